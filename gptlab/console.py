"""What gptlab says, and how: Python logging on rank 0, and the training loop's Reporter.

Every module logs through ``logging.getLogger(__name__)`` (children of the ``gptlab`` logger).
``setup_logging`` gives that logger one console handler: INFO lines as they are written (on stdout),
warnings and errors prefixed with ``gptlab:`` (on stderr), and, for a run, a file handler on the
run folder's log. Under Hydra the same handlers come from conf/hydra/job_logging/gptlab.yaml (the
run folder's ``<command>.log`` holds the run's lines). Third-party loggers stay at WARNING, so their
INFO chatter (matplotlib's font cache, alembic's migrations) stays out of the console.

Command output proper (a JSON line, a table) is printed, not logged: it is the command's result.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

LOGGER = "gptlab"
FILE_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] %(message)s"


class ConsoleHandler(logging.Handler):
    """INFO and below on stdout as written; warnings and errors on stderr as `gptlab: ...`.

    The stream is looked up at every line, so a test's captured stdout (or a swapped sys.stdout)
    gets the line, not the stream that was current when the handler was made.
    """

    # a command whose stdout is its result (bench's JSON line) sends its INFO lines to stderr
    info_stream_is_stderr = False

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = self.format(record)
            if record.levelno >= logging.WARNING:
                who = "gptlab" if record.name.split(".")[0] == LOGGER else record.name
                stream, text = sys.stderr, f"{who}: {text}"
            else:
                stream = sys.stderr if ConsoleHandler.info_stream_is_stderr else sys.stdout
            stream.write(text + "\n")
            stream.flush()
        except (OSError, ValueError, TypeError):  # a closed or broken stream, a bad format
            self.handleError(record)


def setup_logging(log_file: Optional[Path] = None) -> logging.Logger:
    """Give the gptlab logger its console (and optionally a file) handler, once per process.

    A process whose gptlab logger already has handlers (Hydra's job logging, an earlier call) keeps
    them; a process that nothing configured (a spawned worker, a test) gets gptlab's console.
    """
    log = logging.getLogger(LOGGER)
    if not log.handlers:
        log.addHandler(ConsoleHandler())
        log.propagate = False
        if log_file is not None:
            Path(log_file).parent.mkdir(parents=True, exist_ok=True)
            file = logging.FileHandler(log_file)
            file.setFormatter(logging.Formatter(FILE_FORMAT))
            log.addHandler(file)
    if log.level == logging.NOTSET:
        log.setLevel(logging.INFO)
    return log


def for_rank(rank: int) -> None:
    """Rank 0 speaks; the other ranks only warn (their lines would repeat rank 0's)."""
    logging.getLogger(LOGGER).setLevel(logging.INFO if rank == 0 else logging.WARNING)


class quiet:
    """Only warnings from gptlab while the block runs.

    gptlab.bench uses it: its JSON line is its output.
    """

    def __enter__(self) -> None:
        self.log = logging.getLogger(LOGGER)
        self.level = self.log.level
        self.log.setLevel(logging.WARNING)

    def __exit__(self, *exc: Any) -> None:
        self.log.setLevel(self.level)


def next_start(folder: Path, resume: str) -> str:
    """Where the next start of a stopped run continues, and the command that continues it.

    folder: the run's checkpoints folder. A run folder is named by the time it was made, so the
    command names it (hydra.run.dir, or hydra.sweep.dir for a job of a sweep: Hydra's multirun.yaml
    is in the sweep's folder, and the sweep run again continues each job in its own folder).
    """
    from gptlab.checkpoint.state import latest, step_of
    from gptlab.records import layout

    found = latest(Path(folder))
    where = (
        f"resumes from {found} (step {step_of(found)})"
        if found
        else "begins at step 0 (no checkpoint yet)"
    )
    run_dir = Path(folder).parent
    if (run_dir.parent / layout.MULTIRUN).is_file():
        how = f"run the sweep again with hydra.sweep.dir={run_dir.parent}"
    else:
        how = f"run the same command with hydra.run.dir={run_dir}"
    return f"the next start {where}: {how}{'' if resume == 'auto' else ' train.resume=auto'}"


def local_bars() -> None:
    """Progress bars in this process take a thread lock, not tqdm's default multiprocessing one.

    In a spawned worker (whose multiprocessing start method is spawn) tqdm's default lock is a named
    semaphore registered with the launcher's resource tracker; the worker leaves with os._exit
    (distributed._exit_now), which never unregisters it, and the tracker then warns of a "leaked
    semaphore" when the launcher exits. gptlab's bars are drawn by one process.
    """
    import threading

    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())


class Reporter:
    """The training loop's voice and stopwatch: progress lines, the ETA, the stop message, timing.

    Progress lines are a live bar on a terminal; the timing windows between logging steps are what
    gptlab.bench reads.

    Everything here runs on rank 0's words only; other ranks' reporters time but never speak.
    """

    def __init__(self, enabled: bool, max_steps: int):
        self.enabled = enabled
        self.max_steps = max_steps
        self.log = logging.getLogger(__name__)
        self.bar = None
        self.train_time = 0.0  # seconds inside timing windows: training, not eval or checkpoints
        self.timings: List[Tuple[int, float, int]] = []  # (step, seconds, tokens) per window
        self._t0, self._tokens, self._start = time.perf_counter(), 0, 0

    def begin(self, step: int, summary: str) -> None:
        self._start = step
        if self.enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(
                total=self.max_steps, initial=step, unit="step", dynamic_ncols=True, file=sys.stderr
            )
        self.say(summary)
        self.open_window()

    def open_window(self) -> None:
        """Start timing training again (after logging, evaluation or a checkpoint)."""
        self._t0, self._tokens = time.perf_counter(), 0

    def trained(self, tokens: int) -> None:
        self._tokens += tokens

    def close_window(self, step: int) -> Tuple[float, float]:
        """End the timing window at a logging step: (seconds, tokens/s).

        The caller syncs the device.
        """
        seconds = time.perf_counter() - self._t0
        self.train_time += seconds
        self.timings.append((step, seconds, self._tokens))
        return seconds, (self._tokens / seconds if seconds > 0 else 0.0)

    def tick(self, step: int) -> None:
        if self.bar is not None:
            self.bar.n = step
            self.bar.refresh()

    def progress(self, step: int, figures: Dict[str, Any], best_val: float) -> None:
        """One line per logging step (or the bar's figures on a terminal).

        figures: train_loss (the latest), lr, tokens_per_s, mfu, val_loss on an evaluation step,
        and hellaswag_acc(_norm) on a step that scores HellaSwag.
        """
        if not self.enabled:
            return
        eta = (self.max_steps - step) * self.train_time / max(1, step - self._start)
        loss, lr, tok_s, mfu = (
            figures["train_loss"],
            figures["lr"],
            figures["tokens_per_s"],
            figures["mfu"],
        )
        if self.bar is not None:
            self.bar.n = step
            figures = {"loss": f"{loss:.4f}", "best_val": f"{best_val:.4f}", "lr": f"{lr:.1e}"}
            figures.update(
                {"tok/s": f"{tok_s:,.0f}", "mfu": f"{100 * mfu:.1f}%", "eta": f"{eta:,.0f}s"}
            )
            self.bar.set_postfix(figures, refresh=False)
            self.bar.refresh()
            return
        val = ""
        if figures.get("val_loss") is not None:
            val = f" | val {figures['val_loss']:.4f}"
            if figures.get("val_bpb") is not None:
                val += f" ({figures['val_bpb']:.4f} bpb)"
        if figures.get("hellaswag_acc") is not None:
            val += (
                f" | hellaswag {figures['hellaswag_acc']:.4f} "
                f"(norm {figures['hellaswag_acc_norm']:.4f})"
            )
        self.log.info(
            f"step {step}/{self.max_steps} | loss {loss:.4f}{val} | lr {lr:.2e} | {tok_s:,.0f} "
            f"tok/s "
            f"| mfu {100 * mfu:.1f}% | eta {eta:,.0f}s"
        )

    def stopped(self, signal_name: str, step: int, folder: Path, resume: str) -> None:
        """folder: the run's checkpoints; resume: its train.resume (only auto continues a run)."""
        self.say(f"{signal_name} received: stopped at step {step}; {next_start(folder, resume)}")

    def say(self, line: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(line)  # above the live bar (a terminal shows no log lines under it)
        else:
            self.log.info(line)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
