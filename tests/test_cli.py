"""One command-line grammar for every command: Hydra overrides on the command's own root config
(conf/<command>.yaml; train's is conf/config.yaml), the same --help listing its keys, the same
one-line errors, and commands that only read leave nothing behind."""

import json
import shlex
import subprocess
import sys

import pytest
from conftest import nano_overrides, run_cli
from omegaconf import OmegaConf

from gptlab.cli import compose, hydra_quote
from gptlab.errors import GptlabError

# command -> (root config, keys of its own that --help and the composed config show)
COMMANDS = {
    "train": ("config", ["train.max_steps", "model.n_layer", "tracking.uri"]),
    "prepare": ("prepare", ["data.name", "data.path", "data.tokenizer.kind"]),
    "bench": ("bench", ["bench.warmup", "bench.steps", "bench.mlflow", "train.micro_batch_size"]),
    "plan": ("plan", ["plan.mfu", "plan.json", "model.n_layer"]),
    "ui": ("ui", ["ui.host", "ui.port", "ui.workers", "ui.allowed_hosts", "ui.cors_allowed_origins", "tracking.uri"]),
    "compare": ("compare", ["compare.target", "compare.out", "tracking.uri"]),
    "sample": ("sample", ["run", "prompt", "max_new_tokens", "temperature", "top_k", "which"]),
    "export": ("export", ["run", "out", "which", "hf"]),
    "sync": ("sync", ["sync.folders", "tracking.uri"]),
}
READ_ONLY = ["plan", "ui", "compare", "sample", "export", "prepare"]


def has_key(cfg, key: str) -> bool:
    parent, _, leaf = key.rpartition(".")
    node = OmegaConf.select(cfg, parent) if parent else cfg
    return node is not None and leaf in list(node)  # (`in` is False for a mandatory ??? key)


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_composes_its_own_root_config(command):
    config_name, keys = COMMANDS[command]
    cfg = compose(config_name)
    assert all(has_key(cfg, k) for k in keys), [k for k in keys if not has_key(cfg, k)]


def test_the_commands_settings_are_overrides():
    bench = compose("bench", ["bench.warmup=0", "bench.steps=2", "bench.mlflow=true"])
    assert (bench.bench.warmup, bench.bench.steps, bench.tracking.mlflow) == (0, 2, True)
    assert compose("bench").tracking.mlflow is False  # a benchmark records no MLflow run unless asked
    assert compose("plan", ["plan.mfu=0.35", "plan.json=true"]).plan == {"mfu": 0.35, "json": True}
    ui = compose("ui", ["ui.host=0.0.0.0", "ui.port=5001", "ui.workers=2"]).ui
    assert (ui.host, ui.port, ui.workers) == ("0.0.0.0", 5001, 2)
    assert compose("export", ["run=r", "hf=false", "which=best"]).hf is False
    # a training experiment applies under a command's own root config too
    assert compose("plan", ["experiment=gpt1b_shakespeare"]).model.name == "gpt1b"


def test_compare_takes_the_target_as_its_first_word():
    assert compose("compare", ["outputs/sweeps/2026-11-30_06-22-48.746659"]).compare.target == (
        "outputs/sweeps/2026-11-30_06-22-48.746659"
    )
    run_id = "0123456789" * 3 + "00"  # digits only: text, not a number
    cfg = compose("compare", [run_id, "compare.out=null", "tracking.uri=sqlite:////tmp/x.db"])
    assert (cfg.compare.target, cfg.compare.out, cfg.tracking.uri) == (run_id, None, "sqlite:////tmp/x.db")
    assert compose("compare", ["compare.target=1e5"]).compare.target == "1e5"


@pytest.mark.parametrize(
    "prompt", ["ROMEO:", "\\n", "\n", "true", "1e5", "null", "Hello, world", "€", "it's", "a\\", "'q'", ""]
)
def test_text_keys_are_taken_as_typed(prompt):
    assert compose("sample", ["run=r", f"prompt={prompt}"]).prompt == prompt


def test_text_settings_of_ui_keep_commas():
    ui = compose("ui", ["ui.allowed_hosts=mlflow.example.org,mlflow.example.org:*"]).ui
    assert ui.allowed_hosts == "mlflow.example.org,mlflow.example.org:*"
    assert compose("ui", ["ui.allowed_hosts=null"]).ui.allowed_hosts is None


@pytest.mark.parametrize("text", ["plain", "it's", "a\\", "a\\'b", "x\\\\'y", "'", "\\", "a,b", "€", " x "])
def test_hydra_quote_reads_back_exactly(text):
    from hydra.core.override_parser.overrides_parser import OverridesParser

    assert OverridesParser.create().parse_override(f"k={hydra_quote(text)}").value() == text


@pytest.mark.parametrize(
    "config_name,override,fragment",
    [
        ("bench", "bench.stepz=3", "bench.stepz"),
        ("bench", "bench.steps=many", "bench.steps"),
        ("plan", "plan.mfu=abc", "plan.mfu"),
        ("ui", "ui.port=abc", "ui.port"),
        ("sample", "temprature=0.5", "temprature"),
        ("ui", "outputs", "Error parsing override 'outputs'"),
    ],
)
def test_in_process_errors_are_one_line(config_name, override, fragment):
    with pytest.raises(GptlabError) as e:
        compose(config_name, [override])
    assert fragment in str(e.value) and "\n" not in str(e.value)


# ---- the real commands --------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("command", COMMANDS)
def test_help_lists_the_commands_keys(command, tmp_path):
    r = run_cli([f"gptlab.{command}", "--help"], cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r.stderr
    if command != "train":  # train keeps Hydra's default header (its root is conf/config.yaml)
        assert r.stdout.startswith(f"python -m gptlab.{command} "), r.stdout[:300]
    config = OmegaConf.create(r.stdout.split("== Config ==", 1)[1].split("\n", 2)[2].split("Powered by Hydra")[0])
    _, keys = COMMANDS[command]
    assert all(has_key(config, k) for k in keys), [k for k in keys if not has_key(config, k)]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
@pytest.mark.parametrize("command", COMMANDS)
def test_an_unknown_key_is_one_line_and_exit_code_2(command, tmp_path):
    r = run_cli([f"gptlab.{command}", "no_such_key=1"], cwd=tmp_path, timeout=120)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0].startswith(f"gptlab.{command}: error:") and "no_such_key" in lines[0]


@pytest.mark.slow
@pytest.mark.parametrize(
    "args,code,fragment",
    [
        (["gptlab.plan", "model=gpt_nano"], 0, None),
        (["gptlab.plan", "plan.json=true", "plan.mfu=0.3"], 0, None),
        (["gptlab.plan", "experiment=gpt1b_shakespeare", "parallelism.activation_checkpointing=false"], 2, "would fit"),
        (["gptlab.sample", "run=missing-run", "prompt=ROMEO:"], 2, "no checkpoint found"),
        (["gptlab.sample"], 2, "run is missing"),
        (["gptlab.export", "run=missing-run"], 2, "no checkpoint found"),
        (["gptlab.compare", "no-such-sweep"], 2, "no MLflow store"),
        (["gptlab.ui"], 2, "no MLflow store"),
        (["gptlab.sync", "no-such-run"], 2, "no-such-run: no such folder"),
        (["gptlab.sync"], 2, "no run folders under outputs/runs or outputs/sweeps"),
        (["gptlab.plan", "--cfg", "job"], 0, None),
    ],
)
def test_read_only_commands_leave_nothing_in_the_folder(args, code, fragment, tmp_path):
    r = run_cli(args, cwd=tmp_path, timeout=120)
    assert r.returncode == code, r.stderr
    if fragment:
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"{args[0]}: error:") and fragment in lines[0], r.stderr
    if "plan.json=true" in args:
        assert json.loads(r.stdout)["expected_mfu"] == 0.3
    assert list(tmp_path.iterdir()) == []  # no outputs/, .hydra/ or log file


@pytest.mark.slow
def test_prepare_writes_only_the_data_cache(shakespeare, tmp_path):
    work, cache = tmp_path / "work", tmp_path / "cache"
    work.mkdir()
    r = run_cli(
        ["gptlab.prepare", f"data.path={shakespeare}", "data.progress=false"],
        cwd=work,
        env_extra={"GPTLAB_CACHE_DIR": str(cache)},
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1])["vocab_size"] == 65
    assert list(work.iterdir()) == [] and (cache / "tokens").is_dir()


@pytest.fixture(scope="module")
def trained(tmp_path_factory, shakespeare):
    from conftest import compose_config

    from gptlab.train import run_training

    run_dir = tmp_path_factory.mktemp("cli-trained") / "run"
    run_training(compose_config(nano_overrides(shakespeare, "train.max_steps=10", "train.sample_tokens=0")), run_dir)
    return run_dir


@pytest.mark.slow
def test_the_readmes_sample_command_works_as_typed_in_a_shell(trained, tmp_path):
    """README: python -m gptlab.sample run=outputs/runs/my-run prompt="ROMEO:" max_new_tokens=300 ..."""
    line = (
        f"{shlex.quote(sys.executable)} -m gptlab.sample run={shlex.quote(str(trained))} "
        'prompt="ROMEO:" max_new_tokens=300 temperature=0.8 top_k=200'
    )
    r = subprocess.run(["bash", "-c", line], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("ROMEO:") and len(r.stdout.rstrip("\n")) >= 300
    assert list(tmp_path.iterdir()) == []
    # a newline prompt typed as $'\n', and text that Hydra alone would read as a bool or a sweep
    for prompt in ("$'\\n'", "true", "'ROMEO, JULIET:'"):
        line = f"{shlex.quote(sys.executable)} -m gptlab.sample run={shlex.quote(str(trained))} max_new_tokens=5 "
        line += f"prompt={prompt}"
        r = subprocess.run(["bash", "-c", line], cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        expected = subprocess.run(["bash", "-c", f"printf %s {prompt}"], capture_output=True, text=True).stdout
        assert r.stdout.startswith(expected), (prompt, r.stdout)


@pytest.mark.slow
@pytest.mark.parametrize("mlflow", [False, True])
def test_a_bench_sweep_prints_one_json_line_per_job(shakespeare, tmp_path, mlflow):
    """A plain bench sweep makes no MLflow parent run; with bench.mlflow=true it does."""
    sweep = tmp_path / "sweep"
    r = run_cli(
        [
            "gptlab.bench",
            "-m",
            "model=gpt_nano",
            f"data.path={shakespeare}",
            "train.batch_size=4",
            "train.micro_batch_size=2,4",
            "bench.warmup=0",
            "bench.steps=2",
            f"bench.mlflow={str(mlflow).lower()}",
            f"hydra.sweep.dir={sweep}",
        ],
        cwd=tmp_path,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.strip().splitlines()
    results = [json.loads(line) for line in lines if line.startswith("{")]
    assert [x["micro_batch_size"] for x in results] == [2, 4] and all(x["timed_steps"] == 2 for x in results)
    assert (sweep / "sweep.json").is_file() == mlflow
    assert (tmp_path / "outputs" / "mlflow.db").is_file() == mlflow
    if not mlflow:
        assert len(lines) == 2, r.stdout  # stdout is the JSON lines and nothing else
    assert sorted(p.name for p in tmp_path.iterdir()) == (["outputs", "sweep"] if mlflow else ["sweep"])
