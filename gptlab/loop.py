"""train(run): the one training loop. It sees built objects (``build.Run``), never the config tree.

Per step: set lr -> accumulate gradients over micro-batches -> clip -> optimizer step -> log ->
maybe evaluate -> maybe checkpoint. Host-device synchronisation happens only at logging, eval and
checkpoint steps, so the accelerator can run ahead of Python everywhere else.
"""

from __future__ import annotations

import math
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, Dict, Optional

import torch

from gptlab import checkpoint, distributed
from gptlab.errors import GptlabError
from gptlab.metrics import mfu

if TYPE_CHECKING:  # only for type hints: loop.py does not build anything itself
    from gptlab.build import Run


class StopOnSignal:
    """SIGTERM / SIGUSR2 (preemption, scancel, SLURM's time-limit warning) ask the loop to stop.

    The handler only sets a flag; the loop checks it at the next step boundary, where every rank
    agrees to stop, rank 0 saves a checkpoint, and the run ends cleanly. The previous handlers come
    back afterwards (submitit's SIGUSR2 handler then requeues the job).
    """

    SIGNALS = ("SIGTERM", "SIGUSR2")

    def __init__(self):
        self.received: Optional[str] = None
        self._previous: Dict[int, Any] = {}
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be installed from the main thread
        for name in self.SIGNALS:
            sig = getattr(signal, name)
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.received = signal.Signals(signum).name

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}


class Console:
    """Progress output on rank 0: a live bar on a terminal, plain lines in logs (SLURM, pipes)."""

    def __init__(self, enabled: bool, total: int, start: int):
        self.enabled = enabled
        self.bar = None
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True, file=sys.stderr)

    def step(self, step: int, line: Optional[str], postfix: Optional[Dict[str, str]] = None) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.n = step
            if postfix:
                self.bar.set_postfix(postfix, refresh=False)
            self.bar.refresh()
        elif line:
            print(line, flush=True)

    def write(self, line: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


@torch.no_grad()
def evaluate(run: "Run") -> float:
    """Mean validation loss over the fixed validation batches, averaged over all ranks."""
    model = run.model
    model.eval()
    total = torch.zeros((), device=run.dist.device)
    for x, y in run.val_batches:
        x, y = x.to(run.dist.device, non_blocking=True), y.to(run.dist.device, non_blocking=True)
        with run.autocast():
            _, loss = model(x, y)
        total += loss.float()
    model.train()
    count = torch.tensor(float(len(run.val_batches)), device=run.dist.device)
    # sum of losses and of batch counts over ranks, so uneven splits still give the exact mean
    stats = torch.stack([total, count])
    if run.dist.world_size > 1:
        torch.distributed.all_reduce(stats)
    return (stats[0] / stats[1]).item()


def seed_step(seed: int, step: int, rank: int) -> None:
    """Dropout (and any other sampling) draws from a stream fixed by (seed, step, rank).

    So a resumed run, even on another number of ranks, draws exactly what it would have drawn.
    """
    torch.manual_seed((seed * 1_000_003 + step) * 4099 + rank)


def save_checkpoint(run: "Run", step: int, tokens: int, best_val: float, val: Optional[float]) -> None:
    """Rank 0 writes the checkpoint; every rank waits so nobody races ahead of a slow save."""
    if run.dist.is_main:
        state = checkpoint.TrainingState.capture(
            run.stateful(),
            step=step,
            tokens=tokens,
            best_val_loss=best_val,
            config=run.resolved_config,
            model_config=run.model_config,
            tokenizer=run.tokenizer.to_meta(),
            mlflow_run_id=run.tracker.run_id,
        )
        checkpoint.save_state(run.checkpoint_dir, state, val, run.train.keep_checkpoints)
    if run.dist.world_size > 1:
        torch.distributed.barrier()


def optimizer_step(run: "Run", lr: float, loss_sum: torch.Tensor) -> torch.Tensor:
    """One optimizer step over this rank's micro-batches; adds the loss to loss_sum, returns the grad norm."""
    model, opt, scaler, dev = run.model, run.optimizer, run.scaler, run.dist.device
    for group in opt.param_groups:
        group["lr"] = lr
    micro = run.train_loader.next_step()
    accum = len(micro)
    for i, (x, y) in enumerate(micro):
        x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
        # DDP all-reduces gradients only on the last micro-step; earlier ones just accumulate.
        with distributed.no_sync(model, i == accum - 1), run.autocast():
            _, loss = model(x, y)
            # Divide by the micro-steps so the summed gradients equal those of one big batch.
            loss = loss / accum
        scaler.scale(loss).backward()
        loss_sum += loss.detach()
    grad_norm = torch.zeros((), device=dev)
    if run.grad_clip > 0:
        scaler.unscale_(opt)  # clip the true gradients, not the fp16-scaled ones
        grad_norm = torch.nn.utils.clip_grad_norm_(run.raw_model.parameters(), run.grad_clip)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)
    return grad_norm


def train(run: "Run") -> Dict[str, Any]:
    """Run the training loop from run.start_step to train.max_steps; return the results dict.

    Stops early, with a checkpoint, when SIGTERM or SIGUSR2 arrives (results["stopped_by"]).
    """
    t = run.train
    dev = run.dist.device
    tokens_per_step = t.batch_size * run.block_size
    step, tokens = run.start_step, run.start_tokens
    best_val, last_val, train_loss = run.start_best_val, None, float("nan")
    console = Console(run.dist.is_main, t.max_steps, step)
    console.write(run.summary)
    run.model.train()
    wall0 = time.perf_counter()
    train_time, window_t0, window_tokens = 0.0, time.perf_counter(), 0
    loss_sum = torch.zeros((), device=dev)
    loss_count = 0
    stop = StopOnSignal()
    stopped_by: Optional[str] = None
    try:
        while step < t.max_steps and stopped_by is None:
            seed_step(t.seed, step, run.dist.rank)
            lr = run.lr_at(step)
            grad_norm = optimizer_step(run, lr, loss_sum)
            step += 1
            loss_count += 1
            tokens += tokens_per_step
            window_tokens += tokens_per_step
            # every rank must agree to stop at the same step, or the others would wait in a collective
            stopped_by = distributed.agree_on_signal(stop.received, dev)
            last = step == t.max_steps
            do_log = step % t.log_every == 0 or last or step == run.start_step + 1 or stopped_by is not None
            do_eval = bool(t.eval_every and step % t.eval_every == 0) or last
            do_save = t.save_checkpoints and (
                bool(t.checkpoint_every and step % t.checkpoint_every == 0) or last or stopped_by is not None
            )
            if not (do_log or do_eval or do_save):
                console.step(step, None)
                continue
            # The one host sync of a logging step: close the timing window before eval / save run.
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            window_s = time.perf_counter() - window_t0
            train_time += window_s
            run.timings.append((step, window_s, window_tokens))  # per-window timings for gptlab.bench
            tok_s = window_tokens / window_s if window_s > 0 else 0.0
            step_mfu = mfu(tok_s, run.flops_per_token, run.peak_flops)
            metrics: Dict[str, Any] = {"tokens": tokens}
            if do_log:
                train_loss = distributed.all_reduce_mean(loss_sum / loss_count).item()
                if not math.isfinite(train_loss):
                    raise GptlabError(
                        f"train loss is {train_loss} at step {step}: training diverged; "
                        f"lower optimizer.lr or use a more stable precision"
                    )
                metrics.update(
                    {
                        "train_loss": train_loss,
                        "lr": lr,
                        "grad_norm": float(grad_norm),
                        "tokens_per_s": tok_s,
                        "mfu": step_mfu,
                    }
                )
                loss_sum.zero_()
                loss_count = 0
            if do_eval:
                last_val = evaluate(run)
                best_val = min(best_val, last_val)
                metrics["val_loss"] = last_val
            if (do_log or do_eval) and step > run.logged_until_step:
                run.tracker.log_metrics(step, metrics)
                eta = (t.max_steps - step) * train_time / max(1, step - run.start_step)
                line = (
                    f"step {step}/{t.max_steps} | loss {train_loss:.4f}"
                    + (f" | val {last_val:.4f}" if do_eval else "")
                    + f" | lr {lr:.2e} | {tok_s:,.0f} tok/s | mfu {100 * step_mfu:.1f}% | eta {eta:,.0f}s"
                )
                console.step(
                    step,
                    line,
                    {
                        "loss": f"{train_loss:.4f}",
                        "best_val": f"{best_val:.4f}",
                        "lr": f"{lr:.1e}",
                        "tok/s": f"{tok_s:,.0f}",
                        "mfu": f"{100 * step_mfu:.1f}%",
                        "eta": f"{eta:,.0f}s",
                    },
                )
            if do_save:
                save_checkpoint(run, step, tokens, best_val, last_val if do_eval else None)
            if stopped_by is not None:
                console.write(
                    f"{stopped_by} received: stopped at step {step} with a checkpoint in "
                    f"{run.checkpoint_dir}; run the same command again to continue"
                )
            # evaluation, checkpointing and logging are not training throughput
            window_t0, window_tokens = time.perf_counter(), 0
    finally:
        stop.restore()
        console.close()
    session_tokens = tokens - run.start_tokens
    return {
        "params": run.num_params,
        "steps": step,
        "tokens": tokens,
        "train_loss": train_loss,
        "val_loss": last_val,
        "best_val_loss": best_val if math.isfinite(best_val) else None,
        "tokens_per_s": session_tokens / train_time if train_time > 0 else None,
        "mfu": mfu(session_tokens / train_time, run.flops_per_token, run.peak_flops) if train_time > 0 else None,
        "wall_s": time.perf_counter() - wall0,
        "mlflow_run_id": run.tracker.run_id,
        "stopped_by": stopped_by,
    }
