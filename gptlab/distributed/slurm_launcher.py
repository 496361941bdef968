"""The SLURM presets' launcher: submitit's, submitting a job again after a task or node died.

hydra_plugins/gptlab_slurm's RestartingSlurmLauncher, whose launch is `launch` here.

hydra-submitit-launcher's SlurmLauncher submits each Hydra job of a sweep as a SLURM job and waits
for them all; a job whose task died (killed, or exited non-zero: srun's kill-on-bad-exit then ends
the others) or whose node was lost ends FAILED (or NODE_FAIL), and the sweep with it. This launcher
submits such a job again: the same Hydra job (the same job number, so the same run folder, where
train.resume=auto continues from the newest checkpoint in the same MLflow run), without the node
that failed when srun names it, up to train.max_restarts times (the job's own config). Before that
it leaves the failure in the run folder (restarts.leave_failure), which the next start records in
restarts.json, results.json's `restarts` and MLflow, as it does for gptlab's own workers and
torchrun.

It stops with one line (GptlabError) when the budget is spent, or when the job failed at the same
step as the time before (a repeated failure). Never submitted again: a task's exit code 2 (gptlab's
user error), an exception the job raised (submitit's error result: a config or import error), a job
cancelled or out of time; these end the sweep as before. Timeouts and preemption keep submitit's own
path (SIGUSR2, a requeue of the same SLURM job).
"""

from __future__ import annotations

import datetime
import logging
import os
import subprocess
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Set

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, filter_overrides
from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
from omegaconf import OmegaConf, open_dict

from gptlab.distributed import restarts, slurm
from gptlab.errors import GptlabError, or_none

log = logging.getLogger(__name__)

# The SLURM states of a job that lost a task or a node (a timed-out, cancelled or preempted job is
# not one: submitit requeues those, or the user ended them)
RESUBMITTED_STATES = frozenset({"FAILED", "NODE_FAIL", "OUT_OF_MEMORY"})
# how srun reports a task that ended with gptlab's user error (one line, exit 2)
USER_ERROR = "Exited with exit code 2"
DEFAULT_MAX_RESTARTS = 3  # conf/config.yaml's, for a job whose config cannot be read here
POLL_S = 1.0


# ------------------------------------------------------------------ what failed, and what to do


def first_failure(lines: Sequence[str]) -> Dict[str, Any]:
    """The task srun reported dead first, out of slurm.job_failures' lines; {} when none is named.

    Kill-on-bad-exit ended the others because of it: its rank (None for a range of ranks), node
    and how it ended. srun names none for a lost node or a batch script that failed before srun.
    """
    for line in lines:
        parts = slurm.failure_parts(line)
        if parts is not None:
            ranks, node, ended = parts
            return {"rank": int(ranks) if ranks.isdigit() else None, "node": node, "ended": ended}
    return {}


def what_failed(f: Dict[str, Any]) -> str:
    """`rank 1 on gptlab-n2: Killed`, or the job's state when srun named no task (`NODE_FAIL`)."""
    if f.get("node") is None:
        return f["ended"]
    who = f"rank {f['rank']}" if f.get("rank") is not None else "a task"
    return f"{who} on {f['node']}: {f['ended']}"


def slurm_failure(
    job_id: str,
    state: str,
    dead: Dict[str, Any],
    died_at_step: Optional[int],
    started_at: Optional[float] = None,
) -> Dict[str, Any]:
    """A SLURM job's failure as the launcher saw it (restarts.leave_failure's record).

    Its state, the task srun reported dead first (first_failure), and the furthest step any rank
    started.
    """
    f = {
        "launcher": "slurm",
        "job_id": job_id,
        "state": state,
        "rank": dead.get("rank"),
        "node": dead.get("node"),
        "ended": dead.get("ended") or state,
        "died_at_step": died_at_step,
        "failed_at": time.time(),
        "attempt_started_at": started_at,
    }
    f["cause"] = f"SLURM job {job_id}: {what_failed(f)}"
    return f


def not_resubmitted(f: Dict[str, Any], raised: bool) -> Optional[str]:
    """Why a failed job is not submitted again whatever the budget (None: it may be).

    A user error or an exception the job raised is the same at every start.
    """
    if raised:
        return "the job raised an error (submitit's error below)"
    if f["ended"] == USER_ERROR:
        return "exit code 2 is a user error, the same at every start"
    return None


def failed_job(f: Dict[str, Any]) -> str:
    """`SLURM job 105 failed (rank 1 on gptlab-n2: Killed)`."""
    return f"SLURM job {f['job_id']} failed ({what_failed(f)})"


def stop_line(failures: List[Dict[str, Any]], max_restarts: int) -> Optional[str]:
    """The one line that ends a job's restarts; None while it may be submitted again.

    The budget is spent, or the job failed at the same step as the time before (no progress in
    between).
    """
    last = failures[-1]
    head = failed_job(last)
    if max_restarts == 0:
        return f"{head}; not resubmitted (train.max_restarts=0)"
    if len(failures) > max_restarts:
        return restarts.budget_line(failures, max_restarts, said=failed_job, alike=what_failed)
    if len(failures) > 1 and failures[-2]["died_at_step"] == last["died_at_step"]:
        step = last["died_at_step"]
        at = "before its first step" if step is None else f"at step {step}"
        return (
            f"{head} {at}, as job {failures[-2]['job_id']} did: a repeated failure, not "
            f"resubmitted ({len(failures) - 1} of train.max_restarts={max_restarts} restarts used)"
        )
    return None


def resubmitted_line(
    f: Dict[str, Any], new_id: str, excluded: Optional[str], n: int, max_restarts: int
) -> str:
    """The line a resubmission prints.

    `SLURM job 105 failed (rank 1 on gptlab-n2: Killed): resubmitted as job 106 without gptlab-n2
    (restart 1 of train.max_restarts=3)`.
    """
    without = f" without {excluded}" if excluded else ""
    return (
        f"SLURM job {f['job_id']} failed ({what_failed(f)}): resubmitted as job {new_id}{without} "
        f"(restart {n} of train.max_restarts={max_restarts})"
    )


def node_to_exclude(
    f: Dict[str, Any],
    job_nodes: List[str],
    partition_nodes: List[str],
    excluded: Set[str],
    need: int,
) -> Optional[str]:
    """The node the next submission leaves out, if the partition can spare it.

    The one srun named (or a lost job's only node), unless too few nodes would be left in the
    partition for the job (`need` of them).
    """
    node = f.get("node") or (job_nodes[0] if len(job_nodes) == 1 else None)
    if node is None or node in excluded:
        return None
    left = set(partition_nodes) - excluded - {node}
    return node if len(left) >= need else None


# ------------------------------------------------------------------ asking SLURM


def partition_nodes(partition: Optional[str]) -> List[str]:
    """The nodes of a partition (the default one for None), as sinfo lists them."""
    cmd = ["sinfo", "-h", "-N", "-o", "%N"] + (["-p", partition] if partition else [])
    r = or_none(subprocess.run, cmd, capture_output=True, text=True, timeout=30)
    return sorted(set(r.stdout.split())) if r is not None and r.returncode == 0 else []


def started_at(job_id: str) -> Optional[float]:
    """When a job last started (accounting's Start), as a timestamp; None if unknown."""
    r = or_none(
        subprocess.run,
        ["sacct", "-X", "-n", "-P", "-o", "Start", "-j", job_id],
        capture_output=True,
        text=True,
        timeout=30,
    )
    text = (r.stdout.split() or [""])[0] if r is not None else ""
    when = or_none(datetime.datetime.strptime, text, "%Y-%m-%dT%H:%M:%S")
    return when.timestamp() if when is not None else None


def job_nodes(job: Any) -> List[str]:
    """The nodes a submitit job ran on (accounting's NodeList, as submitit's watcher last read)."""
    nodes = job.get_info(mode="cache").get("NodeList") or ""
    if not nodes or nodes == "None assigned":
        return []
    return or_none(slurm.slurm_hostnames, nodes) or [nodes]


def raised(job: Any) -> bool:
    """Whether task 0 of a submitit job left submitit's error result (the function raised)."""
    from submitit.core.utils import pickle_load

    path = job.paths.result_pickle
    outcome = or_none(pickle_load, path) if path.exists() else None
    return bool(outcome) and outcome[0] == "error"


# ------------------------------------------------------------------ the launcher


class _Watched:
    """One Hydra job of the sweep, as the launcher follows it.

    Its current SLURM job, the launcher's arguments that submit it, its failures so far, the nodes
    left out, and the line that ended it (if one did).
    """

    def __init__(self, job: Any, args: tuple):
        self.job, self.args = job, args
        self.failures: List[Dict[str, Any]] = []
        self.excluded: Set[str] = set()
        self.ended = False
        self.stop: Optional[str] = None


def launch(
    launcher: Any, job_overrides: Sequence[Sequence[str]], initial_job_idx: int
) -> Sequence[JobReturn]:
    """RestartingSlurmLauncher.launch: submit, wait, resubmit each job that lost a task or node.

    The sweep's jobs go as one array, as the stock launcher submits them.
    """
    assert launcher.config is not None and len(job_overrides) > 0
    sweeping = _Sweep(launcher)
    sweep_dir = Path(str(launcher.config.hydra.sweep.dir))
    log.info(f"Submitit 'slurm' sweep output dir : {sweep_dir}")
    sweep_dir.mkdir(parents=True, exist_ok=True)
    if "mode" in launcher.config.hydra.sweep:
        os.chmod(sweep_dir, mode=int(str(launcher.config.hydra.sweep.mode), 8))
    args = []
    for num, overrides in enumerate(job_overrides, start=initial_job_idx):
        log.info(f"\t#{num} : {' '.join(filter_overrides(overrides))}")
        args.append(
            (list(overrides), "hydra.sweep.dir", num, f"job_id_for_{num}", Singleton.get_state())
        )
    jobs = sweeping.executor.map_array(launcher, *zip(*args))
    return sweeping.wait([_Watched(job, a) for job, a in zip(jobs, args)])


class _Sweep:
    """The launcher's jobs, watched until each finished, failed for good, or ran out of restarts."""

    def __init__(self, launcher: Any):
        self.launcher = launcher
        self.params: Dict[str, Any] = dict(launcher.params)
        self.executor = self._executor()

    def _executor(self) -> Any:
        """submitit's SLURM executor with the preset's parameters.

        As the stock launcher maps them: the queue's common keys as they are, the others prefixed
        `slurm_`.
        """
        import submitit

        params = dict(self.params)
        init = {"folder": params.pop("submitit_folder")}
        if "max_num_timeout" in params:
            init["slurm_max_num_timeout"] = params.pop("max_num_timeout")
        executor = submitit.AutoExecutor(cluster="slurm", **init)
        common = set(OmegaConf.structured(BaseQueueConf).keys())
        executor.update_parameters(
            **{k if k in common else f"slurm_{k}": v for k, v in params.items()}
        )
        return executor

    def wait(self, watched: List[_Watched]) -> List[JobReturn]:
        """Wait for every job, submitting again those that lost a task or node.

        Then their results, or one line for the jobs whose restarts ended, or submitit's error.
        """
        while not all(w.ended for w in watched):
            for w in watched:
                if not w.ended and w.job.done():
                    self._ended(w)
            if not all(w.ended for w in watched):
                time.sleep(POLL_S)
        stops = [w.stop for w in watched if w.stop]
        if stops:
            raise GptlabError("; ".join(stops))
        return [w.job.results()[0] for w in watched]

    def _ended(self, w: _Watched) -> None:
        """A job ended: finished, failed for good (w.ended), or submitted again."""
        job = w.job
        state = job.state.split()[0] if job.state else "UNKNOWN"  # `CANCELLED by 0`
        if state not in RESUBMITTED_STATES or (
            job.paths.result_pickle.exists() and not raised(job)
        ):
            w.ended = True
            return
        run_dir, budget = self._job_config(w.args)
        dead = first_failure(slurm.job_failures(job.paths.folder))
        step = restarts.furthest_step(run_dir) if run_dir is not None else None
        f = slurm_failure(job.job_id, state, dead, step, started_at(job.job_id))
        why_not = not_resubmitted(f, raised(job))
        if why_not is not None:
            log.error(
                f"SLURM job {job.job_id} failed ({what_failed(f)}): not resubmitted: {why_not}"
            )
            w.ended = True
            return
        w.failures.append(f)
        w.stop = stop_line(w.failures, budget)
        if w.stop is not None:
            w.ended = True
            return
        if run_dir is not None:
            restarts.leave_failure(run_dir, f)
            restarts.clear_marks(run_dir)  # the next start's marks are its own
        self._resubmit(w, f, budget)

    def _resubmit(self, w: _Watched, f: Dict[str, Any], budget: int) -> None:
        """Submit w's Hydra job again, without the failed node where the partition can spare it."""
        need = int(self.params.get("nodes") or 1)
        configured = [n for n in str(self.params.get("exclude") or "").split(",") if n]
        node = node_to_exclude(
            f,
            job_nodes(w.job),
            partition_nodes(self.params.get("partition")),
            w.excluded | set(configured),
            need,
        )
        if node is not None:
            w.excluded.add(node)
        exclude = ",".join(configured + sorted(w.excluded - set(configured)))
        self.executor.update_parameters(slurm_exclude=exclude or None)
        w.job = self.executor.submit(self.launcher, *w.args)
        log.warning(resubmitted_line(f, w.job.job_id, node, len(w.failures), budget))

    def _job_config(self, args: tuple) -> tuple:
        """The (run folder, train.max_restarts) of the Hydra job that `args` submit.

        Its sweep config, composed here as the job composes it. The folder is None if it does not
        exist (the job died before Hydra made it).
        """
        hydra_context, config = self.launcher.hydra_context, self.launcher.config
        overrides, _, num = args[:3]
        cfg = or_none(hydra_context.config_loader.load_sweep_config, config, overrides)
        if cfg is None:
            return None, DEFAULT_MAX_RESTARTS
        with open_dict(cfg.hydra.job):
            cfg.hydra.job.num = num
        run_dir = Path(str(cfg.hydra.sweep.dir)) / str(cfg.hydra.sweep.subdir)
        budget = OmegaConf.select(cfg, "train.max_restarts", default=DEFAULT_MAX_RESTARTS)
        return (run_dir if run_dir.is_dir() else None), int(budget)
