"""gptlab.sync: run folders recorded in MLflow later (a store that was down, locked or out of
reach), completed without duplicates; and concurrent runs on one fresh SQLite store, all
recorded."""

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from helpers import compose_config, nano_overrides, run_cli, start_cli, start_mlflow_server

from gptlab.cli import compose
from gptlab.records import lineage
from gptlab.records.layout import SWEEP_KIND, read_metrics
from gptlab.records.store import METRIC_NAMES, SUMMARY_METRICS, flatten, mlflow_metrics
from gptlab.sync import gather_words, main, sync
from gptlab.train import run_training

DOWN = "http://127.0.0.1:9"  # nothing listens there: MLflow is disabled for the run


def client(uri):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def all_runs(uri):
    c = client(uri)
    return c.search_runs([e.experiment_id for e in c.search_experiments()], max_results=1000)


def expected_points(run_dir):
    """Metric name -> the steps the folder holds (metrics.jsonl, and results.json's summary)."""
    steps = {}
    for row in read_metrics(run_dir):
        for name in mlflow_metrics(row):
            steps.setdefault(name, set()).add(row["step"])
    results = json.loads((run_dir / "results.json").read_text())
    for key, name in SUMMARY_METRICS.items():
        if results.get(key) is not None:
            steps.setdefault(name, set()).add(results["steps"])
    return steps


def param_count(run_dir):
    """The params a run folder records: its resolved config, flattened, and its derived.*
    figures."""
    import yaml

    derived = json.loads((run_dir / "derived.json").read_text())
    return len(flatten(yaml.safe_load((run_dir / "config_resolved.yaml").read_text()))) + len(
        derived
    )


def recorded_points(uri, run_id):
    """Metric name -> the steps of its points in the run (a step twice is a duplicate)."""
    c = client(uri)
    names = [*METRIC_NAMES.values(), *SUMMARY_METRICS.values()]
    return {
        n: [m.step for m in c.get_metric_history(run_id, n)]
        for n in names
        if c.get_metric_history(run_id, n)
    }


def assert_complete(uri, run, run_dir):
    points = recorded_points(uri, run.info.run_id)
    assert {n: sorted(s) for n, s in points.items()} == {
        n: sorted(s) for n, s in expected_points(run_dir).items()
    }
    assert all(len(s) == len(set(s)) for s in points.values()), points  # no point twice
    artifacts = {a.path for a in client(uri).list_artifacts(run.info.run_id)}
    assert {"config_resolved.yaml", "results.json", "loss.png"} <= artifacts, artifacts
    assert run.data.params["model.name"] == "gpt_nano" and "derived.params" in run.data.params
    # every derived.* figure the run logged
    derived = json.loads((run_dir / "derived.json").read_text())
    assert {k: run.data.params[f"derived.{k}"] for k in derived} == {
        k: str(v) for k, v in derived.items()
    }
    assert run.data.tags["run_dir"] == str(run_dir.resolve()) and run.info.status == "FINISHED"


class Lines(logging.Handler):
    """The lines a logger says, as they would reach the console (a module-scoped caplog)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture(scope="module")
def offline_run(tmp_path_factory, shakespeare):
    """A finished run whose store was unreachable: everything in its folder, nothing in MLflow."""
    run_dir = tmp_path_factory.mktemp("offline") / "run"
    overrides = nano_overrides(
        shakespeare,
        "tracking.mlflow=true",
        "tracking.plots=true",  # loss.png is an artifact sync sends
        f"tracking.uri={DOWN}",
        "train.sample_tokens=5",
    )
    said, logger = Lines(), logging.getLogger("gptlab.records.tracker")
    logger.addHandler(said)
    try:
        results = run_training(compose_config(overrides), run_dir)
    finally:
        logger.removeHandler(said)
    assert results["mlflow_run_id"] is None
    return run_dir, said.lines


@pytest.fixture
def folder(offline_run, tmp_path):
    """A copy of the offline run in this test's own folder (the run_dir tag names the copy)."""
    return Path(shutil.copytree(offline_run[0], tmp_path / "run"))


@pytest.mark.integration
def test_the_warning_says_how_to_record_the_run_later(offline_run):
    run_dir, messages = offline_run
    (message,) = [m for m in messages if "MLflow disabled" in m]
    assert message == (
        f"MLflow disabled for this run: server {DOWN} unreachable (Connection refused); the run "
        f"folder still "
        f"records everything; record it later with: python -m gptlab.sync {run_dir.resolve()}"
    )


@pytest.mark.parametrize(
    "args,expected",
    [
        (["a", "tracking.uri=x", "b"], ["tracking.uri=x", "sync.folders=['a','b']"]),
        (["--cfg", "job", "a"], ["--cfg", "job", "sync.folders=['a']"]),
        (["-c", "job"], ["-c", "job"]),
        (["--info", "config", "a"], ["--info", "config", "sync.folders=['a']"]),
        (["--info", "a"], ["--info", "sync.folders=['a']"]),
        (["sync.folders=[a]"], ["sync.folders=[a]"]),
        ([], []),
    ],
)
def test_the_words_without_equals_are_the_folders(args, expected):
    assert gather_words(args) == expected


def test_folders_are_given_one_way():
    from gptlab.errors import GptlabError

    with pytest.raises(GptlabError, match="not both"):
        gather_words(["sync.folders=[a]", "b"])


@pytest.mark.integration
def test_folders_are_taken_as_typed():
    names = [
        "outputs/sweeps/2026-11-30_06-22-48.746659",
        "my runs/it's",
        "a,b",
        "1e5",
        "true",
        "[x]",
    ]
    assert list(compose("sync", gather_words(names)).sync.folders) == names
    assert list(compose("sync").sync.folders) == [] and compose("sync").tracking.uri is None


def logged_models(uri, run):
    return client(uri).search_logged_models(
        [run.info.experiment_id], f"source_run_id = '{run.info.run_id}'"
    )


@pytest.mark.integration
def test_a_second_sync_adds_nothing(folder, tmp_path, capsys):
    uri = f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}"
    (line,) = main([str(folder), f"tracking.uri={uri}"])
    (run,) = all_runs(uri)
    points, params = sum(len(s) for s in expected_points(folder).values()), param_count(folder)
    # and the model the run's end would have logged, once
    (model,) = logged_models(uri, run)
    assert line == (
        f"{folder}: recorded as run {run.info.run_id} ({points} metric points, {params} params, 4 "
        f"artifacts, FINISHED, its model {model.model_uri})"
    )
    assert_complete(uri, run, folder)
    assert (
        run.info.run_name == "gpt_nano-shakespeare_char-cpu"
        and run.data.tags["recorded_by"] == "gptlab.sync"
    )
    assert client(uri).get_experiment(run.info.experiment_id).name == "gpt_nano-shakespeare_char"
    assert capsys.readouterr().out == line + "\n"
    # the data it trained on, as dataset inputs, as a live run records them
    recorded = {(i.dataset.name, i.dataset.digest) for i in run.inputs.dataset_inputs}
    assert recorded == {(d["name"], d["digest"]) for d in lineage.read(folder)}
    # again, and again through the folder that holds it: the same single run, nothing sent
    assert sync([folder], uri) == [f"{folder}: up to date"]
    assert main([str(tmp_path), f"tracking.uri={uri}"]) == [f"{folder}: up to date"]
    (again,) = all_runs(uri)
    assert again.info.run_id == run.info.run_id and recorded_points(
        uri, run.info.run_id
    ) == recorded_points(uri, again.info.run_id)


@pytest.mark.integration
def test_the_count_sync_says_is_what_the_store_holds_and_the_model_adds_no_metric(folder, tmp_path):
    """The run's metric points in the store are the N of sync's line, under the run's own names
    only: the model it logged carries the run's figures at its step (summary/best_val_loss,
    val/loss, ...; the validation ones naming the data), not copies under names of its own."""
    uri = f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}"
    (line,) = sync([folder], uri)
    (run,) = all_runs(uri)
    held = {
        name: len(client(uri).get_metric_history(run.info.run_id, name))
        for name in run.data.metrics
    }
    assert f"({sum(held.values())} metric points, " in line, (line, held)
    assert set(held) <= {*METRIC_NAMES.values(), *SUMMARY_METRICS.values()}, sorted(held)
    (model,) = logged_models(uri, run)
    figures = {m.key: m for m in model.metrics}
    assert {"summary/best_val_loss", "val/loss"} <= set(figures) <= set(held)
    validation = next(d for d in lineage.read(folder) if d["context"] == "validation")
    assert figures["summary/best_val_loss"].dataset_digest == validation["digest"]


@pytest.mark.integration
def test_a_partly_recorded_run_is_completed_not_duplicated(folder, tmp_path):
    from mlflow.entities import Metric

    uri = f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}"
    c = client(uri)
    exp = c.create_experiment("elsewhere")
    run = c.create_run(exp, tags={"run_dir": str(folder)}, run_name="half")
    rows = read_metrics(folder)
    half = [
        Metric(n, v, 0, row["step"])
        for row in rows[: len(rows) // 2]
        for n, v in mlflow_metrics(row).items()
    ]
    c.log_batch(run.info.run_id, metrics=half, params=[])
    c.log_param(run.info.run_id, "model.name", "gpt_nano")
    (line,) = sync([folder], uri)
    sent, params = (
        sum(len(s) for s in expected_points(folder).values()) - len(half),
        param_count(folder) - 1,
    )
    (model,) = logged_models(uri, run)
    assert (
        line
        == f"{folder}: recorded as run {run.info.run_id} ({sent} metric points, {params} params, 4 "
        f"artifacts, FINISHED, its model {model.model_uri})"
    )
    (done,) = all_runs(uri)
    assert done.info.run_name == "half"  # the run it was, completed in place
    assert_complete(uri, done, folder)
    assert sync([folder], uri) == [f"{folder}: up to date"]


@pytest.mark.integration
def test_results_json_names_the_run_and_a_run_without_results_stays_running(folder, tmp_path):
    uri = f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}"
    c = client(uri)
    # no run_dir tag: found by results.json's id
    run = c.create_run(c.create_experiment("x"), run_name="by id")
    results = json.loads((folder / "results.json").read_text())
    (folder / "results.json").write_text(json.dumps({**results, "mlflow_run_id": run.info.run_id}))
    assert sync([folder], uri)[0].startswith(f"{folder}: recorded as run {run.info.run_id} (")
    assert client(uri).get_run(run.info.run_id).info.status == "FINISHED"
    # a run still going (or one that died): recorded, its status left RUNNING until it has results
    live = Path(shutil.copytree(folder, tmp_path / "live"))
    (live / "results.json").unlink()
    (line,) = sync([live], uri)
    assert (
        line.endswith("(no results.json yet: its status is left as it is)")
        and "recorded as run" in line
    )
    (rec,) = [r for r in all_runs(uri) if r.data.tags.get("run_dir") == str(live)]
    assert rec.info.status == "RUNNING"
    assert sync([live], uri) == [
        f"{live}: up to date (no results.json yet: its status is left as it is)"
    ]
    # a run of tracking.mlflow=false is not recorded; a deleted run stays deleted
    off = Path(shutil.copytree(folder, tmp_path / "off"))
    config = (off / "config_resolved.yaml").read_text()
    (off / "config_resolved.yaml").write_text(config.replace("  mlflow: true", "  mlflow: false"))
    assert sync([off], uri) == [f"{off}: skipped (it ran with tracking.mlflow=false)"]
    c.delete_run(rec.info.run_id)
    assert sync([live], uri) == [f"{live}: skipped (its MLflow run {rec.info.run_id} is deleted)"]


@pytest.mark.integration
def test_an_earlier_run_moved_aside_in_the_folder_is_not_mixed_with_this_one(folder, tmp_path):
    """train.resume=never moves an earlier run's files to previous/<time>/; its MLflow run had the
    same run_dir tag, and must not be completed with the new run's records."""
    uri = f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}"
    c = client(uri)
    earlier = c.create_run(
        c.create_experiment("x"), tags={"run_dir": str(folder)}, run_name="earlier"
    )
    (folder / "previous" / "2026-11-30_05-00-00").mkdir(parents=True)
    (folder / "previous" / "2026-11-30_05-00-00" / "results.json").write_text(
        json.dumps({"mlflow_run_id": earlier.info.run_id})
    )
    (line,) = sync([folder], uri)
    (run,) = [r for r in all_runs(uri) if r.info.run_id != earlier.info.run_id]
    assert line.startswith(f"{folder}: recorded as run {run.info.run_id} (")
    assert_complete(uri, run, folder)
    assert not client(uri).get_run(earlier.info.run_id).data.metrics
    assert sync([folder], uri) == [f"{folder}: up to date"]


@pytest.mark.integration
def test_a_sweep_folder_nests_its_jobs_under_a_parent_made_from_sweep_json(folder, tmp_path):
    sweep = tmp_path / "sweep"
    for num, lr in (("0", "0.001"), ("1", "0.003")):
        job = Path(shutil.copytree(folder, sweep / num))
        (job / ".hydra").mkdir()
        (job / ".hydra" / "overrides.yaml").write_text(f"- model=gpt_nano\n- optimizer.lr={lr}\n")
    info = {
        "kind": SWEEP_KIND,
        "parent_run_id": "0" * 32,  # the parent in the store the sweep used, not in this one
        "experiment_id": "7",
        "experiment": "lr-sweep",
        "uri": DOWN,
        "overrides": ["model=gpt_nano", "optimizer.lr=1e-3,3e-3"],
        "swept": ["optimizer.lr"],
        "launcher": "basic",
        "run_name": "gpt_nano-shakespeare_char-cpu sweep optimizer.lr=1e-3,3e-3",
    }
    (sweep / "sweep.json").write_text(json.dumps(info))
    uri = f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}"
    lines = sync([sweep / "0", sweep / "1"], uri)
    assert [line.split(": ")[0] for line in lines] == [str(sweep / "0"), str(sweep / "1")]
    runs = all_runs(uri)
    (parent,) = [r for r in runs if r.data.tags.get("run_type") == "sweep"]
    kids = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert (
        parent.info.run_name == info["run_name"]
        and parent.data.params["optimizer.lr"] == "1e-3,3e-3"
    )
    assert sorted(k.info.run_name for k in kids) == [
        "gpt_nano-shakespeare_char-cpu optimizer.lr=0.001",
        "gpt_nano-shakespeare_char-cpu optimizer.lr=0.003",
    ]
    assert {k.info.experiment_id for k in kids} == {parent.info.experiment_id}
    assert client(uri).get_experiment(parent.info.experiment_id).name == "lr-sweep"
    parent = client(uri).get_run(parent.info.run_id)
    assert parent.info.status == "FINISHED" and parent.data.tags["jobs"] == "2"
    assert "summary/best_val_loss" in parent.data.metrics
    assert main([str(sweep), f"tracking.uri={uri}"]) == [
        f"{sweep / '0'}: up to date",
        f"{sweep / '1'}: up to date",
    ]
    assert len(all_runs(uri)) == 3


@pytest.mark.slow
def test_an_unreachable_store_is_one_line_and_exit_code_2(folder, tmp_path):
    r = run_cli(["gptlab.sync", str(folder), f"tracking.uri={DOWN}"], cwd=tmp_path, timeout=120)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0] == (
        f"gptlab.sync: error: {folder.resolve()}: not recorded: MLflow server {DOWN} unreachable "
        f"(Connection "
        "refused); start it (or name another store with tracking.uri=...), then run gptlab.sync "
        "again (it sends "
        "only what the store lacks)"
    )
    # the store the run was configured with
    r = run_cli(["gptlab.sync", str(folder)], cwd=tmp_path, timeout=120)
    assert r.returncode == 2 and f"MLflow server {DOWN} unreachable" in r.stderr


def configured_store(run_dir, uri):
    """Make the run folder say it ran with tracking.uri=uri (None: the local store)."""
    import yaml

    path = run_dir / "config_resolved.yaml"
    config = yaml.safe_load(path.read_text())
    config["tracking"]["uri"] = uri
    path.write_text(yaml.safe_dump(config, sort_keys=False))


@pytest.mark.slow
def test_every_folder_is_tried_and_each_one_not_recorded_is_one_line(offline_run, tmp_path):
    """With no folders: every run folder under outputs/, in order; a store that does not answer
    fails its folders (one line each), the folders after it are still recorded, and the exit code is
    2."""
    runs = tmp_path / "outputs" / "runs"
    down, local, down_too = (
        Path(shutil.copytree(offline_run[0], runs / name)) for name in ("a", "b", "c")
    )
    configured_store(local, None)  # the local store, outputs/mlflow.db
    r = run_cli(["gptlab.sync"], cwd=tmp_path, timeout=180)
    assert r.returncode == 2, r.stdout + r.stderr[-3000:]
    lines = r.stderr.strip().splitlines()
    assert [line.partition(": not recorded: ")[0] for line in lines] == [
        f"gptlab.sync: error: {down.resolve()}",
        f"gptlab.sync: error: {down_too.resolve()}",
    ], r.stderr
    assert all(
        f"MLflow server {DOWN} unreachable" in line and "gptlab.sync again" in line
        for line in lines
    )
    (recorded,) = r.stdout.strip().splitlines()
    assert recorded.startswith(f"{local.resolve()}: recorded as run ")
    (run,) = all_runs(f"sqlite:///{tmp_path / 'outputs' / 'mlflow.db'}")
    assert_complete(f"sqlite:///{tmp_path / 'outputs' / 'mlflow.db'}", run, local.resolve())


# ---- one SQLite store, many processes ------------------------------------------------------------

RACE = """
import os, sys, time, traceback
import mlflow  # imported once: each racer is a fork with no connection of its own yet
from gptlab.records.store import artifact_root, get_or_create_experiment, mlflow_client
uri, start, n = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
racers = []
for _ in range(n):
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            time.sleep(max(0.0, start - time.time()))  # all at once
            client = mlflow_client(uri)
            run = client.create_run(get_or_create_experiment(client, "race", artifact_root(uri)))
            client.set_terminated(run.info.run_id)
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        os._exit(code)
    racers.append(pid)
print([os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in racers])
"""


@pytest.mark.integration
def test_processes_that_open_one_fresh_sqlite_store_at_once_all_record(tmp_path):
    """Each process's first connection creates and migrates the store; without the lock they
    race (four processes, forked from one that imported MLflow)."""
    uri = f"sqlite:///{tmp_path / 'new' / 'mlflow.db'}"
    start = str(time.time() + 3)
    r = subprocess.run([sys.executable, "-c", RACE, uri, start, "4"], capture_output=True,
                       text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0 and r.stdout.strip().splitlines()[-1] == "[0, 0, 0, 0]", (
        r.stdout + r.stderr
    )
    assert [r.info.status for r in all_runs(uri)] == ["FINISHED"] * 4
    assert (tmp_path / "new" / "mlflow.db.lock").is_file()


def test_a_locked_database_is_tried_again_and_other_errors_are_not(monkeypatch):
    from mlflow.exceptions import MlflowException

    from gptlab.records import store as tracking

    monkeypatch.setattr(tracking.time, "sleep", lambda s: None)
    calls = []

    def flaky(x, fails=2, error="(sqlite3.OperationalError) database is locked", kind=None):
        calls.append(x)
        if len(calls) <= fails:
            raise (kind or MlflowException)(error)  # MLflow wraps SQLAlchemy's error
        return x

    assert tracking.retry_locked(flaky, 7) == 7 and len(calls) == 3
    calls.clear()
    with pytest.raises(MlflowException, match="no such table"):
        tracking.retry_locked(flaky, 7, error="no such table")
    assert len(calls) == 1
    calls.clear()
    with pytest.raises(MlflowException, match="locked"):
        tracking.retry_locked(flaky, 7, fails=100)
    assert len(calls) == tracking.LOCKED_RETRIES
    calls.clear()
    with pytest.raises(RuntimeError, match="locked"):  # a bug's error is no store's: raised at once
        tracking.retry_locked(flaky, 7, kind=RuntimeError)
    assert len(calls) == 1


# ---- the real commands --------------------------------------------------------------------------


def train_args(shakespeare, *extra):
    return [
        "gptlab.train",
        "model=gpt_nano",
        f"data.path={shakespeare}",
        "train.max_steps=10",
        "train.batch_size=8",
        "train.eval_every=5",
        "train.eval_steps=2",
        "train.log_every=5",
        "train.sample_tokens=5",
        *extra,
    ]


@pytest.mark.slow
def test_concurrent_runs_on_one_fresh_sqlite_store_are_all_recorded(shakespeare, tmp_path):
    """Two runs started at once on a store that does not exist yet: each one creates (and migrates)
    it (test_processes_that_open_one_fresh_sqlite_store_at_once_all_record races four)."""
    uri = f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}"
    procs = [
        start_cli(
            train_args(shakespeare, f"tracking.uri={uri}", f"hydra.run.dir={tmp_path / str(i)}"),
            tmp_path,
            merge_stderr=True,
        )
        for i in range(2)
    ]
    outputs = [p.communicate(timeout=400)[0] for p in procs]
    assert [p.returncode for p in procs] == [0] * 2, outputs
    assert not [o for o in outputs if "MLflow disabled" in o], outputs
    runs = all_runs(uri)
    assert len(runs) == 2 and {r.info.status for r in runs} == {"FINISHED"}
    assert {r.data.tags["run_dir"] for r in runs} == {str(tmp_path / str(i)) for i in range(2)}
    # and each run folder knows its run: sync finds every one recorded
    lines = sync([tmp_path / str(i) for i in range(2)])
    assert lines == [f"{tmp_path / str(i)}: up to date" for i in range(2)]


@pytest.mark.slow
def test_a_run_made_offline_is_recorded_through_a_server_later(
    offline_sweep, tmp_path, monkeypatch
):
    """The acceptance case: the store is down during the run (a job of offline_sweep, whose warning
    the test above checks); later, sync records all of it, once."""
    # a copy out of its sweep folder: a run of its own
    run_dir = Path(shutil.copytree(offline_sweep[0] / "0", tmp_path / "run"))
    server, uri = start_mlflow_server(tmp_path / "server")
    # sync in this process, from tmp_path (synced_sweep runs the command): the server is the point
    monkeypatch.chdir(tmp_path)
    try:
        (line,) = main([str(run_dir), f"tracking.uri={uri}"])
        (run,) = all_runs(uri)
        assert line.startswith(f"{run_dir}: recorded as run {run.info.run_id} (")
        assert_complete(uri, run, run_dir)
        # per metric name, as many points as metrics.jsonl has values of it
        counts = Counter(n for row in read_metrics(run_dir) for n in mlflow_metrics(row))
        points = recorded_points(uri, run.info.run_id)
        assert {n: len(points[n]) for n in counts} == dict(counts)
        assert run.data.tags["overrides"].startswith("model=gpt_nano ")
        artifacts = {a.path for a in client(uri).list_artifacts(run.info.run_id)}
        assert artifacts == {"config_resolved.yaml", "results.json", "samples.txt", "loss.png"}
        # the model the run's end would have logged, once
        models = logged_models(uri, run)
        steps = json.loads((run_dir / "results.json").read_text())["steps"]
        assert [m.tags["gptlab.step"] for m in models] == [str(steps)]
        assert line.endswith(f", FINISHED, its model {models[0].model_uri})")
        params = dict(run.data.params)
        # again: nothing sent
        assert main([str(run_dir), f"tracking.uri={uri}"]) == [f"{run_dir}: up to date"]
        (again,) = all_runs(uri)
        assert again.info.run_id == run.info.run_id and dict(again.data.params) == params
        assert recorded_points(uri, run.info.run_id) == points
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)
    # sync left nothing behind
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run", "server"]


@pytest.fixture(scope="module")
def offline_sweep(shakespeare, tmp_path_factory):
    """(sweep folder, the finished command) of a 2-job sweep whose store was down throughout."""
    sweep = tmp_path_factory.mktemp("offline_sweep") / "sweep"
    args = train_args(
        shakespeare, f"tracking.uri={DOWN}", "optimizer.lr=1e-3,3e-3", f"hydra.sweep.dir={sweep}"
    )
    r = run_cli([args[0], "-m", *args[1:]], cwd=sweep.parent)
    assert r.returncode == 0, r.stderr[-3000:]
    return sweep, r


@pytest.mark.slow
def test_a_sweep_on_a_store_that_is_down_says_so_once_and_each_job_in_one_line(offline_sweep):
    """No urllib3 retry lines, no MLflow exception quoted: the parent's one line and each job's."""
    sweep, r = offline_sweep
    for text in (r.stdout, r.stderr):
        assert "Retrying" not in text and "Max retries" not in text and "Traceback" not in text, (
            text[-3000:]
        )
    lines = r.stderr.strip().splitlines()
    assert all(line.startswith("gptlab: ") for line in lines), r.stderr
    (parent,) = [line for line in lines if "no MLflow parent run" in line]
    assert parent == (
        f"gptlab: no MLflow parent run for this sweep: server {DOWN} unreachable (Connection "
        f"refused); the sweep "
        "goes on unrecorded in MLflow (each run folder keeps everything); record it later with: "
        f"python -m gptlab.sync {sweep.resolve()}"
    )
    jobs = [line for line in lines if "MLflow disabled for this run" in line]
    assert [job.rpartition(" ")[2] for job in jobs] == [
        str(sweep.resolve() / "0"),
        str(sweep.resolve() / "1"),
    ]
    assert len(lines) == 3, r.stderr


@pytest.fixture(scope="module")
def synced_sweep(offline_sweep, tmp_path_factory):
    """(store uri, the finished command) of offline_sweep recorded by `python -m gptlab.sync`; its
    tests name offline_sweep first, so that xdist groups them with it (conftest.xdist_group)."""
    cwd = tmp_path_factory.mktemp("synced")
    uri = f"sqlite:///{cwd / 'store' / 'mlflow.db'}"
    r = run_cli(["gptlab.sync", str(offline_sweep[0]), f"tracking.uri={uri}"], cwd=cwd, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    return uri, r


@pytest.mark.slow
def test_an_offline_sweep_is_recorded_as_a_parent_with_its_jobs(offline_sweep, synced_sweep):
    """A sweep whose store was down has no sweep.json: its parent run is made from Hydra's
    multirun.yaml."""
    sweep, _ = offline_sweep
    assert not (sweep / "sweep.json").exists()
    uri, _ = synced_sweep
    runs = all_runs(uri)
    (parent,) = [x for x in runs if x.data.tags.get("run_type") == "sweep"]
    kids = sorted((x for x in runs if x is not parent), key=lambda x: x.info.run_name)
    assert parent.info.run_name == "gpt_nano-shakespeare_char-cpu sweep optimizer.lr=1e-3,3e-3"
    assert [k.info.run_name for k in kids] == [
        "gpt_nano-shakespeare_char-cpu optimizer.lr=0.001",
        "gpt_nano-shakespeare_char-cpu optimizer.lr=0.003",
    ]
    assert {k.data.tags["mlflow.parentRunId"] for k in kids} == {parent.info.run_id}
    for kid in kids:
        assert_complete(uri, kid, Path(kid.data.tags["run_dir"]))
    assert client(uri).get_run(parent.info.run_id).info.status == "FINISHED"
    # again, in this process (the command's exit is checked in synced_sweep): nothing sent
    assert main([str(sweep), f"tracking.uri={uri}"]) == [
        f"{sweep / '0'}: up to date",
        f"{sweep / '1'}: up to date",
    ]
    assert len(all_runs(uri)) == 3


def comparable(run, folder_tags=("run_dir", "sweep_dir", "mlflow.parentRunId", "recorded_by")):
    """A run's name and tags, without those that name its own folder or store (the overrides tag
    loses its tracking.uri=..., the one override the two sweeps differ in)."""
    tags = {k: v for k, v in run.data.tags.items() if k not in folder_tags}
    if "overrides" in tags:
        tags["overrides"] = " ".join(
            o for o in tags["overrides"].split() if not o.startswith("tracking.uri=")
        )
    return run.info.run_name, tags


@pytest.mark.slow
def test_a_sweep_synced_later_is_named_and_tagged_as_the_same_sweep_recorded_live(
    offline_sweep, synced_sweep, shakespeare, tmp_path
):
    """One function names and tags a run (records/identity.py): live and synced records agree,
    host and git_commit included (the run folder's run.json keeps them)."""
    synced_uri, _ = synced_sweep
    live_uri = f"sqlite:///{tmp_path / 'live' / 'mlflow.db'}"
    sweep_dir = f"hydra.sweep.dir={tmp_path / 'sweep'}"
    args = train_args(shakespeare, f"tracking.uri={live_uri}", "optimizer.lr=1e-3,3e-3", sweep_dir)
    r = run_cli([args[0], "-m", *args[1:]], cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    live, synced = all_runs(live_uri), all_runs(synced_uri)
    assert len(live) == len(synced) == 3
    assert sorted(map(comparable, synced), key=repr) == sorted(map(comparable, live), key=repr)
    kids = [x for x in live if x.data.tags.get("run_type") != "sweep"]
    assert len(kids) == 2 and all({"host", "git_commit"} <= set(k.data.tags) for k in kids)
