"""A trained model for inference: the model and its tokenizer, rebuilt from a checkpoint alone.

The library side of ``gptlab.sample`` and ``gptlab.export``: neither needs the run's config, only
the checkpoint's saved model config, weights (their average where the run kept one) and tokenizer.
"""

from __future__ import annotations

from typing import Tuple

from gptlab import checkpoint
from gptlab.data import Tokenizer, load_tokenizer
from gptlab.model import GPT, GPTConfig
from gptlab.optim import AVERAGE, load_average


def load_model(
    run: str, which: str = "latest", device: str = "cpu"
) -> Tuple[GPT, Tokenizer, checkpoint.TrainingState]:
    """The trained model (eval mode) and its tokenizer, rebuilt from a checkpoint's saved model (its
    weight average where the run kept one)."""
    saved = checkpoint.read_model(checkpoint.find(run, which), optimizer_entries=(AVERAGE,))
    model = GPT(GPTConfig(**saved.model_config))
    model.load_state_dict(saved.model)
    load_average(model, saved.optimizer)  # the weights the run evaluated (optimizer.ema_decay > 0)
    return model.to(device).eval(), load_tokenizer(saved.tokenizer), saved
