"""From run to model (gptlab/registry/serving.py, gptlab.export's mlflow/register keys,
gptlab.sample's model URIs): a trained run logged as an MLflow model, registered with an alias,
loaded back by URI, and served by `mlflow models serve` with the text gptlab.sample gives."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from types import SimpleNamespace

import pytest
from helpers import cli_env, compose_config, nano_overrides, run_cli
from mlflow import MlflowClient
from test_slurm import tracking_server  # noqa: F401 - the team server (PostgreSQL in CI)

from gptlab import export, sample
from gptlab.errors import GptlabError
from gptlab.registry import serving
from gptlab.train import run_training
from gptlab.training import build

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


@pytest.mark.integration
def test_a_finished_run_logs_its_model_and_export_registers_that_one(registered):
    """tracking.log_model (on by default): the run's last checkpoint is its MLflow model, with the
    step and the final metrics; export.register afterwards registers it, not a copy."""
    run_dir, uri, run_id = registered
    client = MlflowClient(uri)
    results = json.loads((run_dir / "results.json").read_text())
    [model] = logged_models(client, run_id)  # one: the export found it, logged nothing more
    assert model.tags["gptlab.step"] == str(results["steps"]) and model.name == "model"
    metrics = {m.key: m for m in model.metrics}
    assert metrics["summary/best_val_loss"].value == pytest.approx(results["best_val_loss"])
    assert metrics["summary/best_val_loss"].step == results["steps"]
    version = client.get_model_version_by_alias("nano-chars", "champion")
    assert version.source == model.model_uri


@pytest.mark.integration
def test_a_registered_model_is_the_runs_and_loads_back_by_name_alias_and_run(registered, capsys):
    run_dir, uri, run_id = registered
    client = MlflowClient(uri)
    version = client.get_model_version_by_alias("nano-chars", "champion")
    assert str(version.version) == "1" and version.run_id == run_id
    # the logged model is linked to its run, its step and the run's final metrics
    logged = client.get_logged_model(version.source.removeprefix("models:/"))
    assert logged.source_run_id == run_id
    assert {m.key for m in logged.metrics} >= {"summary/best_val_loss", "summary/best_val_bpb"}
    from_folder = sampled(capsys, f"run={run_dir}", *GREEDY)
    for uri_form in (
        "models:/nano-chars@champion",
        "models:/nano-chars/1",
        f"runs:/{run_id}/model",
    ):
        assert sampled(capsys, f"run={uri_form}", f"tracking_uri={uri}", *GREEDY) == from_folder


@pytest.mark.integration
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
        status, answer = invoke(port, ["ROMEO:"], {"max_new_tokens": 24, "temperature": 0.0,
                                                    "seed": 3})  # fmt: skip
        assert status == 200 and answer["predictions"] == [expected.removesuffix("\n")]
        # a parameter out of range: a 400 naming it, not a greedy answer
        status, answer = invoke(port, ["ROMEO:"], {"temperature": -1.0})
        assert status == 400 and "param temperature=-1.0" in answer["message"], answer
        # SIGTERM while a long request is in flight: it is answered (503) and the server ends
        # within seconds, not when the generation would have
        long = {}
        many = {"max_new_tokens": serving.MAX_NEW_TOKENS}
        caller = threading.Thread(
            target=lambda: long.update(zip(("status", "answer"), invoke(port, ["a"] * 200, many)))
        )
        caller.start()
        time.sleep(3)  # the request is generating
        stopped = time.monotonic()
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
    # nothing is left: the server's workers end after it, within seconds
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (group_alive(server.pid) or listening(port)):
        time.sleep(0.2)
    took = time.monotonic() - stopped
    assert not group_alive(server.pid) and not listening(port)
    caller.join(60)
    assert long["status"] == 503 and "the server is stopping" in long["answer"]["message"], long
    assert took < 15, took


def invoke(port, prompts, params, timeout=90):
    """POST /invocations: (HTTP status, the JSON answer)."""
    body = {"dataframe_split": {"columns": ["prompt"], "data": [[p] for p in prompts]},
            "params": params}  # fmt: skip
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/invocations", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.integration
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
    with pytest.raises(GptlabError, match="MLflow server http://127.0.0.1:9 unreachable"):
        export.main([f"run={run_dir}", "export.mlflow=true", "hf=false", f"out={tmp_path}/z",
                     "tracking_uri=http://127.0.0.1:9"])  # fmt: skip
    assert not (tmp_path / "z").exists()  # refused before the export was written
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(GptlabError):
        export.main([f"run={empty}", "export.register=nano-chars", "hf=false"])
    assert str(client.get_registered_model("nano-chars").latest_versions[0].version) == "1"


@pytest.mark.integration
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
@pytest.mark.services  # the team server: make test starts it for the services tests' process
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


# ---- issue 42: what export, sample and the served model say and do -------------------------------


def test_bad_registry_names_are_refused_before_anything_is_written(registered, tmp_path):
    """A refused name, a reserved alias, an alias without a name: one line each, and no export
    folder (the run's own export/ is not rewritten either)."""
    run_dir, _, _ = registered
    export_dir = run_dir / "export"
    written = {p: p.stat().st_mtime_ns for p in export_dir.iterdir()}
    cases = [
        (["export.register=bad/name"], "a registered model's name"),
        (["export.register=ok", "export.alias=v2"], "an alias is a name"),
        (["export.alias=champion"], "give export.register=NAME too"),
    ]
    for i, (args, message) in enumerate(cases):
        out = tmp_path / f"out{i}"
        with pytest.raises(GptlabError, match=message):
            export.main([f"run={run_dir}", *args, f"out={out}"])
        assert not out.exists()
        with pytest.raises(GptlabError, match=message):  # out= not given: the run's export/
            export.main([f"run={run_dir}", *args])
    assert {p: p.stat().st_mtime_ns for p in export_dir.iterdir()} == written


@pytest.mark.integration
def test_a_model_whose_files_are_gone_says_so_and_export_logs_it_again(
    registered, tmp_path, capsys
):
    """A registered model whose artifacts were deleted: loading it is one line saying its files are
    missing (no MLflow lines before it); export does not take it for the checkpoint's model, but
    logs the checkpoint again and registers a version that loads."""
    run_dir, uri, run_id = registered
    client = MlflowClient(uri)
    # a copy of the run folder recorded as another run, so the module's own model stays intact
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    other = client.create_run(client.get_run(run_id).info.experiment_id).info.run_id
    results = json.loads((copy / "results.json").read_text())
    (copy / "results.json").write_text(json.dumps({**results, "mlflow_run_id": other}))
    model = serving.log_checkpoint(copy, uri, other, results)
    serving.register(uri, model.model_uri, "nano-gone", "lost")
    location = client.get_logged_model(model.model_id).artifact_location
    shutil.rmtree(location.removeprefix("file://"))
    capsys.readouterr()
    with pytest.raises(GptlabError, match="models:/nano-gone@lost: the model's files are missing"):
        sample.main(["run=models:/nano-gone@lost", f"tracking_uri={uri}", *GREEDY])
    assert capsys.readouterr().err == ""
    assert serving.logged_at(uri, other, results["steps"]) == (None, [model.model_uri])
    export.main([f"run={copy}", "export.register=nano-gone", "export.alias=lost", "hf=false"])
    said = capsys.readouterr().out
    lost = f"the run's MLflow model {model.model_uri} (step {results['steps']}) has lost its files"
    assert lost in said
    assert "logged as the MLflow model" in said and "registered as models:/nano-gone/2" in said
    expected = sampled(capsys, f"run={run_dir}", *GREEDY)
    assert sampled(capsys, "run=models:/nano-gone@lost", f"tracking_uri={uri}", *GREEDY) == expected


@pytest.mark.slow
def test_a_store_that_does_not_answer_is_one_line_in_seconds(tmp_path):
    """Not MLflow's minutes of retries, then "no such model": the store is named unreachable, with
    MLflow's own retry settings (the test suite's 0 retries removed)."""
    env = {k: v for k, v in cli_env().items() if not k.startswith("MLFLOW_HTTP_REQUEST")}
    began = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-m", "gptlab.sample", "run=models:/chars@champion",
         "tracking_uri=http://127.0.0.1:9"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    took = time.monotonic() - began
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith(
        "gptlab.sample: error: MLflow server http://127.0.0.1:9 unreachable (Connection refused)"
    )
    assert took < 60, took  # startup and ~4 s of asking, on a busy 2-core machine


def test_a_sqlite_store_that_is_not_there_is_not_made(tmp_path):
    db = tmp_path / "none" / "mlflow.db"
    with pytest.raises(GptlabError, match="no such store"):
        sample.main(["run=runs:/0123/model", f"tracking_uri=sqlite:///{db}"])
    assert not db.exists()


def served(registered):
    """The pyfunc model as the scoring server loads it: GptlabModel on the run's export folder."""
    run_dir, _, _ = registered
    model = serving.GptlabModel()
    model.load_context(SimpleNamespace(artifacts={"export": str(run_dir / "export")}))
    return model


@pytest.mark.parametrize(
    "params,named",
    [
        ({"temperature": -1.0}, "temperature=-1.0"),
        ({"temperature": float("nan")}, "temperature=nan"),
        ({"top_k": -3}, "top_k=-3"),
        ({"max_new_tokens": 0}, "max_new_tokens=0"),
        ({"max_new_tokens": 10**9}, "max_new_tokens=1000000000"),  # above the cap
        ({"max_new_tokens": "lots"}, "max_new_tokens='lots'"),
        ({"max_new_tokens": True}, "max_new_tokens=True"),
        ({"seed": 1.5}, "seed=1.5"),
    ],
)
def test_served_params_out_of_range_are_a_400_naming_the_param(registered, params, named):
    from mlflow.exceptions import MlflowException

    with pytest.raises(MlflowException, match=f"param {re.escape(named)}") as e:
        served(registered).predict(None, ["ROMEO:"], params)
    assert e.value.get_http_status_code() == 400


@pytest.mark.integration
def test_a_request_ends_at_its_deadline_and_when_the_server_is_stopping(registered, monkeypatch):
    """The work a request costs is bounded: at the deadline (the scoring server's timeout less a
    margin) it is a 504; when the server is told to stop (its SIGTERM handler sets should_exit, as
    uvicorn's does) the generation in progress ends within a token: a 503."""
    from mlflow.exceptions import MlflowException

    model = served(registered)
    many = {"max_new_tokens": serving.MAX_NEW_TOKENS}
    monkeypatch.setenv("MLFLOW_SCORING_SERVER_REQUEST_TIMEOUT", "2")  # a deadline of 1 s
    began = time.monotonic()
    with pytest.raises(MlflowException, match="deadline") as e:
        model.predict(None, ["ROMEO:"] * 200, many)
    assert e.value.get_http_status_code() == 504 and time.monotonic() - began < 10

    class Server:  # what uvicorn's Server does with SIGTERM
        should_exit = False

        def handle_exit(self, signum, frame):
            self.should_exit = True

    monkeypatch.setenv("MLFLOW_SCORING_SERVER_REQUEST_TIMEOUT", "600")
    server = Server()
    before = signal.signal(signal.SIGTERM, server.handle_exit)
    timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM))
    try:
        timer.start()
        began = time.monotonic()
        with pytest.raises(MlflowException, match="the server is stopping") as e:
            model.predict(None, ["ROMEO:"] * 200, many)
        assert e.value.get_http_status_code() == 503 and time.monotonic() - began < 10
    finally:
        timer.cancel()
        signal.signal(signal.SIGTERM, before)


@pytest.mark.slow
def test_export_and_sample_by_model_uri_print_gptlab_lines_only(registered, tmp_path):
    """Redirected, as in a job's log: no MLflow registration lines, download bars or INFO lines
    beside gptlab's own; and model.safetensors has its siblings' mode."""
    run_dir, uri, _ = registered
    r = run_cli(["gptlab.export", f"run={run_dir}", "export.register=nano-quiet", "hf=false",
                 f"out={tmp_path / 'out'}"], cwd=tmp_path)  # fmt: skip
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert r.stdout.splitlines()[-1] == "registered as models:/nano-quiet/1"
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "out").iterdir()}
    assert len(set(modes.values())) == 1, modes
    r = run_cli(["gptlab.sample", "run=models:/nano-quiet/1", f"tracking_uri={uri}", *GREEDY],
                cwd=tmp_path)  # fmt: skip
    assert r.returncode == 0 and r.stderr == "" and r.stdout.startswith("ROMEO:"), r.stderr


# ---- serving's rules in process, without a trained model


def test_params_at_their_bounds_and_the_defaults_for_those_not_given():
    from mlflow.exceptions import MlflowException

    assert serving.check_params(None) == {"max_new_tokens": 100, "temperature": 0.8, "top_k": 200,
                                          "seed": 0}  # fmt: skip
    edge = {"max_new_tokens": 4096, "temperature": 0, "top_k": 0, "seed": -(2**63)}
    assert serving.check_params(edge) == edge
    assert serving.check_params({"max_new_tokens": 1, "seed": 2**64 - 1, "top_k": None}) == {
        "max_new_tokens": 1, "temperature": 0.8, "top_k": 200, "seed": 2**64 - 1,
    }  # fmt: skip
    tokens, temp = "must be a whole number from 1 to 4096", "must be a number >= 0 (0: greedy)"
    top_k, seed = "must be a whole number >= 0 (0: the whole vocabulary)", "must be a whole number"
    bad = [
        ({"max_new_tokens": 4097}, f"param max_new_tokens=4097: {tokens}"),
        ({"max_new_tokens": 0}, f"param max_new_tokens=0: {tokens}"),
        ({"max_new_tokens": 2.0}, f"param max_new_tokens=2.0: {tokens}"),
        ({"temperature": -0.01}, f"param temperature=-0.01: {temp}"),
        ({"temperature": float("inf")}, f"param temperature=inf: {temp}"),
        ({"temperature": False}, f"param temperature=False: {temp}"),
        ({"top_k": -1}, f"param top_k=-1: {top_k}"),
        ({"top_k": True}, f"param top_k=True: {top_k}"),  # a bool is no count
        ({"max_new_tokens": True}, f"param max_new_tokens=True: {tokens}"),
        ({"seed": 2**64}, f"param seed=18446744073709551616: {seed}"),
        ({"seed": -(2**63) - 1}, f"param seed=-9223372036854775809: {seed}"),
        ({"seed": "7"}, f"param seed='7': {seed}"),
        ({"top_p": 0.9}, "param top_p=0.9: not a param of this model (max_new_tokens, "
                         "temperature, top_k, seed)"),
    ]  # fmt: skip
    for params, says in bad:
        with pytest.raises(MlflowException) as e:
            serving.check_params(params)
        assert e.value.message == says and e.value.get_http_status_code() == 400


def test_a_requests_deadline_is_the_servers_timeout_less_five_seconds_or_half_of_it(monkeypatch):
    for timeout, deadline in [("60", 55.0), ("10", 5.0), ("8", 4.0), ("2", 1.0), ("100", 95.0)]:
        monkeypatch.setenv("MLFLOW_SCORING_SERVER_REQUEST_TIMEOUT", timeout)
        assert serving.deadline_s() == deadline


def test_a_budget_stops_at_its_deadline_or_when_the_server_stops(monkeypatch):
    from mlflow.exceptions import MlflowException

    now = [100.0]
    monkeypatch.setattr(serving.time, "monotonic", lambda: now[0])
    budget = serving.Budget(2.5)
    assert budget.ends == 102.5 and not budget.stop() and budget.reason is None
    budget.check()  # nothing to say yet
    now[0] = 102.5
    assert not budget.stop()  # at the deadline itself, still in time
    now[0] = 102.6
    assert budget.stop(None) and budget.reason == "deadline"
    with pytest.raises(MlflowException) as e:
        budget.check()
    assert e.value.get_http_status_code() == 504
    assert e.value.message.startswith("generation passed the request's deadline (2.5 s); ask for")
    stopping = serving.Budget(60)
    monkeypatch.setattr(serving, "server_stopping", lambda: True)
    assert stopping.stop() and stopping.reason == "stopping"
    with pytest.raises(MlflowException, match="the server is stopping") as e:
        stopping.check()
    assert e.value.get_http_status_code() == 503


def test_the_server_is_stopping_once_its_sigterm_or_sigint_handler_has_set_should_exit(
    monkeypatch,
):
    class Server:
        should_exit = False

        def handle_exit(self, signum, frame):
            self.should_exit = True

    handlers = {}
    monkeypatch.setattr(serving.signal, "getsignal", lambda sig: handlers.get(sig))
    assert not serving.server_stopping()  # no handler, or not a server's
    for sig in (signal.SIGTERM, signal.SIGINT):
        server = Server()
        handlers.clear()
        handlers[sig] = server.handle_exit
        assert not serving.server_stopping()
        server.should_exit = True
        assert serving.server_stopping()
    server.should_exit = 1  # only uvicorn's True counts
    assert not serving.server_stopping()


def test_prompts_come_from_a_list_a_string_or_a_dataframes_prompt_column():
    import pandas as pd

    assert serving._prompts(["a", 3]) == ["a", "3"]
    assert serving._prompts("ROMEO:") == ["ROMEO:"]
    assert serving._prompts(pd.DataFrame({"x": [1], "prompt": ["p"]})) == ["p"]
    assert serving._prompts(pd.DataFrame({"text": ["t", "u"]})) == ["t", "u"]
    uris = ("models:/m/1", "runs:/r/model", "mlflow-artifacts:/x", "outputs/run", "/models:/x")
    assert [serving.is_model_uri(u) for u in uris] == [True, True, True, False, False]


def test_the_signature_names_the_prompt_and_each_params_default():
    sig = serving.signature()
    assert sig.inputs.input_names() == ["prompt"]
    assert {p.name: (p.dtype.name, p.default) for p in sig.params.params} == {
        "max_new_tokens": ("long", 100), "temperature": ("double", 0.8), "top_k": ("long", 200),
        "seed": ("long", 0),
    }  # fmt: skip


def test_the_model_links_the_runs_points_at_its_step_the_validation_ones_with_their_data():
    point = lambda name, value, step: SimpleNamespace(value=value, timestamp=7, step=step)  # noqa: E731
    history = {
        "val/loss": [point("val/loss", 3.0, 10), point("val/loss", 2.0, 20)],
        "train/loss": [point("train/loss", 2.5, 20), point("train/loss", 2.4, 21)],
        "summary/best_val_loss": [point("summary/best_val_loss", 2.0, 20)],
    }
    sent = []
    client = SimpleNamespace(
        get_metric_history=lambda run_id, name: history[name],
        log_batch=lambda run_id, metrics: sent.append((run_id, metrics)),
    )
    run = SimpleNamespace(info=SimpleNamespace(run_id="r"), data=SimpleNamespace(metrics=history))
    data = SimpleNamespace(name="tiny-val", digest="abc")
    serving.link_figures(client, run, "m-1", 20, data)
    [(run_id, metrics)] = sent
    got = [(m.key, m.value, m.step, m.timestamp, m.model_id, m.run_id, m.dataset_name,
            m.dataset_digest) for m in metrics]  # fmt: skip
    assert run_id == "r" and got == [
        ("summary/best_val_loss", 2.0, 20, 7, "m-1", "r", "tiny-val", "abc"),
        ("train/loss", 2.5, 20, 7, "m-1", "r", None, None),
        ("val/loss", 2.0, 20, 7, "m-1", "r", "tiny-val", "abc"),
    ]
    described = [{"name": "d-train", "digest": "1", "context": "training", "source_type": "local",
                  "source": "{}", "profile": "{}"}]  # fmt: skip
    assert (
        serving.validation_dataset(described) is None and serving.validation_dataset(None) is None
    )
    described.append({**described[0], "name": "d-val", "context": "validation"})
    assert serving.validation_dataset(described).name == "d-val"


def test_a_logged_models_files_are_its_mlmodel_and_an_export_folder():
    def client(tree):
        listing = lambda model_id, path=None: [SimpleNamespace(path=p) for p in tree.get(path, [])]  # noqa: E731
        return SimpleNamespace(list_logged_model_artifacts=listing)

    files = ["artifacts/export/config.json", "artifacts/export/model.safetensors"]
    whole = {None: ["MLmodel", "artifacts"], "artifacts": ["artifacts/export"],
             "artifacts/export": files}  # fmt: skip
    assert serving.has_files(client(whole), "m")
    assert not serving.has_files(client({**whole, None: ["artifacts"]}), "m")
    assert not serving.has_files(client({**whole, "artifacts/export": files[:1]}), "m")
    assert not serving.has_files(client({None: ["MLmodel"]}), "m")


def test_a_downloaded_models_export_folder_else_one_line_saying_what_is_wrong(tmp_path):
    got = tmp_path / "got"
    (got / "artifacts" / "out").mkdir(parents=True)
    (got / "artifacts" / "out" / "config.json").write_text("{}")
    (got / "artifacts" / "out" / "model.safetensors").write_text("")
    assert serving.export_in("models:/m/1", got) == got / "artifacts" / "out"
    (got / "artifacts" / "out" / "model.safetensors").unlink()
    with pytest.raises(GptlabError, match=r"^models:/m/1: the model's files are missing from"):
        serving.export_in("models:/m/1", got)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(GptlabError, match="files are missing"):
        serving.export_in("models:/m/1", empty)
    ours = tmp_path / "ours"
    ours.mkdir()
    (ours / "MLmodel").write_text(
        "flavors:\n  python_function:\n    artifacts:\n      export: {}\n"
    )
    with pytest.raises(GptlabError, match="files are missing"):
        serving.export_in("models:/m/1", ours)
    other = tmp_path / "other"
    other.mkdir()
    (other / "MLmodel").write_text("flavors:\n  sklearn: {}\n")
    with pytest.raises(GptlabError) as e:
        serving.export_in("models:/m/2", other)
    assert str(e.value) == "models:/m/2: not a gptlab model (no artifacts/*/config.json in it)"


@pytest.mark.integration
def test_init_from_a_registered_or_logged_model_reads_the_registered_weights(registered):
    """model.init_from=models:/NAME@ALIAS, models:/NAME/VERSION and runs:/ID/model download the
    model from the run's store: the same weights as the run folder it was registered from; a name
    the store does not hold is one line."""
    import shutil

    import torch

    from gptlab.config import to_config
    from gptlab.model import pretrained

    run_dir, uri, run_id = registered
    cfg = to_config(compose_config([f"tracking.uri={uri}"]))
    expected = pretrained.source_state(pretrained.read_source(str(run_dir), run_dir))
    for spec in ("models:/nano-chars@champion", "models:/nano-chars/1", f"runs:/{run_id}/model"):
        source = build.locate_source(cfg, spec)
        try:
            got = pretrained.source_state(source)
        finally:
            shutil.rmtree(source.temporary, ignore_errors=True)
        # an export stores the tied head once (as the embedding); a checkpoint names both
        assert source.kind == "export" and set(expected) - set(got) <= {"lm_head.weight"}, spec
        assert all(torch.equal(got[k], expected[k]) for k in got), spec
    with pytest.raises(
        GptlabError, match="model.init_from=models:/no-such-model@x: .*no such model"
    ):
        build.locate_source(cfg, "models:/no-such-model@x")
