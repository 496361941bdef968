"""python -m gptlab.export run=PATH [out=DIR]: weights as safetensors plus a JSON config.

For GPT-2-shaped models (learned positions, GELU MLP of 4 x d, biases, tied head) it also writes
a folder that Hugging Face ``transformers`` loads as ``GPT2LMHeadModel`` (when transformers is
installed; the layout needs no transformers to write, only to check). Both folders get the
tokenizer as Hugging Face files (tokenizer.json, tokenizer_config.json) that ``AutoTokenizer`` loads
and that encode any text to the ids the model was trained on. The root config,
conf/export.yaml, holds only the settings below (``ExportConfig``), as top-level keys.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
from hydra.core.config_store import ConfigStore

from gptlab.cli import command, require, text_keys
from gptlab.config import to_config
from gptlab.data import Tokenizer
from gptlab.data.hf_tokenizer import special_token_ids, write_hf_tokenizer
from gptlab.inference import load_model
from gptlab.model import GPT


@dataclass
class ExportConfig:
    """The schema of conf/export.yaml (the values are there)."""

    run: str  # run folder or checkpoint file (mandatory: ???)
    out: Optional[str]  # null: <run folder>/export
    which: str  # latest | best
    hf: bool  # also write a Hugging Face GPT-2 folder when the model is GPT-2-shaped


ConfigStore.instance().store(name="gptlab_export_schema", node=ExportConfig)
TEXT_KEYS = text_keys(ExportConfig)  # run=, out=, which= are text as typed (cli.hydra_words)


def gpt2_shaped(model: GPT) -> bool:
    c = model.config
    return (
        c.pos_emb == "learned"
        and c.mlp == "gelu"
        and c.bias
        and c.tie_weights
        and c.hidden_dim == 4 * c.n_embd
    )


def hf_gpt2_state(model: GPT) -> Dict[str, torch.Tensor]:
    """Our weights under GPT-2's names; its Conv1D layers store (in, out), so Linear weights are
    transposed."""
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
    return {k: v.detach().contiguous().clone() for k, v in out.items()}


def hf_gpt2_config(model: GPT, tokenizer: Tokenizer) -> dict:
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
        "activation_function": "gelu",  # exact GELU, as trained
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
    from safetensors.torch import save_file

    require(config, "run", "run=PATH, a run folder or a checkpoint file")
    cfg = to_config(config, ExportConfig)
    model, tokenizer, saved = load_model(cfg.run, cfg.which)
    run_path = Path(cfg.run)
    out = (
        Path(cfg.out)
        if cfg.out
        else (run_path.parent.parent if run_path.is_file() else run_path) / "export"
    )
    out.mkdir(parents=True, exist_ok=True)
    # the tied LM head is the embedding: store it once
    weights = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "gptlab"})
    (out / "config.json").write_text(
        json.dumps(
            {"model": saved.model_config, "tokenizer": saved.tokenizer, "step": saved.step},
            indent=1,
        )
    )
    tokenizer_files = write_hf_tokenizer(tokenizer, out, model.config.block_size)
    print(f"wrote {out / 'model.safetensors'}, {out / 'config.json'} and the tokenizer's files")
    if cfg.hf and gpt2_shaped(model):
        hf = out / "hf_gpt2"
        hf.mkdir(exist_ok=True)
        save_file(hf_gpt2_state(model), str(hf / "model.safetensors"), metadata={"format": "pt"})
        (hf / "config.json").write_text(json.dumps(hf_gpt2_config(model, tokenizer), indent=1))
        for path in tokenizer_files:
            shutil.copy(path, hf / path.name)
        print(f"wrote a Hugging Face GPT-2 folder: {hf} (GPT2LMHeadModel, AutoTokenizer)")
    elif cfg.hf:
        print("not GPT-2-shaped (positions, MLP or biases differ): no Hugging Face folder")
    return out


def main(argv: Optional[List[str]] = None) -> Optional[Path]:
    """python -m gptlab.export run=PATH [key=value ...]: a Hydra app on conf/export.yaml.

    argv: the same key=value arguments, to export in this process (returns the export folder; errors
    raise GptlabError).
    """
    return command("export", run_export, argv)


if __name__ == "__main__":
    main()
