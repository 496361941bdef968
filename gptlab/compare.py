"""python -m gptlab.compare TARGET [tracking.uri=...] [compare.out=PNG]: a sweep's runs side by
side.

TARGET is a sweep folder (outputs/sweeps/<date>_<time>; any folder of run folders works), an MLflow
run id (a sweep's parent run: its children; any other run: itself), or an MLflow experiment name
(its runs, sweep parents left out). Prints a table of the runs (the overrides that differ between
them, status, best val loss, tokens/s, MFU, wall time) sorted by best val loss, and writes a PNG of
their validation loss against tokens (<sweep folder>/compare_val_loss.png, or
outputs/compare/<target>.png).

A sweep folder is read from its run folders (metrics.jsonl, results.json, .hydra/overrides.yaml),
which are written whether or not MLflow was reachable; when it records an MLflow parent run
(sweep.json), the jobs' statuses and errors come from MLflow.

The root config is conf/compare.yaml: the training config (its `tracking` section names the store)
and the command's own keys `compare.target` and `compare.out`; a first argument without `=` is the
target.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from hydra.core.config_store import ConfigStore

from gptlab.cli import command, require, text_keys
from gptlab.config import Config, to_config
from gptlab.errors import GptlabError
from gptlab.records import layout
from gptlab.records.layout import read_metrics, read_overrides, read_results, read_sweep
from gptlab.records.store import (
    Unreachable,
    check_reachable,
    children,
    local_uri,
    mlflow_client,
    sqlite_path,
    store_failure,
)

VAL_PNG = "compare_val_loss.png"
SCORE_KEYS = ("hellaswag_acc", "hellaswag_acc_norm")  # metrics.jsonl's downstream scores

# not __name__: run as __main__, it would fall outside gptlab
log = logging.getLogger("gptlab.compare")


@dataclass
class CompareSettings:
    """The command's own keys (values in conf/compare.yaml)."""

    target: str  # a sweep folder, an MLflow (parent) run id, or an experiment name
    # the val-loss PNG; null: <sweep folder>/compare_val_loss.png or outputs/compare/<target>.png
    out: Optional[str]
    # what the runs are sorted and plotted by: loss (nats per token) | bpb (bits per byte: runs
    # with different tokenizers share one axis)
    metric: str = "loss"


@dataclass
class CompareConfig(Config):
    """The training config with the `compare` section: the schema of conf/compare.yaml."""

    compare: CompareSettings


ConfigStore.instance().store(name="gptlab_compare_schema", node=CompareConfig)
# How the command reads its arguments (cli.hydra_words): TARGET is compare.target=TARGET, as typed
POSITIONAL = "compare.target"
TEXT_KEYS = text_keys(CompareSettings, "compare.")


@dataclass
class RunRecord:
    name: str  # a sweep's job number, or the MLflow run name
    overrides: Dict[str, str]
    status: str
    best_val_loss: Optional[float] = None
    best_val_bpb: Optional[float] = None
    tokens_per_s: Optional[float] = None
    mfu: Optional[float] = None
    wall_s: Optional[float] = None
    val_curve: List[Tuple[float, float]] = field(default_factory=list)  # (tokens, val loss)
    bpb_curve: List[Tuple[float, float]] = field(default_factory=list)  # (tokens, val bpb)
    # the latest downstream scores: hellaswag_acc(_norm) in the loop, <task>/<metric> of gptlab.eval
    scores: Dict[str, float] = field(default_factory=dict)
    error: Optional[str] = None
    run_id: Optional[str] = None
    run_dir: Optional[str] = None


def parse_overrides(items: List[str]) -> Dict[str, str]:
    out = {}
    for o in items:
        key, sep, value = o.partition("=")
        if sep:
            out[key] = value
    return out


def _finite(x: Any) -> Optional[float]:
    return float(x) if isinstance(x, (int, float)) and math.isfinite(x) else None


def _best(recorded: Any, curve: List[Tuple[float, float]]) -> Optional[float]:
    """The recorded best val loss, else the lowest point of the val curve."""
    best = _finite(recorded)
    return min(v for _, v in curve) if best is None and curve else best


def _run_wall_s(run: Any) -> Optional[float]:
    """An MLflow run's seconds from start to end (None until it ends)."""
    return (
        (run.info.end_time - run.info.start_time) / 1000
        if run.info.end_time and run.info.start_time
        else None
    )


# ---- reading runs ---------------------------------------------------------------------------


def from_folder(folder: Path) -> List[RunRecord]:
    """Each run folder directly under `folder` (a sweep's jobs, or outputs/runs)."""
    run_dirs = layout.runs_in(folder)
    if not run_dirs:
        if layout.is_run_folder(folder):
            raise GptlabError(
                f"{folder} is one run folder: give the sweep folder that holds it (or an "
                f"experiment)"
            )
        raise GptlabError(f"{folder} holds no run folders (a sweep folder holds 0/, 1/, ...)")
    records = []
    for d in run_dirs:
        rows = read_metrics(d)
        results = read_results(d)
        curve, bpb = (
            [(r["tokens"], r[key]) for r in rows if r.get(key) is not None and "tokens" in r]
            for key in ("val_loss", "val_bpb")
        )
        records.append(
            RunRecord(
                name=d.name,
                overrides=parse_overrides(read_overrides(d)),
                status=folder_status(results),
                best_val_loss=_best(results.get("best_val_loss"), curve),
                best_val_bpb=_best(results.get("best_val_bpb"), bpb),
                tokens_per_s=_finite(results.get("tokens_per_s")),
                mfu=_finite(results.get("mfu")),
                wall_s=_finite(results.get("wall_s")),
                val_curve=curve,
                bpb_curve=bpb,
                scores=folder_scores(d, rows),
                run_id=results.get("mlflow_run_id"),
                run_dir=str(d.resolve()),
            )
        )
    sweep = read_sweep(run_dirs[0])
    if sweep is not None and Path(sweep["sweep_dir"]) == folder.resolve():
        _statuses_from_mlflow(records, sweep)
    return records


def folder_status(results: Dict[str, Any]) -> str:
    """A run folder's status: PRUNED (a search trial its pruner stopped), FINISHED or INCOMPLETE."""
    if not results:
        return "INCOMPLETE"
    return "PRUNED" if results.get("stopped_by") == layout.PRUNED else "FINISHED"


def _statuses_from_mlflow(records: List[RunRecord], sweep: Dict[str, Any]) -> None:
    """FAILED / RUNNING and the error, from the sweep's MLflow children (when the store answers)."""
    uri = sweep["uri"]
    db = sqlite_path(uri)
    if db is not None and not db.is_file():
        return
    try:
        check_reachable(uri)  # a server that is down: one look, not MLflow's retries
        client = mlflow_client(uri)
        runs = children(client, sweep["experiment_id"], sweep["parent_run_id"])
    except Exception as e:  # noqa: BLE001 - the folders alone still make the table
        log.warning(f"statuses from the run folders only: MLflow {store_failure(uri, e)}")
        return
    by_dir = {r.data.tags.get("run_dir"): r for r in runs}
    for rec in records:
        run = by_dir.get(rec.run_dir)
        if run is not None:
            pruned = run.data.tags.get("search.state") == "PRUNED"
            rec.status, rec.error, rec.run_id = (
                "PRUNED" if pruned else run.info.status,
                run.data.tags.get("error"),
                run.info.run_id,
            )
            if rec.wall_s is None:
                rec.wall_s = _run_wall_s(run)
    # a job whose start failed leaves no folder behind: the sweep's record of it is all there is
    known = {rec.run_dir for rec in records}
    records += [
        _record_from_run(client, r, job_names=True)
        for d, r in by_dir.items()
        if d and d not in known
    ]


def folder_scores(run_dir: Path, rows: List[Dict[str, Any]]) -> Dict[str, float]:
    """A run folder's latest downstream scores: the in-loop HellaSwag's (metrics.jsonl) and
    gptlab.eval's (eval.json, without stderrs)."""
    scores = {}
    for r in rows:
        scores.update({k: r[k] for k in SCORE_KEYS if _finite(r.get(k)) is not None})
    for item in layout.read_eval(run_dir):
        if _finite(item.get("value")) is not None:
            scores[f"{item['task']}/{item['metric']}"] = item["value"]
    return scores


def mlflow_scores(metrics: Dict[str, float]) -> Dict[str, float]:
    """The same scores from an MLflow run's latest metrics (hellaswag/*, eval/<task>/<metric>)."""
    scores = {}
    for key, value in metrics.items():
        if key.startswith("hellaswag/"):
            scores[key.replace("/", "_")] = value
        elif key.startswith("eval/") and not key.endswith("_stderr"):
            scores[key[len("eval/") :]] = value
    return scores


def _record_from_run(client: Any, run: Any, job_names: bool) -> RunRecord:
    m, tags = run.data.metrics, run.data.tags
    tokens_at = {p.step: p.value for p in client.get_metric_history(run.info.run_id, "tokens")}
    curve, bpb = (
        [
            (tokens_at.get(p.step, float(p.step)), p.value)
            for p in sorted(client.get_metric_history(run.info.run_id, key), key=lambda p: p.step)
        ]
        for key in ("val/loss", "val/bpb")
    )
    wall = _finite(m.get("summary/wall_s"))
    name = Path(tags["run_dir"]).name if job_names and "run_dir" in tags else run.info.run_name
    overrides = tags.get("overrides")
    return RunRecord(
        name=name,
        overrides=parse_overrides(overrides.split(" ")) if overrides else {},
        status=run.info.status,
        best_val_loss=_best(m.get("summary/best_val_loss"), curve),
        best_val_bpb=_best(m.get("summary/best_val_bpb"), bpb),
        tokens_per_s=_finite(m.get("summary/tokens_per_s")),
        mfu=_finite(m.get("summary/mfu")),
        wall_s=wall if wall is not None else _run_wall_s(run),
        val_curve=curve,
        bpb_curve=bpb,
        scores=mlflow_scores(m),
        error=tags.get("error"),
        run_id=run.info.run_id,
        run_dir=tags.get("run_dir"),
    )


def from_mlflow(uri: str, target: str) -> Tuple[List[RunRecord], str]:
    """(records, a title) for a run id or an experiment name in the store at uri."""
    db = sqlite_path(uri)
    if db is not None and not db.is_file():
        raise GptlabError(
            f"{target}: not a folder, and there is no MLflow store at {db} "
            "(pass tracking.uri=... or run from the folder holding outputs/)"
        )
    try:
        check_reachable(uri)
    except Unreachable as e:
        raise GptlabError(f"{target}: not a folder, and MLflow {e}") from None
    client = mlflow_client(uri)
    runs, title, job_names = None, target, False
    if re.fullmatch(r"[0-9a-f]{32}", target):
        try:
            run = client.get_run(target)
        except Exception:  # noqa: BLE001 - not a run id: maybe an experiment named like one
            run = None
        if run is not None:
            kids = children(client, run.info.experiment_id, target)
            runs, title, job_names = (kids or [run]), run.info.run_name, bool(kids)
    if runs is None:
        exp = client.get_experiment_by_name(target)
        if exp is None:
            names = ", ".join(e.name for e in client.search_experiments()) or "none"
            raise GptlabError(
                f"{target}: not a folder, a run id or an experiment in {uri} (experiments: {names})"
            )
        runs = [
            r
            for r in client.search_runs([exp.experiment_id], max_results=10000)
            if r.data.tags.get("run_type") != "sweep"
        ]
        if not runs:
            raise GptlabError(f"experiment {target} in {uri} has no runs yet")
    return [_record_from_run(client, r, job_names) for r in runs], title


# ---- the table and the plot ------------------------------------------------------------------


def differing_keys(records: List[RunRecord]) -> List[str]:
    """Override keys whose value is not the same in every run, in first-seen order."""
    keys: List[str] = []
    for r in records:
        keys += [k for k in r.overrides if k not in keys and k not in SEARCH_KEYS]
    return [k for k in keys if len({r.overrides.get(k) for r in records}) > 1]


# a search trial's own overrides: its number is the run's name, its storage is where it reports
SEARCH_KEYS = ("hparams_search.trial", "hparams_search.storage", "hparams_search.attempt")


def shown(value: Optional[str]) -> str:
    """An override's value for the table: a sampled float to 4 significant digits."""
    if value is None:
        return "-"
    try:
        number = float(value)
    except ValueError:
        return value
    return value if len(value) <= 8 or not math.isfinite(number) else f"{number:.4g}"


METRICS = ("loss", "bpb")


def best_of(r: RunRecord, metric: str) -> Optional[float]:
    return r.best_val_bpb if metric == "bpb" else r.best_val_loss


def sort_key(r: RunRecord, metric: str = "loss"):
    best = best_of(r, metric)
    return (best is None, best if best is not None else 0.0)


def label(r: RunRecord, keys: List[str]) -> str:
    return " ".join(f"{k}={r.overrides.get(k, '-')}" for k in keys) or r.name


def _figure(value: Optional[float], spec: str) -> str:
    return format(value, spec) if value is not None else "-"


def table(records: List[RunRecord], metric: str = "loss") -> str:
    """Plain-text table, best first by `metric` (loss or bpb), with each run's latest downstream
    scores where any run has them."""
    keys = differing_keys(records)
    scores: List[str] = []
    for r in records:
        scores += [k for k in r.scores if k not in scores]
    figures = ["best val loss", "best val bpb", *scores, "tokens/s", "MFU", "wall"]
    head = ["run", *keys, "status", *figures]
    rows = []
    for r in sorted(records, key=lambda r: sort_key(r, metric)):
        rows.append(
            [
                r.name[:60],
                *[shown(r.overrides.get(k)) for k in keys],
                r.status,
                _figure(r.best_val_loss, ".4f"),
                _figure(r.best_val_bpb, ".4f"),
                *[_figure(r.scores.get(k), ".4f") for k in scores],
                _figure(r.tokens_per_s, ",.0f"),
                f"{100 * r.mfu:.2f}%" if r.mfu is not None else "-",
                f"{r.wall_s:,.0f}s" if r.wall_s is not None else "-",
            ]
        )
    right = set(figures)
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]

    def fmt(cells):
        return "  ".join(
            str(c).rjust(w) if h in right else str(c).ljust(w)
            for c, w, h in zip(cells, widths, head)
        ).rstrip()

    lines = [fmt(head), fmt(["-" * w for w in widths]), *map(fmt, rows)]
    ordered = sorted(records, key=lambda r: sort_key(r, metric))
    errors = [f"  {r.name}: {r.error}" for r in ordered if r.error]
    return "\n".join(lines + (["errors:", *errors] if errors else []))


def plot_val_curves(records: List[RunRecord], path: Path, title: str, metric: str = "loss") -> None:
    """PNG overlaying the runs' validation loss (or bits per byte) against tokens (needs
    matplotlib)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    keys = differing_keys(records)
    fig = Figure(figsize=(8, 4.8), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for r in sorted(records, key=lambda r: sort_key(r, metric)):
        curve, best = (
            (r.bpb_curve, r.best_val_bpb) if metric == "bpb" else (r.val_curve, r.best_val_loss)
        )
        if curve:
            x, y = zip(*curve)
            shown = f" (best {best:.4f})" if best is not None else ""
            ax.plot(x, y, marker="o", ms=3, lw=1.5, label=f"{label(r, keys)}{shown}")
    ax.set_xlabel("tokens")
    ax.set_ylabel("val bits per byte" if metric == "bpb" else "val loss")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)


def run_compare(cfg: Any) -> None:
    """Print the table and write the PNG. cfg: composed from conf/compare.yaml."""
    require(
        cfg,
        "compare.target",
        "a sweep folder, an MLflow run id or an experiment name (python -m gptlab.compare TARGET)",
    )
    config = to_config(cfg, CompareConfig)
    target, out_setting, metric = config.compare.target, config.compare.out, config.compare.metric
    if metric not in METRICS:
        raise GptlabError(f"compare.metric={metric}: must be one of {', '.join(METRICS)}")
    folder = Path(target).expanduser()
    if folder.is_dir():
        records, title = from_folder(folder), str(folder)
        out = Path(out_setting) if out_setting else folder / VAL_PNG
    else:
        records, title = from_mlflow(
            config.tracking.uri or local_uri(Path(config.paths.mlflow_db)), target
        )
        safe = re.sub(r"[^\w.-]+", "_", target)
        out = (
            Path(out_setting)
            if out_setting
            else Path(config.paths.outputs) / "compare" / f"{safe}.png"
        )
    print(table(records, metric), flush=True)
    try:
        plot_val_curves(records, out, title, metric)
        print(f"val {metric} curves: {out}", flush=True)
    except ImportError:
        log.warning("val loss plot skipped: matplotlib is not installed (pip install matplotlib)")


def main(argv: Optional[List[str]] = None) -> None:
    """python -m gptlab.compare TARGET [overrides]: a Hydra app on conf/compare.yaml.

    A first argument without `=` is the target (compare.target=TARGET). argv: the same arguments, to
    run it in this process (errors raise GptlabError).
    """
    command("compare", run_compare, argv)


if __name__ == "__main__":
    main()
