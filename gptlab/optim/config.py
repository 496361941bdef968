"""The optimizer's config section, free of torch: the schema (gptlab/config.py) is built from it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple


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
