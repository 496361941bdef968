"""gptlab.perf.fastpath: hardware.precision=auto and hardware.compile=auto decide as measured, say
why, and a set value is kept; train.profile leaves a trace Perfetto opens and the operator table."""

from __future__ import annotations

import json
import os

import pytest
import torch
from helpers import compose_config, nano_overrides

from gptlab.config import to_config
from gptlab.errors import GptlabError
from gptlab.perf import costs, fastpath

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
@pytest.mark.integration
def test_on_a_cpu_with_bf16_units_a_wide_model_gets_bf16_and_the_default_fp32(
    cpu_units, avx512_bf16, amx, monkeypatch
):
    cpu_units(avx512_bf16, amx)
    # compile's rule reads the peak at the chosen precision: a CPU without the units only emulates
    # the bf16 matmul that would measure it, and the peak is not what this test decides
    monkeypatch.setattr(costs, "measured_cpu_peak", lambda *args, **kwargs: 1e11)
    cfg, choices = resolved(BABY + ["train.max_steps=20"])
    assert cfg.hardware.precision == "bf16" and choices["precision"].auto
    assert "width 384" in choices["precision"].reason
    cfg, choices = resolved([])  # gpt_char: 4 x 128
    assert cfg.hardware.precision == "fp32"
    assert "width 128" in choices["precision"].reason


@pytest.mark.integration
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


@pytest.mark.integration
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


@pytest.mark.integration
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


@pytest.mark.integration
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


# ---- each rule's boundaries and wording, in process


def test_the_cpu_bf16_rule_turns_on_at_width_192_with_the_units():
    choose = fastpath.choose_precision
    assert fastpath.CPU_BF16_MIN_WIDTH == 192
    assert choose("auto", "cpu", 191, cpu_bf16=True) == fastpath.Choice(
        "fp32", "width 191 < 192: bf16's casts cost more", True
    )
    assert choose("auto", "cpu", 192, cpu_bf16=True) == fastpath.Choice(
        "bf16", "bf16 units, width 192 >= 192", True
    )
    assert choose("auto", "cpu", 4096, cpu_bf16=False) == fastpath.Choice(
        "fp32", "this CPU has no bf16 units (AVX-512-BF16 or AMX)", True
    )
    assert choose("fp16", "cpu", 4096, cpu_bf16=True) == fastpath.Choice("fp16", "set", False)
    assert choose("fp32", "cuda", 64, capability=(9, 0)) == fastpath.Choice("fp32", "set", False)


def test_the_cpus_bf16_units_are_avx512_bf16_or_amx(cpu_units):
    for avx512_bf16, amx in [(False, False), (True, False), (False, True), (True, True)]:
        cpu_units(avx512_bf16, amx)
        assert fastpath.cpu_bf16_units() is (avx512_bf16 or amx)
        want = "bf16" if avx512_bf16 or amx else "fp32"
        assert fastpath.choose_precision("auto", "cpu", 384).value == want  # read when not given


def test_the_gpu_rule_is_sm_80_and_up_and_assumes_ampere_where_no_gpu_is_visible(monkeypatch):
    choose = fastpath.choose_precision
    assert choose("auto", "cuda", 64, capability=(8, 0)) == fastpath.Choice(
        "bf16", "sm_80 has bf16 tensor cores", True
    )
    assert choose("auto", "cuda", 64, capability=(8, 6)).value == "bf16"
    assert choose("auto", "cuda", 64, capability=(7, 5)) == fastpath.Choice(
        "fp32", "sm_75 has no bf16 tensor cores", True
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert fastpath.gpu_capability() is None
    assert choose("auto", "cuda", 64) == fastpath.Choice(
        "bf16", "no GPU visible here: assumed Ampere or newer", True
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: [7, 0])
    assert fastpath.gpu_capability() == (7, 0)
    assert choose("auto", "cuda", 64).value == "fp32"  # the visible GPU's capability is read

    def cannot_say(device=None):
        raise RuntimeError("driver")

    monkeypatch.setattr(torch.cuda, "get_device_capability", cannot_say)
    assert fastpath.gpu_capability() is None


def test_compile_pays_only_when_its_saving_exceeds_its_cost(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cold"))
    assert (
        fastpath.COMPILE_COST_S["cuda"] == (90.0, 20.0) and fastpath.COMPILE_SAVING["cuda"] == 0.5
    )
    even = fastpath.choose_compile("auto", "cuda", 1800, 0.1)  # saves 0.5 x 1800 x 0.1 = 90 s
    assert even == fastpath.Choice(
        False, "1,800 steps of ~100 ms: compiling saves ~90 s, costs ~90 s", True
    )
    assert fastpath.choose_compile("auto", "cuda", 1801, 0.1).value is True
    auto = "".join(["au", "to"])  # "auto" as a config gives it: equal, not the same object
    assert fastpath.choose_compile(auto, "cuda", 1801, 0.1).auto
    for step_s in (None, 0.0):
        assert fastpath.choose_compile("auto", "cuda", 10**6, step_s) == fastpath.Choice(
            False, "the step time is unknown", True
        )
    assert fastpath.choose_compile(True, "cuda", 0, None) == fastpath.Choice(True, "set", False)
    assert fastpath.choose_compile(False, "cpu", 0, None) == fastpath.Choice(False, "set", False)
    assert fastpath.choose_compile("auto", "cpu", 10**6, 1.0) == fastpath.Choice(
        False, "a compiled step measured no faster on the CPU", True
    )
    monkeypatch.setitem(fastpath.COMPILE_SAVING, "cpu", 0.2)
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    assert fastpath.choose_compile("auto", "cpu", 10**6, 1.0) == fastpath.Choice(
        False, "inductor needs a C++ compiler (g++) on the CPU", True
    )


def test_durations_are_said_in_the_unit_that_reads_best():
    said = [
        fastpath._seconds(s) for s in (0.0123, 0.9996, 1.0, 119.4, 120.0, 7199.0, 7200.0, 9000.0)
    ]
    assert said == ["12 ms", "1000 ms", "1 s", "119 s", "2 min", "120 min", "2.0 h", "2.5 h"]


def test_the_inductor_cache_is_its_own_setting_else_under_gptlabs_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "ind"))
    monkeypatch.setenv("GPTLAB_CACHE_DIR", str(tmp_path / "gl"))
    assert fastpath.inductor_cache() == tmp_path / "ind"
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    assert fastpath.inductor_cache() == tmp_path / "gl" / "inductor"
    monkeypatch.delenv("GPTLAB_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert fastpath.inductor_cache() == tmp_path / "home" / ".cache" / "gptlab" / "inductor"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "ind"))
    (tmp_path / "ind").mkdir()
    assert fastpath.compile_cost_s("cuda") == 90.0  # an empty cache is a cold one
    (tmp_path / "ind" / "x").write_text("")
    assert fastpath.compile_cost_s("cuda") == 20.0


@pytest.mark.integration
def test_resolve_decides_precision_compile_and_threads_and_keeps_a_set_thread_count(
    monkeypatch, cpu_units
):
    cpu_units(True, False)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    set_to = []
    monkeypatch.setattr(torch, "set_num_threads", set_to.append)
    monkeypatch.setitem(fastpath.COMPILE_SAVING, "cpu", 0.5)
    monkeypatch.setattr(fastpath, "compile_cost_s", lambda device: 10.0)
    seen = []

    def step_s(cfg):
        seen.append((cfg.hardware.precision, cfg.hardware.threads))
        return 0.5

    cfg = to_config(compose_config(["model=gpt_nano", "model.n_embd=192", "train.max_steps=41",
                                    "hardware.threads=null"]))  # fmt: skip
    assert (cfg.hardware.precision, cfg.hardware.compile, cfg.hardware.threads) == (
        "auto", "auto", None
    )  # fmt: skip
    out, choices = fastpath.resolve(cfg, step_s)  # 0.5 x 41 x 0.5 = 10.25 s saved > 10 s
    assert seen == [("bf16", None)]  # the step time is that of the decided config
    assert (out.hardware.precision, out.hardware.compile, out.hardware.threads) == (
        "bf16",
        True,
        None,
    )
    assert out.parallelism.compile is None and set_to == []  # threads as set: none changed
    assert choices["compile"].reason.startswith("41 steps of ~500 ms")
    _, choices = fastpath.resolve(cfg, step_s, steps=40)  # 10 s saved: not more than it costs
    assert choices["compile"].value is False and seen[-1] == ("bf16", None)
    both = ["model=gpt_nano", "hardware.compile=true", "parallelism.compile=false"]
    both = to_config(compose_config([*both, "hardware.threads=3"]))
    out, choices = fastpath.resolve(both, step_s)
    assert out.hardware.compile is False and choices["compile"] == fastpath.Choice(
        False, "set", False
    )
    assert out.hardware.threads == 3 and set_to == []
    assert choices["threads"] == fastpath.Choice(3, "set", False)
    auto_threads = to_config(compose_config(["model=gpt_nano", "hardware.threads=auto"]))
    out, choices = fastpath.resolve(auto_threads, step_s, rate={2: 9e9, 1: 5e9}.__getitem__)
    assert out.hardware.threads == 2 and set_to == [2]  # auto's choice is applied to torch


def test_with_precision_decides_only_an_auto_precision(cpu_units):
    cpu_units(False, True)
    cfg = to_config(compose_config(["model=gpt_nano", "model.n_embd=256"]))
    assert fastpath.with_precision(cfg).hardware.precision == "bf16"
    assert fastpath.with_precision(cfg).hardware.compile == "auto"  # nothing else decided
    fp16 = to_config(compose_config(["model=gpt_nano", "hardware.precision=fp16"]))
    assert fastpath.with_precision(fp16) is fp16


def test_the_choices_as_run_figures_and_on_the_summary_line():
    choices = {
        "precision": fastpath.Choice("bf16", "sm_80 has bf16 tensor cores", True),
        "compile": fastpath.Choice(True, "set", False),
        "threads": fastpath.Choice(1, "the CPU is busy: 1 thread wins", True),
    }
    x = fastpath.derived(choices)
    assert x == {
        "precision": "bf16", "precision_auto": True,
        "precision_reason": "sm_80 has bf16 tensor cores",
        "compile": True, "compile_auto": False, "compile_reason": "set",
        "threads": 1, "threads_auto": True, "threads_reason": "the CPU is busy: 1 thread wins",
    }  # fmt: skip
    assert fastpath.summary(x, "bf16") == (
        "bf16 (auto: sm_80 has bf16 tensor cores)",
        " | compiled | 1 thread (auto: the CPU is busy: 1 thread wins)",
    )
    eager_auto = {**x, "compile": False, "compile_auto": True, "compile_reason": "short run"}
    assert fastpath.summary(eager_auto, "bf16")[1] == (
        " | eager (auto: short run) | 1 thread (auto: the CPU is busy: 1 thread wins)"
    )
    compiled_auto = {**eager_auto, "compile": True, "threads": 2}
    assert fastpath.summary(compiled_auto, "bf16")[1] == " | compiled (auto: short run)"
    plain = {**x, "precision_auto": False, "compile": False, "threads_auto": False}
    assert fastpath.summary(plain, "fp16") == ("fp16", "")
    idle = {**x, "threads_reason": "100 GFLOP/s, 1 thread 30"}  # one thread, but not busy
    assert fastpath.summary(idle, "bf16")[1] == " | compiled"


def test_threads_auto_says_the_rates_it_compared():
    busy = "the CPU is busy: 1 thread multiplies at 30 GFLOP/s, 4 threads at 20"
    assert fastpath.choose_threads("auto", "cpu", 4, {4: 20e9, 1: 30e9}.__getitem__) == (
        fastpath.Choice(1, busy, True)
    )
    assert fastpath.choose_threads("auto", "cpu", 4, {4: 30e9, 1: 30e9}.__getitem__).value == 1
    assert fastpath.choose_threads("auto", "cpu", 4, {4: 31e9, 1: 30e9}.__getitem__) == (
        fastpath.Choice(4, "31 GFLOP/s, 1 thread 30", True)
    )
    assert fastpath.choose_threads("auto", "cpu", 4, None) == fastpath.Choice(
        4, "one core for this process", True
    )
    assert fastpath.choose_threads("auto", "cpu", 1, {}.__getitem__) == fastpath.Choice(
        1, "one core for this process", True
    )
    assert fastpath.choose_threads("auto", "cuda", 4, None) == fastpath.Choice(
        None, "the GPU does the work", True
    )


def test_the_gpu_rule_reads_the_first_gpu_and_a_cuda_config_gets_it(monkeypatch, cpu_units):
    asked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability",
                        lambda device=None: asked.append(device) or (7, 5))  # fmt: skip
    assert fastpath.gpu_capability() == (7, 5) and asked == [0]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cpu_units(False, False)  # the CPU rule would say fp32
    cuda = to_config(compose_config(["model=gpt_nano", "hardware.device=cuda"]))
    assert fastpath.with_precision(cuda).hardware.precision == "bf16"  # no GPU here: assumed
    out, choices = fastpath.resolve(cuda, lambda c: None, rate=None)
    assert out.hardware.precision == "bf16" and set(choices) == {"precision", "compile", "threads"}
    assert choices["precision"].reason == "no GPU visible here: assumed Ampere or newer"


def test_a_set_compile_is_kept_and_parallelism_compile_is_folded_into_it():
    for given, want in [("hardware.compile=true", True), ("hardware.compile=false", False),
                        ("parallelism.compile=true", True)]:  # fmt: skip
        cfg = to_config(compose_config(["model=gpt_nano", "hardware.threads=null", given]))
        out, choices = fastpath.resolve(cfg, lambda c: None)
        assert out.hardware.compile is want and choices["compile"] == fastpath.Choice(
            want, "set", False
        )
        assert out.parallelism.compile is None  # decided once, in hardware.compile


def test_auto_compile_estimates_the_step_only_where_its_rule_needs_it(monkeypatch):
    """On the CPU auto never compiles: the step time (which measures the CPU's peak, at bf16 a
    slow matmul without bf16 units) is not asked for; on a GPU it is, once."""
    asked = []

    def step_s(cfg):
        asked.append(cfg.hardware.device)
        return 0.1

    cpu = to_config(compose_config(["model=gpt_nano", "hardware.threads=null"]))
    out, choices = fastpath.resolve(cpu, step_s)
    assert out.hardware.compile is False and choices["compile"].auto and asked == []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cuda = to_config(compose_config(["model=gpt_nano", "hardware.device=cuda"]))
    fastpath.resolve(cuda, step_s, steps=10**6, rate=None)
    assert asked == ["cuda"]


def test_rates_and_hours_are_rounded_as_they_are_said():
    rate = {4: 12_500_000_010.0, 1: 29_500_000_010.0}.__getitem__  # 12.50000001, 29.50000001
    assert fastpath.choose_threads("auto", "cpu", 4, rate).reason == (
        "the CPU is busy: 1 thread multiplies at 30 GFLOP/s, 4 threads at 13"
    )
    rate = {4: 29_500_000_010.0, 1: 12_500_000_010.0}.__getitem__
    assert fastpath.choose_threads("auto", "cpu", 4, rate).reason == "30 GFLOP/s, 1 thread 13"
    assert fastpath._seconds(8101.0) == "2.3 h"  # 2.2503 h
