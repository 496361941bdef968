"""python -m gptlab.sample run=PATH [prompt=...]: generate text from a run folder's checkpoint.

PATH is a run folder (its newest checkpoint, or the best by validation loss with which=best), a
checkpoint file, or an MLflow model URI (models:/NAME/3, models:/NAME@champion, runs:/<id>/model,
from ``tracking_uri``'s store). The model and tokenizer are rebuilt from the checkpoint alone
(``gptlab.model.inference.load_model``): the root config, conf/sample.yaml, holds only the settings
below (``SampleConfig``), as top-level keys. Text keys take their value as typed:
``prompt="ROMEO:"`` is the text ``ROMEO:``.

``attention.out=FILE.png`` also draws the prompt's attention weights, every layer and head (or
``attention.layers`` / ``attention.heads``), as a grid of heatmaps (``gptlab.model.attention``); the
text is still generated unless ``max_new_tokens=0``.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, List, Optional, Tuple

from hydra.core.config_store import ConfigStore

from gptlab.cli import command, require, text_keys
from gptlab.config import to_config

if TYPE_CHECKING:  # hints only: torch stays off the start-up path of --help and config errors
    from gptlab.data import Tokenizer
    from gptlab.model.gpt import GPT


@dataclass
class AttentionConfig:
    """The `attention` section: a PNG of the prompt's attention weights."""

    out: Optional[str]  # the PNG; null: no attention maps
    layers: Optional[List[int]]  # null: every layer
    heads: Optional[List[int]]  # null: every head


@dataclass
class SampleConfig:
    """The schema of conf/sample.yaml (the values are there)."""

    run: str  # run folder or checkpoint file (mandatory: ???)
    prompt: str
    max_new_tokens: int
    temperature: float  # 0: greedy
    top_k: Optional[int]  # null: the whole vocabulary
    num_samples: int
    seed: int
    which: str  # latest | best (by validation loss), for a run folder
    device: str
    tracking_uri: Optional[str]  # run=models:/...: the MLflow store (null: $MLFLOW_TRACKING_URI)
    attention: AttentionConfig


ConfigStore.instance().store(name="gptlab_sample_schema", node=SampleConfig)
# prompt=ROMEO: / prompt=true / prompt=a,b are text as typed (cli.hydra_words)
TEXT_KEYS = {**text_keys(SampleConfig), **text_keys(AttentionConfig, "attention.")}


def draw_attention(
    cfg: SampleConfig, model: GPT, tok: Tokenizer, prompt: List[int], step: int
) -> None:
    """Write attention.out: the prompt's attention maps, each token labelled with its own text."""
    from gptlab.model.attention import write_attention  # torch: off the start-up path of --help

    settings = cfg.attention
    out = Path(settings.out)
    tokens = [tok.decode([i]) for i in prompt]
    title = f"attention weights of {cfg.run} (step {step}) over the prompt's {len(prompt)} tokens"
    layers, heads = write_attention(
        model, prompt, tokens, out, settings.layers, settings.heads, title
    )
    print(f"attention maps ({layers} layers x {heads} heads): {out}", flush=True)


def load_for_sample(cfg: SampleConfig, tmp: Path) -> Tuple[Any, Any, int]:
    """(model, tokenizer, step) from a run folder, a checkpoint file, or an MLflow model URI.

    MLflow model URIs: models:/NAME/3, models:/NAME@champion, runs:/<id>/model: downloaded into tmp.
    """
    from gptlab.registry import serving

    if not serving.is_model_uri(cfg.run):
        # torch: off the start-up path of --help and config errors
        from gptlab.model.inference import load_model

        model, tok, saved = load_model(cfg.run, cfg.which, cfg.device)
        return model, tok, saved.step
    from gptlab.records.store import default_uri

    uri = cfg.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or default_uri()
    model, tok, meta = serving.load_export(serving.download(uri, cfg.run, tmp))
    return model.to(cfg.device), tok, int(meta.get("step") or 0)


def run_sample(config: Any) -> None:
    """Print the generated text, and write the attention maps when attention.out is set.

    config: composed from conf/sample.yaml.
    """
    require(config, "run", "run=PATH, a run folder or a checkpoint file")
    cfg = to_config(config, SampleConfig)
    with tempfile.TemporaryDirectory() as tmp:
        model, tok, step = load_for_sample(cfg, Path(tmp))
    prompt = tok.encode(cfg.prompt) or [0]
    if cfg.attention.out is not None:
        draw_attention(cfg, model, tok, prompt, step)
        if cfg.max_new_tokens == 0:
            return
    from gptlab.model.inference import generate_text  # torch: off the start-up path of --help

    texts = generate_text(
        model,
        tok,
        cfg.prompt,
        cfg.max_new_tokens,
        cfg.temperature,
        cfg.top_k,
        cfg.seed,
        cfg.num_samples,
    )
    for i, text in enumerate(texts):
        if cfg.num_samples > 1:
            print(f"--- sample {i + 1} (step {step}) ---")
        print(text)


def main(argv: Optional[List[str]] = None) -> None:
    """python -m gptlab.sample run=PATH [key=value ...]: a Hydra app on conf/sample.yaml.

    It writes nothing but attention.out's PNG, when that is set. argv: the same key=value
    arguments, to run it in this process (errors raise GptlabError).
    """
    command("sample", run_sample, argv)


if __name__ == "__main__":
    main()
