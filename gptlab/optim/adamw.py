"""AdamW with decoupled weight decay on the matrices and embeddings only."""

from __future__ import annotations

from typing import List

import torch
import torch.nn as nn

from gptlab.optim import decay_groups
from gptlab.optim.config import OptimizerConfig


def build(
    model: nn.Module,
    decay: List[nn.Parameter],
    no_decay: List[nn.Parameter],
    cfg: OptimizerConfig,
    lr: float,
    fused: bool,
) -> torch.optim.Optimizer:
    """torch's AdamW (fused: its one-kernel step)."""
    groups = decay_groups(decay, no_decay, cfg.weight_decay, model)
    return torch.optim.AdamW(groups, lr=lr, betas=tuple(cfg.betas), eps=cfg.eps, fused=fused)
