"""train.profile: chosen steps recorded with torch.profiler, and what an out-of-memory step held.

Records chosen steps of a run with torch.profiler, and what a CUDA step that runs out of memory
held.

``train.profile.steps=[A,B]`` records steps A..B (inclusive) with CPU (and CUDA) activities,
shapes and memory, and writes into ``<run folder>/profile/``:
- ``trace_rank<r>.json``: the Chrome/Perfetto trace (ui.perfetto.dev, chrome://tracing), each step
  a ``step N`` range;
- ``operators_rank<r>.txt``: the operators ranked by their own time;
- on CUDA, ``memory_rank<r>.pickle``: the allocator's history over those steps
  (pytorch.org/memory_viz).
Rank 0's files go to MLflow under ``profile/``. With ``train.profile.oom_snapshot=true`` (CUDA) the
allocator's history is recorded from the first step, and a step that runs out of memory writes
``memory_oom_rank<r>.pickle`` before the run fails.

While it records, ``StderrFilter`` keeps the profiler's own chatter out of the run's stderr (the
lines of ``NOISE``); every other line, a genuine error included, goes through as written.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import re
import sys
import threading
from pathlib import Path
from typing import Any, List, Optional, Sequence

import torch

# the section and its check live in the schema (gptlab/config.py), free of torch
from gptlab.config import ProfileConfig
from gptlab.config import check_profile as check  # noqa: F401

log = logging.getLogger(__name__)

FOLDER = "profile"
MEMORY_ENTRIES = 200_000  # allocator events kept (the newest): a few steps of a large model

# What torch's C++ side prints on stderr while a profile records, none of it a problem:
# - kineto's USDT probe markers as the trace starts and stops ("USDT:<time> <pid>:<tid>
#   SyncActivityProfilerHandler.cpp:52] profiler_start"), logged at a severity above kineto's
#   errors, so no KINETO_LOG_LEVEL hides them and keeps the errors;
# - c10's note, with profile_memory (the operators' memory columns), that a block allocated before
#   the profile began was freed inside it (c10's LOG(WARNING): only TORCH_CPP_LOG_LEVEL, read once
#   at import, silences it, and every other C++ warning with it).
NOISE = (
    re.compile(rb"^USDT:.*\] profiler_(start|stop)$"),
    re.compile(
        rb"^\[W.*CPUAllocator\.cpp:\d+\] Memory block of unknown size was allocated before "
        rb"the profiling started"
    ),
)
# how a held-back line may begin: a write that starts like one waits for the rest of its line
NOISE_STARTS = (b"USDT:", b"[W")
PIPE_BYTES = 1 << 20  # the pipe's buffer: a burst of stderr is never waiting on the filter


class StepProfiler:
    """Records train.profile.steps of the loop.

    The loop calls begin(step) before a step and end(step) after it. Does nothing (one comparison a
    step) when profiling is off.
    """

    def __init__(
        self,
        cfg: Optional[ProfileConfig],
        run_dir: Path,
        device: torch.device,
        rank: int,
        tracker: Any,
        is_main: bool,
    ):
        self.first, self.last = cfg.steps if cfg is not None and cfg.steps else (0, -1)
        self.rows = cfg.rows if cfg is not None else 0
        self.folder = Path(run_dir) / FOLDER
        self.device, self.rank, self.tracker, self.is_main = device, rank, tracker, is_main
        self.cuda = device.type == "cuda"
        self.oom_history = bool(cfg and cfg.oom_snapshot and self.cuda)
        self._prof: Optional[torch.profiler.profile] = None
        self._range: Optional[Any] = None
        self._history = False
        self._quiet = StderrFilter()  # the profiler's chatter kept out of stderr while it records
        if self.oom_history:
            self._record_history(True)

    def begin(self, step: int) -> None:
        if step == self.first:
            self._start()
        if self._prof is not None:
            self._range = torch.profiler.record_function(f"step {step}")
            self._range.__enter__()

    def end(self, step: int) -> None:
        if self._prof is None:
            return
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None
        self._prof.step()
        if step >= self.last:
            self._finish()

    def out_of_memory(self) -> Optional[Path]:
        """A step ran out of CUDA memory: the allocator's history, when it was recorded."""
        if not (self.cuda and self._history):
            return None
        path = self.folder / f"memory_oom_rank{self.rank}.pickle"
        self.folder.mkdir(parents=True, exist_ok=True)
        torch.cuda.memory._dump_snapshot(str(path))
        self._log(path)
        return path

    def close(self) -> None:
        """The run ended (or failed) inside the recorded steps: what was recorded is written."""
        if self._prof is not None:
            self._finish()
        if self._history:
            self._record_history(False)

    # --- inside
    def _start(self) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._record_history(True)
        self._prof = torch.profiler.profile(
            activities=activities, record_shapes=True, profile_memory=True
        )
        self._quiet.start()
        self._prof.start()
        log.info(f"profiling steps {self.first}..{self.last} into {self.folder}")

    def _finish(self) -> None:
        prof, self._prof = self._prof, None
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None
        try:
            prof.stop()
        finally:
            self._quiet.stop()
        self.folder.mkdir(parents=True, exist_ok=True)
        trace = self.folder / f"trace_rank{self.rank}.json"
        prof.export_chrome_trace(str(trace))
        table = self.folder / f"operators_rank{self.rank}.txt"
        sort = "self_cuda_time_total" if self.cuda else "self_cpu_time_total"
        table.write_text(
            prof.key_averages(group_by_input_shape=True).table(sort_by=sort, row_limit=self.rows)
            + "\n"
        )
        written = [trace, table]
        if self.cuda and self._history:
            memory = self.folder / f"memory_rank{self.rank}.pickle"
            torch.cuda.memory._dump_snapshot(str(memory))
            written.append(memory)
            if not self.oom_history:
                self._record_history(False)
        for path in written:
            self._log(path)
        log.info(f"profile of steps {self.first}..{self.last}: {trace} (ui.perfetto.dev), {table}")

    def _record_history(self, on: bool) -> None:
        torch.cuda.memory._record_memory_history("all" if on else None, max_entries=MEMORY_ENTRIES)
        self._history = on

    def _log(self, path: Path) -> None:
        if self.is_main and self.tracker is not None:
            self.tracker.log_artifact(path, FOLDER)


class StderrFilter:
    """While on, file descriptor 2 is a pipe whose lines go on to the real stderr unless noise.

    File descriptor 2 (C++'s std::cerr and Python's sys.stderr alike) is a pipe read by a thread
    that writes each line on to the real stderr unless it matches one of noise.
    """

    def __init__(self, noise: Sequence["re.Pattern[bytes]"] = NOISE):
        self.noise = noise
        self._saved: Optional[int] = None
        self._thread: Optional[threading.Thread] = None

    def start(self) -> None:
        if self._saved is not None:
            return
        try:
            sys.stderr.flush()
            saved = os.dup(2)
            read, write = os.pipe()
        except (OSError, ValueError, AttributeError):  # no stderr to filter
            return
        try:
            import fcntl

            fcntl.fcntl(write, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        except (ImportError, AttributeError, OSError):  # not Linux, or over the system's limit
            pass
        out = os.dup(saved)  # the thread's own: it writes until the last writer is gone
        os.dup2(write, 2)
        os.close(write)
        self._saved = saved
        if faulthandler.is_enabled():  # a crash's traceback straight to the real stderr
            faulthandler.enable(file=saved, all_threads=True)
        self._thread = threading.Thread(
            target=self._pump, args=(read, out), name="stderr-filter", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        """fd 2 back to the real stderr, after what was written so far has gone through."""
        if self._saved is None:
            return
        with contextlib.suppress(OSError, ValueError, AttributeError):
            sys.stderr.flush()
        os.dup2(self._saved, 2)  # closes the pipe's last writer here: the thread reads to its end
        if faulthandler.is_enabled():
            faulthandler.enable(file=2, all_threads=True)
        os.close(self._saved)
        self._saved = None
        if self._thread is not None:
            # a child started meanwhile may hold the pipe still: the thread forwards it till it ends
            self._thread.join(timeout=5)
            self._thread = None

    def _pump(self, read: int, out: int) -> None:
        held = b""
        try:
            while True:
                chunk = os.read(read, 65536)
                if not chunk:
                    break
                lines = (held + chunk).splitlines(keepends=True)
                last = lines[-1]
                complete = last.endswith((b"\n", b"\r"))
                held = b"" if complete or not self._may_be_noise(last) else lines.pop()
                self._write(out, lines)
            self._write(out, [held] if held else [])
        finally:
            os.close(read)
            os.close(out)

    def _may_be_noise(self, start: bytes) -> bool:
        return any(start.startswith(p) or p.startswith(start) for p in NOISE_STARTS)

    def _write(self, out: int, lines: List[bytes]) -> None:
        kept = b"".join(ln for ln in lines if not any(p.search(ln.rstrip()) for p in self.noise))
        while kept:
            kept = kept[os.write(out, kept) :]
