import math

import pytest
import torch
import torch.nn.functional as F
from helpers import model_config

from gptlab.model.gpt import GPT, GPTConfig


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
@pytest.mark.integration
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
    """GPT-2's init: N(0, 0.02) everywhere, the two projections into the residual stream scaled by
    1/sqrt(2 * n_layer), biases zero. 4% allowed on each std: seed 0 measured within 1.2% (4,096 to
    16,384 draws a matrix), while 1/sqrt(3 * n_layer) is 18% off; means within 0.002 (measured
    4e-4)."""
    torch.manual_seed(0)
    model = GPT(tiny(n_layer=8, n_embd=64))
    assert model.lm_head.weight is model.wte.weight
    residual, plain = 0.02 / math.sqrt(16), 0.02
    block = model.h[0]
    expected = {
        "attn.c_proj": residual,
        "mlp.c_proj": residual,
        "attn.c_attn": plain,
        "mlp.c_fc": plain,
    }
    for name, std in expected.items():
        w = block.get_submodule(name).weight
        assert w.std().item() == pytest.approx(std, rel=0.04), name
        assert abs(w.mean().item()) < 0.1 * std, name
        assert torch.all(block.get_submodule(name).bias == 0), name
    for emb in (model.wte, model.wpe):
        assert emb.weight.std().item() == pytest.approx(0.02, rel=0.04)
        assert abs(emb.weight.mean().item()) < 0.002


@pytest.mark.parametrize("bias", [True, False])
def test_bias_false_leaves_no_bias_anywhere(bias):
    names = {n for n, _ in GPT(tiny(bias=bias)).named_parameters() if n.endswith("bias")}
    per_block = {
        "ln_1.bias",
        "attn.c_attn.bias",
        "attn.c_proj.bias",
        "ln_2.bias",
        "mlp.c_fc.bias",
        "mlp.c_proj.bias",
    }
    # the LM head: never
    everything = {f"h.{i}.{n}" for i in range(2) for n in per_block} | {"ln_f.bias"}
    assert names == (everything if bias else set())


@pytest.mark.parametrize("pos_emb", ["learned", "sinusoidal", "rotary"])
def test_a_checkpoint_holds_parameters_only_not_the_derived_position_tables(pos_emb):
    model = GPT(tiny(pos_emb=pos_emb))
    assert set(model.state_dict()) == {n for n, _ in model.named_parameters(remove_duplicate=False)}


def test_configuration_errors_name_the_field():
    import dataclasses

    with pytest.raises(
        ValueError,
        match=r"^GPTConfig\.vocab_size is null: set it from the tokenizer before building$",
    ):
        GPT(tiny(vocab_size=None))
    with pytest.raises(ValueError, match=r"^unknown pos_emb 'alibi'$"):
        GPT(dataclasses.replace(tiny(), pos_emb="alibi"))


@pytest.mark.parametrize("pos_emb", ["learned", "sinusoidal"])
@pytest.mark.integration
def test_the_residual_stream_starts_as_token_plus_position_and_each_block_is_pre_layernorm(pos_emb):
    """The first block sees wte[token] + position; a block is x + attn(ln_1(x)), then +
    mlp(ln_2(x)); the head reads ln_f of the last block. Rebuilt by hand, measured 0 to 2e-7 apart
    (fp32)."""
    torch.manual_seed(0)
    model = GPT(tiny(pos_emb=pos_emb)).eval()
    idx = torch.randint(0, 65, (2, 16))
    pos = model.wpe.weight if pos_emb == "learned" else model.pos_table
    x = model.wte(idx) + pos[:16]
    for block in model.h:
        x = x + block.attn(block.ln_1(x))[0]
        x = x + block.mlp(block.ln_2(x))
    logits, loss = model(idx)
    assert loss is None
    assert torch.allclose(logits, model.lm_head(model.ln_f(x))[..., :65], atol=1e-5, rtol=0)


def count_params(**kw) -> int:
    with torch.device("meta"):
        return GPT(model_config(**kw)).num_params()


def test_gpt1b_parameter_count():
    n = count_params(
        vocab_size=65, block_size=2048, n_layer=20, n_head=16, n_embd=2048, ffn_dim=8192
    )
    assert abs(n - 1_011_224_385) / 1_011_224_385 < 1e-3, n


def test_gpt2_124m_parameter_count():
    n = count_params(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768)
    assert n == 124_439_808
    padded = count_params(
        vocab_size=50257, vocab_multiple=64, block_size=1024, n_layer=12, n_head=12, n_embd=768
    )
    assert padded == 124_439_808 + (50304 - 50257) * 768


def test_rotary_in_complex_and_in_real_arithmetic_agree():
    """apply_rotary (eager: complex multiply) and rotate_pairs (what torch.compile runs) are one
    rotation."""
    from gptlab.model.gpt import apply_rotary, rotary_tables, rotate_pairs

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
@pytest.mark.integration
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
@pytest.mark.integration
def test_a_chunk_of_new_tokens_after_a_cache_sees_the_cache_and_its_own_past_only(pos_emb):
    """Several new tokens after a cached prefix (the masked branch of attention, which generate's
    one token at a time never takes): the same logits as one forward over the whole sequence."""
    torch.manual_seed(0)
    model = GPT(tiny(pos_emb=pos_emb)).eval()
    x = torch.randint(0, 65, (2, 12))
    full, _ = model(x)
    with torch.no_grad():
        prefix, _, cache = model(x[:, :5], cache=[])
        chunk, _, cache = model(x[:, 5:10], cache=cache)
        # two new tokens: the smallest chunk that needs a mask
        pair, _, cache = model(x[:, 10:], cache=cache)
    assert torch.allclose(prefix, full[:, :5], atol=1e-5)
    # a wrong mask changes every row but the last
    assert torch.allclose(chunk, full[:, 5:10], atol=1e-5)
    assert torch.allclose(pair, full[:, 10:], atol=1e-5)
    assert cache[0][0].shape == (2, 2, 12, 16)  # (B, nh, T, hs): the cache holds all 12 positions
    with pytest.raises(ValueError, match="sequence of 17 tokens exceeds block_size 16"):
        model(x[:, :5], cache=cache)


@pytest.mark.integration
def test_generation_past_block_size_and_top_k():
    torch.manual_seed(0)
    model = GPT(tiny())
    g = torch.Generator().manual_seed(0)
    out = model.generate(
        torch.zeros(1, 1, dtype=torch.long), 40, temperature=1.0, top_k=5, generator=g
    )
    assert out.shape == (1, 41)
    assert model.training  # generate restores the mode


@pytest.mark.parametrize("pos_emb", ["learned", "rotary"])
@pytest.mark.integration
def test_activation_checkpointing_same_gradients_and_recomputes_only_when_training(pos_emb):
    """Same gradients with and without checkpointing (rotary: the rotation goes into the recompute);
    each block runs forward twice per training step with it (once more in backward), once without it
    and once in evaluation either way."""
    torch.manual_seed(0)
    model = GPT(tiny(pos_emb=pos_emb))
    assert model.activation_checkpointing is False  # off unless distributed.wrap_model turns it on
    calls = []
    # inside the block: its checkpointing recomputes the block's layers, not the block's call
    model.h[0].attn.register_forward_pre_hook(lambda *_: calls.append(1))

    def forwards(train: bool) -> int:
        calls.clear()
        model.train(train)
        with torch.set_grad_enabled(train):
            loss = model(x, x)[1]
            if train:
                loss.backward()
        return len(calls)

    x = torch.randint(0, 65, (2, 16))
    assert forwards(train=True) == 1
    ref = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model.activation_checkpointing = True
    assert forwards(train=True) == 2
    for r, p in zip(ref, model.parameters()):
        assert torch.allclose(r, p.grad, atol=1e-6)
    assert forwards(train=False) == 1


def test_attention_dropout_applies_in_training_only():
    from gptlab.model.gpt import CausalSelfAttention

    torch.manual_seed(0)
    attn = CausalSelfAttention(tiny(dropout=0.5))
    attn.resid_dropout.p = 0.0  # isolate the dropout inside attention
    x = torch.randn(2, 16, 32)
    assert not torch.allclose(attn(x)[0], attn(x)[0])  # two draws of the attention-weight dropout
    attn.eval()
    assert torch.equal(attn(x)[0], attn(x)[0])


@pytest.mark.integration
def test_sequence_too_long_is_refused():
    model = GPT(tiny())
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, 17, dtype=torch.long))


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("chunk", [1, 7, 32, 1000])
@pytest.mark.integration
def test_chunked_head_and_loss_match_the_whole_logits_in_loss_and_every_gradient(tie, chunk):
    """ChunkedHeadLoss against F.cross_entropy over the whole logits: fp32 loss and gradients of
    every parameter within 1e-5, for chunks smaller than, not dividing, and larger than the 3 x 16
    tokens."""
    import copy

    torch.manual_seed(0)
    # padded to 320: 20 unused rows
    whole = GPT(tiny(vocab_size=300, vocab_multiple=64, tie_weights=tie))
    chunked = copy.deepcopy(whole)
    chunked.loss_chunk = chunk
    # 3 x 16 = 48 tokens, not the model's width (32): a token count read from the wrong axis fails
    x, y = torch.randint(0, 300, (3, 16)), torch.randint(0, 300, (3, 16))
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
    assert chunked(x)[0].shape == (3, 16, 300)  # without targets: the logits, as before


def test_chunked_head_and_loss_on_bf16_weights_keep_dtypes_and_sum_gradients_in_fp32():
    """Under fsdp's mixed precision the head's weight itself is bf16: the chunk's gradients are cast
    to the weight's dtype for the matmuls, and the weight's gradient sums its chunks in fp32.
    Against fp64 over the whole logits, 512 chunks of one token: max relative error of the weight's
    gradient measured 6.9e-3 (one bf16 rounding of each product); summed in bf16 it is 2.0e-2."""
    from gptlab.model.gpt import ChunkedHeadLoss

    torch.manual_seed(0)
    N, C, V = 512, 32, 300
    x = torch.randn(N, C).bfloat16().requires_grad_()
    w = (0.5 * torch.randn(320, C)).bfloat16().requires_grad_()
    t = torch.randint(0, V, (N,))
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = F.cross_entropy(x64 @ w64[:V].T, t)
    ref.backward()
    loss = ChunkedHeadLoss.apply(x, w, t, V, 1)
    loss.backward()
    assert loss.dtype == torch.float32 and x.grad.dtype == w.grad.dtype == torch.bfloat16
    assert loss.item() == pytest.approx(ref.item(), abs=2e-3)  # measured 4.0e-4
    rel = lambda a, b: ((a.double() - b).abs().max() / b.abs().max()).item()  # noqa: E731
    assert rel(x.grad, x64.grad) < 1e-2  # measured 5.4e-3
    assert rel(w.grad, w64.grad) < 1.2e-2


def test_position_tables_are_the_formulas():
    """The sinusoidal table: sin at even channels, cos at odd ones, of p / 10000^(2i/d); the rotary
    tables: cos and sin of p * base^(-2i/hs). Against fp64; measured 7e-5 apart at position 63 (fp32
    angles), 1e-4 allowed; a wrong sign, base, channel or exponent is O(1) somewhere."""
    from gptlab.model.gpt import rotary_tables, sinusoidal_table

    p = torch.arange(64, dtype=torch.float64)[:, None]
    i = torch.arange(0, 16, 2, dtype=torch.float64)
    angle = p / 10000.0 ** (i / 16)
    table = sinusoidal_table(64, 16)
    assert table.dtype == torch.float32 and table.shape == (64, 16)
    assert torch.allclose(table[:, 0::2].double(), angle.sin(), atol=1e-4, rtol=0)
    assert torch.allclose(table[:, 1::2].double(), angle.cos(), atol=1e-4, rtol=0)
    cos, sin = rotary_tables(64, 8, 500.0)
    angle = p * 500.0 ** (-torch.arange(0, 8, 2, dtype=torch.float64) / 8)
    assert cos.shape == sin.shape == (64, 4) and cos.dtype == torch.float32
    assert torch.allclose(cos.double(), angle.cos(), atol=1e-4, rtol=0)
    assert torch.allclose(sin.double(), angle.sin(), atol=1e-4, rtol=0)


def test_under_torch_compile_the_rotation_is_done_in_real_arithmetic_in_the_input_dtype(
    monkeypatch,
):
    """What apply_rotary runs when torch.compile traces it (is_compiling): rotate_pairs on the same
    arguments, whose result keeps a bf16 input's dtype (measured: the same values as eager, 0
    apart)."""
    from gptlab.model.gpt import apply_rotary, rotary_tables, rotate_pairs

    torch.manual_seed(0)
    x = torch.randn(2, 3, 16, 8)
    cos, sin = rotary_tables(16, 8, 10000.0)
    eager = apply_rotary(x, cos, sin)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert torch.equal(apply_rotary(x, cos, sin), rotate_pairs(x, cos, sin))
    assert torch.allclose(apply_rotary(x, cos, sin), eager, atol=2e-6, rtol=0)
    assert rotate_pairs(x.bfloat16(), cos, sin).dtype == torch.bfloat16


def test_swiglu_is_silu_of_the_gate_times_the_up_projection():
    from gptlab.model.gpt import MLP

    torch.manual_seed(0)
    mlp = MLP(tiny(mlp="swiglu", ffn_dim=48))
    x = torch.randn(2, 5, 32)
    gate, up = mlp.c_fc(x).split(48, dim=-1)
    assert torch.allclose(mlp(x), mlp.c_proj(F.silu(gate) * up), atol=1e-6, rtol=0)


@pytest.mark.parametrize("pos_emb", ["learned", "sinusoidal", "rotary"])
@pytest.mark.integration
def test_every_position_scheme_makes_the_model_see_token_order(pos_emb):
    """Without positions, a one-layer causal model's last output depends on the set of earlier
    tokens, not their order: swapping two of them must change it under each scheme. Sharpened
    attention (x10), seed 0, measured: learned 3.5e-2, sinusoidal 3.8e-5, rotary 4.2e-2; with the
    positions taken out (the control below) 6e-8, float rounding."""
    torch.manual_seed(0)
    model = GPT(tiny(pos_emb=pos_emb, n_layer=1)).eval()
    with torch.no_grad():
        model.h[0].attn.c_attn.weight.mul_(10)
    x = torch.randint(0, 65, (1, 16))
    x[0, 2] = (x[0, 5] + 1) % 65  # two different tokens
    swapped = x.clone()
    swapped[0, [2, 5]] = x[0, [5, 2]]
    change = lambda: (model(x)[0][0, -1] - model(swapped)[0][0, -1]).abs().max().item()  # noqa: E731
    assert change() > 1e-6
    with torch.no_grad():  # the control: the same model with its positions neutralised
        if pos_emb == "learned":
            model.wpe.weight.zero_()
        elif pos_emb == "sinusoidal":
            model.pos_table.zero_()
        else:
            model.rope_cos.fill_(1.0), model.rope_sin.zero_()
    assert change() < 1e-6
