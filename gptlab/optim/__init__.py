"""Optimizers: the table of kinds, read by the config's checks, the planner and its report.

The table imports no torch (the config reads it before a command's first heavy import); each kind's
module builds the optimizer (gptlab.optim.factory.build_optimizer). A new optimizer is one module
with a `build` function, one row here and one file in conf/optimizer/.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional


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


def _gpt(model: Any) -> Any:
    """The GPT inside `model` (DDP, FSDP or compile wrappers looked through), or None."""
    return next((m for m in model.modules() if hasattr(getattr(m, "config", None), "n_embd")), None)


def width_mult(model: Any) -> Optional[float]:
    """muP's width multiplier m of the GPT inside `model`; None in the standard form.

    A group that sets "lr_mult" gets lr * lr_mult from the schedule (training/loop.py).
    """
    gpt = _gpt(model)
    if gpt is None or getattr(gpt.config, "parametrization", "standard") != "mup":
        return None
    return gpt.config.width_mult


def hidden_matrices(model: Any) -> List[Any]:
    """The blocks' matrices (attention and MLP weights): muP's hidden layers, whose lr scales."""
    return [p for p in _gpt(model).h.parameters() if p.dim() >= 2 and p.requires_grad]


def decay_groups(
    decay: List[Any], no_decay: List[Any], weight_decay: float, model: Any = None
) -> List[Dict]:
    """The parameter groups of a kind that treats every parameter alike.

    Weight decay on the matrices and embeddings, none on biases and gains. Under muP (docs/mup.md)
    the hidden matrices are a group of their own with lr_mult 1/m; embeddings, the head, biases and
    gains keep the lr.
    """
    m = width_mult(model) if model is not None else None
    if m is None:
        return [
            {"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
    hidden = {id(p) for p in hidden_matrices(model)}
    return [
        {"params": [p for p in decay if id(p) in hidden], "weight_decay": weight_decay,
         "lr_mult": 1.0 / m},
        {"params": [p for p in decay if id(p) not in hidden], "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]  # fmt: skip
