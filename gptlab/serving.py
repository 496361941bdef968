"""A trained model as an MLflow model: logged in its run, registered, loaded back, served.

The logged model is an MLflow pyfunc model (`GptlabModel`) whose one artifact is gptlab's own
export folder (model.safetensors, config.json, the tokenizer's files: gptlab.export's), so it needs
gptlab and torch where it is loaded, and nothing else. `predict` takes prompts (a list of strings,
or a DataFrame with a `prompt` column) and returns each prompt followed by its generated text, as
`gptlab.sample` prints it for the same seed; the params are `max_new_tokens`, `temperature` (0:
greedy), `top_k` (0: the whole vocabulary) and `seed`. `mlflow models serve -m models:/NAME/1
--env-manager local` serves it: `POST /invocations`. A finished run logs its last checkpoint so
(`log_checkpoint`, tracking.log_model), as do gptlab.export's export.mlflow and gptlab.sync.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from gptlab.errors import GptlabError

ARTIFACT = "export"  # the pyfunc model's artifact: gptlab's export folder
MODEL_NAME = "model"  # the logged model's name in its run
MODEL_URIS = ("models:/", "runs:/", "mlflow-artifacts:/")  # what run= of sample and eval accept
PROGRESS_BAR = "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"
STEP_TAG = "gptlab.step"  # a logged model's tag: the step of the checkpoint it holds
PARAMS = {"max_new_tokens": 100, "temperature": 0.8, "top_k": 200, "seed": 0}


def load_export(folder: Path) -> Tuple[Any, Any, Dict[str, Any]]:
    """(the model in eval mode, its tokenizer, config.json) from an export folder."""
    from safetensors.torch import load_file

    from gptlab.data import load_tokenizer
    from gptlab.model import GPT, GPTConfig

    meta = json.loads((folder / "config.json").read_text())
    model = GPT(GPTConfig(**meta["model"]))
    missing, unexpected = model.load_state_dict(load_file(str(folder / "model.safetensors")),
                                                strict=False)  # fmt: skip
    if unexpected or set(missing) - {"lm_head.weight"}:  # the tied head is the embedding
        raise GptlabError(f"{folder}: not a gptlab export (weights {missing or unexpected} differ)")
    return model.eval(), load_tokenizer(meta["tokenizer"]), meta


def generate(model: Any, tokenizer: Any, prompt: str, params: Dict[str, Any]) -> str:
    """The prompt and its continuation for predict's params (PARAMS for those not given)."""
    from gptlab.inference import generate_text

    p = {**PARAMS, **{k: v for k, v in (params or {}).items() if v is not None}}
    return generate_text(model, tokenizer, prompt, p["max_new_tokens"], p["temperature"],
                         int(p["top_k"]), p["seed"])[0]  # fmt: skip


def _prompts(model_input: Any) -> List[str]:
    if hasattr(model_input, "columns"):  # a DataFrame (what the scoring server hands over)
        column = "prompt" if "prompt" in model_input.columns else model_input.columns[0]
        return [str(v) for v in model_input[column].tolist()]
    if isinstance(model_input, str):
        return [model_input]
    return [str(v) for v in model_input]


try:
    from mlflow.pyfunc import PythonModel
except ImportError:  # MLflow is an install extra of the tracking tools
    PythonModel = object  # type: ignore[assignment,misc]


class GptlabModel(PythonModel):  # type: ignore[misc]
    """The pyfunc model: loads the export folder once, generates text per prompt."""

    # the logged signature is the schema: MLflow is not to read one from predict's type hints
    # (it warns about them either way otherwise)
    _skip_type_hint_validation = True

    def load_context(self, context: Any) -> None:
        self.model, self.tokenizer, self.meta = load_export(Path(context.artifacts[ARTIFACT]))

    # model_input has no annotation: MLflow would read a signature from it (the logged one rules)
    def predict(self, context, model_input, params=None):
        prompts = _prompts(model_input)
        return [generate(self.model, self.tokenizer, p, params or {}) for p in prompts]


def signature() -> Any:
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, ParamSchema, ParamSpec, Schema

    params = ParamSchema([
        ParamSpec("max_new_tokens", "long", PARAMS["max_new_tokens"]),
        ParamSpec("temperature", "double", PARAMS["temperature"]),
        ParamSpec("top_k", "long", PARAMS["top_k"]),
        ParamSpec("seed", "long", PARAMS["seed"]),
    ])  # fmt: skip
    return ModelSignature(
        inputs=Schema([ColSpec("string", "prompt")]), outputs=Schema([ColSpec("string")]),
        params=params,
    )  # fmt: skip


def log_model(uri: str, run_id: str, export_dir: Path, step: int,
              metrics: Dict[str, float],
              datasets: Optional[List[Dict[str, Any]]] = None) -> Any:  # fmt: skip
    """Log the export folder as the run's MLflow model (linked to the run, its step and metrics,
    the validation figures to the run's validation data: lineage.describe's `datasets`); the run's
    status is left as it was. Its ModelInfo."""
    import mlflow
    import torch

    mlflow.set_tracking_uri(uri)
    client = mlflow.MlflowClient(uri)
    status = client.get_run(run_id).info.status
    mlflow.start_run(run_id=run_id)
    bar = os.environ.get(PROGRESS_BAR)
    os.environ[PROGRESS_BAR] = "false"  # it copies local files: no bar in the run's output
    try:
        with warnings.catch_warnings():
            # predict generates text: an input example would make MLflow run it at every logging
            warnings.filterwarnings("ignore", message=".*input example was not provided")
            info = mlflow.pyfunc.log_model(
                name=MODEL_NAME, python_model=str(Path(__file__).with_name("pyfunc_model.py")),
                artifacts={ARTIFACT: str(export_dir)}, signature=signature(), step=step,
                tags={STEP_TAG: str(step)},
                pip_requirements=[f"torch=={torch.__version__.split('+')[0]}", "safetensors",
                                  "tiktoken", "gptlab"],
            )  # fmt: skip
        val = validation_dataset(datasets)
        on_val = {k: v for k, v in metrics.items() if k.startswith(("val_", "best_val_"))}
        if on_val:
            mlflow.log_metrics(on_val, step=step, model_id=info.model_id, dataset=val)
        if len(on_val) < len(metrics):
            rest = {k: v for k, v in metrics.items() if k not in on_val}
            mlflow.log_metrics(rest, step=step, model_id=info.model_id)
    finally:
        mlflow.end_run(status=status)
        if bar is None:
            os.environ.pop(PROGRESS_BAR, None)
        else:
            os.environ[PROGRESS_BAR] = bar
    return info


METRICS_KEPT = ("best_val_loss", "best_val_bpb", "val_loss", "val_bpb", "hellaswag_acc_norm")


def validation_dataset(datasets: Optional[List[Dict[str, Any]]]) -> Any:
    """The run's validation data as an MLflow Dataset (None when the run folder has none)."""
    from gptlab.records import lineage

    val = [d for d in datasets or [] if d.get("context") == "validation"]
    return lineage.mlflow_dataset(val[0]) if val else None


def model_metrics(results: Dict[str, Any]) -> Dict[str, float]:
    """The results.json figures a logged model carries (METRICS_KEPT, where present)."""
    return {k: float(results[k]) for k in METRICS_KEPT if isinstance(results.get(k), (int, float))}


def log_checkpoint(run_dir: Path, uri: str, run_id: str, results: Dict[str, Any]) -> Any:
    """A run folder's latest checkpoint as its run's MLflow model (tracking.log_model at the end
    of a run): the export's files, in a temporary folder that MLflow copies. Its ModelInfo."""
    import tempfile

    from gptlab.inference import load_model, write_model_files
    from gptlab.records import lineage

    model, tokenizer, saved = load_model(str(run_dir), "latest")
    with tempfile.TemporaryDirectory(prefix="gptlab-model-") as tmp:
        out = Path(tmp) / ARTIFACT  # MLflow keeps the folder's name
        write_model_files(model, tokenizer, saved, out)
        metrics = model_metrics(results)
        return log_model(uri, run_id, out, saved.step, metrics, lineage.read(run_dir))


def logged_at(uri: str, run_id: str, step: int) -> Optional[str]:
    """The URI of the run's logged model of the checkpoint at `step` (tracking.log_model's, or an
    earlier export's), or None: exporting it again registers that one instead of a copy."""
    import mlflow

    client = mlflow.MlflowClient(uri)
    experiment = client.get_run(run_id).info.experiment_id
    found = client.search_logged_models(
        experiment_ids=[experiment],
        filter_string=f"source_run_id = '{run_id}' AND tags.`{STEP_TAG}` = '{int(step)}'",
    )
    ready = [m for m in found if str(m.status) == "READY"]
    return ready[0].model_uri if ready else None


_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\- ]{0,254}$")
_ALIAS = re.compile(r"^[A-Za-z_][A-Za-z0-9_\-]*$")


def check_names(name: str, alias: Optional[str]) -> None:
    """A registered model's name and alias MLflow takes, or one line."""
    if not _NAME.match(name):
        raise GptlabError(
            f"export.register={name!r}: a registered model's name is letters, digits, '_', '-', "
            f"'.' and spaces"
        )
    if alias is not None and (not _ALIAS.match(alias) or re.match(r"^[vV][0-9]+$", alias)):
        raise GptlabError(f"export.alias={alias!r}: an alias is a name like champion, not v3")


def register(uri: str, model_uri: str, name: str, alias: Optional[str]) -> Any:
    """A new version of the registered model `name` (made when missing), with `alias` on it."""
    import mlflow

    check_names(name, alias)
    mlflow.set_tracking_uri(uri)
    version = mlflow.register_model(model_uri, name)
    if alias:
        mlflow.MlflowClient(uri).set_registered_model_alias(name, alias, version.version)
    return version


def is_model_uri(run: Any) -> bool:
    return str(run).startswith(MODEL_URIS)


def source_run(uri: str, model_uri: str) -> Optional[str]:
    """The MLflow run a logged or registered model came from (None when MLflow does not say)."""
    import mlflow

    mlflow.set_tracking_uri(uri)
    try:
        return mlflow.models.get_model_info(model_uri).run_id
    except Exception:  # noqa: BLE001 - download() has already named a bad URI in one line
        return None


def download(uri: str, model_uri: str, dest: Path) -> Path:
    """The export folder of a logged or registered model (models:/NAME/3, models:/NAME@alias,
    runs:/<id>/model), downloaded into dest."""
    import mlflow

    mlflow.set_tracking_uri(uri)
    try:
        got = mlflow.artifacts.download_artifacts(artifact_uri=model_uri, dst_path=str(dest))
    except Exception as e:  # noqa: BLE001 - MLflow's own errors: one line naming the URI
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise GptlabError(f"{model_uri}: no such model in {uri} ({first[:200]})") from None
    # MLflow keeps the logged folder's own name (export/, or what export's out= named)
    artifacts = Path(got) / "artifacts"
    folders = sorted(p.parent for p in artifacts.glob("*/config.json"))
    if not folders:
        raise GptlabError(f"{model_uri}: not a gptlab model (no artifacts/*/config.json in it)")
    return folders[0]
