"""muP (model.parametrization=mup): the model, its optimizer groups, the config checks, old
checkpoints' configs and the export's folding."""

import dataclasses
import math

import pytest
import torch

from gptlab.cli import compose
from gptlab.config import Config, to_config
from gptlab.errors import GptlabError
from gptlab.export import hf_gpt2_state
from gptlab.model.gpt import GPT, GPTConfig
from gptlab.model.pretrained import CONV1D
from gptlab.optim.config import OptimizerConfig
from gptlab.optim.factory import build_optimizer


def small(parametrization="standard", width=64, base=64, tie=True):
    return GPTConfig(name="t", vocab_size=96, vocab_multiple=64, block_size=16, n_layer=2,
                     n_head=4, n_embd=width, ffn_dim=None, dropout=0.0, bias=True,
                     pos_emb="learned", mlp="gelu", tie_weights=tie, rope_base=1e4,
                     parametrization=parametrization, mup_base_width=base)  # fmt: skip


def optimizer_config(name: str) -> OptimizerConfig:
    cfg = to_config(compose("config", [f"optimizer={name}", "optimizer.fused=false"]), Config)
    return cfg.optimizer


def train(cfg: GPTConfig, opt_name: str, steps: int = 3):
    """Weights and losses after `steps` steps on one random batch, from seed 0."""
    torch.manual_seed(0)
    model = GPT(cfg)
    opt_cfg = optimizer_config(opt_name)
    opt = build_optimizer(model, opt_cfg, opt_cfg.lr, "cpu")
    batch = torch.randint(96, (2, 17), generator=torch.Generator().manual_seed(1))
    init = {k: v.clone() for k, v in model.state_dict().items()}
    losses = []
    for _ in range(steps):
        for group in opt.param_groups:
            group["lr"] = opt_cfg.lr * group.get("lr_mult", 1.0)  # as training/loop.py does
        _, loss = model(batch[:, :-1], batch[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return init, model.state_dict(), losses


@pytest.mark.parametrize("opt_name", ["adamw", "muon", "lion"])
def test_mup_at_its_base_width_is_the_standard_form_bit_for_bit(opt_name):
    s_init, s_after, s_losses = train(small("standard"), opt_name)
    m_init, m_after, m_losses = train(small("mup", 64, 64), opt_name)
    assert s_losses == m_losses
    for k in s_init:
        assert torch.equal(s_init[k], m_init[k]), k
        assert torch.equal(s_after[k], m_after[k]), k


def test_mup_scales_init_attention_and_logits_with_the_width():
    torch.manual_seed(0)
    wide = GPT(small("mup", width=256, base=64))  # m = 4
    assert wide.config.width_mult == 4.0
    d = 256 // 4
    assert wide.h[0].attn.scale == pytest.approx(math.sqrt(64 // 4) / d)  # sqrt(d_base) / d_head
    assert GPT(small("standard", 256)).h[0].attn.scale is None  # SDPA's own 1/sqrt(d_head)
    std = wide.h[0].mlp.c_fc.weight.std().item()
    assert std == pytest.approx(0.02 / 2, rel=0.05)  # 0.02 / sqrt(m)
    assert wide.wte.weight.std().item() == pytest.approx(0.02, rel=0.05)  # embeddings keep theirs
    # the same weights in the standard form, with muP's attention scale: the logits are m times
    plain = GPT(small("standard", 256))
    plain.load_state_dict(wide.state_dict())
    for block in plain.h:
        block.attn.scale = wide.h[0].attn.scale
    idx = torch.randint(96, (2, 16), generator=torch.Generator().manual_seed(1))
    assert torch.allclose(wide(idx)[0] * 4.0, plain(idx)[0], atol=1e-5)


def groups(parametrization, opt_name, tie=True):
    model = GPT(small(parametrization, width=256, base=64, tie=tie))
    opt = build_optimizer(model, optimizer_config(opt_name), 1e-3, "cpu")
    hidden = {id(p) for p in model.h.parameters() if p.dim() == 2}
    found = [(g.get("lr_mult"), {id(p) for p in g["params"]}) for g in opt.param_groups]
    return model, found, hidden


@pytest.mark.parametrize("opt_name", ["adamw", "lion"])
def test_mup_divides_the_hidden_matrices_lr_by_m(opt_name):
    model, found, hidden = groups("mup", opt_name)
    assert [ids for mult, ids in found if mult is not None] == [hidden]
    assert [mult for mult, _ in found if mult is not None] == [0.25]
    assert id(model.wte.weight) not in hidden  # embeddings, the tied head, gains: the lr as set
    _, standard, _ = groups("standard", opt_name)
    assert [mult for mult, _ in standard] == [None, None]  # two groups, as before muP


def test_mup_scales_muons_matrices_by_one_over_sqrt_m():
    model, found, hidden = groups("mup", "muon", tie=False)
    mult, ids = found[0]
    # the blocks' matrices and the untied head: Muon's 0.2 sqrt(max dim) step grows as sqrt(m)
    assert mult == 0.5 and ids == hidden | {id(model.lm_head.weight)}
    assert all(m is None for m, _ in found[1:])  # AdamW's groups: embeddings, gains, biases


@pytest.mark.parametrize(
    "override, message",
    [
        ("model.parametrization=muq", "model.parametrization"),
        ("model.mup_base_width=0", "model.mup_base_width"),
        ("model.mup_base_width=90", "90 is not divisible by model.n_head"),
    ],
)
def test_the_config_refuses_bad_mup_settings(override, message):
    with pytest.raises(GptlabError, match=message):
        to_config(compose("config", ["model.parametrization=mup", override]), Config)


def test_the_root_config_is_standard_and_validates_with_mup():
    cfg = to_config(compose("config", ["model.parametrization=mup"]), Config)
    assert cfg.model.parametrization == "mup" and cfg.model.mup_base_width > 0
    assert to_config(compose("config", []), Config).model.parametrization == "standard"


def test_an_older_checkpoints_model_config_builds_the_standard_form():
    saved = dataclasses.asdict(small("standard"))
    del saved["parametrization"], saved["mup_base_width"]
    cfg = GPTConfig(**saved)  # what inference.load_model and the checkpoint's rebuild do
    assert cfg.parametrization == "standard" and cfg.width_mult == 1.0


def test_the_hf_export_folds_mup_into_a_plain_gpt2():
    torch.manual_seed(0)
    mup = GPT(small("mup", width=128, base=64))
    with torch.no_grad():  # trained-looking biases and gains, so that folding them is tested
        for p in mup.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    state = {}
    for name, t in hf_gpt2_state(mup).items():
        name = name.removeprefix("transformer.")
        state[name] = t.t() if name.endswith(CONV1D) else t
    plain = GPT(small("standard", width=128))
    wte = torch.cat([state.pop("wte.weight"), mup.wte.weight[96:].detach()])  # the padded rows
    state.update({"wte.weight": wte, "lm_head.weight": wte})
    loaded = plain.load_state_dict(state, strict=False)
    assert not loaded.unexpected_keys and not loaded.missing_keys
    idx = torch.randint(96, (2, 16), generator=torch.Generator().manual_seed(1))
    assert torch.allclose(mup(idx)[0], plain(idx)[0], atol=1e-5)
