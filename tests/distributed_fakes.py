"""Stand-ins shared by the tests of gptlab/distributed/: launcher variables cleared, presets,
recorded calls, a fake CUDA."""

from __future__ import annotations

import dataclasses
import functools

import torch
from helpers import typed

from gptlab.perf import fastpath

LAUNCH_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "SUBMITIT_EXECUTOR",
    "SLURM_PROCID",
    "SLURM_STEP_NUM_TASKS",
    "SLURM_LOCALID",
    "SLURM_JOB_ID",
    "SLURM_STEP_NODELIST",
    "SLURM_JOB_NODELIST",
    "CUDA_VISIBLE_DEVICES",
)


@functools.lru_cache(maxsize=None)
def _section(section: str, *overrides: str):
    return typed(section, *overrides)


def hw(preset: str = "cpu", **changes):
    """A hardware preset with precision=auto decided as for the tests' narrow models."""
    section = _section("hardware", f"hardware={preset}")
    decided = fastpath.choose_precision(section.precision, section.device, 64).value
    return dataclasses.replace(section, **{"precision": decided, **changes})


def par(preset: str = "single", **changes):
    return dataclasses.replace(_section("parallelism", f"parallelism={preset}"), **changes)


def recorder(result=None):
    calls = []

    def record(*args, **kwargs):
        calls.append((args, kwargs) if kwargs else args)
        return result

    record.calls = calls
    return record


def fake_cuda(monkeypatch, count: int):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
