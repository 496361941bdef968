"""Who am I, and how the model is wrapped.

One function, ``setup``, decides what this process is (a plain process or a torchrun-style worker
with RANK / WORLD_SIZE in its environment), picks the device and backend, and starts the process
group with a timeout so that a dead rank ends the job instead of hanging it. ``wrap_model`` applies
activation checkpointing, then torch.compile, then DDP, in that order (DDP must see the compiled
module so its gradient hooks fire on the compiled graph's parameters).
"""

from __future__ import annotations

import datetime
import os
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn


@dataclass
class HardwareConfig:
    name: str = "cpu"
    device: str = "cpu"  # cpu | cuda
    nproc_per_node: int = 1
    nodes: int = 1
    precision: str = "fp32"  # fp32 | bf16 | fp16 (fp16 uses a dynamic GradScaler)
    micro_batch_size: Optional[int] = None  # per-process sequences per forward; null: as large as the batch allows
    peak_tflops: Optional[float] = None  # per device, for MFU; null: measure the CPU's matmul rate
    tf32: bool = False  # TF32 tensor-core matmuls on Ampere and newer
    compile: bool = False  # torch.compile by default on this hardware
    attention_backend: str = "auto"  # auto | flash | efficient | math
    threads: Optional[int] = None  # CPU threads per process; null: torch's default


@dataclass
class ParallelismConfig:
    name: str = "single"
    strategy: str = "single"  # single | ddp
    activation_checkpointing: bool = False
    compile: Optional[bool] = None  # null: the hardware's default
    timeout_s: int = 600  # a collective waiting longer than this ends the job


@dataclass
class Dist:
    """This process's place in the job."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def setup(hw: HardwareConfig, par: ParallelismConfig) -> Dist:
    """Decide who this process is, pick its device, and join the process group if there is one."""
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    expected = hw.nproc_per_node * hw.nodes
    if world != expected:
        from gptlab.errors import GptlabError

        raise GptlabError(
            f"hardware={hw.name} asks for {expected} process(es) but this job has {world}: start it with "
            f"`torchrun --nproc_per_node={hw.nproc_per_node} -m gptlab.train hardware={hw.name} ...`"
        )
    if hw.threads:
        torch.set_num_threads(hw.threads)
    if hw.device == "cuda":
        if not torch.cuda.is_available():
            from gptlab.errors import GptlabError

            raise GptlabError(f"hardware={hw.name} needs CUDA, but no GPU is visible; use hardware=cpu")
        n_visible = torch.cuda.device_count()
        device = torch.device("cuda", local_rank % n_visible)
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = hw.tf32
        torch.backends.cudnn.allow_tf32 = hw.tf32
    else:
        device = torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(
            backend="nccl" if device.type == "cuda" else "gloo",
            timeout=datetime.timedelta(seconds=par.timeout_s),
            device_id=device if device.type == "cuda" else None,
        )
    return Dist(rank=rank, local_rank=local_rank, world_size=world, device=device)


def teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def wrap_model(model: nn.Module, d: Dist, checkpointing: bool, compile: bool) -> nn.Module:
    """checkpointing -> compile -> DDP, in that fixed order."""
    if checkpointing:
        model.activation_checkpointing = True
    if compile:
        model = torch.compile(model)
    if d.world_size > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model, device_ids=[d.device.index] if d.device.type == "cuda" else None)
    return model


def no_sync(model: nn.Module, sync: bool):
    """Skip DDP's gradient all-reduce on accumulation micro-steps: only the last one syncs."""
    if sync or not hasattr(model, "no_sync"):
        return nullcontext()
    return model.no_sync()


def all_reduce_mean(t: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        t /= dist.get_world_size()
    return t


def attention_context(backend: str):
    """Restrict SDPA to one kernel family when the hardware preset asks for it."""
    if backend == "auto":
        return nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kind = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "math": SDPBackend.MATH}[backend]
    return sdpa_kernel(kind)
