"""python -m gptlab.sample run=PATH [prompt=...]: generate text from a run folder's checkpoint.

PATH is a run folder (its newest checkpoint, or the best by validation loss with which=best) or a
checkpoint file. The model and tokenizer are rebuilt from the checkpoint alone: no config tree.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from gptlab import checkpoint
from gptlab.cli import condense, fail
from gptlab.data import Tokenizer, load_tokenizer
from gptlab.errors import GptlabError
from gptlab.model import GPT, GPTConfig


@dataclass
class SampleConfig:
    run: str = "???"  # run folder or checkpoint file
    prompt: str = "\n"
    max_new_tokens: int = 500
    temperature: float = 0.8  # 0: greedy
    top_k: Optional[int] = 200
    num_samples: int = 1
    seed: int = 0
    which: str = "latest"  # latest | best (by validation loss), for a run folder
    device: str = "cpu"


def parse_args(argv: List[str], schema) -> object:
    """key=value arguments onto a dataclass schema; unknown keys and bad types are one-line errors."""
    bad = [a for a in argv if "=" not in a]
    if bad:
        raise GptlabError(f"arguments are key=value pairs, got {bad[0]!r}")
    text_fields = {f.name for f in dataclasses.fields(schema) if f.type in (str, "str")}
    raw = {}
    for arg in argv:
        key, value = arg.split("=", 1)
        # text such as prompt="ROMEO:" stays text instead of being read as YAML
        raw[key] = value if key in text_fields else OmegaConf.from_dotlist([arg])[key]
    try:
        cfg = OmegaConf.merge(OmegaConf.structured(schema), raw)
        return OmegaConf.to_object(cfg)
    except OmegaConfBaseException as e:
        raise GptlabError(condense(str(e))) from None


def load_model(run: str, which: str = "latest", device: str = "cpu") -> Tuple[GPT, Tokenizer, checkpoint.SavedModel]:
    """The trained model (eval mode) and its tokenizer, rebuilt from a checkpoint's saved model."""
    saved = checkpoint.read_model(checkpoint.find(run, which))
    model = GPT(GPTConfig(**saved.model_config))
    model.load_state_dict(saved.weights)
    return model.to(device).eval(), load_tokenizer(saved.tokenizer), saved


def main(argv: List[str]) -> None:
    cfg = parse_args(argv, SampleConfig)
    model, tok, saved = load_model(cfg.run, cfg.which, cfg.device)
    prompt = tok.encode(cfg.prompt) or [0]
    idx = torch.tensor([prompt] * cfg.num_samples, dtype=torch.long, device=cfg.device)
    gen = torch.Generator(device=cfg.device).manual_seed(cfg.seed)
    out = model.generate(idx, cfg.max_new_tokens, temperature=cfg.temperature, top_k=cfg.top_k, generator=gen)
    for i, row in enumerate(out.tolist()):
        if cfg.num_samples > 1:
            print(f"--- sample {i + 1} (step {saved.step}) ---")
        print(tok.decode(row))


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except GptlabError as e:
        fail("gptlab.sample", e)
