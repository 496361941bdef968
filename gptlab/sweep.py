"""A sweep (`python -m gptlab.train -m ...`, any launcher) as one MLflow parent run with a child per job.

A Hydra callback, registered in conf/config.yaml under `hydra.callbacks`:

- when the multirun starts (in the launching process, before any job): create the store once (a
  fresh SQLite file migrated by many jobs at once races), then the parent run (params: the sweep's
  overrides; tags: the sweep folder, the launcher), and write its id to `<sweep folder>/sweep.json`;
- each job's tracker (gptlab/tracking.py) finds sweep.json above its run folder and creates its run
  as a child of the parent; a job that raises marks its run FAILED with the error as a tag;
- a job that failed before it had a run (a bad override, missing data) gets a FAILED child here;
- when the sweep ends: the parent is FINISHED, or FAILED if a job failed; if the launcher raised (a
  failed job is re-raised once all jobs ended) the parent is marked FAILED at exit. A SLURM job one
  of whose tasks died (srun's kill-on-bad-exit then ended the others) is named with the rank and node
  that failed, on the console as it happens (SubmissionReporter) and in the runs' `slurm_error` tag.
  While a SLURM sweep runs, the launcher waits for its jobs through ControllerCheckedWatcher: a job
  that accounting (sacct) reads as ended is only done once SLURM's controller agrees (a requeued job).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import re
import subprocess
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from omegaconf import DictConfig
from submitit.slurm.slurm import SlurmInfoWatcher, SlurmJob

from gptlab import console
from gptlab.cli import fail
from gptlab.errors import GptlabError
from gptlab.tracking import (
    PARENT_TAG,
    SWEEP_FILE,
    SWEEP_KIND,
    artifact_root,
    check_reachable,
    check_uri,
    children,
    default_uri,
    error_text,
    experiment_name,
    get_or_create_experiment,
    log_params,
    mlflow_client,
    read_sweep,
    run_name,
    store_failure,
    sweep_run_name,
    sync_command,
)

log = logging.getLogger(__name__)


def _is_first_task() -> bool:
    """With several SLURM tasks per node every task runs the whole job: only the first one records."""
    return os.environ.get("SLURM_PROCID", os.environ.get("RANK", "0")) == "0"


# srun's own line for a task that ended badly, e.g. `srun: error: gptlab-n2: task 1: Killed` or
# `srun: error: node7: tasks 8-15: Exited with exit code 1` (task numbers are global ranks)
_SRUN_BAD_EXIT = re.compile(
    r"^srun: error: (?P<node>[^\s:]+): (?P<kind>tasks?) (?P<tasks>[0-9][0-9,-]*): (?P<what>.+)$"
)


# slurmstepd's line when a requeue (submitit's, after SIGUSR2) stops the running job: srun then
# reports the tasks it stopped, ending with rank 0 (which requeued the job)
_REQUEUE = "DUE TO JOB REQUEUE"


def srun_failures(text: str, requeued: bool = False) -> Tuple[List[str], bool]:
    """The tasks that srun says ended badly, one line each (`rank 1 on gptlab-n2: Killed`), and
    whether the text ends inside a requeue (to carry into the next piece of the same log).

    The tasks that a requeue stops are not failures, and are left out.
    """
    found = []
    for line in text.splitlines():
        if _REQUEUE in line:
            requeued = True
            continue
        m = _SRUN_BAD_EXIT.match(line.strip())
        if not m:
            continue
        if requeued:
            if re.split(r"[-,]", m["tasks"])[0] == "0":
                # rank 0 asked for the requeue and is the last to go (it exits 255, submitit's code,
                # or slurmstepd terminates it first): what comes next is the job's next start
                requeued = False
            continue
        ranks = "ranks" if m["kind"] == "tasks" else "rank"
        found.append(f"{ranks} {m['tasks']} on {m['node']}: {m['what'].strip()}")
    return found, requeued


def job_failures(job_folder: Path) -> List[str]:
    """srun's bad-exit lines in a SLURM job's logs (submitit's folder of that job). srun writes to the
    batch step's stderr, which submitit sends to task 0's `<job>_0_log.err`."""
    found: List[str] = []
    for err in sorted(Path(job_folder).glob("*_0_log.err")) if Path(job_folder).is_dir() else []:
        try:
            found += [f for f in srun_failures(err.read_text(errors="replace"))[0] if f not in found]
        except OSError:
            continue
    return found


def _base_name(config: DictConfig) -> str:
    return config.tracking.run_name or run_name(config.model.name, config.data.name, config.hardware.name)


def swept(overrides: List[str]) -> List[str]:
    """The overrides that sweep (`optimizer.lr=1e-3,3e-3`, `range(...)`, ...), as typed."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        return [o.input_line for o in OverridesParser.create().parse_overrides(overrides) if o.is_sweep_override()]
    except Exception:  # noqa: BLE001 - a name is not worth failing a sweep for
        return [o for o in overrides if "," in o]


class SweepCallback(Callback):
    """Records a multirun as an MLflow parent run; the jobs' trackers nest under it."""

    def __init__(self) -> None:
        self.parent: Optional[Dict[str, Any]] = None
        self.ended = False

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        console.setup_logging()  # the launching process: Hydra configures job logging per job only
        t = config.tracking
        try:
            check_uri(t.uri)  # each job would refuse it: one line before the first
        except GptlabError as e:
            fail(f"gptlab.{config.hydra.job.name}", e)
        if not t.mlflow:
            return
        # Resolving ${now:...} here caches it: Hydra's launcher reuses the same folder for the jobs.
        sweep_dir = Path(str(config.hydra.sweep.dir)).resolve()
        uri = t.uri or default_uri(Path("outputs"))
        try:
            check_reachable(uri)  # a server that is down: one look, not MLflow's retries of each call
            overrides = [str(o) for o in config.hydra.overrides.task]
            launcher = str(config.hydra.runtime.choices.get("hydra/launcher") or "basic")
            experiment = t.experiment or experiment_name(config.model.name, config.data.name)
            client = mlflow_client(uri)  # for SQLite: creates and migrates the store, once, before any job
            exp_id = get_or_create_experiment(client, experiment, artifact_root(uri))
            sweeping = swept(overrides)
            name = f"{_base_name(config)} sweep {' '.join(sweeping)}".rstrip()
            run = client.create_run(
                exp_id,
                run_name=name,
                tags={
                    "run_type": "sweep",
                    "sweep_dir": str(sweep_dir),
                    "launcher": launcher,
                    "overrides": " ".join(overrides),
                },
            )
            params = {}
            for o in overrides:
                key, _, value = o.partition("=")
                params[key.lstrip("+~")[:250]] = value
            log_params(client, run.info.run_id, params)
            self.parent = {
                "kind": SWEEP_KIND,
                "parent_run_id": run.info.run_id,
                "experiment_id": exp_id,
                "experiment": experiment,
                "uri": uri,
                "overrides": overrides,
                "swept": [o.partition("=")[0] for o in sweeping],
                "launcher": launcher,
                "run_name": name,
            }
            sweep_dir.mkdir(parents=True, exist_ok=True)
            tmp = sweep_dir / (SWEEP_FILE + ".tmp")
            tmp.write_text(json.dumps(self.parent, indent=2) + "\n")
            os.replace(tmp, sweep_dir / SWEEP_FILE)
            atexit.register(self._end, stopped=True)
            log.info(f"MLflow sweep run {run.info.run_id} ({name}) in {uri}")
        except Exception as e:  # noqa: BLE001 - the jobs still run and record their own runs
            log.warning(
                f"no MLflow parent run for this sweep: {store_failure(uri, e)}; the sweep goes on unrecorded in "
                f"MLflow (each run folder keeps everything); record it later with: {sync_command(sweep_dir)}"
            )
            self.parent = None

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        self._end(stopped=False)
        atexit.unregister(self._end)

    def _end(self, stopped: bool) -> None:
        """Close the parent run: FAILED if a job failed or the sweep stopped early, else FINISHED."""
        if self.parent is None or self.ended:
            return
        self.ended = True
        p = self.parent
        try:
            client = mlflow_client(p["uri"])
            runs = children(client, p["experiment_id"], p["parent_run_id"])
            failed = [r for r in runs if r.info.status in ("FAILED", "KILLED")]
            client.set_tag(p["parent_run_id"], "jobs", str(len(runs)))
            client.set_tag(p["parent_run_id"], "failed_jobs", str(len(failed)))
            scored = [r for r in runs if "summary/best_val_loss" in r.data.metrics]
            if scored:
                best = min(scored, key=lambda r: r.data.metrics["summary/best_val_loss"])
                client.log_metric(
                    p["parent_run_id"], "summary/best_val_loss", best.data.metrics["summary/best_val_loss"]
                )
                client.set_tag(p["parent_run_id"], "best_run", best.info.run_name)
            slurm_errors = []
            for r in failed:
                why = _slurm_error(r.data.tags.get("run_dir"))
                if why:
                    client.set_tag(r.info.run_id, "slurm_error", why[:5000])
                    slurm_errors.append(why)
            if failed or stopped:
                why = f"{len(failed)} of {len(runs)} jobs failed" if failed else "the sweep stopped early"
                client.set_tag(p["parent_run_id"], "error", "; ".join([why, *slurm_errors])[:5000])
            client.set_terminated(p["parent_run_id"], status="FAILED" if failed or stopped else "FINISHED")
        except Exception as e:  # noqa: BLE001
            log.warning(f"could not close the sweep's MLflow parent run {p['parent_run_id']}: {error_text(e)}")

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        """A job that failed before its tracker made a run still shows up, FAILED, under the parent."""
        if job_return.status != JobStatus.FAILED or not _is_first_task():
            return
        try:
            run_dir = Path(str(config.hydra.runtime.output_dir)).resolve()
            sweep = read_sweep(run_dir)
            if sweep is None or not config.tracking.mlflow:
                return
            client = mlflow_client(sweep["uri"])
            runs = children(client, sweep["experiment_id"], sweep["parent_run_id"])
            if any(r.data.tags.get("run_dir") == str(run_dir) for r in runs):
                return  # the tracker made the run and marked it FAILED with the error
            job_overrides = [str(o) for o in config.hydra.overrides.task]
            name = sweep_run_name(_base_name(config), job_overrides, sweep)
            run = client.create_run(
                sweep["experiment_id"],
                run_name=name,
                tags={
                    PARENT_TAG: sweep["parent_run_id"],
                    "sweep_dir": sweep["sweep_dir"],
                    "run_dir": str(run_dir),
                    "overrides": " ".join(job_overrides),
                    "error": error_text(job_return._return_value),
                },
            )
            client.set_terminated(run.info.run_id, status="FAILED")
        except Exception as e:  # noqa: BLE001
            log.warning(f"could not record the failed job in MLflow: {error_text(e)}")


def _slurm_error(run_dir: Optional[str]) -> Optional[str]:
    """`SLURM job 61: rank 1 on gptlab-n2: Killed` for a run folder whose SLURM job lost a task."""
    if not run_dir:
        return None
    try:
        job = json.loads((Path(run_dir) / "slurm.json").read_text())
    except (OSError, ValueError):
        return None
    folder = job.get("submitit_folder") if isinstance(job, dict) else None
    failures = job_failures(Path(folder)) if folder else []
    return f"SLURM job {job.get('job_id')}: {'; '.join(failures)}" if failures else None


# What SLURM's controller calls a job that is running, or will run again (a requeued job is PENDING)
LIVE_STATES = frozenset(
    {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "REQUEUE_FED",
     "REQUEUE_HOLD", "RESIZING", "SIGNALING", "STAGE_OUT"}
)  # fmt: skip


def controller_state(job_id: str) -> Optional[str]:
    """A job's state in SLURM's controller (`scontrol show job`), or None where the controller cannot
    say: it has forgotten the job (MinJobAge after the end), does not answer, or there is no scontrol."""
    try:
        r = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"\bJobState=(\S+)", r.stdout) if r.returncode == 0 else None
    return match.group(1) if match else None


class ControllerCheckedWatcher(SlurmInfoWatcher):
    """submitit's job watcher, which believes accounting (sacct) that a job ended only when SLURM's
    controller agrees.

    submitit reads job states from sacct and takes the first ended state it reads as final: the
    launcher then waits 15 s for the job's result file, and fails the sweep without it. Accounting is
    fed by the controller after the fact, and a job that was requeued (SIGUSR2, preemption) can read
    there as ended while the controller has it pending or running again: seen once in CI, a 2-node
    job requeued by SIGUSR2 read FAILED and its sweep failed before the job's next start could end.
    While the controller says the job lives, it is not done, and sacct is asked again.
    """

    def is_done(self, job_id: str, mode: str = "standard") -> bool:
        if not super().is_done(job_id, mode=mode):
            return False
        state = controller_state(job_id)
        if state not in LIVE_STATES:
            return True  # the controller agrees, or no longer knows the job: accounting's word stands
        self._finished.discard(job_id)
        self._info_dict.pop(job_id, None)  # ask sacct again at the next update
        return False


class SubmissionReporter(Callback):
    """Says which SLURM jobs a submitit sweep submitted and where their logs go, as they appear, and
    which rank on which node ended a job that lost a task.

    hydra-submitit-launcher submits silently and then waits for the whole sweep; this watches
    submitit's folder (<sweep dir>/.submitit/) from the launching process and prints each new job, and
    each task that srun reports as dead (killed, or exited non-zero: srun's kill-on-bad-exit then ends
    the job's other tasks, and submitit's own error names neither the rank nor the node).
    """

    def __init__(self, poll_s: float = 1.0) -> None:
        self.poll_s = poll_s
        self._stop: Optional[Any] = None
        self._thread: Optional[Any] = None
        self._stock_watcher: Optional[SlurmInfoWatcher] = None

    def __getstate__(self) -> Dict[str, Any]:
        # the launcher pickles callbacks into every job: the watchers stay in the launching process
        return {"poll_s": self.poll_s, "_stop": None, "_thread": None, "_stock_watcher": None}

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        import threading

        launcher = str(config.hydra.runtime.choices.get("hydra/launcher") or "")
        if not launcher.startswith("slurm"):
            return
        folder = Path(str(config.hydra.sweep.dir)).resolve() / ".submitit"
        console.setup_logging()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, args=(folder, self._stop), daemon=True)
        self._thread.start()
        if not isinstance(SlurmJob.watcher, ControllerCheckedWatcher):
            # the launcher's jobs wait through this class attribute: put submitit's back at the end
            self._stock_watcher = SlurmJob.watcher
            SlurmJob.watcher = ControllerCheckedWatcher(delay_s=SlurmJob.watcher._delay_s)
        # a failed job makes the launcher raise, and on_multirun_end never comes: the last look at exit
        atexit.register(self._finish)

    def _watch(self, folder: Path, stop: Any) -> None:
        seen: set = set()
        reported: Dict[Path, Any] = {}
        while True:
            for script in sorted(folder.glob("*/*_submission.sh")) if folder.is_dir() else []:
                job_id = script.parent.name
                if job_id not in seen:
                    seen.add(job_id)
                    log.info(
                        f"submitted SLURM job {job_id}; logs: {folder}/{job_id}*/{job_id}*_log.{{out,err}} "
                        f"(squeue -j {job_id})"
                    )
            self._report_failures(folder, reported)
            if stop.wait(self.poll_s):
                self._report_failures(folder, reported)  # lines written since the last look
                return

    @staticmethod
    def _report_failures(folder: Path, reported: Dict[Path, Any]) -> None:
        """Log each task that srun reports dead in the jobs' stderr, reading only what was added."""
        for err in sorted(folder.glob("*/*_0_log.err")) if folder.is_dir() else []:
            offset, seen, requeued = reported.get(err, (0, set(), False))
            try:
                with open(err, "rb") as f:
                    f.seek(offset)
                    chunk = f.read()
            except OSError:
                continue
            complete = chunk[: chunk.rfind(b"\n") + 1]  # a line still being written waits for the next look
            failures, requeued = srun_failures(complete.decode(errors="replace"), requeued)
            reported[err] = (offset + len(complete), seen, requeued)
            for failure in failures:
                if failure not in seen:
                    seen.add(failure)
                    log.error(
                        f"SLURM job {err.parent.name}: {failure}; srun ended the job's other tasks "
                        f"(kill-on-bad-exit); logs: {err.parent}/"
                    )

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        self._finish()
        atexit.unregister(self._finish)

    def _finish(self) -> None:
        if self._stop is not None and self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=10)
        if self._stock_watcher is not None:
            SlurmJob.watcher, self._stock_watcher = self._stock_watcher, None
