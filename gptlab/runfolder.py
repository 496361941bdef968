"""A run folder belongs to one run: what a new start does with the folder it is given.

Before anything is written, rank 0 decides (``claim``):

- ``train.resume=auto``: the newest checkpoint that loads is the run's own line of history. Newer
  ones that do not load are moved to ``checkpoints/broken/`` (named), so that neither pruning nor a
  later resume ever picks them. The checkpoint must come from the same run: its config and this
  one may differ only in topology (hardware, parallelism, processes, the micro-batch split of the
  same global batch), pace (max_steps, eval / log / checkpoint cadence) and records (tracking); any
  other difference is one line naming the keys. A folder with records but no loadable checkpoint is
  refused the same way (a rerun would mix two runs' records).
- ``train.resume=never``: an earlier run's files are moved aside into ``previous/<time>/``, never
  deleted or mixed, and the run starts fresh.
- ``train.resume=PATH``: a deliberate warm start from that file, whatever its config; an earlier
  run's files in this folder are moved aside as for ``never`` (a checkpoint inside this folder's
  own history continues it, and the history after it is moved aside).

A finished run rerun with the same command is recognised before anything is built (``finished``):
one line, nothing changed. Only rank 0 moves files; the others are told which checkpoint to load.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

from gptlab import checkpoint
from gptlab.errors import GptlabError

# What a run folder holds besides Hydra's .hydra/ and the log file (which the new attempt owns already).
RECORDS = ("checkpoints", "metrics.jsonl", "results.json", "samples.txt", "loss.png", "config_resolved.yaml",
           "derived.json", "tensorboard", "slurm.json", "bench.json", "export")  # fmt: skip
PREVIOUS = "previous"
BROKEN = "broken"

# Keys a run may change and still continue its own checkpoint: where and how fast it runs, how often
# it reports, how long it goes on, and where it records. Everything else (model, data stream,
# optimizer, global batch, seed) makes it another run.
FREE = (
    "hardware.", "parallelism.", "tracking.", "expected.",
    "train.max_steps", "train.micro_batch_size", "train.eval_every", "train.eval_steps", "train.eval_batch_size",
    "train.log_every", "train.checkpoint_every", "train.keep_checkpoints", "train.resume", "train.sample_tokens",
    "train.sample_prompt", "train.save_checkpoints",
    "data.path", "data.cache_dir", "data.workers", "data.progress",  # where the text is, not what it is
    "optimizer.fused", "bench.",
)  # fmt: skip


@dataclass
class Claim:
    """What rank 0 decided: the checkpoint every rank loads (None: start fresh), and what it said."""

    resume_from: Optional[Path]
    notes: List[str]


def flat(d: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for k, v in (d or {}).items():
        if isinstance(v, dict) and v:
            out.update(flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def differences(saved: Dict[str, Any], now: Dict[str, Any]) -> List[str]:
    """`key=old (now new)` for every key outside FREE whose value differs between two resolved configs."""
    a, b = flat(saved), flat(now)
    keys = sorted(k for k in set(a) | set(b) if not k.startswith(FREE) and a.get(k) != b.get(k))
    return [f"{k}={a.get(k)!r} (now {b.get(k)!r})" for k in keys]


def has_records(run_dir: Path) -> bool:
    return any((run_dir / name).exists() for name in RECORDS if name != "checkpoints") or bool(
        checkpoint.list_checkpoints(run_dir / "checkpoints")
    )


def set_aside(run_dir: Path, why: str, log: Callable[[str], None]) -> Optional[Path]:
    """Move an earlier run's records into previous/<time>/ (nothing is deleted); the folder they went to."""
    present = [run_dir / name for name in RECORDS if (run_dir / name).exists()]
    if not present:
        return None
    dest = run_dir / PREVIOUS / time.strftime("%Y-%m-%d_%H-%M-%S")
    while dest.exists():
        dest = dest.with_name(dest.name + "_")
    dest.mkdir(parents=True)
    for path in present:
        shutil.move(str(path), str(dest / path.name))
    log(f"{why}: the earlier run's files were moved to {dest}")
    return dest


def _saved_config(run_dir: Path) -> Dict[str, Any]:
    """The resolved config an earlier attempt recorded in the folder ({} when there is none)."""
    import yaml

    try:
        return yaml.safe_load((run_dir / "config_resolved.yaml").read_text()) or {}
    except (OSError, yaml.YAMLError):
        return {}


def finished(run_dir: Path, resolved: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """The results of this very run when it has finished already (train.resume=auto reruns it): else None."""
    results_file, saved = run_dir / "results.json", _saved_config(run_dir)
    if resolved["train"]["resume"] != "auto" or not results_file.is_file() or not saved:
        return None
    try:
        results = json.loads(results_file.read_text())
    except (OSError, ValueError):
        return None
    done = results.get("stopped_by") is None and (results.get("steps") or 0) >= resolved["train"]["max_steps"]
    return results if done and not differences(saved, resolved) else None


def claim(run_dir: Path, resume: str, resolved: Dict[str, Any], log: Callable[[str], None]) -> Claim:
    """Rank 0's decision for this start (see the module's docstring); raises GptlabError for another run."""
    notes: List[str] = []
    say = notes.append
    if resume == "never":
        set_aside(run_dir, "train.resume=never", say)
        return _told(Claim(None, notes), log)
    if resume != "auto":
        return _told(Claim(_warm_start(run_dir, Path(resume).expanduser(), say), notes), log)
    folder = run_dir / "checkpoints"
    found = checkpoint.load_latest_good(folder, warn=say)
    if found is None:
        if checkpoint.list_checkpoints(folder):
            first = next((n for n in notes if n.startswith("warning: ")), "")
            why = first[len("warning: ") :].split("; trying the previous")[0]
            raise GptlabError(_another_run(run_dir, f"none of its checkpoints loads: {why}" if why else
                                           "none of its checkpoints loads"))  # fmt: skip
        if has_records(run_dir):  # an attempt that ended before its first checkpoint: the same run?
            diff = differences(_saved_config(run_dir), resolved)
            if diff:
                raise GptlabError(_another_run(run_dir, f"its config_resolved.yaml differs in {', '.join(diff)}"))
            set_aside(run_dir, "the earlier attempt left no checkpoint to continue", say)
        return _told(Claim(None, notes), log)
    path, state = found
    diff = differences(state.get("config") or {}, resolved)
    if diff:
        raise GptlabError(_another_run(run_dir, f"its checkpoint {path.name} differs in {', '.join(diff)}"))
    _move_broken(folder, path, say)
    return _told(Claim(path, notes), log)


def _warm_start(run_dir: Path, path: Path, say: Callable[[str], None]) -> Path:
    """train.resume=PATH: within this folder's history, the history after it goes aside; else the whole
    earlier run does."""
    folder = run_dir / "checkpoints"
    checkpoint.load(path)  # a path that does not load stops here, before anything is moved
    if path.resolve().parent == folder.resolve():
        later = [p for p in checkpoint.list_checkpoints(folder) if p.name > path.name]
        if later:
            dest = set_aside_files(run_dir, later, "resuming from an earlier checkpoint")
            say(f"train.resume={path}: the checkpoints after it were moved to {dest}")
        return path
    set_aside(run_dir, f"train.resume={path} (a warm start)", say)
    return path


def set_aside_files(run_dir: Path, files: List[Path], why: str) -> Path:
    dest = run_dir / PREVIOUS / (time.strftime("%Y-%m-%d_%H-%M-%S") + "_checkpoints")
    dest.mkdir(parents=True, exist_ok=True)
    for path in files:
        shutil.move(str(path), str(dest / path.name))
    return dest


def _move_broken(folder: Path, good: Path, say: Callable[[str], None]) -> None:
    """Checkpoints newer than the one resumed did not load: out of the run's history, kept for a look."""
    broken = [p for p in checkpoint.list_checkpoints(folder) if p.name > good.name]
    if not broken:
        return
    (folder / BROKEN).mkdir(exist_ok=True)
    for path in broken:
        shutil.move(str(path), str(folder / BROKEN / path.name))
    say(f"moved {len(broken)} unreadable checkpoint(s) to {folder / BROKEN}")


def _another_run(run_dir: Path, why: str) -> str:
    return (
        f"run folder {run_dir} holds another run ({why}): use a new hydra.run.dir, or train.resume=never to "
        f"start over here (its files are moved to {run_dir / PREVIOUS}/), or train.resume=PATH to warm-start "
        f"from one of its checkpoints"
    )


def _told(c: Claim, log: Callable[[str], None]) -> Claim:
    for note in c.notes:
        log(note)
    return c


def shared_claim(run_dir: Path, resume: str, resolved: Dict[str, Any], is_main: bool,
                 log: Callable[[str], None]) -> Tuple[Optional[Path], Optional[str]]:  # fmt: skip
    """claim() on rank 0, its answer on every rank: (the checkpoint to load, rank 0's error if any)."""
    from gptlab import distributed

    answer: Tuple[Optional[str], Optional[str]] = (None, None)
    if is_main:
        try:
            c = claim(run_dir, resume, resolved, log)
            answer = (str(c.resume_from) if c.resume_from else None, None)
        except GptlabError as e:
            answer = (None, str(e))
    path, error = distributed.broadcast_object(answer)
    return (Path(path) if path else None), error
