"""Records: the run folder (always) and MLflow (when reachable), written by rank 0 only.

Other ranks get ``NullTracker``, so the training loop calls the same methods everywhere and never
branches on whether logging is on. A tracking store that is down or fails never stops training: the
tracker warns once, stops using MLflow, and the run folder still gets everything.
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
import urllib.request
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

METRIC_NAMES = {  # flat run-folder key -> MLflow name, grouped by prefix so runs overlay in the UI
    "train_loss": "train/loss",
    "val_loss": "val/loss",
    "lr": "opt/lr",
    "grad_norm": "opt/grad_norm",
    "tokens_per_s": "perf/tokens_per_s",
    "mfu": "perf/mfu",
    "tokens": "tokens",
}


@dataclass
class TrackingConfig:
    mlflow: bool = True  # false: only the run folder is written
    uri: Optional[str] = None  # null: the local store sqlite:///<cwd>/outputs/mlflow.db
    experiment: Optional[str] = None  # null: "<model>-<data>"
    run_name: Optional[str] = None  # null: "<model>-<data>-<hardware>"
    flush_every: int = 50  # metric points buffered before one batched MLflow call


def default_uri(outputs: Path) -> str:
    return f"sqlite:///{outputs.resolve() / 'mlflow.db'}"


def ui_command(uri: str) -> str:
    """The command that opens the MLflow UI on the store at uri."""
    if uri.startswith("http://") or uri.startswith("https://"):
        return f"open {uri} (the server is already the UI)"
    cmd = f"mlflow ui --backend-store-uri {shlex.quote(uri)}"
    if uri.startswith("sqlite:///"):
        artifacts = Path(uri[len("sqlite:///"):]).parent / "mlartifacts"
        cmd += f" --default-artifact-root {shlex.quote(str(artifacts))}"
    return cmd


def git_commit() -> Optional[str]:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent,
                             capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or None if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def flatten(d: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


class NullTracker:
    """What non-zero ranks get: every call does nothing."""

    run_id: Optional[str] = None
    uri: Optional[str] = None

    def log_metrics(self, step: int, metrics: Dict[str, float]) -> None: ...

    def log_artifact(self, path: Path) -> None: ...

    def write_config(self, resolved: Dict[str, Any]) -> None: ...

    def write_results(self, results: Dict[str, Any]) -> None: ...

    def finish(self, status: str = "FINISHED") -> None: ...


class MLflowRun:
    """A thin wrapper over MlflowClient that turns any failure into one warning and a no-op."""

    def __init__(self, cfg: TrackingConfig, uri: str, experiment: str, run_name: str,
                 params: Dict[str, Any], tags: Dict[str, str], artifact_root: Optional[Path]):
        self.uri = uri
        self.flush_every = cfg.flush_every
        self.run_id: Optional[str] = None
        self._buffer: List[Any] = []
        self._client = None
        # MLflow's HTTP client retries for minutes by default; a down server should cost seconds.
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "15")
        try:
            self._check_reachable(uri)
            from mlflow.entities import Param, RunTag
            from mlflow.tracking import MlflowClient

            client = MlflowClient(tracking_uri=uri)
            exp = client.get_experiment_by_name(experiment)
            if exp is None:
                location = (artifact_root / experiment).as_uri() if artifact_root else None
                exp_id = client.create_experiment(experiment, artifact_location=location)
            else:
                exp_id = exp.experiment_id
            run = client.create_run(exp_id, run_name=run_name, tags=tags)
            self.run_id = run.info.run_id
            items = [Param(k, str(v)[:6000]) for k, v in params.items()]
            for i in range(0, len(items), 100):  # MLflow accepts at most 100 params per batch
                client.log_batch(self.run_id, params=items[i : i + 100])
            self._client = client
            self.experiment_id = exp_id
        except Exception as e:  # noqa: BLE001 - any tracking failure must not stop training
            self._fail(e)

    @staticmethod
    def _check_reachable(uri: str) -> None:
        if uri.startswith("http://") or uri.startswith("https://"):
            try:
                urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=5).read()
            except Exception as e:  # noqa: BLE001
                raise ConnectionError(f"tracking server {uri} is unreachable ({e})") from None

    def _fail(self, e: Exception) -> None:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        warnings.warn(f"MLflow disabled for this run: {first[:300]}; the run folder still records "
                      "everything", RuntimeWarning, stacklevel=3)
        self._client = None

    def log_metrics(self, step: int, metrics: Dict[str, float]) -> None:
        if self._client is None:
            return
        from mlflow.entities import Metric

        import time as _time
        now = int(_time.time() * 1000)
        for k, v in metrics.items():
            if k in METRIC_NAMES and v is not None:
                self._buffer.append(Metric(METRIC_NAMES[k], float(v), now, step))
        if len(self._buffer) >= self.flush_every * 4:
            self.flush()

    def flush(self) -> None:
        if self._client is None or not self._buffer:
            return
        try:
            for i in range(0, len(self._buffer), 1000):
                self._client.log_batch(self.run_id, metrics=self._buffer[i : i + 1000])
        except Exception as e:  # noqa: BLE001
            self._fail(e)
        self._buffer = []

    def log_artifact(self, path: Path) -> None:
        if self._client is None:
            return
        try:
            self._client.log_artifact(self.run_id, str(path))
        except Exception as e:  # noqa: BLE001
            self._fail(e)

    def set_tag(self, key: str, value: str) -> None:
        if self._client is not None:
            try:
                self._client.set_tag(self.run_id, key, value)
            except Exception as e:  # noqa: BLE001
                self._fail(e)

    def finish(self, status: str) -> None:
        self.flush()
        if self._client is not None:
            try:
                self._client.set_terminated(self.run_id, status=status)
            except Exception as e:  # noqa: BLE001
                self._fail(e)

    @property
    def active(self) -> bool:
        return self._client is not None


class Tracker:
    """Rank 0's records: metrics.jsonl and results.json in the run folder, mirrored to MLflow."""

    def __init__(self, run_dir: Path, cfg: TrackingConfig, outputs: Path, experiment: str,
                 run_name: str, params: Dict[str, Any], tags: Dict[str, str]):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._metrics = open(self.run_dir / "metrics.jsonl", "a", buffering=1)
        self.uri = cfg.uri or default_uri(outputs)
        self.mlflow: Optional[MLflowRun] = None
        if cfg.mlflow:
            artifacts = outputs.resolve() / "mlartifacts" if cfg.uri is None else None
            tags = {**tags, "host": socket.gethostname()}
            if commit := git_commit():
                tags["git_commit"] = commit
            self.mlflow = MLflowRun(cfg, self.uri, experiment, run_name, params, tags, artifacts)

    @property
    def run_id(self) -> Optional[str]:
        return self.mlflow.run_id if self.mlflow and self.mlflow.active else None

    def log_metrics(self, step: int, metrics: Dict[str, float]) -> None:
        row = {"step": step, **{k: v for k, v in metrics.items() if v is not None}}
        self._metrics.write(json.dumps(row) + "\n")
        if self.mlflow:
            self.mlflow.log_metrics(step, metrics)

    def log_artifact(self, path: Path) -> None:
        if self.mlflow:
            self.mlflow.log_artifact(path)

    def write_config(self, resolved: Dict[str, Any]) -> None:
        """The resolved config (interpolations filled in) as config_resolved.yaml, also an artifact."""
        import yaml

        path = self.run_dir / "config_resolved.yaml"
        path.write_text(yaml.safe_dump(resolved, sort_keys=False))
        self.log_artifact(path)

    def write_results(self, results: Dict[str, Any]) -> None:
        path = self.run_dir / "results.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(results, indent=2) + "\n")
        os.replace(tmp, path)
        self.log_artifact(path)

    def finish(self, status: str = "FINISHED") -> None:
        self._metrics.close()
        if self.mlflow:
            self.mlflow.finish(status)
            if self.mlflow.active:
                print(f"MLflow run {self.mlflow.run_id} in {self.uri}\n"
                      f"  open the UI with: {ui_command(self.uri)}", flush=True)
