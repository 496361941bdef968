"""The mixture loader's throughput against one source's (tokens/s of training batches, CPU only).

    .venv/bin/python benchmarks/mixture_loader.py [--steps 300] [--batch 64] [--block 256]

Three in-memory sources (random windows, one of them sequential) against one random-window
source of the same size; prints one JSON line. The loader is what is measured: no model runs.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from gptlab.data.loader import RandomWindowLoader
from gptlab.data.mixture_loader import MixtureLoader


def rate(loader, steps: int, tokens_per_step: int) -> float:
    loader.next_step()  # the first step outside the timing
    t0 = time.perf_counter()
    for _ in range(steps):
        loader.next_step()
    return steps * tokens_per_step / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--block", type=int, default=256)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    toks = [rng.integers(0, 50000, 4_000_000).astype(np.uint16) for _ in range(3)]
    args = (a.block, a.batch, a.batch // 4, 0, 1, 1337)
    one = rate(RandomWindowLoader(toks[0], *args), a.steps, a.batch * a.block)
    mixed = MixtureLoader(
        toks, ["a", "b", "c"], [0.5, 0.3, 0.2], ["random", "random", "sequential"], *args
    )
    three = rate(mixed, a.steps, a.batch * a.block)
    print(json.dumps({"one_source_tok_s": round(one), "three_sources_tok_s": round(three)}))


if __name__ == "__main__":
    main()
