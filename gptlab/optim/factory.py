"""build_optimizer: the parameter groups, the kind from the table, and the weight average."""

from __future__ import annotations

import importlib

import torch
import torch.nn as nn

from gptlab.optim import OPTIMIZERS
from gptlab.optim.average import WeightAverage, drop_average
from gptlab.optim.config import OptimizerConfig

FUSED_ADAMW_DEVICES = ("cuda", "cpu")  # where torch has a fused AdamW kernel


def build_optimizer(
    model: nn.Module, cfg: OptimizerConfig, lr: float, device_type: str
) -> torch.optim.Optimizer:
    """optimizer.name's kind over the trainable parameters.

    Weight decay on >=2-D tensors (matrices, embeddings) only; with ema_decay > 0, the weight
    average in its state.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    # One fused kernel per step on CUDA and the CPU: faster than the for-each default, the same
    # update to rounding (docs/measurements/2026-11-30-cpu-speed.md has the figures).
    fused = cfg.fused if cfg.fused is not None else device_type in FUSED_ADAMW_DEVICES
    kind = importlib.import_module(f"gptlab.optim.{OPTIMIZERS[cfg.name].module}")
    optimizer = kind.build(model, decay, no_decay, cfg, lr, fused)
    if cfg.ema_decay > 0:
        WeightAverage(cfg.ema_decay).attach(optimizer)
    # resumed from a run that averaged: its average would stand still, and be evaluated and saved
    else:
        optimizer.register_load_state_dict_post_hook(drop_average)
    return optimizer
