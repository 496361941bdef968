"""gptlab.fastpath: hardware.precision=auto and hardware.compile=auto decide as measured, say why,
and a set value is kept; train.profile leaves a trace Perfetto opens and the operator table."""

from __future__ import annotations

import json
import os

import pytest
import torch
from helpers import compose_config, nano_overrides

from gptlab import costs, fastpath
from gptlab.config import to_config
from gptlab.errors import GptlabError

BABY = ["model.n_layer=6", "model.n_embd=384", "model.n_head=6", "model.block_size=256"]


def resolved(overrides, **patch):
    cfg = to_config(compose_config(overrides))
    return costs.resolve_auto(cfg)


@pytest.fixture
def cpu_units(monkeypatch):
    """Patch what the CPU reports: set(avx512_bf16, amx)."""

    def set_units(avx512_bf16: bool, amx: bool) -> None:
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)

    return set_units


@pytest.mark.parametrize("avx512_bf16,amx", [(False, True), (True, False)])
def test_on_a_cpu_with_bf16_units_a_wide_model_gets_bf16_and_the_default_fp32(
    cpu_units, avx512_bf16, amx
):
    cpu_units(avx512_bf16, amx)
    cfg, choices = resolved(BABY + ["train.max_steps=20"])
    assert cfg.hardware.precision == "bf16" and choices["precision"].auto
    assert "width 384" in choices["precision"].reason
    cfg, choices = resolved([])  # gpt_char: 4 x 128
    assert cfg.hardware.precision == "fp32"
    assert "width 128" in choices["precision"].reason


def test_a_cpu_without_bf16_units_stays_fp32_at_any_width(cpu_units):
    cpu_units(False, False)
    cfg, choices = resolved(BABY)
    assert cfg.hardware.precision == "fp32"
    assert "no bf16 units" in choices["precision"].reason


@pytest.mark.parametrize(
    "capability,precision", [((8, 0), "bf16"), ((9, 0), "bf16"), ((7, 0), "fp32"), ((7, 5), "fp32")]
)
def test_on_a_gpu_ampere_and_newer_get_bf16_and_older_ones_fp32_never_fp16(
    monkeypatch, capability, precision
):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    got = fastpath.choose_precision("auto", "cuda", 768)
    assert got.value == precision and got.auto
    assert f"sm_{capability[0]}{capability[1]}" in got.reason


def test_a_set_precision_or_compile_is_kept(cpu_units):
    cpu_units(True, True)
    cfg, choices = resolved(["hardware.precision=fp16", "hardware.compile=false", *BABY])
    assert cfg.hardware.precision == "fp16" and not choices["precision"].auto
    assert cfg.compile is False and not choices["compile"].auto
    cfg, _ = resolved(["hardware.precision=bf16", "parallelism.compile=true"])
    assert cfg.hardware.precision == "bf16" and cfg.compile is True


def test_compile_is_chosen_for_a_long_run_and_not_for_a_short_one(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "empty"))  # a cold cache
    short = fastpath.choose_compile("auto", "cuda", 20, 0.1)
    assert short.value is False and short.auto and "20 steps" in short.reason
    cost = fastpath.COMPILE_COST_S["cuda"][0]
    steps = int(2 * cost / (fastpath.COMPILE_SAVING["cuda"] * 0.1))
    long = fastpath.choose_compile("auto", "cuda", steps, 0.1)
    assert long.value is True and f"{steps:,} steps" in long.reason
    # on the CPU a compiled step measured no faster: eager however long the run
    cpu = fastpath.choose_compile("auto", "cpu", 10**6, 1.0)
    assert cpu.value is False and "no faster" in cpu.reason
    monkeypatch.setitem(fastpath.COMPILE_SAVING, "cpu", 0.2)  # a CPU where it pays
    assert fastpath.choose_compile("auto", "cpu", 10**6, 1.0).value is True
    monkeypatch.setattr(fastpath.shutil, "which", lambda name: None)
    no_compiler = fastpath.choose_compile("auto", "cpu", 10**6, 1.0)
    assert no_compiler.value is False and "C++ compiler" in no_compiler.reason


def test_a_warm_inductor_cache_lowers_the_cost_compiling_must_repay(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    cold, warm = fastpath.COMPILE_COST_S["cpu"]
    assert fastpath.compile_cost_s("cpu") == cold
    (tmp_path / "inductor").mkdir()
    (tmp_path / "inductor" / "fxgraph").mkdir()
    assert fastpath.compile_cost_s("cpu") == warm


def test_the_inductor_cache_defaults_to_gptlabs_cache_folder(monkeypatch, tmp_path):
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("GPTLAB_CACHE_DIR", str(tmp_path))
    assert fastpath.use_inductor_cache() == tmp_path / "inductor"
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert fastpath.use_inductor_cache() == tmp_path / "mine"  # the user's choice stands


def test_an_unresolved_auto_is_refused_where_a_decision_is_needed():
    cfg = to_config(compose_config([]))
    assert cfg.hardware.compile == "auto"
    with pytest.raises(GptlabError, match="costs.resolve_auto"):
        _ = cfg.compile


@pytest.mark.parametrize(
    "override,words",
    [
        ("hardware.precision=fp8", "hardware.precision=fp8: must be one of auto, fp32"),
        ("hardware.compile=maybe", "hardware.compile=maybe: must be one of auto, true, false"),
        ("train.profile.steps=[5]", "give the first and last step"),
        ("train.profile.steps=[7,5]", "need 1 <= first <= last"),
        ("train.profile.steps=[50,60]", "the run ends at step 20 first"),
    ],
)
def test_bad_settings_are_one_line(shakespeare, override, words):
    with pytest.raises(GptlabError) as e:
        to_config(compose_config(nano_overrides(shakespeare, override)))
    assert words in str(e.value) and "\n" not in str(e.value)


def test_the_summary_line_and_mlflow_say_what_auto_chose_and_why(
    shakespeare, tmp_path, monkeypatch
):
    from mlflow.tracking import MlflowClient

    from gptlab.train import run_training

    # the width rule, whatever this CPU has (without bf16 units the reason names those instead)
    monkeypatch.setattr(fastpath, "cpu_bf16_units", lambda: True)

    overrides = nano_overrides(
        shakespeare, "tracking.mlflow=true", "train.sample_tokens=0",
        f"paths.outputs={tmp_path}/outputs", "train.profile.steps=[2,3]",
    )  # fmt: skip
    results = run_training(compose_config(overrides), tmp_path / "run")
    config = json.loads((tmp_path / "run" / "derived.json").read_text())
    assert config["precision"] == "fp32" and config["precision_auto"] is True
    assert config["compile"] is False and "no faster" in config["compile_reason"]
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/outputs/mlflow.db")
    run = client.get_run(results["mlflow_run_id"])
    assert run.data.params["derived.precision"] == "fp32"
    assert "width 32" in run.data.params["derived.precision_reason"]
    # the profile of steps 2..3: a Chrome trace with those steps' ranges, and the operator table
    trace = json.loads((tmp_path / "run" / "profile" / "trace_rank0.json").read_text())
    steps = {e["name"] for e in trace["traceEvents"] if e.get("name", "").startswith("step ")}
    assert steps == {"step 2", "step 3"}
    assert any(e.get("name") == "aten::mm" for e in trace["traceEvents"])
    table = (tmp_path / "run" / "profile" / "operators_rank0.txt").read_text()
    assert "Self CPU" in table and "aten::" in table
    logged = {a.path for a in client.list_artifacts(run.info.run_id, "profile")}
    assert logged == {"profile/trace_rank0.json", "profile/operators_rank0.txt"}


def test_threads_auto_takes_one_thread_where_it_multiplies_faster():
    """A busy CPU (another process on the cores): threads wait for each other at every matmul, so
    one is faster; an idle one keeps torch's default. A set count or null is used as given."""
    busy = {4: 20e9, 1: 30e9}.__getitem__
    idle = {4: 100e9, 1: 30e9}.__getitem__
    choice = fastpath.choose_threads("auto", "cpu", 4, busy)
    assert choice.value == 1 and choice.auto and "busy" in choice.reason
    assert fastpath.choose_threads("auto", "cpu", 4, idle).value == 4
    assert fastpath.choose_threads("auto", "cpu", 1, busy).value == 1  # nothing to measure
    assert fastpath.choose_threads(3, "cpu", 4, busy) == fastpath.Choice(3, "set", False)
    assert fastpath.choose_threads(None, "cpu", 4, busy).value is None
    assert fastpath.choose_threads("auto", "cuda", 4, busy).value is None


def test_a_busy_cpu_is_named_on_the_summary_line(monkeypatch):
    """resolve applies auto's choice to torch and the summary says why."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    set_to = []
    monkeypatch.setattr(torch, "set_num_threads", set_to.append)
    cfg = to_config(compose_config(["hardware.threads=auto", "model=gpt_nano"]))
    busy = {2: 1e9, 1: 3e9}.__getitem__
    resolved, choices = fastpath.resolve(cfg, lambda c: None, 10, busy)
    assert resolved.hardware.threads == 1 and set_to == [1]
    _, clause = fastpath.summary(fastpath.derived(choices), "fp32")
    assert (
        "1 thread (auto: the CPU is busy: 1 thread multiplies at 3 GFLOP/s, 2 threads at 1)"
        in clause
    )


@pytest.mark.parametrize("value", ["many", 0, -2, 1.5])
def test_threads_must_be_auto_a_count_or_null(value):
    with pytest.raises(GptlabError, match="hardware.threads"):
        to_config(compose_config([f"hardware.threads={value}"]))
