"""A trained model as an MLflow model: logged in its run, registered, loaded back, served.

The logged model is an MLflow pyfunc model (`GptlabModel`) whose one artifact is gptlab's own
export folder (model.safetensors, config.json, the tokenizer's files: gptlab.export's), so it needs
gptlab and torch where it is loaded, and nothing else. `predict` takes prompts (a list of strings,
or a DataFrame with a `prompt` column) and returns each prompt followed by its generated text, as
`gptlab.sample` prints it for the same seed; the params are `max_new_tokens` (1 to
MAX_NEW_TOKENS), `temperature` (>= 0; 0: greedy), `top_k` (>= 0; 0: the whole vocabulary) and
`seed`, each checked (`check_params`: MLflow's INVALID_PARAMETER_VALUE, the scoring server's 400).
A request generates until its deadline (`deadline_s`: 504 after it) and a served process that is
told to stop (SIGTERM) ends the generation in progress (503). `mlflow models serve -m
models:/NAME/1 --env-manager local` serves it: `POST /invocations`. A finished run logs its last
checkpoint so (`log_checkpoint`, tracking.log_model), as do gptlab.export's export.mlflow and
gptlab.sync; the model's figures are the run's own points at its step (`link_figures`).
"""

from __future__ import annotations

import contextlib
import json
import math
import numbers
import os
import signal
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from gptlab.errors import GptlabError, as_user_error, or_none
from gptlab.records.store import METRIC_NAMES, SUMMARY_METRICS, check_names

ARTIFACT = "export"  # the pyfunc model's artifact: gptlab's export folder
MODEL_NAME = "model"  # the logged model's name in its run
MODEL_URIS = ("models:/", "runs:/", "mlflow-artifacts:/")  # what run= of sample and eval accept
PROGRESS_BAR = "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"
STEP_TAG = "gptlab.step"  # a logged model's tag: the step of the checkpoint it holds
PARAMS = {"max_new_tokens": 100, "temperature": 0.8, "top_k": 200, "seed": 0}
MAX_NEW_TOKENS = 4096  # the most max_new_tokens a request may ask for (docs/registry.md)
DEADLINE_MARGIN_S = 5.0  # a request's generation ends this long before the server's own timeout


def load_export(folder: Path) -> Tuple[Any, Any, Dict[str, Any]]:
    """(the model in eval mode, its tokenizer, config.json) from an export folder."""
    from safetensors.torch import load_file

    from gptlab.data import load_tokenizer
    from gptlab.model.gpt import GPT, GPTConfig

    meta = json.loads((folder / "config.json").read_text())
    model = GPT(GPTConfig(**meta["model"]))
    missing, unexpected = model.load_state_dict(
        load_file(str(folder / "model.safetensors")), strict=False
    )
    if unexpected or set(missing) - {"lm_head.weight"}:  # the tied head is the embedding
        raise GptlabError(f"{folder}: not a gptlab export (weights {missing or unexpected} differ)")
    return model.eval(), load_tokenizer(meta["tokenizer"]), meta


def _whole(v: Any) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _number(v: Any) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)


# param -> (the test a given value passes, what it must be)
RULES: Dict[str, Tuple[Callable[[Any], bool], str]] = {
    "max_new_tokens": (
        lambda v: _whole(v) and 1 <= v <= MAX_NEW_TOKENS,
        f"a whole number from 1 to {MAX_NEW_TOKENS}",
    ),
    "temperature": (lambda v: _number(v) and v >= 0, "a number >= 0 (0: greedy)"),
    "top_k": (lambda v: _whole(v) and v >= 0, "a whole number >= 0 (0: the whole vocabulary)"),
    "seed": (lambda v: _whole(v) and -(2**63) <= v < 2**64, "a whole number"),
}


def check_params(params: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """predict's params, PARAMS for those not given (or None); bad values raise MlflowException.

    A value of the wrong type or out of range raises MlflowException(INVALID_PARAMETER_VALUE), which
    the scoring server answers with a 400 naming the param.
    """
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE

    given = {k: v for k, v in (params or {}).items() if v is not None}
    for name, value in given.items():
        test, must = RULES.get(name, (None, ""))
        if test is not None and test(value):
            continue
        why = f"must be {must}" if test else f"not a param of this model ({', '.join(PARAMS)})"
        shown = repr(value) if isinstance(value, str) else value
        raise MlflowException(f"param {name}={shown}: {why}", error_code=INVALID_PARAMETER_VALUE)
    return {**PARAMS, **given}


def deadline_s() -> float:
    """How long one request may generate: DEADLINE_MARGIN_S less than the server's own timeout.

    The scoring server's timeout is MLFLOW_SCORING_SERVER_REQUEST_TIMEOUT (`mlflow models serve -t`,
    60 s by default); the deadline is at least half of it. So gptlab answers before the server's
    bare 504 and no generation goes on after its request was answered.
    """
    from mlflow.environment_variables import MLFLOW_SCORING_SERVER_REQUEST_TIMEOUT

    timeout = float(MLFLOW_SCORING_SERVER_REQUEST_TIMEOUT.get())
    return max(timeout - DEADLINE_MARGIN_S, timeout / 2)


def server_stopping() -> bool:
    """Whether the server running this process was told to stop (SIGTERM, SIGINT).

    Under `mlflow models serve` that is uvicorn, whose handler of both is its Server's method: it
    sets the server's `should_exit`, then the server waits for the requests in flight (and the
    interpreter for the threads that run them). Read here, a generation ends at its next token
    instead of holding the shutdown until it is done.
    """
    for sig in (signal.SIGTERM, signal.SIGINT):
        server = getattr(signal.getsignal(sig), "__self__", None)
        if getattr(server, "should_exit", False) is True:
            return True
    return False


class Budget:
    """One request's bound: its generation stops at the deadline, or when the server must stop.

    The server is told to stop through server_stopping; `check` then raises the request's error.
    """

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.ends = time.monotonic() + seconds
        self.reason: Optional[str] = None

    def stop(self, out: Any = None) -> bool:
        """inference.generate_text's stop: called after each new token."""
        if server_stopping():
            self.reason = "stopping"
        elif time.monotonic() > self.ends:
            self.reason = "deadline"
        return self.reason is not None

    def check(self) -> None:
        from mlflow.exceptions import MlflowException
        from mlflow.protos.databricks_pb2 import DEADLINE_EXCEEDED, TEMPORARILY_UNAVAILABLE

        if self.reason == "stopping":
            raise MlflowException(
                "the server is stopping: generation ended; send the request again",
                error_code=TEMPORARILY_UNAVAILABLE,
            )
        if self.reason == "deadline":
            raise MlflowException(
                f"generation passed the request's deadline ({self.seconds:g} s); ask for fewer "
                "max_new_tokens or prompts, or serve with a longer timeout (mlflow models serve "
                "-t)",
                error_code=DEADLINE_EXCEEDED,
            )


def generate(
    model: Any,
    tokenizer: Any,
    prompt: str,
    params: Optional[Dict[str, Any]],
    stop: Optional[Callable[[Any], bool]] = None,
) -> str:
    """The prompt and its continuation for predict's params, ending early where stop says so.

    The params are check_params' ones.
    """
    from gptlab.model.inference import generate_text

    p = check_params(params)
    return generate_text(
        model,
        tokenizer,
        prompt,
        p["max_new_tokens"],
        p["temperature"],
        int(p["top_k"]),
        p["seed"],
        stop=stop,
    )[0]


def _prompts(model_input: Any) -> List[str]:
    if hasattr(model_input, "columns"):  # a DataFrame (what the scoring server hands over)
        column = "prompt" if "prompt" in model_input.columns else model_input.columns[0]
        return [str(v) for v in model_input[column].tolist()]
    if isinstance(model_input, str):
        return [model_input]
    return [str(v) for v in model_input]


class TextGeneration:
    """The pyfunc model's behaviour: loads the export folder once, generates text per prompt.

    Each generation stays within the request's Budget. GptlabModel is this class with MLflow's
    PythonModel, made on first use (module __getattr__), so that importing this module (on every
    training run's path) does not import MLflow.
    """

    # the logged signature is the schema: MLflow is not to read one from predict's type hints
    # (it warns about them either way otherwise)
    _skip_type_hint_validation = True

    def load_context(self, context: Any) -> None:
        self.model, self.tokenizer, self.meta = load_export(Path(context.artifacts[ARTIFACT]))

    # model_input has no annotation: MLflow would read a signature from it (the logged one rules)
    def predict(self, context, model_input, params=None):
        settings = check_params(params)  # all of them, before any text is generated
        budget = Budget(deadline_s())
        texts = []
        for prompt in _prompts(model_input):
            if not budget.stop():
                texts.append(generate(self.model, self.tokenizer, prompt, settings, budget.stop))
            budget.check()
        return texts


def __getattr__(name: str) -> Any:
    """GptlabModel, the pyfunc model class (TextGeneration with MLflow's PythonModel), made once.

    Every logged model's code (pyfunc_model.py, copied into the model) imports it by this name.
    """
    if name != "GptlabModel":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from mlflow.pyfunc import PythonModel

    model = type("GptlabModel", (TextGeneration, PythonModel), {"__module__": __name__})
    globals()[name] = model
    return model


def signature() -> Any:
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, ParamSchema, ParamSpec, Schema

    params = ParamSchema(
        [
            ParamSpec("max_new_tokens", "long", PARAMS["max_new_tokens"]),
            ParamSpec("temperature", "double", PARAMS["temperature"]),
            ParamSpec("top_k", "long", PARAMS["top_k"]),
            ParamSpec("seed", "long", PARAMS["seed"]),
        ]
    )
    return ModelSignature(
        inputs=Schema([ColSpec("string", "prompt")]),
        outputs=Schema([ColSpec("string")]),
        params=params,
    )


def log_model(
    uri: str,
    run_id: str,
    export_dir: Path,
    step: int,
    datasets: Optional[List[Dict[str, Any]]] = None,
) -> Any:
    """Log the export folder as the run's MLflow model of `step`; its ModelInfo.

    The model is linked to the run (its source run, and the run's model output at `step`) and to the
    run's own figures at that step (link_figures). The run itself is not touched otherwise: not made
    active, its status and points as they were.
    """
    import mlflow
    import torch
    from mlflow.entities import LoggedModelOutput

    mlflow.set_tracking_uri(uri)
    client = mlflow.MlflowClient(uri)
    run = client.get_run(run_id)
    # made here, not by log_model in the active run: that links the run's figures at the step
    # itself, without their dataset, and a figure cannot be linked twice (link_figures)
    model = client.create_logged_model(
        run.info.experiment_id,
        name=MODEL_NAME,
        source_run_id=run_id,
        tags={STEP_TAG: str(step)},
        params=dict(run.data.params),
    )
    bar = os.environ.get(PROGRESS_BAR)
    os.environ[PROGRESS_BAR] = "false"  # it copies local files: no bar in the run's output
    try:
        with warnings.catch_warnings():
            # predict generates text: an input example would make MLflow run it at every logging
            warnings.filterwarnings("ignore", message=".*input example was not provided")
            info = mlflow.pyfunc.log_model(
                name=MODEL_NAME,
                python_model=str(Path(__file__).with_name("pyfunc_model.py")),
                artifacts={ARTIFACT: str(export_dir)},
                signature=signature(),
                model_id=model.model_id,
                pip_requirements=[
                    f"torch=={torch.__version__.split('+')[0]}",
                    "safetensors",
                    "tiktoken",
                    "gptlab",
                ],
            )
    finally:
        if bar is None:
            os.environ.pop(PROGRESS_BAR, None)
        else:
            os.environ[PROGRESS_BAR] = bar
    client.log_outputs(run_id, [LoggedModelOutput(model.model_id, step)])
    link_figures(client, run, model.model_id, step, validation_dataset(datasets))
    return info


# the run's figures measured on its validation data (the model's page names the data)
ON_VALIDATION = {METRIC_NAMES["val_loss"], METRIC_NAMES["val_bpb"]} | {
    SUMMARY_METRICS[k] for k in ("best_val_loss", "best_val_bpb", "val_loss", "val_bpb")
}


def link_figures(client: Any, run: Any, model_id: str, step: int, validation: Any) -> None:
    """Link the model to its figures: the run's own points at its step.

    The figures are val/loss, summary/best_val_loss, ...: the names the run records, each linked to
    the model, the validation ones with the run's validation data (an MLflow Dataset, or None). Sent
    again as they are (name, value, step, time), each stays one point of the run: the store keeps a
    point once, so the run holds exactly what it recorded (sync's count is the store's).
    """
    from mlflow.entities import Metric

    run_id = run.info.run_id
    linked = []
    for name in sorted(run.data.metrics):
        for m in client.get_metric_history(run_id, name):
            data = validation if name in ON_VALIDATION else None
            if m.step == step:
                linked.append(
                    Metric(
                        name,
                        m.value,
                        m.timestamp,
                        m.step,
                        model_id=model_id,
                        run_id=run_id,
                        dataset_name=data and data.name,
                        dataset_digest=data and data.digest,
                    )
                )
    for i in range(0, len(linked), 1000):
        client.log_batch(run_id, metrics=linked[i : i + 1000])


def validation_dataset(datasets: Optional[List[Dict[str, Any]]]) -> Any:
    """The run's validation data as an MLflow Dataset (None when the run folder has none)."""
    from gptlab.records import lineage

    val = [d for d in datasets or [] if d.get("context") == "validation"]
    return lineage.mlflow_dataset(val[0]) if val else None


def log_checkpoint(run_dir: Path, uri: str, run_id: str, results: Dict[str, Any]) -> Any:
    """Log a run folder's latest checkpoint as its run's MLflow model; its ModelInfo.

    This is tracking.log_model at the end of a run: the export's files, in a temporary folder that
    MLflow copies. results: the run's results.json; the model's figures are the run's points
    (link_figures).
    """
    import tempfile

    from gptlab.model.inference import load_model, write_model_files
    from gptlab.records import lineage

    model, tokenizer, saved = load_model(str(run_dir), "latest")
    with tempfile.TemporaryDirectory(prefix="gptlab-model-") as tmp:
        out = Path(tmp) / ARTIFACT  # MLflow keeps the folder's name
        write_model_files(model, tokenizer, saved, out)
        return log_model(uri, run_id, out, saved.step, lineage.read(run_dir))


def logged_at(uri: str, run_id: str, step: int) -> Tuple[Optional[str], List[str]]:
    """The URI of the run's logged model of `step` (or None), and the URIs whose files are gone.

    The first is tracking.log_model's or an earlier export's model of the checkpoint at `step`; the
    second lists those of that step whose files are gone from the artifact store. Exporting the
    checkpoint again registers the first instead of a copy; one whose files are gone is not it (it
    would register, and not load).
    """
    import mlflow

    client = mlflow.MlflowClient(uri)
    experiment = client.get_run(run_id).info.experiment_id
    found = client.search_logged_models(
        experiment_ids=[experiment],
        filter_string=f"source_run_id = '{run_id}' AND tags.`{STEP_TAG}` = '{int(step)}'",
    )
    lost = []
    for model in (m for m in found if str(m.status) == "READY"):
        if has_files(client, model.model_id):
            return model.model_uri, lost
        lost.append(model.model_uri)
    return None, lost


def has_files(client: Any, model_id: str) -> bool:
    """Whether a logged model's files are in the artifact store.

    The files are its MLmodel, and an export folder with config.json and model.safetensors (a model
    whose artifacts were deleted is READY still).
    """
    top = {f.path for f in client.list_logged_model_artifacts(model_id)}
    if "MLmodel" not in top:
        return False
    for folder in client.list_logged_model_artifacts(model_id, "artifacts"):
        files = client.list_logged_model_artifacts(model_id, folder.path)
        if {"config.json", "model.safetensors"} <= {Path(f.path).name for f in files}:
            return True
    return False


@contextlib.contextmanager
def mlflow_quiet() -> Iterator[None]:
    """Turn MLflow's own lines to stderr off; gptlab says what it did itself.

    MLflow prints `Successfully registered model ...`, `Created version ...` whatever the log level.
    """
    from mlflow.utils.logging_utils import MLFLOW_LOGGING_STREAM

    was = MLFLOW_LOGGING_STREAM.enabled
    MLFLOW_LOGGING_STREAM.enabled = False
    try:
        yield
    finally:
        MLFLOW_LOGGING_STREAM.enabled = was


def register(uri: str, model_uri: str, name: str, alias: Optional[str]) -> Any:
    """A new version of the registered model `name` (made when missing), with `alias` on it."""
    import mlflow

    check_names(name, alias)
    mlflow.set_tracking_uri(uri)
    with mlflow_quiet():
        version = mlflow.register_model(model_uri, name)
    if alias:
        mlflow.MlflowClient(uri).set_registered_model_alias(name, alias, version.version)
    return version


def is_model_uri(run: Any) -> bool:
    return str(run).startswith(MODEL_URIS)


def source_run(uri: str, model_uri: str) -> Optional[str]:
    """The MLflow run a logged or registered model came from, or None when MLflow does not say.

    It is its logged model's source run (the MLmodel file names none: log_model logs it outside the
    run).
    """
    import mlflow

    mlflow.set_tracking_uri(uri)

    def ask() -> Optional[str]:
        info = mlflow.models.get_model_info(model_uri)
        if info.run_id or not info.model_id:
            return info.run_id
        return mlflow.MlflowClient(uri).get_logged_model(info.model_id).source_run_id

    return or_none(ask)  # None on failure: download() has already named a bad URI in one line


# MLflow's error codes for a model URI that names nothing in the store
NOT_FOUND = ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE", "NOT_FOUND")


def download(uri: str, model_uri: str, dest: Path) -> Path:
    """Download the export folder of a logged or registered model into dest.

    The model: models:/NAME/3, models:/NAME@alias, runs:/<id>/model. One line each for a store that
    does not answer (in seconds), a model it does not have, a model whose files are gone, and one
    not gptlab's.
    """
    import mlflow

    from gptlab.records.store import open_store, store_failure

    # a server that does not answer, or a SQLite file that is not there: not "no such model"
    open_store(uri, "name the model's store with tracking_uri=... (a server: start it)", False)
    mlflow.set_tracking_uri(uri)

    def failure(e: BaseException) -> str:  # MLflow's own errors: one line naming the URI
        if getattr(e, "error_code", None) not in NOT_FOUND:
            return f"{model_uri}: MLflow {store_failure(uri, e)}"
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        return f"{model_uri}: no such model in {uri} ({first[:200]})"

    with as_user_error(failure):
        got = mlflow.artifacts.download_artifacts(artifact_uri=model_uri, dst_path=str(dest))
    return export_in(model_uri, Path(got))


def export_in(model_uri: str, got: Path) -> Path:
    """gptlab's export folder in a downloaded model, or one line saying why there is none.

    MLflow keeps the logged folder's own name: export/, or what export's out= named. The line says
    its files are gone, or it is no gptlab model.
    """
    import yaml

    folders = sorted(p.parent for p in got.glob("artifacts/*/config.json"))
    if folders and (folders[0] / "model.safetensors").is_file():
        return folders[0]
    mlmodel = got / "MLmodel"
    flavor = yaml.safe_load(mlmodel.read_text()) if mlmodel.is_file() else {}
    ours = ARTIFACT in (
        (flavor or {}).get("flavors", {}).get("python_function", {}).get("artifacts") or {}
    )
    if folders or ours or not any(got.rglob("*")):
        raise GptlabError(
            f"{model_uri}: the model's files are missing from the store's artifacts (deleted?); "
            "log its checkpoint again: python -m gptlab.export run=<its run folder> "
            "export.register=<name>"
        )
    raise GptlabError(f"{model_uri}: not a gptlab model (no artifacts/*/config.json in it)")
