"""The mixture's training loader: each step's global batch drawn from the sources by weight.

A step's global batch of B rows is a pure function of the seed, the step and each source's position,
as the single-source loaders' (loader.py), so 1 and N ranks read the same rows and a checkpoint
resumes at the same token on any number of ranks:

- ``step_counts``: source i gets floor(B w_i) rows plus, by systematic sampling seeded by (seed,
  step), one more with probability equal to the remainder; so every step's counts sum to B and,
  over many steps, each source's share converges to its weight with an error below one row.
- ``row_sources``: the rows interleaved (source i's j-th row at (j + 0.5) / c_i of the batch), so
  every rank's and every micro-batch's slice holds the sources in proportion too.
- Each source reads its rows as its own data.sampling says: ``random`` windows seeded by (seed,
  step, source), or ``sequential`` through epochs of its shards; each source's position is (epoch,
  tokens into it) whatever its sampling, so a source that runs out starts a new epoch, counted.

Source 0 draws exactly what a single-source loader draws (the same seeds), so a one-source mixture
is that run.
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

import numpy as np
import torch

from gptlab.data.loader import Batch, _check_kind, _StepLoader
from gptlab.errors import GptlabError

Position = Tuple[int, Tuple[Tuple[int, int], ...]]  # (step, (epoch, tokens into it) per source)


def step_counts(weights: np.ndarray, batch_size: int, seed: int, step: int) -> np.ndarray:
    """Rows per source in step's global batch: floor(B w) plus a seeded systematic rounding."""
    exact = weights * batch_size
    base = np.floor(exact)
    cum = np.concatenate([[0.0], np.cumsum(exact - base)])
    u = np.random.default_rng([seed, 3, step]).random()
    extra = np.diff(np.floor(cum + u))
    counts = (base + extra).astype(np.int64)
    # float rounding may leave the total one off: the largest source absorbs it
    counts[int(np.argmax(weights))] += batch_size - int(counts.sum())
    return counts


def row_sources(counts: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """(source, index within that source's rows) of each row of the global batch, interleaved."""
    src = np.repeat(np.arange(len(counts)), counts)
    idx = np.concatenate([np.arange(c) for c in counts]) if len(counts) else np.zeros(0, np.int64)
    key = (idx + 0.5) / np.maximum(counts[src], 1)
    order = np.lexsort((src, key))
    return src[order], idx[order]


class MixtureLoader(_StepLoader):
    """Yields, per optimizer step, this rank's micro-batches of a weighted mixture of sources."""

    kind = "mixture"

    def __init__(
        self,
        tokens: Sequence[Any],
        names: Sequence[str],
        weights: Sequence[float],
        samplings: Sequence[str],
        *args: Any,
        **kwargs: Any,
    ):  # then _StepLoader's arguments after `tokens`
        super().__init__(list(tokens), *args, **kwargs)
        self.names, self.samplings = list(names), list(samplings)
        self.weights = np.asarray(weights, dtype=np.float64)
        self.weights = self.weights / self.weights.sum()
        for name, toks, mode, w in zip(self.names, self.tokens, self.samplings, self.weights):
            if w == 0:
                continue  # never read
            need = (self.batch_size if mode == "sequential" else 1) * self.block_size + 2
            if len(toks) < need:
                raise GptlabError(
                    f"data.sources.{name}: {len(toks):,} training tokens, fewer than the "
                    f"{need:,} one step may read from it; use more text or a smaller batch"
                )
        self.step = 0
        self.positions: Tuple[Tuple[int, int], ...] = tuple((0, 0) for _ in self.names)
        self._streams: Dict[Tuple[int, int], Any] = {}

    def _position(self) -> Position:
        return (self.step, self.positions)

    def _set_position(self, pos: Position) -> None:
        self.step, self.positions = pos

    def _normalise(self, i: int, pos: Tuple[int, int], rows: int) -> Tuple[int, int]:
        """(epoch, offset) where source i's `rows` rows start: a new epoch when they do not fit."""
        epoch, p = pos
        if p + rows * self.block_size + 1 > len(self.tokens[i]):
            return (epoch + 1, 0)
        return (epoch, p)

    def _advance(self, pos: Position) -> Position:
        step, positions = pos
        counts = step_counts(self.weights, self.batch_size, self.seed, step)
        moved = []
        for i, (c, at) in enumerate(zip(counts, positions)):
            epoch, p = self._normalise(i, at, int(c))
            moved.append((epoch, p + int(c) * self.block_size))
        return (step + 1, tuple(moved))

    def _stream(self, i: int, epoch: int) -> Any:
        """Source i's epoch: its shards in a seeded order (source 0: a single-source run's)."""
        key = (i, epoch)
        if key not in self._streams:
            toks = self.tokens[i]
            shards = getattr(toks, "shards", None)
            if shards is not None and len(shards) > 1:
                seeds = [self.seed, 2, epoch] + ([i] if i else [])
                toks = toks.reordered(np.random.default_rng(seeds).permutation(len(shards)))
            # a new dict, replaced whole: the prefetch thread reads it too
            kept = {k: v for k, v in self._streams.items() if k[0] != i}
            self._streams = {**kept, key: toks}
        return self._streams[key]

    def _starts(self, i: int, rows: int, step: int, at: Tuple[int, int]) -> Tuple[Any, np.ndarray]:
        """(token array, start of each of source i's rows this step)."""
        epoch, p = self._normalise(i, at, rows)
        if self.samplings[i] == "sequential":
            return self._stream(i, epoch), p + np.arange(rows) * self.block_size
        toks = self.tokens[i]
        rng = np.random.default_rng([self.seed, 0, step] + ([i] if i else []))
        return toks, rng.integers(0, len(toks) - self.block_size - 1, size=rows, endpoint=True)

    def _batches_at(self, pos: Position) -> List[Batch]:
        step, positions = pos
        counts = step_counts(self.weights, self.batch_size, self.seed, step)
        src, idx = row_sources(counts)
        per_rank = self.micro_batch_size * self.accum_steps
        mine = slice(self.rank * per_rank, (self.rank + 1) * per_rank)
        starts = {
            int(i): self._starts(int(i), int(counts[i]), step, positions[i])
            for i in np.unique(src[mine])
        }
        rows = []
        for i, j in zip(src[mine].tolist(), idx[mine].tolist()):
            toks, at = starts[i]
            rows.append(toks[int(at[j]) : int(at[j]) + self.block_size + 1])
        t = torch.from_numpy(np.stack(rows).astype(np.int64))
        return self._split(t[:, :-1], t[:, 1:])

    def epochs(self) -> Dict[str, float]:
        """How many times each source has been read so far (epochs, fractions included)."""
        return {
            n: e + p / len(toks) for n, (e, p), toks in zip(self.names, self.positions, self.tokens)
        }

    def state_dict(self) -> Dict[str, Any]:
        # per source by name: weights may change and sources come or go between runs
        sources = {n: list(at) for n, at in zip(self.names, self.positions)}
        return {"kind": self.kind, "step": self.step, "seed": self.seed, "sources": sources}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        _check_kind(state, self.kind)
        self.step = int(state["step"])
        self.seed = int(state["seed"])
        saved = state.get("sources", {})
        self.positions = tuple(tuple(int(v) for v in saved.get(n, (0, 0))) for n in self.names)  # type: ignore[assignment]
        self._streams = {}
        self._ahead = None
