#!/usr/bin/env bash
# benchmarks/fastpath_figures.sh width|compile|attention [DATA]: the measurements behind
# gptlab/perf/fastpath.py's rules (docs/measurements/2026-12-03-fastpath.md). One line per benchmark:
# the setting, tokens/s and the median step in ms (plus the process's wall time for `compile`).
#   width      bf16 against fp32 by model width (6 layers, 256 context, batch 8), alternating
#   compile    compile's cost (a new process each, cold then warm inductor cache) and its saving
#   attention  gpt_char: precision x attention path, three alternating rounds
# Not a test: speed is measured, never asserted.
set -uo pipefail
cd "$(dirname "$0")/.."
WHAT=${1:?width, compile or attention}
DATA=${2:-../shared/data/tinyshakespeare.txt}
PY=${PYTHON:-.venv/bin/python}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

bench() {  # label, overrides...: one line
  local label=$1; shift
  local t0 t1 out
  t0=$(date +%s.%N)
  out=$("$PY" -m gptlab.bench "$@" "data.path=$DATA" "hydra.run.dir=$WORK/$RANDOM$RANDOM" 2>/dev/null | tail -n 1)
  t1=$(date +%s.%N)
  echo "$label $(echo "$out" | "$PY" -c 'import json,sys; d=json.loads(sys.stdin.read()); print(d["tokens_per_s"], d["step_ms"])') wall_s=$("$PY" -c "print(round($t1 - $t0, 1))")"
}

case $WHAT in
  width)
    for w in 128 192 256 384 512; do
      for p in fp32 bf16 bf16 fp32; do
        bench "width=$w $p" model.n_layer=6 model.n_embd=$w model.n_head=4 model.block_size=256 \
          train.batch_size=8 hardware.precision=$p hardware.compile=false bench.warmup=3 bench.steps=10
      done
    done ;;
  compile)
    baby="model.n_layer=6 model.n_embd=384 model.n_head=6 model.block_size=256 train.batch_size=8 hardware.precision=bf16"
    for model in char baby; do
      args=""; [ "$model" = baby ] && args=$baby
      export TORCHINDUCTOR_CACHE_DIR=$WORK/inductor-$model
      for run in eager:false cold:true warm:true eager:false warm:true; do
        # shellcheck disable=SC2086
        bench "$model ${run%%:*}" $args hardware.compile=${run##*:} bench.warmup=3 bench.steps=20
      done
    done ;;
  attention)
    for round in 1 2 3; do
      for p in fp32 bf16; do for a in auto math; do
        bench "round=$round $p attention=$a" hardware.precision=$p hardware.attention_backend=$a \
          hardware.compile=false bench.warmup=10 bench.steps=120
      done; done
    done ;;
  *) echo "benchmarks/fastpath_figures.sh: error: width, compile or attention, not $WHAT" >&2; exit 2 ;;
esac
