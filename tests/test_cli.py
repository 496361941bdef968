"""One command-line grammar for every command: Hydra overrides on the command's own root config
(conf/<command>.yaml; train's is conf/config.yaml), the same --help listing its keys, the same
one-line errors, and commands that only read leave nothing behind."""

import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import nano_overrides, run_cli
from omegaconf import OmegaConf

from gptlab.cli import HYDRA_OPTIONS, compose, config_keys, flag_error, hydra_quote, nearest_keys
from gptlab.errors import GptlabError

# command -> (root config, keys of its own that --help and the composed config show)
COMMANDS = {
    "train": ("config", ["train.max_steps", "model.n_layer", "tracking.uri"]),
    "prepare": ("prepare", ["data.name", "data.path", "data.tokenizer.kind"]),
    "bench": ("bench", ["bench.warmup", "bench.steps", "bench.mlflow", "train.micro_batch_size"]),
    "plan": ("plan", ["plan.mfu", "plan.json", "model.n_layer"]),
    "ui": (
        "ui",
        [
            "ui.host",
            "ui.port",
            "ui.workers",
            "ui.allowed_hosts",
            "ui.cors_allowed_origins",
            "tracking.uri",
        ],
    ),
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


@pytest.mark.integration
def test_the_commands_settings_are_overrides():
    bench = compose("bench", ["bench.warmup=0", "bench.steps=2", "bench.mlflow=true"])
    assert (bench.bench.warmup, bench.bench.steps, bench.tracking.mlflow) == (0, 2, True)
    # a benchmark records no MLflow run unless asked
    assert compose("bench").tracking.mlflow is False
    assert compose("plan", ["plan.mfu=0.35", "plan.json=true"]).plan == {"mfu": 0.35, "json": True}
    ui = compose("ui", ["ui.host=0.0.0.0", "ui.port=5001", "ui.workers=2"]).ui
    assert (ui.host, ui.port, ui.workers) == ("0.0.0.0", 5001, 2)
    assert compose("export", ["run=r", "hf=false", "which=best"]).hf is False
    # a training experiment applies under a command's own root config too
    assert compose("plan", ["experiment=gpt1b_shakespeare"]).model.name == "gpt1b"


@pytest.mark.integration
def test_compare_takes_the_target_as_its_first_word():
    assert compose("compare", ["outputs/sweeps/2026-11-30_06-22-48.746659"]).compare.target == (
        "outputs/sweeps/2026-11-30_06-22-48.746659"
    )
    run_id = "0123456789" * 3 + "00"  # digits only: text, not a number
    cfg = compose("compare", [run_id, "compare.out=null", "tracking.uri=sqlite:////tmp/x.db"])
    assert (cfg.compare.target, cfg.compare.out, cfg.tracking.uri) == (
        run_id,
        None,
        "sqlite:////tmp/x.db",
    )
    assert compose("compare", ["compare.target=1e5"]).compare.target == "1e5"


@pytest.mark.parametrize(
    "prompt",
    ["ROMEO:", "\\n", "\n", "true", "1e5", "null", "Hello, world", "€", "it's", "a\\", "'q'", ""],
)
def test_text_keys_are_taken_as_typed(prompt):
    assert compose("sample", ["run=r", f"prompt={prompt}"]).prompt == prompt


@pytest.mark.integration
def test_text_settings_of_ui_keep_commas():
    ui = compose("ui", ["ui.allowed_hosts=mlflow.example.org,mlflow.example.org:*"]).ui
    assert ui.allowed_hosts == "mlflow.example.org,mlflow.example.org:*"
    assert compose("ui", ["ui.allowed_hosts=null"]).ui.allowed_hosts is None


@pytest.mark.parametrize(
    "text", ["plain", "it's", "a\\", "a\\'b", "x\\\\'y", "'", "\\", "a,b", "€", " x "]
)
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
@pytest.mark.integration
def test_in_process_errors_are_one_line(config_name, override, fragment):
    with pytest.raises(GptlabError) as e:
        compose(config_name, [override])
    assert fragment in str(e.value) and "\n" not in str(e.value)


# ---- the real commands --------------------------------------------------------------------------


@pytest.fixture
def main_of(monkeypatch, capsys, tmp_path):
    """`python -m gptlab.<command> ARGS` as its module's main reads the command line, in this
    process and in tmp_path: (exit code, stdout, stderr). The real processes' exit codes and lines
    are the tests below (read-only commands, options and typos, a start that fails)."""
    import importlib

    from hydra.core.global_hydra import GlobalHydra

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)  # run_entry sets it for its process

    def run(command: str, *args: str):
        monkeypatch.setattr(sys, "argv", [f"gptlab/{command}.py", *args])
        capsys.readouterr()
        try:
            importlib.import_module(f"gptlab.{command}").main()
            code = 0
        except SystemExit as e:
            code = e.code
        finally:
            GlobalHydra.instance().clear()  # Hydra's app leaves its own set
        out, err = capsys.readouterr()
        return code, out, err

    return run


@pytest.mark.slow
@pytest.mark.parametrize("command", COMMANDS)
def test_help_lists_the_commands_keys(command, tmp_path):
    r = run_cli([f"gptlab.{command}", "--help"], cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r.stderr
    if command != "train":  # train keeps Hydra's default header (its root is conf/config.yaml)
        assert r.stdout.startswith(f"python -m gptlab.{command} "), r.stdout[:300]
    config = OmegaConf.create(
        r.stdout.split("== Config ==", 1)[1].split("\n", 2)[2].split("Powered by Hydra")[0]
    )
    _, keys = COMMANDS[command]
    assert all(has_key(config, k) for k in keys), [k for k in keys if not has_key(config, k)]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.integration
@pytest.mark.parametrize("command", COMMANDS)
def test_an_unknown_key_is_one_line_and_exit_code_2(command, main_of):
    code, _, err = main_of(command, "no_such_key=1")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith(f"gptlab.{command}: error:") and "no_such_key" in lines[0]


@pytest.mark.slow
@pytest.mark.parametrize(
    "args,code,fragment",
    [
        # a plan that fits (its report is test_plan.py's, in process)
        (["gptlab.plan", "plan.json=true", "plan.mfu=0.3"], 0, None),
        # plan's exit code 2 where a recipe does not fit: test_plan.py's test_plan_cli_gpt1b
        (["gptlab.sample", "run=missing-run", "prompt=ROMEO:"], 2, "missing-run: no such folder"),
        (["gptlab.sample"], 2, "run is missing"),
        (["gptlab.export", "run=missing-run"], 2, "missing-run: no such folder"),
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
        assert (
            len(lines) == 1 and lines[0].startswith(f"{args[0]}: error:") and fragment in lines[0]
        ), r.stderr
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
    from helpers import compose_config

    from gptlab.train import run_training

    run_dir = tmp_path_factory.mktemp("cli-trained") / "run"
    run_training(
        compose_config(nano_overrides(shakespeare, "train.max_steps=10", "train.sample_tokens=0")),
        run_dir,
    )
    return run_dir


@pytest.mark.slow
def test_the_readmes_sample_command_works_as_typed_in_a_shell(trained, tmp_path, capsys):
    """README: python -m gptlab.sample run=outputs/runs/my-run prompt="ROMEO:" max_new_tokens=300
    ..."""
    from gptlab import sample

    line = (
        f"{shlex.quote(sys.executable)} -m gptlab.sample run={shlex.quote(str(trained))} "
        'prompt="ROMEO:" max_new_tokens=300 temperature=0.8 top_k=200'
    )
    r = subprocess.run(
        ["bash", "-c", line], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("ROMEO:") and len(r.stdout.rstrip("\n")) >= 300
    assert list(tmp_path.iterdir()) == []
    # a newline prompt typed as $'\n', and text that Hydra alone would read as a bool or a sweep:
    # the words the shell makes of each, read by the command's own main in this process
    for prompt in ("$'\\n'", "true", "'ROMEO, JULIET:'"):
        words = f"run={shlex.quote(str(trained))} max_new_tokens=5 prompt={prompt}"
        argv = subprocess.run(
            ["bash", "-c", f"printf '%s\\0' {words}"], capture_output=True, text=True, check=True
        ).stdout.split("\0")[:-1]
        capsys.readouterr()
        sample.main(argv)
        out = capsys.readouterr().out
        expected = subprocess.run(
            ["bash", "-c", f"printf %s {prompt}"], capture_output=True, text=True
        ).stdout
        assert out.startswith(expected), (prompt, out)


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
    assert [x["micro_batch_size"] for x in results] == [2, 4] and all(
        x["timed_steps"] == 2 for x in results
    )
    assert (sweep / "sweep.json").is_file() == mlflow
    assert (tmp_path / "outputs" / "mlflow.db").is_file() == mlflow
    if not mlflow:
        assert len(lines) == 2, r.stdout  # stdout is the JSON lines and nothing else
    assert sorted(p.name for p in tmp_path.iterdir()) == (
        ["outputs", "sweep"] if mlflow else ["sweep"]
    )


# ---- options where a key is expected, mistyped keys and choices ----------------------------------


def test_hydras_own_options_are_the_ones_cli_lets_through():
    # the test may read Hydra's internals; gptlab does not
    from hydra._internal.utils import get_args_parser

    ours = set(HYDRA_OPTIONS)
    assert ours == {o for action in get_args_parser()._actions for o in action.option_strings}


@pytest.mark.parametrize(
    "args",
    [
        ["--help"], ["-h"], ["--hydra-help"], ["--version"], ["--cfg", "job"], ["-c", "job"],
        ["--cfg=job"], ["-cjob"], ["--resolve", "--cfg", "job"], ["--cfg", "job", "-p", "model"],
        ["--package=model"], ["--run"], ["-r"], ["-m", "model=gpt_nano,gpt_char"], ["--multirun"],
        ["--multi"], ["--shell-completion", "install=bash"], ["-sc", "install=bash"],
        ["--config-path", "/x"], ["-cp", "/x"], ["--config-name", "bench"], ["-cn", "bench"],
        ["--config-dir", "/x"], ["-cd", "/x"], ["--experimental-rerun", "/x/config.pickle"],
        ["--info"], ["--info", "searchpath"], ["-i", "defaults"],
        ["model=gpt_nano", "--", "--not-read"],
    ],
)  # fmt: skip
def test_hydras_options_are_not_taken_for_mistyped_keys(args):
    assert flag_error("config", "train", args) is None


@pytest.mark.parametrize(
    "config_name,args,fragment",
    [
        ("bench", ["--steps", "3"], "bench.steps=3, not --steps 3"),
        ("bench", ["--steps=3"], "bench.steps=3, not --steps=3"),
        ("config", ["--lr", "1e-3", "model=gpt_nano"], "optimizer.lr=1e-3, not --lr 1e-3"),
        ("config", ["--lr"], "optimizer.lr=..., not --lr"),
        ("config", ["--steps", "10"], "train.max_steps=10, not --steps 10"),
        (
            "config",
            ["--model"],
            "model=NAME (one of gpt1b, gpt2_124m, gpt2_1558m, gpt2_350m, gpt2_774m, gpt_char, ",
        ),
        ("config", ["--model", "gpt_nano"], "model=gpt_nano, not --model gpt_nano"),
        ("config", ["--n-head", "4"], "model.n_head=4, not --n-head 4"),
        ("plan", ["--mfu", "0.3"], "plan.mfu=0.3, not --mfu 0.3"),
        ("sample", ["--temperature", "0.5"], "temperature=0.5, not --temperature 0.5"),
        ("config", ["--multirn"], "--multirun, not --multirn"),
        ("config", ["--zzzz"], "no key is like --zzzz"),
    ],
)
def test_an_option_where_a_key_is_expected_names_the_key(config_name, args, fragment):
    with pytest.raises(GptlabError) as e:
        compose(config_name, args)
    message = str(e.value)
    assert message.startswith("settings are key=value, not options: ") and fragment in message, (
        message
    )
    assert "\n" not in message and "usage:" not in message


@pytest.mark.parametrize(
    "config_name,override,message",
    [
        ("config", "train.max_step=10",
         "train.max_step: no such key; did you mean train.max_steps=10?"),
        ("config", "trian.max_steps=10",
         "trian.max_steps: no such key; did you mean train.max_steps=10?"),
        ("config", "model.n_heads=4", "model.n_heads: no such key; did you mean model.n_head=4?"),
        ("config", "modle=gpt_nano", "modle: no such key; did you mean model=gpt_nano?"),
        ("config", "train.sed=1", "train.sed: no such key; did you mean train.seed=1?"),
        ("bench", "bench.stepz=3", "bench.stepz: no such key; did you mean bench.steps=3?"),
        ("sample", "temprature=0.5", "temprature: no such key; did you mean temperature=0.5?"),
        ("config", "hydra.run.dirr=x",
         "hydra.run.dirr: no such key; did you mean hydra.run.dir=x?"),
        # no key is close: `+` is offered only where it works, in a section without a schema
        ("config", "expected.val_los=1.5",
         "expected.val_los: no such key; to add it to the free-form section, "
         "give +expected.val_los=1.5"),
        ("config", "no_such_key=1", "no_such_key: no such key in gptlab.train's config "
                                    "(python -m gptlab.train --help lists the keys)"),
        ("config", "model=gpt_tiny",
         "model=gpt_tiny: no such choice; choose one of gpt1b, gpt2_124m, gpt2_1558m, "
         "gpt2_350m, gpt2_774m, gpt_char, gpt_nano"),
        ("config", "optimizer=adam",
         "optimizer=adam: no such choice; choose one of adamw, lion, muon"),
        # optional groups: Hydra would say nothing and run the default job
        ("config", "experiment=shakespeare_char_bby",
         "experiment=shakespeare_char_bby: no such choice; did you mean "
         "experiment=shakespeare_char_baby? choose one of bpe_25m, gpt1b_shakespeare, "
         "gpt2_124m_fineweb_edu, gpt2_124m_gutenberg, gpt2_finetune_shakespeare, gpt_2b7_fsdp, "
         "shakespeare_char_baby"),
        ("config", "debug=smok",
         "debug=smok: no such choice; did you mean debug=smoke? choose one of smoke"),
        ("config", "hparams_search=default_job,defualt_job",
         "hparams_search=defualt_job: no such choice; did you mean hparams_search=default_job? "
         "choose one of default_job, gpt2_124m, lr_transfer, lr_warmup, mixture_weights"),
        ("config", "local=defualt",
         "local=defualt: no such choice; choose one of cost_example, slurm_example"),
        # the same name in another section; a Hydra Optuna sweeper's key
        ("config", "train.precision=auto",
         "train.precision: no such key; did you mean hardware.precision=auto?"),
        ("config", "hydra.sweeper.n_trials=6",
         "hydra.sweeper.n_trials: no such key; did you mean hparams_search.n_trials=6?"),
    ],
)  # fmt: skip
@pytest.mark.integration
def test_a_mistyped_key_or_choice_gets_the_nearest_key_or_the_choices(
    config_name, override, message
):
    with pytest.raises(GptlabError) as e:
        compose(
            config_name,
            ["model=gpt_nano", override] if override.startswith("model.") else [override],
        )
    assert str(e.value) == message


def test_keys_are_suggested_from_the_commands_own_schema():
    keys, groups = config_keys("ui")
    assert nearest_keys("prot", keys, groups) == ["ui.port"]
    # equally likely: all of them
    assert nearest_keys("seed", keys, groups) == ["data.seed", "train.seed", "hparams_search.seed"]
    assert nearest_keys("heads", keys, groups) == ["model.n_head"]
    assert nearest_keys("expected.x", keys, groups) == []  # never the section above the key


@pytest.mark.slow
@pytest.mark.parametrize(
    "args,fragment",
    [
        (["gptlab.bench", "--steps", "3", "model=gpt_nano"], "bench.steps=3, not --steps 3"),
        (["gptlab.train", "--lr", "1e-3"], "optimizer.lr=1e-3, not --lr 1e-3"),
        (["gptlab.train", "--steps", "10"], "train.max_steps=10, not --steps 10"),
        (["gptlab.prepare", "--model=gpt_nano"], "model=gpt_nano, not --model=gpt_nano"),
        (["gptlab.train", "train.max_step=10"], "did you mean train.max_steps=10?"),
        (["gptlab.train", "model=gpt_tiny"], "choose one of gpt1b, gpt2_124m"),
        (["gptlab.train", "experiment=shakespeare_char_bby"], "experiment=shakespeare_char_baby?"),
        (["gptlab.train", "-m", "hparams_search=defualt_job"], "hparams_search=default_job?"),
        (["gptlab.plan", "-m", "--cfg", "job"], "Only one of --run, --multirun"),
    ],
)
def test_options_and_typos_are_one_line_from_the_command(args, fragment, tmp_path):
    r = run_cli(args, cwd=tmp_path, timeout=120)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0].startswith(f"{args[0]}: error: ") and fragment in lines[0], lines[0]
    assert "search path" not in lines[0].lower() and "+train" not in lines[0]
    assert list(tmp_path.iterdir()) == []


# ---- a start that fails leaves nothing behind --------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra,fragment",
    [
        (["model.n_head=5"], "model.n_head=5"),
        (["optimizer.lr=-1"], "optimizer.lr"),
        (["data.path={missing}"], "no such file"),
        (["train.resume={missing}"], "no such file"),  # after the run folder's lock was taken
        (["hardware=cpu_x2", "data.path={missing}"], "no such file"),  # a worker said it
    ],
)
def test_a_start_that_fails_before_training_leaves_no_run_folder(
    extra, fragment, shakespeare, tmp_path
):
    missing = tmp_path / "missing.txt"
    extra = [e.format(missing=missing) for e in extra]
    args = ["gptlab.train", *nano_overrides(shakespeare, "train.max_steps=2", *extra)]
    r = run_cli([*args, f"hydra.run.dir={tmp_path / 'runs' / 'a'}"], cwd=tmp_path, timeout=180)
    assert r.returncode == 2 and fragment in r.stderr, r.stderr
    assert list(tmp_path.iterdir()) == []  # no runs/a, no empty runs/ either
    if extra == [f"data.path={missing}"]:  # one line naming the file (test_config's bad overrides)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("gptlab.train: error: "), r.stderr
        assert str(missing) in lines[0] and "Traceback" not in r.stderr
    # the default run folder, outputs/runs/<time>/, goes with its parents
    if extra == ["model.n_head=5"]:
        r = run_cli(args, cwd=tmp_path, timeout=120)
        assert r.returncode == 2 and r.stderr.startswith("gptlab.train: error: model.n_embd"), (
            r.stderr
        )
        assert list(tmp_path.iterdir()) == []
        r = run_cli(
            ["gptlab.bench", "model=gpt_nano", f"data.path={shakespeare}", "model.n_head=5"],
            cwd=tmp_path,
        )
        assert r.returncode == 2 and r.stderr.startswith("gptlab.bench: error: model.n_embd"), (
            r.stderr
        )
        assert list(tmp_path.iterdir()) == []  # nor outputs/bench/<time>/


def _files(folder: Path) -> dict:
    return {
        str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
    }


@pytest.mark.slow
def test_a_failed_start_in_a_folder_that_holds_a_run_removes_nothing(
    trained, shakespeare, tmp_path
):
    run_dir = tmp_path / "run"
    shutil.copytree(trained, run_dir)
    before = _files(run_dir)
    assert {"results.json", "metrics.jsonl"} <= set(before) and any(
        k.startswith("checkpoints/") for k in before
    )
    args = [
        "gptlab.train",
        *nano_overrides(shakespeare, "model.n_head=5", f"hydra.run.dir={run_dir}"),
    ]
    r = run_cli(args, cwd=tmp_path, timeout=120)
    assert r.returncode == 2 and "model.n_head=5" in r.stderr, r.stderr
    after = _files(run_dir)
    # every file of the run, as it was
    assert {k: v for k, v in after.items() if k in before} == before
    # what Hydra writes for any start (.hydra/, the log), and nothing was removed
    assert set(after) - set(before) <= {
        ".hydra/config.yaml",
        ".hydra/hydra.yaml",
        ".hydra/overrides.yaml",
        "train.log",
    }


@pytest.mark.slow
def test_a_sweeps_job_that_fails_validation_leaves_no_job_folder(shakespeare, tmp_path):
    sweep = tmp_path / "sweep"
    args = nano_overrides(
        shakespeare, "train.max_steps=1", "train.sample_tokens=0", "model.n_head=4,5"
    )
    r = run_cli(
        ["gptlab.train", "-m", *args, f"hydra.sweep.dir={sweep}"], cwd=tmp_path, timeout=300
    )
    assert "gptlab.train: error: model.n_embd: 32 is not divisible by model.n_head=5" in r.stderr, (
        r.stderr
    )
    assert (sweep / "0" / "results.json").is_file() and not (sweep / "1").exists()
