"""python -m gptlab.ui: which store and experiment it opens (the real command over a real sweep, and
the page it serves, are tested in tests/system/test_browser.py)."""

import contextlib

import pytest

from gptlab.cli import compose
from gptlab.config import to_config
from gptlab.errors import GptlabError
from gptlab.ui import UIConfig, find_experiment, store_uri
from gptlab.ui import main as ui_main


def test_no_store_yet_is_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        GptlabError, match=r"no MLflow store at .*outputs/mlflow.db: no run has been recorded"
    ):
        ui_main([])
    with pytest.raises(GptlabError, match="Error parsing override 'outputs'"):
        ui_main(["outputs"])


def test_the_store_and_experiment_come_from_the_config_overrides(tmp_path):
    config = to_config(
        compose("ui", ["tracking.uri=http://10.0.0.1:5000", "tracking.experiment=sweeps"]), UIConfig
    )
    t = config.tracking
    assert (t.uri, t.experiment) == ("http://10.0.0.1:5000", "sweeps")
    ui = to_config(
        compose("ui", ["ui.host=0.0.0.0", "ui.port=5001", "ui.allowed_hosts=a.org,a.org:*"]),
        UIConfig,
    ).ui
    assert (ui.host, ui.port, ui.workers, ui.allowed_hosts) == ("0.0.0.0", 5001, 1, "a.org,a.org:*")
    assert store_uri("http://10.0.0.1:5000") == "http://10.0.0.1:5000"


@pytest.mark.integration
def test_the_newest_experiment_is_opened_unless_one_is_named(tmp_path):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    old, new = client.create_experiment("old"), client.create_experiment("new")
    client.create_run(new, start_time=1_000)
    client.create_run(old, start_time=2_000)
    assert find_experiment(uri, None) == (old, "old")
    assert find_experiment(uri, "new") == (new, "new")
    with pytest.raises(
        GptlabError, match="tracking.experiment=nope: no such experiment .*there are: "
    ):
        find_experiment(uri, "nope")


def test_serving_on_another_address_accepts_this_machines_names_as_host_and_origin():
    import socket

    from gptlab.ui import network_access

    assert network_access("127.0.0.1", 5000, "127.0.0.1") == (None, None)  # MLflow's own defaults
    hosts, origins = network_access("0.0.0.0", 5000, "node01")
    assert {"node01", "node01:*", socket.gethostname(), "localhost:*", "10.*", "192.168.*"} <= set(
        hosts.split(",")
    )
    assert {"http://node01:5000", f"http://{socket.getfqdn()}:5000"} <= set(origins.split(","))
    hosts, origins = network_access("10.1.2.3", 5001, "10.1.2.3")
    assert "10.1.2.3:*" in hosts.split(",") and "http://10.1.2.3:5001" in origins.split(",")


@pytest.mark.integration
def test_a_server_that_fails_is_one_line_from_its_log(tmp_path):
    """Its notices stay in the log; the line is its exit code, its last line (the error) and the
    log."""
    import sys

    from gptlab.ui import start_server, wait_until_up

    log = tmp_path / "mlflow-ui.log"
    log.write_text("an earlier server's lines\n")
    fails = (
        "import sys; print('Registry store URI not provided.'); "
        "sys.exit('OSError: [Errno 98] address in use')"
    )
    proc, start = start_server([sys.executable, "-c", fails], log)
    with pytest.raises(GptlabError) as e:
        wait_until_up(proc, "http://127.0.0.1:9", 60, log, start)
    assert str(e.value) == (
        f"mlflow server exited with code 1 before answering: OSError: [Errno 98] address in use "
        f"(log: {log})"
    )


@pytest.mark.slow
def test_the_ui_says_only_gptlabs_lines_and_the_servers_go_to_its_log(tmp_path):
    """MLflow's notices (the registry URI, the security middleware, Starlette's DeprecationWarning
    and its source line) are the server's: in outputs/mlflow-ui.log, not on the console."""
    import os
    import re
    import signal
    import subprocess
    import sys
    import time

    from mlflow.tracking import MlflowClient

    from gptlab.ui import free_port

    store = tmp_path / "outputs" / "mlflow.db"
    store.parent.mkdir()
    client = MlflowClient(tracking_uri=f"sqlite:///{store}")
    client.create_run(client.create_experiment("exp"))
    port = free_port("127.0.0.1", preferred=0)
    ui = subprocess.Popen(
        [sys.executable, "-m", "gptlab.ui", f"ui.port={port}"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    server = None
    try:
        lines = [ui.stdout.readline() for _ in range(4)]  # what it prints once the server answers
        server = re.search(r"server pid (\d+)", lines[-1])
        assert server, lines
        ui.send_signal(signal.SIGTERM)
        out, err = ui.communicate(timeout=60)
        deadline = time.monotonic() + 15  # stopping gptlab.ui ends the server's whole group
        with pytest.raises(ProcessLookupError):
            while time.monotonic() < deadline:
                os.killpg(int(server.group(1)), 0)
                time.sleep(0.2)
    finally:
        for group in [ui.pid, *([int(server.group(1))] if server else [])]:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGKILL)
    log = tmp_path / "outputs" / "mlflow-ui.log"
    assert [line.split(" ")[0] for line in lines] == ["MLflow", "", "", ""] and out == "", lines + [
        out
    ]
    assert lines[0] == f"MLflow UI for sqlite:///{store}\n"
    assert (
        lines[3]
        == f"  (server pid {lines[3].split()[2].rstrip(',')}, its log {log}; Ctrl-C stops it)\n"
    )
    assert err == "" and ui.returncode == 0, err
    assert "Registry store URI not provided" in log.read_text()  # the server's own lines, kept
