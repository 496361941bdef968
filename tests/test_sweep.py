"""A sweep, `python -m gptlab.train -m ...`: each job in its own folder, a stop signal ending the
sweep, and the sweep callback's MLflow parent run with a child per job (a failing job included).

The real sweep is test_compare.py's, made once per session."""

import json
import signal

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
def test_sweep_runs_each_job_into_its_own_folder(tmp_path, shakespeare):
    r = run_cli(
        [
            "gptlab.train",
            "-m",
            "model=gpt_nano",
            f"data.path={shakespeare}",
            "train.max_steps=5",
            "train.eval_steps=1",
            "train.batch_size=4",
            "tracking.mlflow=false",
            "optimizer.lr=1e-3,3e-3",
        ],
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    (sweep,) = list((tmp_path / "outputs" / "sweeps").iterdir())
    assert [json.loads((sweep / j / "results.json").read_text())["steps"] for j in ("0", "1")] == [
        5,
        5,
    ]
    # each job trained with its own lr: every lr job 1 logged is job 0's times 3 (the same schedule)
    lrs = {}
    for job in ("0", "1"):
        rows = [json.loads(x) for x in (sweep / job / "metrics.jsonl").read_text().splitlines()]
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
