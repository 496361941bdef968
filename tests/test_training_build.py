"""gptlab.training.build: what building a run adds to the loop's results, e.g. a recipe's expected
result, checked and recorded as an MLflow tag."""

import pytest
from helpers import compose_config, nano_overrides

from gptlab.train import run_training


@pytest.mark.integration
def test_a_recipes_expected_result_is_checked_and_tagged(tmp_path, shakespeare, monkeypatch):
    monkeypatch.chdir(tmp_path)
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'outputs' / 'mlflow.db'}")
    for bound, met in (("10.0", True), ("0.1", False)):
        results = run_training(
            compose_config(
                nano_overrides(
                    shakespeare,
                    "tracking.mlflow=true",
                    f"+expected.best_val_loss={bound}",
                    "hardware.attention_backend=math",
                )
            ),
            tmp_path / f"run{bound}",
        )
        assert results["expected_met"] is met
        assert (
            client.get_run(results["mlflow_run_id"]).data.tags["expected_met"] == str(met).lower()
        )
