"""Run under torchrun (2 processes, gloo): the measured per-rank peak of one fsdp training step.

Prints one JSON line on rank 0: {"model": bytes, ...} for each model named on the command line
(each one composed with hardware=cpu_x2 parallelism=fsdp). Used by tests/test_plan.py.
"""

import json
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from helpers import compose_config  # noqa: E402
from test_plan import measured_peak_bytes  # noqa: E402

from gptlab.config import to_config  # noqa: E402
from gptlab.distributed import world as distributed  # noqa: E402
from gptlab.perf.costs import resolve_auto, resolve_micro_batch  # noqa: E402


def measure(overrides):
    """test_plan's measurement, with the model sharded as a run would shard it."""
    cfg = resolve_micro_batch(resolve_auto(to_config(compose_config(overrides)))[0])
    d = distributed.setup(cfg.hardware, cfg.parallelism)

    def shard(model):
        return distributed.wrap_model(model, d, cfg.parallelism, cfg.hardware, compile=False)

    return measured_peak_bytes(cfg, cfg.parallelism.activation_checkpointing, wrap=shard)


if __name__ == "__main__":
    out = {}
    for spec in sys.argv[1:]:
        overrides = spec.split()
        out[spec] = measure([*overrides, "hardware=cpu_x2", "parallelism=fsdp"])
    if dist.get_rank() == 0:
        print(json.dumps(out))
    distributed.teardown()
