"""python -m gptlab.ui: which store and experiment it opens (the real command over a real sweep, and the
page it serves, are tested in tests/test_browser.py)."""

import pytest

from gptlab.cli import compose
from gptlab.config import to_config
from gptlab.errors import GptlabError
from gptlab.ui import UIConfig, find_experiment, store_uri
from gptlab.ui import main as ui_main


def test_no_store_yet_is_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(GptlabError, match=r"no MLflow store at .*outputs/mlflow.db: no run has been recorded"):
        ui_main([])
    with pytest.raises(GptlabError, match="Error parsing override 'outputs'"):
        ui_main(["outputs"])


def test_the_store_and_experiment_come_from_the_config_overrides(tmp_path):
    config = to_config(compose("ui", ["tracking.uri=http://10.0.0.1:5000", "tracking.experiment=sweeps"]), UIConfig)
    t = config.tracking
    assert (t.uri, t.experiment) == ("http://10.0.0.1:5000", "sweeps")
    ui = to_config(compose("ui", ["ui.host=0.0.0.0", "ui.port=5001", "ui.allowed_hosts=a.org,a.org:*"]), UIConfig).ui
    assert (ui.host, ui.port, ui.workers, ui.allowed_hosts) == ("0.0.0.0", 5001, 1, "a.org,a.org:*")
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


def test_serving_on_another_address_accepts_this_machines_names_as_host_and_origin():
    import socket

    from gptlab.ui import network_access

    assert network_access("127.0.0.1", 5000, "127.0.0.1") == (None, None)  # MLflow's own defaults
    hosts, origins = network_access("0.0.0.0", 5000, "node01")
    assert {"node01", "node01:*", socket.gethostname(), "localhost:*", "10.*", "192.168.*"} <= set(hosts.split(","))
    assert {"http://node01:5000", f"http://{socket.getfqdn()}:5000"} <= set(origins.split(","))
    hosts, origins = network_access("10.1.2.3", 5001, "10.1.2.3")
    assert "10.1.2.3:*" in hosts.split(",") and "http://10.1.2.3:5001" in origins.split(",")
