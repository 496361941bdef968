"""MLflow records, on a real local store, and a dead tracking server that must not stop training."""

import json
import warnings

import pytest

from conftest import compose_config, nano_overrides
from gptlab.train import run_training


def test_mlflow_run_has_params_metrics_and_artifacts(tmp_path, shakespeare, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default store is ./outputs/mlflow.db
    run_dir = tmp_path / "outputs" / "runs" / "r1"
    results = run_training(compose_config(nano_overrides(shakespeare, "tracking.mlflow=true")), run_dir)
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'outputs' / 'mlflow.db'}")
    run = client.get_run(results["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.params["model.n_layer"] == "2" and run.data.params["derived.accum_steps"] == "1"
    assert run.data.tags["hardware"] == "cpu" and "host" in run.data.tags
    exp = client.get_experiment(run.info.experiment_id)
    assert exp.name == "gpt_nano-shakespeare_char"
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert [m.step for m in history] == [1, 5, 10, 15, 20]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "val/loss")] == [10, 20]
    for name in ("opt/lr", "opt/grad_norm", "perf/tokens_per_s", "perf/mfu", "tokens"):
        assert client.get_metric_history(run.info.run_id, name), name
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"results.json", "samples.txt", "config_resolved.yaml"} <= artifacts
    assert json.loads((run_dir / "results.json").read_text())["mlflow_run_id"] == run.info.run_id


def test_unreachable_tracking_server_still_completes_the_run(tmp_path, shakespeare):
    run_dir = tmp_path / "run"
    overrides = nano_overrides(shakespeare, "tracking.mlflow=true", "tracking.uri=http://127.0.0.1:9")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = run_training(compose_config(overrides), run_dir)
    assert any("MLflow disabled" in str(w.message) for w in caught)
    assert results["steps"] == 20 and results["mlflow_run_id"] is None
    assert (run_dir / "results.json").is_file()
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 5
