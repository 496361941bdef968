"""gptlab's loop beside the plain loop, on the same model shapes, alternating, N runs each.

    python benchmarks/compare.py [runs=2] [warmup=3] [steps=10] [shapes=baby,default]
    [precisions=fp32,bf16,defaults]

For each shape and precision it runs benchmarks/plain_loop.py and `python -m gptlab.bench` one after
the other, `runs` times, the first of the pair alternating (so drift in the machine's speed hits
both alike), and prints one line per
pair plus a JSON summary: tokens/s of each (the mean over the timed steps, as gptlab.bench reports),
and gptlab's ratio to the plain loop. Shapes: baby = 6 x 384, 6 heads, 256 context, batch 8 (the
shakespeare_char_baby recipe's width, dropout 0); default = gpt_char (4 x 128, 64 context, batch
16). Both sides run AdamW with learned positions (the default job's Muon, rotary and weight average
are not the plain loop's, so gptlab.bench is pinned to what plain_loop.py does).
`precisions=defaults` runs gptlab with its own choices (hardware.precision and hardware.compile
left at auto, for the default job's length) against the plain loop in fp32, the way a plain loop
runs on a CPU; each ratio line also gives the runs' spread (max/min - 1 of each side).
Not a test: speed is measured, never asserted.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"
SHAPES = {
    "baby": {"n_layer": 6, "n_embd": 384, "n_head": 6, "block_size": 256, "batch": 8},
    "default": {"n_layer": 4, "n_embd": 128, "n_head": 4, "block_size": 64, "batch": 16},
}


def last_json(out: str) -> dict:
    return json.loads([ln for ln in out.splitlines() if ln.startswith("{")][-1])


def plain(shape: dict, precision: str, warmup: int, steps: int, data: Path) -> float:
    precision = "fp32" if precision == "defaults" else precision
    args = [f"{k}={v}" for k, v in shape.items()] + [
        f"precision={precision}",
        f"warmup={warmup}",
        f"steps={steps}",
    ]
    cmd = [sys.executable, str(ROOT / "benchmarks" / "plain_loop.py"), *args, f"data={data}"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT).stdout
    return last_json(out)["tokens_per_s_mean"]


def gptlab(shape: dict, precision: str, warmup: int, steps: int, data: Path) -> float:
    s = shape
    args = [
        f"model.n_layer={s['n_layer']}", f"model.n_embd={s['n_embd']}",
        f"model.n_head={s['n_head']}", f"model.block_size={s['block_size']}", "model.dropout=0.0",
        f"train.batch_size={s['batch']}",
        # what plain_loop.py runs
        "optimizer=adamw", "optimizer.ema_decay=0", "model.pos_emb=learned",
        f"train.micro_batch_size={s['batch']}",
        f"bench.warmup={warmup}", f"bench.steps={steps}", f"data.path={data}",
    ]  # fmt: skip
    if precision != "defaults":  # defaults: precision and compile are gptlab's auto choices
        args += [f"hardware.precision={precision}", "hardware.compile=false"]
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "gptlab.bench", *args, f"hydra.run.dir={tmp}/run"]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT).stdout
    return last_json(out)["tokens_per_s"]


def main(argv):
    o = dict(a.split("=", 1) for a in argv)
    runs, warmup, steps = int(o.get("runs", 2)), int(o.get("warmup", 3)), int(o.get("steps", 10))
    data = Path(o.get("data", DATA))
    summary = {}
    for name in o.get("shapes", "baby,default").split(","):
        for precision in o.get("precisions", "fp32,bf16").split(","):
            got = {"plain": [], "gptlab": []}
            for i in range(runs):  # alternating, and which goes first alternates too
                order = ("plain", "gptlab") if i % 2 == 0 else ("gptlab", "plain")
                for loop in order:
                    fn = plain if loop == "plain" else gptlab
                    got[loop].append(fn(SHAPES[name], precision, warmup, steps, data))
            p, g = statistics.mean(got["plain"]), statistics.mean(got["gptlab"])
            spread = {k: round(max(v) / min(v) - 1, 4) for k, v in got.items()}
            summary[f"{name}/{precision}"] = {**got, "ratio": round(g / p, 3), "spread": spread}
            print(
                f"{name:8} {precision}: plain {p:10,.0f} tok/s  gptlab {g:10,.0f} tok/s  "
                f"ratio {g / p:.3f}  (runs: {got['plain']} / {got['gptlab']}; spread "
                f"{100 * spread['plain']:.1f}% / {100 * spread['gptlab']:.1f}%)",
                flush=True,
            )
    print(json.dumps(summary))


if __name__ == "__main__":
    main(sys.argv[1:])
