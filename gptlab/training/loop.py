"""train(run): the one training loop. It sees built objects (``run.Run``), never the config tree.

Per step: set lr -> accumulate gradients over micro-batches -> clip -> optimizer step -> log ->
maybe evaluate -> maybe checkpoint. Host-device synchronisation happens only at logging, eval and
checkpoint steps, so the accelerator can run ahead of Python everywhere else; the one exception is
train.on_divergence=rollback, which reads each step's divergence test before the optimizer step
(training/divergence.py), and a refused step is rolled back instead (roll_back).
"""

from __future__ import annotations

import math
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, Optional, Tuple

import torch

from gptlab.checkpoint import background
from gptlab.checkpoint import state as checkpoint
from gptlab.distributed import world as distributed
from gptlab.errors import GptlabError
from gptlab.evaluation import hellaswag
from gptlab.perf.measure import mfu
from gptlab.records.layout import PRUNED
from gptlab.training import divergence, faults

if TYPE_CHECKING:  # only for type hints: loop.py does not build anything itself
    from gptlab.training.run import Run


class StopOnSignal:
    """SIGTERM / SIGUSR2 and SIGINT (Ctrl-C) ask the loop to stop.

    SIGTERM / SIGUSR2 come from preemption, scancel, or SLURM's time-limit warning.

    The handler only sets a flag; the loop checks it at the next step boundary, where every rank
    agrees to stop, rank 0 saves a checkpoint, and the run ends cleanly. A second SIGINT or SIGTERM
    (distributed.stop_again) raises KeyboardInterrupt at once, wherever the loop is. SIGINT is left
    alone where it is ignored (a shell's background job: Ctrl-C is not for it). The previous
    handlers come back afterwards (submitit's SIGUSR2 handler then requeues the job).
    """

    SIGNALS = ("SIGTERM", "SIGUSR2", "SIGINT")

    def __init__(self):
        self.received: Optional[str] = None
        self._at = 0.0
        self._previous: Dict[int, Any] = {}
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be installed from the main thread
        for name in self.SIGNALS:
            sig = getattr(signal, name)
            if name == "SIGINT" and signal.getsignal(sig) is signal.SIG_IGN:
                continue
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.received is None:
            self.received, self._at = name, time.monotonic()
        elif distributed.stop_again(self.received, time.monotonic() - self._at, name):
            raise KeyboardInterrupt(f"{name} again")

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}


LN2 = math.log(2)


@torch.no_grad()
def evaluate(run: "Run") -> Dict[str, float]:
    """Validation loss and bits per byte of the evaluated weights, summed over all ranks.

    Over the fixed validation batches; the evaluated weights are the weight average with
    optimizer.ema_decay > 0.

    val_loss is the mean cross-entropy per token (nats); val_bpb is the summed cross-entropy in
    bits over the UTF-8 bytes of the targets (run.token_bytes: special tokens count no bytes and
    are left out of both sums), so runs with different tokenizers compare. A mixture measures each
    source on its own (val/<source>/loss, val/<source>/bpb); its val_loss and val_bpb are their
    means weighted as the sources are drawn.
    """
    model = run.model
    model.eval()
    with run.evaluated_weights():
        if not getattr(run, "val_sets", None):  # a Run always has it; a stand-in may not
            out = _val_figures(run, run.val_batches)
        else:
            out = _mixture_figures(run)
    model.train()
    return out


def _mixture_figures(run: "Run") -> Dict[str, float]:
    out: Dict[str, float] = {"val_loss": 0.0, "val_bpb": 0.0}
    for name, (weight, batches) in run.val_sets.items():
        f = _val_figures(run, batches)
        out[f"val/{name}/loss"], out[f"val/{name}/bpb"] = f["val_loss"], f["val_bpb"]
        out["val_loss"] += weight * f["val_loss"]
        out["val_bpb"] += weight * f["val_bpb"]
    return out


def _val_figures(run: "Run", batches: Any) -> Dict[str, float]:
    """val_loss and val_bpb over these batches.

    A sharded model's every forward is a collective, so each rank runs as many forwards as the rank
    with the most batches (ceil(eval_steps / world)), padding with uncounted ones.
    """
    model, dev = run.model, run.dist.device
    # nats of every target, their count, nats of the targets that have bytes, those bytes
    sums = torch.zeros(4, dtype=torch.float64, device=dev)
    rounds = len(batches)
    if distributed.is_sharded(run.raw_model):
        rounds = -(-run.train.eval_steps // run.dist.world_size)
    for i in range(rounds):
        if i < len(batches):
            x, y = batches[i]
        else:  # padding: the collectives need this rank, the sums do not
            x = y = torch.zeros((1, run.block_size), dtype=torch.long, device=dev)
        x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
        with run.autocast():
            _, nats = model(x, y, per_token=True)
        if i < len(batches):
            nbytes = run.token_bytes[y]
            counted = nats.masked_fill(nbytes == 0, 0.0)
            sums[0] += nats.sum()
            sums[1] += y.numel()  # a Python number: no tensor on another device
            sums[2] += counted.sum()
            sums[3] += nbytes.sum()
    if run.dist.world_size > 1:
        torch.distributed.all_reduce(sums)
    total, count, counted, nbytes = sums.tolist()
    return {"val_loss": total / count, "val_bpb": counted / nbytes / LN2 if nbytes else math.nan}


def hellaswag_due(run: "Run", step: int) -> bool:
    """Whether HellaSwag is scored at step: every eval.hellaswag.every steps and at the last."""
    every = run.hellaswag_config.every if run.hellaswag else 0
    return bool(every) and (step % every == 0 or step == run.train.max_steps)


@torch.no_grad()
def score_hellaswag(run: "Run") -> Dict[str, float]:
    """hellaswag_acc and hellaswag_acc_norm of the evaluated weights, over all ranks."""
    model, d = run.model, run.dist
    model.eval()
    with run.evaluated_weights():
        figures = hellaswag.score(
            model,
            run.hellaswag,
            run.block_size,
            d.device,
            d.rank,
            d.world_size,
            run.hellaswag_config.batch_size,
            run.autocast,
            distributed.is_sharded(run.raw_model),
        )
    model.train()
    return figures


def seed_step(seed: int, step: int, rank: int) -> None:
    """Dropout (and any other sampling) draws from a stream fixed by (seed, step, rank).

    So a resumed run, even on another number of ranks, draws exactly what it would have drawn.
    """
    torch.manual_seed((seed * 1_000_003 + step) * 4099 + rank)


def checkpoint_saver(run: "Run") -> background.Saver:
    """The run's checkpoint saver, made at its first use (a stand-in Run in a test has none)."""
    if getattr(run, "saver", None) is None:
        run.saver = background.Saver()
    return run.saver


def save_checkpoint(run: "Run", p: "Progress", val: Optional[float]) -> None:
    """Save a checkpoint: every rank captures its state, then rank 0 or every rank writes it.

    Rank 0 writes a whole checkpoint, or every rank its shards of a sharded one
    (train.checkpoint_async: in the background, after the previous save is written). Every rank then
    waits, so nobody races ahead of a slow save. The seconds this held the loop are the save's
    stall: checkpoint/stall_s, and results.json's mean checkpoint_stall_s.
    """
    start = time.perf_counter()
    state = checkpoint.TrainingState.capture(
        run.stateful(),
        **p.state_dict(),  # a collective: every rank's train-loss sum averaged over ranks
        config=run.resolved_config,
        model_config=run.model_config,
        tokenizer=run.tokenizer.to_meta(),
        mlflow_run_id=run.tracker.run_id,
    )
    saver = checkpoint_saver(run)
    t = run.train
    saver.save(
        run.checkpoint_dir, state, val, t.keep_checkpoints, run.dist.is_main, t.checkpoint_async
    )
    if p.stopped_by is not None:
        saver.wait()  # the run stops here and names this checkpoint as the next start's
    if run.dist.world_size > 1:
        torch.distributed.barrier()
    saver.stalls.append(time.perf_counter() - start)
    if p.step > run.logged_until_step:
        run.tracker.log_side_metrics(p.step, {"checkpoint/stall_s": saver.stalls[-1]})


def optimizer_step(
    run: "Run",
    lr: float,
    loss_sum: torch.Tensor,
    step: int,
    watch: Optional[divergence.Watch] = None,
) -> torch.Tensor:
    """Step `step` (1-based) over this rank's micro-batches; returns the grad norm.

    Adds the loss to loss_sum. A watch tests the step before the optimizer takes it: a step it
    refuses leaves the weights and the optimizer state as they were (watch.pending says why).
    """
    model, opt, scaler, dev = run.model, run.optimizer, run.scaler, run.dist.device
    for group in opt.param_groups:
        group["lr"] = lr * group.get("lr_mult", 1.0)  # muP's per-layer lrs (optim.decay_groups)
    micro = run.train_loader.next_step()
    accum = len(micro)
    fired = watch.rolled_back_steps() if watch is not None else ()
    step_loss = torch.zeros((), device=dev)
    for i, (x, y) in enumerate(micro):
        x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
        # DDP / FSDP reduce gradients only on the last micro-step; earlier ones just accumulate.
        with distributed.no_sync(model, i == accum - 1), run.autocast():
            _, loss = model(x, y)
            # Divide by the micro-steps so the summed gradients equal those of one big batch.
            loss = faults.poison(loss / accum, step, run.train.faults, fired)
        scaler.scale(loss).backward()
        loss_sum += loss.detach()
        step_loss += loss.detach()
    grad_norm = torch.zeros((), device=dev)
    if run.grad_clip > 0:
        scaler.unscale_(opt)  # clip the true gradients, not the fp16-scaled ones
        norm = torch.nn.utils.clip_grad_norm_(run.raw_model.parameters(), run.grad_clip)
        grad_norm = distributed.grad_norm_value(norm)  # sharded: the global norm, replicated
    if watch is not None and not watch.step_ok(step, step_loss, grad_norm):
        if run.grad_clip > 0:
            scaler.update()  # closes this step's unscale_ (the rollback restores the scaler)
        opt.zero_grad(set_to_none=True)
        return grad_norm
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)
    return grad_norm


@dataclass
class Progress:
    """Where the loop stands: what it has trained, the latest losses, and why it stopped.

    state_dict() / load_state_dict() are what a checkpoint keeps of it, under the checkpoint's
    names: a value a resumed run needs is added there, and nowhere else.
    """

    step: int
    tokens: int
    best_val: float
    loss_sum: torch.Tensor  # this rank's summed micro-step losses since the last logging step
    loss_count: int = 0
    train_loss: float = float("nan")
    last_val: Optional[float] = None
    stopped_by: Optional[str] = None
    best_bpb: float = math.inf
    last_bpb: Optional[float] = None
    hellaswag: Dict[str, float] = field(default_factory=dict)  # the latest scoring's figures
    sources: Dict[str, float] = field(default_factory=dict)  # a mixture's latest per-source figures
    watch: Optional[divergence.Watch] = None  # the divergence test, its rollbacks and snapshot
    # the checkpoint's rollbacks and recent losses, which the watch starts from (Watch.state())
    resumed_divergence: Dict[str, Any] = field(default_factory=dict)

    @classmethod
    def start(cls, device: torch.device) -> "Progress":
        """Step 0 of a new run, its train-loss sum on the device."""
        return cls(0, 0, math.inf, torch.zeros((), device=device))

    def state_dict(self) -> Dict[str, Any]:
        """What a checkpoint keeps of the loop (its TrainingState entries).

        Every rank calls it: the train-loss sum in progress is averaged over the ranks (a
        collective).
        """
        window = distributed.all_reduce_mean(self.loss_sum.detach().clone()).item()
        return {
            "step": self.step,
            "tokens": self.tokens,
            "best_val_loss": self.best_val,
            # the train-loss average in progress, so a resumed run logs the same averages
            "loss_window": (window, self.loss_count),
            # the last logged and evaluated losses: results of a resumption with no step left
            "train_loss": self.train_loss,
            "val_loss": self.last_val,
            "best_val_bpb": self.best_bpb,
            "val_bpb": self.last_bpb,
            "hellaswag": dict(self.hellaswag),
            "divergence": self.watch.state() if self.watch is not None else {},
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Continue from a checkpoint's state_dict() (empty: a new run).

        What an older checkpoint lacks keeps its value at the start; the train-loss sum stays on its
        device.
        """
        if not state:
            return
        self.step, self.tokens, self.best_val = (
            state["step"],
            state["tokens"],
            state["best_val_loss"],
        )
        window_sum, window_count = state.get("loss_window", (0.0, 0))
        self.loss_sum.fill_(float(window_sum))
        self.loss_count = int(window_count)
        train_loss = state.get("train_loss")
        self.train_loss = math.nan if train_loss is None else train_loss
        self.last_val = state.get("val_loss")
        self.best_bpb, self.last_bpb = state.get("best_val_bpb", math.inf), state.get("val_bpb")
        self.hellaswag = dict(state.get("hellaswag") or {})
        self.resumed_divergence = dict(state.get("divergence") or {})


def due(t: Any, p: Progress) -> Tuple[bool, bool, bool]:
    """(log, evaluate, save) at step p.step: their cadences, the first and last steps, and a stop.

    A stop saves but does not log: its partial train-loss average goes into the checkpoint, and the
    resumed run logs the same averages at the same steps as a run that was never stopped.
    """
    last = p.step == t.max_steps
    stopping = p.stopped_by is not None
    log = p.step % t.log_every == 0 or last or p.step == 1
    evaluate_now = bool(t.eval_every and p.step % t.eval_every == 0) or last
    every = bool(t.checkpoint_every and p.step % t.checkpoint_every == 0)
    return log, evaluate_now, t.save_checkpoints and (every or last or stopping)


def start_progress(run: "Run") -> Progress:
    """Where the loop starts: step 0, or where the resumed checkpoint's progress stood."""
    p = Progress.start(run.dist.device)
    p.load_state_dict(run.resumed)
    return p


def record_step(run: "Run", p: Progress, lr: float, grad_norm: Any, due_now: Tuple) -> None:
    """A step that logs, evaluates or saves: its figures, the evaluation, the records, the save."""
    do_log, do_eval, do_save = due_now
    dev, report = run.dist.device, run.reporter
    # The one host sync of a logging step: close the timing window before eval / save run.
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    _, tok_s = report.close_window(p.step)
    figures = {
        "lr": lr,
        "tokens_per_s": tok_s,
        "mfu": mfu(tok_s, run.flops_per_token, run.peak_flops),
    }
    metrics: Dict[str, Any] = {"tokens": p.tokens}
    if do_log:
        loss = mean_train_loss(p)
        metrics.update({"train_loss": loss, "lr": lr, "grad_norm": float(grad_norm), **figures})
    if do_eval:
        metrics.update(evaluate(run))
        p.last_val, p.last_bpb = metrics["val_loss"], metrics["val_bpb"]
        p.best_val = min(p.best_val, p.last_val)
        p.best_bpb = min(p.best_bpb, p.last_bpb)
        p.sources = {k: v for k, v in metrics.items() if k.startswith("val/")}
    if do_log and hasattr(run.train_loader, "epochs"):  # a mixture: each source's epochs so far
        metrics.update({f"data/{n}/epochs": e for n, e in run.train_loader.epochs().items()})
    do_hellaswag = hellaswag_due(run, p.step) and p.stopped_by is None
    if do_hellaswag:
        p.hellaswag = score_hellaswag(run)
        metrics.update(p.hellaswag)
    if (do_log or do_eval or do_hellaswag) and p.step > run.logged_until_step:
        run.tracker.log_metrics(p.step, metrics)
        report.progress(p.step, {**figures, "train_loss": p.train_loss, **metrics}, p.best_val)
    pruned = pruned_now(run, p, do_eval or do_hellaswag, metrics)
    if pruned:
        p.stopped_by = PRUNED
    if do_save or (pruned and run.train.save_checkpoints):
        save_checkpoint(run, p, p.last_val if do_eval else None)
        keep_good_state(run, p)
    if pruned:
        report.say(
            f"trial {run.trial.number} pruned at step {p.step}: its evaluations are worse than "
            f"the finished trials' median at this step; checkpoint saved"
        )
    elif p.stopped_by is not None:
        report.stopped(p.stopped_by, p.step, run.checkpoint_dir, run.train.resume)
    report.open_window()  # evaluation, checkpointing and logging are not training throughput


def pruned_now(run: "Run", p: Progress, evaluated: bool, metrics: Dict[str, Any]) -> bool:
    """Whether the pruner stops a search trial here, just evaluated before its last step.

    Every rank gets rank 0's answer.
    """
    if run.trial is None or not evaluated or p.stopped_by is not None:
        return False
    if p.step >= run.train.max_steps:
        return False  # finished anyway: its objective counts in full
    return run.trial.should_prune(p.step, metrics)


def train(run: "Run") -> Dict[str, Any]:
    """Run the training loop from run.start_step to train.max_steps; return the results dict.

    Stops early, with a checkpoint, when SIGTERM or SIGUSR2 arrives (results["stopped_by"]).
    """
    t, report = run.train, run.reporter
    tokens_per_step = t.batch_size * run.block_size
    p = start_progress(run)
    watch_divergence(run, p)
    wall0 = time.perf_counter()
    run.model.train()
    report.begin(p.step, run.summary)
    stop = StopOnSignal()
    prof = run.profiler
    try:
        while p.step < t.max_steps and p.stopped_by is None:
            seed_step(t.seed, p.step, run.dist.rank)
            lr = run.lr_at(p.step)
            if prof is not None:
                prof.begin(p.step + 1)
            grad_norm = profiled_step(run, lr, p, prof)
            if p.watch.pending is not None:  # refused: back to the last good state
                if prof is not None:
                    prof.end(p.step + 1)
                roll_back(run, p)
                continue
            p.step, p.tokens, p.loss_count = (
                p.step + 1,
                p.tokens + tokens_per_step,
                p.loss_count + 1,
            )
            faults.maybe_crash(p.step, run.dist.rank, run.run_dir, run.train.faults)
            if prof is not None:
                prof.end(p.step)
            report.trained(tokens_per_step)
            # every rank stops at the same step, or the others would wait in a collective
            p.stopped_by = distributed.agree_on_signal(stop.received)
            due_now = due(t, p)
            if any(due_now) or hellaswag_due(run, p.step):
                p.watch.raise_if_diverged()  # on_divergence=stop: before any record or save
                record_step(run, p, lr, grad_norm, due_now)
            else:
                report.tick(p.step)
    finally:
        if prof is not None:
            prof.close()
        stop.restore()
        report.close()
        checkpoint_saver(run).close()  # a save in flight is written (or its failure raised) first
    return results(run, p, time.perf_counter() - wall0)


def watch_divergence(run: "Run", p: Progress) -> None:
    """The divergence test of every step (training/divergence.py).

    With on_divergence=rollback, also the first good state to go back to: the start.
    """
    norm_counts = run.grad_clip > 0 and not run.scaler.is_enabled()
    p.watch = divergence.Watch(run.train, run.dist.device, norm_counts, p.resumed_divergence)
    if p.watch.rollback:
        p.watch.snapshot = divergence.Snapshot(run, p, p.watch)


def keep_good_state(run: "Run", p: Progress) -> None:
    """After a save, the saved state is the one a rollback goes back to (none needed at the end)."""
    watch, going_on = p.watch, p.stopped_by is None and p.step < run.train.max_steps
    if watch is not None and watch.rollback and going_on:
        watch.snapshot = divergence.Snapshot(run, p, watch)


def roll_back(run: "Run", p: Progress) -> None:
    """Roll back the step the watch refused: the last good state back, the data since skipped.

    The loader stays past the bad step's batches; the rollback is recorded and said.
    """
    watch = p.watch
    bad = watch.pending
    watch.check_limit()
    position = run.train_loader.state_dict()
    watch.snapshot.restore(run, p, watch)
    run.train_loader.load_state_dict(position)
    step, back_to = bad["step"], p.step
    watch.rollbacks.append(
        {"step": step, "cause": bad["cause"], "back_to": back_to, "skipped_steps": step - back_to}
    )
    watch.pending = None
    if step > run.logged_until_step:
        run.tracker.log_metrics(step, {"rollbacks": len(watch.rollbacks)})
    what = divergence.describe(step, bad["cause"], bad["loss"], bad["norm"], watch.factor)
    run.reporter.say(
        f"{what.split(':')[0]} ({bad['cause']}): rolled back to step {back_to}, skipping the "
        f"batches of steps {back_to + 1}-{step} (rollback {len(watch.rollbacks)} of at most "
        f"{watch.max_rollbacks})"
    )


def profiled_step(run: "Run", lr: float, p: Progress, prof: Any) -> torch.Tensor:
    """optimizer_step, leaving the allocator's history when a CUDA step first runs out of memory.

    A CUDA step that runs out of memory first leaves the allocator's history
    (train.profile.oom_snapshot) and says where.
    """
    if prof is None:
        return optimizer_step(run, lr, p.loss_sum, p.step + 1, p.watch)
    try:
        return optimizer_step(run, lr, p.loss_sum, p.step + 1, p.watch)
    except torch.cuda.OutOfMemoryError:
        path = prof.out_of_memory()
        if path is not None:
            run.reporter.say(f"step {p.step + 1} ran out of memory: what it held is in {path}")
        raise


def mean_train_loss(p: Progress) -> float:
    """The mean loss over every rank's micro-steps since the last logging step (then reset)."""
    p.train_loss = distributed.all_reduce_mean(p.loss_sum / p.loss_count).item()
    if not math.isfinite(p.train_loss):
        raise GptlabError(
            f"train loss is {p.train_loss} at step {p.step}: training diverged; "
            f"lower optimizer.lr or use a more stable precision"
        )
    p.loss_sum.zero_()
    p.loss_count = 0
    return p.train_loss


def results(run: "Run", p: Progress, wall_s: float) -> Dict[str, Any]:
    """The run's final figures (results.json).

    Throughput counts this session's training time only.
    """
    session_tokens, train_time = p.tokens - run.start_tokens, run.reporter.train_time
    tok_s = session_tokens / train_time if train_time > 0 else None
    return {
        "params": run.num_params,
        # N without the embeddings, and C: the model FLOPs of every token trained (scaling laws)
        "params_non_embedding": getattr(run, "derived", {}).get("params_non_embedding"),
        "flops": run.flops_per_token * p.tokens,
        "steps": p.step,
        "tokens": p.tokens,
        # 0: resumed at the final step (the losses are the checkpoint's)
        "tokens_this_session": session_tokens,
        "train_loss": p.train_loss,
        "val_loss": p.last_val,
        "best_val_loss": p.best_val if math.isfinite(p.best_val) else None,
        "val_bpb": p.last_bpb,
        "best_val_bpb": p.best_bpb if math.isfinite(p.best_bpb) else None,
        "tokens_per_s": tok_s,
        "mfu": mfu(tok_s, run.flops_per_token, run.peak_flops) if tok_s is not None else None,
        "wall_s": wall_s,
        "mlflow_run_id": run.tracker.run_id,
        "stopped_by": p.stopped_by,
        # each divergence rolled back: {step, cause, back_to, skipped_steps}
        "rollbacks": [dict(r) for r in p.watch.rollbacks] if p.watch is not None else [],
        "checkpoint_stall_s": checkpoint_saver(run).mean_stall(),  # mean s a save held the loop
        **p.hellaswag,  # the last scoring's (none when it is off)
        **p.sources,  # a mixture's last per-source evaluation
    }
