"""The tuning ladder of python -m gptlab.bench, on this machine and model.

Usage: python -m gptlab.bench bench.ladder=true [overrides].

From the plainest setting (fp32, no TF32, eager, the math attention path, the for-each AdamW, the
whole loss at once) each rung adds one speed lever to the best setting so far: TF32 (GPU), bf16
autocast, torch.compile, fused attention (SDPA's flash kernel), fused AdamW, the chunked loss, the
largest micro-batch that fits, threads per process (CPU). A lever that does not apply here is
skipped with the reason; one that makes the step slower is measured, shown and not kept, and tried
once more at the end on the best setting (levers interact: a lever may lose alone and win beside a
later one). Each rung is its own benchmark process (python -m gptlab.bench: no state carries from
one rung to the next), and the first and the last setting are measured again at the end, so a drift
of the machine's speed shows as a spread instead of as a speed-up.

The table goes to the console, ladder.json to the ladder's folder, and one JSON line to stdout.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from omegaconf import DictConfig, OmegaConf, open_dict

from gptlab.errors import GptlabError
from gptlab.perf import fastpath

# the plainest setting: every lever off (the keys each rung turns on)
PLAIN = {
    "hardware.precision": "fp32",
    "hardware.tf32": False,
    "hardware.compile": False,
    "parallelism.compile": None,
    "hardware.attention_backend": "math",
    "optimizer.fused": False,
    "parallelism.loss_chunk": 0,
    "hardware.threads": None,  # torch's default; the threads rung sets one per physical core
}
# a rung's figures kept in the table and the JSON
FIGURES = (
    "tokens_per_s",
    "step_ms",
    "mfu",
    "peak_mem_bytes",
    "precision",
    "compile",
    "attention_backend",
    "micro_batch_size",
    "threads",
)


@dataclass
class Rung:
    """One lever: the settings it adds, or why it does not apply here."""

    name: str
    adds: Dict[str, Any]
    skip: Optional[str] = None
    result: Optional[Dict[str, Any]] = None
    error: Optional[str] = None
    kept: bool = False
    speedup_prev: Optional[float] = None
    speedup_plain: Optional[float] = None


@dataclass
class Ladder:
    rungs: List[Rung]
    repeats: Dict[str, Dict[str, Any]] = field(default_factory=dict)


def own_overrides(task: List[str]) -> List[str]:
    """The user's overrides a rung's benchmark inherits.

    Without the ladder's own switch, the run folder (each rung has its own) and the keys every rung
    sets.
    """
    dropped = ("bench.ladder=", "hydra.run.dir=", *(f"{k}=" for k in PLAIN))
    return [o for o in task if not o.lstrip("+~").startswith(dropped)]


def _value(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return str(v).lower()
    return str(v)


def overrides_of(settings: Dict[str, Any]) -> List[str]:
    return [f"{k}={_value(v)}" for k, v in settings.items()]


def with_settings(cfg: DictConfig, settings: Dict[str, Any], typed: Callable[[DictConfig], Any]):
    """The typed config of cfg with `settings` applied."""
    cfg = cfg.copy()
    with open_dict(cfg):
        for k, v in settings.items():
            OmegaConf.update(cfg, k, v, merge=False)
    return typed(cfg)


def physical_cores() -> int:
    """The physical cores this process may run on (hyper-threads' siblings counted once)."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    cores = set()
    for cpu in cpus:
        path = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
        try:
            cores.add(path.read_text().strip())
        except OSError:
            cores.add(str(cpu))
    return len(cores) or (os.cpu_count() or 1)


def plan_rungs(cfg: DictConfig, typed: Callable[[DictConfig], Any]) -> List[Rung]:
    """The ladder for this config and machine: each lever, its settings or why it is skipped.

    typed: the benchmark's config as gptlab.config.Config (gptlab.bench gives it)."""
    plain = with_settings(cfg, PLAIN, typed)
    cuda = plain.hardware.device == "cuda"
    cap = fastpath.gpu_capability() if cuda else None
    gpu = f"sm_{cap[0]}{cap[1]}" if cap else ""
    ampere = cap is None or cap >= (8, 0)  # no GPU visible (planning only): assumed Ampere
    if cuda:
        tf32 = None if ampere else f"{gpu} has no TF32 tensor cores"
        bf16 = None if ampere else f"{gpu} has no bf16 tensor cores"
    else:
        tf32 = "TF32 is a GPU tensor-core format"
        units = fastpath.cpu_bf16_units()
        bf16 = None if units else "this CPU has no bf16 units (AVX-512-BF16 or AMX)"
    cxx = os.environ.get("CXX", "g++")
    compiler = None if cuda or shutil.which(cxx) else f"inductor needs a C++ compiler ({cxx})"
    attention = None
    if not cuda and plain.model.dropout > 0:
        attention = f"the CPU's fused attention takes no dropout ({plain.model.dropout})"
    return [
        Rung("plain fp32", dict(PLAIN)),
        Rung("+ TF32", {"hardware.tf32": True}, tf32),
        Rung("+ bf16 autocast", {"hardware.precision": "bf16"}, bf16),
        Rung("+ torch.compile", {"hardware.compile": True}, compiler),
        Rung(
            "+ flash attention" if cuda else "+ fused attention (SDPA)",
            {"hardware.attention_backend": "auto"},
            attention,
        ),
        _fused_adamw(plain),
        _chunked_loss(plain),
        _micro_batch(plain),
        _threads(plain),
    ]


def _fused_adamw(plain: Any) -> Rung:
    from gptlab.optim.factory import FUSED_ADAMW_DEVICES

    device = plain.hardware.device
    why = None if device in FUSED_ADAMW_DEVICES else f"torch has no fused AdamW on {device}"
    return Rung("+ fused AdamW", {"optimizer.fused": True}, why)


def _chunked_loss(plain: Any) -> Rung:
    from gptlab.perf import costs

    vocab, _ = costs.vocab_for(plain)
    rule = dataclasses.replace(plain.parallelism, loss_chunk=None)
    why = None
    if not costs.loss_chunk(rule, plain.model, vocab):
        why = f"the logits (vocab {vocab}) are not the step's largest tensor: no chunking"
    return Rung("+ chunked loss", {"parallelism.loss_chunk": None}, why)


def _micro_batch(plain: Any) -> Rung:
    from gptlab.perf import costs

    micro = plain.micro_batch_size
    try:
        largest = costs.auto_micro_batch(plain)
    except GptlabError as e:
        largest, why = 0, str(e)
    else:
        why = f"micro-batch {micro} is already the largest that fits and divides the batch"
    return Rung(
        "+ larger micro-batch", {"train.micro_batch_size": "auto"}, None if largest > micro else why
    )


def _threads(plain: Any) -> Rung:
    import torch

    hw = plain.hardware
    if hw.device == "cuda":
        return Rung("+ threads per core", {}, "a GPU's speed is not set by the CPU threads")
    if hw.threads not in (None, "auto"):
        return Rung("+ threads per core", {}, f"set by hardware.threads={hw.threads}")
    per_process = max(1, physical_cores() // max(1, hw.nproc_per_node))
    default = torch.get_num_threads()
    why = None
    if per_process == default:
        why = f"torch's default is already {default} threads, one per physical core"
    return Rung("+ threads per core", {"hardware.threads": per_process}, why)


def bench_command(nproc: int) -> List[str]:
    if nproc > 1:
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={nproc}",
            "-m",
            "gptlab.bench",
        ]
    return [sys.executable, "-m", "gptlab.bench"]


def run_one(base: List[str], settings: Dict[str, Any], folder: Path, nproc: int) -> Dict[str, Any]:
    """One rung's benchmark in its own process: its JSON line (GptlabError with its last words)."""
    args = [
        *bench_command(nproc),
        *base,
        *overrides_of(settings),
        "bench.ladder=false",
        f"hydra.run.dir={folder}",
    ]
    proc = subprocess.run(args, capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        said = proc.stderr.strip() or proc.stdout.strip() or f"exit code {proc.returncode}"
        raise GptlabError(said.splitlines()[-1][:300])
    return json.loads(lines[-1])


def climb(
    cfg: DictConfig,
    typed: Callable[[DictConfig], Any],
    base: List[str],
    folder: Path,
    say: Callable[[str], None] = print,
) -> Ladder:
    """Measure every rung that applies, keeping each lever that makes the step faster.

    Then try each dropped lever once more on the best setting, since levers interact (compile can
    lose on the math attention path and win on the flash kernel).
    """
    rungs = plan_rungs(cfg, typed)
    nproc = int(cfg.hardware.nproc_per_node)
    best: Dict[str, Any] = {}
    best_tok = plain_tok = None

    def measure(rung: Rung, name: str) -> None:
        nonlocal best, best_tok, plain_tok
        settings = {**best, **rung.adds}
        say(f"{rung.name}: measuring ...")
        try:
            rung.result = run_one(base, settings, folder / name, nproc)
        except GptlabError as e:
            rung.error = str(e)
            say(f"{rung.name}: failed ({rung.error})")
            return
        tok = rung.result["tokens_per_s"]
        if plain_tok is None:
            plain_tok = best_tok = tok
        rung.speedup_prev = tok / best_tok if best_tok else None
        rung.speedup_plain = tok / plain_tok if plain_tok else None
        rung.kept = not best or tok > best_tok
        if rung.kept:
            best, best_tok = settings, tok
        kept = "" if rung.kept else " (slower: not kept)"
        say(f"{rung.name}: {tok:,.0f} tok/s, x{rung.speedup_prev:.2f} the previous{kept}")

    dropped: List[tuple] = []  # (index, rung, the best setting it was measured against)
    for i, rung in enumerate(rungs):
        if rung.skip:
            say(f"{rung.name}: skipped ({rung.skip})")
            continue
        before = best
        measure(rung, f"{i:02d}")
        if rung.result and not rung.kept:
            dropped.append((i, rung, before))
    for i, rung, before in dropped:
        if best == before:  # nothing kept since: the same setting, already measured
            continue
        again = Rung(f"{rung.name} (again, on the best)", dict(rung.adds))
        rungs.append(again)
        measure(again, f"{i:02d}-again")
    ladder = Ladder(rungs)
    measured = [r for r in rungs if r.result]
    if measured:
        say("measuring the plainest and the best setting again (the machine's drift) ...")
        ladder.repeats = _again(base, measured[0].adds, best, folder, nproc)
    return ladder


def _again(
    base: List[str], plain: Dict[str, Any], best: Dict[str, Any], folder: Path, nproc: int
) -> Dict[str, Dict[str, Any]]:
    """The plainest and the best setting measured once more (one run when they are the same)."""
    repeats: Dict[str, Dict[str, Any]] = {}
    for label, settings in (("plain", plain), ("best", best)):
        try:
            repeats[label] = run_one(base, settings, folder / f"again-{label}", nproc)
        except GptlabError as e:
            repeats[label] = {"error": str(e)}
        if label == "plain" and best == plain:
            repeats["best"] = repeats["plain"]
            break
    return repeats


def drift(ladder: Ladder) -> Dict[str, Optional[float]]:
    """How much the plainest and the best setting's speed moved between their two measurements."""
    measured = [r for r in ladder.rungs if r.result]
    kept = [r for r in measured if r.kept]
    out: Dict[str, Optional[float]] = {}
    for label, rung in (
        ("plain", measured[0] if measured else None),
        ("best", kept[-1] if kept else None),
    ):
        again = ladder.repeats.get(label, {}).get("tokens_per_s")
        first = rung.result["tokens_per_s"] if rung else None
        out[label] = round(again / first - 1, 4) if again and first else None
    return out


def table(ladder: Ladder) -> str:
    """The ladder as a fixed-width table: one row per rung, measured or skipped."""
    rows = [("rung", "tok/s", "x prev", "x plain", "peak mem", "MFU", "kept", "note")]
    for r in ladder.rungs:
        if r.result:
            res = r.result
            mem = res.get("peak_mem_bytes") or 0
            rows.append(
                (
                    r.name,
                    f"{res['tokens_per_s']:,.0f}",
                    f"{r.speedup_prev:.2f}",
                    f"{r.speedup_plain:.2f}",
                    f"{mem / 2**30:.2f} GiB",
                    f"{100 * res['mfu']:.1f}%",
                    "yes" if r.kept else "no",
                    _note(res),
                )
            )
        else:
            why = f"failed: {r.error}" if r.error else f"skipped: {r.skip}"
            rows.append((r.name, "-", "-", "-", "-", "-", "-", why))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(row[:-1], widths)) + "  " + row[-1] for row in rows
    ]
    d = drift(ladder)
    spread = ", ".join(f"{k} {100 * v:+.1f}%" for k, v in d.items() if v is not None)
    lines.append(f"measured again at the end: {spread or 'n/a'} (the machine's drift)")
    return "\n".join(lines)


def _note(res: Dict[str, Any]) -> str:
    return (
        f"{res.get('precision')}, {'compiled' if res.get('compile') else 'eager'}, "
        f"{res.get('attention_backend')} attention, micro-batch {res.get('micro_batch_size')}, "
        f"{res.get('threads')} threads"
    )


def as_json(ladder: Ladder) -> Dict[str, Any]:
    rungs = []
    for r in ladder.rungs:
        row: Dict[str, Any] = {"rung": r.name, "adds": r.adds}
        if r.result:
            row.update({k: r.result.get(k) for k in FIGURES})
            row.update(
                {
                    "speedup_prev": round(r.speedup_prev, 4),
                    "speedup_plain": round(r.speedup_plain, 4),
                    "kept": r.kept,
                }
            )
        else:
            row["skipped" if r.skip else "failed"] = r.skip or r.error
        rungs.append(row)
    repeats = {k: v.get("tokens_per_s", v.get("error")) for k, v in ladder.repeats.items()}
    return {"ladder": rungs, "again_tokens_per_s": repeats, "drift": drift(ladder)}


def run(
    cfg: DictConfig, typed: Callable[[DictConfig], Any], task_overrides: List[str], folder: Path
) -> Dict[str, Any]:
    """The ladder for the benchmark `cfg` (conf/bench.yaml): its table, ladder.json, a JSON line.

    typed: the benchmark's DictConfig as gptlab.config.Config (gptlab.bench gives it, after
    checking that this process is not one of torchrun's)."""
    folder.mkdir(parents=True, exist_ok=True)
    say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731 - stdout is the JSON
    ladder = climb(cfg, typed, own_overrides(task_overrides), folder, say)
    text = table(ladder)
    out = as_json(ladder)
    (folder / "ladder.json").write_text(json.dumps(out, indent=1) + "\n")
    (folder / "ladder.txt").write_text(text + "\n")
    print(text, flush=True)
    print(json.dumps(out), flush=True)
    return out
