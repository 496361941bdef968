"""DCP reading without code execution.

Stock torch 2.13 (torch/distributed/checkpoint):
  * filesystem.FileSystemReader.read_metadata: plain ``pickle.load`` of ``.metadata`` (protocol 4+, FRAME
    opcodes: torch's own weights_only unpickler refuses it with "Unsupported operand 149").
  * default_planner.DefaultLoadPlanner.load_bytes: ``torch.load(value, weights_only=False)`` for every
    non-tensor entry (e.g. the optimizer's param_groups: lr, betas, eps, ...).
  * tensor entries: ``torch.load(..., weights_only=True)`` already.
Here: ``.metadata`` goes through a pickle.Unpickler whose find_class only admits an allow-list, and bytes
entries through torch.load(weights_only=True).
"""

from __future__ import annotations

import io
import pickle

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

_ALLOWED_MODULES = {
    "torch.distributed.checkpoint.metadata"
}  # Metadata, *StorageMetadata, TensorProperties, MetadataIndex, StorageMeta, _MEM_FORMAT_ENCODING
_ALLOWED = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # torch.strided etc. are pickled as _get_layout("torch.strided")
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if module in _ALLOWED_MODULES or (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"DCP metadata refers to {module}.{name}, which is not allowed")


def safe_read_metadata(path) -> Metadata:
    with open(path, "rb") as f:
        md = _MetadataUnpickler(f).load()
    if not isinstance(md, Metadata):
        raise pickle.UnpicklingError(f"{path} is not DCP metadata")
    return md


class SafeFileSystemReader(FileSystemReader):
    def read_metadata(self, *args, **kwargs) -> Metadata:
        metadata = safe_read_metadata(self._get_metadata_path(kwargs.get("rank")))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj
