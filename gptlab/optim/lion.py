"""Lion: the sign of an interpolation of gradient and momentum, one state buffer per parameter."""

from __future__ import annotations

from typing import List

import torch
import torch.nn as nn

from gptlab.optim import decay_groups
from gptlab.optim.config import OptimizerConfig


class Lion(torch.optim.Optimizer):
    """Lion (Chen et al., 2023): each coordinate moves by lr, in the sign of its momentum.

    update = sign(b1 * m + (1 - b1) * g), then m = b2 * m + (1 - b2) * g; weight decay decoupled, as
    AdamW's. Its steps are larger than AdamW's: it wants a smaller lr and a larger weight decay.
    """

    def __init__(self, params, lr: float, betas=(0.9, 0.99), weight_decay: float = 0.0):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            for p in params:
                if not self.state[p]:
                    self.state[p]["exp_avg"] = torch.zeros_like(p)
            grads = [p.grad for p in params]
            moments = [self.state[p]["exp_avg"] for p in params]
            b1, b2 = group["betas"]
            if group["weight_decay"]:
                torch._foreach_mul_(params, 1.0 - group["lr"] * group["weight_decay"])
            updates = torch._foreach_lerp(moments, grads, 1.0 - b1)
            for u in updates:  # one sign per tensor: a sharded parameter's shard signs alone
                u.sign_()
            torch._foreach_add_(params, updates, alpha=-group["lr"])
            torch._foreach_lerp_(moments, grads, 1.0 - b2)
        return loss


def build(
    model: nn.Module,
    decay: List[nn.Parameter],
    no_decay: List[nn.Parameter],
    cfg: OptimizerConfig,
    lr: float,
    fused: bool,
) -> torch.optim.Optimizer:
    """Lion on every parameter, with weight decay on the matrices and embeddings.

    There is no fused kernel: `fused` is not used.
    """
    groups = decay_groups(decay, no_decay, cfg.weight_decay, model=model)
    return Lion(groups, lr=lr, betas=tuple(cfg.betas))
