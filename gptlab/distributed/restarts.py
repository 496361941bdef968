"""Restarts after a failure: a dead rank or node costs the steps since the latest checkpoint.

It does not cost the run.

gptlab's own launcher (world.spawn) starts every worker again after one dies, up to
train.max_restarts times; torchrun's --max-restarts does the same for its workers, and the SLURM
presets' launcher (distributed/slurm_launcher.py) submits a failed job again. Either way the new
start resumes from the latest checkpoint (train.resume=auto) in the same run folder and MLflow
run. This module keeps what recording those restarts needs:

- progress marks: each rank's step in progress, 8 bytes at 8 x rank in <run>/.gptlab.progress,
  so that whoever starts the job again knows the step it died at;
- failures: the launcher's record of a dead worker (which rank, its exit status, that step), left
  in <run>/.gptlab.failure.json for the next start, whose rank 0 completes it (the step it resumed
  from, the steps and seconds lost) into restarts.json, MLflow and the log.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import struct
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from gptlab.checkpoint import state as checkpoint
from gptlab.distributed import slurm
from gptlab.records import layout

log = logging.getLogger(__name__)

MARK = struct.Struct("<q")


# ------------------------------------------------------------------ progress marks


class StepMarks:
    """One rank's progress mark: the step it is training, rewritten in place as each step starts."""

    def __init__(self, run_dir: Path, rank: int):
        self._fd = os.open(Path(run_dir) / layout.PROGRESS, os.O_RDWR | os.O_CREAT, 0o644)
        self._at = MARK.size * rank

    def mark(self, step: int) -> None:
        os.pwrite(self._fd, MARK.pack(step), self._at)

    def marking(self, lr_at: Callable[[int], float]) -> Callable[[int], float]:
        """lr_at, marking step+1 as it is asked for step's rate.

        The loop asks once, as a step starts, and no rank starts a step before every rank has
        finished the one before.
        """

        def marked(step: int) -> float:
            self.mark(step + 1)
            return lr_at(step)

        return marked


def furthest_step(run_dir: Path) -> Optional[int]:
    """The furthest step any rank started (None: no rank marked one)."""
    try:
        data = (Path(run_dir) / layout.PROGRESS).read_bytes()
    except OSError:
        return None
    steps = [MARK.unpack_from(data, i)[0] for i in range(0, len(data) - MARK.size + 1, MARK.size)]
    return max(steps) if steps else None


def clear_marks(run_dir: Path) -> None:
    """Forget the marks of an attempt that ended: the next one's are its own."""
    (Path(run_dir) / layout.PROGRESS).unlink(missing_ok=True)


# ------------------------------------------------------------------ failures (the launcher's side)


def how_it_ended(code: int) -> str:
    """A worker's exit status in a few words: `exit 17`, `SIGKILL`."""
    if code >= 0:
        return f"exit {code}"
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def failure(rank: int, code: int, run_dir: Path, started_at: float) -> Dict[str, Any]:
    """A worker's failure as the launcher saw it: which rank, how it ended, at which step."""
    return {
        "launcher": "gptlab",
        "rank": rank,
        "ended": how_it_ended(code),
        "died_at_step": furthest_step(run_dir),
        "failed_at": time.time(),
        "attempt_started_at": started_at,
    }


def died(f: Dict[str, Any]) -> str:
    """`rank 1 died at step 12 (exit 17)`."""
    step = f.get("died_at_step")
    at = "before its first step" if step is None else f"at step {step}"
    return f"rank {f['rank']} died {at} ({f['ended']})"


def budget_line(
    failures: List[Dict[str, Any]],
    max_restarts: int,
    said: Callable[[Dict[str, Any]], str] = died,
    alike: Optional[Callable[[Dict[str, Any]], str]] = None,
) -> str:
    """The one line when the failures have used up train.max_restarts.

    `said` puts the last failure in words, and failures are counted as the same when `alike`
    (default: said) says so (the SLURM launcher's own words, without the job ids).
    """
    alike = alike or said
    last = failures[-1]
    same = 0
    for f in reversed(failures):
        if alike(f) != alike(last):
            break
        same += 1
    times = f" {same} times" if same > 1 else f", after {len(failures) - 1} restart(s)"
    return f"{said(last)}{times}; no restarts left (train.max_restarts={max_restarts})"


def leave_failure(run_dir: Path, f: Dict[str, Any]) -> None:
    """Leave a failure for the next start's rank 0 to complete."""
    path = Path(run_dir) / layout.FAILURE
    _write_json(path, {"failures": _listed(path, "failures") + [f]})


def _listed(path: Path, key: str) -> List[Dict[str, Any]]:
    """The list under `key` in a JSON file of ours ([] when there is none)."""
    return list((layout.read_json(path) or {}).get(key) or [])


def _write_json(path: Path, value: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=1) + "\n")
    os.replace(tmp, path)


# ------------------------------------------------------------------ the next start's side


def torchrun_failure(run_dir: Path, known: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """A start that torchrun made after its workers failed and that is not recorded yet.

    Such a start has TORCHELASTIC_RESTART_COUNT > 0; returns its failure, as far as torchrun tells
    its workers.
    """
    count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if count == 0 or any(
        e.get("torchrun_restart") == count and e.get("torchrun_run_id") == run_id for e in known
    ):
        return []
    return [
        {
            "launcher": "torchrun",
            "rank": None,  # torchrun does not tell the new workers which rank failed (its log does)
            "ended": (
                f"a worker failed; torchrun started every worker again (restart {count} of "
                f"--max-restarts={os.environ.get('TORCHELASTIC_MAX_RESTARTS')})"
            ),
            "died_at_step": furthest_step(run_dir),
            "torchrun_restart": count,
            "torchrun_run_id": run_id,
        }
    ]


def slurm_requeue_failure(
    run_dir: Path, known: List[Dict[str, Any]], resumed_from: int
) -> List[Dict[str, Any]]:
    """A start of a job SLURM requeued itself after it failed (a lost node), not recorded yet.

    SLURM counts a job's requeues (SLURM_RESTART_COUNT); a requeue after a stop (SIGUSR2, a
    preemption) resumes at the step the job stopped at, so only a start whose ranks had gone past
    the checkpoint it resumes from follows a failure.
    """
    count = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
    job = os.environ.get("SLURM_JOB_ID")
    died_at = furthest_step(run_dir)
    if count == 0 or died_at is None or died_at <= resumed_from:
        return []
    if any(e.get("slurm_restart") == count and e.get("slurm_job_id") == job for e in known):
        return []
    ended = f"SLURM requeued job {job} after it failed (a lost node; requeue {count})"
    return [
        {
            "launcher": "slurm",
            "rank": None,  # the controller's accounting names the node (sacct -D -j JOB)
            "ended": ended,
            "cause": ended,
            "died_at_step": died_at,
            "slurm_restart": count,
            "slurm_job_id": job,
        }
    ]


def lost_since(
    checkpoint_dir: Path, step: int, attempt_started_at: Optional[float]
) -> Optional[float]:
    """When the work a restart lost began; None when neither time is known.

    The resumed checkpoint's writing, or the dead attempt's start if that came later (it resumed
    from the same checkpoint).
    """
    written = [
        p.stat().st_mtime
        for p in checkpoint.list_checkpoints(checkpoint_dir)
        if checkpoint.step_of(p) == step
    ]
    times = [t for t in (*written, attempt_started_at) if t is not None]
    return max(times) if times else None


def complete(
    f: Dict[str, Any], resumed_from: int, since: Optional[float], n: int
) -> Dict[str, Any]:
    """A failure, completed by the start that followed it: restart n of the run."""
    step, now = f.get("died_at_step"), time.time()
    return {
        "restart": n,
        **f,
        "cause": died(f) if f["launcher"] == "gptlab" else f.get("cause") or f["ended"],
        "resumed_from": resumed_from,
        "steps_lost": None if step is None else max(0, step - resumed_from),
        "seconds_lost": None if since is None else round(now - since, 3),
        "resumed_at": now,
    }


def record(run: Any) -> List[Dict[str, Any]]:
    """Record the failures that led to this start, on rank 0; returns the run's restarts so far.

    Rank 0 of a start, after it was built: the failures are completed and added to restarts.json,
    logged and sent to MLflow (metric and tag `restarts`).
    """
    run_dir = Path(run.run_dir)
    history = _listed(run_dir / layout.RESTARTS, "restarts")
    pending = _listed(run_dir / layout.FAILURE, "failures") + torchrun_failure(run_dir, history)
    if slurm.slurm_task():
        pending += slurm_requeue_failure(run_dir, history, run.start_step)
    if not pending:
        return history
    for f in pending:
        since = lost_since(run.checkpoint_dir, run.start_step, f.get("attempt_started_at"))
        event = complete(f, run.start_step, since, len(history) + 1)
        history.append(event)
        log.warning(
            f"restart {event['restart']}: {event['cause']}; resumed from step {run.start_step} "
            f"({event['steps_lost']} step(s) lost)"
        )
    _write_json(run_dir / layout.RESTARTS, {"restarts": history})
    (run_dir / layout.FAILURE).unlink(missing_ok=True)
    run.tracker.log_metrics(run.start_step, {"restarts": len(history)})
    run.tracker.set_tag("restarts", str(len(history)))
    return history


def begin(run: Any) -> List[Dict[str, Any]]:
    """Every rank, after the run was built: mark each step and record this start's failures.

    Mark each step as it starts where a launcher may start the job again (several ranks, torchrun,
    or a SLURM task: the launcher may submit its job again); on rank 0, record the failures that led
    to this start. The run's restarts so far (rank 0; [] elsewhere).
    """
    restartable = (
        run.dist.world_size > 1 or "TORCHELASTIC_RESTART_COUNT" in os.environ or slurm.slurm_task()
    )
    history = record(run) if run.dist.is_main else []
    if restartable:
        run.lr_at = StepMarks(run.run_dir, run.dist.rank).marking(run.lr_at)
    return history
