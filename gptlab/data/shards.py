"""Token shards: flat memory-mappable arrays with a JSON sidecar each.

``<split>/shard_00000.bin`` holds raw little-endian uint16 (vocabulary <= 65,536) or uint32 ids;
``shard_00000.json`` records the format version, dtype, vocabulary size, token count, tokenizer
hash and the shard's own SHA-256. A shard is written to ``.partial`` and renamed, so a file with
the final name is always complete.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Dict, List, Sequence, Union

import numpy as np

from gptlab.errors import GptlabError

FORMAT_VERSION = 2


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def shard_name(i: int) -> str:
    return f"shard_{i:05d}"


def shard_plan(n_tokens: int, divisor: int, max_tokens: int) -> tuple:
    """(number of shards, tokens per shard): equal shards, their number a multiple of divisor.

    The last n_tokens - n * per tokens (fewer than n) are dropped so that every shard is equal.
    """
    groups = max(1, -(-n_tokens // (divisor * max_tokens)))
    n = divisor * groups
    return n, n_tokens // n


class ShardWriter:
    """Fills `n` shards of `per_shard` tokens in order from a stream of arrays; drops the rest."""

    def __init__(
        self, folder: Path, n: int, per_shard: int, dtype: np.dtype, header: Dict[str, Any]
    ):
        self.folder, self.n, self.per, self.dtype, self.header = folder, n, per_shard, dtype, header
        folder.mkdir(parents=True, exist_ok=True)
        self.index, self.filled, self.f, self.h = 0, 0, None, None
        self.dropped = 0

    def _open(self) -> None:
        # open until the shard is full (or the writer closes): one handle per shard
        self.f = open(self.folder / f"{shard_name(self.index)}.bin.partial", "wb")  # noqa: SIM115
        self.h = hashlib.sha256()
        self.filled = 0

    def _close(self) -> None:
        assert self.f is not None and self.h is not None
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        name = shard_name(self.index)
        side = {
            **self.header,
            "index": self.index,
            "tokens": self.per,
            "dtype": self.dtype.name,
            "sha256": self.h.hexdigest(),
        }
        _write_json(self.folder / f"{name}.json", side)
        os.replace(self.folder / f"{name}.bin.partial", self.folder / f"{name}.bin")
        self.f, self.h = None, None
        self.index += 1

    def write(self, arr: np.ndarray) -> None:
        arr = np.ascontiguousarray(arr, dtype=self.dtype)
        while len(arr):
            if self.index >= self.n:
                self.dropped += len(arr)
                return
            if self.f is None:
                self._open()
            take = min(len(arr), self.per - self.filled)
            data = arr[:take].tobytes()
            self.f.write(data)
            self.h.update(data)
            self.filled += take
            arr = arr[take:]
            if self.filled == self.per:
                self._close()

    def finish(self) -> None:
        if self.index != self.n:
            raise RuntimeError(f"shard writer got too few tokens ({self.index} of {self.n} shards)")


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".partial")
    tmp.write_text(json.dumps(obj, indent=1, sort_keys=True))
    os.replace(tmp, path)


class TokenShards:
    """A split's shards read as one flat, read-only token array (``len``, slices, ``dtype``).

    A slice may span shard boundaries; nothing is read until it is sliced (the shards are memory
    maps).
    """

    def __init__(self, shards: Sequence[np.ndarray]):
        self.shards = list(shards)
        self.dtype = self.shards[0].dtype if self.shards else np.dtype(np.uint16)
        self.offsets = np.cumsum([0] + [len(s) for s in self.shards])

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def reordered(self, order: Sequence[int]) -> "TokenShards":
        return TokenShards([self.shards[i] for i in order])

    def __getitem__(self, key: Union[slice, int]) -> Union[np.ndarray, int]:
        if isinstance(key, (int, np.integer)):
            i = int(key) + len(self) if key < 0 else int(key)
            s = int(np.searchsorted(self.offsets, i, side="right")) - 1
            return self.shards[s][i - self.offsets[s]]
        start, stop, step = key.indices(len(self))
        if step != 1:
            raise IndexError("TokenShards slices must be contiguous")
        if stop <= start:
            return np.zeros(0, dtype=self.dtype)
        s = int(np.searchsorted(self.offsets, start, side="right")) - 1
        e = int(np.searchsorted(self.offsets, stop - 1, side="right")) - 1
        if s == e:
            o = self.offsets[s]
            return self.shards[s][start - o : stop - o]
        parts = [self.shards[s][start - self.offsets[s] :]]
        parts += [self.shards[k][:] for k in range(s + 1, e)]
        parts.append(self.shards[e][: stop - self.offsets[e]])
        return np.concatenate(parts)

    def __array__(self, dtype=None, copy=None):
        out = self[0 : len(self)]
        return np.asarray(out, dtype=dtype)


def open_shards(folder: Path, expect: Dict[str, Any]) -> List[np.ndarray]:
    """Memory-map a split's shards, refusing any whose sidecar disagrees with the dataset's meta."""
    sides = sorted(folder.glob("shard_*.json"))
    if not sides:
        raise GptlabError(f"{folder}: no token shards; delete {folder.parent} to prepare it again")
    out = []
    for side in sides:
        meta = json.loads(side.read_text())
        for key in ("format_version", "tokenizer_sha256", "vocab_size", "dtype"):
            if meta.get(key) != expect[key]:
                raise GptlabError(
                    f"{side}: {key} is {meta.get(key)!r} but the dataset expects {expect[key]!r} "
                    f"(made by a "
                    f"different tokenizer or gptlab version); delete {folder.parent} to prepare "
                    f"it again"
                )
        if not isinstance(meta.get("sha256"), str) or not meta["sha256"]:
            raise GptlabError(
                f"{side}: no sha256 of its shard (the side file is damaged); delete "
                f"{folder.parent} to prepare it again"
            )
        path = side.with_suffix(".bin")
        dtype = np.dtype(meta["dtype"])
        if not path.is_file() or path.stat().st_size != meta["tokens"] * dtype.itemsize:
            raise GptlabError(
                f"{path}: missing or not {meta['tokens']} tokens long; delete {folder.parent} to "
                f"prepare it again"
            )
        out.append(np.memmap(path, dtype=dtype, mode="r"))
    return out
