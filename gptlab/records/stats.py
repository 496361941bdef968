"""Seeds as replicates, in pure Python: summary statistics and Welch's t-test of two groups.

scipy is not a dependency. It gives the mean and sample standard deviation, Welch's t-test of two
groups (the t statistic, Welch–Satterthwaite degrees of freedom, the two-sided p-value) and the 95%
interval of their difference. gptlab.compare and a sweep's parent run (records/parent.py) use it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

from gptlab.errors import GptlabError

SEED_KEY = (
    "train.seed"  # runs whose overrides differ only in it are replicates of one configuration
)


def mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs)


def std(xs: Sequence[float]) -> Optional[float]:
    """The sample standard deviation (n - 1); None for fewer than 2 values."""
    if len(xs) < 2:
        return None
    m = mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def _beta_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of the regularized incomplete beta.

    It uses Lentz's method, as in Numerical Recipes' betacf.
    """
    tiny, qab, qap, qam = 1e-300, a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        m2 = 2 * m
        even = m * (b - m) * x / ((qam + m2) * (a + m2))
        odd = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        for aa in (even, odd):
            d = 1.0 + aa * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + aa / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def incomplete_beta(a: float, b: float, x: float) -> float:
    """I_x(a, b), the regularized incomplete beta function, for 0 <= x <= 1."""
    if x <= 0.0 or x >= 1.0:
        return 0.0 if x <= 0.0 else 1.0
    front = math.exp(
        math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    )
    # the fraction converges fast on this side of the mean; the symmetry I_x(a,b)=1-I_1-x(b,a) else
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _beta_fraction(a, b, x) / a
    return 1.0 - front * _beta_fraction(b, a, 1.0 - x) / b


def t_two_sided(t: float, df: float) -> float:
    """P(|T| >= |t|) for Student's t with df degrees of freedom."""
    if math.isinf(t):
        return 0.0
    return incomplete_beta(df / 2.0, 0.5, df / (df + t * t))


def t_quantile(p: float, df: float) -> float:
    """The t with P(T <= t) = p (0.5 < p < 1), by bisection of the two-sided tail."""
    tail = 2.0 * (1.0 - p)
    lo, hi = 0.0, 1.0
    while t_two_sided(hi, df) > tail:
        hi *= 2.0
    for _ in range(200):
        mid = (lo + hi) / 2.0
        lo, hi = (mid, hi) if t_two_sided(mid, df) > tail else (lo, mid)
    return (lo + hi) / 2.0


@dataclass
class Welch:
    """Welch's t-test of a against b: diff = mean(a) - mean(b), and its interval at `level`."""

    t: float
    df: float
    p_value: float
    diff: float
    low: float
    high: float


def welch(a: Sequence[float], b: Sequence[float], level: float = 0.95) -> Welch:
    """Welch's unequal-variance t-test (two-sided) and the `level` interval of mean(a) - mean(b).

    Each side needs at least 2 values.
    """
    if len(a) < 2 or len(b) < 2:
        raise GptlabError(f"the t-test needs at least 2 seeds per side (got {len(a)} and {len(b)})")
    va, vb = std(a) ** 2 / len(a), std(b) ** 2 / len(b)  # type: ignore[operator]
    diff, se2 = mean(a) - mean(b), va + vb
    if se2 == 0.0:  # identical replicates on both sides: no spread to test against
        same = diff == 0.0
        t = 0.0 if same else math.copysign(math.inf, diff)
        return Welch(t, math.inf, 1.0 if same else 0.0, diff, diff, diff)
    df = se2**2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    t = diff / math.sqrt(se2)
    half = t_quantile(0.5 + level / 2.0, df) * math.sqrt(se2)
    return Welch(t, df, t_two_sided(t, df), diff, diff - half, diff + half)
