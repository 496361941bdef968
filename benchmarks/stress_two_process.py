"""Many short two-process runs, to catch a crash that comes once in many (a rank dying of SIGABRT).

    python benchmarks/stress_two_process.py [runs=40] [steps=150] [strategy=fsdp] [malloc=both]
    [out=DIR]
        [model=gpt_nano] [mlflow=false] [ctrl_c=0]

Each run is the real command, `python -m gptlab.train model=<model> hardware=cpu_x2
parallelism=<strategy> train.max_steps=<steps>` with an evaluation and a checkpoint every 50 steps,
in a fresh run folder under out (default: a temporary folder; mlflow=true records in out's SQLite
store). malloc=both alternates runs with gptlab's glibc malloc setting (runtime.keep_freed_memory)
and without it (GPTLAB_KEEP_FREED_MEMORY=0); malloc=on or malloc=off runs one kind only. Python's
faulthandler is on in every process, so a rank that dies of a signal prints its threads' Python
stacks first. ctrl_c=N sends SIGINT to the run's process group, as a terminal's Ctrl-C does, once
metrics.jsonl has N rows (every run ends early then; exit 0 or 130 is clean).

A run fails when the command exits non-zero, or its stderr names a signal, an abort or a glibc
malloc check (`free(): invalid pointer`, `double free`, `corrupted ...`). Every failed run's stderr
is kept as out/failed_<i>_<malloc>.txt. Prints one JSON line: per setting, the runs, the failures,
and for each failure the signal or message that ended it. Not a test: it takes minutes.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHAKESPEARE = REPO.parent / "shared" / "data" / "tinyshakespeare.txt"
# what a dying process leaves on stderr: the launcher's line for a killed worker, glibc's malloc
# checks, C++'s terminate, and faulthandler's header
FATAL = re.compile(
    r"was killed by (SIG[A-Z0-9]+)|(free\(\): [^\n]+)|(double free[^\n]*)|(corrupted [^\n]+)"
    r"|(malloc\(\): [^\n]+)|(terminate called[^\n]*)|Fatal Python error: ([^\n]+)"
)


def command(run_dir: Path, opts: dict) -> list:
    return [
        sys.executable,
        "-m",
        "gptlab.train",
        f"model={opts['model']}",
        "hardware=cpu_x2",
        f"parallelism={opts['strategy']}",
        f"data.path={opts['data']}",
        f"train.max_steps={opts['steps']}",
        "train.eval_every=50",
        "train.eval_steps=2",
        "train.checkpoint_every=50",
        "train.log_every=50",
        "train.sample_tokens=0",
        f"tracking.mlflow={opts['mlflow']}",
        "parallelism.timeout_s=60",
        f"hydra.run.dir={run_dir}",
    ]


def run(cmd: list, cwd: Path, env: dict, timeout: float, ctrl_c: int, run_dir: Path) -> tuple:
    """(exit code, stderr) of the command; ctrl_c > 0: SIGINT to its process group (a terminal's
    Ctrl-C) once metrics.jsonl has that many rows. A hang counts as a failure (exit "timeout"; it is
    killed)."""
    # so Ctrl-C reaches it even when this script is a shell's background job (which ignores SIGINT)
    default_sigint = lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)  # noqa: E731
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=default_sigint,
    )
    reader = ThreadPoolExecutor(1).submit(proc.stderr.read)  # a full pipe must not stall the run
    deadline = time.monotonic() + timeout
    metrics = run_dir / "metrics.jsonl"
    while ctrl_c and proc.poll() is None and time.monotonic() < deadline:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= ctrl_c:
            os.killpg(proc.pid, signal.SIGINT)
            break
        time.sleep(0.1)
    try:
        code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        code = "timeout"
    return code, reader.result(timeout=60)


def one_run(i: int, malloc: str, opts: dict, out: Path) -> dict:
    """Run the command once; what ended it (None: it finished)."""
    env = {
        **os.environ,
        "PYTHONFAULTHANDLER": "1",
        "GPTLAB_KEEP_FREED_MEMORY": "1" if malloc == "on" else "0",
    }
    env.pop("HYDRA_FULL_ERROR", None)
    cmd = command(out / f"run_{i}_{malloc}", opts)
    t0 = time.perf_counter()
    code, err = run(
        cmd, out, env, float(opts["timeout"]), int(opts["ctrl_c"]), out / f"run_{i}_{malloc}"
    )
    found = [next(g for g in m.groups() if g) for m in FATAL.finditer(err)]
    # after a Ctrl-C, exit 0 (a stop with a checkpoint) or 130 (interrupted) is a clean end
    failed = code not in ((0, 130) if int(opts["ctrl_c"]) else (0,)) or bool(found)
    if failed:
        (out / f"failed_{i}_{malloc}.txt").write_text(f"exit code {code}\n{' '.join(cmd)}\n\n{err}")
    return {"run": i, "malloc": malloc, "exit": code, "fatal": found, "failed": failed,
            "seconds": round(time.perf_counter() - t0, 1)}  # fmt: skip


def main(argv) -> None:
    opts = {"runs": "40", "steps": "150", "strategy": "fsdp", "malloc": "both", "out": "",
            "timeout": "300", "model": "gpt_nano", "mlflow": "false", "ctrl_c": "0",
            "data": str(os.environ.get("GPTLAB_SHAKESPEARE") or SHAKESPEARE)}  # fmt: skip
    opts.update(a.split("=", 1) for a in argv)
    out = Path(opts["out"] or tempfile.mkdtemp(prefix="gptlab_stress_"))
    out.mkdir(parents=True, exist_ok=True)
    kinds = ["on", "off"] if opts["malloc"] == "both" else [opts["malloc"]]
    runs = []
    for i in range(int(opts["runs"])):
        runs.append(one_run(i, kinds[i % len(kinds)], opts, out))
        print(json.dumps(runs[-1]), file=sys.stderr, flush=True)  # progress, one line a run
    summary = {k: opts[k] for k in ("steps", "strategy", "model", "mlflow", "ctrl_c")}
    summary["out"] = str(out)
    for kind in kinds:
        mine = [r for r in runs if r["malloc"] == kind]
        bad = [r for r in mine if r["failed"]]
        summary[f"malloc_{kind}"] = {
            "runs": len(mine),
            "failed": len(bad),
            "failures": [{"run": r["run"], "exit": r["exit"], "fatal": r["fatal"]} for r in bad],
            "mean_s": round(sum(r["seconds"] for r in mine) / max(1, len(mine)), 1),
        }
    print(json.dumps(summary))


if __name__ == "__main__":
    main(sys.argv[1:])
