"""Attention maps: every layer's and head's attention weights over a prompt, and their heatmaps.

The model's own attention goes through the fused ``F.scaled_dot_product_attention``, which never
forms the weights. Here each layer's input is taken from the real blocks (a forward pre-hook on each
block, so embeddings and positions are exactly the model's), and the weights are recomputed
explicitly from the block's own layers: q, k from ``attn.c_attn`` on ``ln_1`` of the residual stream
(rotated with ``model.apply_rotary`` and the model's tables for rotary positions), then softmax(q
k^T / sqrt(head_dim)) under the causal mask. ``explicit_attention`` also returns weights @ v through
``c_proj``, which equals the block's attention output (tests/test_model_attention.py).
``write_attention`` draws them, a grid of heatmaps labelled with the tokens, for ``gptlab.sample``.
"""

from __future__ import annotations

import math
import textwrap
from pathlib import Path
from typing import Any, List, Optional, Sequence, Tuple

import torch

from gptlab.errors import GptlabError
from gptlab.model.gpt import GPT, CausalSelfAttention, apply_rotary

Rope = Optional[Tuple[torch.Tensor, torch.Tensor]]


@torch.no_grad()
def layer_inputs(model: GPT, ids: torch.Tensor) -> List[Tuple[torch.Tensor, Rope]]:
    """What each block receives when the model reads ids (B, T), in eval mode (no dropout).

    It is its residual stream input and the rotary tables (None for learned or sinusoidal
    positions).
    """
    seen: List[Tuple[torch.Tensor, Rope]] = []
    hooks = [
        block.register_forward_pre_hook(lambda _, args: seen.append((args[0], args[1])))
        for block in model.h
    ]
    was_training = model.training
    try:
        model.eval()
        model(ids)
    finally:
        model.train(was_training)
        for hook in hooks:
            hook.remove()
    return seen


def explicit_attention(
    attn: CausalSelfAttention, x: torch.Tensor, rope: Rope = None
) -> Tuple[torch.Tensor, torch.Tensor]:
    """One attention layer written out: x (B, T, C) -> (weights, the layer's output).

    x is the block's ln_1 output; the weights are (B, nh, T, T) in float32, the layer's output (B,
    T, C) is weights @ v through c_proj.
    """
    B, T, C = x.shape
    nh, hs = attn.n_head, attn.head_dim
    # (B, T, 3 * nh, hs): the heads of q, then of k, then of v, as CausalSelfAttention splits them
    heads = attn.c_attn(x).view(B, T, 3 * nh, hs)
    q, k, v = heads.split(nh, dim=2)
    if rope is not None:
        cos, sin = rope[0][:, None], rope[1][:, None]
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, nh, T, hs)
    scores = (q.float() @ k.float().transpose(-2, -1)) / math.sqrt(hs)
    future = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(diagonal=1)
    # exp(-inf) is exactly 0: no weight on a later token
    weights = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
    y = (weights.to(v.dtype) @ v).transpose(1, 2).reshape(B, T, C)
    return weights, attn.c_proj(y)


@torch.no_grad()
def attention_maps(model: GPT, ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """The attention weights of every layer and head over one sequence of token ids (T,).

    They are a float32 CPU tensor (n_layer, n_head, T, T), row t the weights query t puts on keys
    0..t.
    """
    ids = torch.as_tensor(ids, dtype=torch.long, device=model.wte.weight.device).reshape(1, -1)
    n, block_size = ids.size(1), model.config.block_size
    if n > block_size:
        raise GptlabError(
            f"the prompt is {n} tokens, more than the model's block_size {block_size}: attention "
            f"maps need the whole prompt in one block (give at most {block_size} tokens)"
        )
    maps = [
        explicit_attention(block.attn, block.ln_1(x), rope)[0][0]
        for block, (x, rope) in zip(model.h, layer_inputs(model, ids))
    ]
    return torch.stack(maps).cpu()


def pick(key: str, given: Optional[Sequence[int]], count: int, what: str) -> List[int]:
    """The indices `key` selects of `count` (all when given is None).

    One line when one is out of range.
    """
    if given is None:
        return list(range(count))
    bad = [i for i in given if not 0 <= i < count]
    if bad or not given:
        problem = f"{what} {bad[0]} is out of range" if bad else "no " + what
        raise GptlabError(
            f"{key}={list(given)}: {problem}; the model has {what}s 0-{count - 1} (null: all)"
        )
    return list(given)


ESCAPES = {"\n": "\\n", "\t": "\\t", "\r": "\\r", "$": r"\$"}


def token_label(text: str) -> str:
    """A token's text as an axis label, with what matplotlib would misdraw escaped.

    A newline is \\n (and other control characters escaped alike), a token of spaces is shown as
    open boxes, and $ is escaped so that matplotlib draws it rather than reading mathtext.
    """
    if text and not text.strip(" "):
        return "\u2423" * len(text)
    return "".join(
        ESCAPES.get(ch, ch if ch.isprintable() else ch.encode("unicode_escape").decode())
        for ch in text
    )


TITLE_POINTS = 10  # the figure's title's font size
TITLE_LINES = 4  # the most lines a title is wrapped to; a longer one ends in an ellipsis


def grid_geometry(
    rows: int, cols: int, labels: Sequence[str], title_lines: int = 1
) -> Tuple[Any, ...]:
    """The grid's geometry: square panels that grow with the prompt, within 60 inches a side.

    Returned: (figure size in inches, the grid's left, right, bottom, top as fractions of it,
    wspace, hspace, the tick labels' font size). The whole is within 60 inches (6000 px) a side,
    with margins wide enough for the longest token label and above the grid room for a title of
    title_lines lines.
    """
    n = len(labels)
    panel = min(max(2.4, 0.2 * n + 1.0), 60.0 / max(rows, cols))
    font = max(3.0, min(9.0, 0.7 * 72 * panel / n))  # points: at most 0.7 of a row's height
    label = 0.6 * font / 72 * max(map(len, labels)) + 0.45  # inches: the labels and "query"/"key"
    gap_w, gap_h, colorbar = 0.2, 0.4, 1.1
    top = 0.45 + 1.25 * TITLE_POINTS / 72 * title_lines
    width = label + cols * panel + (cols - 1) * gap_w + colorbar
    height = label + rows * panel + (rows - 1) * gap_h + top
    box = (label / width, 1 - colorbar / width, label / height, 1 - top / height)
    return (width, height), *box, gap_w / panel, gap_h / panel, font


def attention_figure(
    maps: torch.Tensor,
    tokens: Sequence[str],
    layers: Sequence[int],
    heads: Sequence[int],
    title: str,
) -> Any:
    """A matplotlib Figure of a grid of heatmaps, one per (layer, head).

    Rows are layers, columns heads; maps (len(layers), len(heads), T, T), queries down, keys across,
    labelled with the tokens' text on the left column and the bottom row.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows, cols, n = len(layers), len(heads), len(tokens)
    labels = [token_label(t) for t in tokens]
    lines = title_lines(title, grid_geometry(rows, cols, labels)[0][0])
    geometry = grid_geometry(rows, cols, labels, len(lines))
    size, left, right, bottom, top, wspace, hspace, font = geometry
    # placed by hand, tokens on the outer panels only: constrained layout and a tick label per
    # token on every panel were most of the drawing time of a 12 x 12 grid
    fig = Figure(figsize=size, dpi=100)
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(
        rows, cols, left=left, right=right, bottom=bottom, top=top, wspace=wspace, hspace=hspace
    )
    future = torch.ones(n, n, dtype=torch.bool).triu(diagonal=1)
    image = None
    for r, layer in enumerate(layers):
        for c, head in enumerate(heads):
            ax = fig.add_subplot(grid[r, c])
            # the masked future as blank, not as weight 0
            image = ax.imshow(maps[r, c].masked_fill(future, float("nan")).numpy(), vmin=0, vmax=1)
            ax.set_title(f"layer {layer} head {head}", fontsize=9)
            ax.tick_params(length=0)
            ax.set_xticks([])
            ax.set_yticks([])
            if r == rows - 1:
                ax.set_xticks(range(n), labels, rotation=90, fontsize=font)
                ax.set_xlabel("key", fontsize=9)
            if c == 0:
                ax.set_yticks(range(n), labels, fontsize=font)
                ax.set_ylabel("query", fontsize=9)
    # at most 5 inches tall, centred on the grid
    tall = min(top - bottom, 5.0 / size[1])
    bar = fig.add_axes((right + 0.3 / size[0], (top + bottom - tall) / 2, 0.15 / size[0], tall))
    fig.colorbar(image, cax=bar, label="attention weight")
    fig.suptitle("\n".join(lines), fontsize=TITLE_POINTS, y=1 - 0.15 / size[1], va="top")
    return fig


def title_lines(title: str, width: float) -> List[str]:
    """The title wrapped to a figure width inches wide (at most TITLE_LINES lines).

    No line runs past its edges: a long run path or model URI breaks where it must.
    """
    chars = max(20, int((width - 0.3) * 72 / (0.62 * TITLE_POINTS)))  # DejaVu Sans: ~0.6 em a char
    return textwrap.wrap(title, chars, max_lines=TITLE_LINES, placeholder=" \u2026") or [""]


def write_attention(
    model: GPT,
    ids: Sequence[int],
    tokens: Sequence[str],
    path: Path,
    layers: Optional[Sequence[int]],
    heads: Optional[Sequence[int]],
    title: str,
) -> Tuple[int, int]:
    """Compute the maps of ids and write the grid of the chosen layers and heads to path.

    None chooses all; returns (layers drawn, heads drawn).
    """
    cfg = model.config
    layers = pick("attention.layers", layers, cfg.n_layer, "layer")
    heads = pick("attention.heads", heads, cfg.n_head, "head")
    maps = attention_maps(model, ids)[layers][:, heads]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise GptlabError(
            "attention.out needs matplotlib, which is not installed (pip install matplotlib)"
        ) from None
    path.parent.mkdir(parents=True, exist_ok=True)
    attention_figure(maps, tokens, layers, heads, title).savefig(path)
    return len(layers), len(heads)
