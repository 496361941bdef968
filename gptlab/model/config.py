"""The model's config section, free of torch.

The schema (gptlab/config.py) is built from it, so --help and config errors answer without importing
torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class GPTConfig:
    """Shape and flavour of the model; ``vocab_size`` is filled in from the tokenizer when null."""

    name: str
    vocab_size: Optional[int]
    vocab_multiple: int  # pad the embedding/LM head to a multiple of this (64 for tensor cores)
    block_size: int
    n_layer: int
    n_head: int
    n_embd: int
    ffn_dim: Optional[int]  # null: 4 * n_embd (GELU) or the usual 8/3 * n_embd rounded (SwiGLU)
    dropout: float
    bias: bool
    pos_emb: str  # learned | sinusoidal | rotary
    mlp: str  # gelu | gelu_tanh (GPT-2's own approximation) | swiglu
    tie_weights: bool
    rope_base: float
    # start from these weights (docs/finetuning.md): gpt2 | gpt2-medium | gpt2-large | gpt2-xl, a
    # Hugging Face GPT-2 folder, a gptlab export, run folder or checkpoint, or an MLflow model URI.
    # The one field with a default (its value still lives in conf/model/gpt2_124m.yaml): the model
    # configs that checkpoints and exports written before it saved still build a GPTConfig.
    init_from: Optional[str] = None
    # standard | mup (docs/mup.md): muP's initialisation, attention scale, output multiplier and
    # per-layer learning rates, relative to mup_base_width (where muP equals standard). Defaults for
    # the same reason as init_from: checkpoints written before them saved neither (both standard).
    parametrization: str = "standard"
    mup_base_width: int = 768

    @property
    def width_mult(self) -> float:
        """muP's width multiplier m = n_embd / mup_base_width; 1.0 under the standard form."""
        if self.parametrization != "mup":
            return 1.0
        return self.n_embd / self.mup_base_width

    @property
    def padded_vocab_size(self) -> int:
        assert self.vocab_size is not None, "vocab_size must be set before building the model"
        return padded_vocab(self.vocab_size, self.vocab_multiple)

    @property
    def hidden_dim(self) -> int:
        if self.ffn_dim is not None:
            return self.ffn_dim
        if self.mlp == "swiglu":
            # 2/3 of 4d keeps the parameter count of a GELU MLP; rounded up to a multiple of 64
            return (int(8 * self.n_embd / 3) + 63) // 64 * 64
        return 4 * self.n_embd


def padded_vocab(vocab: int, multiple: int) -> int:
    """The embedding's rows: the vocabulary rounded up to a multiple.

    A multiple of 64 keeps tensor-core matmuls fast.
    """
    k = max(1, multiple)
    return (vocab + k - 1) // k * k
