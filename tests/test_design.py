"""Guards on the design: imports flow one way, and the command-line names stay stable."""

import ast
from pathlib import Path

import pytest
from conftest import compose_config

from gptlab.config import to_config

PKG = Path(__file__).resolve().parents[1] / "gptlab"
LEAVES = ["model", "optim", "tracking", "metrics", "checkpoint", "data"]
ALLOWED_FOR_LEAVES = {"gptlab.errors"}


def gptlab_imports(path: Path):
    """gptlab modules imported at run time, lazily inside functions too (imports under
    `if TYPE_CHECKING:` are for hints only). `from gptlab import x` yields gptlab.x for a module x."""
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
    files = [PKG / f"{leaf}.py"] if (PKG / f"{leaf}.py").exists() else sorted((PKG / leaf).glob("*.py"))
    for f in files:
        for mod in gptlab_imports(f):
            assert mod in ALLOWED_FOR_LEAVES or mod.startswith(f"gptlab.{leaf}"), f"{f.name} imports {mod}"


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


def test_no_import_cycle_inside_gptlab():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_loop_and_train_stay_thin():
    loop = set(gptlab_imports(PKG / "loop.py"))
    assert "gptlab.config" not in loop and "gptlab.build" not in loop  # the loop sees built objects
    train = set(gptlab_imports(PKG / "train.py"))
    # train.py also asks distributed.py whether this process runs the job or starts its workers
    assert train <= {
        "gptlab.config",
        "gptlab.build",
        "gptlab.loop",
        "gptlab.cli",
        "gptlab.errors",
        "gptlab",
        "gptlab.distributed",
    }


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


def test_command_line_override_names_are_frozen():
    cfg = to_config(compose_config([f"{k}={v}" for k, v in FROZEN_OVERRIDES.items()]))
    for key, value in FROZEN_OVERRIDES.items():
        group, name = key.split(".")
        assert getattr(getattr(cfg, group), name) == value, key


def test_entry_point_modules_exist():
    assert (PKG / "train.py").is_file()
