"""python -m gptlab.compare TARGET: a sweep's runs side by side, as a table and a PNG.

Usage: python -m gptlab.compare TARGET [tracking.uri=...] [compare.out=PNG].

TARGET is a sweep folder (outputs/sweeps/<date>_<time>; any folder of run folders works), an MLflow
run id (a sweep's parent run: its children; any other run: itself), or an MLflow experiment name
(its runs; a sweep's or search's parent run is no row but a heading over its jobs). Prints a table
of the runs (best val loss and bpb, status, the overrides that differ between them, downstream
scores, tokens/s, MFU, wall time) sorted by best val loss, in lines of at most 100 characters (a
column the same in every row said once above it), and writes a PNG of their validation loss against
tokens (<sweep folder>/compare_val_loss.png, or outputs/compare/<target>.png).

A sweep folder is read from its run folders (metrics.jsonl, results.json, .hydra/overrides.yaml),
which are written whether or not MLflow was reachable; when it records an MLflow parent run
(sweep.json), the jobs' statuses and errors come from MLflow.

Seeds as replicates: runs whose overrides differ only in train.seed are one configuration; a second
table gives each one's n, mean ± std over seeds of every final figure, Welch's t-test of the
objective against compare.baseline's seeds (p-value, the difference with its 1 - compare.alpha
interval, "not significant"), and its device-hours and cost; compare.json=PATH writes it as JSON,
and <PNG stem>_seeds.png draws the seeds, means and intervals.

The lr transfer check (docs/mup.md): when model.n_embd and optimizer.lr both vary (a sweep of
hparams_search=lr_transfer), or compare.transfer=KEY names the width, it prints each width's best lr
(by the mean over seeds) and the drift (best lr at the widest / at the narrowest), writes
compare_transfer.png beside the curves' PNG and adds `transfer` to compare.json.
compare.export_best=PATH writes the best configuration as an experiment file (search/best.py).

The root config is conf/compare.yaml: the training config (its `tracking` section names the store)
and the command's own keys (`compare.target`, `compare.out`, `compare.metric`, `compare.baseline`,
`compare.alpha`, `compare.json`, `compare.transfer`, `compare.export_best`); a first argument
without `=` is the target.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import string
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

from hydra.core.config_store import ConfigStore

from gptlab.cli import command, require, text_keys
from gptlab.config import Config, to_config
from gptlab.errors import GptlabError, never_fatal, or_none
from gptlab.records import layout, stats, transfer
from gptlab.records.identity import INIT_FROM_TAG
from gptlab.records.layout import read_metrics, read_overrides, read_results, read_sweep
from gptlab.records.store import (
    PARENT_TAG,
    Unreachable,
    check_reachable,
    children,
    local_uri,
    mlflow_client,
    sqlite_path,
    store_failure,
)
from gptlab.search.best import write as write_experiment

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
    # seeds as replicates: the configuration the others are t-tested against (a job's name, its
    # folder, or overrides such as 'optimizer.lr=1e-4'); null: the best configuration
    baseline: Optional[str]
    alpha: float  # a difference with a larger p-value is "not significant"; its interval 1 - alpha
    json: Optional[str]  # also write the table as JSON to this path; null: no JSON
    # the lr transfer check (docs/mup.md): the width key of a width x lr sweep; null: model.n_embd
    # when it and optimizer.lr both vary, else no check
    transfer: Optional[str]
    # write the best configuration (over seeds) as an experiment file here; null: none
    export_best: Optional[str]
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
    parent: Optional[str] = None  # the run id of the sweep's or search's parent run it is a job of
    device_hours: Optional[float] = None  # wall x devices, or SLURM's accounting
    cost: Optional[float] = None  # device_hours x hardware.cost_per_device_hour
    init_from: Optional[str] = None  # the weights the run started from (model.init_from)
    # a mixture's last per-source figures (val/<source>/loss, val/<source>/bpb)
    sources: Dict[str, float] = field(default_factory=dict)


@dataclass
class ParentRecord:
    """A sweep's or search's parent run in an experiment: a heading over its jobs, not a row."""

    run_id: str
    name: str
    kind: str  # sweep | search
    status: str
    letter: str = ""  # its jobs are named <letter>/<job>

    def heading(self, jobs: int) -> str:
        noun = "trial" if self.kind == "search" else "job"
        return f"{self.letter}: {self.kind} {self.name!r}, {self.status}, {jobs} {noun}s"


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


def runs_of_sweep(folder: Path) -> List[Path]:
    """The run folders under `folder`, then each seed's of a search's trials, in trial order.

    First the run folders directly under `folder`, then those of a search's trials over seeds
    (<trial>/seed_<seed>/, hydra.sweeper.seeds), in trial order.
    """
    nested = [d for d in Path(folder).glob("*/seed_*") if d.is_dir() and layout.is_run_folder(d)]
    nested.sort(key=lambda d: (layout.job_order(d.parent), d.name))
    return layout.runs_in(folder) + nested


def from_folder(folder: Path) -> List[RunRecord]:
    """Each run folder under `folder` (a sweep's jobs, or outputs/runs), and each trial seed's.

    The run folders directly under `folder`, and each seed's of a search's trials.
    """
    run_dirs = runs_of_sweep(folder)
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
                name=str(d.relative_to(folder)) if d.parent != folder else d.name,
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
                init_from=results.get("init_from"),
                sources=per_source(results),
                **folder_usage(d, results),
            )
        )
    sweep = read_sweep(run_dirs[0])
    if sweep is not None and Path(sweep["sweep_dir"]) == folder.resolve():
        _statuses_from_mlflow(records, sweep)
    return records


def folder_usage(run_dir: Path, results: Dict[str, Any]) -> Dict[str, Optional[float]]:
    """A run folder's device_hours and cost, from results.json or else from its wall time.

    results.json's figures where it has them; else (a run recorded before they were) its wall time x
    the devices and price of its config.
    """
    hours, cost = _finite(results.get("device_hours")), _finite(results.get("cost"))
    wall = _finite(results.get("wall_s"))
    if hours is None and wall is not None:
        hw = (layout.read_config(run_dir) or {}).get("hardware") or {}
        hours = wall * int(hw.get("nodes") or 1) * int(hw.get("nproc_per_node") or 1) / 3600
        price = _finite(hw.get("cost_per_device_hour"))
        cost = hours * price if price is not None else None
    return {"device_hours": hours, "cost": cost}


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
    runs = None
    # the folders alone still make the table
    with never_fatal(
        lambda e: log.warning(f"statuses from the run folders only: MLflow {store_failure(uri, e)}")
    ):
        check_reachable(uri)  # a server that is down: one look, not MLflow's retries
        client = mlflow_client(uri)
        runs = children(client, sweep["experiment_id"], sweep["parent_run_id"])
    if runs is None:
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
    """A run folder's latest downstream scores, from metrics.jsonl and eval.json.

    The in-loop HellaSwag's (metrics.jsonl) and gptlab.eval's (eval.json, without stderrs).
    """
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
        device_hours=_finite(m.get("summary/device_hours")),
        cost=_finite(m.get("summary/cost")),
        init_from=tags.get(INIT_FROM_TAG),
        sources=per_source(m),
    )


def from_mlflow(uri: str, target: str) -> Tuple[List[RunRecord], str, List[ParentRecord]]:
    """The records of a run id or an experiment name in the store at uri.

    Returns (records, a title, the sweeps' and searches' parent runs).
    """
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
    if re.fullmatch(r"[0-9a-f]{32}", target):
        run = or_none(client.get_run, target)  # None: maybe an experiment named like a run id
        if run is not None:
            kids = children(client, run.info.experiment_id, target)
            records = [_record_from_run(client, r, bool(kids)) for r in kids or [run]]
            return records, run.info.run_name, []
    exp = client.get_experiment_by_name(target)
    if exp is None:
        names = ", ".join(e.name for e in client.search_experiments()) or "none"
        raise GptlabError(
            f"{target}: not a folder, a run id or an experiment in {uri} (experiments: {names})"
        )
    runs = client.search_runs([exp.experiment_id], max_results=10000)
    records, parents = experiment_runs(client, runs)
    if not records:
        raise GptlabError(f"experiment {target} in {uri} has no runs yet")
    return records, target, parents


# the run_type tags of a parent run: records.parent's (a sweep) and the sweeper's (a search)
PARENT_KINDS = ("sweep", "search")


def experiment_runs(client: Any, runs: List[Any]) -> Tuple[List[RunRecord], List[ParentRecord]]:
    """An experiment's runs as jobs and parents.

    A sweep's or search's parent run (its run_type, or a run other runs name as their
    mlflow.parentRunId) is no job; each job of one is named <letter>/<job number>, the letter its
    parent's.
    """
    nesting = {r.data.tags.get(PARENT_TAG) for r in runs} - {None}
    parents: Dict[str, ParentRecord] = {}
    records = []
    for r in sorted(runs, key=lambda r: r.info.start_time or 0):  # A: the oldest
        kind = r.data.tags.get("run_type")
        if kind in PARENT_KINDS or r.info.run_id in nesting:
            parents[r.info.run_id] = ParentRecord(
                r.info.run_id, r.info.run_name or r.info.run_id, kind or "sweep", r.info.status
            )
            continue
        rec = _record_from_run(client, r, job_names=r.data.tags.get(PARENT_TAG) is not None)
        rec.parent = r.data.tags.get(PARENT_TAG)
        records.append(rec)
    for run_id in nesting - set(parents):  # deleted, or in another experiment
        parents[run_id] = ParentRecord(
            run_id, f"run {run_id[:8]} (not in this experiment)", "sweep", "-"
        )
    for i, p in enumerate(parents.values()):
        p.letter = string.ascii_uppercase[i % 26] + (str(i // 26) if i >= 26 else "")
    for rec in records:
        if rec.parent in parents:
            rec.name = f"{parents[rec.parent].letter}/{rec.name}"
    return records, list(parents.values())


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
SOURCE_METRIC = re.compile(r"val/[^/]+/(loss|bpb)")  # a mixture's source: val/<source>/loss


def per_source(figures: Dict[str, Any]) -> Dict[str, float]:
    """The per-source figures among results.json's keys or an MLflow run's metrics."""
    out = {k: _finite(v) for k, v in figures.items() if SOURCE_METRIC.fullmatch(k)}
    return {k: v for k, v in out.items() if v is not None}


def best_of(r: RunRecord, metric: str) -> Optional[float]:
    if metric not in METRICS:  # a source's figure: the run's last evaluation of it
        return r.sources.get(metric)
    return r.best_val_bpb if metric == "bpb" else r.best_val_loss


def sort_key(r: RunRecord, metric: str = "loss"):
    best = best_of(r, metric)
    return (best is None, best if best is not None else 0.0)


def _figure(value: Optional[float], spec: str) -> str:
    return format(value, spec) if value is not None else "-"


WIDTH = 100  # a table line's most characters
NAME_WIDTH, VALUE_WIDTH, SCORE_WIDTH = 30, 16, 20
KEY_WIDTH = 12  # a longer override key is headed by its last part
# a column: its head, its cells (one a row) and whether they are figures (right-aligned)
Column = Tuple[str, List[str], bool]
Group = Tuple[Optional[str], List[RunRecord]]  # a heading (a parent run; None: none) and its rows


def clip(text: str, width: int) -> str:
    """text in at most width characters: a path keeps its end, anything else its start."""
    if len(text) <= width:
        return text
    if "/" in text and " " not in text:
        return "…" + text[-(width - 1) :]
    return text[: width - 1] + "…"


def key_heads(keys: List[str]) -> List[str]:
    """Column heads of override keys, a long key by its last part where that names one key.

    optimizer.weight_decay -> weight_decay where that names one key; each head is cut to
    VALUE_WIDTH.
    """
    tails = [k.rsplit(".", 1)[-1] for k in keys]
    return [
        clip(k if len(k) <= KEY_WIDTH or tails.count(t) > 1 else t, VALUE_WIDTH)
        for k, t in zip(keys, tails)
    ]


def groups(records: List[RunRecord], metric: str, parents: List[ParentRecord]) -> List[Group]:
    """The rows in order: best first by metric, and with parents each parent's jobs under it.

    With parents, the groups go best first too, and the runs of no sweep sit under their own
    heading.
    """

    def best_first(rs: List[RunRecord]) -> List[RunRecord]:
        return sorted(rs, key=lambda r: sort_key(r, metric))

    if not parents:
        return [(None, best_first(records))]
    by_parent = {p.run_id: [r for r in records if r.parent == p.run_id] for p in parents}
    out: List[Group] = [
        (p.heading(len(by_parent[p.run_id])), best_first(by_parent[p.run_id])) for p in parents
    ]
    own = [r for r in records if r.parent not in by_parent]
    if own:
        out.append(("runs of no sweep or search", best_first(own)))
    return sorted(out, key=lambda g: sort_key(g[1][0], metric) if g[1] else (True, 0.0))


def shared_prefix(names: List[str]) -> str:
    """The words that begin every name, said once rather than in every row ("" if none).

    Given only when a name is too long for its column and each name has more words; "" otherwise.
    """
    if len(names) < 2 or max(map(len, names)) <= NAME_WIDTH:
        return ""
    common = os.path.commonprefix(names)
    common = common[: common.rfind(" ") + 1]
    return common if all(len(n) > len(common) for n in names) else ""


def columns(rows: List[RunRecord], indent: str, metric: str, cut: int = 0) -> List[Column]:
    """Every column of the table for rows, in order.

    The run's name (less its first cut characters), the best figures (the one the rows are sorted by
    first), status, the overrides that differ, downstream scores, speed.
    """
    keys = differing_keys(rows)
    scores: List[str] = []
    for r in rows:
        scores += [k for k in r.scores if k not in scores]
    best = [
        ("best val loss", [_figure(r.best_val_loss, ".4f") for r in rows], True),
        ("best val bpb", [_figure(r.best_val_bpb, ".4f") for r in rows], True),
    ]
    if metric not in METRICS:  # sorted by a source's figure: that column first
        best.insert(0, (metric, [_figure(r.sources.get(metric), ".4f") for r in rows], True))
    overrides = [
        (head, [clip(shown(r.overrides.get(k)), VALUE_WIDTH) for r in rows], False)
        for head, k in zip(key_heads(keys), keys)
    ]
    figures = [
        *[(clip(k, SCORE_WIDTH), [_figure(r.scores.get(k), ".4f") for r in rows]) for k in scores],
        ("tokens/s", [_figure(r.tokens_per_s, ",.0f") for r in rows]),
        ("MFU", [f"{100 * r.mfu:.2f}%" if r.mfu is not None else "-" for r in rows]),
        ("wall", [f"{r.wall_s:,.0f}s" if r.wall_s is not None else "-" for r in rows]),
        *usage_columns([r.device_hours for r in rows], [r.cost for r in rows]),
    ]
    # the starting weights, where a run had some (a fine-tune beside runs from scratch)
    start = [("from", [clip(shown(r.init_from), VALUE_WIDTH) for r in rows], False)]
    return [
        ("run", [indent + clip(r.name[cut:], NAME_WIDTH) for r in rows], False),
        *(best[::-1] if metric == "bpb" else best),
        ("status", [r.status for r in rows], False),
        *(start if any(r.init_from for r in rows) else []),
        *overrides,
        *[(head, cells, True) for head, cells in figures],
    ]


def usage_columns(
    hours: List[Optional[float]], costs: List[Optional[float]]
) -> List[Tuple[str, List[str]]]:
    """The device-hours and cost columns, each where any row has one."""
    out = []
    for head, values in (("device-h", hours), ("cost", costs)):
        if any(v is not None for v in values):
            out.append((head, [_figure(v, ".3g") for v in values]))
    return out


def blocks(cols: List[Column], width: int = WIDTH) -> List[List[Column]]:
    """The columns in blocks of at most width characters, each led by the run column.

    A table too wide for one block continues below.
    """

    def span(col: Column) -> int:
        return max(len(x) for x in [col[0], *col[1]])

    run, rest = cols[0], cols[1:]
    out: List[List[Column]] = [[run]]
    used = span(run)
    for col in rest:
        if len(out[-1]) > 1 and used + 2 + span(col) > width:
            out.append([run])
            used = span(run)
        out[-1].append(col)
        used += 2 + span(col)
    return out


def render(cols: List[Column], grouped: List[Group]) -> List[str]:
    """One block's lines: heads, rules, and each group's heading and rows."""
    widths = [max(len(x) for x in [head, *cells]) for head, cells, _ in cols]

    def line(cells: List[str]) -> str:
        return "  ".join(
            c.rjust(w) if right else c.ljust(w) for c, w, (_, _, right) in zip(cells, widths, cols)
        ).rstrip()

    lines = [line([head for head, _, _ in cols]), line(["-" * w for w in widths])]
    row = 0
    for heading, members in grouped:
        if heading is not None:
            lines.append(clip(heading, WIDTH))
        for _ in members:
            lines.append(line([cells[row] for _, cells, _ in cols]))
            row += 1
    return lines


def table(
    records: List[RunRecord], metric: str = "loss", parents: Optional[List[ParentRecord]] = None
) -> str:
    """Plain-text table of the runs in lines of at most WIDTH characters, best first by `metric`.

    `metric` is loss or bpb. Columns: the best figures, status, the overrides that differ, each
    run's latest downstream scores where any run has them, speed; a column the same in every row is
    said once above it (and the words every long name begins with), the columns past WIDTH continue
    below; with parents (an experiment's sweeps and searches), each one's jobs under a heading of
    it, never a row.
    """
    grouped = groups(records, metric, parents or [])
    rows = [r for _, members in grouped for r in members]
    prefix = shared_prefix([r.name for r in rows])
    cols = columns(rows, "  " if parents else "", metric, len(prefix))
    lines: List[str] = []
    if len(rows) > 1 and (prefix or any(len(set(col[1])) == 1 for col in cols[1:])):
        same = [col for col in cols[1:] if len(set(col[1])) == 1]
        cols = [col for col in cols if col not in same]
        said = [f"name={prefix}\u2026"] if prefix else []
        said += [f"{head}={cells[0]}" for head, cells, _ in same]
        lines += textwrap.wrap(f"every run: {', '.join(said)}", WIDTH, subsequent_indent="  ")
    for i, block in enumerate(blocks(cols)):
        lines += ([""] if i else []) + render(block, grouped)
    errors = [
        line
        for r in rows
        if r.error
        for line in textwrap.wrap(
            f"{r.name}: {r.error}",
            WIDTH,
            initial_indent="  ",
            subsequent_indent="    ",
            max_lines=4,
            placeholder=" \u2026",
        )
    ]
    return "\n".join(lines + (["errors:", *errors] if errors else []))


def _short_value(value: str) -> str:
    """A value for the plot's legend: a number to 3 significant digits."""
    try:
        return f"{float(value):.3g}"
    except ValueError:
        return clip(value, VALUE_WIDTH)


def legend_label(
    r: RunRecord, keys: List[str], best: Optional[float], width: int, cut: int = 0
) -> str:
    """A run's legend entry in at most width characters.

    Its name (less its first cut characters), best figure and its values of the keys that differ (3
    significant digits).
    """
    head = clip(r.name[cut:], max(12, width // 3))
    head += f" (best {best:.4g})" if best is not None else ""
    values = " ".join(
        f"{k.rsplit('.', 1)[-1]}={_short_value(r.overrides[k])}" for k in keys if k in r.overrides
    )
    return clip(f"{head}: {values}" if values else head, width)


# legend entries per column count: (most entries, characters a label): wider legends, shorter labels
LEGEND_LAYOUTS = ((10, 90), (30, 55), (10**9, 40))


def val_figure(records: List[RunRecord], title: str, metric: str = "loss") -> Any:
    """The matplotlib Figure of the runs' validation loss (or bits per byte) against tokens.

    Its legend sits below the axes in as many columns as the entries need, and the figure is as
    tall.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    keys = differing_keys(records)
    curves = []
    for r in sorted(records, key=lambda r: sort_key(r, metric)):
        curve = r.bpb_curve if metric == "bpb" else r.val_curve
        if curve:
            curves.append((r, curve))
    ncol, (_, width) = next(
        (i + 1, lay) for i, lay in enumerate(LEGEND_LAYOUTS) if len(curves) <= lay[0]
    )
    legend_rows = math.ceil(len(curves) / ncol)
    cut = len(shared_prefix([r.name for r, _ in curves]))
    fig = Figure(figsize=(9, 4.8 + 0.2 * legend_rows), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for r, curve in curves:
        x, y = zip(*curve)
        ax.plot(
            x,
            y,
            marker="o",
            ms=3,
            lw=1.5,
            label=legend_label(r, keys, best_of(r, metric), width, cut),
        )
    ax.set_xlabel("tokens")
    ax.set_ylabel("val bits per byte" if metric == "bpb" else "val loss")
    ax.grid(alpha=0.3)
    if curves:
        fig.legend(loc="outside lower center", ncol=ncol, fontsize=8)
    ax.set_title("\n".join(textwrap.wrap(title, 90)) or title, fontsize=10)
    return fig


def plot_val_curves(records: List[RunRecord], path: Path, title: str, metric: str = "loss") -> None:
    """PNG overlaying the runs' validation loss (or bits per byte) against tokens.

    Needs matplotlib.
    """
    fig = val_figure(records, title, metric)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)


# ---- seeds as replicates ---------------------------------------------------------------------

# a run's final figures, summarised over a configuration's seeds: (head, the figure, its format)
FIGURES: Tuple[Tuple[str, Callable[[RunRecord], Optional[float]], str], ...] = (
    ("best val loss", lambda r: r.best_val_loss, ".4f"),
    ("best val bpb", lambda r: r.best_val_bpb, ".4f"),
    ("tokens/s", lambda r: r.tokens_per_s, ",.0f"),
    ("MFU %", lambda r: 100 * r.mfu if r.mfu is not None else None, ".2f"),
    ("wall s", lambda r: r.wall_s, ",.0f"),
)


@dataclass
class Replicates:
    """One configuration: the runs whose overrides differ only in train.seed, its seeds."""

    overrides: Dict[str, str]  # less the seed
    runs: List[RunRecord]
    test: Optional[stats.Welch] = None  # against the baseline's seeds
    significant: Optional[bool] = None
    baseline: bool = False

    def values(self, figure: Callable[[RunRecord], Optional[float]]) -> List[float]:
        return [v for v in map(figure, self.runs) if v is not None]

    def objective(self, metric: str) -> List[float]:
        return self.values(lambda r: best_of(r, metric))

    def total(self, figure: Callable[[RunRecord], Optional[float]]) -> Optional[float]:
        """The sum over its seeds (device-hours, cost); None when no run has it."""
        values = self.values(figure)
        return sum(values) if values else None


def configurations(records: List[RunRecord], metric: str) -> List[Replicates]:
    """The runs grouped by their overrides less train.seed, best mean first.

    The keys a search trial sets for itself are left out as train.seed is.
    """
    groups: Dict[Tuple[Tuple[str, str], ...], Replicates] = {}
    for r in records:
        own = {k: v for k, v in r.overrides.items() if k != stats.SEED_KEY and k not in SEARCH_KEYS}
        key = tuple(sorted(own.items()))
        groups.setdefault(key, Replicates(own, [])).runs.append(r)

    def order(c: Replicates) -> Tuple[bool, float]:
        values = c.objective(metric)
        return (not values, stats.mean(values) if values else 0.0)

    return sorted(groups.values(), key=order)


def _same_value(given: str, value: Optional[str]) -> bool:
    """An override's value as typed against a run's: equal as text or as numbers (1e-3 = 0.001)."""
    if value is None or given == value:
        return given == value
    return or_none(lambda: float(given) == float(value)) or False


def _matches(c: Replicates, spec: str) -> bool:
    """Whether spec (a job's name, its folder, or override words k=v) names configuration c."""
    folder = Path(spec).expanduser()
    if any(r.name == spec for r in c.runs):
        return True
    if folder.is_dir() and any(r.run_dir == str(folder.resolve()) for r in c.runs):
        return True
    pairs = [w.partition("=") for w in spec.replace(",", " ").split()]
    return bool(pairs) and all(
        sep and _same_value(v, c.overrides.get(k.lstrip("+~"))) for k, sep, v in pairs
    )


def find_baseline(configs: List[Replicates], spec: Optional[str], metric: str) -> Replicates:
    """The configuration spec names (null: the best one with 2 seeds or more, else the best)."""
    if spec is None:
        seeded = [c for c in configs if len(c.objective(metric)) >= 2]
        return (seeded or configs)[0]
    found = [c for c in configs if _matches(c, spec)]
    if not found:
        raise GptlabError(
            f"compare.baseline={spec}: no configuration matches it (give a job's name, its folder, "
            f"or overrides such as 'optimizer.lr=1e-3')"
        )
    if len(found) > 1:
        raise GptlabError(
            f"compare.baseline={spec}: {len(found)} configurations match it; name one with more "
            f"overrides ({'; '.join(config_label(c, configs) for c in found[:3])})"
        )
    n = len(found[0].objective(metric))
    if n < 2:
        raise GptlabError(
            f"compare.baseline={spec}: the t-test needs at least 2 seeds per side; the baseline "
            f"has {n} (sweep train.seed=0,1,2)"
        )
    return found[0]


def t_tests(configs: List[Replicates], base: Replicates, metric: str, alpha: float) -> None:
    """Welch's t-test of each configuration with 2 seeds or more against the baseline's.

    Each result says whether its p-value is under alpha.
    """
    base.baseline = True
    ref = base.objective(metric)
    if len(ref) < 2:
        return
    for c in configs:
        values = c.objective(metric)
        if c is not base and len(values) >= 2:
            c.test = stats.welch(values, ref, 1 - alpha)
            c.significant = c.test.p_value < alpha


def config_label(c: Replicates, configs: List[Replicates]) -> str:
    """A configuration named by the overrides that differ between configurations.

    Its run's name when none do.
    """
    keys = differing_keys([Replicates(x.overrides, []) for x in configs])  # type: ignore[misc]
    words = [f"{h}={shown(c.overrides.get(k))}" for h, k in zip(key_heads(keys), keys)]
    return " ".join(words) or c.runs[0].name


def _spread(values: List[float], spec: str) -> str:
    """mean ± std (the mean alone for one value, '-' for none)."""
    if not values:
        return "-"
    sd = stats.std(values)
    return format(stats.mean(values), spec) + (f" ± {format(sd, spec)}" if sd is not None else "")


def _test_cells(c: Replicates) -> Tuple[str, str, str]:
    """(the difference and its interval, p, the verdict) of a configuration's t-test."""
    if c.baseline:
        return "baseline", "-", "baseline"
    if c.test is None:
        return "-", "-", "- (1 seed)"
    t = c.test
    verdict = "yes" if c.significant else "not significant"
    return f"{t.diff:+.4f} [{t.low:+.4f}, {t.high:+.4f}]", f"{t.p_value:.2g}", verdict


def seed_columns(configs: List[Replicates], metric: str, alpha: float) -> List[Column]:
    """The seeds table's columns.

    The configuration, n, mean ± std of every final figure (the objective first), the t-test against
    the baseline, device-hours and cost summed over seeds.
    """
    figures = sorted(FIGURES, key=lambda f: f[0] != f"best val {metric}")
    scores: List[str] = []
    for r in (r for c in configs for r in c.runs):
        scores += [k for k in r.scores if k not in scores]
    spreads = [(head, fig, spec) for head, fig, spec in figures]
    spreads += [(clip(k, SCORE_WIDTH), lambda r, k=k: r.scores.get(k), ".4f") for k in scores]
    tests = [_test_cells(c) for c in configs]
    level = f"{100 * (1 - alpha):g}%"
    cols: List[Column] = [
        ("configuration", [clip(config_label(c, configs), 40) for c in configs], False),
        ("n", [str(len(c.objective(metric))) for c in configs], True),
        *[(h, [_spread(c.values(f), spec) for c in configs], True) for h, f, spec in spreads],
        (f"diff [{level} interval]", [t[0] for t in tests], True),
        ("p", [t[1] for t in tests], True),
        (f"significant (alpha={alpha:g})", [t[2] for t in tests], False),
    ]
    usage = usage_columns(
        [c.total(lambda r: r.device_hours) for c in configs],
        [c.total(lambda r: r.cost) for c in configs],
    )
    return cols + [(head, cells, True) for head, cells in usage]


def seed_table(configs: List[Replicates], metric: str, alpha: float) -> str:
    """The configurations' table, in blocks of at most WIDTH characters."""
    base = next((c for c in configs if c.baseline), None)
    runs = sum(len(c.runs) for c in configs)
    lines = textwrap.wrap(
        f"seeds as replicates: {runs} runs, {len(configs)} configurations (by train.seed); mean ± "
        f"std over n seeds; Welch's t-test of best val {metric} against the baseline"
        + (f" {config_label(base, configs)}" if base else ""),
        WIDTH,
    )
    for i, block in enumerate(blocks(seed_columns(configs, metric, alpha))):
        lines += ([""] if i else []) + render(block, [(None, configs)])  # type: ignore[list-item]
    return "\n".join(lines)


def as_json(configs: List[Replicates], metric: str, alpha: float) -> Dict[str, Any]:
    """compare.json's document: one row per configuration."""
    rows = []
    for c in configs:
        values = c.objective(metric)
        t = c.test
        rows.append(
            {
                "overrides": c.overrides,
                "runs": [r.name for r in c.runs],
                "n": len(values),
                "mean": stats.mean(values) if values else None,
                "std": stats.std(values),
                "values": values,
                "baseline": c.baseline,
                "p_value": t.p_value if t else None,
                "significant": c.significant,
                "diff": t.diff if t else None,
                "interval": [t.low, t.high] if t else None,
                "device_hours": c.total(lambda r: r.device_hours),
                "cost": c.total(lambda r: r.cost),
                "figures": {
                    head: {"mean": stats.mean(v) if v else None, "std": stats.std(v)}
                    for head, fig, _ in FIGURES
                    for v in [c.values(fig)]
                },
            }
        )
    return {"metric": f"best_val_{metric}", "alpha": alpha, "rows": rows}


def seeds_figure(configs: List[Replicates], title: str, metric: str, alpha: float) -> Any:
    """Each configuration's seeds as points, with their mean and its 1 - alpha interval."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    shown_configs = [c for c in configs if c.objective(metric)]
    fig = Figure(
        figsize=(max(5.0, 1.2 * len(shown_configs) + 2), 4.8), dpi=110, layout="constrained"
    )
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for i, c in enumerate(shown_configs):
        values = c.objective(metric)
        offsets = [(j - (len(values) - 1) / 2) * 0.06 for j in range(len(values))]
        ax.plot([i + o for o in offsets], values, "o", ms=4, alpha=0.6, color="C0")
        m, sd = stats.mean(values), stats.std(values)
        half = (
            stats.t_quantile(1 - alpha / 2, len(values) - 1) * sd / math.sqrt(len(values))
            if sd
            else 0.0
        )
        ax.errorbar([i + 0.25], [m], yerr=[half], fmt="s", color="C3" if c.baseline else "C1",
                    capsize=4)  # fmt: skip
    ax.set_xticks(range(len(shown_configs)))
    ax.set_xticklabels([config_label(c, configs) for c in shown_configs], rotation=20, fontsize=8)
    ax.set_ylabel(f"best val {'bits per byte' if metric == 'bpb' else 'loss'}")
    ax.grid(alpha=0.3)
    ax.set_title(
        f"{clip(title, 70)}\nseeds (points), mean and {100 * (1 - alpha):g}% interval "
        "(squares; red: the baseline)",
        fontsize=9,
    )
    return fig


def report_seeds(
    records: List[RunRecord],
    settings: CompareSettings,
    out: Path,
    title: str,
    found: List[transfer.Transfer],
) -> None:
    """Reports seeds as replicates: the configurations' table, compare.json and the seeds' PNG.

    The table when any configuration has 2 seeds or more (or a baseline is given), compare.json when
    asked, and the seeds' PNG beside the curves'.
    """
    metric, alpha = settings.metric, settings.alpha
    configs = configurations(records, metric)
    seeded = any(len({r.overrides.get(stats.SEED_KEY) for r in c.runs}) > 1 for c in configs)
    if seeded or settings.baseline is not None:
        t_tests(configs, find_baseline(configs, settings.baseline, metric), metric, alpha)
        print("\n" + seed_table(configs, metric, alpha), flush=True)
        path = out.with_name(f"{out.stem}_seeds.png")
        with never_fatal(lambda e: log.warning(f"seeds plot skipped: {e}")):
            fig = seeds_figure(configs, title, metric, alpha)
            path.parent.mkdir(parents=True, exist_ok=True)
            fig.savefig(path)
            print(f"seeds: {path}", flush=True)
    if settings.json:
        doc = as_json(configs, metric, alpha)
        if found:  # a width x lr sweep: each group's best lr per width and its drift
            doc["transfer"] = [t.as_json() for t in found]
        Path(settings.json).write_text(json.dumps(doc, indent=1) + "\n")
        print(f"table as JSON: {settings.json}", flush=True)


def run_compare(cfg: Any) -> None:
    """Print the table and write the PNG. cfg: composed from conf/compare.yaml."""
    require(
        cfg,
        "compare.target",
        "a sweep folder, an MLflow run id or an experiment name (python -m gptlab.compare TARGET)",
    )
    config = to_config(cfg, CompareConfig)
    target, out_setting, metric = config.compare.target, config.compare.out, config.compare.metric
    if metric not in METRICS and not SOURCE_METRIC.fullmatch(metric):
        raise GptlabError(
            f"compare.metric={metric}: must be one of {', '.join(METRICS)}, or a mixture's "
            "source as val/<source>/loss or val/<source>/bpb"
        )
    if not 0 < config.compare.alpha < 1:
        raise GptlabError(f"compare.alpha={config.compare.alpha}: must be between 0 and 1")
    folder = Path(target).expanduser()
    if folder.is_dir():
        records, title, parents = from_folder(folder), str(folder), []
        out = Path(out_setting) if out_setting else folder / VAL_PNG
    else:
        records, title, parents = from_mlflow(
            config.tracking.uri or local_uri(Path(config.paths.mlflow_db)), target
        )
        safe = re.sub(r"[^\w.-]+", "_", target)
        out = (
            Path(out_setting)
            if out_setting
            else Path(config.paths.outputs) / "compare" / f"{safe}.png"
        )
    print(table(records, metric, parents), flush=True)
    try:
        plot_val_curves(records, out, title, metric)
        print(f"val {metric} curves: {out}", flush=True)
    except ImportError:
        log.warning("val loss plot skipped: matplotlib is not installed (pip install matplotlib)")
    found = report_transfer(records, config.compare, out, title)
    report_seeds(records, config.compare, out, title, found)
    export_best(records, config.compare, title)


def report_transfer(
    records: List[RunRecord], settings: CompareSettings, out: Path, title: str
) -> List[transfer.Transfer]:
    """The lr transfer check of a width x lr sweep: each width's best lr and the drift.

    Runs for compare.transfer, or when found by itself; writes compare_transfer.png beside the
    curves' PNG.
    """
    metric = settings.metric
    points = [(r.overrides, best_of(r, metric)) for r in records]
    width_key = settings.transfer or transfer.detect(points)
    if width_key is None:
        return []
    if not (transfer.varies(points, width_key) and transfer.varies(points, transfer.LR_KEY)):
        raise GptlabError(
            f"compare.transfer={width_key}: the runs need 2 values or more of both {width_key} "
            f"and {transfer.LR_KEY} (a sweep such as hparams_search=lr_transfer)"
        )
    found = transfer.transfers(points, width_key)
    if not found:
        log.warning("lr transfer: no run has a best val %s yet", metric)
        return []
    print("\n" + transfer.table(found, metric), flush=True)
    path = out.with_name(transfer.TRANSFER_PNG)
    with never_fatal(lambda e: log.warning(f"transfer plot skipped: {e}")):
        fig = transfer.figure(found, title, metric)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path)
        print(f"transfer: {path}", flush=True)
    return found


def export_best(records: List[RunRecord], settings: CompareSettings, title: str) -> None:
    """compare.export_best: the best configuration as an experiment file (search/best.py).

    The best is the lowest mean over its seeds; its muP keys come from the best run's resolved
    config.
    """
    if not settings.export_best:
        return
    metric = settings.metric
    configs = [c for c in configurations(records, metric) if c.objective(metric)]
    if not configs:
        raise GptlabError(
            f"compare.export_best={settings.export_best}: no run has a best val {metric} yet"
        )
    top, values = configs[0], configs[0].objective(metric)
    run = min(
        (r for r in top.runs if best_of(r, metric) is not None), key=lambda r: sort_key(r, metric)
    )
    resolved = layout.read_config(Path(run.run_dir)) if run.run_dir else None
    about = (
        f"The best configuration of {title} by gptlab.compare: best val {metric} "
        f"{stats.mean(values):.4f} (mean of {len(values)}; runs "
        f"{', '.join(r.name for r in top.runs)})."
    )
    model = (resolved or {}).get("model")
    print(write_experiment(Path(settings.export_best), top.overrides, model, about), flush=True)


def main(argv: Optional[List[str]] = None) -> None:
    """python -m gptlab.compare TARGET [overrides]: a Hydra app on conf/compare.yaml.

    A first argument without `=` is the target (compare.target=TARGET). argv: the same arguments, to
    run it in this process (errors raise GptlabError).
    """
    command("compare", run_compare, argv)


if __name__ == "__main__":
    main()
