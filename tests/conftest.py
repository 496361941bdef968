"""Shared fixtures: tiny configs composed through Hydra's compose API from the real conf/ tree."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

import gptlab.config  # noqa: F401 - registers the schema in Hydra's ConfigStore

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"
SHAKESPEARE = Path(os.environ.get("GPTLAB_SHAKESPEARE", REPO.parent / "shared" / "data" / "tinyshakespeare.txt"))


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory):
    """Prepared token files go to a per-session folder, not the user's ~/.cache."""
    os.environ["GPTLAB_CACHE_DIR"] = str(tmp_path_factory.mktemp("gptlab-cache"))
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    yield


@pytest.fixture(scope="session")
def shakespeare() -> Path:
    if not SHAKESPEARE.is_file():
        pytest.fail(f"Tiny Shakespeare not found at {SHAKESPEARE}; set GPTLAB_SHAKESPEARE")
    return SHAKESPEARE


def compose_config(overrides: List[str]) -> DictConfig:
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF)):
        return compose(config_name="config", overrides=overrides)


def typed(section: str, *overrides: str, **changes: Any) -> Any:
    """One typed section of the composed config (conf/ gives every value), with some fields changed.

    A dict for a nested section (data's tokenizer) changes only the fields it names.
    """
    from gptlab.config import to_config

    return _replace(getattr(to_config(compose_config(list(overrides))), section), changes)


def _replace(obj: Any, changes: Dict[str, Any]) -> Any:
    nested = {
        k: _replace(getattr(obj, k), v)
        for k, v in changes.items()
        if isinstance(v, dict) and dataclasses.is_dataclass(getattr(obj, k))
    }
    return dataclasses.replace(obj, **{**changes, **nested})


def model_config(**changes: Any):
    """gpt_nano's GPTConfig with fields changed (vocab_size must be given to build a GPT)."""
    return typed("model", "model=gpt_nano", **changes)


def data_config(**changes: Any):
    """The Tiny Shakespeare data section, split into 8-way shards unless changed."""
    return typed("data", **{"shard_divisor": 8, **changes})


def nano_overrides(data_path: Path, *extra: str) -> List[str]:
    """A seconds-long fp32 run of the nano model, with MLflow off unless asked for."""
    return [
        "model=gpt_nano",
        f"data.path={data_path}",
        "train.max_steps=20",
        "train.batch_size=8",
        "train.eval_every=10",
        "train.eval_steps=2",
        "train.log_every=5",
        "train.sample_tokens=20",
        "tracking.mlflow=false",
        "optimizer.warmup_steps=5",
        *extra,
    ]


def run_cli(args: List[str], cwd: Path, timeout: float = 300, env_extra=None) -> subprocess.CompletedProcess:
    """Run `python -m <args>` as a user would, from cwd."""
    env = {**os.environ, **(env_extra or {})}
    env.pop("HYDRA_FULL_ERROR", None)
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
