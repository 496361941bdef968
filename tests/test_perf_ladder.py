"""The tuning ladder (gptlab/perf/ladder.py): which levers apply where, what is kept, a real
ladder."""

from __future__ import annotations

import json
import os

import pytest
import torch
import warm_start

from gptlab import cli
from gptlab.bench import BenchConfig, bench_config
from gptlab.config import to_config
from gptlab.perf import fastpath, ladder


def compose(shakespeare, *extra):
    return cli.compose("bench", [f"data.path={shakespeare}", *extra])


def typed(cfg):
    return to_config(bench_config(cfg), BenchConfig)


def skipped(rungs):
    return {r.name: r.skip for r in rungs if r.skip}


@pytest.mark.integration
def test_a_cpu_without_bf16_units_or_a_compiler_skips_those_rungs_with_the_reason(
    shakespeare, monkeypatch
):
    monkeypatch.setattr(fastpath, "cpu_bf16_units", lambda: True)
    rungs = ladder.plan_rungs(compose(shakespeare, "model=gpt_nano"), typed)
    assert rungs[0].name == "plain fp32" and rungs[0].adds == ladder.PLAIN
    skips = skipped(rungs)
    assert "+ bf16 autocast" not in skips
    assert "GPU" in skips["+ TF32"]
    # vocab 65 against a 4 x 32 MLP: the logits are not the largest tensor
    assert "no chunking" in skips["+ chunked loss"]

    monkeypatch.setattr(fastpath, "cpu_bf16_units", lambda: False)
    monkeypatch.setenv("CXX", "no-such-compiler")
    skips = skipped(ladder.plan_rungs(compose(shakespeare, "model=gpt_nano"), typed))
    assert "no bf16 units" in skips["+ bf16 autocast"]
    assert "no-such-compiler" in skips["+ torch.compile"]
    # a model with dropout cannot use the CPU's fused attention
    skips = skipped(
        ladder.plan_rungs(compose(shakespeare, "model=gpt_nano", "model.dropout=0.1"), typed)
    )
    assert "dropout" in skips["+ fused attention (SDPA)"]


@pytest.mark.integration
def test_a_gpu_gets_tf32_and_bf16_from_ampere_on_and_a_batch_that_can_grow_gets_its_rung(
    shakespeare, monkeypatch
):
    gpu = ("hardware=gpu", "hardware.memory_gb=40", "hardware.peak_tflops=312", "model=gpt_nano",
           "train.batch_size=64", "train.micro_batch_size=4")  # fmt: skip
    monkeypatch.setattr(fastpath, "gpu_capability", lambda: (8, 0))
    rungs = ladder.plan_rungs(compose(shakespeare, *gpu), typed)
    skips = skipped(rungs)
    assert "+ TF32" not in skips and "+ bf16 autocast" not in skips
    assert "+ larger micro-batch" not in skips  # 4 of 64 sequences: auto fits all 64
    assert "+ flash attention" in [r.name for r in rungs]
    assert "CPU threads" in skips["+ threads per core"]
    monkeypatch.setattr(fastpath, "gpu_capability", lambda: (7, 0))
    skips = skipped(ladder.plan_rungs(compose(shakespeare, *gpu), typed))
    assert "sm_70" in skips["+ TF32"] and "sm_70" in skips["+ bf16 autocast"]


@pytest.mark.integration
def test_a_lever_that_slows_the_step_is_shown_and_not_kept_and_the_repeats_give_the_drift(
    shakespeare, monkeypatch, tmp_path
):
    """climb's bookkeeping on scripted figures: the ladder's arithmetic, not the machine's."""
    monkeypatch.setattr(fastpath, "cpu_bf16_units", lambda: True)
    monkeypatch.setenv("CXX", "no-such-compiler")
    # torch's default is a thread per core: the threads rung has nothing to try, on any machine
    monkeypatch.setattr(ladder, "physical_cores", torch.get_num_threads)
    speeds = {"plain fp32": 100.0, "+ bf16 autocast": 80.0, "+ fused attention (SDPA)": 150.0,
              "+ fused AdamW": 165.0}  # fmt: skip
    calls = []

    def fake_run(base, settings, folder, nproc):
        calls.append(dict(settings))
        if folder.name == "again-plain":
            return {"tokens_per_s": 104.0, "mfu": 0.1}
        if folder.name == "again-best":
            return {"tokens_per_s": 160.0, "mfu": 0.1}
        if folder.name.endswith("-again"):  # bf16 tried once more, on the best setting
            return {"tokens_per_s": 176.0, "mfu": 0.1, "precision": "bf16"}
        rung = ladder.plan_rungs(compose(shakespeare, "model=gpt_nano"), typed)[int(folder.name)]
        return {"tokens_per_s": speeds[rung.name], "mfu": 0.1, "precision": "fp32"}

    monkeypatch.setattr(ladder, "run_one", fake_run)
    said = []
    result = ladder.climb(compose(shakespeare, "model=gpt_nano"), typed, [], tmp_path, said.append)
    rows = {r.name: r for r in result.rungs}
    assert not rows["+ bf16 autocast"].kept and rows["+ bf16 autocast"].speedup_prev == 0.8
    # the rung after the slower one builds on the best setting: bf16 is not in it
    assert calls[2]["hardware.precision"] == "fp32"
    assert rows["+ fused attention (SDPA)"].speedup_prev == 1.5
    assert rows["+ fused AdamW"].speedup_prev == pytest.approx(1.1)
    assert rows["+ fused AdamW"].speedup_plain == pytest.approx(1.65)
    best = {**ladder.PLAIN, "hardware.attention_backend": "auto", "optimizer.fused": True}
    # the dropped lever is measured again on the best setting, and kept now that it wins there
    again = rows["+ bf16 autocast (again, on the best)"]
    assert calls[-3] == {**best, "hardware.precision": "bf16"}
    assert again.kept and again.speedup_prev == pytest.approx(176 / 165)
    assert calls[-1] == {**best, "hardware.precision": "bf16"}  # the best, measured again
    assert ladder.drift(result) == {"plain": 0.04, "best": pytest.approx(-0.0909, abs=1e-4)}
    text = ladder.table(result)
    assert "slower" in " ".join(said)
    assert "skipped: inductor needs a C++ compiler" in text and "plain +4.0%" in text
    json.dumps(ladder.as_json(result))


@pytest.mark.integration
def test_a_dropped_lever_is_not_measured_again_when_nothing_was_kept_after_it(
    shakespeare, monkeypatch, tmp_path
):
    monkeypatch.setattr(fastpath, "cpu_bf16_units", lambda: False)
    monkeypatch.setenv("CXX", "no-such-compiler")
    monkeypatch.setattr(ladder, "physical_cores", torch.get_num_threads)
    # the last lever measured is the slower one: the best setting never moves past it
    speeds = {"plain fp32": 100.0, "+ fused attention (SDPA)": 150.0, "+ fused AdamW": 140.0}
    folders = []

    def fake_run(base, settings, folder, nproc):
        folders.append(folder.name)
        if folder.name.startswith("again-"):
            return {"tokens_per_s": 150.0, "mfu": 0.1}
        rung = ladder.plan_rungs(compose(shakespeare, "model=gpt_nano"), typed)[int(folder.name)]
        return {"tokens_per_s": speeds[rung.name], "mfu": 0.1}

    monkeypatch.setattr(ladder, "run_one", fake_run)
    result = ladder.climb(compose(shakespeare, "model=gpt_nano"), typed, [], tmp_path, print)
    assert not any("again, on the best" in r.name for r in result.rungs)
    assert not any(f.endswith("-again") for f in folders)
    assert [r.name for r in result.rungs if r.kept][-1] == "+ fused attention (SDPA)"


@pytest.mark.slow
def test_the_ladder_measures_each_rung_in_its_own_benchmark_and_prints_one_table(
    shakespeare, tmp_path, monkeypatch, capsys
):
    """bench.ladder=true's job (gptlab.bench._job's ladder.run) here: each rung a real benchmark."""
    # compile's rung is skipped (minutes on a CPU), and with dropout the fused attention's: the
    # rungs measured are plain, bf16 and fused AdamW, then the two measured again
    monkeypatch.setenv("CXX", "no-such-compiler")
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)  # as a user's shell starts the rungs
    monkeypatch.chdir(tmp_path)
    if warm_start.enabled():  # each rung still its own `-m gptlab.bench` process, forked warm
        python = warm_start.python_env()["PYTHON"]
        monkeypatch.setattr(ladder, "bench_command", lambda nproc: [python, "-m", "gptlab.bench"])
    folder = tmp_path / "ladder"
    args = ["bench.ladder=true", "model=gpt_nano", f"data.path={shakespeare}", "bench.warmup=1",
            "bench.steps=3", "train.batch_size=8", "hardware.precision=bf16",
            "model.dropout=0.1"]  # fmt: skip
    ladder.run(cli.compose("bench", args), typed, args, folder)
    out = capsys.readouterr()
    line = json.loads(out.out.strip().splitlines()[-1])
    assert line == json.loads((folder / "ladder.json").read_text())
    rows = {r["rung"]: r for r in line["ladder"]}
    assert rows["plain fp32"]["precision"] == "fp32"  # the plain rung overrides the user's bf16
    assert rows["plain fp32"]["attention_backend"] == "math"
    assert rows["plain fp32"]["speedup_plain"] == 1.0
    assert "C++ compiler" in rows["+ torch.compile"]["skipped"]
    measured = [r for r in line["ladder"] if "tokens_per_s" in r]
    # bf16's rung is measured only on a CPU with bf16 units (CI's CPU model varies)
    assert len(measured) >= 2 + fastpath.cpu_bf16_units()
    assert all(r["tokens_per_s"] > 0 for r in measured)
    assert set(line["drift"]) == {"plain", "best"} and line["drift"]["plain"] is not None
    # each measured rung ran as its own benchmark in its own folder
    benches = sorted(p.parent.name for p in folder.glob("*/bench.json"))
    # the rungs, and the plainest and the best measured again (one, if no lever was kept)
    assert len(benches) in (len(measured) + 1, len(measured) + 2)
    table = out.out
    assert "x plain" in table and "measured again at the end" in table
    assert os.path.exists(folder / "ladder.txt")
