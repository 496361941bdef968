"""Scaling-law fits of (FLOPs, parameters, tokens, loss) points.

The fits are isoFLOP parabolas and the parametric loss, with bootstrap intervals and a held-out
check.

Approach 2 of Hoffmann et al. (2022): per compute budget C, a parabola of the loss in ln N whose
minimum is that budget's N_opt (D_opt = C / 6 N_opt); then power laws N_opt = k C^a, D_opt = k' C^b
and L_opt = k'' C^l by least squares in log space. Approach 3: L(N, D) = E + A / N^alpha +
B / D^beta. The loss is linear in (E, A, B) once alpha and beta are fixed, so alpha and beta are
searched on a grid, refined twice, each grid point solved in closed form; a fit with A or B not
positive is refused. Intervals come from resampling every budget's points with replacement.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from gptlab.errors import GptlabError

COLUMNS = ("flops", "params", "tokens", "loss")
MIN_PER_BUDGET = 3  # a parabola needs three sizes
BUDGET_SPREAD = 1.1  # FLOPs this close are one budget
# alpha and beta's search: a coarse grid, then two finer ones around the best point
EXPONENT_RANGE = (0.02, 1.5)
GRID = 60


@dataclass(frozen=True)
class Point:
    flops: float
    params: float
    tokens: float
    loss: float


def read_csv(path: Path) -> List[Point]:
    """The rows of a CSV with the columns flops, params, tokens and loss (any others ignored)."""
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise GptlabError(
                f"{path}: no column {', '.join(missing)} (a scaling CSV has the columns "
                f"{', '.join(COLUMNS)})"
            )
        points = []
        for line, row in enumerate(reader, start=2):
            try:
                values = [float(row[c]) for c in COLUMNS]
            except (TypeError, ValueError):
                raise GptlabError(f"{path}:{line}: not a number in {dict(row)}") from None
            if min(values[:3]) <= 0 or not all(math.isfinite(v) for v in values):
                raise GptlabError(f"{path}:{line}: flops, params and tokens must be positive")
            points.append(Point(*values))
    return points


def budgets(points: Sequence[Point]) -> Dict[float, List[Point]]:
    """The points by compute budget, smallest first, keyed by each group's median.

    FLOPs within BUDGET_SPREAD of the smallest of a group are one budget (runs rounded to whole
    steps spend a little more or less).
    """
    groups: List[List[Point]] = []
    for p in sorted(points, key=lambda p: p.flops):
        if groups and p.flops <= groups[-1][0].flops * BUDGET_SPREAD:
            groups[-1].append(p)
        else:
            groups.append([p])
    return {float(np.median([p.flops for p in g])): g for g in groups}


def isoflop_minimum(budget: float, points: Sequence[Point]) -> Tuple[float, float]:
    """(N_opt, L_opt) of one budget: the vertex of the parabola of loss in ln N."""
    sizes = {p.params for p in points}
    if len(sizes) < MIN_PER_BUDGET:
        raise GptlabError(
            f"budget {budget:.3g} FLOPs: {len(sizes)} model sizes; a fit needs at least "
            f"{MIN_PER_BUDGET} per budget"
        )
    x = np.log([p.params for p in points])
    c2, c1, c0 = np.polyfit(x, [p.loss for p in points], 2)
    if c2 <= 0:
        raise GptlabError(
            f"budget {budget:.3g} FLOPs: the loss does not curve up around a minimum in ln N "
            "(add sizes on both sides of the best one)"
        )
    vertex = -c1 / (2 * c2)
    return math.exp(vertex), float(c0 + c1 * vertex + c2 * vertex**2)


def power_law(xs: Sequence[float], ys: Sequence[float]) -> Tuple[float, float]:
    """(exponent, coefficient) of y = coefficient * x^exponent, least squares in log space."""
    slope, intercept = np.polyfit(np.log(xs), np.log(ys), 1)
    return float(slope), float(math.exp(intercept))


def approach2(points: Sequence[Point]) -> Dict[str, float]:
    """The isoFLOP fit: each budget's minimum, then N_opt = kN C^a, D_opt = kD C^b."""
    groups = budgets(points)
    if len(groups) < 2:
        raise GptlabError(f"{len(groups)} compute budget(s): a scaling fit needs at least 2")
    minima = [(c, *isoflop_minimum(c, group)) for c, group in groups.items()]
    cs = [m[0] for m in minima]
    n_opt = [m[1] for m in minima]
    a, k_n = power_law(cs, n_opt)
    b, k_d = power_law(cs, [c / (6 * n) for c, n in zip(cs, n_opt)])
    slope, k_l = power_law(cs, [m[2] for m in minima])  # L_opt = kL C^l
    return {"a": a, "k_n": k_n, "b": b, "k_d": k_d, "l": slope, "k_l": k_l, "minima": minima}


def _solve_linear(points: Sequence[Point], alphas: np.ndarray, betas: np.ndarray):
    """For every (alpha, beta) pair: (E, A, B) by least squares and the sum of squared errors."""
    n = np.array([p.params for p in points])
    d = np.array([p.tokens for p in points])
    y = np.array([p.loss for p in points])
    # design matrices [1, N^-alpha, D^-beta], one per grid point: (G, rows, 3)
    cols_n = n[None, :] ** -alphas[:, None]
    cols_d = d[None, :] ** -betas[:, None]
    x = np.stack([np.ones_like(cols_n), cols_n, cols_d], axis=2)
    xt = np.transpose(x, (0, 2, 1))
    gram = xt @ x + 1e-12 * np.eye(3)
    coef = np.linalg.solve(gram, xt @ y[None, :, None])[..., 0]
    sse = ((x @ coef[..., None])[..., 0] - y[None, :]) ** 2
    sse = sse.sum(axis=1)
    sse[(coef[:, 1] <= 0) | (coef[:, 2] <= 0)] = np.inf  # a law whose terms do not fall
    return coef, sse


def approach3(points: Sequence[Point]) -> Dict[str, float]:
    """L(N, D) = E + A / N^alpha + B / D^beta by a grid search of alpha, beta refined twice."""
    lo, hi = EXPONENT_RANGE
    center, half = ((lo + hi) / 2, (lo + hi) / 2), (hi - lo) / 2
    for _ in range(3):
        a_axis = np.linspace(max(lo, center[0] - half), center[0] + half, GRID)
        b_axis = np.linspace(max(lo, center[1] - half), center[1] + half, GRID)
        alphas, betas = (g.ravel() for g in np.meshgrid(a_axis, b_axis, indexing="ij"))
        coef, sse = _solve_linear(points, alphas, betas)
        best = int(np.argmin(sse))
        if not math.isfinite(sse[best]):
            raise GptlabError("no law L = E + A/N^alpha + B/D^beta with A, B > 0 fits these points")
        center, half = (alphas[best], betas[best]), 2 * half / GRID
    e, a, b = (float(v) for v in coef[best])
    return {"E": e, "A": a, "B": b, "alpha": float(alphas[best]), "beta": float(betas[best])}


def optimum(law: Dict[str, float], flops: float) -> Tuple[float, float, float]:
    """(N_opt, D_opt, L_opt) at a budget from the parametric law (C = 6 N D)."""
    alpha, beta, a, b = law["alpha"], law["beta"], law["A"], law["B"]
    g = (alpha * a / (beta * b)) ** (1 / (alpha + beta))
    n = g * (flops / 6) ** (beta / (alpha + beta))
    d = flops / (6 * n)
    return n, d, law["E"] + a / n**alpha + b / d**beta


def bootstrap(points: Sequence[Point], rounds: int, seed: int) -> Dict[str, Tuple[float, float]]:
    """The 95% interval of every fitted figure over `rounds` resamplings within each budget."""
    rng = np.random.default_rng(seed)
    groups = list(budgets(points).values())
    draws: Dict[str, List[float]] = {}
    for _ in range(rounds):
        sample = [g[i] for g in groups for i in rng.integers(0, len(g), len(g))]
        try:
            two, three = approach2(sample), approach3(sample)
        except GptlabError:  # a resample with too few distinct sizes in a budget
            continue
        for key in ("a", "b"):
            draws.setdefault(key, []).append(two[key])
        for key in ("E", "A", "B", "alpha", "beta"):
            draws.setdefault(key, []).append(three[key])
    return {
        k: (float(np.percentile(v, 2.5)), float(np.percentile(v, 97.5))) for k, v in draws.items()
    }


def held_out(points: Sequence[Point]) -> Optional[Dict[str, float]]:
    """The fit without the largest budget, judged on it; None with fewer than three budgets.

    Judged: the relative error of its N_opt and L_opt against that budget's own parabola.
    """
    groups = budgets(points)
    if len(groups) < 3:
        return None
    largest = max(groups)
    rest = [p for c, g in groups.items() if c != largest for p in g]
    two = approach2(rest)
    n_pred = two["k_n"] * largest ** two["a"]
    law = approach3(rest)
    loss_pred = (
        law["E"]
        + law["A"] / n_pred ** law["alpha"]
        + law["B"] / (largest / (6 * n_pred)) ** law["beta"]
    )
    n_meas, loss_meas = isoflop_minimum(largest, groups[largest])
    return {
        "flops": largest,
        "n_opt_predicted": n_pred,
        "n_opt_measured": n_meas,
        "n_opt_error": n_pred / n_meas - 1,
        "loss_predicted": loss_pred,
        "loss_measured": loss_meas,
        "loss_error": loss_pred / loss_meas - 1,
    }
