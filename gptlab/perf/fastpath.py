"""The fastest path by default: ``hardware.precision=auto`` and ``hardware.compile=auto``.

Each rule looks at what the run is and where it runs and returns its choice with the reason; the
summary line and MLflow (``derived.precision_reason``, ``derived.compile_reason``) carry both. The
figures behind the rules were measured: docs/measurements/2026-12-03-fastpath.md, docs/speed.md.

- precision: bf16 autocast where the device multiplies bf16 natively (Ampere or newer; a CPU with
  AVX-512-BF16 or AMX) and, on the CPU, the model is wide enough that the casts pay; fp32 elsewhere.
  fp16 only when asked (it needs loss scaling and overflows where bf16 does not).
- compile: torch.compile when the run's eager time is long enough that compiling's measured saving
  repays its cost; eager for short runs (tests, quick checks). Inductor's cache lives in gptlab's
  cache folder, so the second run of a command compiles in seconds.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple, Union

import torch

AUTO = "auto"
# On the CPU, bf16 autocast pays from this model width on (narrower: the casts around every matmul
# cost more than the faster matmuls save). Measured by width on AVX-512-BF16 (docs/speed.md).
CPU_BF16_MIN_WIDTH = 192
# compile's cost in seconds (first run, and with inductor's cache warm) and the share of an eager
# step it saves, per device type; a run compiles when its saving beats the cost. The CPU's figures
# are measured (docs/speed.md: a compiled step was no faster at 2 threads); the GPU's saving is the
# reference tuning study's x2.5 taken conservatively, its cost assumed, until a GPU measures them.
COMPILE_COST_S = {"cpu": (55.0, 5.0), "cuda": (90.0, 20.0)}
COMPILE_SAVING = {"cpu": 0.0, "cuda": 0.5}


@dataclass(frozen=True)
class Choice:
    """One decision: the value the run uses and why (``auto`` when the rule chose it)."""

    value: Any
    reason: str
    auto: bool


def cpu_bf16_units() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX-512-BF16 or AMX).

    Not oneDNN's "bf16 supported", which is true on any AVX-512 CPU: without these instructions it
    emulates bf16, several times slower than fp32."""
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def gpu_capability() -> Optional[Tuple[int, int]]:
    """The visible GPU's compute capability, or None where no GPU is visible (planning)."""
    if not torch.cuda.is_available():
        return None
    try:
        return tuple(torch.cuda.get_device_capability(0))  # type: ignore[return-value]
    except (RuntimeError, AssertionError):  # a driver that cannot say: decide as for planning
        return None


def choose_precision(
    requested: str,
    device: str,
    width: int,
    cpu_bf16: Optional[bool] = None,
    capability: Optional[Tuple[int, int]] = None,
) -> Choice:
    """hardware.precision: as set, or auto's choice for this device and model width."""
    if requested != AUTO:
        return Choice(requested, "set", False)
    if device == "cuda":
        cap = capability if capability is not None else gpu_capability()
        if cap is None:
            return Choice("bf16", "no GPU visible here: assumed Ampere or newer", True)
        if cap >= (8, 0):
            return Choice("bf16", f"sm_{cap[0]}{cap[1]} has bf16 tensor cores", True)
        return Choice("fp32", f"sm_{cap[0]}{cap[1]} has no bf16 tensor cores", True)
    units = cpu_bf16_units() if cpu_bf16 is None else cpu_bf16
    if not units:
        return Choice("fp32", "this CPU has no bf16 units (AVX-512-BF16 or AMX)", True)
    if width < CPU_BF16_MIN_WIDTH:
        return Choice("fp32", f"width {width} < {CPU_BF16_MIN_WIDTH}: bf16's casts cost more", True)
    return Choice("bf16", f"bf16 units, width {width} >= {CPU_BF16_MIN_WIDTH}", True)


def choose_threads(
    requested: Any, device: str, default: int, rate: Optional[Callable[[int], float]]
) -> Choice:
    """hardware.threads: as set, or auto's choice on the CPU.

    As set: a number, or null: torch's `default`. auto's choice on the CPU: the default or 1 thread,
    whichever multiplies faster now (`rate(threads)`: FLOP/s). On a CPU that other processes keep
    busy, threads wait for each other at every matmul and one thread can be several times faster
    than all of them.
    """
    if requested != AUTO:
        return Choice(requested, "set", False)
    if device != "cpu":
        return Choice(None, "the GPU does the work", True)
    if default <= 1 or rate is None:
        return Choice(default, "one core for this process", True)
    many, one = rate(default), rate(1)
    if one >= many:
        return Choice(
            1,
            f"the CPU is busy: 1 thread multiplies at {one / 1e9:.0f} GFLOP/s, {default} threads "
            f"at {many / 1e9:.0f}",
            True,
        )
    return Choice(default, f"{many / 1e9:.0f} GFLOP/s, 1 thread {one / 1e9:.0f}", True)


def inductor_cache() -> Path:
    """Inductor's cache folder: $TORCHINDUCTOR_CACHE_DIR, else <gptlab's cache>/inductor."""
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        return Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
    root = os.environ.get("GPTLAB_CACHE_DIR") or "~/.cache/gptlab"
    return Path(root).expanduser() / "inductor"


def use_inductor_cache() -> Path:
    """Point inductor at gptlab's cache folder (unless the user chose one) before compiling."""
    path = inductor_cache()
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(path))
    return path


def compile_cost_s(device: str) -> float:
    """compile's expected cost here: the warm figure once inductor's cache holds compiled code."""
    cold, warm = COMPILE_COST_S[device]
    cache = inductor_cache()
    return warm if cache.is_dir() and any(cache.iterdir()) else cold


def choose_compile(
    requested: Any,
    device: str,
    steps: int,
    step_s: Union[None, float, Callable[[], Optional[float]]],
) -> Choice:
    """hardware.compile: as set, or auto's choice from the run's expected eager time.

    step_s: the expected eager step time (None: unknown, then eager), or a function giving it,
    called only where the rule needs it (the estimate measures the device's peak)."""
    if requested is not AUTO and requested != AUTO:
        return Choice(bool(requested), "set", False)
    if COMPILE_SAVING[device] <= 0:
        return Choice(False, f"a compiled step measured no faster on the {device.upper()}", True)
    if device == "cpu" and not shutil.which(os.environ.get("CXX", "g++")):
        return Choice(False, "inductor needs a C++ compiler (g++) on the CPU", True)
    if callable(step_s):
        step_s = step_s()
    if not step_s:
        return Choice(False, "the step time is unknown", True)
    cost, saving = compile_cost_s(device), COMPILE_SAVING[device] * steps * step_s
    why = (
        f"{steps:,} steps of ~{_seconds(step_s)}: compiling saves ~{_seconds(saving)}, "
        f"costs ~{_seconds(cost)}"
    )
    return Choice(saving > cost, why, True)


def _seconds(s: float) -> str:
    if s < 1:
        return f"{s * 1e3:.0f} ms"
    if s < 120:
        return f"{s:.0f} s"
    return f"{s / 60:.0f} min" if s < 7200 else f"{s / 3600:.1f} h"


def with_precision(cfg: Any) -> Any:
    """The config with hardware.precision=auto decided (cheap: no measurement); as is otherwise."""
    hw = cfg.hardware
    if hw.precision != AUTO:
        return cfg
    chosen = choose_precision(hw.precision, hw.device, cfg.model.n_embd).value
    return dataclasses.replace(cfg, hardware=dataclasses.replace(hw, precision=chosen))


def resolve(
    cfg: Any,
    step_s: Callable[[Any], Optional[float]],
    steps: Optional[int] = None,
    rate: Optional[Callable[[int], float]] = None,
) -> Tuple[Any, Dict[str, Choice]]:
    """(the config with precision and compile decided, the choices with their reasons).

    step_s: the planner's expected eager step time of a config (costs.eager_step_s; callers go
    through costs.resolve_auto). steps: the length of the run the choice is for (default
    train.max_steps; a benchmark passes the run it stands for). rate: FLOP/s at a CPU thread
    count, for hardware.threads=auto (first: the compile rule's step time depends on it)."""
    hw = cfg.hardware
    threads = choose_threads(hw.threads, hw.device, torch.get_num_threads(), rate)
    if threads.auto and threads.value:
        torch.set_num_threads(threads.value)
    precision = choose_precision(hw.precision, hw.device, cfg.model.n_embd)
    hw = dataclasses.replace(hw, precision=precision.value, threads=threads.value)
    requested = cfg.parallelism.compile if cfg.parallelism.compile is not None else hw.compile
    if requested == AUTO:
        staged = dataclasses.replace(cfg, hardware=hw)
        expected = functools.partial(step_s, staged)
        compiled = choose_compile(AUTO, hw.device, steps or cfg.train.max_steps, expected)
    else:
        compiled = choose_compile(requested, hw.device, 0, None)
    hw = dataclasses.replace(hw, compile=compiled.value)
    par = dataclasses.replace(cfg.parallelism, compile=None)
    return dataclasses.replace(cfg, hardware=hw, parallelism=par), {
        "precision": precision,
        "compile": compiled,
        "threads": threads,
    }


def derived(choices: Dict[str, Choice]) -> Dict[str, Any]:
    """The choices as run figures (MLflow params derived.precision, derived.compile_reason, ...)."""
    out: Dict[str, Any] = {}
    for name, c in choices.items():
        out.update({name: c.value, f"{name}_auto": c.auto, f"{name}_reason": c.reason})
    return out


def summary(x: Dict[str, Any], precision: str) -> Tuple[str, str]:
    """(the precision, the compile clause) of a run's summary line, with auto's reasons.

    'bf16 (auto: ...)', ' | eager (auto: ...)'; a set choice is only named.
    """
    if x.get("precision_auto"):
        precision = f"{x['precision']} (auto: {x['precision_reason']})"
    name = "compiled" if x.get("compile") else "eager"
    # threads are named when auto left the default for one: the CPU is busy
    busy = x.get("threads_auto") and x.get("threads") == 1 and "busy" in x["threads_reason"]
    threads = f" | 1 thread (auto: {x['threads_reason']})" if busy else ""
    if x.get("compile_auto"):
        return precision, f" | {name} (auto: {x['compile_reason']}){threads}"
    return precision, (" | compiled" if x.get("compile") else "") + threads
