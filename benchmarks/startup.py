"""How fast each command answers when it has nothing heavy to do: --help, --cfg job, config errors.

    python benchmarks/startup.py [repeats=3]

Runs each command `repeats` times in a fresh interpreter (this one's) and prints a Markdown table of
the best CPU seconds (user + sys of the child) and wall seconds. Not a test: the figures depend on
the machine and its load; tests/system/test_startup.py holds that none of these imports torch,
MLflow or Optuna.
"""

from __future__ import annotations

import resource
import subprocess
import sys
import tempfile
import time

COMMANDS = [
    ("gptlab.train --help", ""),
    ("gptlab.train --cfg job", ""),
    ("gptlab.train model.nlayer=3", "a typo'd key"),
    ("gptlab.train model=gpt3", "a wrong group choice"),
    ("gptlab.train --lr 1e-3", "a flag instead of a key"),
    ("gptlab.train optimizer.lr=abc", "a bad value"),
    ("gptlab.plan --help", ""),
    ("gptlab.sync --help", ""),
    ("gptlab.eval --help", ""),
    ("gptlab.sample --help", ""),
    ("gptlab.compare --help", ""),
    ("gptlab.ui --help", ""),
    ("gptlab.bench --help", ""),
]


def best_of(args: list, repeats: int, cwd: str) -> tuple:
    """(best CPU seconds, best wall seconds) of `python -m args` over repeats runs."""
    cpu, wall = float("inf"), float("inf")
    for _ in range(repeats):
        before, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
        subprocess.run([sys.executable, "-m", *args], capture_output=True, cwd=cwd)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        wall = min(wall, time.perf_counter() - t0)
        cpu = min(cpu, after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
    return cpu, wall


def main() -> None:
    repeats = int(next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("repeats=")), 3))
    print("| command | CPU s | wall s |\n| --- | --- | --- |")
    with tempfile.TemporaryDirectory() as cwd:  # commands that write would write here
        for command, what in COMMANDS:
            cpu, wall = best_of(command.split(), repeats, cwd)
            label = f"`python -m {command}`" + (f" ({what})" if what else "")
            print(f"| {label} | {cpu:.2f} | {wall:.2f} |", flush=True)


if __name__ == "__main__":
    main()
