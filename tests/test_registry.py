"""From run to model (gptlab/serving.py, gptlab.export's mlflow/register keys, gptlab.sample's model
URIs): a trained run logged as an MLflow model, registered with an alias, loaded back by URI, and
served by `mlflow models serve` with the text gptlab.sample gives."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from types import SimpleNamespace

import pytest
from helpers import cli_env, compose_config, nano_overrides
from mlflow import MlflowClient
from test_slurm import tracking_server  # noqa: F401 - the team server (PostgreSQL in CI)

from gptlab import build, export, sample
from gptlab.errors import GptlabError
from gptlab.train import run_training

GREEDY = ["temperature=0", "max_new_tokens=24", "prompt=ROMEO:", "seed=3"]


def train(shakespeare, tmp_path, uri=None):
    outputs = tmp_path / "outputs"
    extra = [f"tracking.uri={uri}"] if uri else []
    overrides = nano_overrides(
        shakespeare, "tracking.mlflow=true", "train.sample_tokens=0", f"paths.outputs={outputs}",
        *extra,
    )  # fmt: skip
    results = run_training(compose_config(overrides), tmp_path / "run")
    return tmp_path / "run", uri or f"sqlite:///{outputs}/mlflow.db", results["mlflow_run_id"]


def sampled(capsys, *args):
    capsys.readouterr()
    sample.main(list(args))
    return capsys.readouterr().out


@pytest.fixture(scope="module")
def registered(shakespeare, tmp_path_factory):
    """A tiny run on a local SQLite store, registered as version 1 of a model, alias champion."""
    tmp = tmp_path_factory.mktemp("registry")
    run_dir, uri, run_id = train(shakespeare, tmp)
    export.main(
        [f"run={run_dir}", "export.register=nano-chars", "export.alias=champion", "hf=false"]
    )
    return run_dir, uri, run_id


def logged_models(client, run_id):
    experiment = client.get_run(run_id).info.experiment_id
    return client.search_logged_models([experiment], f"source_run_id = '{run_id}'")


def test_a_finished_run_logs_its_model_and_export_registers_that_one(registered):
    """tracking.log_model (on by default): the run's last checkpoint is its MLflow model, with the
    step and the final metrics; export.register afterwards registers it, not a copy."""
    run_dir, uri, run_id = registered
    client = MlflowClient(uri)
    results = json.loads((run_dir / "results.json").read_text())
    [model] = logged_models(client, run_id)  # one: the export found it, logged nothing more
    assert model.tags["gptlab.step"] == str(results["steps"]) and model.name == "model"
    metrics = {m.key: m for m in model.metrics}
    assert metrics["best_val_loss"].value == pytest.approx(results["best_val_loss"])
    assert metrics["best_val_loss"].step == results["steps"]
    version = client.get_model_version_by_alias("nano-chars", "champion")
    assert version.source == model.model_uri


def test_a_registered_model_is_the_runs_and_loads_back_by_name_alias_and_run(registered, capsys):
    run_dir, uri, run_id = registered
    client = MlflowClient(uri)
    version = client.get_model_version_by_alias("nano-chars", "champion")
    assert str(version.version) == "1" and version.run_id == run_id
    # the logged model is linked to its run, its step and the run's final metrics
    logged = client.get_logged_model(version.source.removeprefix("models:/"))
    assert logged.source_run_id == run_id
    assert {m.key for m in logged.metrics} >= {"best_val_loss", "best_val_bpb"}
    from_folder = sampled(capsys, f"run={run_dir}", *GREEDY)
    for uri_form in (
        "models:/nano-chars@champion",
        "models:/nano-chars/1",
        f"runs:/{run_id}/model",
    ):
        assert sampled(capsys, f"run={uri_form}", f"tracking_uri={uri}", *GREEDY) == from_folder


def test_eval_of_a_model_uri_scores_as_its_run_folder_and_records_in_its_run(
    registered, shakespeare, tmp_path
):
    """gptlab.eval run=models:/NAME@alias: the same figures as the run folder's checkpoint, in the
    source run's MLflow run at the model's step; an unknown model is one line."""
    pytest.importorskip("lm_eval")
    from test_eval import next_line_task

    from gptlab.eval import main as evaluate

    run_dir, uri, run_id = registered
    tasks = next_line_task(tmp_path / "tasks", shakespeare, 12)
    common = ["tasks=[next_line]", f"eval.include={tasks}", f"tracking_uri={uri}"]
    by_folder = json.loads(evaluate([f"run={run_dir}", *common, "eval.mlflow=false"]).read_text())
    path = evaluate(["run=models:/nano-chars@champion", *common])
    by_uri = json.loads(path.read_text())
    values = [(r["task"], r["metric"], r["value"]) for r in by_uri["results"]]
    assert values == [(r["task"], r["metric"], r["value"]) for r in by_folder["results"]]
    assert by_uri["step"] == by_folder["step"] and by_uri["mlflow_run_id"] == run_id
    history = MlflowClient(uri).get_metric_history(run_id, "eval/next_line/acc")
    assert [(h.step, h.value) for h in history] == [(by_uri["step"], values[0][2])]
    with pytest.raises(GptlabError, match="models:/no-such-model/1: no such model"):
        evaluate(["run=models:/no-such-model/1", *common])


@pytest.mark.slow
def test_mlflow_models_serve_answers_with_the_text_gptlab_sample_gives(registered, capsys):
    run_dir, uri, _ = registered
    expected = sampled(capsys, f"run={run_dir}", *GREEDY)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    venv_bin = os.path.dirname(sys.executable)  # as in an activated environment: uvicorn on PATH
    mlflow_cli = os.path.join(venv_bin, "mlflow")
    env = {**cli_env(), "MLFLOW_TRACKING_URI": uri}
    env["PATH"] = f"{venv_bin}{os.pathsep}{env.get('PATH', '')}"
    server = subprocess.Popen(
        [mlflow_cli, "models", "serve", "-m", "models:/nano-chars/1", "--env-manager", "local",
         "-h", "127.0.0.1", "-p", str(port)],
        env=env, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and server.poll() is None:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/ping", timeout=2)
                break
            except OSError:
                time.sleep(1)
        assert server.poll() is None, server.communicate()[0][-3000:]
        body = {"dataframe_split": {"columns": ["prompt"], "data": [["ROMEO:"]]},
                "params": {"max_new_tokens": 24, "temperature": 0.0, "seed": 3}}  # fmt: skip
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/invocations", data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )  # fmt: skip
        answer = json.loads(urllib.request.urlopen(request, timeout=60).read())
        assert answer["predictions"] == [expected.removesuffix("\n")]
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
    # nothing is left: the server's workers end after it, within seconds
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (group_alive(server.pid) or listening(port)):
        time.sleep(0.5)
    assert not group_alive(server.pid) and not listening(port)


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_bad_registry_input_is_one_line_and_registers_nothing(registered, tmp_path):
    run_dir, uri, run_id = registered
    client = MlflowClient(uri)
    before = len(
        client.search_logged_models(experiment_ids=[client.get_run(run_id).info.experiment_id])
    )
    with pytest.raises(GptlabError, match="a registered model's name"):
        export.main([f"run={run_dir}", "export.register=bad/name", "hf=false", f"out={tmp_path}/x"])
    with pytest.raises(GptlabError, match="an alias is a name"):
        export.main(
            [
                f"run={run_dir}",
                "export.register=ok",
                "export.alias=v2",
                "hf=false",
                f"out={tmp_path}/y",
            ]
        )
    after = client.search_logged_models(experiment_ids=[client.get_run(run_id).info.experiment_id])
    assert len(after) == before  # nothing was logged for the refused names
    with pytest.raises(GptlabError, match="no such model"):
        sample.main(["run=models:/no-such-model/1", f"tracking_uri={uri}", *GREEDY])
    with pytest.raises(GptlabError, match="MLflow at http://127.0.0.1:9"):
        export.main([f"run={run_dir}", "export.mlflow=true", "hf=false", f"out={tmp_path}/z",
                     "tracking_uri=http://127.0.0.1:9"])  # fmt: skip
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(GptlabError):
        export.main([f"run={empty}", "export.register=nano-chars", "hf=false"])
    assert str(client.get_registered_model("nano-chars").latest_versions[0].version) == "1"


def test_a_store_down_when_a_run_ends_is_one_warning_naming_the_command(
    registered, shakespeare, caplog
):
    """The run is done and recorded: a model that cannot be logged costs a warning, in seconds."""
    run_dir, uri, run_id = registered
    results = json.loads((run_dir / "results.json").read_text())
    config = compose_config(nano_overrides(shakespeare, "tracking.mlflow=true"))
    # the run's tracker as it ends, its store gone since
    down = SimpleNamespace(
        run_id=run_id, uri="http://127.0.0.1:9", mlflow=SimpleNamespace(unsent=[])
    )
    with caplog.at_level("WARNING", logger="gptlab"):
        build.log_model(config, down, run_dir, results)
    assert f"log it with: python -m gptlab.export run={run_dir} export.mlflow=true" in caplog.text
    assert "127.0.0.1:9" in caplog.text and len(logged_models(MlflowClient(uri), run_id)) == 1


@pytest.mark.slow
def test_registration_on_the_team_server_resolves_by_alias(
    shakespeare,
    tmp_path,
    capsys,
    tracking_server,  # noqa: F811
):
    name = f"nano-{uuid.uuid4().hex[:8]}"
    run_dir, uri, run_id = train(shakespeare, tmp_path, tracking_server)
    export.main([f"run={run_dir}", f"export.register={name}", "export.alias=champion", "hf=false"])
    version = MlflowClient(uri).get_model_version_by_alias(name, "champion")
    assert version.run_id == run_id
    from_folder = sampled(capsys, f"run={run_dir}", *GREEDY)
    assert sampled(capsys, f"run=models:/{name}@champion", f"tracking_uri={uri}", *GREEDY) == (
        from_folder
    )
