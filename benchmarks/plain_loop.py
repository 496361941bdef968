"""The simplest training loop a user could write around gptlab's model: the speed baseline.

    python benchmarks/plain_loop.py [n_layer=6 n_embd=384 n_head=6 block_size=256 batch=8]
                                    [precision=fp32|bf16] [compile=0|1] [warmup=3 steps=10]
                                    [data=PATH]

gptlab's own GPT (gptlab/model/gpt.py) and nothing else of gptlab: the text is read and encoded by
characters here, batches are random windows drawn with torch.randint, and each step is forward,
backward, gradient clipping at 1.0 and AdamW (the default foreach implementation, weight decay on
matrices as gptlab does). Prints one JSON line with the median step time and tokens/s over the
timed steps. benchmarks/compare.py runs it beside `python -m gptlab.bench` on the same shapes.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

# the checkout's gptlab, installed or not
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gptlab.model.gpt import GPT, GPTConfig  # noqa: E402

SHAKESPEARE = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare.txt"


def main(argv):
    o = dict(a.split("=", 1) for a in argv)
    n_layer, n_embd, n_head = (
        int(o.get("n_layer", 6)),
        int(o.get("n_embd", 384)),
        int(o.get("n_head", 6)),
    )
    T, B = int(o.get("block_size", 256)), int(o.get("batch", 8))
    warmup, steps = int(o.get("warmup", 3)), int(o.get("steps", 10))
    precision, compile_ = o.get("precision", "fp32"), o.get("compile", "0") == "1"
    text = Path(o.get("data", SHAKESPEARE)).read_text()
    chars = sorted(set(text))
    data = torch.from_numpy(np.array([chars.index(c) for c in text[:200_000]], dtype=np.int64))

    torch.manual_seed(1337)
    cfg = GPTConfig(
        name="plain", vocab_size=len(chars), vocab_multiple=1, block_size=T, n_layer=n_layer,
        n_head=n_head, n_embd=n_embd, ffn_dim=None, dropout=0.0, bias=True, pos_emb="learned",
        mlp="gelu", tie_weights=True, rope_base=10000.0,
    )  # fmt: skip
    model = GPT(cfg)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=1e-3
    )
    step_fn = torch.compile(model) if compile_ else model
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")

    times = []
    for step in range(warmup + steps):
        t0 = time.perf_counter()
        ix = torch.randint(len(data) - T - 1, (B,))
        x = torch.stack([data[i : i + T] for i in ix])
        y = torch.stack([data[i + 1 : i + 1 + T] for i in ix])
        with autocast:
            _, loss = step_fn(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_value = loss.item()
        if step >= warmup:
            times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    result = {"loop": "plain", "tokens_per_s_mean": round(B * T * len(times) / sum(times), 1)}
    result.update(
        n_layer=n_layer, n_embd=n_embd, block_size=T, batch=B, precision=precision, compile=compile_
    )
    result.update(threads=torch.get_num_threads(), step_ms=round(step_s * 1e3, 2))
    result.update(tokens_per_s=round(B * T / step_s, 1), last_loss=round(loss_value, 4))
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
