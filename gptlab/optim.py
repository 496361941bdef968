"""Optimizer: parameter groups, AdamW, and the learning-rate schedule lr_at(step)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn as nn


@dataclass
class OptimizerConfig:
    name: str
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


def scaled_lr(cfg: OptimizerConfig, world_size: int) -> float:
    """The peak lr after the data-parallel scaling rule (sqrt as in the 1B reference run)."""
    factor = {"none": 1.0, "sqrt": math.sqrt(world_size), "linear": float(world_size)}[cfg.lr_scaling]
    return cfg.lr * factor


def lr_at(step: int, peak: float, cfg: OptimizerConfig, total_steps: int) -> float:
    """Linear warmup over warmup_steps, then decay to min_lr_ratio * peak at decay_steps."""
    if cfg.warmup_steps > 0 and step < cfg.warmup_steps:
        return peak * (step + 1) / cfg.warmup_steps
    floor = peak * cfg.min_lr_ratio
    decay = cfg.decay_steps or total_steps
    if cfg.schedule == "constant" or decay <= cfg.warmup_steps:
        return peak
    progress = min(1.0, (step - cfg.warmup_steps) / (decay - cfg.warmup_steps))
    if cfg.schedule == "linear":
        return peak - (peak - floor) * progress
    return floor + 0.5 * (peak - floor) * (1.0 + math.cos(math.pi * progress))


FUSED_ADAMW_DEVICES = ("cuda", "cpu")  # where torch has a fused AdamW kernel


def build_optimizer(model: nn.Module, cfg: OptimizerConfig, lr: float, device_type: str) -> torch.optim.AdamW:
    """AdamW with weight decay on >=2-D tensors (matrices, embeddings) only."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    # One fused kernel per step on CUDA and the CPU. On this machine's CPU it is 4x faster than the
    # default for-each implementation (gpt_char's parameters: 1.8 vs 7.4 ms a step at one thread;
    # 6 x 384 x 256: 23 vs 89 ms), the same update to rounding (1.5e-6 apart after 20 steps).
    fused = cfg.fused if cfg.fused is not None else device_type in FUSED_ADAMW_DEVICES
    return torch.optim.AdamW(groups, lr=lr, betas=tuple(cfg.betas), eps=cfg.eps, fused=fused)
