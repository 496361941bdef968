"""MLflow records, on a real local store, and a dead tracking server that must not stop training;
the optional records (loss plot, system metrics, TensorBoard) and what a run does without them."""

import importlib.util
import json
import shlex
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers import compose_config, nano_overrides, run_cli, typed

from gptlab.errors import GptlabError
from gptlab.records.identity import RunIdentity, sweep_run_name
from gptlab.records.store import check_uri, default_uri, runs_url, ui_command
from gptlab.records.tracker import Tracker
from gptlab.train import run_training


def client_for(tmp_path):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'outputs' / 'mlflow.db'}")


@pytest.mark.integration
def test_mlflow_run_has_params_metrics_and_artifacts(tmp_path, shakespeare, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # the default store is ./outputs/mlflow.db
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "0.2")
    tensorboard = importlib.util.find_spec("tensorboard") is not None
    run_dir = tmp_path / "outputs" / "runs" / "r1"
    results = run_training(
        compose_config(
            nano_overrides(
                shakespeare,
                "tracking.mlflow=true",
                "tracking.plots=true",
                "tracking.system_metrics=true",
                f"tracking.tensorboard={tensorboard}",
            )
        ),
        run_dir,
    )
    client = client_for(tmp_path)
    run = client.get_run(results["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    assert run.info.run_name == "gpt_nano-shakespeare_char-cpu"
    assert run.data.params["model.n_layer"] == "2" and run.data.params["derived.accum_steps"] == "1"
    assert len(run.data.params["derived.tokenizer_sha256"]) == 64
    assert run.data.tags["hardware"] == "cpu" and "host" in run.data.tags
    exp = client.get_experiment(run.info.experiment_id)
    assert exp.name == "gpt_nano-shakespeare_char"
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert [m.step for m in history] == [1, 5, 10, 15, 20]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "val/loss")] == [10, 20]
    # every point MLflow holds is the run folder's own value at that step (metrics.jsonl is the
    # record)
    from gptlab.records.store import METRIC_NAMES, NOT_METRICS

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # every key the run wrote reaches MLflow, under its own name unless METRIC_NAMES renames it
    keys = {k for r in rows for k in r} - NOT_METRICS
    for key, name in {**{k: k for k in keys}, **METRIC_NAMES}.items():
        expected = {r["step"]: r[key] for r in rows if key in r}
        got = {m.step: m.value for m in client.get_metric_history(run.info.run_id, name)}
        optional = key.startswith("hellaswag")  # only when eval.hellaswag.every is set
        assert (got or optional) and got == pytest.approx(expected, rel=1e-6), name
    # the results again, once, as sortable summary/* metrics
    assert run.data.metrics["summary/best_val_loss"] == pytest.approx(results["best_val_loss"])
    assert run.data.metrics["summary/wall_s"] == pytest.approx(results["wall_s"])
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"results.json", "samples.txt", "config_resolved.yaml", "loss.png"} <= artifacts
    assert (run_dir / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((run_dir / "results.json").read_text())["mlflow_run_id"] == run.info.run_id
    out = capsys.readouterr().out
    assert (
        "open the UI with: python -m gptlab.ui tracking.experiment=gpt_nano-shakespeare_char" in out
    )
    # opt-in system metrics, sampled by MLflow's own monitor
    assert "system/cpu_utilization_percentage" in run.data.metrics
    assert "system/system_memory_usage_megabytes" in run.data.metrics
    if tensorboard:  # the same metric names in TensorBoard event files
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(str(run_dir / "tensorboard"))
        events.Reload()
        assert {"train/loss", "val/loss", "opt/lr", "perf/tokens_per_s"} <= set(
            events.Tags()["scalars"]
        )
        assert [e.step for e in events.Scalars("val/loss")] == [10, 20]


@pytest.mark.integration
def test_unreachable_tracking_server_still_completes_the_run(tmp_path, shakespeare, capsys):
    run_dir = tmp_path / "run"
    overrides = nano_overrides(
        shakespeare, "tracking.mlflow=true", "tracking.uri=http://127.0.0.1:9"
    )
    results = run_training(compose_config(overrides), run_dir)
    # gptlab's console: one warning line, not Python's warning and its source line
    err = capsys.readouterr().err
    (line,) = [line for line in err.splitlines() if "MLflow" in line]
    assert line.startswith(
        "gptlab: MLflow disabled for this run: server http://127.0.0.1:9 unreachable (Connection "
    )
    assert "tracking.py:" not in err and "Warning" not in err
    assert results["steps"] == 20 and results["mlflow_run_id"] is None
    assert (run_dir / "results.json").is_file()
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 5


@pytest.mark.integration
def test_a_sink_of_ones_own_is_one_class_and_gets_every_row_metrics_jsonl_gets(
    tmp_path, shakespeare, monkeypatch, capsys
):
    """A new place to record is one Sink subclass and one entry in SINKS: it receives every logged
    row (metrics.jsonl's, exactly), the results and the end; a sink that fails is said once and
    dropped, and the run goes on."""
    from gptlab.records import tracker as tracking
    from gptlab.records.sinks import Sink

    class Rows(Sink):
        rows, results, ended = [], [], []

        def log_metrics(self, step, metrics):
            Rows.rows.append({"step": step, **{k: v for k, v in metrics.items() if v is not None}})

        def write_results(self, results):
            Rows.results.append(results)

        def finish(self, status, error):
            Rows.ended.append(status)

    class Broken(Sink):
        name = "the broken store"
        calls = 0

        def log_side_metrics(self, step, metrics):
            Broken.calls += 1
            raise ConnectionError("gone")

    monkeypatch.setattr(tracking, "SINKS", (*tracking.SINKS, Rows, Broken))
    run_dir = tmp_path / "run"
    results = run_training(compose_config(nano_overrides(shakespeare)), run_dir)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 5, 10, 15, 20] and Rows.rows == rows
    assert Rows.results == [json.loads((run_dir / "results.json").read_text())]
    assert Rows.ended == ["FINISHED"] and results["steps"] == 20
    assert Broken.calls == 1
    (line,) = [line for line in capsys.readouterr().err.splitlines() if "broken" in line]
    assert line.endswith(
        "the broken store records stopped for this run (ConnectionError: gone); the run folder "
        "still records everything"
    )


@pytest.mark.parametrize(
    "uri",
    [
        "outputs/mlruns",
        "/data/mlruns",
        "file:///data/mlruns",
        "sqlite:////data/mlflow.db",
        "http://127.0.0.1:5000",
        "https://mlflow.example.org",
        "postgresql://me@db/mlflow",
        "postgresql+psycopg2://me@db/mlflow",
        "databricks",
        None,
    ],
)
def test_the_stores_mlflow_knows_are_accepted_without_being_opened(uri):
    check_uri(uri)


@pytest.mark.parametrize(
    "uri", ["garbage://x", "htp://127.0.0.1:5000", "sqlit:///outputs/mlflow.db"]
)
def test_a_scheme_mlflow_does_not_know_is_refused_naming_the_ones_it_does(uri):
    with pytest.raises(GptlabError) as e:
        check_uri(uri)
    assert str(e.value).startswith(
        f"tracking.uri={uri}: {uri.partition(':')[0]!r} is not a scheme MLflow knows;"
    )
    assert all(
        s in str(e.value) for s in ("folder path", "sqlite:///", "http(s)://", "postgresql://")
    )


@pytest.mark.slow
@pytest.mark.parametrize("sweep", [False, True])
def test_a_store_mlflow_does_not_know_is_one_line_at_the_start(tmp_path, shakespeare, sweep):
    """Not a run (or a sweep) that trains unrecorded under a warning about MLflow's model
    registry."""
    overrides = nano_overrides(shakespeare, "tracking.mlflow=true", "tracking.uri=garbage://x")
    r = run_cli(
        ["gptlab.train", *(["-m", "optimizer.lr=1e-3,3e-3"] if sweep else []), *overrides],
        cwd=tmp_path,
    )
    assert r.returncode == 2, r.stdout + r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith(
        "gptlab.train: error: tracking.uri=garbage://x: 'garbage' is not a scheme MLflow knows;"
    )
    assert "registry" not in r.stderr and "tracking.py:" not in r.stderr
    assert "step" not in r.stdout and "Launching" not in r.stdout  # nothing ran


@pytest.mark.integration
def test_a_failing_run_is_failed_in_mlflow_with_the_error_as_a_tag(
    tmp_path, shakespeare, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "outputs" / "runs" / "diverged"
    cfg = compose_config(
        nano_overrides(
            shakespeare, "tracking.mlflow=true", "tracking.plots=true", "optimizer.lr=1e7"
        )
    )
    with pytest.raises(GptlabError, match="diverged"):
        run_training(cfg, run_dir)
    (run,) = client_for(tmp_path).search_runs(["1"])
    assert run.info.status == "FAILED"
    assert run.data.tags["error"].startswith("GptlabError: train loss is nan")
    assert (run_dir / "loss.png").is_file()  # what there was of the curves, for the post-mortem


@pytest.mark.integration
def test_a_run_without_matplotlib_or_tensorboard_completes_and_says_what_is_missing(
    tmp_path, shakespeare, monkeypatch, capsys
):
    for name in ("matplotlib", "torch.utils.tensorboard"):
        # `import` now raises ImportError, as if not installed
        monkeypatch.setitem(sys.modules, name, None)
    run_dir = tmp_path / "run"
    results = run_training(
        compose_config(
            nano_overrides(
                shakespeare,
                "tracking.plots=true",
                "tracking.tensorboard=true",
                "tracking.system_metrics=true",
            )
        ),
        run_dir,
    )
    assert results["steps"] == 20 and (run_dir / "results.json").is_file()
    assert not (run_dir / "loss.png").exists() and not (run_dir / "tensorboard").exists()
    err = capsys.readouterr().err
    assert "loss.png skipped: matplotlib is not installed (pip install matplotlib)" in err
    assert "TensorBoard event files skipped: the tensorboard package is not installed" in err
    assert "system metrics skipped" in err  # they live in MLflow, which this run has off


def test_a_metric_without_a_name_of_its_own_is_recorded_under_its_key():
    """A key the loop writes that METRIC_NAMES does not rename reaches MLflow and TensorBoard as
    itself: adding a metric needs no list; None values and the step are no points."""
    from gptlab.records import store

    sent = store.mlflow_metrics({"step": 3, "train_loss": 2.5, "lr": None, "val/books/loss": 0.1})
    assert sent == {"train/loss": 2.5, "val/books/loss": 0.1}


def test_ui_command_names_the_store_and_the_experiment(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert (
        ui_command(default_uri(Path("outputs")), "gpt_nano-shakespeare_char")
        == "python -m gptlab.ui tracking.experiment=gpt_nano-shakespeare_char"
    )
    # quoted for the shell, and the values for Hydra
    assert shlex.split(ui_command("sqlite:////data/my runs/mlflow.db", "lr sweep")) == [
        "python",
        "-m",
        "gptlab.ui",
        "tracking.uri='sqlite:////data/my runs/mlflow.db'",
        "tracking.experiment='lr sweep'",
    ]
    assert runs_url("http://127.0.0.1:5000", "3").startswith(
        "http://127.0.0.1:5000/#/experiments/3/runs?"
    )
    assert "orderByKey=metrics.%60summary%2Fbest_val_loss%60" in runs_url(
        "http://h:1", "3", best_first=True
    )


def test_a_sweep_job_is_named_after_its_own_overrides():
    sweep = {
        "overrides": ["model=gpt_nano", "train.save_checkpoints=false", "optimizer.lr=1e-3,3e-3"],
        "swept": ["optimizer.lr"],
    }
    # as Hydra passes it on
    job = ["model=gpt_nano", "train.save_checkpoints=False", "optimizer.lr=0.003"]
    assert (
        sweep_run_name("gpt_nano-shakespeare_char-cpu", job, sweep)
        == "gpt_nano-shakespeare_char-cpu optimizer.lr=0.003"
    )
    # a sweeper that makes the values itself (Optuna, ...): whatever the job has that the sweep had
    # not
    assert (
        sweep_run_name(
            "b", ["model=gpt_nano", "optimizer.lr=0.0042"], {"overrides": ["model=gpt_nano"]}
        )
        == "b optimizer.lr=0.0042"
    )


@pytest.mark.integration
def test_a_resumed_run_goes_on_in_the_same_mlflow_run(tmp_path):
    cfg, outputs = typed("tracking", plots=False), tmp_path / "outputs"
    first = Tracker(
        tmp_path / "run",
        cfg,
        default_uri(outputs),
        RunIdentity("exp", "name", {}),
        {"train.max_steps": 10, "a": 1},
    )
    first.log_metrics(5, {"train_loss": 3.0, "tokens": 100})
    first.finish("KILLED")  # stopped (preempted) with a checkpoint holding first.run_id
    again = Tracker(
        tmp_path / "run",
        cfg,
        default_uri(outputs),
        RunIdentity("exp", "name", {}),
        {"train.max_steps": 20, "b": 2},
        first.run_id,
    )
    again.log_metrics(10, {"train_loss": 2.0, "tokens": 200})
    again.finish("FINISHED")
    assert again.run_id == first.run_id
    client = client_for(tmp_path)
    run = client.get_run(first.run_id)
    assert run.info.status == "FINISHED"
    # logged params cannot change
    assert run.data.params == {"train.max_steps": "10", "a": "1", "b": "2"}
    assert [(m.step, m.value) for m in client.get_metric_history(first.run_id, "train/loss")] == [
        (5, 3.0),
        (10, 2.0),
    ]
    assert len(client.search_runs([run.info.experiment_id])) == 1


# ---- the sender: a store that is slow, stopped or gone never holds the step loop ---------------


class StalledClient:
    """An MlflowClient whose store stops answering writes (a SIGSTOPped server) until `answer` is
    set; `fail` failures (no answer) come first. Run creation and params answer at once, as they
    did."""

    def __init__(self, fail: int = 0):
        import threading

        self.answer = threading.Event()
        self.fail = fail
        self.points = []  # (key, step) of every point stored, in order
        self.calls = []  # the other writes stored, in order

    def get_experiment_by_name(self, name):
        return SimpleNamespace(experiment_id="1")

    def create_run(self, experiment_id, run_name=None, tags=None):
        return SimpleNamespace(info=SimpleNamespace(run_id="run1", experiment_id=experiment_id))

    def _write(self):
        if self.fail:
            self.fail -= 1
            raise ConnectionError("connection refused")
        self.answer.wait()

    def log_batch(self, run_id, metrics=(), params=()):
        if params:
            return
        self._write()
        self.points += [(m.key, m.step) for m in metrics]

    def log_artifact(self, run_id, path, artifact_path=None):
        self._write()
        self.calls.append(("artifact", Path(path).name))

    def set_tag(self, run_id, key, value):
        self._write()
        self.calls.append(("tag", key))

    def set_terminated(self, run_id, status):
        self._write()
        self.calls.append(("status", status))


@pytest.fixture
def stalled(monkeypatch, tmp_path):
    """A Tracker on a StalledClient, with short waits: (tracker, client)."""
    from gptlab.records import tracker as tracking

    client = StalledClient()
    monkeypatch.setattr(tracking, "mlflow_client", lambda uri: client)
    monkeypatch.setattr(tracking.MLflowRun, "_check_reachable", staticmethod(lambda uri: None))
    monkeypatch.setattr(tracking, "SEND_FIRST_RETRY_S", 0.01)
    monkeypatch.setattr(tracking, "FINAL_FLUSH_S", 0.5)
    cfg = typed("tracking", "tracking.uri=http://127.0.0.1:9", plots=False, flush_every=5)
    tracker = Tracker(
        tmp_path / "run",
        cfg,
        default_uri(tmp_path / "outputs"),
        RunIdentity("exp", "name", {}),
        {"a": 1},
    )
    yield tracker, client
    client.answer.set()  # let an abandoned sender thread end


def log_steps(tracker, steps):
    """Log train_loss and lr at each step; the slowest log_metrics call, in seconds."""
    slowest = 0.0
    for step in steps:
        t = time.perf_counter()
        tracker.log_metrics(step, {"train_loss": 1.0 / step, "lr": 0.1})
        slowest = max(slowest, time.perf_counter() - t)
    return slowest


@pytest.mark.integration
def test_a_stopped_server_never_holds_the_step_loop_and_the_end_names_gptlab_sync(stalled, caplog):
    tracker, client = stalled
    # 600 points: 30 batches queued behind a store that waits
    slowest = log_steps(tracker, range(1, 301))
    # queued, not sent: no call waits on the store, which never answers here (0.2 ms typical; the
    # bound leaves room for a busy machine)
    assert slowest < 2, slowest
    t = time.perf_counter()
    with caplog.at_level("WARNING", logger="gptlab"):
        tracker.finish("FINISHED")
    assert time.perf_counter() - t < 15  # FINAL_FLUSH_S (0.5 s here), not the store's silence
    assert client.points == [] and client.calls == []
    (line,) = [r.getMessage() for r in caplog.records if "points not sent" in r.getMessage()]
    run_dir = (tracker.run_dir).resolve()
    assert line == (
        "MLflow server http://127.0.0.1:9 unreachable: 600 points not sent (nor the run's status); "
        f"they are in {run_dir / 'metrics.jsonl'} — run `python -m gptlab.sync {run_dir}`"
    )
    # the run folder has them all
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 300


def test_points_reach_a_server_that_answers_again_in_order_and_once(stalled):
    tracker, client = stalled
    client.fail = 3  # refused three times (a restarting server), then silent for a while
    log_steps(tracker, range(1, 101))
    client.answer.set()
    log_steps(tracker, range(101, 201))
    tracker.set_tag("expected_met", "true")
    tracker.finish("FINISHED")
    assert client.points == [(k, s) for s in range(1, 201) for k in ("train/loss", "opt/lr")]
    assert client.calls == [("tag", "expected_met"), ("status", "FINISHED")]
    assert tracker.mlflow.unsent == []


def test_the_sender_gives_up_a_call_the_store_refuses_and_the_oldest_points_past_its_bound(
    monkeypatch,
):
    import threading

    from gptlab.records.tracker import Call, Sender

    class Refused(Exception):
        error_code = "INVALID_PARAMETER_VALUE"

    def refuse():
        raise Refused("bad value")

    done = []
    hold = threading.Event()
    sender = Sender("server http://x", max_points=10)
    sender.put(Call("tag bad", refuse))  # a 4xx answer: not tried again
    sender.put(Call("metrics", hold.wait, points=4))  # holds the sender while the queue fills
    time.sleep(0.2)
    for i in range(4):  # 16 points queued behind the held call: the oldest two batches are given up
        sender.put(Call("metrics", lambda i=i: done.append(i), points=4))
    hold.set()
    left = sender.close(5)
    assert done == [2, 3]
    assert [(c.what, c.points) for c in left] == [("tag bad", 0), ("metrics", 4), ("metrics", 4)]


@pytest.mark.integration  # real MLflow stores, each migrated by MLflow: seconds
def test_a_new_sqlite_store_is_a_copy_of_one_migrated_once_and_records_as_mlflows_own(
    tmp_path, monkeypatch
):
    """Two new stores: the first makes the template (MLflow's migration), the second copies it; each
    records a run, and reads as a store MLflow migrated itself (same schema, same Default)."""
    import sqlite3

    from gptlab.records import store

    def schema(db):  # tables, their columns, indexes and the migration (not the order of CHECKs)
        with sqlite3.connect(db) as c:
            names = sorted(c.execute("select type, name from sqlite_master"))
            columns = {n: c.execute(f'pragma table_info("{n}")').fetchall() for t, n in names}
            return names, columns, c.execute("select version_num from alembic_version").fetchall()

    monkeypatch.setenv("GPTLAB_CACHE_DIR", str(tmp_path / "cache"))
    made, defaults = [], {}
    for name in ("a", "b", "mlflows_own"):
        if name == "mlflows_own":
            monkeypatch.setattr(store, "_migrated_template", lambda: 1 / 0)
        db = tmp_path / name / "mlflow.db"
        client = store.mlflow_client(store.local_uri(db))
        made.append(sorted((tmp_path / "cache" / "mlflow").iterdir()))
        default = client.get_experiment("0")
        defaults[name] = (default.name, default.artifact_location, default.lifecycle_stage)
        run = client.create_run("0")
        client.log_metric(run.info.run_id, "train_loss", 1.5, step=1)
        assert client.get_run(run.info.run_id).data.metrics == {"train_loss": 1.5}
    (template,) = made[0]
    assert made[1] == [template] and template.name.startswith("empty-store-")
    assert schema(tmp_path / "b" / "mlflow.db") == schema(tmp_path / "mlflows_own" / "mlflow.db")
    assert defaults["a"] == defaults["b"] == defaults["mlflows_own"]
    assert not list(tmp_path.glob("*/.*partial"))


@pytest.mark.integration
def test_a_store_whose_template_cannot_be_made_is_migrated_by_mlflow(tmp_path, monkeypatch):
    from gptlab.records import store

    (tmp_path / "cache").write_text("a file where the cache folder would be")
    monkeypatch.setenv("GPTLAB_CACHE_DIR", str(tmp_path / "cache"))
    db = tmp_path / "run" / "mlflow.db"
    client = store.mlflow_client(store.local_uri(db))
    assert client.get_experiment("0").name == "Default" and db.is_file()
