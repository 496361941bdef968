"""A sweep's MLflow parent run: the one way it is created, given its failed jobs, and ended.

The sweep callback (gptlab/search/callbacks.py) creates it when a multirun starts and ends it when
the multirun ends; gptlab.sync creates it for a sweep recorded later and ends it from its jobs'
records. Both go through these functions, so a sweep looks the same in MLflow whichever recorded it.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, Optional

from gptlab.errors import or_none
from gptlab.records import store
from gptlab.records.identity import RunIdentity

log = logging.getLogger(__name__)

BEST = "summary/best_val_loss"  # the figure the parent keeps of its best job
BEST_BPB = "summary/best_val_bpb"
# a job's figures the parent keeps per job (jobs/<job>/<name>): its best and its latest scores
JOB_FIGURES = (BEST, BEST_BPB)
JOB_SCORE_PREFIXES = ("hellaswag/", "eval/")


def per_job_figures(runs: list) -> Dict[str, float]:
    """jobs/<job>/<figure> for each child: its best val loss and bpb, and its latest downstream
    scores (in-loop HellaSwag, gptlab.eval), so the parent's page lists every job's."""
    import os

    out = {}
    for r in runs:
        job = os.path.basename(r.data.tags.get("run_dir") or "") or r.info.run_name or "job"
        for key, value in r.data.metrics.items():
            if key in JOB_FIGURES or key.startswith(JOB_SCORE_PREFIXES):
                name = key.split("/", 1)[1] if key in JOB_FIGURES else key
                out[f"jobs/{job}/{name}"[:250]] = value
    return out


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
    """The parent run that `recorded` (a sweep.json) names, RUNNING again; None when there is none
    in this store (another store, deleted): a search started again keeps its one parent."""
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
    """A FAILED child for a job that failed before its tracker made a run (a bad override, no data);
    nothing when its run exists already (the tracker marked it FAILED with the error)."""
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
    """End the parent from its children: FAILED if a job failed (more than tolerated_failures: a
    search's allowance) or the sweep stopped early, else FINISHED; with the job counts, the best
    job's summary/best_val_loss, and what ended each failed job as job_error(its run folder) says
    (`slurm_error`; the callers pass slurm.job_error: the rank and node a SLURM job lost)."""
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


def discard(client: Any, parent_run_id: str) -> None:
    """Delete the parent of a sweep none of whose jobs began (its first job's composition failed):
    a sweep that never ran is no record (MLflow keeps the run in its trash, restorable)."""
    client.delete_run(parent_run_id)
