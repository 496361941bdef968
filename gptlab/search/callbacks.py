"""A sweep (`python -m gptlab.train -m`, any launcher) as one MLflow parent run, a child per job.

A Hydra callback, registered in conf/config.yaml under `hydra.callbacks`:

- when the multirun starts (in the launching process, before any job): create the store once (a
  fresh SQLite file migrated by many jobs at once races), then the parent run (params: the sweep's
  overrides; tags: the sweep folder, the launcher), and write its id to `<sweep folder>/sweep.json`;
- each job's tracker (gptlab/records/tracker.py) finds sweep.json above its run folder and creates
  its run as a child of the parent; a job that raises marks its run FAILED with the error as a tag;
- a job that failed before it had a run (a bad override, missing data) gets a FAILED child here;
- when the sweep ends: the parent is FINISHED, or FAILED if a job failed; if the launcher raised (a
  failed job is re-raised once all jobs ended) the parent is marked FAILED at exit, unless no job
  began (the first job's config could not be composed: `model.n_layer=abc,def`): then the parent
  run is deleted and the sweep folder removed, so a sweep that never ran leaves nothing. A SLURM
  job one of whose tasks died (srun's kill-on-bad-exit then ended the others) is named with the
  rank and node that failed, on the console as it happens (SubmissionReporter) and in the runs'
  `slurm_error` tag. While a SLURM sweep runs, the launcher waits for its jobs through
  slurm.ControllerCheckedWatcher: a job that accounting (sacct) reads as ended is only done once
  SLURM's controller agrees (a requeued job).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
from pathlib import Path
from typing import Any, Dict, Optional

from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from gptlab import console
from gptlab.cli import fail
from gptlab.distributed import slurm
from gptlab.errors import GptlabError, Superseded, never_fatal
from gptlab.records import identity, layout, parent
from gptlab.records.store import (
    check_reachable,
    check_uri,
    error_text,
    local_uri,
    mlflow_client,
    store_failure,
    sync_command,
)
from gptlab.search.study import allowed_failures

log = logging.getLogger(__name__)


class SweepCallback(Callback):
    """Records a multirun as an MLflow parent run (records/parent.py).

    The jobs' trackers nest under it.
    """

    def __init__(self) -> None:
        self.parent: Optional[Dict[str, Any]] = None
        self.ended = False
        self.tolerated_failures = 0  # a search's trials may fail up to its max_failure_rate
        self.sweep_dir: Optional[Path] = None
        self.existed: Optional[Path] = None  # the sweep folder's nearest folder that existed before
        self.created = False  # the parent run is this start's (not a search's, taken up again)
        self.job_began = False  # a job of this process's launcher (Hydra's basic one) began

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        console.setup_logging()  # the launching process: Hydra configures job logging per job only
        t = config.tracking
        try:
            check_uri(t.uri)  # each job would refuse it: one line before the first
        except GptlabError as e:
            fail(f"gptlab.{config.hydra.job.name}", e)
        if is_search(config):
            from gptlab.search.sweeper import check

            try:
                check(config)  # a bad search: one line, before its parent run exists
            except GptlabError as e:
                fail(f"gptlab.{config.hydra.job.name}", e)
        # Resolving ${now:...} here caches it: Hydra's launcher reuses the same folder for the jobs.
        sweep_dir = Path(str(config.hydra.sweep.dir)).resolve()
        if not is_search(config):  # a search's trials are in its study, asked or not
            self.sweep_dir = sweep_dir
            self.existed = next(p for p in [sweep_dir, *sweep_dir.parents] if p.exists())
        # a sweep that stops (a job's composition failed, a job failed, a signal) ends here
        atexit.register(self._stopped)
        if t.mlflow:
            self._open_parent(config, sweep_dir)

    def _open_parent(self, config: DictConfig, sweep_dir: Path) -> None:
        """The sweep's MLflow parent run, its id in sweep.json; one line when the store fails."""
        t = config.tracking
        uri = t.uri or local_uri(Path(str(config.paths.mlflow_db)))

        def unrecorded(e: BaseException) -> None:  # the jobs still run and record their own runs
            log.warning(
                f"no MLflow parent run for this sweep: {store_failure(uri, e)}; the sweep goes on "
                f"unrecorded in MLflow (each run folder keeps everything); record it later with: "
                f"{sync_command(sweep_dir)}"
            )
            self.parent = None

        with never_fatal(unrecorded):
            # a server that is down: one look, not MLflow's retries of each call
            check_reachable(uri)
            overrides = [str(o) for o in config.hydra.overrides.task]
            launcher = str(config.hydra.runtime.choices.get("hydra/launcher") or "basic")
            sweep = identity.sweep_identity(config, overrides, launcher, sweep_dir)
            # for SQLite: creates and migrates the store, once, before any job
            client = mlflow_client(uri)
            search = is_search(config)
            if search:
                self.tolerated_failures = allowed_failures(config.hparams_search)
            # a search or a scaling study started again continues, and its parent run with it
            again = search or is_scaling(config)
            run = again and parent.reopen(client, uri, layout.read_json(sweep_dir / layout.SWEEP))
            self.created = not run
            run = run or parent.create(client, uri, sweep)
            self.parent = {
                **sweep,
                "uri": uri,
                "parent_run_id": run.info.run_id,
                "experiment_id": run.info.experiment_id,
            }
            sweep_dir.mkdir(parents=True, exist_ok=True)
            tmp = sweep_dir / (layout.SWEEP + ".tmp")
            tmp.write_text(json.dumps(self.parent, indent=2) + "\n")
            os.replace(tmp, sweep_dir / layout.SWEEP)
            log.info(f"MLflow sweep run {run.info.run_id} ({sweep['run_name']}) in {uri}")

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        self._end(stopped=False)
        atexit.unregister(self._stopped)

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        self.job_began = True  # in the launching process for Hydra's basic launcher only

    def _stopped(self) -> None:
        """At exit, clean up after a sweep that did not end.

        One none of whose jobs began (the composition of its first job failed) leaves nothing (its
        parent run deleted, its folder removed); any other has its parent marked FAILED. A job that
        began and failed keeps its FAILED child run, even when its own folder was removed (cli's
        failed start).
        """
        if self.sweep_dir is not None and not self.job_began and not began(self.sweep_dir):
            self._discard()
        else:
            self._end(stopped=True)

    def _discard(self) -> None:
        """Remove what this sweep's start made.

        That is the parent run (into MLflow's trash), sweep.json and Hydra's multirun.yaml, the
        folder and the empty folders above it that it made.
        """
        assert self.sweep_dir is not None and self.existed is not None
        if self.parent is not None and self.created:
            p, self.ended = self.parent, True
            with never_fatal(
                lambda e: log.warning(
                    f"could not delete the sweep's MLflow parent run: {error_text(e)}"
                )
            ):
                parent.discard(mlflow_client(p["uri"]), p["parent_run_id"])
                log.info(
                    f"no job of this sweep began: MLflow sweep run {p['parent_run_id']} deleted"
                )
        for name in (layout.SWEEP, layout.MULTIRUN):
            (self.sweep_dir / name).unlink(missing_ok=True)
        for folder in [self.sweep_dir, *self.sweep_dir.parents]:
            if folder == self.existed or self.existed not in folder.parents:
                return
            try:
                folder.rmdir()
            except OSError:  # not empty, or gone already
                return

    def _end(self, stopped: bool) -> None:
        """End the parent run: FAILED if a job failed or the sweep stopped early, else FINISHED."""
        if self.parent is None or self.ended:
            return
        self.ended = True
        p = self.parent
        with never_fatal(
            lambda e: log.warning(
                f"could not close the sweep's MLflow parent run {p['parent_run_id']}: "
                f"{error_text(e)}"
            )
        ):
            parent.end(
                mlflow_client(p["uri"]),
                p["experiment_id"],
                p["parent_run_id"],
                stopped,
                tolerated_failures=self.tolerated_failures,
                job_error=slurm.job_error,
            )

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        """Record a failed job as a FAILED child run under the parent.

        A job that failed before its tracker made a run still shows up, FAILED, under the parent.
        """
        if not failed_job(job_return) or not slurm.first_task():
            return
        with never_fatal(
            lambda e: log.warning(f"could not record the failed job in MLflow: {error_text(e)}")
        ):
            run_dir = Path(str(config.hydra.runtime.output_dir)).resolve()
            sweep = layout.read_sweep(run_dir)
            if sweep is None or not config.tracking.mlflow:
                return
            config_dict = OmegaConf.to_container(config, resolve=False)
            overrides = [str(o) for o in config.hydra.overrides.task]  # its folder may hold none
            ident = identity.identify(config_dict, run_dir, identity.this_process(), overrides)
            error = error_text(job_return._return_value)
            parent.record_failed_job(mlflow_client(sweep["uri"]), sweep, ident, error)


def failed_job(job_return: JobReturn) -> bool:
    """Whether a job's end is a failure its sweep records.

    A trial's job superseded by a later launch of the trial is not one: the trial's run is the
    new launch's.
    """
    return job_return.status == JobStatus.FAILED and not isinstance(
        job_return._return_value, Superseded
    )


SEARCH_SWEEPER = "hydra_plugins.gptlab_search.optuna_search.GptlabOptunaSweeper"
SCALING_SWEEPER = "hydra_plugins.gptlab_search.scaling_sweeper.GptlabScalingSweeper"


def began(sweep_dir: Path) -> bool:
    """Whether a job of the sweep in `sweep_dir` began: its folder holds more than its start wrote.

    The start writes sweep.json and Hydra's multirun.yaml; a job adds a job's folder, or submitit's
    .submitit/.
    """
    if not sweep_dir.is_dir():
        return False
    return any(e.name not in (layout.SWEEP, layout.MULTIRUN) for e in sweep_dir.iterdir())


def is_scaling(config: DictConfig) -> bool:
    """Whether this multirun is an isoFLOP study (-m scaling=FILE)."""
    return str(OmegaConf.select(config, "hydra.sweeper._target_", default="")) == SCALING_SWEEPER


def is_search(config: DictConfig) -> bool:
    """Whether this multirun is a hyperparameter search (hydra/sweeper=gptlab_optuna)."""
    return str(OmegaConf.select(config, "hydra.sweeper._target_", default="")) == SEARCH_SWEEPER


class SubmissionReporter(Callback):
    """Says which SLURM jobs a submitit sweep submitted and where their logs go, as they appear.

    It also says which rank on which node ended a job that lost a task.

    hydra-submitit-launcher submits silently and then waits for the whole sweep; this watches
    submitit's folder (<sweep dir>/.submitit/) from the launching process and prints each new job,
    and each task that srun reports as dead (killed, or exited non-zero: srun's kill-on-bad-exit
    then ends the job's other tasks, and submitit's own error names neither the rank nor the node).
    """

    def __init__(self, poll_s: float = 1.0) -> None:
        self.poll_s = poll_s
        self._stop: Optional[Any] = None
        self._thread: Optional[Any] = None
        self._stock_watcher: Optional[Any] = None

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
        self._stock_watcher = slurm.install_watcher()  # put back at the end
        # a failed job makes the launcher raise and on_multirun_end never comes: look again at exit
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
                        f"submitted SLURM job {job_id}; logs: "
                        f"{folder}/{job_id}*/{job_id}*_log.{{out,err}} "
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
            # a line still being written waits for the next look
            complete = chunk[: chunk.rfind(b"\n") + 1]
            failures, requeued = slurm.srun_failures(complete.decode(errors="replace"), requeued)
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
            slurm.restore_watcher(self._stock_watcher)
            self._stock_watcher = None
