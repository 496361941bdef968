"""Real multi-process data parallelism: gloo on the CPU, started by gptlab itself or by torchrun."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import run_cli

COMMON = [
    "model=gpt_nano",
    "train.max_steps=8",
    "train.batch_size=8",
    "train.log_every=1",
    "train.eval_every=4",
    "train.eval_steps=2",
    "tracking.mlflow=false",
    "train.sample_tokens=0",
    "model.dropout=0.0",
]


def losses(cwd: Path):
    (run_dir,) = [p for p in (cwd / "outputs" / "runs").iterdir() if (p / "results.json").exists()]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["train_loss"] for r in rows if "train_loss" in r], [r["val_loss"] for r in rows if "val_loss" in r]


@pytest.mark.slow
def test_two_gloo_processes_match_one_process(tmp_path, shakespeare):
    """Same global batch on 1 process and on 2 (spawned by gptlab, or by torchrun, and with gradient
    accumulation, where DDP must all-reduce on the last micro-step only): same losses."""
    args = [*COMMON, f"data.path={shakespeare}"]
    runs = {
        "cpu": [sys.executable, "-m", "gptlab.train", *args, "hardware=cpu"],
        "spawn": [sys.executable, "-m", "gptlab.train", *args, "hardware=cpu_x2"],
        "torchrun": [
            str(Path(sys.executable).parent / "torchrun"),
            "--nproc_per_node=2",
            "-m",
            "gptlab.train",
            *args,
            "hardware=cpu_x2",
        ],
        "spawn_accum": [sys.executable, "-m", "gptlab.train", *args, "hardware=cpu_x2", "train.micro_batch_size=2"],
    }
    out = {}
    for name, cmd in runs.items():
        cwd = tmp_path / name
        cwd.mkdir()
        r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, f"{name}: {r.stderr[-3000:]}"
        out[name] = losses(cwd)
        if name != "cpu":
            split = "= 2 x 2 accum x 2 ranks" if name == "spawn_accum" else "= 4 x 1 accum x 2 ranks"
            assert "x2" in r.stdout and split in r.stdout
            # one run folder, rank 0's: other ranks leave nothing behind
            assert len(list((cwd / "outputs" / "runs").iterdir())) == 1
    ref_train, ref_val = out["cpu"]
    assert len(ref_train) == 8
    for name in ("spawn", "torchrun", "spawn_accum"):
        train, val = out[name]
        assert train == pytest.approx(ref_train, abs=1e-5), name
        assert val == pytest.approx(ref_val, abs=1e-5), name


def _wait_for(pred, timeout, what):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pred():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.slow
def test_a_killed_worker_ends_the_whole_job_naming_the_rank(tmp_path, shakespeare):
    cmd = [
        sys.executable,
        "-m",
        "gptlab.train",
        "model=gpt_nano",
        f"data.path={shakespeare}",
        "hardware=cpu_x2",
        "train.max_steps=1000000",
        "train.log_every=1",
        "tracking.mlflow=false",
        "parallelism.timeout_s=30",
    ]
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        metrics = lambda: list((tmp_path / "outputs").rglob("metrics.jsonl"))  # noqa: E731
        _wait_for(lambda: metrics() and len(metrics()[0].read_text().splitlines()) >= 3, 120, "training to start")
        # the spawned ranks, in start order (the resource tracker is not one of them)
        workers = sorted(
            (p for p in psutil.Process(proc.pid).children() if "spawn_main" in " ".join(p.cmdline())),
            key=lambda p: p.create_time(),
        )
        assert len(workers) == 2
        workers[1].send_signal(signal.SIGKILL)
        t0 = time.time()
        _, err = proc.communicate(timeout=60)
        assert time.time() - t0 < 30  # well within the collective timeout
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    last = [ln for ln in err.splitlines() if ln.strip()][-1]
    assert last.startswith("gptlab.train: error: worker rank 1") and "SIGKILL" in last, err[-2000:]
    for w in workers:  # no orphaned worker keeps running
        with contextlib.suppress(psutil.NoSuchProcess):
            _wait_for(lambda w=w: not w.is_running() or w.status() == psutil.STATUS_ZOMBIE, 10, f"pid {w.pid} to end")


@pytest.mark.slow
def test_worker_user_error_is_one_line(tmp_path, shakespeare):
    # the per-process micro-batch check passes, the data check fails inside the workers
    r = run_cli(
        [
            "gptlab.train",
            "model=gpt_nano",
            "hardware=cpu_x2",
            f"data.path={shakespeare}",
            "tracking.mlflow=false",
            "model.block_size=2000000",
        ],
        cwd=tmp_path,
        timeout=120,
    )
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.splitlines() if ln.strip() and "error" in ln]
    assert lines and lines[0].startswith("gptlab.train: error: model.block_size") and "Traceback" not in r.stderr


HANG_RANK1 = """
import os, runpy, sys, time
import gptlab.loop as loop
real = loop.optimizer_step
def optimizer_step(run, lr, loss_sum):  # rank 1 hangs (alive, not dead) in its 4th step
    if os.environ["RANK"] == "1" and run.train_loader.step == 3:
        time.sleep(600)
    return real(run, lr, loss_sum)
loop.optimizer_step = optimizer_step
sys.argv = ["gptlab.train", *{args!r}]
runpy.run_module("gptlab.train", run_name="__main__")
"""


@pytest.mark.slow
def test_a_hung_rank_is_ended_by_the_collective_timeout(tmp_path, shakespeare):
    """A rank that stops answering (not dead: no exit code to notice) ends the job after
    parallelism.timeout_s, through the waiting rank's collective, not after the job's time limit."""
    args = ["model=gpt_nano", f"data.path={shakespeare}", "hardware=cpu_x2", "train.max_steps=50", "train.log_every=1",
            "tracking.mlflow=false", "train.sample_tokens=0", "parallelism.timeout_s=10"]  # fmt: skip
    args.append(f"hydra.run.dir={tmp_path / 'run'}")
    script = tmp_path / "hang.py"
    script.write_text(HANG_RANK1.format(args=args))
    torchrun = str(Path(sys.executable).parent / "torchrun")
    t0 = time.time()
    r = subprocess.run([torchrun, "--nproc_per_node=2", str(script)], cwd=tmp_path, capture_output=True, text=True,
                       timeout=180)  # fmt: skip
    took = time.time() - t0
    assert r.returncode != 0
    assert took < 90, f"the job took {took:.0f} s to end"
    assert "timed out" in r.stderr.lower() or "timeout" in r.stderr.lower(), r.stderr[-3000:]
    steps = [json.loads(x)["step"] for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]  # rank 0 logged until the step rank 1 never finished
