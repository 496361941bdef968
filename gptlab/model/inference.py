"""A trained model for inference: the model and its tokenizer, rebuilt from a checkpoint alone.

The library side of ``gptlab.sample`` and ``gptlab.export``: neither needs the run's config, only
the checkpoint's saved model config, weights (their average where the run kept one) and tokenizer.
``generate_text`` is the one way text is generated from a prompt: the run's samples.txt,
``gptlab.sample`` and the served MLflow model all call it, so one seed gives one text everywhere.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from gptlab.checkpoint import state as checkpoint
from gptlab.data import Tokenizer, load_tokenizer
from gptlab.data.hf_tokenizer import write_hf_tokenizer
from gptlab.errors import GptlabError
from gptlab.model.gpt import GPT, GPTConfig
from gptlab.optim.average import AVERAGE, load_average


def load_model(
    run: str, which: str = "latest", device: str = "cpu"
) -> Tuple[GPT, Tokenizer, checkpoint.TrainingState]:
    """The trained model (eval mode) and its tokenizer, rebuilt from a checkpoint's saved model.

    The model is its weight average where the run kept one. A run= that is not there is one line
    saying so.
    """
    if not Path(run).expanduser().exists():
        raise GptlabError(
            f"run={run}: no such folder or file (a run folder, a checkpoint file, or an MLflow "
            "model URI: models:/NAME@alias, runs:/<id>/model)"
        )
    saved = checkpoint.read_model(checkpoint.find(run, which), optimizer_entries=(AVERAGE,))
    model = GPT(GPTConfig(**saved.model_config))
    model.load_state_dict(saved.model)
    load_average(model, saved.optimizer)  # the weights the run evaluated (optimizer.ema_decay > 0)
    return model.to(device).eval(), load_tokenizer(saved.tokenizer), saved


def generate_text(
    model: GPT,
    tokenizer: Tokenizer,
    prompt: str,
    max_new_tokens: int,
    temperature: float,
    top_k: Optional[int],
    seed: int,
    num_samples: int = 1,
    stop: Optional[Callable[[torch.Tensor], bool]] = None,
) -> List[str]:
    """num_samples texts, each the prompt and its continuation.

    They are drawn with one generator seeded with `seed` on the model's device (temperature 0:
    greedy; top_k None or 0: every token). An empty prompt starts from token 0. stop(tokens so far),
    after each new token: True ends the texts there (the served model's deadline).
    """
    device = next(model.parameters()).device
    ids = tokenizer.encode(prompt) or [0]
    idx = torch.tensor([ids] * num_samples, dtype=torch.long, device=device)
    gen = torch.Generator(device=device).manual_seed(int(seed))
    out = model.generate(
        idx,
        int(max_new_tokens),
        temperature=float(temperature),
        top_k=top_k or None,
        generator=gen,
        stop=stop,
    )
    return [tokenizer.decode(row) for row in out.tolist()]


def write_model_files(model: GPT, tokenizer: Tokenizer, saved: Any, out: Path) -> List[Path]:
    """Write gptlab's own export in `out`; the tokenizer's files are returned.

    model.safetensors, config.json (the model config, the tokenizer, the step) and the tokenizer as
    Hugging Face files (returned).
    """
    out.mkdir(parents=True, exist_ok=True)
    # the tied LM head is the embedding: store it once
    weights = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_weights(weights, out / "model.safetensors", {"format": "gptlab"})
    meta = {"model": saved.model_config, "tokenizer": saved.tokenizer, "step": saved.step}
    (out / "config.json").write_text(json.dumps(meta, indent=1))
    return write_hf_tokenizer(tokenizer, out, model.config.block_size)


def save_weights(weights: Dict[str, torch.Tensor], path: Path, metadata: Dict[str, str]) -> None:
    """Write a safetensors file with the mode any other new file gets (0644 under umask 022).

    safetensors writes through a private temporary file (0600) renamed into place.
    """
    from safetensors.torch import save_file

    save_file(weights, str(path), metadata=metadata)
    os.chmod(path, 0o666 & ~umask())


def umask() -> int:
    """The process's umask: read from /proc where Linux shows it, else set and put back."""
    try:
        status = Path("/proc/self/status").read_text()
        return int(
            next(line.split()[1] for line in status.splitlines() if line.startswith("Umask:")), 8
        )
    except (OSError, StopIteration, IndexError, ValueError):
        mask = os.umask(0o022)
        os.umask(mask)
        return mask
