"""`python -m gptlab.ui` over a store that a real gptlab sweep wrote (and one with a registered
model), and the pages it serves rendered by a real headless Chromium.

gptlab.ui starts a real `mlflow server` on a free loopback port, in a process group of its own, and
prints the runs view's URL. Chromium loads that URL (the sweep's jobs folded under the parent run),
then the sorted one it also prints (every run listed), and saves a screenshot next to the sweep's
outputs. Stopping gptlab.ui must end the server's whole process group.
"""

import contextlib
import os
import re
import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from helpers import need, start_cli
from test_compare import client_for, sweep  # noqa: F401 - the session's real sweep
from test_registry_serving import registered  # noqa: F401 - a run registered as nano-chars@champion

from gptlab.ui import free_port

CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--virtual-time-budget=20000",
]


def render(exe: str, url: str, profile: Path, *extra: str, timeout: float = 120) -> str:
    """The DOM after the page ran its scripts (--dump-dom), with a new empty profile each time."""
    profile.mkdir(parents=True)
    proc = subprocess.Popen(
        [exe, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *extra, "--dump-dom", url],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        dom, _ = proc.communicate(timeout=timeout)
    finally:
        kill_group(proc.pid)
        proc.wait(5)
    assert proc.returncode == 0, f"chromium exited with {proc.returncode}"
    return dom


def kill_group(pgid: int) -> None:
    """SIGKILL whatever is left of a process group this test started."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


def text_of(dom: str) -> str:
    return re.sub(
        r"\s+",
        " ",
        re.sub(r"<[^>]+>", " ", re.sub(r"<(script|style)\b.*?</\1>", " ", dom, flags=re.S)),
    )


def start_ui(cwd: Path, port: int):
    """(process, output so far, server pid) once gptlab.ui has printed the URLs."""
    ui = start_cli(["gptlab.ui", f"ui.port={port}"], cwd, merge_stderr=True,
                   env_extra={"PYTHONUNBUFFERED": "1"}, start_new_session=True)  # fmt: skip
    lines, deadline = [], time.monotonic() + 240
    while time.monotonic() < deadline:
        line = ui.stdout.readline()
        if not line:
            break
        lines.append(line)
        if m := re.search(r"server pid (\d+)", line):
            return ui, "".join(lines), int(m.group(1))
    kill_group(ui.pid)
    pytest.fail("gptlab.ui did not print the runs URL:\n" + "".join(lines)[-3000:])


@pytest.mark.slow
def test_ui_serves_the_sweep_and_chromium_shows_the_parent_and_its_children(sweep, tmp_path):  # noqa: F811
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    cwd, _, info, _ = sweep
    exp, parent_id = info["experiment_id"], info["parent_run_id"]
    client = client_for(cwd)
    kids = client.search_runs([exp], filter_string=f"tags.`mlflow.parentRunId` = '{parent_id}'")
    assert len(kids) == 3

    port = free_port("127.0.0.1", preferred=0)
    ui, out, server_pid = start_ui(cwd, port)
    try:
        url = f"http://127.0.0.1:{port}/#/experiments/{exp}/runs?workflowType=machine_learning"
        assert f"runs of experiment 'gpt_nano-shakespeare_char': {url}\n" in out, out
        (sorted_url,) = re.findall(r"best val loss first, sweeps unfolded: (\S+)", out)
        assert sorted_url.startswith(url + "&orderByKey=")
        page = urllib.request.urlopen(url, timeout=30).read().decode()
        assert "<title>" in page and "MLflow" in page

        if exe is not None:
            # As printed first: the sweep is one row, its jobs folded under it.
            dom = render(exe, url, tmp_path / "profile1")
            text = text_of(dom)
            assert "4 matching runs" in text, text[-2000:]
            assert (
                f'href="#/experiments/{exp}/runs/{parent_id}"' in dom and info["run_name"] in text
            )
            assert "Model training" in text  # the training view, not the GenAI one
            assert not any(f'/runs/{k.info.run_id}"' in dom for k in kids)  # folded

            # Sorted by best val loss: every job listed; and the screenshot.
            shot = tmp_path / "mlflow_runs.png"
            dom = render(
                exe,
                sorted_url,
                tmp_path / "profile2",
                f"--screenshot={shot}",
                "--window-size=1400,900",
            )
            for run in [*kids, client.get_run(parent_id)]:
                assert f'href="#/experiments/{exp}/runs/{run.info.run_id}"' in dom, (
                    run.info.run_name
                )
            assert "4 matching runs" in text_of(dom)
            assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
            shutil.copy(shot, cwd / "mlflow_runs.png")  # next to the sweep's outputs/
            if os.environ.get("GPTLAB_SCREENSHOT_DIR"):  # where CI may collect it
                Path(os.environ["GPTLAB_SCREENSHOT_DIR"]).mkdir(parents=True, exist_ok=True)
                shutil.copy(shot, Path(os.environ["GPTLAB_SCREENSHOT_DIR"]) / "mlflow_runs.png")
            print(f"screenshot: {cwd / 'mlflow_runs.png'}")

        ui.send_signal(signal.SIGTERM)  # as `kill`; Ctrl-C ends it the same way
        assert ui.wait(60) == 0
        time.sleep(1)
        with pytest.raises(ProcessLookupError):
            os.killpg(server_pid, 0)  # the server's whole process group is gone
    finally:
        kill_group(ui.pid)
        kill_group(server_pid)
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
    if exe is None:
        need("gptlab.ui checked; the browser part needs chromium (.ci/setup.d/chromium.sh)")


@pytest.mark.slow
def test_the_registry_and_model_pages_show_the_version_its_run_metrics_and_data(
    registered,  # noqa: F811
    tmp_path,
):
    """A registered run's model as a team finds it in the UI: the registered model with its
    version and alias, the version linking its source run and model, the model's page with its
    validation figures on the run's validation data (its digest), and the run's page with the
    datasets it trained on and the model it logged."""
    from mlflow import MlflowClient
    from test_registry_serving import logged_models

    from gptlab.records import lineage

    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        need("the model pages need chromium (.ci/setup.d/chromium.sh installs it)")
    run_dir, uri, run_id = registered
    client = MlflowClient(uri)
    run = client.get_run(run_id)
    exp = run.info.experiment_id
    [model] = logged_models(client, run_id)
    data = {d["context"]: d for d in lineage.read(run_dir)}
    port = free_port("127.0.0.1", preferred=0)
    ui, _, server_pid = start_ui(run_dir.parent, port)
    base = f"http://127.0.0.1:{port}/#"
    try:
        text = text_of(render(exe, f"{base}/models/nano-chars", tmp_path / "p1"))
        assert re.search(r"Version 1 .*champion", text), text[:3000]

        dom = render(exe, f"{base}/models/nano-chars/versions/1", tmp_path / "p2")
        text = text_of(dom)
        assert f"Source Run : {run.info.run_name}" in text and "Source Model : model" in text
        assert f'href="#/experiments/{exp}/runs/{run_id}"' in dom
        assert f'href="#/experiments/{exp}/models/{model.model_id}"' in dom

        text = text_of(render(exe, f"{base}/experiments/{exp}/models/{model.model_id}",
                              tmp_path / "p3"))  # fmt: skip
        val = data["validation"]
        assert re.search(
            rf"best_val_loss {val['name']} \(#{val['digest']}\) {run.info.run_name} [0-9.]+", text
        ), text[:4000]

        text = text_of(render(exe, f"{base}/experiments/{exp}/runs/{run_id}", tmp_path / "p4"))
        train = data["training"]
        assert f"Datasets {train['name']} ({train['digest']}) training" in text, text[-3000:]
        assert "Logged models (1)" in text
    finally:
        ui.send_signal(signal.SIGTERM)
        ui.wait(60)
        kill_group(ui.pid)
        kill_group(server_pid)
