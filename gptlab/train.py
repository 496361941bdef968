"""python -m gptlab.train [overrides]: compose the config, build the run, train, record results."""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any, Dict, Optional

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from gptlab import console
from gptlab.cli import command, fail, os_error_message
from gptlab.config import to_config
from gptlab.errors import GptlabError
from gptlab.records import layout

# not __name__: run as __main__, it would fall outside gptlab
log = logging.getLogger("gptlab.train")


def run_training(cfg: DictConfig, run_dir: Path) -> Dict[str, Any]:
    """config -> build -> loop -> results; also used by tests through Hydra's compose API.

    When `hardware` asks for more processes than were launched (hardware=cpu_x2 from a plain
    `python -m gptlab.train`), this process starts the workers, waits, and returns rank 0's results.
    """
    console.setup_logging()  # under Hydra: its job logging (conf/hydra/job_logging/gptlab.yaml)
    config = to_config(cfg)
    # torch: off the start-up path of --help and config errors (imported once the config is valid)
    from gptlab.distributed import world as distributed
    from gptlab.training.build import (
        budgeted,
        build,
        log_model,
        record_expectation,
        write_sample,
    )
    from gptlab.training.loop import train

    config = budgeted(config)  # train.max_tokens / max_flops: the steps they buy
    resolved = OmegaConf.to_container(cfg, resolve=True)
    resolved["train"]["max_steps"] = config.train.max_steps  # what the run folder records
    done = finished_before(Path(run_dir), resolved)
    if done is not None:
        return done
    if distributed.role(config.hardware) == "parent":
        return _spawned(config, resolved, Path(run_dir))
    run = build(config, run_dir, resolved)
    status, results = "FAILED", {}
    try:
        run.tracker.write_config(resolved, run.derived)
        restarts = distributed.restarts_so_far(run)  # this start's own, when a failure led to it
        results = {**train(run), "restarts": restarts}
        sample = write_sample(run) if not results["stopped_by"] else None
        if sample is not None:
            log.info(f"--- sample ---\n{sample[:400]}\n--------------")
        record_expectation(run, config.expected, results)
        run.tracker.write_results(results)
        log.info(results_line(results, run.run_dir))
        # a pruned trial ended as its search meant it to: only a stop by a signal is KILLED
        status = "KILLED" if results["stopped_by"] not in (None, layout.PRUNED) else "FINISHED"
        if results["stopped_by"] is None:
            run.close(status)
            status = None  # closed: the finally below has nothing left to end
            log_model(config, run.tracker, run.run_dir, results)
        return results
    except KeyboardInterrupt:  # a second stop signal: ended at once
        status = "KILLED"
        raise
    finally:
        if status is not None:
            run.close(status)
        if (
            status == "KILLED"
            and results.get("stopped_by") == "SIGUSR2"
            and callable(signal.getsignal(signal.SIGUSR2))
        ):
            # our handler is gone again: re-deliver so the job's own (submitit's) requeues it
            os.kill(os.getpid(), signal.SIGUSR2)


def _spawned(config: Any, resolved: Dict[str, Any], run_dir: Path) -> Dict[str, Any]:
    """Start the workers `hardware` asks for, wait, and return rank 0's results.

    A worker that dies: every worker starts again from the latest checkpoint, up to
    train.max_restarts times.
    """
    from gptlab.distributed import world as distributed

    n, budget = config.hardware.nproc_per_node, config.train.max_restarts
    distributed.spawn(_worker, n, (resolved, str(run_dir)), budget, run_dir)
    return json.loads((run_dir / layout.RESULTS).read_text())


def finished_before(run_dir: Path, resolved: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """This run's results when the same command ran it to the end before; None otherwise.

    Then there is nothing to do and nothing changed (a log line says so).
    """
    # torch (runfolder reads checkpoints): off the start-up path of --help and config errors
    from gptlab.records import runfolder

    done = runfolder.finished(run_dir, resolved)
    if done is not None:
        best = done.get("best_val_loss")
        log.info(
            f"{run_dir} holds this run, finished at step {done['steps']} (best val loss "
            f"{'none: not evaluated' if best is None else f'{best:.4f}'}): nothing to do. "
            f"train.max_steps=N "
            f"continues it; "
            "train.resume=never starts it over (the files are moved aside)"
        )
    return done


def results_line(results: Dict[str, Any], run_dir: Path) -> str:
    """The run's last line: its best validation figures, speed, time and folder.

    Where it stopped before any, the line says so in place of the figures.
    """
    best, bpb = results["best_val_loss"], results.get("best_val_bpb")
    if best is None:
        figures = f"stopped at step {results['steps']}, before its first evaluation"
    else:
        figures = f"best val loss {best:.4f}{'' if bpb is None else f' ({bpb:.4f} bpb)'}"
    return (
        f"results: {figures} | {results['tokens_per_s'] or 0:,.0f} tok/s | "
        f"{results['wall_s']:.0f}s | {run_dir}"
    )


def _worker(resolved: Dict[str, Any], run_dir: str) -> None:
    """One locally spawned rank: the same run, with RANK / WORLD_SIZE set by distributed.spawn."""
    # a fresh process: Hydra configured nothing here
    console.setup_logging(Path(run_dir) / layout.LOG)
    console.local_bars()
    try:
        run_training(OmegaConf.create(resolved), Path(run_dir))
    except (GptlabError, OSError) as e:
        # a path or the machine (disk full, permissions) is the user's to fix; other OSErrors: bugs
        message = str(e) if isinstance(e, GptlabError) else os_error_message(e)
        if message is None:
            raise
        # User errors (config, data, divergence) are usually the same on every rank: rank 0 says it,
        # and the launcher stops the others while they wait. A rank that fails alone still speaks.
        rank = os.environ.get("RANK", "0")
        if rank != "0":
            time.sleep(3)
        fail("gptlab.train", message if rank == "0" else f"[rank {rank}] {message}")


INTERRUPTED = 130  # the shell's exit status after Ctrl-C

# Hydra's default launcher, which runs a sweep's jobs one after another in this process
BASIC_LAUNCHER = "hydra._internal.core_plugins.basic_launcher.BasicLauncher"


def train_job(cfg: DictConfig) -> Dict[str, Any]:
    """One Hydra job of `python -m gptlab.train`: its run folder is Hydra's output folder.

    A job stopped by a signal in a sweep whose jobs run in this process ends the sweep: Hydra's
    launcher would start the next job (it goes on after any Exception), so this job leaves with
    SystemExit(0), and no further job starts. A run stopped by Ctrl-C (SIGINT) saved a checkpoint
    but did not finish: it exits 130. An interruption (KeyboardInterrupt: a second signal, or
    Ctrl-C before training) carries the line saying where the next start resumes.
    """
    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir)
    try:
        results = run_training(cfg, run_dir)
    except KeyboardInterrupt:
        raise KeyboardInterrupt(
            console.next_start(run_dir / layout.CHECKPOINTS, cfg.train.resume)
        ) from None
    stopped = results.get("stopped_by") not in (None, layout.PRUNED)
    if stopped and hc.mode == RunMode.MULTIRUN and hc.launcher._target_ == BASIC_LAUNCHER:
        log.info(
            f"{results['stopped_by']}: the sweep stops here; the jobs after this one did not start"
        )
        raise SystemExit(INTERRUPTED if results["stopped_by"] == "SIGINT" else 0)
    if results.get("stopped_by") == "SIGINT":
        # saved, but not finished: `make train && next-step` must not go on (a scheduler's SIGTERM
        # and SIGUSR2 keep exit 0: the requeued job resumes by itself)
        raise SystemExit(INTERRUPTED)
    return results


def main() -> None:
    """python -m gptlab.train [overrides]: a Hydra app on conf/config.yaml.

    It follows cli.command's grammar.
    """
    command("train", train_job, config_name="config")


if __name__ == "__main__":
    main()
