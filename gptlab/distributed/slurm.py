"""SLURM's side of a job: a task's identity, the rendezvous port, slurm.json and what went wrong.

A task's identity and environment, the rendezvous port, the job's record in the run folder
(slurm.json, written and read here), and what went wrong with a job (srun's lines, the
controller's state), with the submitit job watcher that asks the controller.

submitit's private attributes are touched in ControllerCheckedWatcher alone.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import List, Optional, Tuple

from submitit.slurm.slurm import SlurmInfoWatcher, SlurmJob

from gptlab.errors import GptlabError
from gptlab.records import layout

log = logging.getLogger(__name__)


# ------------------------------------------------------------------ who this task is


def first_task() -> bool:
    """Whether this is a job's first task, the only one that records.

    With several tasks every one runs the whole job.
    """
    return os.environ.get("SLURM_PROCID", os.environ.get("RANK", "0")) == "0"


def slurm_task() -> bool:
    """True inside an `srun` step (which is how submitit starts each task of a job)."""
    return "SLURM_PROCID" in os.environ and "SLURM_STEP_NUM_TASKS" in os.environ


def _step_nodes() -> list:
    return slurm_hostnames(
        os.environ.get("SLURM_STEP_NODELIST") or os.environ["SLURM_JOB_NODELIST"]
    )


def export_env() -> None:
    """Turn a SLURM task's identity into torch.distributed's env:// variables (any nodes x tasks).

    The master is the first node of the step (SLURM gives it rank 0); the port is
    `rendezvous_port(job id)` unless MASTER_PORT is set. Rank 0 checks that it can listen on that
    port before any rank waits for it.
    """
    port = int(os.environ.get("MASTER_PORT") or rendezvous_port(int(os.environ["SLURM_JOB_ID"])))
    if os.environ.get("SUBMITIT_EXECUTOR") == "slurm":
        import submitit

        env = submitit.helpers.TorchDistributedEnvironment()  # rank, local rank, world, first node
        env.master_addr = os.environ.get("MASTER_ADDR", env.master_addr)
        env.master_port = port  # submitit's own pick is random, and may be an ephemeral port
        # keep every GPU visible: the device is picked from the local rank in setup
        env.export(set_cuda_visible_devices=False, overwrite=True)
    else:  # srun without submitit (launch/sbatch_gptlab.sh)
        os.environ.setdefault("MASTER_ADDR", _step_nodes()[0])
        os.environ.update(
            MASTER_PORT=str(port),
            RANK=os.environ["SLURM_PROCID"],
            WORLD_SIZE=os.environ["SLURM_STEP_NUM_TASKS"],
            LOCAL_RANK=os.environ["SLURM_LOCALID"],
        )
    if os.environ["RANK"] == "0":
        check_rendezvous_port(port)


def slurm_hostnames(nodelist: str) -> list:
    """A SLURM node list (`gptlab-n[1-2]`) as host names, in SLURM's order."""
    out = subprocess.run(
        ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True
    )
    return out.stdout.split()


# ------------------------------------------------------------------ the rendezvous port

EPHEMERAL_PORTS_FILE = "/proc/sys/net/ipv4/ip_local_port_range"


def ephemeral_ports(path: str = EPHEMERAL_PORTS_FILE) -> tuple:
    """(first, last): the ports this node's kernel hands out to outgoing connections."""
    try:
        with open(path) as f:
            first, last = (int(x) for x in f.read().split()[:2])
        return first, last
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def rendezvous_port(job_id: int, ephemeral: Optional[tuple] = None) -> int:
    """The port rank 0 listens on for the rendezvous of SLURM job `job_id`.

    A function of the job id alone, so every node computes the same port and a requeued job gets
    it again; and outside the node's ephemeral range (ephemeral: (first, last), default: read from
    /proc), so that no outgoing connection of this machine (a previous job's gloo sockets sitting
    in TIME_WAIT on an ephemeral port) already holds it. It is the larger of the free stretches of
    20000-65535 on either side of that range (with Linux's default: 20000-32767).
    """
    first, last = ephemeral or ephemeral_ports()
    low, high = 20000, 65536
    stretches = [(low, min(first, high)), (max(last + 1, low), high)]
    start, stop = max(stretches, key=lambda s: s[1] - s[0])
    if stop - start < 1000:
        raise GptlabError(
            f"the ephemeral port range {first}-{last} ({EPHEMERAL_PORTS_FILE}) leaves no room "
            f"for a "
            "rendezvous port in 20000-65535; set MASTER_PORT to a port that no connection uses"
        )
    return start + job_id % (stop - start)


def check_rendezvous_port(port: int) -> None:
    """Rank 0 is about to listen on `port`: if that is impossible, say so and end this task now.

    Otherwise the other ranks would wait for the rendezvous until the process group's timeout. The
    task exits non-zero (SystemExit: Hydra's job runner catches exceptions only, and would turn the
    error into a finished task), so that SLURM's kill-on-bad-exit ends the whole job at once.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # as torch's TCPStore does: a port left in TIME_WAIT is no obstacle
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError as e:
            first, last = ephemeral_ports()
            message = (
                f"rank 0 cannot listen on the rendezvous port {port} on {socket.gethostname()} "
                f"({e.strerror}); set MASTER_PORT to a free port outside {first}-{last} "
                "(this node's ephemeral ports)"
            )
            print(f"gptlab: error: {message}", file=sys.stderr, flush=True)
            raise SystemExit(2) from None


# ------------------------------------------------------------------ the job's record (slurm.json)


def slurm_job_info() -> Optional[dict]:
    """A SLURM task's job id, nodes, and where its output goes.

    For a task started by submitit or by srun.
    """
    if os.environ.get("SUBMITIT_EXECUTOR") == "slurm":
        import submitit

        env = submitit.JobEnvironment()
        return {
            "job_id": env.job_id,
            "nodes": env.hostnames,
            "stdout": str(env.paths.stdout),
            "stderr": str(env.paths.stderr),
            "submitit_folder": str(env.paths.folder),
        }
    if not slurm_task():
        return None
    job_id = os.environ["SLURM_JOB_ID"]
    shown = subprocess.run(
        ["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True
    ).stdout
    fields = dict(word.partition("=")[::2] for word in shown.split() if "=" in word)
    return {
        "job_id": job_id,
        "nodes": _step_nodes(),
        "stdout": fields.get("StdOut", ""),
        "stderr": fields.get("StdErr", ""),
    }


def write_job_record(run_dir: Path) -> None:
    """A SLURM job's logs live in submitit's folder: say where, in slurm.json and the log."""
    job = slurm_job_info()
    if job is not None:
        (Path(run_dir) / layout.SLURM).write_text(json.dumps(job, indent=1) + "\n")
        log.info(f"SLURM job {job['job_id']} on {','.join(job['nodes'])}; logs: {job['stdout']}")


def read_job_record(run_dir: Path) -> Optional[dict]:
    """slurm.json of a run folder a SLURM job ran (None for any other)."""
    return layout.read_json(Path(run_dir) / layout.SLURM)


# ------------------------------------------------------------------ what went wrong

# srun's own line for a task that ended badly, e.g. `srun: error: gptlab-n2: task 1: Killed` or
# `srun: error: node7: tasks 8-15: Exited with exit code 1` (task numbers are global ranks)
_SRUN_BAD_EXIT = re.compile(
    r"^srun: error: (?P<node>[^\s:]+): (?P<kind>tasks?) (?P<tasks>[0-9][0-9,-]*): (?P<what>.+)$"
)

# slurmstepd's line when a requeue (submitit's, after SIGUSR2) stops the running job: srun then
# reports the tasks it stopped, ending with rank 0 (which requeued the job)
_REQUEUE = "DUE TO JOB REQUEUE"


def srun_failures(text: str, requeued: bool = False) -> Tuple[List[str], bool]:
    """The tasks srun says ended badly, one line each, and whether the text ends inside a requeue.

    Each line reads `rank 1 on gptlab-n2: Killed`; a text ending inside a requeue carries into the
    next piece of the same log. The tasks that a requeue stops are not failures, and are left out.
    """
    found = []
    for line in text.splitlines():
        if _REQUEUE in line:
            requeued = True
            continue
        m = _SRUN_BAD_EXIT.match(line.strip())
        if not m:
            continue
        if requeued:
            if re.split(r"[-,]", m["tasks"])[0] == "0":
                # rank 0 asked for the requeue and goes last: what follows is the job's next start
                requeued = False
            continue
        ranks = "ranks" if m["kind"] == "tasks" else "rank"
        found.append(f"{ranks} {m['tasks']} on {m['node']}: {m['what'].strip()}")
    return found, requeued


_FAILURE_LINE = re.compile(r"^ranks? (?P<ranks>[0-9][0-9,-]*) on (?P<node>\S+): (?P<what>.+)$")


def failure_parts(line: str) -> Optional[Tuple[str, str, str]]:
    """The (ranks, node, how it ended) of one of srun_failures' lines; None for any other text.

    `rank 1 on gptlab-n2: Killed` -> ("1", "gptlab-n2", "Killed").
    """
    m = _FAILURE_LINE.match(line)
    return (m["ranks"], m["node"], m["what"]) if m else None


def job_failures(job_folder: Path) -> List[str]:
    """srun's bad-exit lines in a SLURM job's logs (submitit's folder of that job).

    srun writes to the batch step's stderr, which submitit sends to task 0's `<job>_0_log.err`.
    """
    found: List[str] = []
    for err in sorted(Path(job_folder).glob("*_0_log.err")) if Path(job_folder).is_dir() else []:
        try:
            text = err.read_text(errors="replace")
        except OSError:
            continue
        found += [f for f in srun_failures(text)[0] if f not in found]
    return found


def job_error(run_dir: Optional[str]) -> Optional[str]:
    """`SLURM job 61: rank 1 on gptlab-n2: Killed` for a run folder whose SLURM job lost a task."""
    if not run_dir:
        return None
    job = read_job_record(Path(run_dir))
    if job is None:
        return None
    folder = job.get("submitit_folder")
    failures = job_failures(Path(folder)) if folder else []
    return f"SLURM job {job.get('job_id')}: {'; '.join(failures)}" if failures else None


# What SLURM's controller calls a job that is running, or will run again (a requeued job is PENDING)
LIVE_STATES = frozenset(
    {
        "PENDING",
        "CONFIGURING",
        "RUNNING",
        "COMPLETING",
        "SUSPENDED",
        "REQUEUED",
        "REQUEUE_FED",
        "REQUEUE_HOLD",
        "RESIZING",
        "SIGNALING",
        "STAGE_OUT",
    }
)


def controller_state(job_id: str) -> Optional[str]:
    """A job's state in SLURM's controller (`scontrol show job`), or None where it cannot say.

    None: the controller has forgotten the job (MinJobAge after the end), does not answer, or
    there is no scontrol.
    """
    try:
        r = subprocess.run(
            ["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"\bJobState=(\S+)", r.stdout) if r.returncode == 0 else None
    return match.group(1) if match else None


# ------------------------------------------------------------------ the submitit job watcher


class ControllerCheckedWatcher(SlurmInfoWatcher):
    """submitit's job watcher, believing sacct that a job ended only when the controller agrees.

    submitit takes the first ended state sacct reports as final, and the launcher then fails the
    sweep if the job's result file does not appear soon after. Accounting is fed by the controller
    after the fact: a requeued job (SIGUSR2, preemption) can read there as ended while the
    controller has it pending or running again. While the controller says the job lives, it is not
    done, and sacct is asked again.

    The only code of gptlab that uses submitit's private attributes (InfoWatcher's _delay_s,
    _finished and _info_dict), checked against submitit 1.5.4.
    """

    @classmethod
    def replacing(cls, stock: SlurmInfoWatcher) -> "ControllerCheckedWatcher":
        """One that polls as often as `stock` does."""
        return cls(delay_s=stock._delay_s)

    def is_done(self, job_id: str, mode: str = "standard") -> bool:
        if not super().is_done(job_id, mode=mode):
            return False
        if controller_state(job_id) not in LIVE_STATES:
            return (
                True  # the controller agrees, or no longer knows the job: accounting's word stands
            )
        self._finished.discard(job_id)
        self._info_dict.pop(job_id, None)  # ask sacct again at the next update
        return False


def install_watcher() -> Optional[SlurmInfoWatcher]:
    """Make submitit's jobs wait through ControllerCheckedWatcher; returns the watcher it replaced.

    Put it back with restore_watcher; None when ControllerCheckedWatcher is installed already.
    """
    if isinstance(SlurmJob.watcher, ControllerCheckedWatcher):
        return None
    stock = SlurmJob.watcher  # a class attribute: every job of the launcher waits through it
    SlurmJob.watcher = ControllerCheckedWatcher.replacing(stock)
    return stock


def restore_watcher(stock: SlurmInfoWatcher) -> None:
    """Put back the watcher install_watcher replaced."""
    SlurmJob.watcher = stock
