"""Batches of (input, target) windows drawn from a flat token array.

Random-window sampling: the global batch of step s is a pure function of (seed, s), and each rank
and micro-step takes its own slice of it. So the same run on 1 process with 4 accumulation steps or
on 2 processes with 2 computes the same global batch, and resuming only needs the step number.
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import numpy as np
import torch

Batch = Tuple[torch.Tensor, torch.Tensor]


def _windows(tokens: np.ndarray, starts: np.ndarray, block_size: int) -> Batch:
    rows = np.stack([tokens[s : s + block_size + 1] for s in starts]).astype(np.int64)
    t = torch.from_numpy(rows)
    return t[:, :-1], t[:, 1:]


def window_starts(n_tokens: int, block_size: int, count: int, seed: int, step: int, stream: int) -> np.ndarray:
    """`count` window offsets for (seed, step, stream); stream separates train (0) from eval (1)."""
    rng = np.random.default_rng([seed, stream, step])
    return rng.integers(0, n_tokens - block_size - 1, size=count, endpoint=True)


class RandomWindowLoader:
    """Yields, per optimizer step, this rank's micro-batches of random windows."""

    def __init__(self, tokens: np.ndarray, block_size: int, batch_size: int, micro_batch_size: int,
                 rank: int = 0, world_size: int = 1, seed: int = 0):
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
        self.step = 0

    def next_step(self) -> List[Batch]:
        """This rank's micro-batches of the current step, then advance to the next step."""
        starts = window_starts(len(self.tokens), self.block_size, self.batch_size, self.seed, self.step, 0)
        per_rank = self.micro_batch_size * self.accum_steps
        mine = starts[self.rank * per_rank : (self.rank + 1) * per_rank]
        self.step += 1
        return [
            _windows(self.tokens, mine[i * self.micro_batch_size : (i + 1) * self.micro_batch_size],
                     self.block_size)
            for i in range(self.accum_steps)
        ]

    def state_dict(self) -> Dict[str, Any]:
        return {"kind": "random_windows", "step": self.step, "seed": self.seed}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.seed = int(state["seed"])


def eval_batches(tokens: np.ndarray, block_size: int, batch_size: int, n_batches: int, seed: int,
                 rank: int = 0, world_size: int = 1) -> List[Batch]:
    """A fixed set of validation batches (the same at every evaluation), split across ranks."""
    out = []
    for i in range(rank, n_batches, world_size):
        starts = window_starts(len(tokens), block_size, batch_size, seed, i, 1)
        out.append(_windows(tokens, starts, block_size))
    return out


def build_train_loader(tokens: np.ndarray, block_size: int, batch_size: int, micro_batch_size: int,
                       rank: int, world_size: int, seed: int) -> RandomWindowLoader:
    """The training loader for a prepared split (random windows)."""
    return RandomWindowLoader(tokens, block_size, batch_size, micro_batch_size, rank, world_size, seed)
