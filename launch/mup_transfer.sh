#!/usr/bin/env bash
# launch/mup_transfer.sh [--cpu]: the lr transfer check of docs/mup.md in one command: a width x lr
# grid (conf/hparams_search/lr_transfer.yaml) under the standard parametrization and under muP,
# with each optimizer, then each width's best lr and the drift (best lr at the widest / at the
# narrowest; 1: the lr transfers) as one table at the end, and a compare_transfer.png per sweep.
#
#   bash launch/mup_transfer.sh          # one GPU (hardware=h200): widths 64, 256, 512 x 7 lrs,
#                                        # 500 steps, AdamW and Muon: the 4 sweeps run side by side
#                                        # on the one GPU; 84 runs of ~2M tokens, expected
#                                        # under 5 minutes on an H200 (not yet measured there)
#   bash launch/mup_transfer.sh --cpu    # this CPU, small: widths 64, 256, 512 x 6 lrs, 150
#                                        # steps, 2 layers, AdamW, one sweep at a time: about 9
#                                        # minutes on 2 cores; MUP_TRANSFER_OPTIMIZERS="adamw muon"
#                                        # adds Muon's two sweeps, about 35 minutes more (measured
#                                        # 2026-12-05: docs/measurements/2026-12-05-mup-transfer.md)
#
# Settings (environment): MUP_TRANSFER_HARDWARE (default "hardware=h200 hardware.compile=false":
# compiling each of the runs would cost more than it saves), MUP_TRANSFER_OPTIMIZERS ("adamw muon"),
# MUP_TRANSFER_WIDTHS, MUP_TRANSFER_LRS, MUP_TRANSFER_STEPS, MUP_TRANSFER_EXTRA (more overrides),
# MUP_TRANSFER_OUT (the folder of the sweeps and the table; default $OUT where the device tool sets
# it, else outputs/mup_transfer). Text: $GPTLAB_SHAKESPEARE or shared/data/tinyshakespeare.txt, else
# outputs/data/tinyshakespeare.txt (a copy the device call carries: carry=["outputs/data", ".whl"]),
# else the data config's download. A lent GPU machine without Hydra installs .whl/ (gpu_wheels.sh).
#
# On a lent GPU machine (no Hydra, no network): here `bash launch/gpu_wheels.sh` and
# `mkdir -p outputs/data && cp ../shared/data/tinyshakespeare.txt outputs/data/`, then the device
# call `bash launch/mup_transfer.sh` with carry [".whl", "outputs/data"] and timeout_s 600.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1

if [ "${1:-}" = "--cpu" ]; then
  HW=${MUP_TRANSFER_HARDWARE:-hardware=cpu hardware.threads=1}
  OPTIMIZERS=${MUP_TRANSFER_OPTIMIZERS:-adamw}
  WIDTHS=${MUP_TRANSFER_WIDTHS:-64,256,512}
  LRS=${MUP_TRANSFER_LRS:-6e-4,2e-3,6e-3,2e-2,6e-2,2e-1}  # x3.3 apart; Muon's optimum is near 6e-2
  STEPS=${MUP_TRANSFER_STEPS:-150}
  SHAPE="model.n_layer=2 model.block_size=32 train.batch_size=8 train.eval_every=50 \
train.eval_steps=5 train.eval_batch_size=32"
  PARALLEL=0  # two cores: one sweep at a time
else
  HW=${MUP_TRANSFER_HARDWARE:-hardware=h200 hardware.compile=false}
  OPTIMIZERS=${MUP_TRANSFER_OPTIMIZERS:-adamw muon}
  WIDTHS=${MUP_TRANSFER_WIDTHS:-64,256,512}
  LRS=${MUP_TRANSFER_LRS:-5e-4,1e-3,2e-3,4e-3,8e-3,1.6e-2,3.2e-2}
  STEPS=${MUP_TRANSFER_STEPS:-500}
  SHAPE="train.batch_size=64 train.eval_every=100 train.eval_steps=10 tracking.plots=false"
  PARALLEL=1  # small models leave the GPU mostly idle: the sweeps share it
fi
STAMP=$(date +%Y-%m-%d_%H-%M-%S)
BASE=${WIDTHS%%,*}  # muP's base width: the narrowest, where muP is the standard form
OUT_DIR=${MUP_TRANSFER_OUT:-${OUT:-$REPO/outputs/mup_transfer}}
mkdir -p "$OUT_DIR"

if ! "$PY" -c "import hydra, omegaconf" 2>/dev/null; then
  if compgen -G ".whl/*.whl" >/dev/null; then
    SITE=${MUP_TRANSFER_SITE:-/tmp/site}
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$SITE" .whl/*.whl || exit 1
    export PYTHONPATH=$SITE:$PYTHONPATH
  else
    echo "mup_transfer: hydra does not import and there is no .whl/ (run launch/gpu_wheels.sh)" >&2
    exit 1
  fi
fi
DATA=""
for f in "${GPTLAB_SHAKESPEARE:-}" shared/data/tinyshakespeare.txt ../shared/data/tinyshakespeare.txt \
  outputs/data/tinyshakespeare.txt; do
  if [ -n "$f" ] && [ -f "$f" ]; then DATA="data.path=$(cd "$(dirname "$f")" && pwd)/$(basename "$f")"; break; fi
done
# MLflow only where it imports (a lent GPU machine has none): the run folders hold every figure
TRACK=tracking.mlflow=false
if "$PY" -c "import mlflow" 2>/dev/null; then TRACK=tracking.mlflow=true; fi

sweep() {  # sweep PARAMETRIZATION OPTIMIZER: one grid, its log in $OUT_DIR
  # shellcheck disable=SC2086  # the override lists split into words on purpose
  "$PY" -m gptlab.train -m hparams_search=lr_transfer "optimizer=$2" "model.parametrization=$1" \
    "model.mup_base_width=$BASE" "model.n_embd=$WIDTHS" "optimizer.lr=$LRS" \
    "train.max_steps=$STEPS" $SHAPE $HW $DATA $TRACK "paths.outputs=$OUT_DIR" \
    "hydra.sweep.dir=$OUT_DIR/sweeps/lr_transfer-$1-$2-$STAMP" ${MUP_TRANSFER_EXTRA:-} \
    >"$OUT_DIR/$1-$2.log" 2>&1
  echo "mup_transfer: $1 $2 exit $? ($(date +%T)), log $OUT_DIR/$1-$2.log"
}

echo "mup_transfer: widths $WIDTHS, lrs $LRS, $STEPS steps, $OPTIMIZERS; $HW; into $OUT_DIR"
# shellcheck disable=SC2086  # tokenize once, before the sweeps that run side by side read it
"$PY" -m gptlab.prepare $DATA >"$OUT_DIR/prepare.log" 2>&1 || echo "mup_transfer: prepare failed"
for o in $OPTIMIZERS; do
  for p in standard mup; do
    if [ "$PARALLEL" = 1 ]; then sweep "$p" "$o" & else sweep "$p" "$o"; fi
  done
done
wait

# each sweep's table and compare_transfer.png; then the drift table
for o in $OPTIMIZERS; do
  for p in standard mup; do
    s=$(ls -d "$OUT_DIR"/sweeps/lr_transfer-"$p"-"$o"-* 2>/dev/null | tail -1)
    [ -n "$s" ] || { echo "mup_transfer: no sweep of $p $o"; continue; }
    "$PY" -m gptlab.compare "$s" compare.json="$OUT_DIR/transfer-$p-$o.json" \
      >"$OUT_DIR/compare-$p-$o.txt" 2>&1 || echo "mup_transfer: compare of $s failed (see $OUT_DIR/compare-$p-$o.txt)"
  done
done
"$PY" - "$OUT_DIR" $OPTIMIZERS <<'EOF'
import json, sys
from pathlib import Path

out, optimizers = Path(sys.argv[1]), sys.argv[2:]
print(f"\n{'optimizer':<10} {'parametrization':<16} {'best lr per width':<44} drift")
for o in optimizers:
    for p in ("standard", "mup"):
        path = out / f"transfer-{p}-{o}.json"
        doc = json.loads(path.read_text()) if path.is_file() else {}
        for t in doc.get("transfer") or [{}]:
            best = " ".join(f"{w}:{lr:.3g}" for w, lr in (t.get("best_lr") or {}).items()) or "-"
            edge = " (at the grid's edge: " + ",".join(map(str, t["at_edge"])) + ")" if t.get("at_edge") else ""
            drift = f"{t['drift']:.3g}" if t.get("drift") is not None else "-"
            print(f"{o:<10} {p:<16} {best:<44} {drift}{edge}")
EOF
