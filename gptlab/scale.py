"""python -m gptlab.scale SOURCE [scale.*=...]: fit scaling laws to (FLOPs, parameters, tokens,
loss) points and predict the compute-optimal run for a budget.

SOURCE is a CSV with the columns flops, params, tokens and loss (from a study, a paper's table,
anywhere), or a folder whose run folders hold results.json (params, tokens, best_val_loss) and
derived.json (flops_per_token). It prints one table, and writes scaling.json and scaling.png
beside the source (or into scale.out). The methods: docs/scaling.md.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore

from gptlab.cli import text_keys
from gptlab.errors import GptlabError

log = logging.getLogger("gptlab.scale")


@dataclass
class ScaleSettings:
    """The command's own keys (values in conf/scale.yaml)."""

    source: str  # a CSV of flops,params,tokens,loss rows, or a folder of run folders
    target_flops: Optional[float]  # predict the compute-optimal run for this budget; null: none
    bootstrap: int  # resamplings for the 95% intervals (0: none)
    seed: int  # the resampling's seed
    out: Optional[str]  # the folder for scaling.json and scaling.png; null: beside the source


@dataclass
class ScaleConfig:
    scale: ScaleSettings


ConfigStore.instance().store(name="gptlab_scale_schema", node=ScaleConfig)
POSITIONAL = "scale.source"  # python -m gptlab.scale SOURCE is scale.source=SOURCE
TEXT_KEYS = text_keys(ScaleSettings, "scale.")


def read_runs(folder: Path) -> List[Any]:
    """One point per finished run under folder: FLOPs = tokens x the planner's FLOPs per token."""
    from gptlab.records import layout
    from gptlab.scaling.fit import Point

    points = []
    for results_file in sorted(folder.rglob(layout.RESULTS)):
        run = results_file.parent
        results = layout.read_json(results_file) or {}
        derived = layout.read_json(run / layout.DERIVED) or {}
        loss = results.get("best_val_loss", results.get("val_loss"))
        figures = (results.get("params"), results.get("tokens"), derived.get("flops_per_token"))
        if loss is None or None in figures:
            log.warning(f"{run}: skipped (no val loss, params, tokens or flops_per_token)")
            continue
        params, tokens, fpt = figures
        points.append(Point(results.get("flops") or tokens * fpt, params, tokens, loss))
    if not points:
        raise GptlabError(f"scale.source={folder}: no finished run with a val loss in it")
    return points


def fit_all(points: List[Any], s: ScaleSettings) -> Dict[str, Any]:
    """Both approaches, their intervals, the held-out check and the target's prediction."""
    from gptlab.scaling import fit

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
        "intervals": fit.bootstrap(points, s.bootstrap, s.seed) if s.bootstrap else {},
        "held_out": fit.held_out(points),
    }
    if s.target_flops:
        n = two["k_n"] * s.target_flops ** two["a"]
        d = s.target_flops / (6 * n)
        loss = three["E"] + three["A"] / n ** three["alpha"] + three["B"] / d ** three["beta"]
        out["target"] = {"flops": s.target_flops, "n_opt": n, "d_opt": d, "loss": loss}
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
    return "\n".join(lines)


def plot(result: Dict[str, Any], points: List[Any], path: Path) -> None:
    """The isoFLOP curves with their minima and the N_opt power law."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from gptlab.scaling.fit import budgets

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
    right.set(xlabel="compute C (FLOPs)", ylabel="N_opt", title=f"N_opt ~ C^{result['a']:.3f}")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_scale(cfg: Any) -> Dict[str, Any]:
    from gptlab.config import to_config
    from gptlab.scaling.fit import read_csv

    s = to_config(cfg, ScaleConfig).scale
    source = Path(s.source).expanduser()
    if source.is_dir():
        points, out = read_runs(source), Path(s.out or source)
    elif source.is_file():
        points, out = read_csv(source), Path(s.out or source.parent)
    else:
        raise GptlabError(f"scale.source={s.source}: no such CSV file or folder")
    result = fit_all(points, s)
    print(table(result))
    out.mkdir(parents=True, exist_ok=True)
    (out / "scaling.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, points, out / "scaling.png")
    print(f"wrote {out / 'scaling.json'} and {out / 'scaling.png'}")
    return result


def main(argv: Optional[List[str]] = None) -> Optional[Dict[str, Any]]:
    """python -m gptlab.scale SOURCE: a Hydra app on conf/scale.yaml that writes scaling.json."""
    from gptlab.cli import command

    return command("scale", run_scale, argv)


if __name__ == "__main__":
    main()
