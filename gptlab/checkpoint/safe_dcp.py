"""Reading torch.distributed.checkpoint (DCP) folders without running code from them.

Stock DCP (torch 2.13) unpickles a checkpoint's ``.metadata`` with plain ``pickle.load`` and its
non-tensor entries (the optimizer's lr, betas, ...) with ``torch.load(weights_only=False)``: a
crafted checkpoint would run code on load. Here ``.metadata`` goes through an unpickler that admits
only DCP's own metadata classes, sizes, dtypes, layouts and paths, and every non-tensor entry
through ``torch.load(weights_only=True)``; tensors were read that way already. The same guarantee as
checkpoint.load's for a single-file checkpoint. An entry that does not read back (random bytes from
a bad disk block, a crafted pickle) is named (``UnreadableEntry``), told apart from a live object
that the entries do not fit. A torch-only leaf: checkpoint.py uses it.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import re
import warnings
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType

METADATA = ".metadata"

# DCP's metadata classes (Metadata, *StorageMetadata, TensorProperties, MetadataIndex, ...)
_ALLOWED_MODULES = {"torch.distributed.checkpoint.metadata"}
_ALLOWED = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    # torch.strided is pickled as _get_layout("torch.strided")
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module in _ALLOWED_MODULES or (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(
            f"it refers to {module}.{name}, which a checkpoint's metadata never needs"
        )


def read_metadata(folder: Path) -> Metadata:
    """The folder's DCP metadata, unpickled through the allow-list (UnpicklingError otherwise)."""
    with open(Path(folder) / METADATA, "rb") as f:
        metadata = _MetadataUnpickler(f).load()
    if not isinstance(metadata, Metadata):
        raise pickle.UnpicklingError("it is not DCP metadata")
    return metadata


def missing_data(folder: Path, metadata: Metadata) -> List[str]:
    """Shard files the metadata points into that are absent or shorter than it says (a cut copy)."""
    need: Dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    short = []
    for name, size in sorted(need.items()):
        path = Path(folder) / name
        if not path.is_file() or os.path.getsize(path) < size:
            short.append(name)
    return short


# torch.load's advice around its refusal (load with weights_only=False, file an issue, the docs)
_TORCH_ADVICE = re.compile(
    r"weights_only|Weights only load failed|file an issue|trusted source|documentation of torch"
)


def would_run(e: BaseException) -> Optional[str]:
    """The callable a crafted pickle names, from torch.load(weights_only=True)'s refusal.

    None: not that.
    """
    blocked = re.search(r"GLOBAL ([\w.]+)", str(e))
    return blocked.group(1) if blocked else None


def load_error(e: BaseException) -> str:
    """Why torch.load(weights_only=True) refused something, in a few words.

    Never with torch's advice to load it unsafely: the code a crafted pickle would run, the OS's
    error, else "corrupt" and torch's first own sentence (or the unpickler's, which may be as terse
    as "pop from empty list").
    """
    text, blocked = str(e), would_run(e)
    if blocked:
        return f"unsafe: loading it would run {blocked}"
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    kept = [
        s for s in re.split(r"(?<=\.)\s+|\n", text) if s.strip() and not _TORCH_ADVICE.search(s)
    ]
    detail = (
        kept[0].strip().rstrip(".")
        if kept
        else ("cut short" if isinstance(e, EOFError) else type(e).__name__)
    )
    return f"corrupt: {detail}"


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """No warnings while entries load: a foreign pickle's protocol notice would be a second line."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _safe_load(data: io.BytesIO) -> Any:
    with _quiet():
        return torch.load(data, map_location="cpu", weights_only=True)


class UnreadableEntry(Exception):
    """An entry of a DCP folder that does not read back as its metadata says (damaged or crafted).

    Picklable from its args: DCP gathers every rank's failure to every rank."""

    def __init__(self, entry: str, file: str, cause: str):
        super().__init__(entry, file, cause)
        self.entry, self.file, self.cause = entry, file, cause

    def __str__(self) -> str:
        return f"unreadable entry {self.entry} in {self.file} ({self.cause})"


class SafeReader(FileSystemReader):
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_metadata(Path(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: Any, planner: Any) -> Any:
        try:
            with _quiet():
                return super().read_data(plan, planner)
        except Exception:
            # only after a failure, each entry again until the culprit: a good read costs nothing
            bad = self._first_unreadable(plan.items, getattr(planner, "metadata", None))
            if bad is None:
                raise  # every entry reads back whole: the live objects do not fit them
            raise bad from None

    def _first_unreadable(
        self, items: List[Any], metadata: Optional[Metadata]
    ) -> Optional[UnreadableEntry]:
        for item in items:
            info = self.storage_data[item.storage_index]
            try:
                with open(Path(self.path) / info.relative_path, "rb") as f:
                    f.seek(info.offset)
                    raw = io.BytesIO(f.read(info.length))
                stream = self.transforms.transform_load_stream(
                    item, info.transform_descriptors or (), raw
                )
                why = _mismatch(_safe_load(io.BytesIO(stream.read(-1))), item, metadata)
            except Exception as e:  # noqa: BLE001 - whatever fails to read back names the entry
                why = load_error(e)
            if why:
                return UnreadableEntry(item.storage_index.fqn, info.relative_path, why)
        return None


def _mismatch(value: Any, item: Any, metadata: Optional[Metadata]) -> Optional[str]:
    """How a tensor entry that loaded differs from what its own metadata says it holds.

    None: it agrees.
    """
    if item.type == LoadItemType.BYTE_IO:
        return None
    if not isinstance(value, torch.Tensor):
        return f"a {type(value).__name__} where a tensor was saved"
    md = metadata.state_dict_metadata.get(item.storage_index.fqn) if metadata else None
    if not isinstance(md, TensorStorageMetadata):
        return None
    chunk = next(
        (c for c in md.chunks if tuple(c.offsets) == tuple(item.storage_index.offset)), None
    )
    saved, dtype = (
        tuple(chunk.sizes) if chunk is not None else tuple(value.shape),
        md.properties.dtype,
    )
    if tuple(value.shape) != saved or value.dtype != dtype:
        return (
            f"a {value.dtype} tensor of shape {tuple(value.shape)} where a {dtype} one of shape "
            f"{saved} was saved"
        )
    return None


class _SafeBytes:
    """load_bytes through torch.load(weights_only=True) instead of DCP's weights_only=False."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        obj = _safe_load(value)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


class SafeLoadPlanner(_SafeBytes, DefaultLoadPlanner):
    """Loads into the given state dict's tensors (in place, resharding to their layout)."""


class _SafeWholePlanner(_SafeBytes, _EmptyStateDictLoadPlanner):
    """Builds whole (unsharded) tensors from the metadata alone: no model needed."""


@contextlib.contextmanager
def _failures() -> Iterator[None]:
    """Raise DCP's own failure (CheckpointException) as UnreadableEntry or a RuntimeError.

    The failure is a BaseException carrying each rank's traceback, and every rank gets every rank's:
    an entry some rank could not read becomes UnreadableEntry (the lowest rank's) on every rank;
    anything else a RuntimeError with the first line of each distinct cause (a key the checkpoint
    lacks, a shape that differs).
    """
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as e:
        # each failure is (exception, stack) per rank
        failures = [f[0] if isinstance(f, tuple) else f for _, f in sorted(e.failures.items())]
        unreadable = [f for f in failures if isinstance(f, UnreadableEntry)]
        if unreadable:
            raise unreadable[0] from None
        causes = {str(f).strip().splitlines()[0] for f in failures}
        raise RuntimeError("; ".join(sorted(causes))) from None


def load_into(state_dict: Dict[str, Any], folder: Path) -> None:
    """DCP load into state_dict's tensors, in their layout (sharded or whole), safely.

    Its failures are as _failures says.
    """
    import torch.distributed.checkpoint as dcp

    with _failures():
        dcp.load(state_dict, storage_reader=SafeReader(str(folder)), planner=SafeLoadPlanner())


def load_whole(folder: Path, keys: List[str]) -> Dict[str, Any]:
    """The top-level entries `keys` of a DCP folder as whole tensors, in this one process."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: Dict[str, Any] = {}
    with _failures(), _quiet():  # quiet: DCP's notice that it loads in one process is no news here
        _load_state_dict(
            state,
            storage_reader=SafeReader(str(folder)),
            planner=_SafeWholePlanner(keys=set(keys)),
            no_dist=True,
        )
    return state
