"""Real multi-process data parallelism on the CPU (gloo, started by gptlab itself or by torchrun):
two ranks equal one process, a killed, stopped or hung rank ends the job as it should."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from helpers import run_cli, slack

# ------------------------------------------------------------------ real processes: gloo on the CPU


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
    return [r["train_loss"] for r in rows if "train_loss" in r], [
        r["val_loss"] for r in rows if "val_loss" in r
    ]


@pytest.mark.slow
def test_two_gloo_processes_match_one_process(tmp_path, shakespeare):
    """Same global batch on 1 process and on 2 (spawned by gptlab, or by torchrun, and with gradient
    accumulation, where DDP must all-reduce on the last micro-step only): same losses."""
    args = [*COMMON, f"data.path={shakespeare}"]
    # the same losses are the point here, not how a launcher starts: gptlab's commands start warm
    runs = {
        "cpu": ["gptlab.train", *args, "hardware=cpu"],
        "spawn": ["gptlab.train", *args, "hardware=cpu_x2"],
        "torchrun": [
            str(Path(sys.executable).parent / "torchrun"),
            "--nproc_per_node=2",
            "-m",
            "gptlab.train",
            *args,
            "hardware=cpu_x2",
        ],
        "spawn_accum": ["gptlab.train", *args, "hardware=cpu_x2", "train.micro_batch_size=2"],
    }
    out = {}
    for name, cmd in runs.items():
        cwd = tmp_path / name
        cwd.mkdir()
        if name == "torchrun":
            r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=slack(300))
        else:
            r = run_cli(cmd, cwd, timeout=300)
        assert r.returncode == 0, f"{name}: {r.stderr[-3000:]}"
        out[name] = losses(cwd)
        if name != "cpu":
            split = (
                "= 2 x 2 accum x 2 ranks" if name == "spawn_accum" else "= 4 x 1 accum x 2 ranks"
            )
            assert "x2" in r.stdout and split in r.stdout
            # one run folder, rank 0's: other ranks leave nothing behind
            assert len(list((cwd / "outputs" / "runs").iterdir())) == 1
    ref_train, ref_val = out["cpu"]
    assert len(ref_train) == 8
    for name in ("spawn", "torchrun", "spawn_accum"):
        train, val = out[name]
        assert train == pytest.approx(ref_train, abs=1e-5), name
        assert val == pytest.approx(ref_val, abs=1e-5), name


@pytest.mark.slow
def test_ddp_with_fewer_validation_batches_than_ranks_finishes(tmp_path, shakespeare):
    """train.eval_steps=1 on 2 ranks of a rotary model: rank 1 has no validation batch and goes
    straight to the sums' all-reduce. With DDP broadcasting buffers (the rotary tables), rank 0's
    evaluation forward was a collective rank 1 never joined: a hang until killed."""
    args = [*COMMON, f"data.path={shakespeare}", "model.pos_emb=rotary", "train.eval_steps=1",
            "train.max_steps=4", "train.eval_every=2", "parallelism=ddp", "hardware=cpu_x2",
            "parallelism.timeout_s=60"]  # fmt: skip
    r = subprocess.run(
        [sys.executable, "-m", "gptlab.train", *args],
        cwd=tmp_path, capture_output=True, text=True, timeout=slack(180),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    _, val = losses(tmp_path)
    assert len(val) == 2 and all(math.isfinite(v) for v in val)


def _wait_for(pred, timeout, what):
    deadline = time.time() + slack(timeout)
    while time.time() < deadline:
        if pred():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


COLLECTIVE_S = 300


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
        # the survivor's collective would wait this long: an end far sooner is the launcher's doing
        f"parallelism.timeout_s={COLLECTIVE_S}",
        "train.max_restarts=0",  # no restart: the death ends the job
    ]
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        metrics = lambda: next((tmp_path / "outputs").rglob("metrics.jsonl"), None)  # noqa: E731
        workers = _workers_once_logging(proc, metrics)
        workers[1].send_signal(signal.SIGKILL)
        t0 = time.time()
        _, err = proc.communicate(timeout=slack(60))
        took = time.time() - t0
        assert took < COLLECTIVE_S / 3, took  # well within the collective timeout
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    last = [ln for ln in err.splitlines() if ln.strip()][-1]
    assert last.startswith("gptlab.train: error: worker rank 1") and "SIGKILL" in last, err[-2000:]
    for w in workers:  # no orphaned worker keeps running
        with contextlib.suppress(psutil.NoSuchProcess):
            _wait_for(
                lambda w=w: not w.is_running() or w.status() == psutil.STATUS_ZOMBIE,
                10,
                f"pid {w.pid} to end",
            )


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
    assert (
        lines
        and lines[0].startswith("gptlab.train: error: model.block_size")
        and "Traceback" not in r.stderr
    )


@pytest.mark.slow
def test_sigterm_to_one_rank_stops_every_rank_at_the_same_step(tmp_path, shakespeare):
    """SIGTERM reaching rank 1 alone (a scheduler signalling one task): the ranks agree at the next
    step boundary, rank 0 saves that step's checkpoint, and the job ends cleanly; a rank stopping on
    its own would leave the other in a collective until parallelism.timeout_s."""
    from helpers import start_cli

    from gptlab.checkpoint import state as checkpoint

    run_dir = tmp_path / "run"
    args = [
        *COMMON,
        f"data.path={shakespeare}",
        "hardware=cpu_x2",
        "train.max_steps=100000",
        "train.eval_every=0",
        "parallelism.timeout_s=30",
        f"hydra.run.dir={run_dir}",
    ]
    proc = start_cli(["gptlab.train", *args], tmp_path)
    try:
        workers = _workers_once_logging(proc, lambda: run_dir / "metrics.jsonl")
        workers[1].send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=slack(60))
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert "SIGTERM received: stopped at step" in out
    results = json.loads((run_dir / "results.json").read_text())
    assert results["stopped_by"] == "SIGTERM"
    assert checkpoint.latest(run_dir / "checkpoints").name == f"ckpt_{results['steps']:08d}.pt"


def _workers_once_logging(proc, metrics, lines=3, what="training to start"):
    """The 2 ranks of launcher proc, once the metrics file that metrics() names (None: not yet
    there) holds `lines` lines."""

    def logged() -> bool:
        path = metrics()
        return path is not None and path.exists() and len(path.read_text().splitlines()) >= lines

    _wait_for(logged, 120, what)
    workers = _spawned_workers(proc.pid)
    assert len(workers) == 2
    return workers


def _spawned_workers(launcher: int):
    """The ranks a launcher started, in start order: the children of its fork server (neither the
    server itself nor the resource tracker)."""
    children = psutil.Process(launcher).children(recursive=True)
    return sorted(
        (p for p in children if p.ppid() != launcher and "forkserver" in " ".join(p.cmdline())),
        key=lambda p: p.create_time(),
    )


def _gone(p: psutil.Process) -> bool:
    try:
        return not p.is_running() or p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _long_run(shakespeare, run_dir, *extra, steps=100000):
    return [
        sys.executable,
        "-m",
        "gptlab.train",
        *COMMON,
        f"data.path={shakespeare}",
        "hardware=cpu_x2",
        f"train.max_steps={steps}",
        "train.eval_every=0",
        "parallelism.timeout_s=30",
        "data.progress=false",
        f"hydra.run.dir={run_dir}",
        *extra,
    ]


@pytest.mark.slow
def test_a_killed_launcher_leaves_no_worker_and_a_free_folder_that_resumes(tmp_path, shakespeare):
    """A launcher started with SIGINT ignored (a background job of a shell script), killed by
    SIGKILL (nothing of it runs: kill -9, the OOM killer): its workers end within seconds without
    saving again, the run folder's lock is free, and the same command resumes from an intact
    checkpoint."""
    import fcntl

    from helpers import cli_env

    from gptlab.checkpoint import state as checkpoint

    run_dir = tmp_path / "run"
    cmd = _long_run(shakespeare, run_dir, "train.checkpoint_every=5", "train.log_every=5")
    ignore_sigint = lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)  # noqa: E731 - as `trap '' INT`
    proc = subprocess.Popen(
        cmd,
        cwd=tmp_path,
        env=cli_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=ignore_sigint,
    )
    try:
        workers = _workers_once_logging(proc, lambda: run_dir / "metrics.jsonl")
        proc.kill()
        proc.wait()
        for w in workers:
            _wait_for(lambda w=w: _gone(w), 10, f"worker {w.pid} to end with its launcher")
    finally:
        proc.kill()
    saved = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    time.sleep(2)
    # nobody saves any more
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == saved
    with open(run_dir / ".gptlab.lock", "a") as f:
        # free: raises BlockingIOError while a rank holds it
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(f, fcntl.LOCK_UN)
    latest = checkpoint.latest(run_dir / "checkpoints")
    step = checkpoint.step_of(latest)
    again = _long_run(
        shakespeare, run_dir, "train.checkpoint_every=5", "train.log_every=5", steps=step + 2
    )
    r = subprocess.run(
        again, cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=slack(300)
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert (
        f"resuming from {latest} (step {step})" in r.stdout and "warning" not in r.stdout + r.stderr
    )


@pytest.mark.slow
def test_a_second_start_in_a_busy_folder_is_one_line_with_two_processes(tmp_path, shakespeare):
    """A two-process start in a folder whose lock is held says one line, none of torch's.

    This process holds the lock as a running rank 0 would (a real first run holds it in
    test_records_runfolder); no line of torch's about the other rank the failure stopped.
    """
    from helpers import cli_env

    from gptlab.records import runfolder

    run_dir = tmp_path / "run"
    runfolder.lock(run_dir)
    try:
        r = subprocess.run(
            _long_run(shakespeare, run_dir),
            cwd=tmp_path,
            env=cli_env(),
            capture_output=True,
            text=True,
            timeout=slack(120),
        )
    finally:
        runfolder.unlock(run_dir)
    assert r.returncode == 2
    (line,) = r.stderr.splitlines()
    assert line.startswith(
        f"gptlab.train: error: run folder {run_dir} is in use by another gptlab run (pid "
    )


@pytest.mark.slow
def test_a_two_process_run_on_a_terminal_ends_without_a_resource_tracker_warning(
    tmp_path, shakespeare
):
    """On a terminal rank 0 draws a progress bar; the run, and every process it started (the
    resource tracker writes last, once the launcher has gone), print nothing after the results."""
    import fcntl
    import pty
    import struct
    import termios

    from helpers import cli_env

    primary, secondary = pty.openpty()
    # a terminal's size
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    cmd = _long_run(shakespeare, tmp_path / "run", steps=20)
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, env=cli_env(), stdout=subprocess.PIPE, stderr=secondary, text=True
    )
    os.close(secondary)
    seen = []

    def read():  # until every process holding the terminal has closed it
        with contextlib.suppress(OSError):
            while chunk := os.read(primary, 4096):
                seen.append(chunk)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    out, _ = proc.communicate(timeout=slack(300))
    reader.join(60)
    os.close(primary)
    terminal = b"".join(seen).decode(errors="replace")
    assert proc.returncode == 0 and "results: best val loss" in out, terminal[-3000:]
    assert "step/s" in terminal or "s/step" in terminal, terminal[-3000:]  # tqdm's bar was drawn
    assert "resource_tracker" not in terminal and "leaked" not in terminal, terminal[-3000:]
    assert "Warning" not in terminal and "Traceback" not in terminal, terminal[-3000:]


HANG_RANK1 = """
import os, runpy, sys, time
import gptlab.training.loop as loop
real = loop.optimizer_step
def optimizer_step(run, lr, loss_sum, *rest):  # rank 1 hangs (alive, not dead) in its 4th step
    if os.environ["RANK"] == "1" and run.train_loader.step == 3:
        time.sleep(600)
    return real(run, lr, loss_sum, *rest)
loop.optimizer_step = optimizer_step
sys.argv = ["gptlab.train", *{args!r}]
runpy.run_module("gptlab.train", run_name="__main__")
"""


@pytest.mark.slow
def test_a_hung_rank_is_ended_by_the_collective_timeout(tmp_path, shakespeare):
    """A rank that stops answering (not dead: no exit code to notice) ends the job after
    parallelism.timeout_s, through the waiting rank's collective, not after the job's time limit."""
    args = [
        "model=gpt_nano",
        f"data.path={shakespeare}",
        "hardware=cpu_x2",
        "train.max_steps=50",
        "train.log_every=1",
        "tracking.mlflow=false",
        "train.sample_tokens=0",
        "parallelism.timeout_s=10",
    ]
    args.append(f"hydra.run.dir={tmp_path / 'run'}")
    script = tmp_path / "hang.py"
    script.write_text(HANG_RANK1.format(args=args))
    torchrun = str(Path(sys.executable).parent / "torchrun")
    t0 = time.time()
    r = subprocess.run(
        [torchrun, "--nproc_per_node=2", str(script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=slack(180),
    )
    took = time.time() - t0
    assert r.returncode != 0
    assert took < 90, f"the job took {took:.0f} s to end"
    assert "timed out" in r.stderr.lower() or "timeout" in r.stderr.lower(), r.stderr[-3000:]
    steps = [
        json.loads(x)["step"] for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert steps == [1, 2, 3]  # rank 0 logged until the step rank 1 never finished


# ------------------------------------------------------------------ restarts after a failure

# a 20-step run of two ranks that saves every 5 steps: a death at step 12 loses steps 11 and 12
RESTARTABLE = ["debug=smoke", "hardware=cpu_x2", "train.checkpoint_every=5", "data.progress=false"]
CRASH_RANK1_AT_12 = ["train.faults.crash_at_step=12", "train.faults.crash_rank=1"]


def _train_x2(shakespeare, run_dir, *extra):
    return [
        sys.executable,
        "-m",
        "gptlab.train",
        *RESTARTABLE,
        f"data.path={shakespeare}",
        f"hydra.run.dir={run_dir}",
        *extra,
    ]


def _finished(cmd, cwd, timeout=300):
    from helpers import cli_env

    r = subprocess.run(
        cmd, cwd=cwd, env=cli_env(), capture_output=True, text=True, timeout=slack(timeout)
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return r


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory, shakespeare):
    """results.json of the two-rank run that nothing disturbs."""
    cwd = tmp_path_factory.mktemp("undisturbed")
    _finished(_train_x2(shakespeare, cwd / "run"), cwd)
    return json.loads((cwd / "run" / "results.json").read_text())


@pytest.mark.slow
def test_a_rank_that_dies_is_restarted_and_the_run_ends_as_if_undisturbed(
    tmp_path, shakespeare, undisturbed
):
    """Rank 1 exits abruptly after step 12 (os._exit, as a segfault would): gptlab's launcher kills
    rank 0, starts both again, and they resume from step 10's checkpoint in the same folder and
    MLflow run; the final losses are bitwise the undisturbed run's, and the restart is recorded."""
    from mlflow.tracking import MlflowClient

    run_dir = tmp_path / "run"
    mlflow = ["tracking.mlflow=true", "tracking.log_model=false"]
    r = _finished(_train_x2(shakespeare, run_dir, *CRASH_RANK1_AT_12, *mlflow), tmp_path)
    assert "rank 1 died at step 12 (exit 17): starting all 2 workers again" in r.stderr
    results = json.loads((run_dir / "results.json").read_text())
    (restart,) = results["restarts"]
    assert (restart["rank"], restart["ended"], restart["died_at_step"]) == (1, "exit 17", 12)
    assert (restart["resumed_from"], restart["steps_lost"]) == (10, 12 - 10)
    assert restart["seconds_lost"] > 0
    assert json.loads((run_dir / "restarts.json").read_text())["restarts"] == [restart]
    assert results["steps"] == undisturbed["steps"] == 20
    for key in ("train_loss", "val_loss", "best_val_loss"):
        assert results[key] == undisturbed[key], key
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'outputs' / 'mlflow.db'}")
    run = client.get_run(results["mlflow_run_id"])
    assert run.info.status == "FINISHED" and run.data.tags["restarts"] == "1"
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "restarts")] == [
        (10, 1.0)
    ]


@pytest.mark.slow
def test_torchrun_max_restarts_resumes_and_records_the_restart(tmp_path, shakespeare, undisturbed):
    """torchrun --max-restarts=1 starts both workers again after rank 1 dies; resume=auto continues
    from the latest checkpoint, the first new start records the restart, and the run ends with the
    undisturbed run's losses."""
    run_dir = tmp_path / "run"
    torchrun = str(Path(sys.executable).parent / "torchrun")
    cmd = [torchrun, "--nproc_per_node=2", "--max-restarts=1", "-m", "gptlab.train"]
    _finished([*cmd, *_train_x2(shakespeare, run_dir, *CRASH_RANK1_AT_12)[3:]], tmp_path)
    results = json.loads((run_dir / "results.json").read_text())
    (restart,) = results["restarts"]
    assert restart["launcher"] == "torchrun" and "restart 1 of --max-restarts=1" in restart["cause"]
    assert (restart["died_at_step"], restart["resumed_from"], restart["steps_lost"]) == (12, 10, 2)
    for key in ("train_loss", "val_loss", "best_val_loss"):
        assert results[key] == undisturbed[key], key


@pytest.mark.slow
def test_a_worker_killed_from_outside_is_restarted_and_the_run_finishes(tmp_path, shakespeare):
    run_dir = tmp_path / "run"
    cmd = _train_x2(shakespeare, run_dir, "train.max_steps=150", "train.log_every=1")
    from helpers import cli_env

    proc = subprocess.Popen(
        cmd, cwd=tmp_path, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        workers = _workers_once_logging(proc, lambda: run_dir / "metrics.jsonl", 7, "a checkpoint")
        workers[1].send_signal(signal.SIGKILL)
        out, err = proc.communicate(timeout=slack(300))
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    results = json.loads((run_dir / "results.json").read_text())
    assert results["steps"] == 150 and math.isfinite(results["train_loss"])
    (restart,) = results["restarts"]
    assert (restart["rank"], restart["ended"]) == (1, "SIGKILL")
    assert restart["resumed_from"] % 5 == 0 and restart["resumed_from"] >= 5
    assert restart["steps_lost"] == restart["died_at_step"] - restart["resumed_from"] >= 0


@pytest.mark.slow
def test_a_rank_that_dies_every_time_stops_when_the_restarts_are_used_up(tmp_path, shakespeare):
    run_dir = tmp_path / "run"
    cmd = _train_x2(
        shakespeare,
        run_dir,
        *CRASH_RANK1_AT_12,
        "train.faults.crash_once=false",
        "train.max_restarts=2",
    )
    from helpers import cli_env

    r = subprocess.run(
        cmd, cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=slack(300)
    )
    assert r.returncode != 0
    last = [ln for ln in r.stderr.splitlines() if ln.strip()][-1]
    assert last == (
        "gptlab.train: error: rank 1 died at step 12 (exit 17) 3 times; "
        "no restarts left (train.max_restarts=2)"
    ), r.stderr[-3000:]
    assert not (run_dir / "results.json").exists()
    restarts = json.loads((run_dir / "restarts.json").read_text())["restarts"]
    assert [(e["died_at_step"], e["resumed_from"]) for e in restarts] == [(12, 10), (12, 10)]
