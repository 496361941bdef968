"""Who am I, and how the model is wrapped.

``setup`` decides what this process is (a plain process, a torchrun-style worker with RANK /
WORLD_SIZE in its environment, or a SLURM task, whose variables gptlab.distributed.slurm exports),
picks the device and backend, and starts the process group with a timeout so that a dead rank ends
the job instead of hanging it. ``spawn`` starts gptlab's own local workers and forwards stop signals
to them; the process-group helpers (broadcast, mean, the agreed stop signal) and ``teardown`` serve
the ranks once started. ``wrap_model`` applies activation checkpointing, then torch.compile, then
DDP or FSDP (DDP must see the compiled module so its gradient hooks fire on the compiled graph's
parameters). Process-wide tuning (malloc, the SDPA kernel) is gptlab.perf.runtime's."""

from __future__ import annotations

import datetime
import logging
import os
import select
import signal
import sys
import threading
import time
import traceback
from contextlib import nullcontext, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from gptlab import is_dtensor
from gptlab.config import SHARDED
from gptlab.distributed import restarts, slurm
from gptlab.errors import GptlabError
from gptlab.perf import fastpath, runtime

if TYPE_CHECKING:  # hints only: the config classes are data this module reads
    from gptlab.config import HardwareConfig, ParallelismConfig


log = logging.getLogger(__name__)
_CONTROL_GROUP = None  # a gloo group for CPU-side control messages when the main backend is NCCL


@dataclass
class Dist:
    """This process's place in the job."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def role(hw: HardwareConfig) -> str:
    """plain | torchrun | slurm | parent (gptlab must start hw.nproc_per_node workers itself).

    A plain process or a parent checks here that the GPUs it needs are visible, before anything is
    built or any worker started: the error is then the one line on the console.
    """
    expected = hw.nproc_per_node * hw.nodes
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return "torchrun"  # also our own spawned workers, which get the same variables
    if slurm.slurm_task() and int(os.environ["SLURM_STEP_NUM_TASKS"]) > 1:
        return "slurm"
    if expected > 1:
        if hw.nodes > 1:
            raise GptlabError(
                f"hardware.nodes={hw.nodes}: a multi-node job must be started by SLURM "
                "(hydra/launcher=slurm_a100x8, or launch/sbatch_gptlab.sh) or torchrun on "
                "every node"
            )
        check_gpus(hw, hw.nproc_per_node)
        return "parent"
    check_gpus(hw, 1)
    return "plain"


def check_gpus(hw: HardwareConfig, needed: int) -> None:
    """Checks that at least `needed` GPUs are visible to this process, one per local rank.

    Applies for hardware.device=cuda.
    """
    if hw.device != "cuda":
        return
    if not torch.cuda.is_available():
        raise GptlabError(f"hardware={hw.name} needs CUDA, but no GPU is visible; use hardware=cpu")
    visible = torch.cuda.device_count()
    if visible < needed:
        raise GptlabError(
            f"hardware={hw.name} starts {needed} processes, one per GPU, but {visible} GPU(s) are "
            f"visible "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); "
            f"set hardware.nproc_per_node={visible} or make the GPUs visible"
        )


def setup(hw: HardwareConfig, par: ParallelismConfig) -> Dist:
    """Decide who this process is, pick its device, and join the process group if there is one."""
    if role(hw) == "slurm":
        slurm.export_env()
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    expected = hw.nproc_per_node * hw.nodes
    if world != expected:
        raise GptlabError(
            f"hardware={hw.name} asks for {expected} process(es) but this job has {world}: set "
            f"hardware.nproc_per_node / hardware.nodes to match the launcher (torchrun "
            f"--nproc_per_node, "
            f"SLURM tasks)"
        )
    if isinstance(hw.threads, int):  # auto starts from the default and is measured (fastpath)
        torch.set_num_threads(hw.threads)
    elif hw.device == "cpu" and world > 1:
        # processes on one host share its cores: avoid oversubscribing them
        per_node = max(1, world // hw.nodes)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // per_node))
    if hw.device == "cpu":
        runtime.keep_freed_memory()
    if hw.device == "cuda":
        check_gpus(hw, 1)
        n_visible = torch.cuda.device_count()
        device = torch.device("cuda", local_rank % n_visible)
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = hw.tf32
        torch.backends.cudnn.allow_tf32 = hw.tf32
    else:
        device = torch.device("cpu")
    global _CONTROL_GROUP
    # ddp under a launcher (torchrun, SLURM) joins a group even alone: a world of one runs the
    # same DDP wrapper and backend as the many-GPU job (gpu_check's DDP at world 1 over NCCL)
    launched_ddp = par.strategy == "ddp" and "MASTER_ADDR" in os.environ
    if (world > 1 or par.strategy in SHARDED or launched_ddp) and not dist.is_initialized():
        timeout = datetime.timedelta(seconds=par.timeout_s)
        dist.init_process_group(
            backend="nccl" if device.type == "cuda" else "gloo",
            timeout=timeout,
            device_id=device if device.type == "cuda" else None,
            **_rendezvous(rank, world, launched_ddp, timeout),
        )
        # small CPU-side agreements (stop signals) go over gloo so they never sync the GPU stream
        _CONTROL_GROUP = (
            dist.new_group(backend="gloo", timeout=timeout) if device.type == "cuda" else None
        )
    return Dist(rank=rank, local_rank=local_rank, world_size=world, device=device)


def _rendezvous(rank: int, world: int, launched: bool, timeout: datetime.timedelta) -> dict:
    """init_process_group's store, where env:// (MASTER_ADDR, MASTER_PORT) is not enough."""
    if world == 1 and not launched:
        # fsdp on one device still needs a process group for its mesh: a one-rank group in memory
        return {"store": dist.HashStore(), "rank": 0, "world_size": 1}
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if attempt == "0" or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    # torchrun's static rendezvous keeps one store across its restarts, where the dead workers'
    # addresses still are: a rank could connect to one of them (refused) before its peer's new one
    # replaces it. Each attempt's keys get a prefix of their own.
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=False,  # the agent hosts it
        timeout=timeout,
    )
    return {
        "store": dist.PrefixStore(f"gptlab/attempt_{attempt}", store),
        "rank": rank,
        "world_size": world,
    }


def broadcast_object(obj, src: int = 0):
    """Rank src's obj on every rank (identity without a process group)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# A spawned worker's exit codes besides its run's own (0, or 2 after a user error it printed):
# KeyboardInterrupt: the launcher's Ctrl-C reached it before training (the shell's code)
INTERRUPTED = 130
# it raised: its traceback is on the console (sysexits' EX_SOFTWARE, not any SystemExit's code)
CRASHED = 70


def _worker(local_rank: int, launch: tuple, fn, args) -> None:
    """One spawned rank. launch: (nprocs, rendezvous port, the launcher's pid[, environment])."""
    nprocs, port, launcher, *env = launch
    follow_launcher(launcher)
    if env:  # forked from the fork server: the launcher's environment now, not the server's
        os.environ.clear()
        os.environ.update(env[0])
    os.environ.update(
        RANK=str(local_rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(nprocs),
        LOCAL_WORLD_SIZE=str(nprocs),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    try:
        fn(*args)
        code = 0
    except SystemExit as e:  # a user error the worker has already printed (exit 2)
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except KeyboardInterrupt:  # the launcher says where the run stands
        code = INTERRUPTED
    except Exception:  # noqa: BLE001 - a bug: its traceback here; the launcher names the rank
        traceback.print_exc()
        code = CRASHED
    _exit_now(code)


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def follow_launcher(launcher: int) -> None:
    """Bind a spawned worker to the launcher (pid `launcher`) that started it.

    It ends when the launcher ends, however that ends (kill -9, the OOM killer, a closed terminal):
    the kernel sends it SIGKILL where the launcher is its parent (prctl's parent-death signal), and
    a thread waiting on the launcher's pidfd does it where the launcher's fork server is (which
    outlives the launcher while workers hold it open); failing both, a thread polls. SIGKILL, not a
    signal the loop stops on: an orphan must not save (its peers may be gone, and nobody waits for
    the run), and a kill cannot leave a half-written checkpoint (every save is written aside and
    renamed: checkpoint.save and save_sharded). A launcher that died before it was watched is no
    longer the parent nor the fork server's: then the worker ends here. The run folder's lock (an
    flock of rank 0's) goes with the process.

    It gets a session of its own, as torchrun's workers do, so that a terminal's Ctrl-C reaches the
    launcher alone, which forwards one stop to every worker (spawn); and SIGINT, ignored while the
    launcher started it, gets Python's handler back.
    """
    direct = os.getppid() == launcher
    if not (_killed_with_parent() if direct else _killed_with(launcher)):
        threading.Thread(
            target=_watch_launcher, args=(launcher,), name="gptlab-launcher-watch", daemon=True
        ).start()
    if launcher not in (os.getppid(), _parent_of(os.getppid())):
        os.kill(os.getpid(), signal.SIGKILL)
    with suppress(OSError):  # already a session leader: nothing to leave
        os.setsid()
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _killed_with(launcher: int) -> bool:
    """SIGKILL this process as soon as process `launcher` ends; False where there are no pidfds.

    A thread waits on the launcher's pidfd.
    """
    try:
        fd = os.pidfd_open(launcher)
    except ProcessLookupError:  # already gone
        os.kill(os.getpid(), signal.SIGKILL)
    except (AttributeError, OSError):
        return False

    def wait() -> None:
        select.select([fd], [], [])  # readable once the process has ended
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=wait, name="gptlab-launcher-pidfd", daemon=True).start()
    return True


def _parent_of(pid: int) -> Optional[int]:
    """The parent of process pid; None where /proc cannot say.

    A worker's parent is the launcher's fork server, whose parent is the launcher, and which ends as
    soon as the launcher does.
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rpartition(")")[2].split()[1])  # the fields after the command's name


def _killed_with_parent() -> bool:
    """Ask the kernel to SIGKILL this process when its parent ends; False where prctl is absent."""
    import ctypes

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return False
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    return prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0


def _watch_launcher(launcher: int, every_s: float = 0.5) -> None:
    while launcher in (os.getppid(), _parent_of(os.getppid())):
        time.sleep(every_s)
    os.kill(os.getpid(), signal.SIGKILL)


def _exit_now(code: int) -> None:
    """End a spawned worker whose run is over without the interpreter's shutdown.

    A gloo worker thread drops its last finished collective's tensors a moment after the collective
    completes, and a tensor made in Python needs the GIL to be freed. If that moment falls after the
    interpreter has begun to finalize, the thread is unwound inside a noexcept destructor and the
    process aborts (SIGABRT, "terminate called without an active exception") although the run is
    complete. Everything a rank writes is written and closed by now; the logs and standard streams
    are flushed here, then the process leaves with its own exit code and without running the
    interpreter's shutdown.
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


def spawn(
    fn, nprocs: int, args: tuple, max_restarts: int = 0, run_dir: Optional[Path] = None
) -> None:
    """Start nprocs local workers running fn(*args) as ranks 0..nprocs-1, and wait for all of them.

    The first stop signal this launcher gets (SIGTERM, SIGUSR2, and Ctrl-C's SIGINT unless it was
    started with SIGINT ignored, as a shell's background job is) goes on to every worker, which stop
    at the next step with a checkpoint; a second SIGINT or SIGTERM (stop_again) kills them and
    raises KeyboardInterrupt here. When one worker fails, the others are killed at once. A worker
    that died (a crash or a signal nobody asked for, not a user error) with restarts left
    (max_restarts, run_dir given) starts every worker again: the run resumes from its latest
    checkpoint in run_dir, and its next start records the restart (distributed/restarts.py).
    Otherwise the failure is raised: SystemExit(2) for a user error the worker printed itself,
    KeyboardInterrupt for a worker interrupted before training, else one GptlabError naming the rank
    (the used-up budget, once restarts were made).
    """
    stops = _Forward()
    handled = [signal.SIGTERM, signal.SIGUSR2]
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        handled.append(signal.SIGINT)
    previous = {s: signal.getsignal(s) for s in handled}
    failures: List[Dict[str, Any]] = []
    try:
        while True:
            started = time.time()
            if run_dir is not None:
                restarts.clear_marks(run_dir)
            stops.workers = _start(nprocs, fn, args)
            for sig in handled:
                signal.signal(sig, stops)
            failed = _wait(stops.workers)
            if failed is None:
                return
            error = _failure(stops.workers[failed], failed, stops.first)
            # a stop was asked for, a user error, no budget: the job ends here
            restartable = isinstance(error, GptlabError) and stops.first is None
            if not restartable or not max_restarts or run_dir is None:
                raise error from None
            code = stops.workers[failed].exitcode
            failures.append(restarts.failure(failed, code, run_dir, started))
            if len(failures) > max_restarts:
                raise GptlabError(restarts.budget_line(failures, max_restarts)) from None
            restarts.leave_failure(run_dir, failures[-1])
            log.warning(
                f"{restarts.died(failures[-1])}: starting all {nprocs} workers again from the "
                f"latest checkpoint (restart {len(failures)} of train.max_restarts={max_restarts})"
            )
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def restarts_so_far(run: Any) -> List[Dict[str, Any]]:
    """The run's restarts after failures, recorded on every rank after a run was built.

    After a run was built, on every rank: the run's restarts after failures (rank 0), the failures
    that led to this start among them, recorded; each step marked as it starts where a launcher may
    start the job again (distributed/restarts.py).
    """
    return restarts.begin(run)


# What a worker imports before its run, loaded once by the fork server that every worker (and every
# restart's) is forked from, instead of once per worker: torch's dynamo comes with the first
# optimizer (torch._disable_dynamo).
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "gptlab.training.build"]


def _start(nprocs: int, fn, args: tuple) -> list:
    """The started workers, forked from a fork server that imported PRELOAD and fn's module once.

    The fork server is multiprocessing's forkserver: a fresh interpreter with nothing but imports in
    it, so safe with threads and CUDA.

    SIGINT is ignored while they start, so that they inherit it ignored until follow_launcher has
    taken them out of the terminal's reach: a Ctrl-C then reaches this launcher alone.
    """
    import multiprocessing

    ctx = multiprocessing.get_context("forkserver")
    main = fn.__module__ == "__main__"  # each worker runs a __main__ itself, as __mp_main__
    ctx.set_forkserver_preload([*PRELOAD, *([] if main else [fn.__module__])])  # read at its start
    launch = (nprocs, _free_port(), os.getpid(), dict(os.environ))
    workers = [
        ctx.Process(target=_worker, args=(i, launch, fn, args), name=f"rank {i}")
        for i in range(nprocs)
    ]
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        for w in workers:
            w.start()
    except BaseException:
        _kill([w for w in workers if w.pid is not None])
        raise
    finally:
        signal.signal(signal.SIGINT, previous)
    return workers


class _Forward:
    """The launcher's stop-signal handler: the first signal goes on to every live worker.

    A second SIGINT or SIGTERM (stop_again) kills them and raises KeyboardInterrupt; other repeats
    ask nothing more.
    """

    def __init__(self) -> None:
        self.workers: list = []
        self.first: Optional[str] = None
        self._at = 0.0

    def __call__(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.first is None:
            self.first, self._at = name, time.monotonic()
            for w in self.workers:
                if w.is_alive():
                    os.kill(w.pid, signum)
        elif stop_again(self.first, time.monotonic() - self._at, name):
            _kill(self.workers)
            raise KeyboardInterrupt


def _wait(workers: list) -> Optional[int]:
    """Wait until every worker has ended; the failed one's index (None: all ended well).

    When one fails, kill the others at once.
    """
    from multiprocessing.connection import wait

    live = {w.sentinel: i for i, w in enumerate(workers)}
    while live:
        for sentinel in wait(list(live)):
            i = live.pop(sentinel)
            workers[i].join()
            if workers[i].exitcode != 0:
                culprit = _culprit(workers, i)
                _kill(workers)
                return culprit
    return None


def _culprit(workers: list, first: int) -> int:
    """The worker whose failure ended the job, among those that have already failed.

    A rank that died takes its peers down with it (their collectives raise, CRASHED), so a death
    that is not a traceback is the cause; else the first failure seen.
    """
    failed = [i for i, w in enumerate(workers) if w.exitcode not in (None, 0)]
    return next((i for i in failed if workers[i].exitcode != CRASHED), first)


def _kill(workers: list) -> None:
    """SIGKILL the workers still running, and reap them.

    Not SIGTERM: a worker would take it for a stop and try to save, with a peer gone, and say so in
    a traceback.
    """
    for w in workers:
        if w.is_alive():
            w.kill()
    for w in workers:
        w.join()


def _failure(worker, rank: int, asked: Optional[str]) -> BaseException:
    """What a worker's failed exit means here.

    `asked` is the stop signal the launcher forwarded, if any.
    """
    code = worker.exitcode
    if code == 2:
        return SystemExit(2)
    if code == INTERRUPTED or (asked is not None and code == -signal.Signals[asked]):
        # stopped before it could save: the caller says where the run stands
        return KeyboardInterrupt()
    if code == CRASHED:
        return GptlabError(f"worker rank {rank} failed (traceback above); all workers were stopped")
    try:
        how = (
            f"was killed by {signal.Signals(-code).name}"
            if code < 0
            else f"exited with code {code}"
        )
    except ValueError:
        how = f"was killed by signal {-code}"
    return GptlabError(f"worker rank {rank} (pid {worker.pid}) {how}; all workers were stopped")


# seconds teardown leaves the GIL free for gloo's worker threads (see _exit_now)
GLOO_SETTLE_S = 0.2


def teardown() -> None:
    """Leave the process group, and under gloo wait for its worker threads to drop their work.

    Under gloo, give its worker threads time to drop their last work after leaving.

    A process that ends through the interpreter's shutdown (torchrun, SLURM) would otherwise race
    those threads for the GIL as spawned workers did (see _exit_now); the sleep gives them the GIL
    while the interpreter is still whole.
    """
    global _CONTROL_GROUP
    if dist.is_initialized():
        gloo = dist.get_world_size() > 1 and (
            dist.get_backend() == "gloo" or _CONTROL_GROUP is not None
        )
        dist.destroy_process_group()
        if gloo:
            time.sleep(GLOO_SETTLE_S)
    _CONTROL_GROUP = None


def wrap_model(
    model: nn.Module, d: Dist, par: ParallelismConfig, hw: HardwareConfig, compile: bool
) -> nn.Module:
    """checkpointing -> compile -> the strategy's data-parallel wrapper, in that fixed order.

    Unsharded (single, ddp): torch.compile of the whole model, then DDP around the compiled module
    (its gradient hooks then fire on the compiled graph's parameters). Sharded (fsdp, hsdp): each
    block is compiled in place, then sharded, then the root is sharded; a whole-model compile would
    break its graph at every block's FSDP hook and silently run eager.
    """
    if par.activation_checkpointing:
        model.activation_checkpointing = True  # inside each block's forward: compiled with it
        if compile:
            compile_with_checkpointing(d.world_size > 1 and par.strategy not in SHARDED)
    if par.strategy in SHARDED:
        return _shard(model, d, par, hw, compile)
    if compile:
        fastpath.use_inductor_cache()  # the next run of the command reuses the compiled code
        model = torch.compile(model)
    return _replicate(model, d, par.strategy == "ddp" and dist.is_initialized())


def compile_with_checkpointing(ddp: bool) -> None:
    """Dynamo settings for compiled blocks that checkpoint their activations.

    Every block runs the same forward code under its own guards, and backward re-runs them in
    reverse order: Dynamo's LRU reordering of cached graphs then keeps missing and recompiling,
    so it is turned off (as torchtitan does with checkpointing). Under DDP, torch before 2.6 had
    DDPOptimizer refuse graphs holding checkpointing's higher-order op (pytorch#104674): there
    DDP's buckets are not split into graphs (one graph, gradients reduced after it).
    """
    import torch._dynamo

    set_lru = getattr(torch._C._dynamo.eval_frame, "_set_lru_cache", None)
    if set_lru is not None:
        set_lru(False)
    if ddp and torch_older_than(2, 6):
        torch._dynamo.config.optimize_ddp = False


def torch_older_than(major: int, minor: int) -> bool:
    version = torch.__version__.split("+")[0].split(".")
    return (int(version[0]), int(version[1])) < (major, minor)


def _replicate(model: nn.Module, d: Dist, alone_in_ddp: bool = False) -> nn.Module:
    """A whole copy of the model per process; with others, DDP keeps the copies in step.

    Alone, the model itself (unless alone_in_ddp: parallelism=ddp launched as a world of one, whose
    process group is up); with others, DDP keeps the copies in step.
    """
    if d.world_size == 1 and not alone_in_ddp:
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP

    # No buffer broadcast: the buffers (rotary and sinusoidal tables) are the same on every rank by
    # construction, and broadcasting them makes every forward a collective, so that a rank with
    # no validation batch (train.eval_steps < world size) would leave the others waiting in it.
    return DDP(
        model, device_ids=[d.device.index] if d.device.type == "cuda" else None, **_no_buffer_sync()
    )


def _no_buffer_sync() -> Dict[str, bool]:
    """Turns off DDP's switch for syncing buffers before every forward.

    forward_sync_buffers where torch has it (it deprecates broadcast_buffers), else
    broadcast_buffers.
    """
    import inspect

    from torch.nn.parallel import DistributedDataParallel as DDP

    params = inspect.signature(DDP.__init__).parameters
    name = "forward_sync_buffers" if "forward_sync_buffers" in params else "broadcast_buffers"
    return {name: False}


# hardware.precision -> the dtype FSDP gathers parameters in for compute (master weights stay fp32)
_PARAM_DTYPE = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def mesh_shape(strategy: str, world_size: int, nodes: int) -> tuple:
    """The device mesh's shape for fsdp (one dimension) or hsdp (two).

    fsdp: one dimension, all ranks shard; hsdp: (nodes to replicate over, ranks per node to shard
    over).
    """
    return (nodes, world_size // nodes) if strategy == "hsdp" else (world_size,)


def _shard(
    model: nn.Module, d: Dist, par: ParallelismConfig, hw: HardwareConfig, compile: bool
) -> nn.Module:
    """Shards the model with FSDP2 in place: every block, then the root.

    Every block is its own shard unit (gathered just before use), then the root (embeddings, final
    norm, head). Gradients reduce in fp32 whatever the compute dtype.
    """
    import warnings

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    shape = mesh_shape(par.strategy, d.world_size, hw.nodes)
    names = ("replicate", "shard") if len(shape) == 2 else ("shard",)
    mesh = init_device_mesh(d.device.type, shape, mesh_dim_names=names)
    policy = MixedPrecisionPolicy(
        param_dtype=_PARAM_DTYPE[hw.precision], reduce_dtype=torch.float32
    )
    # Blocks return their (k, v) and the root a slice of the padded logits: views FSDP warns about
    # on every forward. Nothing modifies them in place, so the warning says nothing here.
    warnings.filterwarnings("ignore", message=r".*FSDP2-wrapped module.*returned a view tensor")
    for block in model.h:
        if compile:
            fastpath.use_inductor_cache()
            block.compile()
        fully_shard(
            block, mesh=mesh, mp_policy=policy, reshard_after_forward=par.reshard_after_forward
        )
    # the root's parameters are used last in forward and first in backward: keeping them is free
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    return model


def reshard(model: nn.Module) -> None:
    """Free the gathered (unsharded) weights a fully_shard model still holds.

    So that its next forward gathers the shards again: needed after the shards' values were replaced
    in place (the root keeps its gathered weights after forward, as do blocks with
    reshard_after_forward=false). A no-op for any other model.
    """
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def is_sharded(model: nn.Module) -> bool:
    """True for a model sharded by fully_shard (its parameters are DTensors)."""
    return any(is_dtensor(p) for p in model.parameters())


def no_sync(model: nn.Module, sync: bool):
    """Reduce gradients on the last accumulation micro-step only.

    DDP skips its all-reduce inside no_sync(); an FSDP model is told whether to reduce-scatter
    before the backward.
    """
    if hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(sync)
        return nullcontext()
    if sync or not hasattr(model, "no_sync"):
        return nullcontext()
    return model.no_sync()


def grad_norm_value(norm: torch.Tensor) -> torch.Tensor:
    """clip_grad_norm_'s result as a plain tensor.

    Over sharded gradients it is a replicated DTensor that already holds the global norm.
    """
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def all_reduce_mean(t: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        t /= dist.get_world_size()
    return t


def agree_on_signal(received: Optional[str]) -> Optional[str]:
    """The stop signal if any rank received one, the same answer on every rank.

    Every rank gets the same answer; SIGUSR2, which a scheduler follows with a requeue, wins.
    """
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return received
    codes = {None: 0, "SIGINT": 1, "SIGTERM": 2, "SIGUSR2": 3}
    # a CPU tensor over the gloo control group: no host-device synchronisation on GPUs
    flag = torch.tensor([codes.get(received, 2)], device="cpu")
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=_CONTROL_GROUP)
    return {v: k for k, v in codes.items()}[int(flag.item())]


# A stop asked for again within this many seconds is the same stop delivered twice: to every process
# of a SLURM step or a process group, and once more by gptlab's launcher.
SAME_STOP_S = 1.0
USER_STOPS = ("SIGINT", "SIGTERM")


def stop_again(first: str, since_s: float, name: str) -> bool:
    """Whether stop signal `name`, `since_s` seconds after the first one, ends the run at once.

    `first` is the first signal.

    A second SIGINT or SIGTERM does. SIGUSR2 neither does nor makes a later one do: it is a
    scheduler's warning, and the scheduler's SIGTERM that may follow must not cut the save short.
    """
    return first in USER_STOPS and name in USER_STOPS and since_s > SAME_STOP_S
