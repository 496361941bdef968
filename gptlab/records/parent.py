"""A sweep's MLflow parent run: the one way it is created, given its failed jobs, and ended.

The sweep callback (gptlab/search/callbacks.py) creates it when a multirun starts and ends it when
the multirun ends; gptlab.sync creates it for a sweep recorded later and ends it from its jobs'
records. Both go through these functions, so a sweep looks the same in MLflow whichever recorded it.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Callable, Dict, List, Optional, Tuple

from gptlab.errors import never_fatal, or_none
from gptlab.records import stats, store, transfer
from gptlab.records.identity import RunIdentity

log = logging.getLogger(__name__)

BEST = "summary/best_val_loss"  # the figure the parent keeps of its best job
BEST_BPB = "summary/best_val_bpb"
# a job's figures the parent keeps per job (jobs/<job>/<name>): its best and its latest scores
JOB_FIGURES = (BEST, BEST_BPB)
JOB_SCORE_PREFIXES = ("hellaswag/", "eval/")
# what the parent sums over its jobs: the device-hours and cost of the sweep or search
USAGE = ("summary/device_hours", "summary/cost")
ALPHA = 0.05  # the parent's t-tests' level (gptlab.compare's compare.alpha default)


def per_job_figures(runs: list) -> Dict[str, float]:
    """jobs/<job>/<figure> for each child, so the parent's page lists every job's figures.

    Each child's best val loss and bpb, and its latest downstream scores (in-loop HellaSwag,
    gptlab.eval).
    """
    import os

    out = {}
    for r in runs:
        job = os.path.basename(r.data.tags.get("run_dir") or "") or r.info.run_name or "job"
        for key, value in r.data.metrics.items():
            if key in JOB_FIGURES or key.startswith(JOB_SCORE_PREFIXES):
                name = key.split("/", 1)[1] if key in JOB_FIGURES else key
                out[f"jobs/{job}/{name}"[:250]] = value
    return out


def usage_totals(runs: list) -> Dict[str, float]:
    """summary/device_hours and summary/cost summed over the jobs that have them."""
    out = {}
    for key in USAGE:
        values = [r.data.metrics[key] for r in runs if key in r.data.metrics]
        if values:
            out[key] = sum(values)
    return out


def _overrides(run: Any) -> Dict[str, str]:
    """A job's overrides (its `overrides` tag) as key -> value."""
    pairs = (w.partition("=") for w in (run.data.tags.get("overrides") or "").split())
    return {k: v for k, sep, v in pairs if sep}


def _configuration(run: Any) -> Tuple[Tuple[str, str], ...]:
    """A job's overrides less train.seed (and a search trial's own): its seeds' shared key."""
    return tuple(
        sorted(
            (k, v)
            for k, v in _overrides(run).items()
            if k != stats.SEED_KEY and "hparams_search." not in k
        )
    )


def seed_figures(runs: list) -> Tuple[Dict[str, float], Dict[str, str]]:
    """Seeds as replicates: per-configuration figures over seeds and a t-test against the best.

    The replicates are the jobs whose overrides differ only in train.seed: per configuration
    seeds/<its differing overrides>/{n,mean,std} of summary/best_val_loss and, against the best
    configuration's seeds, Welch's {p_value,diff,low,high} and a `significant` tag. Nothing when no
    configuration has 2 seeds.
    """
    groups: Dict[Tuple[Tuple[str, str], ...], List[float]] = {}
    for r in runs:
        # a job without a seed of its own is no replicate (a plain sweep, a search's trial)
        if BEST in r.data.metrics and f"{stats.SEED_KEY}=" in (r.data.tags.get("overrides") or ""):
            groups.setdefault(_configuration(r), []).append(r.data.metrics[BEST])
    if not any(len(v) > 1 for v in groups.values()):
        return {}, {}
    keys = [
        k for k in {k for c in groups for k, _ in c} if len({dict(c).get(k) for c in groups}) > 1
    ]
    base = min((c for c in groups if len(groups[c]) > 1), key=lambda c: stats.mean(groups[c]))
    metrics: Dict[str, float] = {}
    tags: Dict[str, str] = {}
    for c, values in groups.items():
        label = "seeds/" + (" ".join(f"{k}_{v}" for k, v in c if k in keys) or "all")
        label = re.sub(r"[^\w\-. /]", "_", label)[:200]
        metrics.update({f"{label}/n": len(values), f"{label}/mean": stats.mean(values)})
        if len(values) > 1:
            metrics[f"{label}/std"] = stats.std(values)  # type: ignore[assignment]
        if c is base:
            tags["seeds.baseline"] = label
        elif len(values) > 1:
            t = stats.welch(values, groups[base], 1 - ALPHA)
            metrics.update(
                {f"{label}/{k}": getattr(t, k) for k in ("p_value", "diff", "low", "high")}
            )
            tags[f"{label}/significant"] = "yes" if t.p_value < ALPHA else "not significant"
    return metrics, tags


def params(overrides: list) -> Dict[str, str]:
    """The sweep's overrides as the parent's params (`optimizer.lr` -> `1e-3,3e-3`)."""
    pairs = (o.partition("=") for o in overrides)
    return {k.lstrip("+~")[:250]: v for k, _, v in pairs}


def create(
    client: Any,
    uri: str,
    sweep: Dict[str, Any],
    tags: Optional[Dict[str, str]] = None,
    start_time: Optional[int] = None,
) -> Any:
    """Create the parent run of sweep (identity.sweep_identity's dict) in the store; the run.

    tags: more tags (gptlab.sync marks the runs it made); start_time: in ms (now when None)."""
    experiment_id = store.get_or_create_experiment(
        client, sweep["experiment"], store.artifact_root(uri)
    )
    all_tags = {
        "run_type": "sweep",
        "sweep_dir": sweep["sweep_dir"],
        "launcher": str(sweep.get("launcher") or "basic"),
        "overrides": " ".join(sweep.get("overrides") or []),
        **(tags or {}),
    }
    run = client.create_run(
        experiment_id, run_name=sweep.get("run_name"), tags=all_tags, start_time=start_time
    )
    store.log_params(client, run.info.run_id, params(sweep.get("overrides") or []))
    return run


def reopen(client: Any, uri: str, recorded: Optional[Dict[str, Any]]) -> Any:
    """The parent run that `recorded` (a sweep.json) names, RUNNING again.

    None when there is none in this store (another store, deleted): a search started again keeps its
    one parent.
    """
    if not recorded or recorded.get("uri") != uri or not recorded.get("parent_run_id"):
        return None
    run = or_none(client.get_run, recorded["parent_run_id"])
    if run is None:  # not in this store any more: a new parent
        return None
    if run.info.lifecycle_stage != "active":
        return None
    client.update_run(run.info.run_id, status="RUNNING")
    return run


def child_tags(sweep: Dict[str, Any], parent_run_id: str) -> Dict[str, str]:
    """The tags that nest a job's run under the sweep's parent."""
    return {store.PARENT_TAG: parent_run_id, "sweep_dir": sweep["sweep_dir"]}


def record_failed_job(
    client: Any, sweep: Dict[str, Any], identity: RunIdentity, error: str
) -> None:
    """A FAILED child for a job that failed before its tracker made a run (a bad override, no data).

    Nothing when its run exists already (the tracker marked it FAILED with the error).
    """
    runs = store.children(client, sweep["experiment_id"], sweep["parent_run_id"])
    if any(r.data.tags.get("run_dir") == identity.tags["run_dir"] for r in runs):
        return
    tags = {**identity.tags, **child_tags(sweep, sweep["parent_run_id"]), "error": error}
    run = client.create_run(sweep["experiment_id"], run_name=identity.name, tags=tags)
    client.set_terminated(run.info.run_id, status="FAILED")


def end(
    client: Any,
    experiment_id: str,
    parent_run_id: str,
    stopped: bool,
    tolerated_failures: int = 0,
    job_error: Optional[Callable[[Optional[str]], Optional[str]]] = None,
) -> None:
    """End the parent from its children: FAILED if a job failed or the sweep stopped early.

    FAILED if a job failed (more than tolerated_failures: a search's allowance) or the sweep stopped
    early, else FINISHED; with the job counts, the best job's summary/best_val_loss, and what ended
    each failed job as job_error(its run folder) says (`slurm_error`; the callers pass
    slurm.job_error: the rank and node a SLURM job lost).
    """
    runs = store.children(client, experiment_id, parent_run_id)
    failed = [r for r in runs if r.info.status in ("FAILED", "KILLED")]
    client.set_tag(parent_run_id, "jobs", str(len(runs)))
    client.set_tag(parent_run_id, "failed_jobs", str(len(failed)))
    scored = [r for r in runs if BEST in r.data.metrics]
    if scored:
        best = min(scored, key=lambda r: r.data.metrics[BEST])
        client.log_metric(parent_run_id, BEST, best.data.metrics[BEST])
        client.set_tag(parent_run_id, "best_run", best.info.run_name)
    bpb = [r.data.metrics[BEST_BPB] for r in runs if BEST_BPB in r.data.metrics]
    if bpb:
        client.log_metric(parent_run_id, BEST_BPB, min(bpb))
    for key, value in per_job_figures(runs).items():
        client.log_metric(parent_run_id, key, value)
    record_seeds(client, parent_run_id, runs)
    record_transfer(client, parent_run_id, runs)
    slurm_errors = []
    for r in failed if job_error is not None else ():
        why = job_error(r.data.tags.get("run_dir"))
        if why:
            client.set_tag(r.info.run_id, "slurm_error", why[:5000])
            slurm_errors.append(why)
    too_many = len(failed) > tolerated_failures
    if too_many or stopped:
        why = f"{len(failed)} of {len(runs)} jobs failed" if too_many else "the sweep stopped early"
        client.set_tag(parent_run_id, "error", "; ".join([why, *slurm_errors])[:5000])
    client.set_terminated(parent_run_id, status="FAILED" if too_many or stopped else "FINISHED")


def record_seeds(client: Any, parent_run_id: str, runs: list) -> None:
    """The sweep's device-hours and cost (its jobs' sum) and its seeds' figures on the parent."""
    metrics, tags = seed_figures(runs)
    for key, value in {**usage_totals(runs), **metrics}.items():
        client.log_metric(parent_run_id, key, value)
    for key, text in tags.items():
        client.set_tag(parent_run_id, key, text)


def record_transfer(client: Any, parent_run_id: str, runs: list) -> None:
    """A width x lr sweep's transfer check (records/transfer.py); nothing for other sweeps.

    Records transfer/drift, each width's best lr (transfer/best_lr/n_embd_<w>) and the plot
    compare_transfer.png.
    """
    points = [(_overrides(r), r.data.metrics.get(BEST)) for r in runs]
    width_key = transfer.detect(points)
    found = transfer.transfers(points, width_key) if width_key else []
    if not found:
        return
    for key, value in transfer.parent_metrics(found).items():
        client.log_metric(parent_run_id, key, value)
    with never_fatal(lambda e: log.warning(f"the parent run has no transfer plot: {e}")):
        fig = transfer.figure(found, f"sweep {parent_run_id[:8]}: lr transfer", "loss")
        client.log_figure(parent_run_id, fig, transfer.TRANSFER_PNG)


def discard(client: Any, parent_run_id: str) -> None:
    """Delete the parent of a sweep none of whose jobs began (its first job's composition failed).

    A sweep that never ran is no record (MLflow keeps the run in its trash, restorable).
    """
    client.delete_run(parent_run_id)
