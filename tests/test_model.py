import math

import pytest
import torch
import torch.nn.functional as F
from conftest import model_config

from gptlab.model import GPT, GPTConfig


def tiny(**kw) -> GPTConfig:
    base = dict(vocab_size=65, block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=0.0)
    base.update(kw)
    return model_config(**base)


@pytest.mark.parametrize("pos_emb", ["learned", "sinusoidal", "rotary"])
@pytest.mark.parametrize("mlp", ["gelu", "swiglu"])
def test_shapes_and_initial_loss(pos_emb, mlp):
    torch.manual_seed(0)
    model = GPT(tiny(pos_emb=pos_emb, mlp=mlp, vocab_multiple=64))
    x, y = torch.randint(0, 65, (4, 16)), torch.randint(0, 65, (4, 16))
    logits, loss = model(x, y)
    assert logits.shape == (4, 16, 65)  # padded vocabulary never reaches the caller
    assert model.lm_head.weight.shape[0] == 128
    # a fresh model predicts roughly uniformly: loss ~ ln(vocab) on targets unrelated to the input
    assert abs(loss.item() - math.log(65)) < 0.1


@pytest.mark.parametrize("pos_emb", ["learned", "sinusoidal", "rotary"])
def test_causality(pos_emb):
    torch.manual_seed(0)
    model = GPT(tiny(pos_emb=pos_emb)).eval()
    x = torch.randint(0, 65, (1, 16))
    y = x.clone()
    y[0, 10:] = (y[0, 10:] + 7) % 65  # change only the future
    a, _ = model(x)
    b, _ = model(y)
    assert torch.allclose(a[0, :10], b[0, :10], atol=1e-6)
    assert not torch.allclose(a[0, 10:], b[0, 10:])


def test_sdpa_matches_explicit_attention():
    torch.manual_seed(0)
    model = GPT(tiny()).eval()
    attn = model.h[0].attn
    x = torch.randn(2, 16, 32)
    got, _ = attn(x)
    B, T, C = x.shape
    q, k, v = attn.c_attn(x).split(C, dim=2)
    q, k, v = (t.view(B, T, 2, 16).transpose(1, 2) for t in (q, k, v))
    att = (q @ k.transpose(-2, -1)) / math.sqrt(16)
    att = att.masked_fill(torch.ones(T, T).triu(1).bool(), float("-inf"))
    y = (F.softmax(att, dim=-1) @ v).transpose(1, 2).reshape(B, T, C)
    assert torch.allclose(got, attn.c_proj(y), atol=1e-5)


def test_weight_tying_and_residual_init():
    model = GPT(tiny(n_layer=8))
    assert model.lm_head.weight is model.wte.weight
    std = model.h[0].attn.c_proj.weight.std().item()
    assert abs(std - 0.02 / math.sqrt(16)) < 0.002
    assert abs(model.h[0].attn.c_attn.weight.std().item() - 0.02) < 0.002


def count_params(**kw) -> int:
    with torch.device("meta"):
        return GPT(model_config(**kw)).num_params()


def test_gpt1b_parameter_count():
    n = count_params(vocab_size=65, block_size=2048, n_layer=20, n_head=16, n_embd=2048, ffn_dim=8192)
    assert abs(n - 1_011_224_385) / 1_011_224_385 < 1e-3, n


def test_gpt2_124m_parameter_count():
    n = count_params(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768)
    assert n == 124_439_808
    padded = count_params(vocab_size=50257, vocab_multiple=64, block_size=1024, n_layer=12, n_head=12, n_embd=768)
    assert padded == 124_439_808 + (50304 - 50257) * 768


def test_rotary_in_complex_and_in_real_arithmetic_agree():
    """apply_rotary (eager: complex multiply) and rotate_pairs (what torch.compile runs) are one rotation."""
    from gptlab.model import apply_rotary, rotary_tables, rotate_pairs

    torch.manual_seed(0)
    x = torch.randn(2, 3, 16, 8, dtype=torch.float64).float()
    cos, sin = rotary_tables(16, 8, 10000.0)
    # measured: 4.8e-7 apart in fp32 (rounding); a swapped pair or sign is O(1)
    assert torch.allclose(apply_rotary(x, cos, sin), rotate_pairs(x, cos, sin), atol=2e-6, rtol=0)
    # position 0 is not rotated; a rotation keeps each pair's length
    assert torch.equal(apply_rotary(x, cos, sin)[..., 0, :], x[..., 0, :])
    lengths = lambda t: t.unflatten(-1, (-1, 2)).norm(dim=-1)  # noqa: E731
    assert torch.allclose(lengths(apply_rotary(x, cos, sin)), lengths(x), atol=2e-6)


@pytest.mark.parametrize("pos_emb", ["learned", "rotary"])
def test_kv_cache_generation_matches_full_recompute(pos_emb):
    torch.manual_seed(0)
    model = GPT(tiny(pos_emb=pos_emb)).eval()
    prompt = torch.randint(0, 65, (2, 5))
    out = model.generate(prompt, 8, temperature=0)  # greedy, cached
    ref = prompt
    for _ in range(8):  # greedy without a cache
        logits, _ = model(ref)
        ref = torch.cat([ref, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("pos_emb", ["learned", "sinusoidal", "rotary"])
def test_a_chunk_of_new_tokens_after_a_cache_sees_the_cache_and_its_own_past_only(pos_emb):
    """Several new tokens after a cached prefix (the masked branch of attention, which generate's one
    token at a time never takes): the same logits as one forward over the whole sequence."""
    torch.manual_seed(0)
    model = GPT(tiny(pos_emb=pos_emb)).eval()
    x = torch.randint(0, 65, (2, 12))
    full, _ = model(x)
    with torch.no_grad():
        prefix, _, cache = model(x[:, :5], cache=[])
        chunk, _, cache = model(x[:, 5:], cache=cache)
    assert torch.allclose(prefix, full[:, :5], atol=1e-5)
    assert torch.allclose(chunk, full[:, 5:], atol=1e-5)  # a wrong mask changes every row but the last
    assert cache[0][0].shape == (2, 2, 12, 16)  # (B, nh, T, hs): the cache holds all 12 positions
    with pytest.raises(ValueError, match="sequence of 17 tokens exceeds block_size 16"):
        model(x[:, :5], cache=cache)


def test_generation_past_block_size_and_top_k():
    torch.manual_seed(0)
    model = GPT(tiny())
    g = torch.Generator().manual_seed(0)
    out = model.generate(torch.zeros(1, 1, dtype=torch.long), 40, temperature=1.0, top_k=5, generator=g)
    assert out.shape == (1, 41)
    assert model.training  # generate restores the mode


def test_activation_checkpointing_same_gradients():
    torch.manual_seed(0)
    model = GPT(tiny())
    x = torch.randint(0, 65, (2, 16))
    model(x, x)[1].backward()
    ref = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model.activation_checkpointing = True
    model(x, x)[1].backward()
    for r, p in zip(ref, model.parameters()):
        assert torch.allclose(r, p.grad, atol=1e-6)


def test_sequence_too_long_is_refused():
    model = GPT(tiny())
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, 17, dtype=torch.long))


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("chunk", [1, 7, 32, 1000])
def test_chunked_head_and_loss_match_the_whole_logits_in_loss_and_every_gradient(tie, chunk):
    """ChunkedHeadLoss against F.cross_entropy over the whole logits: fp32 loss and gradients of every
    parameter within 1e-5, for chunks smaller than, not dividing, and larger than the 2 x 16 tokens."""
    import copy

    torch.manual_seed(0)
    whole = GPT(tiny(vocab_size=300, vocab_multiple=64, tie_weights=tie))  # padded to 320: 20 unused rows
    chunked = copy.deepcopy(whole)
    chunked.loss_chunk = chunk
    x, y = torch.randint(0, 300, (2, 16)), torch.randint(0, 300, (2, 16))
    logits, ref = whole(x, y)
    none, loss = chunked(x, y)
    assert none is None and logits is not None
    assert loss.item() == pytest.approx(ref.item(), abs=1e-5)
    (2.5 * ref).backward()  # an incoming gradient other than 1 reaches both the same way
    (2.5 * loss).backward()
    for (name, a), b in zip(whole.named_parameters(), chunked.parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-5, rtol=0), name
    assert chunked.lm_head.weight.grad[300:].abs().max() == 0  # the padding rows get no gradient
    chunked.eval()
    assert chunked(x)[0].shape == (2, 16, 300)  # without targets: the logits, as before
