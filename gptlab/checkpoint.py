"""Checkpoints: atomic save, safe load, and finding the newest one. Knows no model class."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

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
    """Load a checkpoint without executing code from it (weights_only unpickling)."""
    try:
        state = torch.load(Path(path), map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise GptlabError(f"checkpoint {path}: no such file") from None
    except Exception as e:  # noqa: BLE001 - truncated, corrupt or unsafe files all land here
        raise GptlabError(f"checkpoint {path} is unreadable or unsafe ({str(e).splitlines()[0][:200]})") from None
    if not isinstance(state, dict) or state.get("format_version") != FORMAT_VERSION:
        raise GptlabError(f"checkpoint {path} is not a gptlab v{FORMAT_VERSION} checkpoint")
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


def load_latest_good(folder: Path, warn=print) -> Optional[Tuple[Path, Dict[str, Any]]]:
    """The newest checkpoint in folder that loads, skipping (and naming) unreadable ones."""
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
