"""model.init_from's cost for GPT-2 small: load time and peak memory on this machine.

A Hugging Face GPT-2 folder of the default GPT2Config() (124M, random weights: the Hub is not
needed) is saved once; then, in a fresh process, the time read_source + building gptlab's GPT +
load_into take and the process's peak RSS.

    .venv/bin/python benchmarks/init_from.py [folder]

Name the folder and run it twice: Linux keeps a process's peak RSS across exec, so the run that
saves the folder reports the saving's peak too. Measured (2 shared cores, 2026): build 13.4 s,
load_into 1.1 s, peak RSS 1,176 MiB (956 MiB above the imports: the model and the source's tensors).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

MEASURE = """
import dataclasses, resource, sys, time
from pathlib import Path
import torch
from gptlab.model import pretrained
from gptlab.model.config import GPTConfig
from gptlab.model.gpt import GPT
folder = Path(sys.argv[1])
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = time.perf_counter()
source = pretrained.read_source(str(folder), folder)
shape = dict(name="gpt2", vocab_multiple=64, dropout=0.0, rope_base=1e4, **source.shape)
model = GPT(GPTConfig(**{**shape, "vocab_size": 50257}))
built = time.perf_counter()
pretrained.load_into(model, source)
done = time.perf_counter()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(f"{model.num_params() / 1e6:.1f}M params: build {built - start:.2f} s, load_into "
      f"{done - built:.2f} s, total {done - start:.2f} s; peak RSS {peak / 1024:.0f} MiB "
      f"({(peak - base) / 1024:.0f} MiB above the imports)")
"""


def main() -> None:
    folder = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp()) / "gpt2"
    if not (folder / "config.json").is_file():
        from transformers import GPT2Config, GPT2LMHeadModel

        start = time.perf_counter()
        GPT2LMHeadModel(GPT2Config()).save_pretrained(folder)
        print(f"saved a random 124M GPT-2 in {time.perf_counter() - start:.1f} s: {folder}")
    subprocess.run([sys.executable, "-c", MEASURE, str(folder)], check=True)


if __name__ == "__main__":
    main()
