"""Guards on the design: imports flow one way, and the command-line names stay stable."""

import ast
import re
from pathlib import Path

import pytest
from helpers import compose_config

from gptlab.config import to_config

PKG = Path(__file__).resolve().parents[2] / "gptlab"
TESTS = PKG.parent / "tests"
# modules (or packages) that import no other gptlab module but their own package's, errors,
# safe_dcp
LEAVES = ["model.gpt", "model.config", "optim", "perf.measure", "checkpoint", "data",
          "records.layout", "records.store", "records.identity", "records.tracker"]  # fmt: skip
# safe_dcp: torch only; gptlab: the package root (the moved modules' old paths)
ALLOWED_FOR_LEAVES = {"gptlab", "gptlab.errors", "gptlab.checkpoint.safe_dcp"}


def gptlab_imports(path: Path):
    """gptlab modules imported at run time, lazily inside functions too (imports under
    `if TYPE_CHECKING:` are for hints only). `from gptlab import x` yields gptlab.x for a module
    x."""
    tree = ast.parse(path.read_text())
    hints_only = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING"
        for n in ast.walk(node)
    }
    for node in ast.walk(tree):
        if id(node) in hints_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("gptlab"):
            yield node.module
            base = PKG.parent.joinpath(*node.module.split("."))
            for alias in node.names:
                if (base / f"{alias.name}.py").is_file() or (base / alias.name).is_dir():
                    yield f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            yield from (a.name for a in node.names if a.name.startswith("gptlab"))


@pytest.mark.parametrize("leaf", LEAVES)
def test_leaf_modules_import_no_other_gptlab_module(leaf):
    path = PKG.joinpath(*leaf.split("."))
    files = (
        [path.with_suffix(".py")] if path.with_suffix(".py").exists() else sorted(path.glob("*.py"))
    )
    # a module of a package may import its package's modules; a leaf module of a package of layers
    # (model.gpt, perf.measure) only the allowed ones
    own = f"gptlab.{leaf}" if leaf == "perf.measure" else f"gptlab.{leaf.split('.')[0]}"
    assert files, leaf
    for f in files:
        for mod in gptlab_imports(f):
            assert mod in ALLOWED_FOR_LEAVES or mod.startswith(own), f"{f.name} imports {mod}"


def module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph():
    """gptlab module -> the gptlab modules it imports (a package counts as its __init__)."""
    graph = {}
    for path in sorted(PKG.rglob("*.py")):
        graph[module_name(path)] = {m for m in gptlab_imports(path) if m != module_name(path)}
    return graph


def find_cycle(graph):
    """One import cycle as a list of modules (first == last), or None."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


@pytest.mark.integration
def test_no_import_cycle_inside_gptlab():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


@pytest.mark.integration
def test_no_import_loop_between_packages():
    """With each package (records, search, data, evaluation, optim) taken as one node beside the
    top-level modules, imports still only go down."""

    def node(module: str) -> str:
        return module.split(".")[1] if "." in module else module

    graph = {}
    for module, imported in import_graph().items():
        graph.setdefault(node(module), set()).update(
            node(m) for m in imported if node(m) != node(module)
        )
    assert find_cycle(graph) is None, find_cycle(graph)


def test_the_formatter_runs_on_the_package():
    """ruff format lays out gptlab/: at most 5 `# fmt: skip/off` escapes."""
    escapes = [
        f"{path.relative_to(PKG)}:{n}"
        for path in sorted(PKG.rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if "fmt: skip" in line or "fmt: off" in line
    ]
    assert len(escapes) <= 5, escapes


def test_records_call_neither_distributed_nor_slurm():
    """records/ reads and writes records: the claim across ranks lives with training (build.py), and
    what ended a SLURM job is read by the caller that ends a sweep (parent.end's job_error)."""
    for path in sorted((PKG / "records").glob("*.py")):
        used = {m for m in gptlab_imports(path) if m.startswith("gptlab.distributed")}
        assert not used, f"{path.name} imports {sorted(used)}"


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_loop_and_train_stay_thin():
    loop = set(gptlab_imports(PKG / "training" / "loop.py"))
    assert (
        "gptlab.config" not in loop and "gptlab.training.build" not in loop
    )  # the loop sees built objects
    train = set(gptlab_imports(PKG / "train.py"))
    # train.py also asks distributed.py whether this process runs the job or starts its workers
    assert train <= {
        "gptlab.config",
        "gptlab.training.build",
        "gptlab.training.loop",
        "gptlab.cli",
        "gptlab.errors",
        "gptlab",
        "gptlab.distributed",
        "gptlab.distributed.world",
        "gptlab.training",
        "gptlab.console",  # logging set-up (a spawned worker is a fresh process)
        "gptlab.records",
        "gptlab.records.layout",  # where rank 0's results are
        "gptlab.records.runfolder",  # a finished run rerun: nothing to build
    }


# The commands (python -m gptlab.<name>): no other module imports one; shared code lives below them.
ENTRY_MODULES = {f"gptlab.{name}" for name in ("train", "prepare", "sample", "export", "bench",
                                                "plan", "ui", "compare", "sync",
                                                "eval", "scale")}  # fmt: skip


@pytest.mark.integration
def test_no_module_imports_an_entry_module():
    found = [f"{mod} imports {dep}" for mod, deps in import_graph().items() for dep in deps
             if dep in ENTRY_MODULES]  # fmt: skip
    assert not found, "; ".join(found)


def test_the_loop_imports_nothing_from_build():
    assert not {
        m
        for m in gptlab_imports(PKG / "training" / "loop.py")
        if m.startswith("gptlab.training.build")
    }


def string_constants(path: Path):
    """(line, text) of the string constants in a module's code, docstrings left out."""
    tree = ast.parse(path.read_text())
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and n.body and isinstance(n.body[0], ast.Expr)}  # fmt: skip
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            yield node.lineno, node.value


@pytest.mark.integration
def test_the_run_folders_file_names_are_written_in_one_module():
    from gptlab.records import layout

    names = {v for k, v in vars(layout).items() if k.isupper() and isinstance(v, str) and "." in v}
    assert {"metrics.jsonl", "results.json", "slurm.json", "sweep.json", "run.json"} <= names
    home = PKG / "records" / "layout.py"
    found = [f"{path.relative_to(PKG)}:{line} {text!r}"
             for path in sorted(PKG.rglob("*.py")) if path != home
             for line, text in string_constants(path)
             if any(text == n or text.endswith("/" + n) for n in names)]  # fmt: skip
    assert not found, "run-folder file names outside records/layout.py: " + ", ".join(found)


@pytest.mark.integration
def test_a_runs_name_is_computed_in_one_module():
    """records/identity.py names runs; every MLflow run is created with a name it computed."""
    naming = {"run_name", "experiment_name", "sweep_run_name", "base_name", "identify"}
    home = PKG / "records" / "identity.py"
    defined, created = [], []
    for path in sorted(PKG.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name in naming and path != home:
                defined.append(f"{path.relative_to(PKG)}:{node.lineno} {node.name}")
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "create_run":
                name = next((k.value for k in node.keywords if k.arg == "run_name"), None)
                named = isinstance(name, ast.Attribute) and name.attr == "name"
                named = named or "run_name" in ast.unparse(name) if name is not None else False
                if not named:
                    created.append(f"{path.relative_to(PKG)}:{node.lineno}")
    assert not defined, "run naming outside records/identity.py: " + ", ".join(defined)
    assert not created, "MLflow runs created without an identity's name: " + ", ".join(created)


def test_tests_import_their_helpers_from_helpers_not_conftest():
    imports_conftest = re.compile(r"^\s*(from conftest import|import conftest)", re.M)
    found = [str(p.relative_to(TESTS)) for p in sorted(TESTS.rglob("*.py"))
             if imports_conftest.search(p.read_text())]  # fmt: skip
    assert not found, found


FROZEN_OVERRIDES = {
    "train.max_steps": 7,
    "train.batch_size": 16,
    "train.micro_batch_size": 4,
    "train.eval_every": 3,
    "train.eval_steps": 2,
    "train.log_every": 1,
    "train.checkpoint_every": 5,
    "train.seed": 1,
    "train.resume": "never",
    "model.block_size": 16,
    "model.n_layer": 1,
    "model.n_head": 2,
    "model.n_embd": 8,
    "model.dropout": 0.1,
    "data.path": "/tmp/x.txt",
    "optimizer.lr": 0.01,
    "optimizer.warmup_steps": 2,
    "tracking.uri": "http://127.0.0.1:5000",
    "tracking.experiment": "e",
}


@pytest.mark.integration
def test_command_line_override_names_are_frozen():
    cfg = to_config(compose_config([f"{k}={v}" for k, v in FROZEN_OVERRIDES.items()]))
    for key, value in FROZEN_OVERRIDES.items():
        group, name = key.split(".")
        assert getattr(getattr(cfg, group), name) == value, key


# The command-line contract (DESIGN.md): each command is a module with a main() whose docstring is
# its usage.
COMMANDS = (
    "train",
    "prepare",
    "sample",
    "bench",
    "plan",
    "export",
    "ui",
    "compare",
    "sync",
    "eval",
    "scale",
)


@pytest.mark.parametrize("name", COMMANDS)
def test_entry_point_modules_exist(name):
    import ast

    tree = ast.parse((PKG / f"{name}.py").read_text())
    assert (ast.get_docstring(tree) or "").startswith(f"python -m gptlab.{name} "), name
    assert any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body), name
    guard = [n for n in tree.body if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test)]
    assert guard and "main()" in ast.unparse(guard[0]), (
        f"gptlab/{name}.py does not run main() as a module"
    )


# ---- repetition and function length -------------------------------------------------------------

WINDOW = 6  # lines
MAX_FUNCTION_LINES = 60


def shape_lines(path: Path):
    """(line number, the line's shape) for the lines of code that do something.

    A line's shape is its tokens with every name (but keywords), number and string replaced, so two
    blocks that differ only in names and numbers have the same shapes. Left out: imports, comments,
    lines of only brackets or one token, and declarations (dataclass fields `name: type`, and
    `"key": value` entries of dict literals), which are data, not logic. A function's parameters,
    one per line, count: two signatures alike are a sign of one function to share.
    """
    import io
    import keyword
    import tokenize

    keep = set(keyword.kwlist) | {"self"}
    shapes = {}
    for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if tok.type in (tokenize.NAME, tokenize.NUMBER, tokenize.STRING, tokenize.OP):
            word = {tokenize.NUMBER: "0", tokenize.STRING: "S"}.get(tok.type, tok.string)
            if tok.type == tokenize.NAME and tok.string not in keep:
                word = "N"
            shapes.setdefault(tok.start[0], []).append(word)
    for line, words in sorted(shapes.items()):
        text = " ".join(words)
        if words[0] in ("import", "from") or len(words) == 1 or set(words) <= set("()[]{},:"):
            continue
        if words[:2] == ["S", ":"] or (words[:2] == ["N", ":"] and words[-1] != ","):
            continue
        yield line, text


def repeated_blocks(paths):
    """Pairs of non-overlapping WINDOW-line blocks with the same shapes, as 'file:line ==
    file:line'."""
    seen, found = {}, []
    for path in paths:
        lines = list(shape_lines(path))
        for i in range(len(lines) - WINDOW + 1):
            window = tuple(text for _, text in lines[i : i + WINDOW])
            # a run of trivial lines (returns, closing calls) is no block
            if sum(map(len, window)) < 80:
                continue
            here = (path, i, lines[i][0])
            for other in seen.get(window, []):
                if other[0] != path or i - other[1] >= WINDOW:
                    found.append(f"{other[0].name}:{other[2]} == {path.name}:{here[2]}")
            seen.setdefault(window, []).append(here)
    return found


@pytest.mark.integration
def test_no_block_of_code_repeats_inside_gptlab():
    found = repeated_blocks(sorted(PKG.rglob("*.py")))
    assert not found, "repeated blocks (factor them out): " + "; ".join(found)


def test_the_repetition_finder_finds_renamed_copies(tmp_path):
    body = "\n".join(
        f"    total_{i} = compute(alpha_{i}, beta + {i}) * weight[{i}] - offset" for i in range(6)
    )
    (tmp_path / "a.py").write_text(f"def f():\n{body}\n")
    (tmp_path / "b.py").write_text(
        "def g():\n" + body.replace("alpha", "gamma").replace("compute", "other") + "\n"
    )
    assert repeated_blocks([tmp_path / "a.py", tmp_path / "b.py"])
    other = "\n".join(f"    x{i} = [y for y in range({i}) if y]" for i in range(6))
    (tmp_path / "c.py").write_text("def h():\n" + other)
    assert not repeated_blocks([tmp_path / "a.py", tmp_path / "c.py"])


@pytest.mark.integration
def test_no_function_is_longer_than_sixty_lines():
    long = []
    for path in sorted(PKG.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{path.name}:{node.lineno} {node.name} ({n} lines)")
    assert not long, "functions over 60 lines: " + ", ".join(long)


# ---- README states what the code writes --------------------------------------------------------

README = PKG.parent / "README.md"


def _hydra_dir(config: str, mode: str) -> str:
    """conf/<config>.yaml's hydra.<mode>.dir with the timestamp as README writes it."""
    from omegaconf import OmegaConf

    raw = OmegaConf.to_container(OmegaConf.load(PKG.parent / "conf" / f"{config}.yaml"))["hydra"][
        mode
    ]["dir"]
    raw = raw.replace("${paths.outputs}", "outputs")  # conf/paths/default.yaml's root
    return raw.replace("${now:%Y-%m-%d_%H-%M-%S.%f}", "<date>_<time>")


def test_readme_names_the_files_and_folders_the_code_writes():
    from gptlab.checkpoint.state import checkpoint_path
    from gptlab.records.layout import RECORDS

    text = README.read_text()
    whole, sharded = (
        checkpoint_path(Path("c"), 2800).name,
        checkpoint_path(Path("c"), 2800, sharded=True).name,
    )
    assert f"`checkpoints/{whole}`" in text and f"`checkpoints/{sharded}/`" in text
    assert "ckpt_<step>" not in text  # no name that a run folder never holds
    run_dir, bench_dir = _hydra_dir("config", "run"), _hydra_dir("bench", "run")
    assert f"`{run_dir}/`" in text and f"`{bench_dir}/bench.json`" in text
    # the table under "Each run gets a folder"
    table = text.split(f"`{run_dir}/`", 1)[1].split("\n\n", 2)[1]
    listed = {
        row.split("`")[1].split("/")[0] for row in table.splitlines() if row.startswith("| `")
    }
    assert listed and listed <= {".hydra", *RECORDS}, listed - {".hydra", *RECORDS}


# The training, evaluation and checkpoint paths: a tensor they make meets the model's on its device
DEVICE_PATHS = ["training/loop.py", "training/divergence.py", "training/faults.py",
                "optim/muon.py", "optim/lion.py", "optim/average.py",
                "checkpoint/state.py", "training/run.py", "model/inference.py",
                "distributed/world.py", "evaluation/scoring.py", "evaluation/hellaswag.py",
                "evaluation/harness.py"]  # fmt: skip
FACTORIES = {"tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn",
             "randint", "linspace", "eye", "scalar_tensor"}  # fmt: skip


def factories_without_device(source: str):
    """(line, call) of each torch.<factory>(...) that does not name its device."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        owner = node.func.value
        if not (isinstance(owner, ast.Name) and owner.id == "torch"):
            continue
        if node.func.attr in FACTORIES and "device" not in {k.arg for k in node.keywords}:
            found.append((node.lineno, f"torch.{node.func.attr}"))
    return found


@pytest.mark.parametrize("path", DEVICE_PATHS)
def test_tensor_factories_on_the_device_paths_name_their_device(path):
    """A factory without device= makes a CPU tensor: on a GPU it fails where it meets the model's
    (tests/system/test_devices.py runs these paths under a device guard); device="cpu" says it
    is meant."""
    assert factories_without_device((PKG / path).read_text()) == []


def test_the_factory_finder_finds_a_factory_without_a_device():
    code = "torch.tensor(3)\ntorch.zeros(2, device=d)\ntorch.stack([a])\nx.new_zeros(2)\n"
    assert factories_without_device(code) == [(1, "torch.tensor")]


def test_a_module_that_moved_into_a_package_still_imports_by_its_old_path():
    """A user's script or a logged model written against the flat layout keeps working, warned."""
    import importlib
    import sys

    import gptlab
    from gptlab.perf import costs

    for new in gptlab.MOVED.values():
        assert importlib.util.find_spec(new) is not None, new
    sys.modules.pop("gptlab.costs", None)
    with pytest.warns(DeprecationWarning, match="gptlab.costs moved to gptlab.perf.costs"):
        old = importlib.import_module("gptlab.costs")
    assert old is costs
    # the packages that replaced a module of the same name resolve its names
    from gptlab.model import gpt

    with pytest.warns(DeprecationWarning, match="gptlab.model.GPT moved"):
        from gptlab.model import GPT
    assert GPT is gpt.GPT
    from gptlab.model import attention  # a submodule is imported as such, not looked up

    assert attention.__name__ == "gptlab.model.attention"


def test_every_module_and_package_is_named_in_the_architecture_map():
    """docs/ARCHITECTURE.md names each module as its path under gptlab/ (`perf/costs.py`) and each
    package as `name/`: a new module is placed on the map, a moved one moves there too."""
    text = (PKG.parent / "docs" / "ARCHITECTURE.md").read_text()
    named = set(re.findall(r"`([\w/]+(?:\.py|/))`", text))
    missing = [
        str(path.relative_to(PKG))
        for path in sorted(PKG.rglob("*.py"))
        if path.name != "__init__.py" and str(path.relative_to(PKG)) not in named
    ]
    missing += [
        f"{path.relative_to(PKG)}/"
        for path in sorted(PKG.iterdir())
        if (path / "__init__.py").is_file() and f"{path.relative_to(PKG)}/" not in named
    ]
    assert not missing, f"not in docs/ARCHITECTURE.md: {missing}"
    # and nothing it names is gone
    gone = [
        n
        for n in named
        if n.endswith(".py")
        and not n.startswith(("tests/", "hydra_plugins/"))
        and "/" in n
        and not (PKG / n).exists()
    ]
    assert not gone, f"docs/ARCHITECTURE.md names modules that do not exist: {gone}"


def test_the_top_level_keeps_the_commands_and_what_they_share():
    """At most 16 modules beside the packages: the commands, cli, console, config and errors."""
    top = sorted(p.name for p in PKG.glob("*.py"))
    assert len(top) <= 16, top


def test_blind_excepts_are_few_and_each_says_why():
    """A handler of every exception (`except Exception`, `BaseException` or bare) that does not
    raise again: at most 10 in the package, errors.py's helpers (never_fatal, as_user_error,
    or_none) and the few places that give their reason in place."""
    found = []
    for path in sorted(PKG.rglob("*.py")):
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if not isinstance(node, ast.ExceptHandler):
                continue
            blind = node.type is None or (
                isinstance(node.type, ast.Name) and node.type.id in ("Exception", "BaseException")
            )
            reraises = isinstance(node.body[-1], ast.Raise)  # cleans up or translates, then raises
            if blind and not reraises:
                found.append((f"{path.relative_to(PKG)}:{node.lineno}", lines[node.lineno - 1]))
    assert len(found) <= 10, [f for f, _ in found]
    unexplained = [f for f, line in found if "#" not in line]
    assert not unexplained, f"a blind except without its reason: {unexplained}"


def mirrored_names() -> "set[str]":
    """What a file in tests/ may be named for: a top module, a package, <package>_<module>."""
    names = {p.stem for p in PKG.glob("*.py")}
    names |= {p.name for p in PKG.iterdir() if (p / "__init__.py").is_file()}
    return names | {f"{p.parent.name}_{p.stem}" for p in PKG.glob("*/*.py") if p.stem != "__init__"}


PLACEMENT_EXCEPTIONS = "### Test files the rule does not place"


def placement_exceptions() -> "dict[str, str]":
    """docs/testing.md's table of the test files the rule does not place: name -> reason."""
    docs = (PKG.parent / "docs" / "testing.md").read_text()
    section = docs[docs.index(PLACEMENT_EXCEPTIONS) :].split("\n#", 1)[0]
    rows = [line.split("|")[1:-1] for line in section.splitlines() if line.startswith("| `test_")]
    return {cells[0].strip().strip("`"): cells[-1].strip() for cells in rows}


def test_each_test_file_mirrors_a_module_or_is_a_system_test_or_a_documented_exception():
    """tests/test_<package>_<module>.py, tests/test_<package>.py or tests/test_<top module>.py;
    tests/system/test_<behaviour>.py, named for no module, for a whole-system behaviour; at most 5
    other files, each in docs/testing.md's table of exceptions with its reason."""
    names, exceptions = mirrored_names(), placement_exceptions()
    flat = [p.name for p in sorted(TESTS.glob("test_*.py"))]
    unplaced = [f for f in flat if f[5:-3] not in names and f not in exceptions]
    assert not unplaced, f"test files named for no module and not in docs/testing.md: {unplaced}"
    system = [p.name for p in sorted((TESTS / "system").glob("test_*.py"))]
    misplaced = [f for f in system if f[5:-3] in names]
    assert not misplaced, (
        f"named for a module, so they belong in tests/, not tests/system/: {misplaced}"
    )
    stale = [f for f in exceptions if f not in flat or f[5:-3] in names]
    assert not stale, (
        f"docs/testing.md lists as exceptions files the rule places or that are gone: {stale}"
    )
    assert 0 < len(exceptions) <= 5, sorted(exceptions)  # none: the table's heading moved
    assert all(exceptions.values()), f"an exception without its reason: {exceptions}"
    folders = (TESTS, TESTS / "system")
    elsewhere = [
        str(p.relative_to(TESTS)) for p in TESTS.rglob("test_*.py") if p.parent not in folders
    ]
    assert not elsewhere, f"test files outside tests/ and tests/system/: {elsewhere}"


def test_every_docstring_opens_with_a_one_line_summary():
    """A docstring's first paragraph, its summary, fits on its first line; the rest is the body."""
    wrapped = []
    for path in sorted(PKG.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node, clean=False)
                if doc and "\n" in doc.strip().split("\n\n")[0].strip():
                    wrapped.append(f"{path.relative_to(PKG.parent)}:{getattr(node, 'lineno', 1)}")
    assert wrapped == [], f"summaries over more than one line: {wrapped}"
