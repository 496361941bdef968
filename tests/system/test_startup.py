"""Every command answers at once: --help and config errors import none of torch, MLflow or Optuna.

The schema is torch-free (gptlab/config/) and each command imports its heavy
modules inside the function that first needs them, after the config is validated. One subprocess
runs every command's main in process on --help, a mistyped key and a bad value, then looks at
sys.modules; one runs the real `python -X importtime -m gptlab.train --help`.
"""

import json
import subprocess
import sys
import textwrap

import pytest

HEAVY = ("torch", "mlflow", "optuna")

# command -> (a mistyped key, the key its message suggests, a bad value's words, the key it names)
CASES = {
    "train": ("train.max_step=10", "train.max_steps", ["optimizer.lr=-1"], "optimizer.lr"),
    "bench": (
        "bench.step=2",
        "bench.steps",
        ["train.batch_size=7", "hardware=cpu_x2"],
        "train.batch_size",
    ),
    "compare": (
        "compare.metrc=bpb",
        "compare.metric",
        ["x", "compare.metric=nats"],
        "compare.metric",
    ),
    "eval": (
        "eval.limt=3",
        "eval.limit",
        ["run=/nowhere", "tasks=[x]", "eval.precision=fp16"],
        "eval.precision",
    ),
    "export": (
        "whihc=best",
        "which",
        ["run=/nowhere", "export.register=bad/name"],
        "export.register",
    ),
    "plan": ("plan.mfuu=0.4", "plan.mfu", ["hardware.device=tpu"], "hardware.device"),
    "prepare": ("data.pth=x", "data.path", ["data.val_fraction=2"], "data.val_fraction"),
    "sample": ("max_new_token=5", "max_new_tokens", ["run=/nowhere", "top_k=many"], "top_k"),
    "sync": ("sync.folder=[a]", "sync.folders", ["model.n_head=0"], "model.n_head"),
    "ui": ("ui.prot=5001", "ui.port", ["tracking.flush_every=0"], "tracking.flush_every"),
    "scale": ("scale.bootstrp=9", "scale.bootstrap", ["x.csv", "scale.seed=one"], "scale.seed"),
}

# Runs each command's main() as `python -m gptlab.<name> ARGS` would, in one process; prints one
# JSON object: the failures, and the heavy modules imported by the end.
SCRIPT = textwrap.dedent(
    """
    import contextlib, importlib, io, json, os, sys

    cases, heavy = json.loads(sys.argv[1]), sys.argv[2].split(",")
    failures = []

    def run(name, args, code, fragment):
        os.environ["HYDRA_FULL_ERROR"] = "0"  # run_entry sets it to 1 for Hydra; the user's is 0
        sys.argv = [f"gptlab.{name}", *args]
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                importlib.import_module(f"gptlab.{name}").main()
                got = None
            except SystemExit as e:
                got = e.code
        text = out.getvalue() + err.getvalue()
        if got != code or fragment not in text:
            failures.append(f"gptlab.{name} {' '.join(args)}: exit {got}, want {code} and "
                            f"{fragment!r} in: {text[-300:]!r}")

    for name, (typo, suggested, bad, named) in cases.items():
        run(name, ["--help"], 0, f"gptlab.{name}")
        run(name, [typo], 2, f"did you mean {suggested}=")
        run(name, bad, 2, named)
    print(json.dumps({"failures": failures, "heavy": [m for m in heavy if m in sys.modules]}))
    """
)


@pytest.mark.slow  # Hydra's --help of ten commands: seconds each
def test_help_and_config_errors_import_no_heavy_module(tmp_path):
    # in a folder of its own: a config error of train/bench starts (and removes) a run folder
    r = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps(CASES), ",".join(HEAVY)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    found = json.loads(r.stdout.strip().splitlines()[-1])
    assert found["failures"] == [], "\n".join(found["failures"])
    assert found["heavy"] == [], f"imported on the start-up path: {found['heavy']}"
    assert not any(tmp_path.iterdir()), list(tmp_path.iterdir())  # the failed starts left nothing


@pytest.mark.integration
def test_train_help_imports_no_heavy_module():
    r = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "gptlab.train", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "python -m gptlab.train" in r.stdout
    # importtime's lines: "import time: self | cumulative | <indent>module"
    modules = {line.rsplit("|", 1)[1].strip() for line in r.stderr.splitlines() if "|" in line}
    assert "gptlab.config" in modules  # the import-time report was read
    assert not [m for m in HEAVY if m in modules], sorted(m for m in modules if m in HEAVY)


@pytest.mark.integration
def test_the_training_path_imports_neither_mlflow_nor_sharded_checkpoints():
    """A run with tracking off, and a whole-file checkpoint's reader, never pay for MLflow (its
    pyfunc model's base class), DCP or DTensor at start-up: a second or more per process each."""
    later = ("mlflow", "torch.distributed.checkpoint", "torch.distributed.tensor")
    code = (
        "import sys, gptlab.training.build, gptlab.checkpoint.state, gptlab.registry.serving; "
        f"print([m for m in {later!r} if m in sys.modules])"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "[]"
