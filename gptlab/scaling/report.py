"""A fit's presentation: the points, both approaches, the printed table, the plot and files.

The points read from a study's run folders, both approaches with their intervals and the target's
prediction (fit_all), the table gptlab.scale prints, the plot, and the files written beside the
points (scaling.json, scaling.png).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Dict, List, Optional

from gptlab.errors import GptlabError
from gptlab.records import layout
from gptlab.scaling import fit
from gptlab.scaling.fit import Point, budgets

log = logging.getLogger("gptlab.scale")

VERIFY = "verify_"  # a study's verification runs: <study>/verify_<budget>/, not points


def read_runs(folder: Path, objective: str = "best_val_loss") -> List[Any]:
    """One point per finished run under folder: FLOPs = tokens x the planner's FLOPs per token."""
    points = []
    for results_file in sorted(folder.rglob(layout.RESULTS)):
        run = results_file.parent
        if run.name.startswith(VERIFY):
            continue
        results = layout.read_json(results_file) or {}
        derived = layout.read_json(run / layout.DERIVED) or {}
        fallback = "val_bpb" if "bpb" in objective else "val_loss"
        loss = results.get(objective, results.get(fallback))
        figures = (results.get("params"), results.get("tokens"), derived.get("flops_per_token"))
        if loss is None or None in figures:
            log.warning(f"{run}: skipped (no val loss, params, tokens or flops_per_token)")
            continue
        params, tokens, fpt = figures
        points.append(Point(results.get("flops") or tokens * fpt, params, tokens, loss))
    if not points:
        raise GptlabError(f"scale.source={folder}: no finished run with a val loss in it")
    return points


def fit_all(
    points: List[Any], bootstrap: int = 100, seed: int = 0, target_flops: Optional[float] = None
) -> Dict[str, Any]:
    """Both approaches, their intervals, the held-out check and the target's prediction."""

    two, three = fit.approach2(points), fit.approach3(points)
    out: Dict[str, Any] = {
        "points": len(points),
        "budgets": [
            {"flops": c, "n_opt": n, "d_opt": c / (6 * n), "loss": loss}
            for c, n, loss in two["minima"]
        ],
        "a": two["a"],
        "b": two["b"],
        **{k: three[k] for k in ("E", "A", "B", "alpha", "beta")},
        "intervals": fit.bootstrap(points, bootstrap, seed) if bootstrap else {},
        "held_out": fit.held_out(points),
    }
    out["l_opt"] = {"k": two["k_l"], "exponent": two["l"]}  # L_opt = k C^exponent
    if target_flops:
        n = two["k_n"] * target_flops ** two["a"]
        d = target_flops / (6 * n)
        loss = three["E"] + three["A"] / n ** three["alpha"] + three["B"] / d ** three["beta"]
        out["target"] = {"flops": target_flops, "n_opt": n, "d_opt": d, "loss": loss}
    out["k_n"] = two["k_n"]
    return out


def table(result: Dict[str, Any]) -> str:
    """The fit as the lines the command prints."""
    ci = result["intervals"]

    def fig(key: str) -> str:
        low_high = f" [{ci[key][0]:.3g}, {ci[key][1]:.3g}]" if key in ci else ""
        return f"{result[key]:.4g}{low_high}"

    lines = [f"{'budget (FLOPs)':>16}  {'N_opt':>12}  {'D_opt':>12}  {'loss':>8}"]
    for b in result["budgets"]:
        lines.append(
            f"{b['flops']:>16.3g}  {b['n_opt']:>12.4g}  {b['d_opt']:>12.4g}  {b['loss']:>8.4f}"
        )
    lines.append(f"N_opt ~ C^a: a = {fig('a')};  D_opt ~ C^b: b = {fig('b')}  (95% intervals)")
    lines.append(
        f"L(N, D) = E + A/N^alpha + B/D^beta: E = {fig('E')}, A = {fig('A')}, B = {fig('B')}, "
        f"alpha = {fig('alpha')}, beta = {fig('beta')}"
    )
    h = result["held_out"]
    if h:
        lines.append(
            f"held out ({h['flops']:.3g} FLOPs, fitted without it): N_opt {h['n_opt_error']:+.1%}, "
            f"loss {h['loss_error']:+.2%}"
        )
    t = result.get("target")
    if t:
        lines.append(
            f"at {t['flops']:.3g} FLOPs: N_opt {t['n_opt']:.4g} parameters, D_opt {t['d_opt']:.4g} "
            f"tokens, expected loss {t['loss']:.4f}"
        )
        if t.get("command"):
            lines.append(f"  the nearest size of the study{t.get('size_note', '')}: {t['command']}")
        v = t.get("verify")
        if v:
            lines.append(
                f"  verified: predicted loss {t['loss']:.4f}, achieved {v['loss']:.4f} "
                f"({v['loss_error']:+.2%}) in {v['run_dir']}"
            )
    return "\n".join(lines)


def plot(result: Dict[str, Any], points: List[Any], path: Path) -> None:
    """The isoFLOP curves with their minima and the N_opt power law."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for c, group in budgets(points).items():
        group = sorted(group, key=lambda p: p.params)
        left.plot([p.params for p in group], [p.loss for p in group], "o-", label=f"{c:.2g}")
    for b in result["budgets"]:
        left.plot(b["n_opt"], b["loss"], "k*", markersize=10)
    left.set(xscale="log", xlabel="parameters N", ylabel="val loss", title="isoFLOP curves")
    left.legend(title="FLOPs", fontsize=7)
    cs = [b["flops"] for b in result["budgets"]]
    right.loglog(cs, [b["n_opt"] for b in result["budgets"]], "k*", label="minima")
    t = result.get("target")
    line_cs = sorted([*cs, *([t["flops"]] if t else [])])
    line = [line_cs[0] / 2, line_cs[-1] * 2]
    right.loglog(line, [result["k_n"] * c ** result["a"] for c in line], "b-", label="power law")
    if t:
        right.loglog([t["flops"]], [t["n_opt"]], "rs", label="prediction")
    right.set(xlabel="compute C (FLOPs)", ylabel="N_opt", title=f"N_opt ~ C^{result['a']:.3f}")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def fit_folder(folder: Path, objective: str = "best_val_loss") -> Dict[str, Any]:
    """A study folder's fit with the default settings, written into it (scaling.json, .png)."""
    points = read_runs(Path(folder), objective)
    return write_fit(fit_all(points), points, Path(folder))


def write_fit(result: Dict[str, Any], points: List[Any], out: Path) -> Dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    (out / "scaling.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, points, out / "scaling.png")
    return result
