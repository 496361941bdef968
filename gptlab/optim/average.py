"""The exponential moving average of the weights, kept in the optimizer's state."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Dict, Iterator, Optional

import torch
import torch.nn as nn

# The exponential moving average of the weights is per-parameter optimizer state under this key, so
# it is saved, resharded and restored with the moments (a sharded run keeps the average of its own
# shard), and a resumed run goes on averaging exactly where it stopped.
AVERAGE = "ema"
# per parameter, beside its average: how many updates it has had (the first included)
UPDATES = "ema_updates"


class WeightAverage:
    """Keeps an exponential moving average of an optimizer's parameters, through its hooks.

    After each step, average = d * average + (1 - d) * weights, the first step starting the average
    at the weights it produced. d = min(decay, (1 + n) / (10 + n)) after n updates: a short run (or
    the start of a long one) averages over its last few steps instead of lagging behind at its
    initial weights (0.775 after 30 updates, 0.991 after 1,000, decay itself from about 4,500 at
    0.998).

    n is saved as per-parameter state (UPDATES) with the average, and counted here in Python too, so
    a step reads no device value; loading a state has the next step read the loaded count, once."""

    def __init__(self, decay: float) -> None:
        self.decay = decay
        self.updates: Optional[int] = None  # None: read the saved count at the next update

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.register_step_post_hook(lambda opt, args, kwargs: self.update(opt))
        optimizer.register_load_state_dict_post_hook(lambda opt: self.forget_count())

    def forget_count(self) -> None:
        self.updates = None

    @torch.no_grad()
    def update(self, optimizer: torch.optim.Optimizer) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        states = [optimizer.state[p] for p in params]
        if self.updates is None:  # first step of this process, or just loaded: read it once
            counted = next((s[UPDATES] for s in states if UPDATES in s), None)
            self.updates = int(counted.item()) if counted is not None else 0
        d = min(self.decay, (1 + self.updates) / (10 + self.updates))
        started, weights, counts = [], [], []
        for p, state in zip(params, states):
            if AVERAGE in state and UPDATES in state:
                started.append(state[AVERAGE])
                weights.append(p.detach())
                counts.append(state[UPDATES])
            else:  # a new average (or one without its count): it starts at these weights, update 1
                state[AVERAGE] = p.detach().clone()
                # shape (1,), not 0-d: torch's state-dict helpers reshard it like the average
                state[UPDATES] = torch.ones(1, dtype=torch.float32, device=p.device)
        if started:
            torch._foreach_lerp_(started, weights, 1.0 - d)
            torch._foreach_add_(counts, 1.0)
        self.updates += 1


def drop_average(optimizer: torch.optim.Optimizer) -> None:
    """Forget every parameter's average (an optimizer without ema_decay that loaded one)."""
    for state in optimizer.state.values():
        state.pop(AVERAGE, None)
        state.pop(UPDATES, None)


@contextmanager
def averaged_weights(optimizer: torch.optim.Optimizer) -> Iterator[bool]:
    """Inside, every parameter that has an average holds it (evaluation, sampling).

    The training weights are back afterwards, bit for bit. Without an average (ema_decay=0) it
    changes nothing. Yields whether it swapped any weights in.
    """
    pairs = [(p.detach(), s[AVERAGE]) for p, s in optimizer.state.items() if AVERAGE in s]
    saved = [p.clone() for p, _ in pairs]
    with torch.no_grad():
        for p, avg in pairs:
            p.copy_(avg)
    try:
        yield bool(pairs)
    finally:
        with torch.no_grad():
            for (p, _), kept in zip(pairs, saved):
                p.copy_(kept)


def load_average(model: nn.Module, optimizer_state: Optional[Dict[str, Any]]) -> bool:
    """Copy a saved optimizer state's weight average into model's parameters; True if there was one.

    The average is keyed by parameter name, as checkpoints hold it. Tied parameters take it under
    any of their names.
    """
    saved = (optimizer_state or {}).get("state", {})
    found = False
    with torch.no_grad():
        for name, p in model.named_parameters(remove_duplicate=False):
            avg = saved.get(name, {}).get(AVERAGE)
            if avg is not None:
                p.copy_(avg)
                found = True
    return found
