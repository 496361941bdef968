"""`python -m gptlab.train`, the real command in a subprocess as a user runs it: its run folder, its
MLflow run, and Ctrl-C. Its sweeps: test_search_callbacks.py."""

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import cli_env, run_cli

from gptlab.checkpoint import state as checkpoint


@pytest.mark.slow
def test_train_command_writes_run_folder_and_mlflow_run(tmp_path, shakespeare):
    r = run_cli(
        [
            "gptlab.train",
            "model=gpt_nano",
            f"data.path={shakespeare}",
            "train.max_steps=30",
            "train.eval_every=15",
            "train.eval_steps=4",
            "train.log_every=10",
            "train.batch_size=8",
        ],
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    # plain progress lines when not on a terminal, then the UI command for the store used
    assert "step 10/30 | loss" in r.stdout
    # the train module's own lines
    assert "--- sample ---" in r.stdout and "results: best val loss" in r.stdout
    # the run's lines, stamped, in its log file; MLflow's and other libraries' INFO chatter nowhere
    assert "INFO" not in r.stdout + r.stderr and "alembic" not in r.stdout + r.stderr, r.stderr[
        -2000:
    ]
    assert f"mlflow ui --backend-store-uri sqlite:///{tmp_path}/outputs/mlflow.db" in r.stdout
    (run_dir,) = list((tmp_path / "outputs" / "runs").iterdir())
    results = json.loads((run_dir / "results.json").read_text())
    assert results["steps"] == 30 and results["best_val_loss"] < 4.0
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 30 and "val_loss" in rows[-1]
    assert (run_dir / ".hydra" / "config.yaml").is_file() and (run_dir / "samples.txt").is_file()
    log_lines = (run_dir / "train.log").read_text()
    assert (
        "][gptlab.console][INFO] step 10/30 | loss" in log_lines
        and "results: best val loss" in log_lines
    )
    db = sqlite3.connect(tmp_path / "outputs" / "mlflow.db")
    (status,) = db.execute(
        "select status from runs where run_uuid = ?", (results["mlflow_run_id"],)
    ).fetchone()
    assert status == "FINISHED"


# ------------------------------------------------------------------ stop signals


def _start(args, cwd, script=None):
    """The command in a session of its own, as a terminal's foreground job: killpg is its Ctrl-C."""
    head = [sys.executable, str(script)] if script else [sys.executable, "-m", "gptlab.train"]
    return subprocess.Popen(
        [*head, *args],
        cwd=cwd,
        env=cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _wait_for_lines(path, n, proc, timeout=180):
    deadline = time.time() + timeout
    while not (path.exists() and len(path.read_text().splitlines()) >= n):
        assert proc.poll() is None and time.time() < deadline, (
            proc.communicate()[1][-3000:] if proc.poll() else ""
        )
        time.sleep(0.2)


def _long_run(shakespeare, *extra):
    return [
        "model=gpt_nano",
        f"data.path={shakespeare}",
        "train.max_steps=100000",
        "train.log_every=10",
        "train.eval_every=0",
        "tracking.mlflow=false",
        "tracking.plots=false",  # the loss plot an ending run draws is not what these tests check
        "train.sample_tokens=0",
        "parallelism.timeout_s=30",
        "data.progress=false",
        *extra,
    ]


@pytest.mark.slow
@pytest.mark.parametrize("hardware", ["cpu", "cpu_x2"])
def test_ctrl_c_saves_at_the_stop_step_and_says_where_the_next_start_resumes(
    tmp_path, shakespeare, hardware
):
    """Ctrl-C (SIGINT to the terminal's whole process group: with two processes the launcher and its
    workers) stops as SIGTERM does: one checkpoint at the stop step, one line naming it and the
    command that continues; the run did not finish, so the exit status is 130 (a shell chain
    stops); that command then resumes from it."""
    run_dir = tmp_path / "run"
    args = _long_run(shakespeare, f"hydra.run.dir={run_dir}", f"hardware={hardware}")
    proc = _start(args, tmp_path)
    try:
        _wait_for_lines(run_dir / "metrics.jsonl", 3, proc)
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130 and err == "", err[-3000:]
    results = json.loads((run_dir / "results.json").read_text())
    step = results["steps"]
    assert results["stopped_by"] == "SIGINT"
    ckpt = run_dir / "checkpoints" / f"ckpt_{step:08d}.pt"
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("ckpt_*")) == [ckpt.name]
    said = [ln for ln in out.splitlines() if "received" in ln]
    assert said == [
        f"SIGINT received: stopped at step {step}; the next start resumes from {ckpt} (step "
        f"{step}): "
        f"run the same command with hydra.run.dir={run_dir}"
    ]
    r = run_cli(
        ["gptlab.train", *[a for a in args if "max_steps" not in a], f"train.max_steps={step + 2}"],
        tmp_path,
    )
    assert r.returncode == 0 and f"resuming from {ckpt} (step {step})" in r.stdout, r.stderr[-2000:]


SLOW_STOP = """
import sys, time
import gptlab.training.loop as loop
real = loop.save_checkpoint
def save_checkpoint(run, p, val):  # a slow save, as a big model's: time for a 2nd Ctrl-C
    if p.stopped_by is not None:
        (run.run_dir / "saving").touch()
        time.sleep(300)
    return real(run, p, val)
loop.save_checkpoint = save_checkpoint
if __name__ == "__main__":
    from gptlab import train
    train.main()
"""


@pytest.mark.slow
@pytest.mark.parametrize("hardware", ["cpu", "cpu_x2"])
def test_a_second_ctrl_c_stops_at_once_naming_the_checkpoint_the_next_start_resumes(
    tmp_path, shakespeare, hardware
):
    script = tmp_path / "slow_stop.py"
    script.write_text(SLOW_STOP)
    run_dir = tmp_path / "run"
    args = _long_run(
        shakespeare, f"hydra.run.dir={run_dir}", f"hardware={hardware}", "train.checkpoint_every=10"
    )
    proc = _start(args, tmp_path, script)
    try:
        _wait_for_lines(run_dir / "metrics.jsonl", 3, proc)
        os.killpg(proc.pid, signal.SIGINT)
        deadline = time.time() + 60
        while not (run_dir / "saving").exists():
            assert time.time() < deadline and proc.poll() is None, (
                "the first Ctrl-C did not start the stop"
            )
            time.sleep(0.1)
        time.sleep(1.5)  # a second press, not the first one delivered twice
        os.killpg(proc.pid, signal.SIGINT)
        t0 = time.time()
        out, err = proc.communicate(timeout=60)
        took = time.time() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130 and took < 15, (took, err[-3000:])
    latest = checkpoint.latest(run_dir / "checkpoints")
    step = checkpoint.step_of(latest)
    assert err.splitlines() == [
        f"gptlab.train: interrupted; the next start resumes from {latest} (step {step}): "
        f"run the same command with hydra.run.dir={run_dir}"
    ]
    # whole: the interrupted save left nothing under a checkpoint's name
    checkpoint.TrainingState.load(latest)
    assert not (run_dir / "results.json").exists()


def test_the_results_line_of_a_run_stopped_before_any_evaluation_says_so():
    from gptlab.train import results_line

    stopped = {"best_val_loss": None, "steps": 3, "tokens_per_s": 1234.0, "wall_s": 2.0}
    assert results_line(stopped, Path("r")) == (
        "results: stopped at step 3, before its first evaluation | 1,234 tok/s | 2s | r"
    )
    done = {**stopped, "best_val_loss": 1.5, "best_val_bpb": 2.25}
    assert results_line(done, Path("r")).startswith("results: best val loss 1.5000 (2.2500 bpb)")
