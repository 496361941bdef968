"""Seconds per example of the in-loop HellaSwag scorer with a trained run's model, on this machine.

    python benchmarks/hellaswag_cost.py outputs/runs/<run> --examples 200

The examples are in HellaSwag's format, built from Tiny Shakespeare's validation text as
tests/test_evaluation_hellaswag.py builds them (the official file needs a download); scored by
gptlab.evaluation.hellaswag.score as the loop does, on the CPU. Divide by the run's step time and
eval.hellaswag.every for the share of training it costs.
"""

import argparse
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from test_evaluation_hellaswag import hellaswag_file  # noqa: E402

from gptlab.evaluation import hellaswag  # noqa: E402
from gptlab.model.inference import load_model  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("run", help="a run folder or checkpoint file")
    p.add_argument("--examples", type=int, default=200)
    p.add_argument("--text", default=str(ROOT.parent / "shared/data/tinyshakespeare.txt"))
    p.add_argument("--out", default="/tmp/hellaswag_cost.jsonl", help="the examples' file")
    args = p.parse_args()
    model, tok, _ = load_model(args.run, "latest", "cpu")
    f = hellaswag_file(Path(args.text), Path(args.out), args.examples)
    cfg = SimpleNamespace(every=250, limit=None, path=str(f), sha256=None, batch_size=16)
    examples = hellaswag.load(cfg, tok, None)
    block, cpu = model.config.block_size, torch.device("cpu")
    hellaswag.score(model, examples[:16], block, cpu)  # warm-up
    t0 = time.perf_counter()
    got = hellaswag.score(model, examples, block, cpu)
    dt = time.perf_counter() - t0
    print(f"{len(examples)} examples in {dt:.2f} s = {dt / len(examples) * 1e3:.1f} ms/example "
          f"({torch.get_num_threads()} threads); {got}")  # fmt: skip


if __name__ == "__main__":
    main()
