"""A sweep, `python -m gptlab.train -m ...`: each job in its own folder, a stop signal ending the
sweep, and the sweep callback's MLflow parent run with a child per job (a failing job included).

The real sweep is test_compare.py's, made once per session."""

import json
import signal
from types import SimpleNamespace

import pytest
from helpers import nano_overrides, run_cli, start_cli
from test_compare import client_for, make_sweep
from test_train import _long_run, _wait_for_lines


@pytest.fixture(scope="session")
def sweep(tmp_path_factory, shakespeare):
    """test_compare's real sweep (made once: make_sweep keeps it)."""
    return make_sweep(tmp_path_factory, shakespeare)


@pytest.mark.slow
def test_a_sweep_is_one_parent_run_with_a_child_per_job(sweep):
    cwd, sweep_dir, info, r = sweep
    # the failed job is reported at the end, after the other jobs ran
    assert r.returncode == 2 and "optimizer.lr: must be > 0" in r.stderr
    assert all((sweep_dir / j / "results.json").is_file() for j in ("0", "1"))
    client = client_for(cwd)
    parent = client.get_run(info["parent_run_id"])
    assert parent.info.run_name == "gpt_nano-shakespeare_char-cpu sweep optimizer.lr=1e-3,3e-3,-1"
    assert (
        parent.data.params["optimizer.lr"] == "1e-3,3e-3,-1"
        and parent.data.params["train.max_steps"] == "12"
    )
    assert parent.data.tags["launcher"] == "basic" and parent.data.tags["sweep_dir"] == str(
        sweep_dir
    )
    assert parent.info.status == "FAILED" and parent.data.tags["error"] == "1 of 3 jobs failed"
    kids = {
        k.info.run_name: k
        for k in client.search_runs(
            [info["experiment_id"]],
            filter_string=f"tags.`mlflow.parentRunId` = '{info['parent_run_id']}'",
        )
    }
    base = "gpt_nano-shakespeare_char-cpu optimizer.lr="
    assert set(kids) == {base + "0.001", base + "0.003", base + "-1"}
    assert kids[base + "0.001"].info.status == kids[base + "0.003"].info.status == "FINISHED"
    failed = kids[base + "-1"]
    assert failed.info.status == "FAILED" and failed.data.tags["error"].startswith(
        "GptlabError: optimizer.lr"
    )
    assert kids[base + "0.003"].data.tags["run_dir"] == str(sweep_dir / "1")
    best = min(kids[base + v].data.metrics["summary/best_val_loss"] for v in ("0.001", "0.003"))
    assert parent.data.metrics["summary/best_val_loss"] == best


@pytest.mark.slow
def test_sweep_runs_each_job_into_its_own_folder(sweep):
    _, sweep_dir, _, _ = sweep
    assert [
        json.loads((sweep_dir / j / "results.json").read_text())["steps"] for j in ("0", "1")
    ] == [12, 12]
    # each job trained with its own lr: every lr job 1 logged is job 0's times 3 (the same schedule)
    lrs = {}
    for job in ("0", "1"):
        rows = [json.loads(x) for x in (sweep_dir / job / "metrics.jsonl").read_text().splitlines()]
        lrs[job] = [r["lr"] for r in rows if "lr" in r]
    assert len(lrs["0"]) >= 2 and lrs["1"] == pytest.approx([3 * x for x in lrs["0"]], rel=1e-9)
    assert max(lrs["1"]) <= 3e-3


@pytest.mark.slow
def test_a_sweep_whose_first_job_cannot_be_composed_leaves_nothing(tmp_path, shakespeare):
    """Issue 42: a sweep whose jobs' overrides do not compose left its folder and a FAILED MLflow
    parent run behind; no job began, so nothing stays (the store itself aside)."""
    from mlflow import MlflowClient

    r = run_cli(
        [
            "gptlab.train",
            "-m",
            "model=gpt_nano",
            f"data.path={shakespeare}",
            "model.n_layer=abc,def",
        ],
        cwd=tmp_path,
    )
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "gptlab.train: error: Error merging override model.n_layer=abc: Value 'abc' of type 'str' "
        "could not be converted to Integer (full_key: model.n_layer)"
    ]
    assert "no job of this sweep began: MLflow sweep run" in r.stdout
    outputs = tmp_path / "outputs"
    assert sorted(p.name for p in outputs.iterdir()) == ["mlflow.db", "mlflow.db.lock"]
    client = MlflowClient(f"sqlite:///{outputs}/mlflow.db")
    experiments = [e.experiment_id for e in client.search_experiments()]
    assert client.search_runs(experiments) == []  # the parent is in MLflow's trash
    # jobs that began and failed (their folders removed as failed starts) keep the sweep's records
    sweep = tmp_path / "sweep"
    args = nano_overrides(shakespeare, "tracking.mlflow=true", "model.n_head=5,7",
                          f"hydra.sweep.dir={sweep}")  # fmt: skip
    r = run_cli(["gptlab.train", "-m", *args], cwd=tmp_path)
    assert r.returncode == 2 and "model.n_head=5" in r.stderr
    info = json.loads((sweep / "sweep.json").read_text())
    parent = client.get_run(info["parent_run_id"])
    assert parent.info.status == "FAILED" and parent.data.tags["error"] == "2 of 2 jobs failed"


@pytest.mark.slow
def test_sigterm_to_a_sweep_stops_the_sweep(tmp_path, shakespeare):
    """Hydra's basic launcher runs the jobs one after another in this process: the job that gets the
    signal saves and stops, and no later job starts."""
    sweep = tmp_path / "sweep"
    args = [
        "gptlab.train",
        "-m",
        *_long_run(shakespeare, f"hydra.sweep.dir={sweep}"),
        "optimizer.lr=1e-3,2e-3",
    ]
    proc = start_cli(args, tmp_path)
    try:
        _wait_for_lines(sweep / "0" / "metrics.jsonl", 3, proc)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert not (sweep / "1").exists()  # the second job never started
    results = json.loads((sweep / "0" / "results.json").read_text())
    assert results["stopped_by"] == "SIGTERM"
    assert f"run the sweep again with hydra.sweep.dir={sweep}" in out
    assert "the sweep stops here; the jobs after this one did not start" in out


# ---- the parent run's bookkeeping (gptlab/records/parent.py), in process, with a recording client


class FakeClient:
    """The MlflowClient calls parent.py makes, recorded; search_runs answers with `runs`."""

    def __init__(self, runs=(), existing=None):
        self.runs, self.existing = list(runs), existing or {}
        self.tags, self.metrics, self.status, self.params = {}, {}, {}, {}
        self.created, self.searched, self.updated, self.deleted = [], [], [], []
        self.experiments = {"gpt": ("exp:gpt", None)}

    def search_runs(self, experiment_ids, filter_string, max_results):
        self.searched.append((experiment_ids, filter_string))
        return self.runs

    def set_tag(self, run_id, key, value):
        self.tags.setdefault(run_id, {})[key] = value

    def log_metric(self, run_id, key, value):
        self.metrics.setdefault(run_id, {})[key] = value

    def set_terminated(self, run_id, status):
        self.status[run_id] = status

    def get_experiment_by_name(self, name):
        if name in self.experiments:
            return SimpleNamespace(experiment_id=self.experiments[name][0])
        return None

    def create_experiment(self, name, artifact_location=None):
        self.experiments[name] = (f"exp:{name}", artifact_location)
        return f"exp:{name}"

    def create_run(self, experiment_id, run_name=None, tags=None, start_time=None):
        self.created.append((experiment_id, run_name, tags, start_time))
        return SimpleNamespace(info=SimpleNamespace(run_id=f"run{len(self.created)}"))

    def log_batch(self, run_id, params=()):
        self.params.setdefault(run_id, {}).update({p.key: p.value for p in params})

    def get_run(self, run_id):
        if run_id not in self.existing:
            raise KeyError(run_id)
        return self.existing[run_id]

    def update_run(self, run_id, status):
        self.updated.append((run_id, status))

    def delete_run(self, run_id):
        self.deleted.append(run_id)


def child(name, status="FINISHED", run_dir=None, **metrics):
    tags = {"run_dir": run_dir} if run_dir is not None else {}
    return SimpleNamespace(
        info=SimpleNamespace(run_id=f"id-{name}", run_name=name, status=status),
        data=SimpleNamespace(tags=tags, metrics=metrics),
    )


def best(loss, bpb=None, **scores):
    figures = {"summary/best_val_loss": loss}
    if bpb is not None:
        figures["summary/best_val_bpb"] = bpb
    return {**figures, **scores}


def test_a_parent_ends_with_its_best_job_the_least_loss_and_the_job_counts():
    from gptlab.records import parent

    runs = [
        child("a", run_dir="/s/0", **best(2.5, 1.9, **{"hellaswag/acc": 0.3, "train/loss": 9.0})),
        child("b", run_dir="/s/1", **best(2.1, 2.0, **{"eval/next_line/acc": 0.6})),
        child("c", run_dir="/s/2", **best(2.3, 1.7)),
        child("d", status="FAILED"),
    ]
    client = FakeClient(runs)
    parent.end(client, "e1", "P", stopped=False, tolerated_failures=1)
    assert client.searched == [(["e1"], "tags.`mlflow.parentRunId` = 'P'")]
    assert client.tags["P"] == {"jobs": "4", "failed_jobs": "1", "best_run": "b"}
    assert client.metrics["P"] == {
        "summary/best_val_loss": 2.1,  # the least, not the first or the greatest
        "summary/best_val_bpb": 1.7,  # the least of any job (not the best-loss job's)
        "jobs/0/best_val_loss": 2.5,
        "jobs/0/best_val_bpb": 1.9,
        "jobs/0/hellaswag/acc": 0.3,
        "jobs/1/best_val_loss": 2.1,
        "jobs/1/best_val_bpb": 2.0,
        "jobs/1/eval/next_line/acc": 0.6,
        "jobs/2/best_val_loss": 2.3,
        "jobs/2/best_val_bpb": 1.7,
    }
    assert client.status == {"P": "FINISHED"}  # one failure, one tolerated


@pytest.mark.parametrize(
    "statuses, tolerated, stopped, status, error",
    [
        (["FINISHED", "FINISHED"], 0, False, "FINISHED", None),
        (["FINISHED", "KILLED"], 0, False, "FAILED", "1 of 2 jobs failed"),
        (["FAILED", "KILLED", "FINISHED"], 1, False, "FAILED", "2 of 3 jobs failed"),
        (["FAILED", "KILLED", "FINISHED"], 2, False, "FINISHED", None),
        (["FINISHED"], 0, True, "FAILED", "the sweep stopped early"),
        (["FAILED"], 0, True, "FAILED", "1 of 1 jobs failed"),
    ],
)
def test_a_parent_fails_past_its_allowance_of_failed_jobs_or_when_stopped(
    statuses, tolerated, stopped, status, error
):
    from gptlab.records import parent

    client = FakeClient([child(f"j{i}", s) for i, s in enumerate(statuses)])
    parent.end(client, "e1", "P", stopped=stopped, tolerated_failures=tolerated)
    assert client.status == {"P": status}
    assert client.tags["P"].get("error") == error
    assert "summary/best_val_loss" not in client.metrics.get("P", {})  # no job has a figure
    assert "best_run" not in client.tags["P"]


def test_a_failed_slurm_jobs_rank_and_node_go_on_its_run_and_the_parents_error():
    from gptlab.records import parent

    why = {"/s/1": "SLURM job 61: rank 1 on n2: Killed", "/s/2": "SLURM job 62: rank 0 on n1: OOM"}
    runs = [
        child("a", "FAILED", "/s/1"),
        child("b", "FAILED", "/s/2"),
        child("c", "FAILED", "/s/3"),
    ]
    client = FakeClient(runs)
    parent.end(client, "e1", "P", stopped=False, job_error=why.get)
    assert client.tags["id-a"] == {"slurm_error": why["/s/1"]}
    assert client.tags["id-b"] == {"slurm_error": why["/s/2"]} and "id-c" not in client.tags
    assert client.tags["P"]["error"] == f"3 of 3 jobs failed; {why['/s/1']}; {why['/s/2']}"
    why["/s/1"] = "SLURM job 61: " + "x" * 6000  # cut to what an MLflow tag holds
    client = FakeClient(runs[:1])
    parent.end(client, "e1", "P", stopped=False, job_error=why.get)  # no failure tolerated
    assert client.status == {"P": "FAILED"}
    assert client.tags["id-a"]["slurm_error"] == why["/s/1"][:5000]
    assert client.tags["P"]["error"] == ("1 of 1 jobs failed; " + why["/s/1"])[:5000]


def test_per_job_figures_name_each_job_by_its_folder_else_its_run():
    from gptlab.records import parent

    runs = [
        child("named", run_dir="/sweep/3", **best(1.5, **{"hellaswag/acc_norm": 0.4})),
        child("by-name", **best(1.25, **{"val_loss": 1.3, "eval/x": 0.5})),
        child("empty-dir", run_dir="", **{"summary/best_val_bpb": 0.9}),
    ]
    runs.append(SimpleNamespace(info=SimpleNamespace(run_name=None), data=runs[1].data))
    assert parent.per_job_figures(runs) == {
        "jobs/3/best_val_loss": 1.5,
        "jobs/3/hellaswag/acc_norm": 0.4,
        "jobs/by-name/best_val_loss": 1.25,
        "jobs/by-name/eval/x": 0.5,
        "jobs/empty-dir/best_val_bpb": 0.9,
        "jobs/job/best_val_loss": 1.25,
        "jobs/job/eval/x": 0.5,
    }
    long = [child("x" * 300, **{"eval/a": 1.0})]
    assert list(parent.per_job_figures(long)) == [("jobs/" + "x" * 300 + "/eval/a")[:250]]


def test_a_parent_is_created_with_the_sweeps_tags_and_its_overrides_as_params():
    from gptlab.records import parent

    client = FakeClient()
    sweep = {"experiment": "gpt", "sweep_dir": "/s", "run_name": "gpt sweep lr=1,2",
             "overrides": ["optimizer.lr=1e-3,3e-3", "+train.x=a=b", "~model.bias="]}  # fmt: skip
    run = parent.create(client, "sqlite:////o/mlflow.db", sweep, tags={"synced": "true"},
                        start_time=1234)  # fmt: skip
    assert run.info.run_id == "run1"
    assert client.created == [
        ("exp:gpt", "gpt sweep lr=1,2", {
            "run_type": "sweep", "sweep_dir": "/s", "launcher": "basic",
            "overrides": "optimizer.lr=1e-3,3e-3 +train.x=a=b ~model.bias=", "synced": "true",
        }, 1234),
    ]  # fmt: skip
    assert client.params["run1"] == {
        "optimizer.lr": "1e-3,3e-3",
        "train.x": "a=b",
        "model.bias": "",
    }
    parent.create(client, "uri", {"experiment": "gpt", "sweep_dir": "/t", "launcher": "slurm"})
    assert client.created[1] == ("exp:gpt", None, {"run_type": "sweep", "sweep_dir": "/t",
                                 "launcher": "slurm", "overrides": ""}, None)  # fmt: skip
    assert parent.params(["k" * 300 + "=v"]) == {"k" * 250: "v"}
    parent.create(client, "sqlite:////o/mlflow.db", {"experiment": "new", "sweep_dir": "/u"})
    assert client.experiments["new"] == ("exp:new", "file:///o/mlartifacts/new")
    assert client.created[2][0] == "exp:new"
    assert parent.child_tags({"sweep_dir": "/s"}, "P") == {
        "mlflow.parentRunId": "P",
        "sweep_dir": "/s",
    }


def test_a_recorded_parent_is_reopened_only_in_its_own_store_while_active():
    from gptlab.records import parent

    active = SimpleNamespace(info=SimpleNamespace(run_id="P", lifecycle_stage="active"))
    deleted = SimpleNamespace(info=SimpleNamespace(run_id="D", lifecycle_stage="deleted"))
    client = FakeClient(existing={"P": active, "D": deleted})
    rec = {"uri": "u1", "parent_run_id": "P"}
    assert parent.reopen(client, "u1", rec) is active and client.updated == [("P", "RUNNING")]
    for uri, recorded in [
        ("u2", rec),  # another store
        ("u1", {"uri": "u1", "parent_run_id": "D"}),  # deleted
        ("u1", {"uri": "u1", "parent_run_id": "gone"}),  # not in the store
        ("u1", {"uri": "u1", "parent_run_id": ""}),
        ("u1", None),
    ]:
        assert parent.reopen(client, uri, recorded) is None
    assert client.updated == [("P", "RUNNING")]
    parent.discard(client, "P")
    assert client.deleted == ["P"]


def test_a_superseded_trial_job_is_not_a_failed_job_of_its_sweep():
    """A dead sweeper's queued job that finds its trial launched again ends at once: no FAILED
    child for it under the search's parent (the trial's child is its new launch's run)."""
    from hydra.core.utils import JobReturn, JobStatus

    from gptlab.errors import GptlabError, Superseded
    from gptlab.search.callbacks import failed_job

    def ended(status, value):
        job = JobReturn(status=status)
        job._return_value = value
        return job

    assert failed_job(ended(JobStatus.FAILED, GptlabError("optimizer.lr: must be > 0")))
    assert failed_job(ended(JobStatus.FAILED, RuntimeError("boom")))
    assert not failed_job(ended(JobStatus.FAILED, Superseded("trial 2: this job is launch 0")))
    assert not failed_job(ended(JobStatus.COMPLETED, {"steps": 5}))


def test_a_job_that_failed_before_its_run_gets_a_failed_child_once():
    from gptlab.records import parent
    from gptlab.records.identity import RunIdentity

    sweep = {"experiment_id": "e1", "parent_run_id": "P", "sweep_dir": "/s"}
    identity = RunIdentity(
        experiment="gpt", name="job 2", tags={"run_dir": "/s/2", "model": "nano"}
    )
    client = FakeClient([child("a", run_dir="/s/1")])
    parent.record_failed_job(client, sweep, identity, "optimizer.lr: must be > 0")
    assert client.searched == [(["e1"], "tags.`mlflow.parentRunId` = 'P'")]
    assert client.created == [("e1", "job 2", {
        "run_dir": "/s/2", "model": "nano", "mlflow.parentRunId": "P", "sweep_dir": "/s",
        "error": "optimizer.lr: must be > 0"}, None)]  # fmt: skip
    assert client.status == {"run1": "FAILED"}
    client = FakeClient([child("a", run_dir="/s/2")])  # its tracker made its run: nothing more
    parent.record_failed_job(client, sweep, identity, "boom")
    assert client.created == [] and client.status == {}
