"""The team tracking server (launch/mlflow_server.sh: mlflow server on PostgreSQL), end to end.

`up` on a fresh state folder, `status`, `down` (no process left) and `up` again (the same runs); a
sweep recorded as one parent with its children; gptlab runs started at once, each logging every
step, through a server stopped for 15 s (SIGSTOP, then SIGCONT) and through one killed and
restarted: every run finishes, training goes on during the outage, and after at most one
`gptlab.sync` every point is in MLflow exactly once.

The server is this module's own, started by the script on a free port (the script installs
PostgreSQL when it is missing, as root). Without PostgreSQL and no way to install it these tests are
skipped, except in CI (CI=true), where that is a failure. Load figures are
benchmarks/mlflow_load.py's, not these tests': here a few short runs, enough for the faults to land
while they train.
"""

from __future__ import annotations

import signal
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, List

import pytest
from helpers import need, run_cli, start_cli_logged
from team_server import ScriptServer, alive, live_pids, stop_group
from test_sync import expected_points, recorded_points

pytestmark = pytest.mark.slow

# started at once: clients of one server at the same time (more of them add load, the subject of
# benchmarks/mlflow_load.py, not a new case)
RUNS = 2
# each logging every step (7 metrics a step) on one thread: enough steps that they still train when
# the fault comes (as soon as the last has logged a step); a run that ends during it is synced after
STEPS = 1000


@pytest.fixture(scope="module")
def server():
    """This module's server, up on a fresh state folder; (server, what `up` printed)."""
    s = ScriptServer.fresh()
    if problem := s.problem():
        need(problem)
    try:
        yield s, s.up()
    finally:
        s.run("down", timeout=180)
        s.remove()


def client(uri):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def new_experiment(name: str) -> str:
    return f"{name}-{uuid.uuid4().hex[:6]}"  # the server outlives a test: names never repeat


@dataclass
class Run:
    proc: Any  # a Popen, or warm_start's equivalent
    dir: Path
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def start_runs(uri: str, experiment: str, cwd: Path, data: Path, n: int = RUNS) -> List[Run]:
    """n gptlab runs started at once, each logging every step to uri."""
    runs = []
    for i in range(n):
        run_dir, log = cwd / f"run{i}", cwd / f"run{i}.log"
        args = [
            "model=gpt_nano",
            f"data.path={data}",
            f"train.max_steps={STEPS}",
            "train.batch_size=2",
            "train.log_every=1",
            "train.eval_every=250",
            "train.eval_steps=1",
            "train.sample_tokens=0",
            "hardware.threads=1",
            "train.save_checkpoints=false",
            f"tracking.uri={uri}",
            f"tracking.experiment={experiment}",
            f"hydra.run.dir={run_dir}",
        ]
        runs.append(Run(start_cli_logged(["gptlab.train", *args], cwd, log), run_dir, log))
    return runs


def logged_lines(runs: List[Run]) -> int:
    return sum(
        len(p.read_text().splitlines()) for r in runs if (p := r.dir / "metrics.jsonl").is_file()
    )


def wait_until_all_train(runs: List[Run], timeout: float = 300) -> None:
    """Until every run has logged a step (its MLflow run exists: the tracker made it before step
    1)."""
    deadline = time.time() + timeout
    while not all(
        (r.dir / "metrics.jsonl").is_file() and (r.dir / "metrics.jsonl").stat().st_size
        for r in runs
    ):
        for r in runs:
            assert r.proc.poll() is None, (
                f"{r.dir.name} ended before training:\n{r.output()[-3000:]}"
            )
        assert time.time() < deadline, "the runs did not start training"
        time.sleep(0.2)


def finish(runs: List[Run], timeout: float = 600) -> None:
    try:
        for r in runs:
            r.proc.wait(timeout=timeout)
    finally:
        for r in runs:
            stop_group(r.proc.pid)
    for r in runs:
        assert r.proc.returncode == 0, (
            f"{r.dir.name} exited {r.proc.returncode}:\n{r.output()[-3000:]}"
        )


def sync_what_was_not_sent(runs: List[Run], cwd: Path) -> List[Path]:
    """One `gptlab.sync` of the folders whose run said that points were not sent (the folders)."""
    left = [r for r in runs if "points not sent" in r.output() or "MLflow disabled" in r.output()]
    for r in left:  # the one line names the command that records the rest
        assert f"python -m gptlab.sync {r.dir.resolve()}" in r.output(), r.output()[-2000:]
    if left:
        s = run_cli(["gptlab.sync", *[str(r.dir) for r in left]], cwd=cwd, timeout=300)
        assert s.returncode == 0, s.stdout + s.stderr
    return [r.dir for r in left]


def assert_every_point_once(uri: str, experiment: str, runs: List[Run]) -> None:
    """Each run FINISHED in MLflow once, with each point of its folder once (train/loss: every
    step)."""
    c = client(uri)
    exp = c.get_experiment_by_name(experiment)
    recorded = {
        r.data.tags["run_dir"]: r for r in c.search_runs([exp.experiment_id], max_results=100)
    }
    assert sorted(recorded) == sorted(str(r.dir.resolve()) for r in runs), sorted(recorded)
    for r in runs:
        mlflow_run = recorded[str(r.dir.resolve())]
        assert mlflow_run.info.status == "FINISHED", (r.dir.name, mlflow_run.info.status)
        points = recorded_points(uri, mlflow_run.info.run_id)
        # in any order: points the live sender sent after the fault come before those sync sent
        assert sorted(points["train/loss"]) == list(range(1, STEPS + 1)), (
            r.dir.name,
            points["train/loss"],
        )
        assert {n: sorted(s) for n, s in points.items()} == {
            n: sorted(s) for n, s in expected_points(r.dir).items()
        }, r.dir.name
        # none twice
        assert all(len(s) == len(set(s)) for s in points.values()), (r.dir.name, points)


def test_up_on_a_fresh_folder_prints_the_uri_and_status_answers(server):
    s, printed = server
    assert f"use: tracking.uri=http://127.0.0.1:{s.port}\n" in printed, printed
    assert "creating the database cluster" in printed, printed  # a fresh state folder
    r = s.run("status")
    assert r.returncode == 0, r.stdout + r.stderr
    for line in (
        "postgres: running",
        "mlflow server: running",
        "health: ok",
        f"use: tracking.uri={s.uri}",
    ):
        assert line in r.stdout, r.stdout
    # the database listens on no TCP port: only its socket in the state folder
    assert list((s.state / "pgsocket").glob(".s.PGSQL.*")), list((s.state / "pgsocket").iterdir())


def test_a_sweep_on_the_server_is_one_parent_with_three_finished_children(
    server, shakespeare, tmp_path
):
    s, _ = server
    experiment = new_experiment("sweep")
    r = run_cli(
        [
            "gptlab.train",
            "-m",
            "model=gpt_nano",
            f"data.path={shakespeare}",
            "train.max_steps=10",
            "train.batch_size=4",
            "train.eval_every=10",
            "train.eval_steps=1",
            "train.sample_tokens=0",
            "train.save_checkpoints=false",
            f"tracking.uri={s.uri}",
            f"tracking.experiment={experiment}",
            "optimizer.lr=1e-3,2e-3,3e-3",
        ],
        cwd=tmp_path,
        timeout=400,
    )
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    c = client(s.uri)
    runs = c.search_runs([c.get_experiment_by_name(experiment).experiment_id])
    parents = [x for x in runs if "mlflow.parentRunId" not in x.data.tags]
    kids = [x for x in runs if "mlflow.parentRunId" in x.data.tags]
    assert len(parents) == 1 and len(kids) == 3, [(x.info.run_name, x.data.tags) for x in runs]
    assert {k.data.tags["mlflow.parentRunId"] for k in kids} == {parents[0].info.run_id}
    assert [k.info.status for k in kids] == ["FINISHED"] * 3 and parents[
        0
    ].info.status == "FINISHED"
    assert sorted(k.data.params["optimizer.lr"] for k in kids) == ["0.001", "0.002", "0.003"]
    # artifacts went through the server into its own folder: the jobs needed no path to it
    assert {a.path for a in c.list_artifacts(kids[0].info.run_id)} >= {
        "results.json",
        "config_resolved.yaml",
    }
    assert list((s.state / "artifacts").rglob("results.json"))


def runs_through_a_fault(s, name, tmp_path, shakespeare, fault):
    """RUNS runs on the server; fault(runs) strikes once all train and returns the logged-line
    counts at its start and 3 s later. The step loops must go on through it, and after at most one
    gptlab.sync per run every point is in MLflow exactly once. Returns the runs that needed sync."""
    experiment = new_experiment(name)
    runs = start_runs(s.uri, experiment, tmp_path, shakespeare)
    try:
        wait_until_all_train(runs)
        before, during = fault(runs)
        finish(runs)
    finally:
        for r in runs:
            stop_group(r.proc.pid)
    assert during > before, (before, during)  # the step loops went on through the fault
    synced = sync_what_was_not_sent(runs, tmp_path)
    assert_every_point_once(s.uri, experiment, runs)
    return synced


def test_runs_go_on_through_a_server_stopped_for_15_s(server, shakespeare, tmp_path):
    s, _ = server

    def stop_for_15_s(runs):
        s.signal(signal.SIGSTOP)
        try:
            before = logged_lines(runs)
            time.sleep(3)
            during = logged_lines(runs)
            time.sleep(12)
        finally:
            s.signal(signal.SIGCONT)
        return before, during

    synced = runs_through_a_fault(s, "stopped", tmp_path, shakespeare, stop_for_15_s)
    print(f"stopped 15 s: {len(synced)} of {RUNS} runs needed gptlab.sync")


def test_runs_go_on_through_a_server_killed_and_restarted(server, shakespeare, tmp_path):
    s, _ = server

    def kill_and_restart(runs):
        pid = s.server_pid()
        s.signal(signal.SIGKILL)  # the server and its workers, at once; PostgreSQL keeps the data
        deadline = time.time() + 30
        while live_pids(pgid=pid):
            assert time.time() < deadline, live_pids(pgid=pid)
            time.sleep(0.1)
        before = logged_lines(runs)  # with no server at all
        time.sleep(3)
        during = logged_lines(runs)
        s.up()  # a new server on the same database and port (~10 s to answer)
        return before, during

    synced = runs_through_a_fault(s, "killed", tmp_path, shakespeare, kill_and_restart)
    print(f"killed and restarted: {len(synced)} of {RUNS} runs needed gptlab.sync")


def test_down_leaves_no_process_and_up_again_serves_the_same_runs(server):
    s, _ = server
    c = client(s.uri)
    exp_id = c.create_experiment(new_experiment("kept"))
    run = c.create_run(exp_id, run_name="kept")
    c.log_metric(run.info.run_id, "train/loss", 2.5, step=7)
    c.set_terminated(run.info.run_id)
    leader, pids = s.server_pid(), s.pids()
    assert len(pids) >= 4, pids  # the server, its workers, PostgreSQL and its backends
    out = s.down()
    assert "down (data kept in" in out, out
    # not one process left (a zombie, waiting for a parent that does not reap it, is none)
    assert [p for p in pids if alive(p)] == [] and live_pids(pgid=leader) == []
    status = s.run("status")
    assert status.returncode != 0
    assert (
        "postgres: not running" in status.stdout and "mlflow server: not running" in status.stdout
    )
    s.up()
    again = client(s.uri).get_run(run.info.run_id)
    assert again.info.status == "FINISHED" and again.info.run_name == "kept"
    assert [
        (m.step, m.value) for m in client(s.uri).get_metric_history(run.info.run_id, "train/loss")
    ] == [(7, 2.5)]
