"""Where a run's records go: the `Sink` interface, the run folder's files and TensorBoard's events.

`records/tracker.py`'s `Tracker` holds one sink per place that records (its `SINKS` table: the run
folder, TensorBoard, MLflow) and hands every call to each. A new place to record is one `Sink`
subclass and one entry in `SINKS`; a sink overrides only the calls it keeps.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional

from gptlab.errors import never_fatal
from gptlab.records import identity as ids
from gptlab.records import layout
from gptlab.records.identity import RunIdentity
from gptlab.records.store import error_text, mlflow_metrics

if TYPE_CHECKING:
    from gptlab.config import TrackingConfig

log = logging.getLogger(__name__)


@dataclass
class Opening:
    """What a sink opens with: the run folder, tracking's config, the run's identity and params."""

    run_dir: Path
    cfg: TrackingConfig
    uri: str  # the store: tracking.uri, else paths.mlflow_db's
    run: RunIdentity  # what the run is recorded as (identity.identify)
    params: Dict[str, Any]  # MLflow's params: the resolved config and the derived figures
    resume_run_id: Optional[str]  # the checkpoint's MLflow run, continued
    # hands a file a sink wrote in the run folder to every sink (Tracker.log_artifact)
    publish: Callable[[Path], None]


class Sink:
    """One place a run's records go. Every call does nothing here: a sink overrides what it keeps.

    A sink that is not `essential` never stops a run: the tracker warns once when one fails and
    drops it. The run folder is essential: it is the run's record.
    """

    name = "records"  # how warnings name it
    essential = False

    @classmethod
    def open(cls, opening: Opening) -> Optional["Sink"]:
        """This run's sink, or None when the config leaves it off."""
        return cls()

    def log_metrics(self, step: int, metrics: Dict[str, Any]) -> None:
        """Log a step's figures (its metrics.jsonl row, less the step); a value may be None.

        By default, the same as any other figures of a step.
        """
        self.log_side_metrics(step, metrics)

    def log_side_metrics(self, step: int, metrics: Dict[str, Any]) -> None:
        """Figures of a step that are not its training row (a checkpoint's stall)."""

    def log_artifact(self, path: Path, artifact_path: Optional[str] = None) -> None:
        """A file of the run to keep a copy of (the run folder's own are published here too)."""

    def set_tag(self, key: str, value: str) -> None:
        """A label of the run (expected_met, ...)."""

    def log_inputs(self, datasets: List[Dict[str, Any]]) -> None:
        """The run's data (records/lineage.py's descriptions)."""

    def write_config(self, resolved: Dict[str, Any], derived: Dict[str, Any]) -> None:
        """The resolved config and the figures derived from it."""

    def write_results(self, results: Dict[str, Any]) -> None:
        """The run's final figures, as results.json holds them."""

    def finish(self, status: str, error: Optional[BaseException]) -> None:
        """The run ended (FINISHED, FAILED, KILLED); error: what failed it, when something did."""


class RunFolder(Sink):
    """The run folder's records.

    metrics.jsonl, run.json, config_resolved.yaml, derived.json, results.json and the loss plot.
    """

    name = "the run folder"
    essential = True

    def __init__(self, opening: Opening):
        self.run_dir = Path(opening.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.title = opening.run.name
        self.plots = opening.cfg.plots
        self.publish = opening.publish
        # line-buffered for the whole run, closed by finish()
        self._metrics = open(self.run_dir / layout.METRICS, "a", buffering=1)  # noqa: SIM115
        ids.write(self.run_dir, opening.run)

    @classmethod
    def open(cls, opening: Opening) -> "RunFolder":
        return cls(opening)

    def log_metrics(self, step: int, metrics: Dict[str, Any]) -> None:
        row = {"step": step, **{k: v for k, v in metrics.items() if v is not None}}
        self._metrics.write(json.dumps(row) + "\n")

    def write_config(self, resolved: Dict[str, Any], derived: Dict[str, Any]) -> None:
        """Write config_resolved.yaml and derived.json.

        config_resolved.yaml has its interpolations filled in (also an artifact); derived.json holds
        MLflow's derived.* params, for gptlab.sync too.
        """
        import yaml

        path = self.run_dir / layout.CONFIG
        path.write_text(yaml.safe_dump(resolved, sort_keys=False))
        self.publish(path)
        (self.run_dir / layout.DERIVED).write_text(json.dumps(derived, indent=1) + "\n")

    def write_results(self, results: Dict[str, Any]) -> None:
        """results.json, atomically (the tracker made every figure strict JSON)."""
        path = self.run_dir / layout.RESULTS
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(results, indent=2, allow_nan=False) + "\n")
        os.replace(tmp, path)
        self.publish(path)

    def finish(self, status: str, error: Optional[BaseException]) -> None:
        self._metrics.close()
        if self.plots:
            self._plot()

    def _plot(self) -> None:
        rows = layout.read_metrics(self.run_dir)
        if not rows:
            return
        path = self.run_dir / layout.LOSS_PLOT
        plotted = False
        # a plot must never fail a run
        with never_fatal(lambda e: log.warning(f"{layout.LOSS_PLOT} skipped: {error_text(e)}")):
            try:
                plot_loss(rows, path, self.title)
            except ImportError:
                log.warning(
                    f"{layout.LOSS_PLOT} skipped: matplotlib is not installed (pip install "
                    "matplotlib)"
                )
                return
            plotted = True
        if plotted:
            self.publish(path)


class TensorBoard(Sink):
    """tracking.tensorboard: event files in <run folder>/tensorboard.

    They are written under MLflow's metric names.
    """

    name = "TensorBoard"

    def __init__(self, writer: Any):
        self.writer = writer

    @classmethod
    def open(cls, opening: Opening) -> Optional["TensorBoard"]:
        if not opening.cfg.tensorboard:
            return None
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            log.warning(
                "TensorBoard event files skipped: the tensorboard package is not installed (pip "
                "install tensorboard)"
            )
            return None
        return cls(SummaryWriter(log_dir=str(Path(opening.run_dir) / layout.TENSORBOARD)))

    def log_side_metrics(self, step: int, metrics: Dict[str, Any]) -> None:
        for name, value in mlflow_metrics(metrics).items():
            self.writer.add_scalar(name, value, step)

    def finish(self, status: str, error: Optional[BaseException]) -> None:
        self.writer.close()


def plot_loss(rows: List[Dict[str, Any]], path: Path, title: str) -> None:
    """PNG of train and val loss against tokens, with lr on a second axis (needs matplotlib)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    def series(key: str):
        pts = [
            (r["tokens"], r[key])
            for r in rows
            if r.get(key) is not None and r.get("tokens") is not None
        ]
        return [p[0] for p in pts], [p[1] for p in pts]

    fig = Figure(figsize=(8, 4.5), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for key, style in (
        ("train_loss", dict(color="tab:blue", lw=1.5)),
        ("val_loss", dict(color="tab:orange", marker="o", ms=3, lw=1.5)),
    ):
        x, y = series(key)
        if x:
            ax.plot(x, y, label=key.replace("_", " "), **style)
    ax.set_xlabel("tokens")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    x, y = series("lr")
    handles, labels = ax.get_legend_handles_labels()
    if x:
        ax2 = ax.twinx()
        ax2.plot(x, y, color="tab:gray", ls="--", lw=1, label="lr")
        ax2.set_ylabel("lr")
        ax2.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))
        h2, l2 = ax2.get_legend_handles_labels()
        handles, labels = handles + h2, labels + l2
    if handles:
        ax.legend(handles, labels, loc="upper right")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
