"""Checkpoints: what one holds (``TrainingState``), atomic save, safe load, pruning.

The one module that knows a checkpoint's keys. The loop captures a ``TrainingState`` from the live
objects and saves it; build restores one into freshly built objects; sample and export read the
model part of one (``read_model``); runfolder.py decides which one a run continues. Adding a field
to what a run saves is a change here only. Knows no model class: it sees objects with
``state_dict()`` / ``load_state_dict()``.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

from gptlab.errors import GptlabError

FORMAT_VERSION = 1
_NAME = re.compile(r"^ckpt_(\d{8})\.pt$")


def checkpoint_path(folder: Path, step: int) -> Path:
    return Path(folder) / f"ckpt_{step:08d}.pt"


def save(path: Path, state: Dict[str, Any]) -> Path:
    """Write state to path atomically: a temporary file in the same folder, fsync, then rename.

    A crash at any point leaves either the old file set or the new one, never a half-written file
    under a checkpoint's name.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        torch.save({"format_version": FORMAT_VERSION, **state}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)
    return path


def load(path: Path) -> Dict[str, Any]:
    """Load a checkpoint without executing code from it (weights_only unpickling).

    Whatever else the file is, the error is one line naming it: missing, a folder, unreadable, not a
    PyTorch file, truncated, a pickle that would run code (refused unread), or not gptlab's.
    """
    import warnings

    path = Path(path)
    try:
        with warnings.catch_warnings():  # a foreign pickle's protocol notice would be a second line
            warnings.simplefilter("ignore")
            state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise GptlabError(f"checkpoint {path}: no such file") from None
    except IsADirectoryError:
        raise GptlabError(f"checkpoint {path} is a folder: give a checkpoint file (ckpt_<step>.pt)") from None
    except OSError as e:  # permission denied, an I/O error
        raise GptlabError(f"checkpoint {path} cannot be read ({e.strerror or e})") from None
    except Exception as e:  # noqa: BLE001 - truncated, corrupt or unsafe files all land here
        # torch's own message is a page long (its weights_only upgrade notice) or says nothing
        # ("101", "pop from empty list"): say what the file is instead.
        blocked = re.search(r"GLOBAL ([\w.]+)", str(e))
        try:
            with open(path, "rb") as f:
                head = f.read(4)
        except OSError:
            head = b"?"
        if blocked:
            why = f"unreadable or unsafe: loading it would run {blocked.group(1)}"
        elif not head:
            why = "an empty file"
        elif head.startswith(b"PK"):  # torch.save writes a zip archive
            why = "a truncated or corrupt PyTorch file"
        else:
            why = "not a PyTorch file"
        raise GptlabError(f"checkpoint {path} is not a gptlab checkpoint ({why})") from None
    if not isinstance(state, dict) or "format_version" not in state:
        raise GptlabError(f"checkpoint {path} is not a gptlab checkpoint (a PyTorch file that gptlab did not write)")
    if state["format_version"] != FORMAT_VERSION:
        raise GptlabError(
            f"checkpoint {path} has checkpoint format v{state['format_version']}; this gptlab reads "
            f"v{FORMAT_VERSION}: use the gptlab version that wrote it"
        )
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
    folder: Path, warn: Optional[Callable[[str], None]] = None
) -> Optional[Tuple[Path, Dict[str, Any]]]:
    """The newest checkpoint in folder that loads, skipping (and naming, through warn) unreadable ones."""
    warn = warn or logging.getLogger(__name__).warning
    for path in reversed(list_checkpoints(folder)):
        try:
            return path, load(path)
        except GptlabError as e:
            warn(f"warning: {e}; trying the previous checkpoint")
    return None


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
    return path if path.is_file() else None


def prune(folder: Path, keep: int) -> None:
    """Delete all but the newest `keep` checkpoints and the best one by validation loss."""
    keep_best = best(folder)
    for p in list_checkpoints(folder)[:-keep] if keep > 0 else []:
        if p != keep_best:
            p.unlink(missing_ok=True)
    for stale in Path(folder).glob(".ckpt_*.pt.tmp*"):  # left by a process killed mid-save
        if not stale.name.endswith(f".tmp{os.getpid()}"):
            stale.unlink(missing_ok=True)


# ------------------------------------------------------------------------------ the training state

# the live objects whose state_dict() a checkpoint holds, by name (build.Run.stateful() gives them)
STATEFUL = ("model", "optimizer", "scaler", "loader")


@dataclass
class TrainingState:
    """Everything a run needs to continue exactly, and to rebuild its model without the config tree."""

    step: int
    tokens: int  # tokens trained on so far (the loader's position is in `loader`)
    best_val_loss: float
    model: Dict[str, Any]  # the unwrapped model's state_dict
    optimizer: Dict[str, Any]
    scaler: Dict[str, Any]  # the fp16 GradScaler (a disabled scaler's state on other precisions)
    loader: Dict[str, Any]
    rng: Dict[str, Any]  # rng_state(): python, numpy, torch (and cuda) generators, as plain types
    config: Dict[str, Any]  # the resolved run config
    model_config: Dict[str, Any]  # GPTConfig's fields with the real vocabulary
    tokenizer: Dict[str, Any]  # the tokenizer's to_meta()
    mlflow_run_id: Optional[str]  # a resumed run goes on in the same MLflow run
    # the train-loss average in progress: (sum of the per-step losses, averaged over ranks; steps), so
    # that a resumed run logs the same averages as one that was never stopped (older checkpoints: empty)
    loss_window: Tuple[float, int] = (0.0, 0)

    @classmethod
    def capture(cls, objects: Dict[str, Any], **fields_: Any) -> "TrainingState":
        """The state now: objects maps each STATEFUL name to its live object; fields_ the rest."""
        return cls(**{k: objects[k].state_dict() for k in STATEFUL}, rng=rng_state(), **fields_)

    def restore(self, objects: Dict[str, Any]) -> None:
        """Load every object's state and the random generators (the run continues exactly)."""
        for name in STATEFUL:
            objects[name].load_state_dict(getattr(self, name))
        restore_rng(self.rng)

    def save(self, path: Path) -> Path:
        return save(path, {f.name: getattr(self, f.name) for f in fields(self)})

    @classmethod
    def load(cls, path: Path) -> "TrainingState":
        return cls.from_dict(path, load(path))

    @classmethod
    def from_dict(cls, path: Path, state: Dict[str, Any]) -> "TrainingState":
        names = [f.name for f in fields(cls)]
        missing = [f.name for f in fields(cls) if f.name not in state and f.default is MISSING]
        if missing:
            raise GptlabError(f"checkpoint {path} is not a gptlab training checkpoint (no {', '.join(missing)})")
        return cls(**{n: state[n] for n in names if n in state})


def read_model(path: Path) -> TrainingState:
    """A checkpoint to read the model from (sample, export): its model_config, model weights,
    tokenizer and step; loaded without code execution, restored into nothing."""
    return TrainingState.load(path)


def save_state(folder: Path, state: TrainingState, val_loss: Optional[float], keep: int) -> Path:
    """Save the state as the step's checkpoint, remember it as the best when val_loss is the best so
    far, and prune to the newest `keep` checkpoints plus the best."""
    path = state.save(checkpoint_path(folder, state.step))
    if val_loss is not None and val_loss <= state.best_val_loss:
        mark_best(folder, path, val_loss)
    prune(folder, keep)
    return path


def find(run: str, which: str = "latest") -> Path:
    """The checkpoint a command means by `run`: a checkpoint file, or a run folder's newest (or, with
    which=best, its best by validation loss)."""
    path = Path(run).expanduser()
    if path.is_file():
        return path
    folder = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    if which == "best" and (found := best(folder)) is not None:
        return found
    found = latest(folder)
    if found is None:
        raise GptlabError(f"run={run}: no checkpoint found (expected {folder}/ckpt_*.pt)")
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
    random.setstate(tuple(x if not isinstance(x, list) else tuple(x) for x in state["python"]))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
