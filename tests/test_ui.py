"""python -m gptlab.ui: which store and experiment it opens (the real command over a real sweep, and the
page it serves, are tested in tests/test_browser.py)."""

import pytest

from gptlab.errors import GptlabError
from gptlab.ui import compose_tracking, find_experiment, main as ui_main, store_uri


def test_no_store_yet_is_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(GptlabError, match=r"no MLflow store at .*outputs/mlflow.db: no run has been recorded"):
        ui_main([])
    with pytest.raises(GptlabError, match="expected an override"):
        ui_main(["outputs"])


def test_the_store_and_experiment_come_from_the_config_overrides(tmp_path):
    t = compose_tracking(["tracking.uri=http://10.0.0.1:5000", "tracking.experiment=sweeps"])
    assert (t.uri, t.experiment) == ("http://10.0.0.1:5000", "sweeps")
    assert store_uri("http://10.0.0.1:5000") == "http://10.0.0.1:5000"


def test_the_newest_experiment_is_opened_unless_one_is_named(tmp_path):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    old, new = client.create_experiment("old"), client.create_experiment("new")
    client.create_run(new, start_time=1_000)
    client.create_run(old, start_time=2_000)
    assert find_experiment(uri, None) == (old, "old")
    assert find_experiment(uri, "new") == (new, "new")
    with pytest.raises(GptlabError, match="tracking.experiment=nope: no such experiment .*there are: "):
        find_experiment(uri, "nope")
