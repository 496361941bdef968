"""Requests per second of gptlab.eval's scorer on this machine, for a model config's shape.

    python benchmarks/eval_throughput.py model=gpt_char
    python benchmarks/eval_throughput.py model=gpt2_124m --requests 64

Synthetic HellaSwag-sized requests (a 64-token context and a 24-token continuation, random ids)
scored by gptlab.evaluation.scoring.score_pairs as lm_eval's loglikelihood calls it (batch 8, no
padding buckets), fp32 on the CPU; random weights, since speed does not depend on them.
"""

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers import typed  # noqa: E402

from gptlab.evaluation.scoring import score_pairs  # noqa: E402
from gptlab.model.gpt import GPT  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model", help="model=NAME (a conf/model preset)")
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--vocab", type=int, default=None, help="default: 65, or 50257 for gpt2_*")
    args = p.parse_args()
    name = args.model.split("=", 1)[-1]
    vocab = args.vocab or (50257 if name.startswith("gpt2") else 65)
    cfg = typed("model", f"model={name}", vocab_size=vocab)
    model = GPT(cfg).eval()
    g = torch.Generator().manual_seed(0)
    pairs = [
        (torch.randint(0, vocab, (64,), generator=g).tolist(),
         torch.randint(0, vocab, (24,), generator=g).tolist())
        for _ in range(args.requests)
    ]  # fmt: skip
    score_pairs(model, pairs[: args.batch_size], cfg.block_size, torch.device("cpu"),
                args.batch_size, bucket=0)  # fmt: skip
    t0 = time.perf_counter()
    score_pairs(model, pairs, cfg.block_size, torch.device("cpu"), args.batch_size, bucket=0)
    dt = time.perf_counter() - t0
    print(f"{name}: {args.requests / dt:,.1f} requests/s ({args.requests} requests, "
          f"batch {args.batch_size}, {torch.get_num_threads()} threads)")  # fmt: skip


if __name__ == "__main__":
    main()
