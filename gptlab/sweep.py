"""A sweep (`python -m gptlab.train -m ...`, any launcher) as one MLflow parent run with a child per job.

A Hydra callback, registered in conf/config.yaml under `hydra.callbacks`:

- when the multirun starts (in the launching process, before any job): create the store once (a
  fresh SQLite file migrated by many jobs at once races), then the parent run (params: the sweep's
  overrides; tags: the sweep folder, the launcher), and write its id to `<sweep folder>/sweep.json`;
- each job's tracker (gptlab/tracking.py) finds sweep.json above its run folder and creates its run
  as a child of the parent; a job that raises marks its run FAILED with the error as a tag;
- a job that failed before it had a run (a bad override, missing data) gets a FAILED child here;
- when the sweep ends: the parent is FINISHED, or FAILED if a job failed; if the launcher raised (a
  failed job is re-raised once all jobs ended) the parent is marked FAILED at exit.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
from pathlib import Path
from typing import Any, Dict, List, Optional

from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from gptlab import console
from gptlab.tracking import (
    PARENT_TAG,
    SWEEP_FILE,
    SWEEP_KIND,
    artifact_root,
    children,
    default_uri,
    error_text,
    experiment_name,
    get_or_create_experiment,
    log_params,
    mlflow_client,
    read_sweep,
    run_name,
    sweep_run_name,
)

log = logging.getLogger(__name__)


def _is_first_task() -> bool:
    """With several SLURM tasks per node every task runs the whole job: only the first one records."""
    return os.environ.get("SLURM_PROCID", os.environ.get("RANK", "0")) == "0"


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
        if not t.mlflow:
            return
        try:
            # Resolving ${now:...} here caches it: Hydra's launcher reuses the same folder for the jobs.
            sweep_dir = Path(str(config.hydra.sweep.dir)).resolve()
            overrides = [str(o) for o in config.hydra.overrides.task]
            launcher = str(config.hydra.runtime.choices.get("hydra/launcher") or "basic")
            uri = t.uri or default_uri(Path("outputs"))
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
            log.warning(f"no MLflow parent run for this sweep: {error_text(e)}")
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
            if failed or stopped:
                why = f"{len(failed)} of {len(runs)} jobs failed" if failed else "the sweep stopped early"
                client.set_tag(p["parent_run_id"], "error", why)
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


class SubmissionReporter(Callback):
    """Says which SLURM jobs a submitit sweep submitted and where their logs go, as they appear.

    hydra-submitit-launcher submits silently and then waits for the whole sweep; this watches
    submitit's folder (<sweep dir>/.submitit/) from the launching process and prints each new job.
    """

    def __init__(self, poll_s: float = 1.0) -> None:
        self.poll_s = poll_s
        self._stop: Optional[Any] = None

    def __getstate__(self) -> Dict[str, Any]:
        # the launcher pickles callbacks into every job: the watcher stays in the launching process
        return {"poll_s": self.poll_s, "_stop": None}

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        import threading

        launcher = str(config.hydra.runtime.choices.get("hydra/launcher") or "")
        if not launcher.startswith("slurm"):
            return
        folder = Path(str(config.hydra.sweep.dir)).resolve() / ".submitit"
        console.setup_logging()
        self._stop = threading.Event()
        threading.Thread(target=self._watch, args=(folder, self._stop), daemon=True).start()

    def _watch(self, folder: Path, stop: Any) -> None:
        seen: set = set()
        while True:
            for script in sorted(folder.glob("*/*_submission.sh")) if folder.is_dir() else []:
                job_id = script.parent.name
                if job_id not in seen:
                    seen.add(job_id)
                    log.info(
                        f"submitted SLURM job {job_id}; logs: {folder}/{job_id}*/{job_id}*_log.{{out,err}} "
                        f"(squeue -j {job_id})"
                    )
            if stop.wait(self.poll_s):
                return

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if self._stop is not None:
            self._stop.set()
