#!/usr/bin/env bash
# launch/gpu_wheels.sh: download into .whl/ (git-ignored) the wheels of the Python packages that a
# lent GPU machine lacks, for launch/gpu_check.sh to install there (docs/speed.md, "GPU check").
#
# That machine has Python 3.12, torch, numpy, PyYAML, packaging, cloudpickle, typing_extensions,
# psutil, matplotlib and safetensors (/work/.library/device/KINDS.md) but not Hydra: gptlab.bench,
# .plan, .train and .sample need hydra-core, omegaconf and antlr4-python3-runtime (their
# dependencies beyond that list), and gptlab.distributed.slurm and Hydra's launcher plugin need submitit and
# hydra-submitit-launcher. All are pure Python (py3-none-any); antlr4-python3-runtime 4.9.3 exists
# only as a source archive, so pip builds its wheel here. Run it where pip reaches the registry:
#     bash launch/gpu_wheels.sh        # then: the device run with carry=[".whl"]
# The versions are the ones this checkout's interpreter has (PYTHON, default .venv/bin/python),
# so the GPU runs what the tests run; without it, the pins below.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
declare -A PINS=(
  [hydra-core]=1.3.8
  [omegaconf]=2.3.1
  [antlr4-python3-runtime]=4.9.3
  [submitit]=1.5.4
  [hydra-submitit-launcher]=1.2.0
)
SPECS=()
for name in hydra-core omegaconf antlr4-python3-runtime submitit hydra-submitit-launcher; do
  version=$("$PY" -c 'import importlib.metadata as m, sys; print(m.version(sys.argv[1]))' "$name" \
    2>/dev/null || echo "${PINS[$name]}")
  SPECS+=("$name==$version")
done

rm -rf .whl
mkdir -p .whl
# a wheel for Python 3.12 on x86-64 Linux where the registry has one; the one source-only package is
# built here (pure Python, so the wheel is the same for every interpreter)
for spec in "${SPECS[@]}"; do
  if ! "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "$spec" 2>/dev/null; then
    "$PY" -m pip wheel -q --no-deps -w .whl "$spec"
  fi
done
# one version of each: two would stop the whole install there
ls .whl
du -ch .whl/*.whl | tail -n 1
grep -qsx '/.whl/' .git/info/exclude || { mkdir -p .git/info && echo '/.whl/' >>.git/info/exclude; }
