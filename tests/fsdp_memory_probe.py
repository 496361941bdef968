"""Run under torchrun (2 processes, gloo): the measured per-rank peak of one fsdp training step.

Prints one JSON line on rank 0: {"model": bytes, ...} for each model named on the command line
(each one composed with hardware=cpu_x2 parallelism=fsdp). Used by tests/test_plan.py.
"""

import dataclasses
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).parent))
from conftest import compose_config  # noqa: E402

from gptlab import distributed  # noqa: E402
from gptlab.config import to_config  # noqa: E402
from gptlab.model import GPT  # noqa: E402
from gptlab.plan import resolve_micro_batch  # noqa: E402


def local_bytes(t: torch.Tensor) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def measure(overrides):
    cfg = resolve_micro_batch(to_config(compose_config(overrides)))
    d = distributed.setup(cfg.hardware, cfg.parallelism)
    torch.manual_seed(0)
    model = GPT(dataclasses.replace(cfg.model, vocab_size=65))
    model = distributed.wrap_model(model, d, cfg.parallelism, cfg.hardware, compile=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 65, (cfg.micro_batch_size, cfg.model.block_size))

    def step():
        _, loss = model(x, x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # creates the optimizer state
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted((e for e in prof.events() if e.self_cpu_memory_usage), key=lambda e: e.time_range.start)
    current = peak = 0
    for e in events:
        current += e.self_cpu_memory_usage
        peak = max(peak, current)
    static = sum(local_bytes(p) for p in model.parameters())
    static += sum(local_bytes(t) for s in opt.state.values() for t in s.values() if t.dim() > 0)
    return static + peak


if __name__ == "__main__":
    out = {}
    for spec in sys.argv[1:]:
        overrides = spec.split()
        out[spec] = measure([*overrides, "hardware=cpu_x2", "parallelism=fsdp"])
    if dist.get_rank() == 0:
        print(json.dumps(out))
    distributed.teardown()
