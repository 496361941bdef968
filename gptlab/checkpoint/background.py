"""Checkpoints saved in the background (train.checkpoint_async): at most one save in flight.

``Saver.save`` returns once the state is copied out of the live objects: to CPU memory here for a
whole ``.pt`` file, staged to CPU memory by torch.distributed.checkpoint.async_save for a sharded
one, so the next steps may change the live tensors. A thread then writes it as a synchronous save
would (a temporary name, fsync, the rename; the digests of state.py), and only then remembers the
best and prunes. The next save and the end of training wait for it, and a failure of the writer is
raised there as one line, never lost. A process killed mid-save leaves what a killed synchronous
save leaves: a temporary file or a ``.partial`` folder, and the previous checkpoint as the newest.

Without train.checkpoint_async, ``Saver.save`` is checkpoint.save_state. Either way it keeps each
save's stall (the seconds the caller was blocked) for results.json's ``checkpoint_stall_s``.
"""

from __future__ import annotations

import copy
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch

from gptlab.checkpoint import state as checkpoint
from gptlab.errors import as_user_error


def cpu_copy(obj: Any, memo: Optional[Dict[int, torch.Tensor]] = None) -> Any:
    """A deep copy of a state with every tensor copied to CPU memory.

    A tensor held twice, such as a tied weight, stays one tensor held twice, as torch.save would
    write it.
    """
    memo = {} if memo is None else memo
    if isinstance(obj, torch.Tensor):
        if id(obj) not in memo:
            memo[id(obj)] = obj.detach().to("cpu", copy=True)
        return memo[id(obj)]
    if isinstance(obj, dict):
        out = obj.copy()  # keeps an OrderedDict an OrderedDict
        for key, value in out.items():
            out[key] = cpu_copy(value, memo)
        return out
    if type(obj) in (list, tuple):
        return type(obj)(cpu_copy(value, memo) for value in obj)
    return copy.deepcopy(obj)


class Saver:
    """A run's checkpoint saves: in the caller's thread, or one at a time in a background one."""

    def __init__(self) -> None:
        self.stalls: List[float] = []  # seconds the loop was blocked by each save of this session
        self._pool: Optional[ThreadPoolExecutor] = None
        self._future: Optional[Future] = None
        self._path: Optional[Path] = None
        # async_save's own gloo group: its collectives run in a thread, beside the training's
        self._group: Any = None

    def mean_stall(self) -> Optional[float]:
        return sum(self.stalls) / len(self.stalls) if self.stalls else None

    def wait(self) -> None:
        """Until the save in flight (if any) is written; its failure is raised here, one line."""
        future, path = self._future, self._path
        self._future = None
        if future is None:
            return
        with as_user_error(lambda e: f"checkpoint {path} was not saved (in the background: {e})"):
            future.result()

    def close(self) -> None:
        """Wait for the save in flight and let the writer thread go (the end of training)."""
        try:
            self.wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None

    def save(
        self,
        folder: Path,
        state: checkpoint.TrainingState,
        val_loss: Optional[float],
        keep: int,
        is_main: bool,
        background: bool = False,
    ) -> Path:
        """checkpoint.save_state, or (background) the same save started in the writer thread.

        In the background, the save starts once the previous one is written. Every rank calls it.
        """
        self.wait()
        if not background:
            return checkpoint.save_state(folder, state, val_loss, keep, is_main)
        path = checkpoint.checkpoint_path(folder, state.step, sharded=state.sharded)
        if state.sharded:
            write = self._sharded(path, state, is_main)
        elif is_main:
            write = self._whole(path, state)
        else:
            return path  # a whole checkpoint is rank 0's to write
        best_val = state.best_val_loss

        def job() -> None:
            write()
            if is_main:
                checkpoint.saved(folder, path, val_loss, best_val, keep)

        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gptlab-checkpoint")
        self._future, self._path = self._pool.submit(job), path
        return path

    @staticmethod
    def _whole(path: Path, state: checkpoint.TrainingState) -> Callable[[], Any]:
        contents = cpu_copy(state.contents())
        return lambda: checkpoint.save(path, contents)

    def _sharded(
        self, path: Path, state: checkpoint.TrainingState, is_main: bool
    ) -> Callable[[], None]:
        import torch.distributed.checkpoint as dcp

        tmp = checkpoint.begin_sharded(path, is_main)
        rest = cpu_copy(state.contents(*checkpoint.SHARDED_PARTS)) if is_main else None
        # staged (copied to CPU memory) before it returns; the files are written in its thread
        upload = dcp.async_save(
            {"model": state.model, "optimizer": state.optimizer},
            storage_writer=dcp.FileSystemWriter(str(tmp)),
            process_group=self._gloo(),
        )
        # newer torch may answer an AsyncSaveResponse: its staging and its upload, two futures
        staging = getattr(upload, "staging_completion", None)
        if staging is not None:
            staging.result()
        done = getattr(upload, "upload_completion", upload)

        def write() -> None:
            done.result()  # every rank's shards and the metadata are written
            if is_main:
                checkpoint.finish_sharded(tmp, path, rest)

        return write

    def _gloo(self) -> Any:
        """A gloo group for async_save (every rank creates it at the first sharded save).

        async_save needs a CPU backend, and its collectives must not interleave with the training's
        own.
        """
        import torch.distributed as dist

        if not dist.is_initialized():
            return None
        if self._group is None:
            self._group = dist.new_group(backend="gloo")
        return self._group
