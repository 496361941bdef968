"""A run folder belongs to one run: what a new start does with the folder it is given.

Before anything is written, rank 0 decides (``claim``):

- ``train.resume=auto``: the newest checkpoint that loads is the run's own line of history. Newer
  ones that do not load are moved to ``checkpoints/broken/`` (named), so that neither pruning nor a
  later resume ever picks them. A sharded checkpoint is read whole only when restored: one an entry
  of which does not read back is passed over then, the same way, on every rank (build.py's
  ``shared_restore``).
  The checkpoint must come from the same run: its config and this one may differ only in topology
  (hardware, parallelism, processes, the micro-batch split of the same global batch), pace
  (max_steps, eval / log / checkpoint cadence) and records (tracking); any other difference is one
  line naming the keys. A folder with records but no loadable checkpoint is
  refused the same way (a rerun would mix two runs' records).
- ``train.resume=never``: an earlier run's files are moved aside into ``previous/<time>/``, never
  deleted or mixed, and the run starts fresh.
- ``train.resume=PATH``: a deliberate warm start from that file, whatever its config; an earlier
  run's files in this folder are moved aside as for ``never`` (a checkpoint inside this folder's
  own history continues it, and the history after it is moved aside).

Two starts in one folder at once: the second ends in one line (``lock``: rank 0 holds
``.gptlab.lock`` while the run lasts). A finished run rerun with the same command is recognised
before anything is built (``finished``): one line, nothing changed. Only rank 0 moves files; the
others are told which checkpoint to load.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

from gptlab.checkpoint import state as checkpoint
from gptlab.errors import GptlabError
from gptlab.records import layout
from gptlab.records.layout import LOCK, PREVIOUS, RECORDS, read_results
from gptlab.records.store import flatten

_HELD: Dict[str, Any] = {}  # run folder -> its open lock file, while this process runs it
BROKEN = "broken"  # in checkpoints/: checkpoints that do not load, kept and named
WARNING = "warning: "  # how checkpoint.load_latest_good marks a note that is a warning

# Keys a run may change and still continue its own checkpoint: where and how fast it runs, how often
# it reports, how long it goes on, and where it records. Everything else (model, data stream,
# optimizer, global batch, seed) makes it another run.
FREE = (
    "hardware.",
    "parallelism.",
    "tracking.",
    "expected.",
    "paths.",
    "train.max_steps",
    "train.micro_batch_size",
    "train.eval_every",
    "train.eval_steps",
    "train.eval_batch_size",
    "train.log_every",
    "train.checkpoint_every",
    "train.keep_checkpoints",
    "train.resume",
    "train.sample_tokens",
    "train.sample_prompt",
    "train.save_checkpoints",
    "train.checkpoint_async",
    "train.verify_checkpoints",
    "train.profile.",
    "hparams_search.attempt",  # a trial resumed by another sweeper: the same trial
    # where the text is, not what it is
    "data.path",
    "data.cache_dir",
    "data.workers",
    "data.progress",
    # arithmetic: auto differs by machine anyway
    "optimizer.fused",
    "optimizer.muon_ns_dtype",
    "bench.",
)


@dataclass
class Claim:
    """What rank 0 decided: the checkpoint every rank loads (None: start fresh), and its notes.

    The notes are what it said.
    """

    resume_from: Optional[Path]
    notes: List[str]
    state: Optional[checkpoint.TrainingState] = None  # rank 0 read it to decide: not read twice


def differences(saved: Dict[str, Any], now: Dict[str, Any]) -> List[str]:
    """`key=old (now new)` for every key outside FREE that differs between two resolved configs."""
    a, b = flatten(saved or {}), flatten(now)
    keys = sorted(k for k in set(a) | set(b) if not k.startswith(FREE) and a.get(k) != b.get(k))
    return [f"{k}={a.get(k)!r} (now {b.get(k)!r})" for k in keys]


def has_records(run_dir: Path) -> bool:
    return any((run_dir / name).exists() for name in RECORDS if name != layout.CHECKPOINTS) or bool(
        checkpoint.list_checkpoints(run_dir / layout.CHECKPOINTS)
    )


def set_aside(run_dir: Path, why: str, log: Callable[[str], None]) -> Optional[Path]:
    """Move an earlier run's records into previous/<time>/; the folder they went to.

    Nothing is deleted.
    """
    present = [run_dir / name for name in RECORDS if (run_dir / name).exists()]
    if not present:
        return None
    dest = move_aside(run_dir, present)
    log(f"{why}: the earlier run's files were moved to {dest}")
    return dest


def move_aside(run_dir: Path, paths: List[Path], suffix: str = "") -> Path:
    """Move paths into a new previous/<time><suffix>/ folder of the run folder.

    Nothing is deleted.
    """
    dest = run_dir / PREVIOUS / (time.strftime("%Y-%m-%d_%H-%M-%S") + suffix)
    while dest.exists():
        dest = dest.with_name(dest.name + "_")
    dest.mkdir(parents=True)
    for path in paths:
        shutil.move(str(path), str(dest / path.name))
    return dest


def _saved_config(run_dir: Path) -> Dict[str, Any]:
    """The resolved config an earlier attempt recorded in the folder ({} when there is none)."""
    import yaml

    try:
        return yaml.safe_load((run_dir / layout.CONFIG).read_text()) or {}
    except (OSError, yaml.YAMLError):
        return {}


def finished(run_dir: Path, resolved: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """The results of this very run when it has finished already, else None.

    train.resume=auto reruns a finished run.
    """
    results, saved = read_results(run_dir), _saved_config(run_dir)
    if resolved["train"]["resume"] != "auto" or not results or not saved:
        return None
    done = (
        results.get("stopped_by") is None
        and (results.get("steps") or 0) >= resolved["train"]["max_steps"]
    )
    return results if done and not differences(saved, resolved) else None


def lock(run_dir: Path) -> None:
    """Hold one run at a time in a folder: a second start there is one line.

    Rank 0 holds an exclusive lock on <run>/.gptlab.lock while the run lasts (the OS drops it when
    the process ends, however it ends).
    """
    key = str(Path(run_dir).resolve())
    if key in _HELD:
        return  # this process runs the folder already (a test calling run_training again)
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    f = open(Path(run_dir) / LOCK, "a+")  # noqa: SIM115 - held open for the whole run
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        raise GptlabError(
            f"run folder {run_dir} is in use by another gptlab run ({holder}): wait for it to end, "
            "or give this run another hydra.run.dir"
        ) from None
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
    f.flush()
    _HELD[key] = f


def unlock(run_dir: Path) -> None:
    """Let the folder go at the end of the run (a process that dies lets it go by itself).

    The lock file is removed while still held, so a finished folder holds only the run's records.
    """
    f = _HELD.pop(str(Path(run_dir).resolve()), None)
    if f is not None:
        Path(f.name).unlink(missing_ok=True)
        f.close()


def claim(
    run_dir: Path,
    resume: str,
    resolved: Dict[str, Any],
    log: Callable[[str], None],
    unreadable: Optional[Dict[Path, str]] = None,
    verify: bool = True,
) -> Claim:
    """Rank 0's decision for this start (see the module's docstring).

    Raises GptlabError for another run.

    unreadable: checkpoints a restore found damaged (path: why), passed over like those that do not
    load. verify: checkpoints whose digests differ from those recorded at save count as damaged."""
    lock(run_dir)
    try:
        return _decide(run_dir, resume, resolved, log, unreadable or {}, verify)
    except GptlabError:
        unlock(run_dir)  # refused: the folder stays as it was, free for the next start
        raise


def _decide(
    run_dir: Path,
    resume: str,
    resolved: Dict[str, Any],
    log: Callable[[str], None],
    unreadable: Dict[Path, str],
    verify: bool = True,
) -> Claim:
    notes: List[str] = []
    say = notes.append
    if resume == "never":
        set_aside(run_dir, "train.resume=never", say)
        return _told(Claim(None, notes), log)
    if resume != "auto":
        path, state = _warm_start(run_dir, Path(resume).expanduser(), say, verify)
        return _told(Claim(path, notes, state), log)
    folder = run_dir / layout.CHECKPOINTS
    found = checkpoint.load_latest_good(folder, warn=say, unreadable=unreadable, verify=verify)
    if found is None:
        if checkpoint.list_checkpoints(folder):
            first = next((n for n in notes if n.startswith(WARNING)), "")
            why = first[len(WARNING) :].split("; trying the previous")[0]
            raise GptlabError(
                _another_run(
                    run_dir,
                    f"none of its checkpoints loads: {why}"
                    if why
                    else "none of its checkpoints loads",
                )
            )
        if has_records(run_dir):  # an attempt that ended before its first checkpoint: the same run?
            diff = differences(_saved_config(run_dir), resolved)
            if diff:
                raise GptlabError(
                    _another_run(run_dir, f"its config_resolved.yaml differs in {', '.join(diff)}")
                )
            set_aside(run_dir, "the earlier attempt left no checkpoint to continue", say)
        return _told(Claim(None, notes), log)
    path, state = found
    diff = differences(state.get("config") or {}, resolved)
    if diff:
        raise GptlabError(
            _another_run(run_dir, f"its checkpoint {path.name} differs in {', '.join(diff)}")
        )
    _move_broken(folder, path, say)
    return _told(Claim(path, notes, checkpoint.TrainingState.from_dict(path, state)), log)


def _warm_start(
    run_dir: Path, path: Path, say: Callable[[str], None], verify: bool = True
) -> Tuple[Path, checkpoint.TrainingState]:
    """Set aside what train.resume=PATH leaves out of the run's history.

    Within this folder's history, the history after PATH goes aside; else the whole earlier run
    does.
    """
    folder = run_dir / layout.CHECKPOINTS
    # one that does not load stops here, before anything moves
    state = checkpoint.TrainingState.load(path, verify)
    if path.resolve().parent == folder.resolve():
        later = [p for p in checkpoint.list_checkpoints(folder) if p.name > path.name]
        if later:
            dest = move_aside(run_dir, later, "_checkpoints")
            say(f"train.resume={path}: the checkpoints after it were moved to {dest}")
        return path, state
    set_aside(run_dir, f"train.resume={path} (a warm start)", say)
    return path, state


def _move_broken(folder: Path, good: Path, say: Callable[[str], None]) -> None:
    """Set aside checkpoints newer than the one resumed, which did not load.

    They go out of the run's history, kept for a look.
    """
    broken = [p for p in checkpoint.list_checkpoints(folder) if p.name > good.name]
    if not broken:
        return
    (folder / BROKEN).mkdir(exist_ok=True)
    for path in broken:
        dest = folder / BROKEN / path.name
        # the same step broken before: both are kept (a move onto a folder nests in it)
        while dest.exists():
            dest = dest.with_name(dest.name + "_")
        shutil.move(str(path), str(dest))
    say(f"moved {len(broken)} unreadable checkpoint(s) to {folder / BROKEN}")


def _another_run(run_dir: Path, why: str) -> str:
    return (
        f"run folder {run_dir} holds another run ({why}): use a new hydra.run.dir, or "
        f"train.resume=never to "
        f"start over here (its files are moved to {run_dir / PREVIOUS}/), or train.resume=PATH to "
        f"warm-start "
        f"from one of its checkpoints"
    )


def _told(c: Claim, log: Callable[[str], None]) -> Claim:
    """The claim's notes, told: a skipped checkpoint is a warning, the rest news.

    A warning is `gptlab: ...` on stderr.
    """
    for note in c.notes:
        if note.startswith(WARNING):
            logging.getLogger(__name__).warning(note[len(WARNING) :])
        else:
            log(note)
    return c
