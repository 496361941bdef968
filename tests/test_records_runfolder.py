"""A run folder belongs to one run: reused folders, reruns, stops and broken checkpoints never lose
or mix a run (gptlab/runfolder.py), and a resumed run logs the same curve as one never stopped."""

import json
import signal
import sqlite3
import time
from pathlib import Path

import pytest
import torch
from helpers import compose_config, nano_overrides, run_cli, start_cli

from gptlab.checkpoint import state as checkpoint
from gptlab.errors import GptlabError
from gptlab.train import run_training


def overrides(shakespeare, *extra):
    """nano_overrides with these settings; a key given again in extra replaces the earlier value."""
    base = nano_overrides(
        shakespeare, "train.log_every=5", "train.checkpoint_every=10", "train.sample_tokens=0",
        "train.eval_every=20", *extra,
    )  # fmt: skip
    merged = {}
    for o in base:
        merged[o.split("=", 1)[0]] = o
    return list(merged.values())


def steps_logged(run_dir: Path):
    return [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def ckpt_names(run_dir: Path):
    return [p.name for p in checkpoint.list_checkpoints(run_dir / "checkpoints")]


def cli(args, cwd):
    return run_cli(["gptlab.train", *args], cwd)


def one_error_line(r) -> str:
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    return lines[0]


@pytest.mark.integration
def test_resume_never_moves_the_earlier_run_aside_and_never_mixes(tmp_path, shakespeare):
    run_dir = tmp_path / "r"
    run_training(compose_config(overrides(shakespeare, "train.max_steps=30")), run_dir)
    before = (run_dir / "metrics.jsonl").read_text()
    again = run_training(
        compose_config(
            overrides(shakespeare, "train.max_steps=20", "train.resume=never", "optimizer.lr=3e-3")
        ),
        run_dir,
    )
    assert again["steps"] == 20
    steps = steps_logged(run_dir)
    assert steps == sorted(set(steps)) and steps[-1] == 20  # one run's rows, each step once
    (previous,) = list((run_dir / "previous").iterdir())
    assert (previous / "metrics.jsonl").read_text() == before  # the earlier run, whole, beside it
    assert ckpt_names(previous) == ["ckpt_00000020.pt", "ckpt_00000030.pt"]
    assert ckpt_names(run_dir) == ["ckpt_00000010.pt", "ckpt_00000020.pt"]
    assert (
        checkpoint.load(run_dir / "checkpoints" / "ckpt_00000020.pt")["config"]["optimizer"]["lr"]
        == 3e-3
    )


@pytest.mark.integration
def test_auto_refuses_another_runs_checkpoint_in_one_line_naming_the_keys(tmp_path, shakespeare):
    run_dir = tmp_path / "r"
    # the earlier run in this process: the refusal is the command's
    run_training(compose_config(overrides(shakespeare, "train.max_steps=10")), run_dir)
    snapshot = {
        p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file() and p.parent.name != ".hydra"
    }
    r = cli([*overrides(shakespeare, "train.max_steps=20", "model.n_layer=3", "optimizer.lr=5e-3"),
             f"hydra.run.dir={run_dir}"], tmp_path)  # fmt: skip
    line = one_error_line(r)
    assert line.startswith("gptlab.train: error: run folder") and "holds another run" in line
    assert (
        "model.n_layer=2 (now 3)" in line
        and "optimizer.lr" in line
        and "train.resume=never" in line
    )
    # nothing of the earlier run changed (the new attempt's log file and its lock note aside)
    assert all(
        p.read_bytes() == b
        for p, b in snapshot.items()
        if p.name not in ("train.log", ".gptlab.lock")
    )
    # a change of topology or pace continues it: another micro-batch split, more steps
    ok = run_training(
        compose_config(overrides(shakespeare, "train.max_steps=20", "train.micro_batch_size=4")),
        run_dir,
    )
    assert ok["steps"] == 20 and steps_logged(run_dir) == [1, 5, 10, 15, 20]


@pytest.mark.integration
def test_broken_newer_checkpoints_are_moved_aside_and_never_win_pruning(tmp_path, shakespeare):
    run_dir = tmp_path / "r"
    run_training(
        compose_config(overrides(shakespeare, "train.max_steps=40", "train.keep_checkpoints=0")),
        run_dir,
    )
    for step in (30, 40):  # newer checkpoints that no longer load
        path = run_dir / "checkpoints" / f"ckpt_{step:08d}.pt"
        path.write_bytes(path.read_bytes()[:1000])
    results = run_training(compose_config(overrides(shakespeare, "train.max_steps=50")), run_dir)
    assert results["steps"] == 50
    broken = run_dir / "checkpoints" / "broken"
    assert sorted(p.name for p in broken.iterdir()) == ["ckpt_00000030.pt", "ckpt_00000040.pt"]
    # this line's own, newest kept
    assert ckpt_names(run_dir) == ["ckpt_00000040.pt", "ckpt_00000050.pt"]
    # rewritten, loads
    assert checkpoint.load(run_dir / "checkpoints" / "ckpt_00000040.pt")["step"] == 40
    steps = steps_logged(run_dir)
    assert steps == sorted(set(steps))  # steps 21-40 were not logged twice


@pytest.mark.integration
def test_every_checkpoint_broken_is_refused_and_nothing_is_touched(tmp_path, shakespeare):
    run_dir = tmp_path / "r"
    run_training(compose_config(overrides(shakespeare, "train.max_steps=20")), run_dir)
    for path in checkpoint.list_checkpoints(run_dir / "checkpoints"):
        path.write_bytes(b"not a checkpoint")
    rows = (run_dir / "metrics.jsonl").read_text()
    why = "holds another run \\(none of its checkpoints loads: .*ckpt_00000020.pt is not a gptlab"
    with pytest.raises(GptlabError, match=why):
        # extended
        run_training(compose_config(overrides(shakespeare, "train.max_steps=30")), run_dir)
    assert (run_dir / "metrics.jsonl").read_text() == rows and len(ckpt_names(run_dir)) == 2


@pytest.mark.slow
def test_rerunning_a_finished_run_changes_nothing(tmp_path, shakespeare, monkeypatch):
    run_dir = tmp_path / "r"
    first = overrides(shakespeare, "train.max_steps=10", "tracking.mlflow=true")
    # the first run in this process, its store where the command's is: the rerun is the command's
    monkeypatch.chdir(tmp_path)
    run_training(compose_config(first), run_dir)
    args = [*first, f"hydra.run.dir={run_dir}"]
    assert not (run_dir / ".gptlab.lock").exists()  # held only while the run lasts
    files = {
        p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file() and p.parent.name != ".hydra"
    }
    r = cli(args, tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "finished at step 10" in r.stdout and "nothing to do" in r.stdout
    assert not (run_dir / ".gptlab.lock").exists()
    assert all(p.read_bytes() == b for p, b in files.items() if p.name != "train.log")
    json.loads(
        (run_dir / "results.json").read_text(),
        parse_constant=lambda c: pytest.fail(f"not strict: {c}"),
    )
    db = sqlite3.connect(tmp_path / "outputs" / "mlflow.db")
    points = db.execute("select count(*) from metrics where key = 'summary/train_loss'").fetchone()[
        0
    ]
    assert points == 1  # the rerun logged no second summary


@pytest.mark.slow
def test_a_stop_checkpoint_is_kept_and_the_resumed_curve_is_the_uninterrupted_one(
    tmp_path, shakespeare
):
    """Issue 11 case 1 and 8: SIGTERM mid-run in a reused folder, then the same run again."""
    run_dir, straight = tmp_path / "r", tmp_path / "straight"
    # the earlier run in the folder, in this process: the stop and the resume are the commands'
    run_training(compose_config(overrides(shakespeare, "train.max_steps=60")), run_dir)
    second = [
        *overrides(
            shakespeare,
            "optimizer.lr=3e-3",
            "train.log_every=4",
            "optimizer.decay_steps=200",
            "train.max_steps=100000",
        ),
        f"hydra.run.dir={run_dir}",
    ]
    proc = start_cli(["gptlab.train", *second, "train.resume=never"], tmp_path)
    deadline = time.time() + 120
    while not (
        (run_dir / "checkpoints" / "ckpt_00000010.pt").exists() and (run_dir / "previous").exists()
    ):
        assert proc.poll() is None and time.time() < deadline, proc.stderr.read()
        time.sleep(0.05)
    time.sleep(0.3)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-2000:]
    stopped = json.loads((run_dir / "results.json").read_text())
    step = stopped["steps"]
    assert (
        stopped["stopped_by"] == "SIGTERM" and f"hydra.run.dir={run_dir} train.resume=auto" in out
    )
    assert ckpt_names(run_dir)[-1] == f"ckpt_{step:08d}.pt"  # the stop checkpoint was not pruned
    # the earlier run (its step 60) is aside: the second run continues its own step, not the old
    # one's
    resumed_args = [a for a in second if not a.startswith("train.max_steps")] + [
        f"train.max_steps={step + 13}"
    ]
    r = cli(resumed_args, tmp_path)
    assert r.returncode == 0 and f"(step {step})" in r.stdout, r.stderr[-2000:]
    assert json.loads((run_dir / "results.json").read_text())["steps"] == step + 13
    # the same run never stopped logs the very same rows (the train-loss average spans the stop)
    straight_args = [a for a in resumed_args if not a.startswith("hydra.run.dir")] + [
        f"hydra.run.dir={straight}"
    ]
    assert cli(straight_args, tmp_path).returncode == 0
    rows = {
        p: [json.loads(x) for x in (p / "metrics.jsonl").read_text().splitlines()]
        for p in (run_dir, straight)
    }
    pick = {
        p: [(x["step"], x.get("train_loss"), x.get("val_loss")) for x in rs]
        for p, rs in rows.items()
    }
    assert pick[run_dir] == pick[straight]
    a = checkpoint.load(checkpoint.latest(run_dir / "checkpoints"))["model"]
    b = checkpoint.load(checkpoint.latest(straight / "checkpoints"))["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_a_second_run_started_in_a_busy_folder_is_one_line_and_the_first_goes_on(
    tmp_path, shakespeare
):
    run_dir = tmp_path / "r"
    args = [
        *overrides(shakespeare, "train.max_steps=100000", "train.log_every=1"),
        f"hydra.run.dir={run_dir}",
    ]
    first = start_cli(["gptlab.train", *args], tmp_path)
    try:
        deadline = time.time() + 120
        while not (run_dir / "metrics.jsonl").exists():
            assert first.poll() is None and time.time() < deadline, first.stderr.read()
            time.sleep(0.1)
        line = one_error_line(cli(args, tmp_path))
        assert "is in use by another gptlab run (pid " in line and str(run_dir) in line
        assert first.poll() is None  # untouched: still training
    finally:
        first.send_signal(signal.SIGTERM)
        out, err = first.communicate(timeout=60)
    assert first.returncode == 0 and "SIGTERM received" in out, err[-2000:]
    steps = steps_logged(run_dir)
    assert steps == sorted(set(steps))  # one run's rows only
