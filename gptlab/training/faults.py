"""Test-only fault injection (train.faults): bad losses at chosen steps, a rank that dies.

A bad loss is non-finite or spiking.

The tests of restarts and divergence rollback use these to make the failures they recover from;
a user never sets train.faults (docs/testing.md).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

import torch

SPIKE = 100.0  # what faults.spike_at multiplies a loss by


def poison(loss: torch.Tensor, step: int, faults: Any, fired: Sequence[int] = ()) -> torch.Tensor:
    """loss, made NaN or SPIKE times larger when `step` is one the faults name.

    NaN when `step` (1-based, the step being trained) is in faults.nonfinite_loss_at, or SPIKE times
    larger when it is in faults.spike_at. A step in `fired` (already rolled back) is left alone: a
    fault happens once, as a bad batch would, and the retrained step is clean.
    """
    if faults is None or step in fired:
        return loss
    if step in list(faults.nonfinite_loss_at or ()):
        return loss * torch.tensor(float("nan"), device=loss.device)
    if step in list(getattr(faults, "spike_at", None) or ()):
        return loss * SPIKE
    return loss


def maybe_crash(step: int, rank: int, run_dir: Path, faults: Any) -> None:
    """Exit abruptly when this rank reaches faults.crash_at_step, like a segfault or a lost node.

    There is no cleanup; with crash_once, only the first time in this run folder.
    """
    if faults is None or faults.crash_at_step is None:
        return
    if step != faults.crash_at_step or rank != faults.crash_rank:
        return
    marker = Path(run_dir) / f".fault_crashed_{step}"
    if faults.crash_once:
        if marker.exists():
            return
        marker.touch()
    os._exit(17)
