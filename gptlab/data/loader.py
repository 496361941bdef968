"""Batches of (input, target) windows drawn from a split's tokens (a flat array or TokenShards).

Both modes make the *global* batch of a step a pure function of a global position, and give each
rank and micro-step its own slice of it. So the same run on 1 process with 4 accumulation steps or
on 2 processes with 2 reads the same tokens, and a checkpointed position means the same thing
whatever the number of ranks that resume from it.

- ``random``: step s draws batch_size windows at offsets seeded by (seed, s). Position = step.
- ``sequential``: epochs over the shards (in a seeded order per epoch), read front to back. A step
  takes the next batch_size * block_size tokens of the epoch's stream (plus one for the last
  target); row r of the global batch starts at position + r * block_size, rank k reads rows
  [k * per_rank, (k + 1) * per_rank). Position = (epoch, tokens into the epoch). The tail of an
  epoch shorter than one global batch is skipped.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

from gptlab.errors import GptlabError

Batch = Tuple[torch.Tensor, torch.Tensor]


def _windows(tokens, starts: np.ndarray, block_size: int) -> Batch:
    rows = np.stack([tokens[s : s + block_size + 1] for s in starts]).astype(np.int64)
    t = torch.from_numpy(rows)
    return t[:, :-1], t[:, 1:]


def window_starts(
    n_tokens: int, block_size: int, count: int, seed: int, step: int, stream: int
) -> np.ndarray:
    """`count` window offsets for (seed, step, stream); stream separates train (0) from eval (1)."""
    rng = np.random.default_rng([seed, stream, step])
    return rng.integers(0, n_tokens - block_size - 1, size=count, endpoint=True)


class _StepLoader:
    """Shared plumbing: rank/micro-batch split, pinned memory, one step prepared ahead."""

    kind = ""

    def __init__(
        self,
        tokens,
        block_size: int,
        batch_size: int,
        micro_batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        pin_memory: bool = False,
        prefetch: Optional[bool] = None,
    ):
        if batch_size % (micro_batch_size * world_size):
            raise ValueError("batch_size must be a multiple of micro_batch_size * world_size")
        self.tokens = tokens
        self.block_size = block_size
        self.batch_size = batch_size
        self.micro_batch_size = micro_batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.accum_steps = batch_size // (micro_batch_size * world_size)
        self.pin_memory = pin_memory
        # Preparing the next step on a thread overlaps memory-map reads with the model's step.
        self._pool = (
            ThreadPoolExecutor(1, thread_name_prefix="gptlab-loader")
            if (pin_memory if prefetch is None else prefetch)
            else None
        )
        self._ahead: Optional[Tuple[Any, Future]] = None

    # subclasses: the position (hashable), the step's batches at a position, the next position
    def _position(self) -> Any: ...

    def _batches_at(self, pos: Any) -> List[Batch]: ...

    def _advance(self, pos: Any) -> Any: ...

    def _set_position(self, pos: Any) -> None: ...

    def _split(self, x: torch.Tensor, y: torch.Tensor) -> List[Batch]:
        mb = self.micro_batch_size
        out = [
            (x[i * mb : (i + 1) * mb], y[i * mb : (i + 1) * mb]) for i in range(self.accum_steps)
        ]
        # page-locked host memory lets .to(cuda, non_blocking=True) overlap compute
        if self.pin_memory:
            out = [(a.contiguous().pin_memory(), b.contiguous().pin_memory()) for a, b in out]
        return out

    def next_step(self) -> List[Batch]:
        """This rank's micro-batches of the current step, then advance to the next step."""
        pos = self._position()
        if self._ahead is not None and self._ahead[0] == pos:
            batches = self._ahead[1].result()
        else:
            batches = self._batches_at(pos)
        nxt = self._advance(pos)
        self._set_position(nxt)
        self._ahead = (nxt, self._pool.submit(self._batches_at, nxt)) if self._pool else None
        return batches


class RandomWindowLoader(_StepLoader):
    """Yields, per optimizer step, this rank's micro-batches of random windows."""

    kind = "random_windows"
    step: int = 0  # the position: the next step's number (set per instance by _set_position)

    def _position(self) -> int:
        return self.step

    def _set_position(self, pos: int) -> None:
        self.step = pos

    def _advance(self, pos: int) -> int:
        return pos + 1

    def _batches_at(self, step: int) -> List[Batch]:
        starts = window_starts(
            len(self.tokens), self.block_size, self.batch_size, self.seed, step, 0
        )
        per_rank = self.micro_batch_size * self.accum_steps
        mine = starts[self.rank * per_rank : (self.rank + 1) * per_rank]
        x, y = _windows(self.tokens, mine, self.block_size)
        return self._split(x, y)

    def state_dict(self) -> Dict[str, Any]:
        return {"kind": self.kind, "step": self.step, "seed": self.seed}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        _check_kind(state, self.kind)
        self.step = int(state["step"])
        self.seed = int(state["seed"])
        self._ahead = None


class SequentialLoader(_StepLoader):
    """Epochs over the shards, front to back.

    Each rank reads its disjoint rows of each global batch.
    """

    kind = "sequential"

    def __init__(self, *args: Any, **kwargs: Any):  # _StepLoader's arguments
        super().__init__(*args, **kwargs)
        self.span = self.batch_size * self.block_size  # tokens a step consumes
        if self.span + 1 > len(self.tokens):
            raise GptlabError(
                f"train.batch_size x model.block_size = {self.span:,} tokens per step is more than "
                f"the {len(self.tokens):,} training tokens; lower them or use more data"
            )
        self.epoch = 0
        self.position = 0  # global tokens into the current epoch's stream
        self._streams: Dict[int, Any] = {}

    def _stream(self, epoch: int):
        """The epoch's token stream: the shards in a seeded order (one memory map: itself)."""
        stream = self._streams.get(epoch)
        if stream is None:
            shards = getattr(self.tokens, "shards", None)
            if shards is None or len(shards) == 1:
                stream = self.tokens
            else:
                stream = self.tokens.reordered(
                    np.random.default_rng([self.seed, 2, epoch]).permutation(len(shards))
                )
            # one epoch kept (replaced whole: the prefetch thread reads it too)
            self._streams = {epoch: stream}
        return stream

    def _position(self) -> Tuple[int, int]:
        return (self.epoch, self.position)

    def _set_position(self, pos: Tuple[int, int]) -> None:
        self.epoch, self.position = pos

    def _normalise(self, pos: Tuple[int, int]) -> Tuple[int, int]:
        epoch, p = pos
        return (epoch + 1, 0) if p + self.span + 1 > len(self.tokens) else (epoch, p)

    def _advance(self, pos: Tuple[int, int]) -> Tuple[int, int]:
        epoch, p = self._normalise(pos)
        return (epoch, p + self.span)

    def _batches_at(self, pos: Tuple[int, int]) -> List[Batch]:
        epoch, p = self._normalise(pos)
        T = self.block_size
        rows = self.micro_batch_size * self.accum_steps
        start = p + self.rank * rows * T
        buf = torch.from_numpy(
            np.asarray(self._stream(epoch)[start : start + rows * T + 1], dtype=np.int64)
        )
        x = buf[:-1].view(rows, T)
        y = buf[1:].view(rows, T)
        return self._split(x, y)

    def state_dict(self) -> Dict[str, Any]:
        # Global tokens, not per-rank counters: any world size / accumulation resumes at one token.
        return {
            "kind": self.kind,
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        _check_kind(state, self.kind)
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self.seed = int(state["seed"])
        self._streams = {}
        self._ahead = None


def _check_kind(state: Dict[str, Any], kind: str) -> None:
    got = state.get("kind", "random_windows")
    if got != kind:
        raise GptlabError(
            f"data.sampling: the checkpoint's loader position is {got!r} but this run samples "
            f"{kind!r}; resume with the same data.sampling or start with train.resume=never"
        )


def eval_batches(
    tokens,
    block_size: int,
    batch_size: int,
    n_batches: int,
    seed: int,
    rank: int = 0,
    world_size: int = 1,
) -> List[Batch]:
    """A fixed set of validation batches (the same at every evaluation), split across ranks."""
    out = []
    for i in range(rank, n_batches, world_size):
        starts = window_starts(len(tokens), block_size, batch_size, seed, i, 1)
        out.append(_windows(tokens, starts, block_size))
    return out


def build_train_loader(
    tokens,
    block_size: int,
    batch_size: int,
    micro_batch_size: int,
    rank: int,
    world_size: int,
    seed: int,
    sampling: str = "random",
    pin_memory: bool = False,
) -> _StepLoader:
    """The training loader for a prepared split.

    Random windows or sequential epochs (data.sampling).
    """
    if sampling == "random":
        cls = RandomWindowLoader
    elif sampling == "sequential":
        cls = SequentialLoader
    else:
        raise GptlabError(f"data.sampling={sampling}: must be random or sequential")
    return cls(tokens, block_size, batch_size, micro_batch_size, rank, world_size, seed, pin_memory)
