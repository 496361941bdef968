"""Checkpoints: what one holds (``TrainingState``), atomic save, safe load, pruning.

The one module that knows a checkpoint's keys, but for the loop's progress, which the loop's
``Progress.state_dict()`` names (saved beside the fields here, read back by ``progress()``). The
loop captures a ``TrainingState`` from the live objects and saves it; build restores one into
freshly built objects; sample and export read the model part of one (``read_model``); runfolder.py
decides which one a run continues. Adding a live object or a field to what a run saves is a change
here only; a value of the loop's progress, a change to ``Progress`` only. Knows no model class:
it sees objects with ``state_dict()`` / ``load_state_dict()``, and reads the model and optimizer
through torch.distributed.checkpoint's state-dict API, which keys both by parameter name whatever
the wrapping (plain, DDP, FSDP), so any checkpoint restores under any strategy and world size.

Two layouts, both atomic and read without code execution:
  * ``ckpt_<step>.pt``: one file, written by rank 0 (unsharded runs: single, ddp);
  * ``ckpt_<step>/``: a DCP folder, one shard file per rank plus ``.metadata``, and ``state.pt``
    with everything else (sharded runs: fsdp, hsdp). It is written as ``.ckpt_<step>.partial/`` and
    renamed once every rank's part and state.pt are complete, so a killed save never appears under
    a checkpoint's name.

Both notice damage that a reader would not (a flipped byte inside tensor data): a ``.pt`` file
holds the SHA-256 of its own contents (``sha256``, computed before it is written, so it is atomic
with the save); a sharded folder holds ``sha256.json``, every file's SHA-256, written by rank 0
before the rename. Loading checks them unless told not to (``verify=False``); older checkpoints
have none and load unchecked.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import shutil
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from gptlab import is_dtensor
from gptlab.errors import GptlabError

# safe_dcp (torch.distributed.checkpoint, and DTensor with it) is imported where a sharded
# checkpoint is read: a whole-file run's start never pays for it
if TYPE_CHECKING:
    from gptlab.checkpoint.safe_dcp import UnreadableEntry

# v2: model and optimizer keyed by parameter name (v1 keyed the optimizer's state by position)
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
_NAME = re.compile(r"^ckpt_(\d{8})(\.pt)?$")
_PARTIAL = re.compile(r"^\.ckpt_(\d{8})\.partial$")
STATE_FILE = "state.pt"  # a sharded checkpoint's everything but the model and optimizer shards
SHARDED_PARTS = ("model", "optimizer")  # what a sharded checkpoint keeps in its DCP shards
DIGEST = "sha256"  # a .pt file's entry: the SHA-256 of everything else in it (state_digest)
MANIFEST = "sha256.json"  # a sharded folder's file: {file name: SHA-256} of every other file


def checkpoint_path(folder: Path, step: int, sharded: bool = False) -> Path:
    return Path(folder) / (f"ckpt_{step:08d}" if sharded else f"ckpt_{step:08d}.pt")


def step_of(path: Path) -> int:
    """The step in a checkpoint's (or an unfinished save's) name."""
    m = _NAME.match(Path(path).name) or _PARTIAL.match(Path(path).name)
    return int(m.group(1)) if m else -1


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)  # make a rename in it durable
    finally:
        os.close(fd)


def save(path: Path, state: Dict[str, Any]) -> Path:
    """Write state to path atomically: a temporary file in the same folder, fsync, then rename.

    A crash at any point leaves either the old file set or the new one, never a half-written file
    under a checkpoint's name.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    state = {"format_version": FORMAT_VERSION, **state}
    with open(tmp, "wb") as f:
        torch.save({**state, DIGEST: state_digest(state)}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)
    return path


def state_digest(state: Any) -> str:
    """The SHA-256 of a checkpoint's contents as read back (what torch.load gives for the file).

    The contents are the tensors' bytes, dtypes and shapes, and every other value's repr, in order;
    the file is the one that was saved.
    """
    h = hashlib.sha256()
    _digest_into(h, state)
    return h.hexdigest()


def _digest_into(h: Any, obj: Any) -> None:
    if isinstance(obj, torch.Tensor):
        t = obj.detach().to("cpu").contiguous().reshape(-1)
        h.update(f"tensor {t.dtype} {tuple(obj.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().data)
    elif isinstance(obj, dict):
        h.update(f"dict {len(obj)}|".encode())
        for key, value in obj.items():
            _digest_into(h, key)
            _digest_into(h, value)
    # torch.load gives a tuple back as a tuple, but the two are the same contents either way
    elif isinstance(obj, (list, tuple)):
        h.update(f"seq {len(obj)}|".encode())
        for value in obj:
            _digest_into(h, value)
    else:
        h.update(f"{type(obj).__name__} {obj!r}|".encode())


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 23):
            h.update(chunk)
    return h.hexdigest()


def _damaged_file(path: Path) -> GptlabError:
    return GptlabError(
        f"checkpoint {path} is damaged: its SHA-256 does not match the one recorded at save"
    )


def write_manifest(folder: Path) -> Path:
    """Write a sharded checkpoint's sha256.json: every file's SHA-256.

    Rank 0 reads every rank's shards: the checkpoint folder is on a filesystem that all ranks share.
    """
    folder = Path(folder)
    digests = {p.name: file_digest(p) for p in sorted(folder.iterdir()) if p.is_file()}
    digests.pop(MANIFEST, None)
    tmp = folder / f".{MANIFEST}.tmp"
    with open(tmp, "w") as f:
        f.write(json.dumps(digests, indent=1) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, folder / MANIFEST)
    return folder / MANIFEST


def check_manifest(folder: Path) -> None:
    """Check that every file sha256.json names has the SHA-256 recorded at save.

    A folder without one (an older checkpoint) is not checked.
    """
    manifest = Path(folder) / MANIFEST
    if not manifest.is_file():
        return
    try:
        digests = json.loads(manifest.read_text())
    except (OSError, ValueError) as e:
        digests = f"{e}"
    if not isinstance(digests, dict):
        raise GptlabError(f"checkpoint {folder} is damaged: its {MANIFEST} is unreadable")
    for name, digest in digests.items():
        if not (Path(folder) / name).is_file() or file_digest(Path(folder) / name) != digest:
            raise _damaged_file(Path(folder) / name)


def load(path: Path, verify: bool = True) -> Dict[str, Any]:
    """Load a checkpoint without executing code from it (weights_only unpickling).

    Whatever else it is, the error is one line naming it: missing, a folder that is not a sharded
    checkpoint, an incomplete one, unreadable, not a PyTorch file, truncated, a pickle that would
    run code (refused unread), or not gptlab's. A sharded checkpoint gives its state.pt (the shards
    are read on restore); its metadata is checked here, and every shard file it names must be whole.
    verify: a file (or, sharded, any file) whose SHA-256 differs from the one recorded at save is
    refused as damaged (train.verify_checkpoints=false skips that read of the whole checkpoint).
    """
    path = Path(path)
    if path.is_dir():
        _check_shards(path)
        if verify:
            check_manifest(path)
        return _load_file(path / STATE_FILE, name=path, verify=verify)
    return _load_file(path, verify=verify)


def _check_shards(path: Path) -> None:
    import pickle

    from gptlab.checkpoint.safe_dcp import METADATA, missing_data, read_metadata

    if not (path / STATE_FILE).is_file() or not (path / METADATA).is_file():
        raise GptlabError(
            f"checkpoint {path} is a folder but not a sharded checkpoint (no {STATE_FILE} and "
            f"{METADATA}): give ckpt_<step>.pt or a sharded ckpt_<step>/"
        )
    try:
        metadata = read_metadata(path)
    except (
        pickle.UnpicklingError,
        EOFError,
        AttributeError,
        ImportError,
        ValueError,
        TypeError,
    ) as e:
        why = f"unreadable or unsafe metadata: {e}"
        raise GptlabError(f"checkpoint {path} is not a gptlab checkpoint ({why})") from None
    short = missing_data(path, metadata)
    if short:
        raise GptlabError(
            f"checkpoint {path} is incomplete: shard file(s) {', '.join(short)} missing or "
            f"cut short"
        )


def _load_file(path: Path, name: Optional[Path] = None, verify: bool = True) -> Dict[str, Any]:
    import warnings

    path, shown = Path(path), name or path
    try:
        with warnings.catch_warnings():  # a foreign pickle's protocol notice would be a second line
            warnings.simplefilter("ignore")
            state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise GptlabError(f"checkpoint {path}: no such file") from None
    # permission denied, an I/O error (a folder never gets here: load() takes it as sharded)
    except OSError as e:
        raise GptlabError(f"checkpoint {path} cannot be read ({e.strerror or e})") from None
    except Exception as e:  # noqa: BLE001 - truncated, corrupt or unsafe files all land here
        # torch's own message is a page long (its weights_only upgrade notice) or says nothing
        # ("101", "pop from empty list"): say what the file is instead.
        from gptlab.checkpoint.safe_dcp import would_run

        blocked = would_run(e)
        try:
            with open(path, "rb") as f:
                head = f.read(4)
        except OSError:
            head = b"?"
        if blocked:
            why = f"unreadable or unsafe: loading it would run {blocked}"
        elif not head:
            why = "an empty file"
        elif head.startswith(b"PK"):  # torch.save writes a zip archive
            why = "a truncated or corrupt PyTorch file"
        else:
            why = "not a PyTorch file"
        raise GptlabError(f"checkpoint {path} is not a gptlab checkpoint ({why})") from None
    if not isinstance(state, dict) or "format_version" not in state:
        raise GptlabError(
            f"checkpoint {shown} is not a gptlab checkpoint (a PyTorch file that gptlab did not "
            f"write)"
        )
    if state["format_version"] not in READABLE_VERSIONS:
        raise GptlabError(
            f"checkpoint {shown} has checkpoint format v{state['format_version']}; this gptlab "
            f"reads "
            f"v{', v'.join(map(str, READABLE_VERSIONS))}: use the gptlab version that wrote it"
        )
    recorded = state.pop(DIGEST, None)  # older checkpoints have none: loaded unchecked
    if verify and recorded is not None and state_digest(state) != recorded:
        raise _damaged_file(path)
    return state


def list_checkpoints(folder: Path) -> List[Path]:
    """Checkpoints in folder, oldest first."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if _NAME.match(p.name))


def latest(folder: Path) -> Optional[Path]:
    found = list_checkpoints(folder)
    return found[-1] if found else None


def load_latest_good(
    folder: Path,
    warn: Optional[Callable[[str], None]] = None,
    unreadable: Optional[Dict[Path, str]] = None,
    verify: bool = True,
) -> Optional[Tuple[Path, Dict[str, Any]]]:
    """The newest checkpoint in folder that loads, skipping (and naming, through warn) bad ones.

    Skipped: unreadable ones (damaged ones too, with verify), sharded saves that never finished, and
    those in `unreadable` (path: why; a restore found it).
    """
    warn = warn or logging.getLogger(__name__).warning
    found, unreadable = None, unreadable or {}
    for path in reversed(list_checkpoints(folder)):
        try:
            if path in unreadable:
                raise UnreadableCheckpoint(unreadable[path])
            found = path, load(path, verify)
            break
        except GptlabError as e:
            warn(f"warning: {e}; trying the previous checkpoint")
    newest = step_of(found[0]) if found else -1
    for partial in unfinished(folder):
        if step_of(partial) > newest:
            warn(
                f"warning: {partial} is a sharded save that did not finish (the job stopped during "
                f"it); skipped"
            )
    return found


def unfinished(folder: Path) -> List[Path]:
    """Sharded saves that never got their checkpoint's name (a job killed while saving)."""
    folder = Path(folder)
    return sorted(p for p in folder.iterdir() if _PARTIAL.match(p.name)) if folder.is_dir() else []


def _best_marker(folder: Path) -> Path:
    return Path(folder) / "best.json"


def mark_best(folder: Path, path: Path, val_loss: float) -> None:
    """Remember which checkpoint has the best validation loss so pruning keeps it."""
    marker = _best_marker(folder)
    tmp = marker.with_name(".best.json.tmp")
    tmp.write_text(json.dumps({"checkpoint": Path(path).name, "val_loss": val_loss}) + "\n")
    os.replace(tmp, marker)


def best(folder: Path) -> Optional[Path]:
    marker = _best_marker(folder)
    if not marker.is_file():
        return None
    path = Path(folder) / json.loads(marker.read_text())["checkpoint"]
    return path if path.exists() else None


def prune(folder: Path, keep: int) -> None:
    """Delete all but the newest `keep` checkpoints and the best one by validation loss."""
    keep_best = best(folder)
    for p in list_checkpoints(folder)[:-keep] if keep > 0 else []:
        if p != keep_best:
            _remove(p)
    for stale in Path(folder).glob(".ckpt_*.pt.tmp*"):  # left by a process killed mid-save
        if not stale.name.endswith(f".tmp{os.getpid()}"):
            stale.unlink(missing_ok=True)
    # sharded saves of a killed job (this one's own has its name now)
    for stale in unfinished(folder):
        _remove(stale)


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


# ------------------------------------------------------------------------------ the training state


class UnreadableCheckpoint(GptlabError):
    """A checkpoint an entry of which does not read back (damaged, or crafted).

    resume=auto skips it.
    """


# the live objects whose state a checkpoint holds, by name (build.Run.stateful() gives them)
STATEFUL = ("model", "optimizer", "scaler", "loader")


@dataclass
class TrainingState:
    """All a run needs to continue exactly, and to rebuild its model without the config tree."""

    step: int
    tokens: int  # tokens trained on so far (the loader's position is in `loader`)
    best_val_loss: float
    # model and optimizer by parameter name (get_state_dict): whole tensors in a .pt checkpoint;
    # this rank's shards (DTensors) while a sharded one is saved; None when read from one (they stay
    # in its shards until restore reads them into the live objects, in their layout)
    model: Optional[Dict[str, Any]]
    optimizer: Optional[Dict[str, Any]]
    scaler: Dict[str, Any]  # the fp16 GradScaler (a disabled scaler's state on other precisions)
    loader: Dict[str, Any]
    rng: Dict[str, Any]  # rng_state(): python, numpy, torch (and cuda) generators, as plain types
    config: Dict[str, Any]  # the resolved run config
    model_config: Dict[str, Any]  # GPTConfig's fields with the real vocabulary
    tokenizer: Dict[str, Any]  # the tokenizer's to_meta()
    mlflow_run_id: Optional[str]  # a resumed run goes on in the same MLflow run
    # the loop's other resumable values, as training/loop.py's Progress.state_dict() names them
    # (loss_window, train_loss, val_loss, best_val_bpb, val_bpb, hellaswag, divergence, ...):
    # saved as entries of their own beside the fields above; an older checkpoint has fewer, and
    # Progress.load_state_dict keeps its start value for what is missing
    progress_entries: Dict[str, Any] = field(default_factory=dict, metadata={"flat": True})
    # a sharded checkpoint's folder
    shards: Optional[Path] = field(default=None, metadata={"saved": False})
    format_version: int = field(default=FORMAT_VERSION, metadata={"saved": False})

    @classmethod
    def capture(cls, objects: Dict[str, Any], **values: Any) -> "TrainingState":
        """The state now (every rank calls it).

        objects maps each STATEFUL name to its live object; values: the fields above, and the loop's
        progress (Progress.state_dict()).
        """
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optimizer = get_state_dict(objects["model"], objects["optimizer"])
        rest = {k: objects[k].state_dict() for k in STATEFUL if k not in SHARDED_PARTS}
        own = {f.name for f in fields(cls)}
        return cls(
            model=model,
            optimizer=optimizer,
            **rest,
            rng=rng_state(),
            **{k: v for k, v in values.items() if k in own},
            progress_entries={k: v for k, v in values.items() if k not in own},
        )

    def progress(self) -> Dict[str, Any]:
        """The loop's progress as Progress.state_dict() wrote it.

        Progress.load_state_dict reads it.
        """
        return {
            "step": self.step,
            "tokens": self.tokens,
            "best_val_loss": self.best_val_loss,
            **self.progress_entries,
        }

    @property
    def sharded(self) -> bool:
        """Captured from a sharded model: its model entries are DTensors (saved through DCP)."""
        return any(is_dtensor(v) for v in (self.model or {}).values())

    def restore(self, objects: Dict[str, Any]) -> None:
        """Load every object's state and the random generators, so the run continues exactly.

        The model and optimizer are resharded to the live objects' layout: any strategy, any world
        size.
        """
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_state_dict,
            set_state_dict,
        )

        from gptlab.checkpoint.safe_dcp import UnreadableEntry, load_into

        model, optimizer = objects["model"], objects["optimizer"]
        # read into the live layout: each rank reads the slices it holds
        if self.shards is not None:
            msd, osd = get_state_dict(model, optimizer)
            try:
                load_into({"model": msd, "optimizer": osd}, self.shards)
            # damage, not a mismatch: every rank got it (resume falls back)
            except UnreadableEntry as e:
                raise UnreadableCheckpoint(_damaged(self.shards, e)) from None
            except RuntimeError as e:
                raise GptlabError(
                    f"checkpoint {self.shards} does not fit this model and optimizer: {e}"
                ) from None
            set_state_dict(model, optimizer, model_state_dict=msd, optim_state_dict=osd)
        # the optimizer's state by position: the unsharded objects only
        elif self.format_version == 1:
            if any(hasattr(p, "full_tensor") for p in model.parameters()):
                raise GptlabError(
                    "a v1 checkpoint resumes under parallelism=single or ddp only: resume it "
                    "there once "
                    "(its next checkpoint is v2), then under fsdp"
                )
            model.load_state_dict(self.model)
            optimizer.load_state_dict(self.optimizer)
        else:  # whole tensors: every rank keeps its own slice of them
            whole = StateDictOptions(full_state_dict=True)
            set_state_dict(
                model,
                optimizer,
                model_state_dict=self.model,
                optim_state_dict=self.optimizer,
                options=whole,
            )
        for name in STATEFUL:
            if name not in SHARDED_PARTS:
                objects[name].load_state_dict(getattr(self, name))
        restore_rng(self.rng)

    def _saved(self, *leave_out: str) -> Dict[str, Any]:
        saved: Dict[str, Any] = {}
        for f in fields(self):
            if not f.metadata.get("saved", True) or f.name in leave_out:
                continue
            if f.metadata.get("flat"):  # the loop's entries, each under its own name
                saved.update(getattr(self, f.name))
            else:
                saved[f.name] = getattr(self, f.name)
        return saved

    def contents(self, *leave_out: str) -> Dict[str, Any]:
        """What a save writes: every saved field but those in leave_out."""
        return self._saved(*leave_out)

    def save(self, path: Path) -> Path:
        return save(path, self._saved())

    def save_sharded(self, path: Path, is_main: bool) -> Path:
        """Write the state as a sharded checkpoint at path (every rank calls it).

        Every rank writes its shards into .<name>.partial/, rank 0 adds state.pt and renames it to
        path once all parts are complete (a killed save never appears under a checkpoint's name).
        """
        import torch.distributed.checkpoint as dcp

        tmp = begin_sharded(path, is_main)
        dcp.save(
            {"model": self.model, "optimizer": self.optimizer},
            storage_writer=dcp.FileSystemWriter(str(tmp)),
        )
        # dcp.save returned: every rank's shards and the metadata are written and synced
        if is_main:
            finish_sharded(tmp, path, self._saved(*SHARDED_PARTS))
        _barrier()  # nobody lists or prunes checkpoints before the rename
        return Path(path)

    @classmethod
    def load(cls, path: Path, verify: bool = True) -> "TrainingState":
        return cls.from_dict(path, load(path, verify))

    @classmethod
    def from_dict(cls, path: Path, state: Dict[str, Any]) -> "TrainingState":
        """The state checkpoint.load(path) read.

        For a sharded checkpoint it is its state.pt: the shards stay put.
        """
        if Path(path).is_dir():
            state = {**state, "model": None, "optimizer": None, "shards": Path(path)}
        names = [f.name for f in fields(cls) if not f.metadata.get("flat")]
        required = [
            f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING
        ]
        missing = [name for name in required if name not in state]
        if missing:
            raise GptlabError(
                f"checkpoint {path} is not a gptlab training checkpoint (no {', '.join(missing)})"
            )
        entries = {k: v for k, v in state.items() if k not in names}
        return cls(**{n: state[n] for n in names if n in state}, progress_entries=entries)


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def begin_sharded(path: Path, is_main: bool) -> Path:
    """The folder every rank writes a sharded checkpoint's shards into; every rank calls it.

    The folder is .<name>.partial/, emptied by rank 0 first.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.partial")
    if is_main:
        path.parent.mkdir(parents=True, exist_ok=True)
        # a killed save's leftovers (maybe from more ranks)
        shutil.rmtree(tmp, ignore_errors=True)
    _barrier()
    return tmp


def finish_sharded(tmp: Path, path: Path, rest: Dict[str, Any]) -> None:
    """Turn tmp into a checkpoint on rank 0, once every rank's shards and the metadata are in it.

    It writes state.pt (the rest), sha256.json, then the rename that makes it a checkpoint.
    """
    save(tmp / STATE_FILE, rest)
    write_manifest(tmp)
    old = path.with_name(f".{path.name}.replaced")
    if path.exists():  # the same step saved again (a stop at a checkpoint step)
        shutil.rmtree(old, ignore_errors=True)
        os.rename(path, old)
    os.rename(tmp, path)
    _fsync_dir(path.parent)
    shutil.rmtree(old, ignore_errors=True)


def read_model(
    path: Path, optimizer_entries: Sequence[str] = (), verify: bool = True
) -> TrainingState:
    """Read a checkpoint's model (sample, export): model_config, whole weights, tokenizer and step.

    A sharded checkpoint's weights are consolidated here, in this process; it is loaded without code
    execution, restored into nothing. optimizer_entries: per-parameter optimizer state to read too,
    whole, by entry name (a single-file checkpoint holds all of it anyway). verify: check the
    digests recorded at save.
    """
    state = TrainingState.load(path, verify)
    if state.shards is not None:
        from gptlab.checkpoint.safe_dcp import UnreadableEntry, load_whole

        try:
            state.model = load_whole(state.shards, ["model"])["model"]
            if optimizer_entries:
                keys = [
                    f"optimizer.state.{name}.{entry}"
                    for name in state.model
                    for entry in optimizer_entries
                ]
                state.optimizer = load_whole(state.shards, keys).get("optimizer")
        except UnreadableEntry as e:
            raise UnreadableCheckpoint(_damaged(state.shards, e)) from None
    return state


def _damaged(path: Path, e: UnreadableEntry) -> str:
    return f"checkpoint {path} has an {e}"


def save_state(
    folder: Path, state: TrainingState, val_loss: Optional[float], keep: int, is_main: bool = True
) -> Path:
    """Save the state as the step's checkpoint; every rank calls it.

    A sharded state is written by all, a whole one by rank 0; rank 0 remembers it as the best when
    val_loss is the best so far, and prunes to the newest `keep` checkpoints plus the best.
    """
    path = checkpoint_path(folder, state.step, sharded=state.sharded)
    if state.sharded:
        state.save_sharded(path, is_main)
    elif is_main:
        state.save(path)
    if is_main:
        saved(folder, path, val_loss, state.best_val_loss, keep)
    return path


def saved(folder: Path, path: Path, val_loss: Optional[float], best_val: float, keep: int) -> None:
    """On rank 0, once path is written: remember it if it is the best, and prune.

    It is the best when val_loss is the best so far; pruning keeps the newest `keep` checkpoints
    plus the best.
    """
    if val_loss is not None and val_loss <= best_val:
        mark_best(folder, path, val_loss)
    prune(folder, keep)


def find(run: str, which: str = "latest") -> Path:
    """The checkpoint a command means by `run`: a checkpoint file, or a run folder's newest.

    With which=best, a run folder's best by validation loss.
    """
    path = Path(run).expanduser()
    if path.is_file() or (path / STATE_FILE).is_file():
        return path
    folder = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    if which == "best" and (found := best(folder)) is not None:
        return found
    found = latest(folder)
    if found is None:
        # a run keeps them there
        where = folder if folder.name == "checkpoints" else path / "checkpoints"
        raise GptlabError(
            f"run={run}: no checkpoint found (expected {where}/ckpt_<step>.pt such as "
            f"{checkpoint_path(Path(), 30).name}, or a sharded {where}/ckpt_<step>/)"
        )
    return found


def rng_state() -> Dict[str, Any]:
    """RNG states as plain types (safe for weights_only loading)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": [kind, keys.tolist(), pos, has_gauss, cached],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: Dict[str, Any]) -> None:
    random.setstate(state["python"])  # torch.save keeps getstate()'s tuples as tuples
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        # one state per GPU the saving process saw: a resume may see fewer (any world size
        # resumes; seed_step reseeds every device at each step anyway), or more
        saved = state["cuda"]
        for index in range(min(len(saved), torch.cuda.device_count())):
            torch.cuda.set_rng_state(saved[index], index)
