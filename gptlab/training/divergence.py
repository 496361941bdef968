"""Divergence: each step's loss and grad norm tested on the device, and the rollback.

The rollback goes to the last good state (train.on_divergence, train.spike_factor,
train.max_rollbacks; docs/checkpoints.md).

A step diverges when its loss (the mean over ranks) or its grad norm is not finite, or, with
train.spike_factor > 0, when its loss is above spike_factor x the median of the last WINDOW good
steps' losses. The test runs on the device every step, on figures every rank holds alike (one small
all-reduce of [loss, grad norm] per step on several ranks), so every rank reaches the same verdict.

- rollback: the verdict is read on the host before the optimizer step (one sync of three numbers per
  step: the device cannot run ahead into the next step), so a bad step never reaches the weights or
  the optimizer state; the loop then restores the Snapshot, skips the data of the steps since, and
  goes on.
- stop: the first bad step is kept on the device and read at the next logging, evaluation or save
  step (no sync per step); the run then stops with one line naming it, before any save.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any, Dict, List, Optional

import torch

from gptlab import is_dtensor
from gptlab.distributed import world as distributed
from gptlab.errors import GptlabError

WINDOW = 50  # the recent good steps' losses whose median a spike is measured against
MIN_HISTORY = 10  # a spike needs this many before it: the first steps' losses fall fast
CAUSES = {1: "non-finite", 2: "spike"}
ADVICE = "lower optimizer.lr or use a more stable precision"


class Watch:
    """The per-step divergence test, the rollbacks so far, and what a checkpoint keeps of both."""

    def __init__(self, train: Any, device: torch.device, norm_counts: bool, saved: Dict[str, Any]):
        self.rollback = train.on_divergence == "rollback"
        self.factor = float(train.spike_factor)
        self.max_rollbacks = int(train.max_rollbacks)
        # under fp16 an infinite gradient is the GradScaler's business (it skips the step)
        self.norm_counts = norm_counts
        self.device = device
        self.rollbacks: List[Dict[str, Any]] = [dict(r) for r in saved.get("rollbacks", [])]
        self.recent = torch.full((WINDOW,), math.nan, device=device)
        self.load_recent(list(saved.get("recent_losses", [])))
        # stop mode: [step, cause, loss, grad norm] of the first bad step (step 0: none yet)
        self.first = torch.zeros(4, dtype=torch.float64, device=device)
        self.pending: Optional[Dict[str, Any]] = None  # rollback mode: the bad step just found
        self.snapshot: Optional[Snapshot] = None

    def load_recent(self, losses: List[float]) -> None:
        self.recent.fill_(math.nan)
        kept = losses[-WINDOW:]
        if kept:
            self.recent[WINDOW - len(kept) :] = torch.tensor(kept, device=self.device)

    def state(self) -> Dict[str, Any]:
        """What a checkpoint keeps (Progress.state_dict's divergence).

        A resumed run tests and skips as the uninterrupted one would.
        """
        recent = [x for x in self.recent.tolist() if not math.isnan(x)]
        return {"rollbacks": [dict(r) for r in self.rollbacks], "recent_losses": recent}

    def rolled_back_steps(self) -> List[int]:
        return [int(r["step"]) for r in self.rollbacks]

    def _verdict(self, loss: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
        """[code, loss, norm] on the device: code 0 good, 1 non-finite, 2 spike."""
        figures = distributed.all_reduce_mean(torch.stack([loss.float(), norm.float()]))
        loss, norm = figures[0], figures[1]
        finite = torch.isfinite(loss)
        if self.norm_counts:
            finite = finite & torch.isfinite(norm)
        code = (~finite).to(torch.float32)
        if self.factor > 0:
            enough = (~self.recent.isnan()).sum() >= MIN_HISTORY
            spike = finite & enough & (loss > self.factor * torch.nanmedian(self.recent))
            code = torch.where(spike, torch.full_like(code, 2.0), code)
        # only good steps' losses enter the window (a bad one is rolled back or ends the run)
        pushed = torch.cat([self.recent[1:], loss.view(1)])
        self.recent = torch.where(code == 0, pushed, self.recent)
        return torch.stack([code, loss, norm])

    def step_ok(self, step: int, loss: torch.Tensor, norm: torch.Tensor) -> bool:
        """Whether the optimizer may take this step.

        Rollback mode reads the verdict now; stop mode keeps the first bad step on the device and
        always says yes.
        """
        verdict = self._verdict(loss, norm)
        if not self.rollback:
            row = torch.cat([torch.full((1,), float(step), device=self.device), verdict.double()])
            first_bad = (self.first[0] == 0) & (verdict[0] != 0)
            self.first = torch.where(first_bad, row, self.first)
            return True
        code, loss_v, norm_v = verdict.tolist()  # the one host sync of a step
        if code == 0:
            return True
        self.pending = {"step": step, "cause": CAUSES[int(code)], "loss": loss_v, "norm": norm_v}
        return False

    def raise_if_diverged(self) -> None:
        """Stop mode, at a step that syncs anyway: the first bad step, as one line."""
        if self.rollback:
            return
        step, code, loss, norm = self.first.tolist()
        if step:
            raise GptlabError(describe(int(step), CAUSES[int(code)], loss, norm, self.factor))

    def check_limit(self) -> None:
        """One more rollback than train.max_rollbacks allows stops the run."""
        bad = self.pending or {}
        if len(self.rollbacks) < self.max_rollbacks:
            return
        what = describe(bad["step"], bad["cause"], bad["loss"], bad["norm"], self.factor)
        raise GptlabError(
            f"{what.split('; ')[0]} after {len(self.rollbacks)} rollback(s) "
            f"(train.max_rollbacks={self.max_rollbacks}); {ADVICE}, or raise train.max_rollbacks"
        )


def describe(step: int, cause: str, loss: float, norm: float, factor: float) -> str:
    """The bad step in words: what was out of bounds, and the advice."""
    if cause == "spike":
        what = f"train loss {loss:.4g} at step {step} is above {factor:g}x its recent median"
    elif not math.isfinite(loss):
        what = f"train loss is {loss} at step {step}"
    else:
        what = f"grad norm is {norm} at step {step}"
    return f"{what}: training diverged; {ADVICE}"


def _local(t: torch.Tensor) -> torch.Tensor:
    """A sharded (DTensor) entry's own shard; a plain tensor itself."""
    return t.to_local() if is_dtensor(t) else t


def _host(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return _local(value).detach().to("cpu", copy=True)
    return copy.deepcopy(value)


class Snapshot:
    """The last good state in host memory, restored in place.

    The model's and optimizer's tensors (each rank its own shards), the scaler, the loader's
    position and the loop's progress. Restored in place, so the live objects (and a sharded model's
    layout) stay as they are.

    Taken at the start and after every checkpoint save (train.checkpoint_every sets how far back a
    rollback goes); it costs one host copy of the model and optimizer state per rank, made when a
    checkpoint is made.
    """

    def __init__(self, run: Any, progress: Any, watch: Watch):
        self.model = {k: _host(v) for k, v in run.raw_model.state_dict().items()}
        opt = run.optimizer
        self.optimizer = [
            {k: _host(v) for k, v in opt.state[p].items()} if p in opt.state else None
            for p in _params(opt)
        ]
        self.scaler = copy.deepcopy(run.scaler.state_dict())
        self.loader = copy.deepcopy(run.train_loader.state_dict())
        self.progress = {
            f.name: _host(getattr(progress, f.name))
            for f in dataclasses.fields(progress)
            if f.name not in ("watch", "stopped_by")
        }
        self.recent = [x for x in watch.recent.tolist() if not math.isnan(x)]

    def restore(self, run: Any, progress: Any, watch: Watch) -> None:
        """Put the snapshot back into the live objects and the progress."""
        with torch.no_grad():
            for k, live in run.raw_model.state_dict().items():
                _local(live).copy_(self.model[k])
            opt = run.optimizer
            for p, saved in zip(_params(opt), self.optimizer):
                _restore_param_state(opt, p, saved)
        run.scaler.load_state_dict(copy.deepcopy(self.scaler))
        run.train_loader.load_state_dict(copy.deepcopy(self.loader))
        for name, value in self.progress.items():
            if isinstance(value, torch.Tensor):
                getattr(progress, name).copy_(value)
            else:
                setattr(progress, name, copy.deepcopy(value))
        watch.load_recent(self.recent)


def _params(opt: torch.optim.Optimizer) -> List[torch.Tensor]:
    return [p for group in opt.param_groups for p in group["params"]]


def _restore_param_state(opt: Any, p: torch.Tensor, saved: Optional[Dict[str, Any]]) -> None:
    """One parameter's optimizer state back as it was.

    In place where the entry still exists (a sharded entry keeps its layout), gone where it did not
    exist yet (AdamW's lazy first step).
    """
    if saved is None:
        opt.state.pop(p, None)
        return
    live = opt.state[p]
    for k in [k for k in live if k not in saved]:
        del live[k]
    for k, value in saved.items():
        current = live.get(k)
        if isinstance(value, torch.Tensor) and isinstance(current, torch.Tensor):
            _local(current).copy_(value)
        elif isinstance(value, torch.Tensor):
            live[k] = value.to(_local(p).device, copy=True)
        else:
            live[k] = copy.deepcopy(value)
