"""The learning rate's transfer across widths: each width's best lr, and the optimum's drift.

docs/mup.md, "The transfer check". From a grid sweep of width x lr (x seeds): each width's best lr
(the lowest mean over seeds of the objective) and the optimum's drift, the best lr at the widest
width over the best at the narrowest (1: it transfers; 0.25: the wide model wants a quarter of the
narrow one's lr).

Pure Python on (overrides, objective) points, so gptlab.compare (run folders, MLflow runs) and a
sweep's parent run (records/parent.py) compute the same figures; matplotlib only in the figure.
"""

from __future__ import annotations

import math
import re
import textwrap
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from gptlab.errors import or_none
from gptlab.records import stats

WIDTH_KEY = (
    "model.n_embd"  # the width a transfer sweep varies, unless compare.transfer names another
)
LR_KEY = "optimizer.lr"
TRANSFER_PNG = "compare_transfer.png"
# a point: a run's overrides and its objective (best val loss; None: no result)
Point = Tuple[Dict[str, str], Optional[float]]


@dataclass
class Transfer:
    """One group's transfer: its runs share every override but the width, lr and seed."""

    group: Dict[str, str]  # what sets this group apart from the sweep's others ({}: one group)
    width_key: str
    # width -> (lr, mean objective over seeds, seeds), lr ascending
    curves: Dict[float, List[Tuple[float, float, int]]] = field(default_factory=dict)

    @property
    def widths(self) -> List[float]:
        return sorted(self.curves)

    @property
    def best_lr(self) -> Dict[float, float]:
        return {w: min(c, key=lambda p: p[1])[0] for w, c in self.curves.items()}

    @property
    def drift(self) -> Optional[float]:
        """Best lr at the widest width / at the narrowest (None under 2 widths)."""
        widths, best = self.widths, self.best_lr
        return best[widths[-1]] / best[widths[0]] if len(widths) > 1 else None

    @property
    def at_edge(self) -> List[float]:
        """The widths whose best lr is the grid's smallest or largest: the optimum may be beyond."""
        best = self.best_lr
        return [
            w
            for w, c in sorted(self.curves.items())
            if len(c) > 1 and best[w] in (c[0][0], c[-1][0])
        ]

    def label(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.group.items())

    def as_json(self) -> Dict[str, Any]:
        return {
            "group": self.group,
            "width_key": self.width_key,
            "widths": [number(w) for w in self.widths],
            "best_lr": {str(number(w)): lr for w, lr in sorted(self.best_lr.items())},
            "drift": self.drift,
            "at_edge": [number(w) for w in self.at_edge],
            "curves": {
                str(number(w)): [{"lr": lr, "mean": m, "n": n} for lr, m, n in c]
                for w, c in sorted(self.curves.items())
            },
        }


def number(x: float) -> Any:
    """A width as written: 64, not 64.0."""
    return int(x) if float(x).is_integer() else x


def _value(text: Optional[str]) -> Optional[float]:
    value = or_none(float, text) if text is not None else None
    return value if value is not None and math.isfinite(value) and value > 0 else None


def varies(points: Sequence[Point], key: str) -> bool:
    """Whether key takes 2 numeric values or more among the points."""
    return len({_value(o.get(key)) for o, _ in points} - {None}) > 1


def detect(points: Sequence[Point]) -> Optional[str]:
    """The width key of a transfer sweep (model.n_embd and optimizer.lr both vary), else None."""
    return WIDTH_KEY if varies(points, WIDTH_KEY) and varies(points, LR_KEY) else None


def transfers(points: Sequence[Point], width_key: str = WIDTH_KEY) -> List[Transfer]:
    """One Transfer per group of runs that differ in nothing but the width, lr and seed.

    A sweep of model.parametrization=standard,mup has two. Made from the runs with a finite
    objective.
    """
    usable = [
        (o, v)
        for o, v in points
        if v is not None
        and math.isfinite(v)
        and _value(o.get(width_key)) is not None
        and _value(o.get(LR_KEY)) is not None
    ]
    own = {width_key, LR_KEY, stats.SEED_KEY}
    keys = sorted({k for o, _ in usable for k in o if k not in own and "hparams_search." not in k})
    rest = [k for k in keys if len({o.get(k) for o, _ in usable}) > 1]
    grouped: Dict[Tuple[Optional[str], ...], Dict[float, Dict[float, List[float]]]] = {}
    for o, v in usable:
        by_width = grouped.setdefault(tuple(o.get(k) for k in rest), {})
        by_lr = by_width.setdefault(_value(o[width_key]), {})  # type: ignore[arg-type]
        by_lr.setdefault(_value(o[LR_KEY]), []).append(v)  # type: ignore[arg-type]
    out = []
    for values, by_width in grouped.items():
        curves = {
            w: [(lr, stats.mean(vs), len(vs)) for lr, vs in sorted(by_lr.items())]
            for w, by_lr in by_width.items()
        }
        group = {k: v for k, v in zip(rest, values) if v is not None}
        out.append(Transfer(group, width_key, curves))
    return sorted(out, key=Transfer.label)


def table(found: List[Transfer], metric: str) -> str:
    """Each group's best lr per width and its drift, a line each."""
    tail = found[0].width_key.rsplit(".", 1)[-1] if found else "width"
    lines = textwrap.wrap(
        f"lr transfer across {tail}: each width's best {LR_KEY} by best val {metric} (mean over "
        "seeds); drift = best lr at the widest / at the narrowest (1: it transfers)",
        100,
    )
    for t in found:
        lines.append(f"{t.label() or 'all runs'}:")
        for w in t.widths:
            lr = t.best_lr[w]
            _, loss, n = next(p for p in t.curves[w] if p[0] == lr)
            edge = "  (the grid's edge: widen the lr range)" if w in t.at_edge else ""
            lines.append(
                f"  {tail}={number(w)}: best lr {lr:.4g}, {metric} {loss:.4f} "
                f"({n} seed{'s' * (n > 1)}, {len(t.curves[w])} lrs){edge}"
            )
        if t.drift is not None:
            widths = t.widths
            lines.append(
                f"  drift ({tail} {number(widths[-1])} / {number(widths[0])}): {t.drift:.3g}"
            )
    return "\n".join(lines)


def parent_metrics(found: List[Transfer]) -> Dict[str, float]:
    """A sweep parent's figures: transfer/drift and transfer/best_lr/<width>_<w>.

    With several groups, transfer/<group>/...
    """
    out: Dict[str, float] = {}
    for t in found:
        prefix = "transfer/" + (f"{t.label()}/" if len(found) > 1 else "")
        prefix = re.sub(r"[^\w\-. /]", "_", prefix)[:200]
        tail = t.width_key.rsplit(".", 1)[-1]
        out.update({f"{prefix}best_lr/{tail}_{number(w)}": lr for w, lr in t.best_lr.items()})
        if t.drift is not None:
            out[f"{prefix}drift"] = t.drift
    return out


def figure(found: List[Transfer], title: str, metric: str) -> Any:
    """Objective against lr (log x), a curve per width, the best lr marked; a panel per group."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5.2 * len(found), 4.2), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    tail = found[0].width_key.rsplit(".", 1)[-1]
    for i, t in enumerate(found):
        ax = fig.add_subplot(1, len(found), i + 1)
        for j, w in enumerate(t.widths):
            lrs, losses = [p[0] for p in t.curves[w]], [p[1] for p in t.curves[w]]
            best = t.best_lr[w]
            ax.plot(lrs, losses, "o-", ms=3, color=f"C{j}", label=f"{tail}={number(w)}")
            ax.plot([best], [min(losses)], "*", ms=12, color=f"C{j}")
        ax.set_xscale("log")
        lrs = sorted({p[0] for c in t.curves.values() for p in c})
        ax.set_xticks(lrs, [f"{lr:g}" for lr in lrs], fontsize=7)  # the grid's lrs, not 10^k
        ax.minorticks_off()
        ax.set_xlabel(LR_KEY)
        ax.set_ylabel(f"best val {'bits per byte' if metric == 'bpb' else 'loss'}")
        drift = f"drift {t.drift:.3g}" if t.drift is not None else "one width"
        ax.set_title(f"{t.label() or 'all runs'}: {drift}", fontsize=9)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    fig.suptitle(f"{title[-80:]}\nbest lr per width (stars)", fontsize=9)
    return fig
