"""python -m gptlab.export run=PATH [out=DIR]: weights as safetensors plus a JSON config.

For GPT-2-shaped models (learned positions, GELU MLP of 4 x d, biases, tied head) it also writes
a folder that Hugging Face ``transformers`` loads as ``GPT2LMHeadModel`` (when transformers is
installed; the layout needs no transformers to write, only to check). Both folders get the
tokenizer as Hugging Face files (tokenizer.json, tokenizer_config.json) that ``AutoTokenizer`` loads
and that encode any text to the ids the model was trained on. The root config,
conf/export.yaml, holds only the settings below (``ExportConfig``); what goes to MLflow is under
``export.`` (``export.mlflow``, ``export.register``, ``export.alias``).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

from hydra.core.config_store import ConfigStore

from gptlab.cli import command, require, text_keys
from gptlab.config import to_config
from gptlab.errors import GptlabError, as_user_error
from gptlab.records import layout

if TYPE_CHECKING:  # hints only: torch stays off the start-up path of --help and config errors
    import torch

    from gptlab.data import Tokenizer
    from gptlab.model.gpt import GPT


@dataclass
class MlflowExport:
    """export.*: the export as an MLflow model, and its registration."""

    mlflow: bool  # also log the export as an MLflow model of the checkpoint's run
    register: Optional[str]  # also register it as a new version of this model name
    alias: Optional[str]  # and point this alias (e.g. champion) at the new version


@dataclass
class ExportConfig:
    """The schema of conf/export.yaml (the values are there)."""

    run: str  # run folder or checkpoint file (mandatory: ???)
    out: Optional[str]  # null: <run folder>/export
    which: str  # latest | best
    hf: bool  # also write a Hugging Face GPT-2 folder when the model is GPT-2-shaped
    export: MlflowExport
    tracking_uri: Optional[str]  # null: the store the run was recorded in


ConfigStore.instance().store(name="gptlab_export_schema", node=ExportConfig)
TEXT_KEYS = text_keys(ExportConfig)  # run=, out=, which= are text as typed (cli.hydra_words)


def gpt2_shaped(model: GPT) -> bool:
    c = model.config
    return (
        c.pos_emb == "learned"
        and c.mlp in ("gelu", "gelu_tanh")
        and c.bias
        and c.tie_weights
        and c.hidden_dim == 4 * c.n_embd
    )


def hf_gpt2_state(model: GPT) -> Dict[str, torch.Tensor]:
    """Our weights under GPT-2's names, Linear weights transposed.

    GPT-2's Conv1D layers store (in, out), so Linear weights are transposed.
    """
    V = model.config.vocab_size
    out = {
        "transformer.wte.weight": model.wte.weight[:V],
        "transformer.wpe.weight": model.wpe.weight,
        "transformer.ln_f.weight": model.ln_f.weight,
        "transformer.ln_f.bias": model.ln_f.bias,
    }
    for i, block in enumerate(model.h):
        p = f"transformer.h.{i}."
        for name in ("ln_1", "ln_2"):
            ln = getattr(block, name)
            out[p + name + ".weight"], out[p + name + ".bias"] = ln.weight, ln.bias
        for name, lin in (
            ("attn.c_attn", block.attn.c_attn),
            ("attn.c_proj", block.attn.c_proj),
            ("mlp.c_fc", block.mlp.c_fc),
            ("mlp.c_proj", block.mlp.c_proj),
        ):
            out[p + name + ".weight"], out[p + name + ".bias"] = lin.weight.t(), lin.bias
    out = {k: v.detach().contiguous().clone() for k, v in out.items()}
    if model.config.parametrization == "mup":
        fold_mup(out, model)
    return out


def fold_mup(state: Dict[str, torch.Tensor], model: GPT) -> None:
    """muP's multipliers folded into plain GPT-2 weights (docs/mup.md), in place.

    The attention scale's factor over SDPA's 1/sqrt(d_head) goes into the queries (c_attn's first
    n_embd outputs, weight and bias), and the output multiplier 1/m into ln_f's gain and bias (the
    head is tied to the embedding, which cannot carry it; ln_f's output feeds only the head).
    """
    C, n_head = model.config.n_embd, model.config.n_head
    query = model.h[0].attn.scale * (C // n_head) ** 0.5 if model.h else 1.0
    for i in range(len(model.h)):
        p = f"transformer.h.{i}.attn.c_attn."
        state[p + "weight"][:, :C] *= query  # Conv1D: (in, out), the queries are the first outputs
        state[p + "bias"][:C] *= query
    for name in ("transformer.ln_f.weight", "transformer.ln_f.bias"):
        state[name] *= 1.0 / model.config.width_mult


def hf_gpt2_config(model: GPT, tokenizer: Tokenizer) -> dict:
    # numpy (the tokenizers): off the start-up path of --help and config errors
    from gptlab.data.hf_tokenizer import special_token_ids

    c = model.config
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": c.vocab_size,
        "n_positions": c.block_size,
        "n_ctx": c.block_size,
        "n_embd": c.n_embd,
        "n_layer": c.n_layer,
        "n_head": c.n_head,
        "n_inner": None,
        # the GELU as trained: exact, or GPT-2's tanh form (a model fine-tuned from GPT-2)
        "activation_function": "gelu_new" if c.mlp == "gelu_tanh" else "gelu",
        "resid_pdrop": c.dropout,
        "embd_pdrop": c.dropout,
        "attn_pdrop": 0.0,
        "layer_norm_epsilon": 1e-5,
        "initializer_range": 0.02,
        "tie_word_embeddings": True,
        # GPT2Config's defaults are GPT-2's 50256; None where this tokenizer has no such token
        **special_token_ids(tokenizer),
        "gptlab_tokenizer": tokenizer.kind,
    }


def run_export(config: Any) -> Path:
    """Write the export folder and return it. config: composed from conf/export.yaml."""
    require(config, "run", "run=PATH, a run folder or a checkpoint file")
    cfg = to_config(config, ExportConfig)
    if cfg.export.register or cfg.export.alias:  # before anything is read or written
        from gptlab.records.store import check_names

        check_names(cfg.export.register, cfg.export.alias)
    # torch: off the start-up path of --help and config errors (imported once the config is valid)
    from gptlab.model.inference import load_model, save_weights, write_model_files

    model, tokenizer, saved = load_model(cfg.run, cfg.which)
    run_path = Path(cfg.run)
    # the run in MLflow, its store answering: before the export folder is written
    target = mlflow_target(cfg, run_path) if cfg.export.mlflow or cfg.export.register else None
    out = Path(cfg.out) if cfg.out else layout.run_folder_of(run_path) / "export"
    tokenizer_files = write_model_files(model, tokenizer, saved, out)
    print(f"wrote {out / 'model.safetensors'}, {out / 'config.json'} and the tokenizer's files")
    if cfg.hf and gpt2_shaped(model):
        hf = out / "hf_gpt2"
        hf.mkdir(exist_ok=True)
        save_weights(hf_gpt2_state(model), hf / "model.safetensors", {"format": "pt"})
        (hf / "config.json").write_text(json.dumps(hf_gpt2_config(model, tokenizer), indent=1))
        for path in tokenizer_files:
            shutil.copy(path, hf / path.name)
        print(f"wrote a Hugging Face GPT-2 folder: {hf} (GPT2LMHeadModel, AutoTokenizer)")
    elif cfg.hf:
        print("not GPT-2-shaped (positions, MLP or biases differ): no Hugging Face folder")
    if target is not None:
        log_to_mlflow(cfg, target, out, saved.step)
    return out


Target = Tuple[str, str]  # the store, the MLflow run id


def mlflow_target(cfg: ExportConfig, run_path: Path) -> Target:
    """(the store, the MLflow run id) a run folder was recorded as, the store answering.

    Else one line saying why not.
    """
    from gptlab.records import identity
    from gptlab.records.store import open_store

    folder = layout.run_folder_of(run_path)
    config = layout.read_config(folder)
    results = layout.read_results(folder)
    run_id = results.get("mlflow_run_id")
    if config is None or not run_id:
        raise GptlabError(
            f"{folder}: the run is not in MLflow (no mlflow_run_id in its results.json); record "
            f"it with python -m gptlab.sync {folder}, then export again"
        )
    sweep = layout.read_sweep(folder) or identity.sweep_from_multirun(folder.parent)
    uri = cfg.tracking_uri or identity.store_of(config, sweep)
    open_store(uri, "start it, or name the run's store with tracking_uri=...", create=False)
    return uri, run_id


def log_to_mlflow(cfg: ExportConfig, target: Target, out: Path, step: int) -> None:
    """export.mlflow / export.register: the export as the run's MLflow model, then a version of it.

    The run's MLflow model is the one the run logged already, where its files are in the store.
    """
    from gptlab.records import lineage
    from gptlab.records.store import error_text
    from gptlab.registry import serving

    uri, run_id = target
    name, alias = cfg.export.register, cfg.export.alias
    with as_user_error(lambda e: f"MLflow at {uri}: {error_text(e)}"):  # the store's errors
        model_uri, lost = serving.logged_at(uri, run_id, step)
        for gone in lost:
            print(f"the run's MLflow model {gone} (step {step}) has lost its files: not that one")
        if model_uri:
            print(f"the run's MLflow model {model_uri} holds this checkpoint (step {step}) already")
        else:
            datasets = lineage.read(layout.run_folder_of(Path(cfg.run)))
            model_uri = serving.log_model(uri, run_id, out, step, datasets).model_uri
            print(f"logged as the MLflow model {model_uri} of run {run_id} in {uri}")
        if name:
            v = serving.register(uri, model_uri, name, alias)
            told = f", alias @{alias}" if alias else ""
            print(f"registered as models:/{name}/{v.version}{told}")


def main(argv: Optional[List[str]] = None) -> Optional[Path]:
    """python -m gptlab.export run=PATH [key=value ...]: a Hydra app on conf/export.yaml.

    argv: the same key=value arguments, to export in this process (returns the export folder; errors
    raise GptlabError).
    """
    return command("export", run_export, argv)


if __name__ == "__main__":
    main()
