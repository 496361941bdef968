"""Peak memory and step time of one training step with the whole logits and with the chunked loss.

    python benchmarks/chunked_loss.py [model=gpt2_124m] [batch=4] [vocab=50304] [chunk=1024]
                                      [device=cpu|cuda] [precision=fp32|bf16] [steps=2]

Random tokens of a GPT-2-sized vocabulary (no tokenizer or download needed), gptlab's GPT at the
model preset's shape, AdamW. For each of loss_chunk=0 (the whole (tokens, vocab) logits) and
loss_chunk=chunk it runs a warm-up step, then measures one step's peak: the CUDA allocator's maximum
on a GPU, the CPU allocator's peak from torch.profiler's memory events on the CPU (above the memory
held before the step). Prints one JSON line with both, their ratio, the median step time, and the
planner's total estimate for each. Not a test: figures depend on the machine.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

# the checkout's gptlab, installed or not
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gptlab.config import to_config  # noqa: E402
from gptlab.model.gpt import GPT  # noqa: E402
from gptlab.perf.costs import make_plan  # noqa: E402
from gptlab.perf.measure import cpu_peak_bytes  # noqa: E402

CONF = Path(__file__).resolve().parents[1] / "conf"


def peak_of(step, device: torch.device) -> int:
    """Peak bytes allocated during step() above what was held before it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        step()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    return cpu_peak_bytes(step)


def measure(
    cfg, vocab: int, chunk: int, batch: int, device: torch.device, precision: str, steps: int
) -> dict:
    torch.manual_seed(0)
    model = GPT(dataclasses.replace(cfg.model, vocab_size=vocab)).to(device)
    model.loss_chunk = chunk
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    x = torch.randint(0, vocab, (batch, cfg.model.block_size), device=device)
    dtype = {"bf16": torch.bfloat16, "fp32": None}[precision]

    def step():
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            _, loss = model(x, x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # the optimizer state exists from here on
    peak = peak_of(step, device)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return {"peak_step_bytes": peak, "step_ms": round(1e3 * statistics.median(times), 1)}


def main(argv):
    o = dict(a.split("=", 1) for a in argv)
    model, batch, vocab = (
        o.get("model", "gpt2_124m"),
        int(o.get("batch", 4)),
        int(o.get("vocab", 50304)),
    )
    chunk, precision = int(o.get("chunk", 1024)), o.get("precision", "fp32")
    device = torch.device(o.get("device", "cpu"))
    hardware = "cpu" if device.type == "cpu" else "h200"
    overrides = [f"model={model}", f"hardware={hardware}", f"hardware.precision={precision}",
                 f"train.batch_size={batch}", f"train.micro_batch_size={batch}"]  # fmt: skip
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF)):
        cfg = {
            c: to_config(compose("config", [*overrides, f"parallelism.loss_chunk={c}"]))
            for c in (0, chunk)
        }
    out = {"model": model, "batch": batch, "block_size": cfg[0].model.block_size, "vocab": vocab,
           "chunk": chunk, "device": str(device), "precision": precision}  # fmt: skip
    from gptlab.perf import costs

    costs.vocab_for = lambda c: (vocab, False)  # the planner sees the same vocabulary
    for name, c in (("whole", 0), ("chunked", chunk)):
        out[name] = measure(cfg[c], vocab, c, batch, device, precision, int(o.get("steps", 2)))
        out[name]["plan_total_bytes"] = int(make_plan(cfg[c]).memory["total"])
    out["peak_ratio"] = round(
        out["chunked"]["peak_step_bytes"] / out["whole"]["peak_step_bytes"], 3
    )
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1:])
