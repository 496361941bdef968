"""gptlab.plan: parameter count, the memory model against measured allocations, fit decisions."""

import dataclasses
import json

import pytest
import torch
from conftest import REPO, compose_config, run_cli

from gptlab import metrics
from gptlab.config import to_config
from gptlab.errors import GptlabError
from gptlab.model import GPT
from gptlab.plan import make_plan, param_count, resolve_micro_batch, shape_for


def cfg_for(*overrides):
    return resolve_micro_batch(to_config(compose_config(list(overrides))))


@pytest.mark.parametrize(
    "overrides",
    [
        ["model=gpt_char"],
        ["model=gpt_nano"],
        ["model=gpt1b", "model.n_layer=1", "model.n_embd=64", "model.n_head=4", "model.ffn_dim=100"],
        [
            "model=gpt_nano",
            "model.mlp=swiglu",
            "model.pos_emb=sinusoidal",
            "model.tie_weights=false",
            "model.bias=false",
            "model.vocab_multiple=64",
        ],
    ],
)
def test_param_count_matches_the_model(overrides):
    cfg = cfg_for(*overrides)
    model = GPT(dataclasses.replace(cfg.model, vocab_size=65))
    assert param_count(cfg, 65) == model.num_params()


def measured_peak_bytes(cfg, checkpointing: bool, vocab: int = 65, loss_chunk: int = 0, wrap=None) -> float:
    """Weights + AdamW state + the allocator's peak during one training step (after a first step).

    wrap: what to do to the model before training it (tests/fsdp_memory_probe.py shards it); the
    static bytes are then this rank's shards."""
    torch.manual_seed(0)
    model = GPT(dataclasses.replace(cfg.model, vocab_size=vocab))
    model.activation_checkpointing = checkpointing
    model.loss_chunk = loss_chunk
    model = wrap(model) if wrap else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, vocab, (cfg.micro_batch_size, cfg.model.block_size))

    def step():
        _, loss = model(x, x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # creates the optimizer state
    peak = metrics.cpu_peak_bytes(step)

    def local_bytes(t: torch.Tensor) -> int:
        t = t.to_local() if hasattr(t, "to_local") else t  # a shard's own bytes
        return t.numel() * t.element_size()

    static = sum(local_bytes(p) for p in model.parameters())
    static += sum(local_bytes(t) for s in opt.state.values() for t in s.values() if t.dim() > 0)
    return static + peak


@pytest.mark.parametrize("model", ["gpt_char", "gpt_nano"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_memory_estimate_within_7_percent_of_measured(model, checkpointing):
    cfg = cfg_for(f"model={model}", f"parallelism.activation_checkpointing={str(checkpointing).lower()}")
    predicted = make_plan(cfg).memory["total"]
    measured = measured_peak_bytes(cfg, checkpointing)
    print(f"{model} ckpt={checkpointing}: predicted {predicted / 2**20:.2f} MiB, measured {measured / 2**20:.2f} MiB")
    # measured (torch 2.13, CPU): gpt_char 43.30 / 43.16 MiB (+0.3%) and 20.54 / 20.61 (-0.3%) with
    # checkpointing; gpt_nano 2.97 / 2.86 (+3.8%) and 1.71 / 1.62 (+5.6%). One AdamW moment is 7-13%.
    assert predicted == pytest.approx(measured, rel=0.07)


@pytest.mark.parametrize("loss_chunk", [0, 256])
def test_memory_estimate_with_a_wide_vocabulary_whole_or_chunked(loss_chunk, monkeypatch):
    """A vocabulary of 8,192 on gpt_char's shape: the logits dominate the step unless chunked, and the
    memory model follows the allocator both ways (an over-estimate of 21% whole, 13% chunked)."""
    from gptlab import plan

    monkeypatch.setattr(plan, "vocab_for", lambda cfg: (8192, False))
    cfg = cfg_for("model=gpt_char", f"parallelism.loss_chunk={loss_chunk}")
    predicted = make_plan(cfg).memory["total"]
    measured = measured_peak_bytes(cfg, False, vocab=8192, loss_chunk=loss_chunk)
    print(f"loss_chunk={loss_chunk}: predicted {predicted / 2**20:.1f} MiB, measured {measured / 2**20:.1f} MiB")
    # measured (torch 2.13, CPU): 182.2 predicted / 150.3 MiB measured whole (+21%), 66.2 / 58.8 chunked
    # (+13%): the estimate errs on the safe side, by about that much and not more
    over = {0: (0.17, 0.25), 256: (0.08, 0.17)}[loss_chunk]
    assert over[0] < predicted / measured - 1 < over[1]


def test_loss_chunks_by_rule_where_the_logits_are_the_largest_tensor():
    assert make_plan(cfg_for("model=gpt_char")).shape.loss_chunk == 0  # 65 symbols: never worth it
    assert make_plan(cfg_for("model=gpt2_124m", "data.tokenizer.kind=gpt2")).shape.loss_chunk == 1024
    assert (
        make_plan(cfg_for("model=gpt2_124m", "data.tokenizer.kind=gpt2", "parallelism.loss_chunk=0")).shape.loss_chunk
        == 0
    )


def test_activations_per_layer_match_autograds_saved_tensors():
    """The per-token count of saved tensors (without checkpointing) for fp32 and bf16 autocast."""
    for precision, dtype in (("fp32", None), ("bf16", torch.bfloat16)):
        cfg = cfg_for("model=gpt_char", "model.n_layer=1", f"hardware.precision={precision}")
        model = GPT(dataclasses.replace(cfg.model, vocab_size=65))
        B, T = 4, cfg.model.block_size
        x = torch.randint(0, 65, (B, T))
        saved = {}
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}

        def pack(t, saved=saved, params=params):
            if t.untyped_storage().data_ptr() not in params and t.dim() >= 2:
                saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with (
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
            torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None),
        ):
            model(x, x)
        shape, _, _ = shape_for(cfg)
        d, V = cfg.model.n_embd, shape.vocab
        head = 4 * d + metrics._BYTES[precision] * d + 4 * V  # ln_f input, head input, log-softmax
        expected = metrics.activation_bytes_per_layer_token(shape, checkpointing=False) + head
        # the autocast weight copies are 2-D too: they are counted apart in memory_estimate
        weights = shape.matmul_params * 2 if dtype is not None else 0
        assert sum(saved.values()) - weights == pytest.approx(expected * B * T, rel=0.02)


def test_gpt1b_recipe_fits_40gb_only_with_checkpointing():
    cfg = cfg_for("experiment=gpt1b_shakespeare")
    plan = make_plan(cfg)
    assert cfg.world_size == 8 and plan.micro_batch == 8 and plan.checkpointing
    assert abs(plan.params - 1_011_224_385) / 1_011_224_385 < 0.001  # the reference's count
    assert plan.fits and plan.memory_ckpt["total"] < 40 * 2**30
    assert plan.memory_no_ckpt["total"] > plan.usable_bytes
    no_ckpt = make_plan(cfg_for("experiment=gpt1b_shakespeare", "parallelism.activation_checkpointing=false"))
    assert not no_ckpt.fits and no_ckpt.largest_fit is not None and no_ckpt.largest_fit < 8


def test_micro_batch_auto_uses_the_planner():
    cfg = cfg_for(
        "model=gpt2_124m",
        "data.tokenizer.kind=gpt2",
        "train.batch_size=64",
        "train.micro_batch_size=auto",
        "hardware.memory_gb=16",
    )
    mb = cfg.micro_batch_size
    assert 1 <= mb < 64 and 64 % mb == 0
    assert cfg.accum_steps == 64 // mb
    bigger = cfg_for(
        "model=gpt2_124m",
        "data.tokenizer.kind=gpt2",
        "train.batch_size=64",
        "train.micro_batch_size=auto",
        "hardware.memory_gb=64",
    )
    assert bigger.micro_batch_size > mb
    with pytest.raises(GptlabError, match="would fit"):
        cfg_for("model=gpt2_124m", "data.tokenizer.kind=gpt2", "train.micro_batch_size=auto", "hardware.memory_gb=0.5")
    with pytest.raises(GptlabError, match="train.micro_batch_size"):
        cfg_for("train.micro_batch_size=lots")


@pytest.mark.slow
def test_plan_cli_gpt1b(tmp_path):
    ok = run_cli(["gptlab.plan", "experiment=gpt1b_shakespeare"], cwd=REPO, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "with activation checkpointing: fits at micro-batch 8" in ok.stdout
    assert "without activation checkpointing: does not fit at micro-batch 8" in ok.stdout
    no = run_cli(
        ["gptlab.plan", "experiment=gpt1b_shakespeare", "parallelism.activation_checkpointing=false"],
        cwd=REPO,
        timeout=120,
    )
    assert no.returncode == 2
    err = no.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("gptlab.plan: error: train.micro_batch_size=8")
    assert "parallelism.activation_checkpointing=true" in err[0]


@pytest.mark.slow
def test_fsdp_memory_estimate_within_25_percent_of_measured_on_two_processes(tmp_path):
    """The sharded memory model against the allocator's peak of a real 2-process fsdp step (gloo)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    models, checkpointing = ("gpt_nano", "gpt_char"), ("false", "true")
    specs = [f"model={m} parallelism.activation_checkpointing={ac}" for m in models for ac in checkpointing]
    torchrun = str(Path(sys.executable).parent / "torchrun")
    probe = REPO / "tests" / "fsdp_memory_probe.py"
    r = subprocess.run([torchrun, "--nproc_per_node=2", str(probe), *specs], capture_output=True, text=True,
                       timeout=300, cwd=tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    measured = json.loads(r.stdout.strip().splitlines()[-1])
    for spec in specs:
        cfg = cfg_for(*spec.split(), "hardware=cpu_x2", "parallelism=fsdp")
        predicted = make_plan(cfg).memory["total"]
        print(f"{spec}: predicted {predicted / 2**20:.2f} MiB, measured {measured[spec] / 2**20:.2f} MiB")
        assert predicted == pytest.approx(measured[spec], rel=0.25), spec
    # sharding is what the estimate is about: the same run unsharded needs more per device
    assert make_plan(cfg_for("model=gpt_char", "hardware=cpu_x2")).memory["weights"] == pytest.approx(
        2 * make_plan(cfg_for("model=gpt_char", "hardware=cpu_x2", "parallelism=fsdp")).memory["weights"]
    )


def test_a_ddp_run_that_does_not_fit_is_told_the_fsdp_setting_that_would():
    from gptlab.plan import main

    # 2.65B parameters on A100-40GB: DDP's 20 bytes per parameter alone are 49 GiB
    with pytest.raises(GptlabError, match=r"would fit: parallelism=fsdp \(14.0 GiB per device\)$"):
        main(["experiment=gpt_2b7_fsdp", "parallelism=ddp"])
    assert main(["experiment=gpt_2b7_fsdp"])["fits"]
    # a smaller model that DDP holds only with checkpointing: fsdp is named first, without it
    args = ["model=gpt2_1558m", "data=fineweb_edu", "hardware=a100x8", "train.batch_size=128"]
    with pytest.raises(GptlabError, match=r"would fit: parallelism=fsdp parallelism.activation_checkpointing=false"):
        main([*args, "train.micro_batch_size=8"])


def test_the_readmes_planner_figures(capsys):
    """README quotes these for the 1B recipe: 20.9 GiB with checkpointing (fits), 40.9 GiB without,
    more than the 36.8 GiB usable, and the two settings that would fit."""
    from gptlab.plan import main

    gib = 2**30
    out = main(["experiment=gpt1b_shakespeare"])
    report = capsys.readouterr().out
    assert out["fits"] and out["activation_checkpointing"] and out["micro_batch_size"] == 8
    assert f"{out['memory_ckpt']['total'] / gib:.1f}" == "20.9"
    assert f"{out['memory_no_ckpt']['total'] / gib:.1f}" == "40.9"
    assert out["usable_bytes"] == pytest.approx(0.92 * 40 * gib)  # 36.8 GiB: 92% of an A100-40GB
    assert "  peak (estimate)                               20.86 GiB         40.93 GiB\n" in report
    assert "device memory 40.0 GiB, usable 36.8 GiB (92%)" in report
    assert "with activation checkpointing: fits at micro-batch 8" in report
    assert "without activation checkpointing: does not fit at micro-batch 8" in report
    with pytest.raises(GptlabError) as e:
        main(["experiment=gpt1b_shakespeare", "parallelism.activation_checkpointing=false"])
    # the README's quote of this error (a comment of two lines under the command) is the error
    lines = (REPO / "README.md").read_text().splitlines()
    command = "python -m gptlab.plan experiment=gpt1b_shakespeare parallelism.activation_checkpointing=false"
    at = next(i for i, line in enumerate(lines) if line.startswith(command))
    quoted = " ".join(line[2:] for line in lines[at + 1 : at + 3])
    assert quoted == f"gptlab.plan: error: {e.value}"
    assert "needs 40.9 GiB per device, more than the 36.8 GiB usable" in quoted
    assert "would fit: parallelism=fsdp" in quoted and "parallelism.activation_checkpointing=true (20.9 GiB)" in quoted


def test_plan_json_is_one_object_of_the_plans_figures(capsys):
    from gptlab.plan import main

    out = main(["model=gpt_nano", "plan.json=true", "plan.mfu=0.3"])
    printed = capsys.readouterr().out.strip()
    assert "\n" not in printed

    assert json.loads(printed) == json.loads(json.dumps(out))  # what main returns is what it printed
    cfg = cfg_for("model=gpt_nano")
    plan = make_plan(cfg)
    assert out["params"] == plan.params == param_count(cfg, 65) and out["expected_mfu"] == 0.3
    assert out["memory"]["total"] == plan.memory["total"] and out["fits"] is True
    assert out["accum_steps"] * out["micro_batch_size"] * out["world_size"] == cfg.train.batch_size
    assert out["hardware_flops_per_token"] >= out["flops_per_token"] > 6 * out["params"] * 0.5
