"""N gptlab runs started at once, each logging every step to one tracking store: what the store
records.

    python benchmarks/mlflow_load.py [backend=server] [runs=16] [steps=200] [uri=http://HOST:PORT]
                                     [model=gpt_nano] [batch=8] [eval_every=50] [threads=1]
                                     [work=FOLDER]

backend=server: the runs log to `mlflow server` on PostgreSQL. Without `uri`, a fresh one is started
with launch/mlflow_server.sh (its own state folder under work/, a free port) and taken down at the
end; with `uri`, that server is used, and its CPU is measured when GPTLAB_MLFLOW_DIR names the state
folder it was started with. backend=sqlite: a fresh SQLite file (sqlite:///work/mlflow.db), the
default kind of store, shared by the runs.

Every run is `python -m gptlab.train model=... train.max_steps=steps train.log_every=1` in its own
run folder, on `threads` CPU threads (1: many runs on few cores would otherwise fight over them),
started through this script (`child` mode), which times each call of the tracker's
log_metrics (what the step loop pays) and each call the background sender makes to the store (what
the store takes per batch), and writes them beside the run folder.

Prints one line per figure and a JSON summary: runs that exited 0, runs recorded (FINISHED of all
started), train/loss points recorded against expected (and duplicates), and the same after one
`gptlab.sync` of the run folders when something was missing, p50/p99 of log_metrics and
of the sender's calls, the wall time, and the server's CPU (seconds, and percent of one core over
the wall: the mlflow server's processes and PostgreSQL's). Not a test: figures are measured, not
asserted.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any, Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"
SCRIPT = ROOT / "launch" / "mlflow_server.sh"
CLK_TCK = os.sysconf("SC_CLK_TCK")


# ---- child mode: one timed gptlab run ------------------------------------------------------------


def child(timings: Path, overrides: List[str]) -> None:
    """Run gptlab.train with the tracker's calls timed; write the timings (ms) to `timings` at
    exit."""
    import atexit

    from gptlab.records import tracker as tracking

    logged: List[float] = []
    sent: List[float] = []

    def timed(fn, into):
        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                into.append((time.perf_counter() - t) * 1000)

        return wrapper

    tracking.Tracker.log_metrics = timed(tracking.Tracker.log_metrics, logged)
    tracking.Sender._attempt = timed(tracking.Sender._attempt, sent)
    atexit.register(
        lambda: timings.write_text(json.dumps({"log_metrics_ms": logged, "send_ms": sent}))
    )
    sys.argv = [sys.argv[0], *overrides]
    from gptlab.train import main

    main()


# ---- the server ----------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def script(command: str, state: Path, port: int) -> str:
    env = {**os.environ, "GPTLAB_MLFLOW_DIR": str(state), "GPTLAB_MLFLOW_PORT": str(port)}
    r = subprocess.run(
        ["bash", str(SCRIPT), command], env=env, capture_output=True, text=True, timeout=600
    )
    if r.returncode != 0:
        raise SystemExit(f"launch/mlflow_server.sh {command} failed:\n{r.stdout}{r.stderr}")
    return r.stdout


def server_pids(state: Optional[Path]) -> List[int]:
    """The mlflow server's processes (its process group) and PostgreSQL's (the postmaster and
    children)."""
    if state is None:
        return []
    pids = []
    roots = []
    for name in ("run/mlflow.pid", "pgdata/postmaster.pid"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            roots.append(int((state / name).read_text().split()[0]))
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        pid, ppid, pgrp = int(stat.parent.name), int(fields[1]), int(fields[2])
        if pid in roots or ppid in roots or pgrp in roots:
            pids.append(pid)
    return pids


def cpu_seconds(pids: List[int]) -> Dict[int, float]:
    out = {}
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        # utime + stime, and cutime + cstime: the children it reaped (PostgreSQL's ended backends)
        out[pid] = sum(int(f) for f in fields[11:15]) / CLK_TCK
    return out


# ---- the runs ------------------------------------------------------------------------------------


def start_runs(o: Dict[str, str], uri: str, work: Path, experiment: str) -> List[Dict[str, Any]]:
    runs = []
    for i in range(int(o["runs"])):
        run_dir = work / "runs" / str(i)
        overrides = [
            f"model={o['model']}", f"data.path={o['data']}", f"train.max_steps={o['steps']}",
            f"train.batch_size={o['batch']}", "train.log_every=1",
            f"train.eval_every={o['eval_every']}", "train.eval_steps=2", "train.sample_tokens=0",
            "train.save_checkpoints=false",
            f"hardware.threads={o['threads']}",
            f"tracking.uri={uri}", f"tracking.experiment={experiment}", f"hydra.run.dir={run_dir}",
        ]  # fmt: skip
        timings = work / f"timings-{i}.json"
        log = open(work / f"run-{i}.log", "w")  # noqa: SIM115 - closed when the run ends
        cmd = [sys.executable, __file__, "child", str(timings), *overrides]
        proc = subprocess.Popen(cmd, cwd=work, stdout=log, stderr=subprocess.STDOUT)
        runs.append({"proc": proc, "log": log, "dir": run_dir, "timings": timings})
    return runs


def recorded(uri: str, experiment: str, steps: int) -> Dict[str, Any]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs([exp.experiment_id], max_results=1000) if exp else []
    points, dups = 0, 0
    for r in runs:
        counts = Counter(m.step for m in client.get_metric_history(r.info.run_id, "train/loss"))
        points += len(counts)
        dups += sum(n - 1 for n in counts.values())
    return {
        "runs_recorded": len(runs),
        "runs_finished": sum(r.info.status == "FINISHED" for r in runs),
        "points_recorded": points,
        "duplicate_points": dups,
    }


def percentile(values: List[float], q: float) -> Optional[float]:
    if not values:
        return None
    values = sorted(values)
    return round(values[min(len(values) - 1, int(q / 100 * len(values)))], 3)


def main(argv: List[str]) -> None:
    if argv[:1] == ["child"]:
        return child(Path(argv[1]), argv[2:])
    o = {"backend": "server", "runs": "16", "steps": "200", "model": "gpt_nano", "batch": "8",
         "eval_every": "50", "threads": "1", "data": str(DATA),
         **dict(a.split("=", 1) for a in argv)}  # fmt: skip
    work = Path(
        o.get("work") or tempfile.mkdtemp(prefix="gptlab-mlflow-load-", dir="/var/tmp")
    ).resolve()
    work.mkdir(parents=True, exist_ok=True)
    # the postgres user enters it (a server started here keeps its database there)
    work.chmod(0o755)
    started_here: Optional[Path] = None
    state = Path(os.environ["GPTLAB_MLFLOW_DIR"]) if os.environ.get("GPTLAB_MLFLOW_DIR") else None
    if o["backend"] == "sqlite":
        uri, state = f"sqlite:///{work / 'mlflow.db'}", None
    elif o.get("uri"):
        uri = o["uri"]
    else:
        port, state = free_port(), work / "server"
        t = time.time()
        print(script("up", state, port).strip(), f"({time.time() - t:.0f} s)", flush=True)
        uri, started_here = f"http://127.0.0.1:{port}", state
    experiment = f"load-{o['backend']}-{int(time.time())}"
    pids = server_pids(state)
    cpu0 = cpu_seconds(pids)
    t0 = time.time()
    runs = start_runs(o, uri, work, experiment)
    try:
        codes = [r["proc"].wait() for r in runs]
    finally:
        for r in runs:
            if r["proc"].poll() is None:
                r["proc"].send_signal(signal.SIGTERM)
            r["log"].close()
    wall = time.time() - t0
    cpu1 = cpu_seconds(server_pids(state))
    # processes alive at the end
    server_cpu = sum(cpu1.get(p, 0.0) - cpu0.get(p, 0.0) for p in cpu1)
    logged, sent = [], []
    for r in runs:
        with_timings = json.loads(r["timings"].read_text()) if r["timings"].is_file() else {}
        logged += with_timings.get("log_metrics_ms", [])
        sent += with_timings.get("send_ms", [])
    steps = int(o["steps"])
    rec = recorded(uri, experiment, steps)
    synced = None
    if rec["points_recorded"] < len(runs) * steps or rec["runs_finished"] < len(runs):
        # what the runs said they could not send: one gptlab.sync of their folders
        cmd = [sys.executable, "-m", "gptlab.sync", *[str(r["dir"]) for r in runs]]
        subprocess.run([*cmd, f"tracking.uri={uri}"], cwd=work, capture_output=True, text=True,
                       timeout=3600)  # fmt: skip
        synced = recorded(uri, experiment, steps)
    summary = {
        "backend": o["backend"], "uri": uri, "runs": len(runs), "steps": steps,
        "runs_exit_0": codes.count(0), **rec, "points_expected": len(runs) * steps,
        "after_one_sync": synced,
        "log_metrics_ms_p50": percentile(logged, 50), "log_metrics_ms_p99": percentile(logged, 99),
        "log_metrics_ms_max": percentile(logged, 100), "log_metrics_calls": len(logged),
        "send_ms_p50": percentile(sent, 50), "send_ms_p99": percentile(sent, 99),
        "send_calls": len(sent),
        "wall_s": round(wall, 1),
        "server_cpu_s": round(server_cpu, 1) if state else None,
        "server_cpu_percent_of_one_core": round(100 * server_cpu / wall, 1) if state else None,
        "work": str(work),
    }  # fmt: skip
    if started_here is not None:
        print(script("down", started_here, int(uri.rsplit(":", 1)[1])).strip(), flush=True)
    print(
        f"{summary['backend']}: {summary['runs_exit_0']}/{len(runs)} runs exited 0, "
        f"{rec['runs_finished']}/{len(runs)} FINISHED in MLflow ({rec['runs_recorded']} recorded), "
        f"train/loss points {rec['points_recorded']}/{summary['points_expected']} "
        f"({rec['duplicate_points']} duplicates)"
        + (
            f"; after one gptlab.sync: {synced['runs_finished']}/{len(runs)} FINISHED, "
            f"{synced['points_recorded']}/{summary['points_expected']} points "
            f"({synced['duplicate_points']} duplicates)"
            if synced
            else ""
        )
        + "\n"
        f"log_metrics p50 {summary['log_metrics_ms_p50']} ms, "
        f"p99 {summary['log_metrics_ms_p99']} ms ({summary['log_metrics_calls']} calls); "
        f"sender's calls to the store p50 {summary['send_ms_p50']} ms, "
        f"p99 {summary['send_ms_p99']} ms ({summary['send_calls']} calls)\n"
        f"wall {summary['wall_s']} s; server CPU "
        + (
            f"{summary['server_cpu_s']} s "
            f"({summary['server_cpu_percent_of_one_core']}% of one core)"
            if state
            else "n/a (no server)"
        ),
        flush=True,
    )
    print(json.dumps(summary), flush=True)
    if o.get("keep") != "1" and not o.get("work"):
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv[1:])
