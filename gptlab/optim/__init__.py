"""Optimizers: the table of kinds, read by the config's checks, the planner and its report.

The table imports no torch (the config reads it before a command's first heavy import); each kind's
module builds the optimizer (gptlab.optim.factory.build_optimizer). A new optimizer is one module
with a `build` function, one row here and one file in conf/optimizer/.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List


@dataclass(frozen=True)
class OptimizerKind:
    """One optimizer: the module that builds it and what its state costs."""

    # gptlab.optim.<module>.build(model, decay, no_decay, cfg, lr, fused) returns the optimizer
    module: str
    label: str  # its state in the plan's report
    # fp32 numbers of state for (parameters, those in the matrices that Muon orthogonalises)
    state_floats: Callable[[int, int], float]
    # orthogonalises matrices by Newton-Schulz: the planner counts the iteration's memory
    newton_schulz: bool = False


OPTIMIZERS: Dict[str, OptimizerKind] = {
    "adamw": OptimizerKind("adamw", "AdamW", lambda params, matrices: 2.0 * params),
    # one momentum per orthogonalised matrix, AdamW's two moments for the rest
    "muon": OptimizerKind(
        "muon", "Muon/AdamW", lambda params, matrices: 2.0 * params - matrices, newton_schulz=True
    ),
    "lion": OptimizerKind("lion", "Lion", lambda params, matrices: 1.0 * params),
}


def decay_groups(decay: List[Any], no_decay: List[Any], weight_decay: float) -> List[Dict]:
    """The two parameter groups of a kind that treats every parameter alike: weight decay on the
    matrices and embeddings, none on biases and gains."""
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
