"""Sharded checkpoint cost: save and load time and bytes per rank for a model under fsdp.

    torchrun --nproc_per_node=2 benchmarks/sharded_checkpoint.py [model=gpt2_124m] [out=DIR]

Builds the model (vocabulary 50,304) under parallelism=fsdp on gloo CPU processes (or NCCL GPUs with
hardware=...), takes one AdamW step so the optimizer state exists, then times checkpoint.save_state
(every rank writes its shard; rank 0 renames) and TrainingState.restore (every rank reads its
slices), and prints one JSON line from rank 0. Not a test: figures depend on the disk and the
machine.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from hydra import compose, initialize_config_dir

# the checkout's gptlab, installed or not
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gptlab.checkpoint import state as checkpoint  # noqa: E402
from gptlab.config import to_config  # noqa: E402
from gptlab.distributed import world as distributed
from gptlab.model.gpt import GPT  # noqa: E402
from gptlab.optim.factory import build_optimizer  # noqa: E402

CONF = Path(__file__).resolve().parents[1] / "conf"


class _Fixed:
    """Stands in for the scaler and loader (their state is a few bytes)."""

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


def main(argv):
    opts = dict(a.split("=", 1) for a in argv)
    model_name, out = opts.get("model", "gpt2_124m"), opts.get("out")
    hardware = opts.get("hardware", "cpu_x2")
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF)):
        cfg = to_config(
            compose("config", [f"model={model_name}", f"hardware={hardware}", "parallelism=fsdp"])
        )
    d = distributed.setup(cfg.hardware, cfg.parallelism)
    mcfg = dataclasses.replace(cfg.model, vocab_size=50304, block_size=64)
    torch.manual_seed(0)
    model = distributed.wrap_model(
        GPT(mcfg).to(d.device), d, cfg.parallelism, cfg.hardware, compile=False
    )
    opt = build_optimizer(model, cfg.optimizer, 1e-4, d.device.type)
    x = torch.randint(0, 50304, (1, 64), device=d.device)
    model(x, x)[1].backward()
    opt.step()
    objects = {"model": model, "optimizer": opt, "scaler": _Fixed(), "loader": _Fixed()}
    folder = Path(out or tempfile.mkdtemp(prefix="gptlab_ckpt_"))
    folder = Path(distributed.broadcast_object(str(folder)))
    dist.barrier()
    t0 = time.perf_counter()
    state = checkpoint.TrainingState.capture(
        objects, step=1, tokens=64, best_val_loss=float("inf"), config={},
        model_config=dataclasses.asdict(mcfg), tokenizer={}, mlflow_run_id=None,
    )  # fmt: skip
    path = checkpoint.save_state(folder, state, None, keep=1, is_main=d.is_main)
    dist.barrier()
    save_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    checkpoint.TrainingState.load(path).restore(objects)
    dist.barrier()
    load_s = time.perf_counter() - t0
    if d.is_main:
        files = {f.name: f.stat().st_size for f in sorted(path.iterdir())}
        print(json.dumps({
            "model": model_name, "params": sum(p.numel() for p in GPT(mcfg).parameters()),
            "world_size": d.world_size, "save_s": round(save_s, 2), "load_s": round(load_s, 2),
            "files": files, "path": str(path),
        }))  # fmt: skip
    distributed.teardown()


if __name__ == "__main__":
    main(sys.argv[1:])
