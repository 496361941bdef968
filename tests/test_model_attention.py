"""gptlab.model.attention: the attention maps are the model's own attention weights, written out
(causal, rows of one, softmax(q k^T / sqrt(d)) by hand, the same block outputs and logits as the
fused path), for every kind of positions; `gptlab.sample attention.out=...` draws them as a PNG."""

import math
import struct

import pytest
import torch
import torch.nn.functional as F
from helpers import model_config
from test_sample import trained  # noqa: F401 - a short run's folder, trained once per module

from gptlab.errors import GptlabError
from gptlab.model.attention import (
    attention_figure,
    attention_maps,
    explicit_attention,
    layer_inputs,
    token_label,
)
from gptlab.model.gpt import GPT, rotate_pairs

POSITIONS = ["learned", "sinusoidal", "rotary"]
T = 12


def sharp_model(pos_emb: str, dropout: float = 0.0) -> GPT:
    """A 2-layer, 2-head model whose attention is far from uniform: at GPT-2's init (std 0.02) the
    weights are nearly 1/(t+1), which a wrong scale or a missing rotation would still match."""
    torch.manual_seed(0)
    model = GPT(model_config(vocab_size=65, pos_emb=pos_emb, dropout=dropout, n_layer=2, n_head=2))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.3)
    return model.eval()


def ids() -> torch.Tensor:
    return torch.randint(0, 65, (T,), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("pos_emb", POSITIONS)
@pytest.mark.integration
def test_maps_are_causal_and_each_row_sums_to_one(pos_emb):
    maps = attention_maps(sharp_model(pos_emb), ids())
    assert maps.shape == (2, 2, T, T) and maps.dtype == torch.float32
    assert torch.equal(maps.triu(diagonal=1), torch.zeros_like(maps))  # exactly 0 on the future
    assert torch.allclose(maps.sum(-1), torch.ones(2, 2, T), atol=1e-6)
    # far from uniform, so the checks below tell a right map from a wrong one
    uniform = 1.0 / torch.arange(1, T + 1)[:, None]
    assert (maps - uniform).tril().abs().max() > 0.3


def first_layer_input(model: GPT, x: torch.Tensor, pos_emb: str) -> torch.Tensor:
    """The residual stream entering block 0, by hand from the embeddings."""
    h = model.wte.weight[x]
    if pos_emb == "learned":
        h = h + model.wpe.weight[: len(x)]
    elif pos_emb == "sinusoidal":
        h = h + model.pos_table[: len(x)]
    return h


@pytest.mark.parametrize("pos_emb", POSITIONS)
@pytest.mark.parametrize("layer,head", [(0, 1), (1, 0)])
@pytest.mark.integration
def test_one_head_equals_softmax_of_q_k_by_hand(pos_emb, layer, head):
    model, x = sharp_model(pos_emb), ids()
    cfg = model.config
    hs = cfg.n_embd // cfg.n_head
    cos, sin = (model.rope_cos[:T], model.rope_sin[:T]) if pos_emb == "rotary" else (None, None)
    with torch.no_grad():
        h = first_layer_input(model, x, pos_emb)[None]
        for block in model.h[:layer]:
            h, _ = block(h, (cos, sin) if cos is not None else None)
        block = model.h[layer]
        a = F.layer_norm(h[0], (cfg.n_embd,), block.ln_1.weight, block.ln_1.bias)
        w, b = block.attn.c_attn.weight, block.attn.c_attn.bias
        rows_q = slice(head * hs, (head + 1) * hs)
        rows_k = slice(cfg.n_embd + head * hs, cfg.n_embd + (head + 1) * hs)
        q, k = a @ w[rows_q].T + b[rows_q], a @ w[rows_k].T + b[rows_k]
        if cos is not None:  # the rotation in real arithmetic, not the complex path the model takes
            q, k = rotate_pairs(q, cos, sin), rotate_pairs(k, cos, sin)
        scores = q @ k.T / math.sqrt(hs)
        scores = scores.masked_fill(torch.ones(T, T).triu(1).bool(), float("-inf"))
        expected = torch.softmax(scores, dim=-1)
    got = attention_maps(model, x)[layer, head]
    # measured difference 0 (float32 on the CPU)
    assert torch.allclose(got, expected, atol=1e-6), (got - expected).abs().max()


@pytest.mark.parametrize("pos_emb", POSITIONS)
@pytest.mark.integration
def test_the_explicit_path_is_the_model(pos_emb):
    """weights @ v through c_proj, then the block's MLP, gives each block's output and, after the
    last, the model's own logits."""
    model, x = sharp_model(pos_emb), ids()[None]
    inputs = layer_inputs(model, x)
    assert len(inputs) == model.config.n_layer
    with torch.no_grad():
        expected_logits, _ = model(x)
        h = inputs[0][0]
        for i, block in enumerate(model.h):
            rope = inputs[i][1]
            assert (rope is not None) == (pos_emb == "rotary")
            weights, y = explicit_attention(block.attn, block.ln_1(h), rope)
            fused, _ = block.attn(block.ln_1(h), rope)
            # measured at most 1.4e-6 against outputs up to 9 (float32 on the CPU)
            assert torch.allclose(y, fused, atol=5e-6), (y - fused).abs().max()
            h = h + y
            h = h + block.mlp(block.ln_2(h))
            if i + 1 < len(model.h):
                # measured at most 5.7e-6 against a residual stream up to 14
                assert torch.allclose(h, inputs[i + 1][0], atol=2e-5)
        logits = model.lm_head(model.ln_f(h))[..., : model.config.vocab_size]
    error = (logits - expected_logits).abs().max()
    assert torch.allclose(logits, expected_logits, atol=2e-5), error  # measured at most 6.2e-6


@pytest.mark.integration
def test_a_map_that_leaves_out_the_rotation_differs():
    """The rotary check can fail: the same model's maps without its rotation are not its maps."""
    model, x = sharp_model("rotary"), ids()
    (h, rope), _ = layer_inputs(model, x[None])
    with_rope, _ = explicit_attention(model.h[0].attn, model.h[0].ln_1(h), rope)
    without, _ = explicit_attention(model.h[0].attn, model.h[0].ln_1(h), None)
    assert torch.allclose(with_rope[0], attention_maps(model, x)[0])
    assert (with_rope - without).abs().max() > 0.1


@pytest.mark.integration
def test_a_model_in_training_mode_is_read_without_dropout_and_left_training():
    model = sharp_model("learned", dropout=0.5)
    expected = attention_maps(model, ids())
    model.train()
    assert torch.equal(attention_maps(model, ids()), expected)
    assert model.training


def test_token_labels_escape_newlines_and_mathtext():
    assert token_label("\n") == "\\n" and token_label("a\tb\r") == "a\\tb\\r"
    assert token_label("$x$") == r"\$x\$" and token_label(" é") == " é"
    assert token_label(" ") == "\u2423" and token_label("  ") == "\u2423\u2423"


def test_the_figure_is_labelled_with_the_tokens():
    tokens = ["RO", "ME", "O:", "\n"]
    maps = torch.full((2, 2, 4, 4), 0.25)
    fig = attention_figure(maps, tokens, [0, 2], [1, 0], "t")
    panels = [ax for ax in fig.axes if ax.get_title()]
    titles = ["layer 0 head 1", "layer 0 head 0", "layer 2 head 1", "layer 2 head 0"]
    assert [ax.get_title() for ax in panels] == titles
    labels = ["RO", "ME", "O:", "\\n"]
    keys = [[t.get_text() for t in ax.get_xticklabels()] for ax in panels]
    queries = [[t.get_text() for t in ax.get_yticklabels()] for ax in panels]
    # keys along the bottom row, queries down the left column
    assert keys == [[], [], labels, labels] and queries == [labels, [], labels, []]


@pytest.mark.parametrize("shape", [(1, 1, 3), (2, 3, 12)])
def test_a_long_title_is_wrapped_inside_the_figure_above_the_panels(shape):
    """sample's title names the run (a long path, or a models:/ URI): drawn over a small grid, it
    was cut at the figure's edges. Wrapped to the figure's width, every line is inside the PNG and
    above the panels' own titles."""
    rows, cols, n = shape
    run = "/home/someone/projects/language-models/outputs/sweeps/2026-12-01_10-00-00.123456/17"
    title = f"attention weights of {run} (step 5000) over the prompt's {n} tokens"
    fig = attention_figure(torch.full((rows, cols, n, n), 1 / n), ["ab"] * n, range(rows),
                           range(cols), title)  # fmt: skip
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    text = fig._suptitle
    box, inside = text.get_window_extent(renderer), fig.bbox
    assert box.x0 >= inside.x0 and box.x1 <= inside.x1 and box.y1 <= inside.y1, (box, inside)
    assert text.get_text().replace("\n", " ") == title or "\n" in text.get_text()
    panel_tops = [ax.title.get_window_extent(renderer).y1 for ax in fig.axes if ax.get_title()]
    assert box.y0 > max(panel_tops)


def png_size(path):
    """(width, height) of a PNG, after checking its signature and header chunk."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", data[:16]
    return struct.unpack(">II", data[16:24])


@pytest.mark.integration
def test_the_sample_command_writes_a_png(trained, tmp_path, capsys):  # noqa: F811
    from gptlab.sample import main as sample

    out = tmp_path / "maps" / "all.png"
    sample([f"run={trained}", "prompt=ROMEO:\nJULIET:", f"attention.out={out}", "max_new_tokens=0"])
    printed = capsys.readouterr().out
    assert printed == f"attention maps (2 layers x 2 heads): {out}\n"  # no text generated
    assert out.stat().st_size > 20_000
    width, height = png_size(out)
    one = tmp_path / "one.png"
    args = [f"attention.out={one}", "attention.layers=[1]", "attention.heads=[0]"]
    sample([f"run={trained}", "prompt=ROMEO:", *args, "max_new_tokens=5", "seed=1"])
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == f"attention maps (1 layers x 1 heads): {one}"
    assert printed[1].startswith("ROMEO:") and len(printed[1]) > len("ROMEO:")  # text generated too
    w1, h1 = png_size(one)
    assert w1 < width and h1 < height  # one panel, not the 2 x 2 grid


@pytest.mark.parametrize(
    "args,message",
    [
        (
            ["attention.layers=[0,2]"],
            "attention.layers=[0, 2]: layer 2 is out of range; the model has layers 0-1",
        ),
        (
            ["attention.heads=[-1]"],
            "attention.heads=[-1]: head -1 is out of range; the model has heads 0-1 (null: all)",
        ),
        (["attention.heads=[]"], "attention.heads=[]: no head; the model has heads 0-1"),
        (["prompt=" + "x" * 40], "the prompt is 40 tokens, more than the model's block_size 32"),
    ],
)
@pytest.mark.integration
def test_a_bad_layer_head_or_prompt_is_one_line(trained, tmp_path, args, message):  # noqa: F811
    from gptlab.sample import main as sample

    out = tmp_path / "a.png"
    with pytest.raises(GptlabError) as e:
        sample([f"run={trained}", f"attention.out={out}", "max_new_tokens=0", *args])
    assert message in str(e.value) and "\n" not in str(e.value)
    assert not out.exists()


@pytest.mark.integration
def test_attention_out_is_a_path_as_typed():
    from gptlab.cli import compose

    # a comma would be a sweep, and a number a number, were the path not text as typed
    for path in ("maps/a,b.png", "2026"):
        assert compose("sample", ["run=r", f"attention.out={path}"]).attention.out == path
    assert compose("sample", ["run=r", "attention.out=null"]).attention.out is None
    assert compose("sample", ["run=r"]).attention == {"out": None, "layers": None, "heads": None}
