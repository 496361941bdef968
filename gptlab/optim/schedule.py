"""The learning rate: the data-parallel scaling rule and the warmup-then-decay schedule."""

from __future__ import annotations

import math

from gptlab.optim.config import OptimizerConfig


def scaled_lr(cfg: OptimizerConfig, world_size: int) -> float:
    """The peak lr after the data-parallel scaling rule (sqrt as in the 1B reference run)."""
    factor = {"none": 1.0, "sqrt": math.sqrt(world_size), "linear": float(world_size)}[
        cfg.lr_scaling
    ]
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
