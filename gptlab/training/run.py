"""Run: everything the training loop needs, already built (gptlab/training/build.py makes it)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.nn as nn

from gptlab.console import Reporter
from gptlab.data import RandomWindowLoader, Tokenizer
from gptlab.distributed import world as distributed
from gptlab.distributed.world import Dist
from gptlab.model.gpt import GPT
from gptlab.optim.average import averaged_weights
from gptlab.records import runfolder


@dataclass
class Run:
    """Everything the loop needs, already built."""

    train: Any  # TrainConfig
    dist: Dist
    model: nn.Module  # wrapped (checkpointing -> compile -> DDP)
    raw_model: GPT
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    lr_at: Callable[[int], float]
    grad_clip: float
    train_loader: RandomWindowLoader
    val_batches: List[Any]
    tokenizer: Tokenizer
    tracker: Any  # Tracker on rank 0, NullTracker elsewhere
    reporter: Reporter  # progress lines and timing windows (speaks on rank 0)
    autocast: Callable[[], contextlib.AbstractContextManager]
    block_size: int
    num_params: int
    flops_per_token: float
    peak_flops: float
    run_dir: Path
    checkpoint_dir: Path
    resolved_config: Dict[str, Any]
    model_config: Dict[str, Any]
    summary: str = ""
    # the resumed checkpoint's progress as loop.Progress.state_dict() wrote it ({}: a new run); the
    # loop starts from it (Progress.load_state_dict)
    resumed: Dict[str, Any] = field(default_factory=dict)
    # on resume after a crash, steps already in metrics.jsonl / MLflow (logged after the checkpoint)
    # are not logged again: an exact resume recomputes the same values
    logged_until_step: int = 0
    # each token id's UTF-8 length in bytes, on the device (special tokens: 0), for val_bpb
    token_bytes: Optional[torch.Tensor] = None
    # HellaSwag's rendered examples and eval.hellaswag, when the loop scores it (every > 0)
    hellaswag: Optional[List[Any]] = None
    hellaswag_config: Any = None
    # search.trial.TrialLink when this run is a trial of a hyperparameter search (pruning)
    trial: Any = None
    # profiling.StepProfiler when train.profile asks for one (else the loop checks nothing)
    profiler: Any = None
    derived: Dict[str, Any] = field(default_factory=dict)
    # a mixture's sources, each measured on its own: {name: (weight, validation batches)}
    val_sets: Dict[str, Tuple[float, List[Any]]] = field(default_factory=dict)
    # checkpoint.background.Saver: the save in flight and each save's stall (made at the first save)
    saver: Any = None

    @property
    def start_step(self) -> int:
        """The step this session starts at: 0, or the resumed checkpoint's."""
        return int(self.resumed.get("step", 0))

    @property
    def start_tokens(self) -> int:
        """The tokens trained before this session: 0, or the resumed checkpoint's."""
        return int(self.resumed.get("tokens", 0))

    @property
    def timings(self) -> List[Tuple[int, float, int]]:
        """(step, seconds, tokens) per timing window of the loop (gptlab.bench reads them)."""
        return self.reporter.timings

    def stateful(self) -> Dict[str, Any]:
        """The live objects a checkpoint saves, by checkpoint.STATEFUL name."""
        return {
            "model": self.raw_model,
            "optimizer": self.optimizer,
            "scaler": self.scaler,
            "loader": self.train_loader,
        }

    @contextlib.contextmanager
    def evaluated_weights(self) -> Iterator[None]:
        """Inside, the model holds the weights a run evaluates, samples and exports.

        That is the weight average with optimizer.ema_decay > 0 (the training weights come back
        afterwards), else the weights.
        """
        with averaged_weights(self.optimizer) as swapped:
            try:
                yield
            # a sharded model's gathered copies of the average must not reach the next step
            finally:
                if swapped:
                    distributed.reshard(self.raw_model)

    def close(self, status: str) -> None:
        """Finish the records (FINISHED / FAILED), free the run folder, leave the process group."""
        self.tracker.finish(status)
        runfolder.unlock(self.run_dir)
        distributed.teardown()
