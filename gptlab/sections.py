"""The config sections of the modules that import torch: ``GPTConfig`` (model.py),
``OptimizerConfig`` (optim.py) and ``ProfileConfig`` with its check (profiling.py). Types only,
values in conf/.

They live here, free of torch, because the schema (config.py) is built from them: every command's
``--help``, ``--cfg job`` and config errors answer without importing torch. Their modules re-export
them (``from gptlab.model import GPTConfig`` still works).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

from gptlab.errors import GptlabError


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
    mlp: str  # gelu | swiglu
    tie_weights: bool
    rope_base: float

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
    """The embedding's rows: the vocabulary rounded up to a multiple (64 keeps tensor-core matmuls
    fast)."""
    k = max(1, multiple)
    return (vocab + k - 1) // k * k


@dataclass
class OptimizerConfig:
    name: str  # adamw | muon (Muon on the blocks' matrices, AdamW on the rest)
    lr: float  # peak learning rate (before lr_scaling)
    min_lr_ratio: float  # the cosine floor, as a fraction of the peak
    betas: Tuple[float, float]
    eps: float
    weight_decay: float  # on matrices only (not biases, LayerNorm gains)
    grad_clip: float  # max global grad norm; 0 disables clipping
    warmup_steps: int
    schedule: str  # cosine | linear | constant (after warmup)
    decay_steps: Optional[int]  # null: decay over train.max_steps
    lr_scaling: str  # none | sqrt | linear: scale lr with the number of data-parallel ranks
    fused: Optional[bool]  # null: fused kernels where the device supports them
    muon_momentum: float  # name=muon: Nesterov momentum of the orthogonalised matrix updates
    muon_ns_steps: int  # name=muon: Newton-Schulz iterations per update
    # name=muon: auto (bf16 where bf16 matmuls are native, else fp32) | bf16 | fp32
    muon_ns_dtype: str
    # > 0: evaluate, sample and export an exponential moving average of the weights
    ema_decay: float


@dataclass
class ProfileConfig:
    steps: Optional[List[int]]  # [first, last] step recorded (1-based, inclusive); null: off
    rows: int  # operators in the table
    oom_snapshot: bool  # CUDA: record the allocator's history so an out-of-memory step leaves one


def check_profile(cfg: ProfileConfig, max_steps: int) -> None:
    """train.profile's settings: one line naming what is wrong."""
    if cfg.steps is None:
        return
    steps = list(cfg.steps)
    if len(steps) != 2 or not all(isinstance(s, int) and not isinstance(s, bool) for s in steps):
        raise GptlabError(
            f"train.profile.steps={steps}: give the first and last step to record, e.g. [5,7]"
        )
    first, last = steps
    if not 1 <= first <= last:
        raise GptlabError(f"train.profile.steps=[{first},{last}]: need 1 <= first <= last")
    if first > max_steps:
        raise GptlabError(
            f"train.profile.steps=[{first},{last}]: the run ends at step {max_steps} first"
        )
    if cfg.rows < 1:
        raise GptlabError(f"train.profile.rows={cfg.rows}: must be at least 1")
