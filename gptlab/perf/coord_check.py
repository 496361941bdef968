"""muP's coordinate check (docs/mup.md), run by gptlab.bench with bench.coord_check=true.

python -m gptlab.bench bench.coord_check=true [model.parametrization=mup] [optimizer=...]

The same small model (LAYERS blocks of HEADS heads, the configured flavour: positions, MLP, bias,
tied head) is built at several widths and trained STEPS steps on one fixed batch of random tokens
with the configured optimizer at its lr (constant: no warmup). Forward hooks record, on that batch,
the embedding's output, each block's attention and MLP outputs and the logits, before and after
training; each layer's figure is the rms of (activation after - activation before). Under muP they
stay flat as the width grows; under the standard form they grow (the logits about as the width).

Under muP the base width is the smallest width checked (there, muP and standard coincide), so the
two checks start from the same point. The JSON line goes to stdout and to coord_check.json, the
plot (log-log, change against width, one line per layer) to coord_check.png, in the bench folder.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Dict, Sequence

import torch

from gptlab.model.gpt import GPT, GPTConfig
from gptlab.optim.config import OptimizerConfig
from gptlab.optim.factory import build_optimizer

WIDTHS = (64, 128, 256, 512)
STEPS = 5
LAYERS, HEADS = 2, 4  # every width divides by HEADS: the head size grows with the width
VOCAB, BATCH, SEQ = 256, 4, 64  # random tokens: the check is about widths, not about the data
RESULT, PLOT = "coord_check.json", "coord_check.png"  # in the bench's run folder


def check_config(model: GPTConfig, width: int, base: int) -> GPTConfig:
    """The configured model's flavour at the check's shape and this width."""
    return dataclasses.replace(
        model,
        vocab_size=VOCAB,
        block_size=SEQ,
        n_layer=LAYERS,
        n_head=HEADS,
        n_embd=width,
        ffn_dim=None,
        dropout=0.0,
        init_from=None,
        mup_base_width=base,
    )


def activations(model: GPT, idx: torch.Tensor) -> Dict[str, torch.Tensor]:
    """Each watched layer's output on idx: embedding, h.<i>.attn, h.<i>.mlp, logits."""
    watched = [("embedding", model.drop)]
    for i, block in enumerate(model.h):
        watched += [(f"h.{i}.attn", block.attn), (f"h.{i}.mlp", block.mlp)]
    watched.append(("logits", model.lm_head))
    seen: Dict[str, torch.Tensor] = {}

    def hook(name: str):
        def keep(module, inputs, output):
            # attention returns (output, its k/v): the output is what joins the residual stream
            seen[name] = (output[0] if isinstance(output, tuple) else output).detach().float()

        return keep

    handles = [m.register_forward_hook(hook(name)) for name, m in watched]
    try:
        with torch.no_grad():
            model(idx)
    finally:
        for h in handles:
            h.remove()
    return seen


def change_at_width(
    cfg: GPTConfig, opt: OptimizerConfig, steps: int, batch: torch.Tensor
) -> Dict[str, float]:
    """rms of each layer's activation change after `steps` steps on the batch, from seed 0."""
    torch.manual_seed(0)
    device = batch.device
    model = GPT(cfg).to(device)
    optimizer = build_optimizer(model, opt, opt.lr, device.type)
    x, y = batch[:, :-1], batch[:, 1:]
    before = activations(model, x)
    for _ in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = opt.lr * group.get("lr_mult", 1.0)  # as the loop sets it
        _, loss = model(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    after = activations(model, x)
    return {k: (after[k] - before[k]).pow(2).mean().sqrt().item() for k in before}


def coord_check(
    model: GPTConfig,
    opt: OptimizerConfig,
    widths: Sequence[int] = WIDTHS,
    steps: int = STEPS,
    device: str = "cpu",
) -> Dict[str, Any]:
    """The check's figures.

    {parametrization, optimizer, lr, steps, widths, layers: {name: [rms of the change at each
    width]}}.
    """
    g = torch.Generator(device="cpu").manual_seed(0)
    batch = torch.randint(VOCAB, (BATCH, SEQ + 1), generator=g, device="cpu").to(device)
    per_width = [
        change_at_width(check_config(model, w, widths[0]), opt, steps, batch) for w in widths
    ]
    return {
        "parametrization": model.parametrization,
        "optimizer": opt.name,
        "lr": opt.lr,
        "steps": steps,
        "widths": list(widths),
        "layers": {k: [round(c[k], 6) for c in per_width] for k in per_width[0]},
    }


def plot(result: Dict[str, Any], path: Path) -> None:
    """PNG of each layer's activation change against the width, log-log."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for name, values in result["layers"].items():
        ax.plot(result["widths"], values, marker="o", ms=3, label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("width (n_embd)")
    ax.set_ylabel(f"rms of the activation change after {result['steps']} steps")
    ax.set_title(f"coordinate check: {result['parametrization']}, {result['optimizer']}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.savefig(path)


def growth(result: Dict[str, Any]) -> Dict[str, float]:
    """Each layer's change at the largest width over its change at the smallest."""
    return {k: v[-1] / max(v[0], 1e-12) for k, v in result["layers"].items()}


def run(
    config: Any, folder: Path, widths: Sequence[int] = WIDTHS, steps: int = STEPS
) -> Dict[str, Any]:
    """The check for the benchmark config (BenchConfig): JSON line, coord_check.json and .png."""
    device = "cuda" if config.hardware.device == "cuda" and torch.cuda.is_available() else "cpu"
    result = coord_check(config.model, config.optimizer, widths, steps, device)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / RESULT).write_text(json.dumps(result, indent=1) + "\n")
    plot(result, folder / PLOT)
    print(json.dumps(result), flush=True)
    return result
