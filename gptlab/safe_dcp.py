"""Reading torch.distributed.checkpoint (DCP) folders without running code from them.

Stock DCP (torch 2.13) unpickles a checkpoint's ``.metadata`` with plain ``pickle.load`` and its
non-tensor entries (the optimizer's lr, betas, ...) with ``torch.load(weights_only=False)``: a
crafted checkpoint would run code on load. Here ``.metadata`` goes through an unpickler that admits
only DCP's own metadata classes, sizes, dtypes, layouts and paths, and every non-tensor entry through
``torch.load(weights_only=True)``; tensors were read that way already. The same guarantee as
checkpoint.load's for a single-file checkpoint. A torch-only leaf: checkpoint.py uses it.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any, Dict, List

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

METADATA = ".metadata"

# DCP's metadata classes (Metadata, *StorageMetadata, TensorProperties, MetadataIndex, StorageMeta, ...)
_ALLOWED_MODULES = {"torch.distributed.checkpoint.metadata"}
_ALLOWED = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # torch.strided is pickled as _get_layout("torch.strided")
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
        raise pickle.UnpicklingError(f"it refers to {module}.{name}, which a checkpoint's metadata never needs")


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


class SafeReader(FileSystemReader):
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_metadata(Path(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _SafeBytes:
    """load_bytes through torch.load(weights_only=True) instead of DCP's weights_only=False."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


class SafeLoadPlanner(_SafeBytes, DefaultLoadPlanner):
    """Loads into the given state dict's tensors (in place, resharding to their layout)."""


class _SafeWholePlanner(_SafeBytes, _EmptyStateDictLoadPlanner):
    """Builds whole (unsharded) tensors from the metadata alone: no model needed."""


def load_into(state_dict: Dict[str, Any], folder: Path) -> None:
    """DCP load into state_dict's tensors, in their layout (sharded or whole), safely.

    DCP's own failure (CheckpointException) is a BaseException carrying each rank's traceback; it
    becomes a RuntimeError with the first line of each distinct cause (a key the checkpoint lacks,
    a shape that differs)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.load(state_dict, storage_reader=SafeReader(str(folder)), planner=SafeLoadPlanner())
    except CheckpointException as e:
        # each failure is (exception, stack) per rank
        causes = {str(f[0] if isinstance(f, tuple) else f).strip().splitlines()[0] for f in e.failures.values()}
        raise RuntimeError("; ".join(sorted(causes))) from None


def load_whole(folder: Path, keys: List[str]) -> Dict[str, Any]:
    """The top-level entries `keys` of a DCP folder as whole tensors, in this one process."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: Dict[str, Any] = {}
    _load_state_dict(state, storage_reader=SafeReader(str(folder)), planner=_SafeWholePlanner(keys=set(keys)),
                     no_dist=True)  # fmt: skip
    return state
