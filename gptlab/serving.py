"""A trained model as an MLflow model: logged in its run, registered, loaded back, served.

The logged model is an MLflow pyfunc model (`GptlabModel`) whose one artifact is gptlab's own
export folder (model.safetensors, config.json, the tokenizer's files: gptlab.export's), so it needs
gptlab and torch where it is loaded, and nothing else. `predict` takes prompts (a list of strings,
or a DataFrame with a `prompt` column) and returns each prompt followed by its generated text, as
`gptlab.sample` prints it for the same seed; the params are `max_new_tokens`, `temperature` (0:
greedy), `top_k` (0: the whole vocabulary) and `seed`. `mlflow models serve -m models:/NAME/1
--env-manager local` serves it: `POST /invocations`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from gptlab.errors import GptlabError

ARTIFACT = "export"  # the pyfunc model's artifact: gptlab's export folder
MODEL_NAME = "model"  # the logged model's name in its run
MODEL_URIS = ("models:/", "runs:/", "mlflow-artifacts:/")  # what run= of sample and eval accept
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
    """The prompt and its continuation, as gptlab.sample writes it for one sample."""
    import torch

    p = {**PARAMS, **{k: v for k, v in (params or {}).items() if v is not None}}
    idx = torch.tensor([tokenizer.encode(prompt) or [0]], dtype=torch.long)
    gen = torch.Generator().manual_seed(int(p["seed"]))
    top_k = int(p["top_k"]) or None
    out = model.generate(idx, int(p["max_new_tokens"]), temperature=float(p["temperature"]),
                         top_k=top_k, generator=gen)  # fmt: skip
    return tokenizer.decode(out[0].tolist())


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

    def predict(self, context: Any, model_input: Any, params: Optional[Dict[str, Any]] = None):
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
              metrics: Dict[str, float]) -> Any:  # fmt: skip
    """Log the export folder as the run's MLflow model (linked to the run, its step and metrics);
    the run's status is left as it was. Its ModelInfo."""
    import mlflow
    import torch

    mlflow.set_tracking_uri(uri)
    client = mlflow.MlflowClient(uri)
    status = client.get_run(run_id).info.status
    mlflow.start_run(run_id=run_id)
    try:
        info = mlflow.pyfunc.log_model(
            name=MODEL_NAME, python_model=GptlabModel(), artifacts={ARTIFACT: str(export_dir)},
            signature=signature(), step=step,
            pip_requirements=[f"torch=={torch.__version__.split('+')[0]}", "safetensors",
                              "tiktoken", "gptlab"],
        )  # fmt: skip
        if metrics:
            mlflow.log_metrics(metrics, step=step, model_id=info.model_id)
    finally:
        mlflow.end_run(status=status)
    return info


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
    folder = Path(got) / "artifacts" / ARTIFACT
    if not (folder / "config.json").is_file():
        raise GptlabError(f"{model_uri}: not a gptlab model (no {ARTIFACT}/config.json in it)")
    return folder
