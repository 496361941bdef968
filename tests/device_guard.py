"""A CPU stand-in for the GPU's "tensors on two devices" errors.

On a GPU, an operation whose tensor arguments live on two devices fails (``torch.cat`` of a CPU
count and CUDA sums: "Expected all tensors to be on the same device"). On the CPU everything is on
one device, so the suite cannot see the mistake. ``DeviceGuard`` fails any such operation while the
model and its batches sit on a second device, ``meta``: a tensor made without naming its device
lands on the CPU and is caught the first time it meets the model's.

Values the host reads from a meta tensor (``.item()``, ``.tolist()``, a copy to the CPU) have no
data: the guard answers them with ones, so the code runs on to its end. Figures computed that way
mean nothing; only the placement is checked.
"""

from __future__ import annotations

from typing import Any, List, Set

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

aten = torch.ops.aten

# moving data between devices is what these are for
TRANSFERS = {
    aten._to_copy.default,
    aten.copy_.default,
    aten._copy_from.default,
    aten._copy_from_and_resize.default,
    aten.lift_fresh.default,
    aten.lift_fresh_copy.default,
}


class DeviceMix(AssertionError):
    """An operation was given tensors on two devices."""


class DeviceGuard(TorchDispatchMode):
    """Raise DeviceMix on any non-transfer operation whose tensors span two devices; let the host
    read meta tensors as ones. ``ops`` lists every operation seen (to prove the code ran)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: List[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops.append(str(func))
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        devices: Set[str] = {t.device.type for t in tensors}
        if len(devices) > 1 and func not in TRANSFERS:
            shapes = ", ".join(f"{t.device.type}{tuple(t.shape)}" for t in tensors)
            raise DeviceMix(f"{func} mixes devices: {shapes}")
        if func is aten._local_scalar_dense.default and args[0].is_meta:
            return _one(args[0].dtype)
        if func is aten._to_copy.default and args[0].is_meta:
            target = kwargs.get("device")
            if target is not None and torch.device(target).type == "cpu":
                dtype = kwargs.get("dtype") or args[0].dtype
                return torch.ones(args[0].shape, dtype=dtype, device="cpu")
        return func(*args, **kwargs)


def _one(dtype: torch.dtype) -> Any:
    if dtype == torch.bool:
        return True
    return 1.0 if dtype.is_floating_point else 1
