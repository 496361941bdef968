#!/usr/bin/env bash
# launch/gpu_check.sh [OUT.json]: the GPU fast paths measured in under 5 minutes on one H100 / H200.
#
# Benchmarks, with the planner's prediction beside each measurement:
#   gpt2_124m  - GPT-2 small's shape, bf16 autocast, torch.compile, flash attention, fused AdamW
#   gpt1b      - the 1.01B reference model, 2048 context, micro-batch 8, activation checkpointing
#   gpt2_124m_fsdp - gpt2_124m again under parallelism=fsdp in a world of one (FSDP2's gathers, bf16
#                parameters for compute with fp32 master weights and reductions, per-block compile)
#   gpt2_124m_muon - gpt2_124m with optimizer=muon (bf16 Newton-Schulz on the blocks' matrices, and its weight average): its step
#                time beside gpt2_124m's AdamW step
# then the chunked loss (benchmarks/chunked_loss.py: one step's peak memory and time with the whole
# logits and in 1024-token chunks, gpt2_124m, vocabulary 50,304, micro-batch 16 x 1024, bf16), then
# the tuning ladder (python -m gptlab.bench bench.ladder=true on gpt2_124m: each speed lever from
# plain fp32 on, every rung its own benchmark),
# and writes one JSON file (default outputs/gpu_check.json): the device, torch, and per model the
# `gptlab.bench` JSON line, the `gptlab.plan plan.json=true` prediction, and any error.
#
# The machine needs no network: the text is Tiny Shakespeare if found (GPTLAB_SHAKESPEARE, shared/data/,
# ../shared/data/), else generated, and tokenized by characters (the benchmark times the model;
# a 65-symbol vocabulary makes the LM head smaller than GPT-2's 50,257, which the FLOP count follows).
#
# Settings (environment):
#   GPU_CHECK_HARDWARE   hardware overrides (default "hardware=h200"; for an H100: "hardware=h100x8
#                        hardware.nproc_per_node=1"); the CPU test uses "hardware=cpu"
#   GPU_CHECK_SHRINK     overrides added to every run (the CPU test shrinks the models with them)
#   GPU_CHECK_WARMUP / GPU_CHECK_STEPS   bench steps (default 3 warm-up, 10 timed)
#   GPU_CHECK_TIMEOUT    seconds per bench (default 200)
#   GPU_CHECK_GPT1B_COMPILE  compile the 1B model too (default false: compiling it costs ~1-2 minutes)
#   GPU_CHECK_CHUNKED    benchmarks/chunked_loss.py's arguments (default "model=gpt2_124m batch=16
#                        device=cuda precision=bf16"; the CPU test shrinks it)
#   GPU_CHECK_LADDER     the ladder's overrides (default "model=gpt2_124m train.batch_size=16
#                        optimizer=adamw"; "off" skips it)
#   GPU_CHECK_LADDER_TIMEOUT  seconds for the whole ladder (default 900)
#   PYTHON               the interpreter (default .venv/bin/python if present, else python3)
set -uo pipefail
cd "$(dirname "$0")/.."

OUT_JSON=${1:-outputs/gpu_check.json}
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
HW=${GPU_CHECK_HARDWARE:-hardware=h200}
SHRINK=${GPU_CHECK_SHRINK:-}
WARMUP=${GPU_CHECK_WARMUP:-3}
STEPS=${GPU_CHECK_STEPS:-10}
TIMEOUT=${GPU_CHECK_TIMEOUT:-200}
GPT1B_COMPILE=${GPU_CHECK_GPT1B_COMPILE:-false}
CHUNKED=${GPU_CHECK_CHUNKED:-model=gpt2_124m batch=16 device=cuda precision=bf16}
LADDER=${GPU_CHECK_LADDER:-model=gpt2_124m train.batch_size=16 optimizer=adamw}
LADDER_TIMEOUT=${GPU_CHECK_LADDER_TIMEOUT:-900}

WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
export GPTLAB_CACHE_DIR=${GPTLAB_CACHE_DIR:-$WORK/cache}
export PYTHONUNBUFFERED=1

# Text to train on, offline.
TEXT=""
for f in "${GPTLAB_SHAKESPEARE:-}" shared/data/tinyshakespeare.txt ../shared/data/tinyshakespeare.txt; do
  if [ -n "$f" ] && [ -f "$f" ]; then TEXT=$(cd "$(dirname "$f")" && pwd)/$(basename "$f"); break; fi
done
if [ -z "$TEXT" ]; then
  TEXT=$WORK/text.txt
  "$PY" - "$TEXT" <<'EOF'
import random, sys
random.seed(0)
words = ["the", "king", "queen", "lord", "love", "death", "night", "day", "speak", "thou", "art", "my", "heart",
         "and", "to", "of", "what", "sweet", "good", "noble", "blood", "crown", "fair", "war", "peace"]
lines = [" ".join(random.choice(words) for _ in range(random.randint(4, 12))).capitalize() + "." for _ in range(40000)]
open(sys.argv[1], "w").write("\n".join(lines) + "\n")
EOF
fi

COMMON="data=shakespeare_char data.path=$TEXT tracking.mlflow=false"

# name | overrides (the planner and the benchmark see the same ones)
run_one() {
  local name=$1; shift
  local args="$HW $COMMON $* $SHRINK"
  echo "== $name: $args" >&2
  # shellcheck disable=SC2086
  "$PY" -m gptlab.plan plan.json=true $args >"$WORK/$name.plan" 2>"$WORK/$name.plan.err"
  # shellcheck disable=SC2086
  timeout "$TIMEOUT" "$PY" -m gptlab.bench "bench.warmup=$WARMUP" "bench.steps=$STEPS" $args \
    "hydra.run.dir=$WORK/runs/$name" >"$WORK/$name.bench" 2>"$WORK/$name.bench.err"
  echo "$?" >"$WORK/$name.rc"
  tail -n 1 "$WORK/$name.bench" >&2
}

T0=$(date +%s)
# AdamW unless named (the root default, muon with a weight average, is the CPU char job's)
run_one gpt2_124m model=gpt2_124m train.batch_size=16 train.micro_batch_size=16 \
  hardware.precision=bf16 hardware.compile=true optimizer=adamw optimizer.fused=true
run_one gpt1b model=gpt1b model.block_size=2048 parallelism=ddp parallelism.activation_checkpointing=true \
  train.batch_size=8 train.micro_batch_size=8 hardware.precision=bf16 hardware.compile=$GPT1B_COMPILE \
  optimizer=adamw optimizer.fused=true
run_one gpt2_124m_fsdp model=gpt2_124m parallelism=fsdp parallelism.activation_checkpointing=false \
  train.batch_size=16 train.micro_batch_size=16 hardware.precision=bf16 hardware.compile=true optimizer=adamw \
  optimizer.fused=true
run_one gpt2_124m_muon model=gpt2_124m train.batch_size=16 train.micro_batch_size=16 \
  hardware.precision=bf16 hardware.compile=true optimizer=muon
echo "== chunked loss: $CHUNKED" >&2
# shellcheck disable=SC2086
timeout "$TIMEOUT" "$PY" benchmarks/chunked_loss.py $CHUNKED >"$WORK/chunked_loss.out" 2>"$WORK/chunked_loss.err"
tail -n 1 "$WORK/chunked_loss.out" >&2
if [ "$LADDER" != "off" ]; then
  echo "== ladder: $HW $LADDER $SHRINK" >&2
  # shellcheck disable=SC2086
  timeout "$LADDER_TIMEOUT" "$PY" -m gptlab.bench bench.ladder=true "bench.warmup=$WARMUP" \
    "bench.steps=$STEPS" $HW $COMMON $LADDER $SHRINK "hydra.run.dir=$WORK/runs/ladder" \
    >"$WORK/ladder.out" 2>"$WORK/ladder.err"
  grep -v '^{' "$WORK/ladder.out" >&2
fi
T1=$(date +%s)

mkdir -p "$(dirname "$OUT_JSON")"
"$PY" - "$WORK" "$OUT_JSON" "$((T1 - T0))" gpt2_124m gpt1b gpt2_124m_fsdp gpt2_124m_muon <<'EOF'
import json, sys
from pathlib import Path

work, out, seconds, names = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]

def last_json(path):
    for line in reversed(path.read_text().strip().splitlines() if path.exists() else []):
        try:
            return json.loads(line)
        except ValueError:
            continue
    return None

def tail(path, n=8):
    return "\n".join(path.read_text().strip().splitlines()[-n:]) if path.exists() else ""

try:
    import torch
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    torch_version = torch.__version__
except Exception as e:  # noqa: BLE001
    device, torch_version = f"unknown ({e})", None

report = {"device": device, "torch": torch_version, "wall_s": seconds, "runs": {}}
for name in names:
    bench, plan = last_json(work / f"{name}.bench"), last_json(work / f"{name}.plan")
    rc = int((work / f"{name}.rc").read_text().strip() or 1)
    entry = {"ok": rc == 0 and bench is not None, "bench": bench, "plan": plan}
    if bench and plan:
        entry["measured_vs_plan"] = {
            "peak_mem_bytes": bench["peak_mem_bytes"], "plan_mem_bytes": plan["memory"]["total"],
            "mem_ratio": round(bench["peak_mem_bytes"] / plan["memory"]["total"], 3),
            "tokens_per_s": bench["tokens_per_s"], "plan_tokens_per_s": plan.get("expected_tokens_per_s"),
            "mfu": bench["mfu"], "hfu": bench["hfu"], "plan_mfu": plan.get("expected_mfu"),
        }
    if not entry["ok"]:
        entry["error"] = tail(work / f"{name}.bench.err") or f"exit code {rc}"
    if plan is None:
        entry["plan_error"] = tail(work / f"{name}.plan.err", 2)
    report["runs"][name] = entry
chunked = last_json(work / "chunked_loss.out")
report["chunked_loss"] = chunked or {"error": tail(work / "chunked_loss.err")}
ladder = last_json(work / "ladder.out")
if (work / "ladder.out").exists() or (work / "ladder.err").exists():
    report["ladder"] = ladder or {"error": tail(work / "ladder.err")}
out.write_text(json.dumps(report, indent=1) + "\n")
ok = all(r["ok"] for r in report["runs"].values()) and chunked is not None
ok = ok and (ladder is not None or "ladder" not in report)
print(json.dumps({"written": str(out), "ok": ok, "wall_s": seconds}))
sys.exit(0 if ok else 1)
EOF
