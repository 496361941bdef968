#!/usr/bin/env bash
# launch/gpu_check.sh [--cpu] [OUT.json]: what only a GPU can show, on one H100 / H200, in one
# command that ends inside its budget (default 450 s, so a lent machine's 8 minutes hold it).
#
# Steps, in this order (a step that the budget left cannot hold is skipped, and says why):
#   wheels        installs .whl/*.whl into $GPU_CHECK_SITE (/tmp/site) when hydra, omegaconf or
#                 submitit do not import (a lent machine has torch but not them: launch/gpu_wheels.sh
#                 downloads them here, and the device call carries .whl)
#   env           the device, torch, CUDA, the driver and the packages' versions
#   gpt2_124m     gptlab.bench: GPT-2 small, bf16, torch.compile, fused AdamW; MFU, tokens/s and the
#                 peak memory beside the planner's (the bench prints both)
#   gpt1b         gptlab.bench: the 1.01B reference model, 2048 context, micro-batch 8, activation
#                 checkpointing, parallelism=ddp under torchrun (a world of one: NCCL and DDP's
#                 wrapper), no compile; its
#                 peak memory beside the planner's and the reference run's 27.66 GB
#   train         gptlab.train: a real run of gpt_char on the preset (bf16, its attention,
#                 Muon with its weight average), through two evaluations and two checkpoints, and
#                 its sample under the preset's attention
#   train_resume  the same command with more train.max_steps: resumes from the checkpoint
#   sample        gptlab.sample from that run folder on the device, with the attention maps
#   fp16          gptlab.train in fp16 (the GradScaler), AdamW, a checkpoint
#   fp16_resume   resumes it (the scaler's state comes back from the checkpoint)
#   fsdp          gptlab.bench of gpt2_124m under parallelism=fsdp, started by torchrun with one
#                 process: NCCL's process group, FSDP2's gathers, per-block compile
#   chunked_loss  benchmarks/chunked_loss.py: one step's peak with the whole logits and chunked
#   gpt2_124m_muon  gptlab.bench of gpt2_124m with optimizer=muon
#   gpt2_124m_stop  gpt2_124m's bench with train.on_divergence=stop: what the per-step check of
#                 the default rollback (one host sync a step) costs
#   ckpt_sync     gptlab.train of gpt2_124m saving a checkpoint every 2 steps: the stall per save
#   ckpt_async    the same with train.checkpoint_async=true (the save written in the background)
#   rollback      gptlab.train of gpt_char with a NaN loss injected at step 7 (train.faults): the
#                 rollback to the last good state, on the device
#   restart       torchrun --max-restarts=1 of gpt_char whose rank dies at step 12: the restart
#                 from the step-10 checkpoint, recorded in results.json
#   ladder        the tuning ladder (gptlab.bench bench.ladder=true): off unless GPU_CHECK_LADDER
#                 names its overrides; it gets what is left of the budget
#
# The JSON (default $OUT/gpu_check.json where the device tool sets $OUT, else
# outputs/gpu_check.json, or the path given) is rewritten whole (a temporary file, then mv) before
# and after every step, so a run killed from outside still returns what it measured: per step its
# status (ok | failed | timed_out | skipped | running | pending), exit code, seconds, the timeout
# it ran under, the budget left when it began, its result, and the end of its log. Every step's
# output goes to one log beside it (gpu_check.log). Exit code 0 when no step failed or timed out.
#
# --cpu: the same steps on the CPU with every model shrunk (hardware=cpu, fp32, no compile, gloo),
# a dry run of this script that CI runs (tests/system/test_gpu_check.py); budget 480 s.
#
# The machine needs no network: the text is Tiny Shakespeare if found (GPTLAB_SHAKESPEARE,
# shared/data/, ../shared/data/), else generated, tokenized by characters.
#
# Settings (environment):
#   GPU_CHECK_BUDGET     seconds for the whole script (default 450; --cpu: 480)
#   GPU_CHECK_ONLY       comma-separated steps to run (the others are recorded as skipped);
#                        wheels and env always run
#   GPU_CHECK_TIMEOUTS   per-step timeouts in seconds over the defaults, e.g. "gpt1b=60,fsdp=90"
#   GPU_CHECK_TIMEOUT_SCALE  a whole number the default timeouts are multiplied by (default 1; the
#                        test suite's dry run, on a machine other tests share, uses 3)
#   GPU_CHECK_HARDWARE   hardware overrides (default "hardware=h200"; for an H100: "hardware=h100x8
#                        hardware.nproc_per_node=1")
#   GPU_CHECK_SHRINK     overrides added last to every run (--cpu: the small shapes)
#   GPU_CHECK_WARMUP / GPU_CHECK_STEPS   bench steps (default 2 warm-up, 6 timed)
#   GPU_CHECK_GPT1B_COMPILE  compile the 1B model too (default false: ~1-2 minutes more)
#   GPU_CHECK_CHUNKED    benchmarks/chunked_loss.py's arguments
#   GPU_CHECK_LADDER     the ladder's overrides, e.g. "model=gpt2_124m train.batch_size=16
#                        optimizer=adamw" (default off)
#   GPU_CHECK_SITE       where the wheels are installed (default /tmp/site)
#   GPU_CHECK_KEEP       1: keep the temporary folder of run folders and checkpoints
#   PYTHON               the interpreter (default .venv/bin/python if present, else python3)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
REPO=$(pwd)
T_START=$(date +%s)

CPU=0
OUT_JSON=""
for arg in "$@"; do
  case $arg in
    --cpu) CPU=1 ;;
    -h | --help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) OUT_JSON=$arg ;;
  esac
done
if [ -z "$OUT_JSON" ]; then
  if [ -n "${OUT:-}" ]; then OUT_JSON=$OUT/gpu_check.json; else OUT_JSON=outputs/gpu_check.json; fi
fi
mkdir -p "$(dirname "$OUT_JSON")"
OUT_JSON=$(cd "$(dirname "$OUT_JSON")" && pwd)/$(basename "$OUT_JSON")
LOG=${OUT_JSON%.json}.log
: >"$LOG"

PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi

if [ "$CPU" = 1 ]; then
  MODE=cpu
  BUDGET=${GPU_CHECK_BUDGET:-480}
  HW=${GPU_CHECK_HARDWARE:-hardware=cpu}
  SHRINK=${GPU_CHECK_SHRINK-model.n_layer=1 model.n_embd=32 model.n_head=2 model.block_size=32 \
model.ffn_dim=null train.batch_size=2 train.micro_batch_size=2 hardware.threads=1}
  FAST="hardware.precision=fp32 hardware.compile=false optimizer.fused=false"
  DEVICE=cpu
  CHUNKED=${GPU_CHECK_CHUNKED:-model=gpt_nano batch=2 vocab=5000 chunk=16 device=cpu steps=1}
else
  MODE=gpu
  BUDGET=${GPU_CHECK_BUDGET:-450}
  HW=${GPU_CHECK_HARDWARE:-hardware=h200}
  SHRINK=${GPU_CHECK_SHRINK:-}
  FAST="hardware.precision=bf16 hardware.compile=true optimizer.fused=true"
  DEVICE=cuda
  CHUNKED=${GPU_CHECK_CHUNKED:-model=gpt2_124m batch=16 device=cuda precision=bf16}
fi
WARMUP=${GPU_CHECK_WARMUP:-2}
STEPS=${GPU_CHECK_STEPS:-6}
GPT1B_COMPILE=${GPU_CHECK_GPT1B_COMPILE:-false}
LADDER=${GPU_CHECK_LADDER:-off}
ONLY=${GPU_CHECK_ONLY:-}
TIMEOUTS=${GPU_CHECK_TIMEOUTS:-}
TIMEOUT_SCALE=${GPU_CHECK_TIMEOUT_SCALE:-1}
SITE=${GPU_CHECK_SITE:-/tmp/site}
RESERVE=8  # seconds kept for the last JSON write
GRACE=10   # timeout -k: seconds between TERM and KILL

WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
if [ "${GPU_CHECK_KEEP:-0}" != 1 ]; then trap 'rm -rf "$WORK"' EXIT; fi
export GPTLAB_CACHE_DIR=${GPTLAB_CACHE_DIR:-$WORK/cache}
export PYTHONUNBUFFERED=1
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}  # gptlab and hydra_plugins travel as source

STEP_NAMES=(wheels env gpt2_124m gpt1b train train_resume sample fp16 fp16_resume fsdp chunked_loss
  gpt2_124m_muon gpt2_124m_stop ckpt_sync ckpt_async rollback restart ladder)

# The JSON: one small Python program (no torch import) rewrites it whole after every change.
RECORD_PY=$(cat <<'EOF'
import json, os, sys, time
from pathlib import Path

REFERENCE_GB = 27.66  # conf/experiment/gpt1b_shakespeare.yaml: shared/reference/000's peak per GPU


def save(path, doc):
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, path)


def last_json(path):
    try:
        lines = Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                continue
    return None


def log_tail(log, offset, n=12):
    with open(log, "rb") as f:
        f.seek(int(offset))
        text = f.read().decode(errors="replace")
    return "\n".join(text.strip().splitlines()[-n:])[-3000:]


def ratio(a, b):
    return round(a / b, 3) if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None


def bench_result(name, r):
    r = dict(r)
    r["measured_vs_plan"] = {
        "mfu": r.get("mfu"), "plan_mfu": r.get("plan_mfu"), "hfu": r.get("hfu"),
        "tokens_per_s": r.get("tokens_per_s"), "plan_tokens_per_s": r.get("plan_tokens_per_s"),
        "tokens_per_s_ratio": ratio(r.get("tokens_per_s"), r.get("plan_tokens_per_s")),
        "peak_mem_bytes": r.get("peak_mem_bytes"), "plan_mem_bytes": r.get("plan_mem_bytes"),
        "mem_ratio": ratio(r.get("peak_mem_bytes"), r.get("plan_mem_bytes")),
    }
    if name == "gpt1b" and r.get("peak_mem_bytes"):
        r["measured_vs_reference"] = {
            "peak_gb": round(r["peak_mem_bytes"] / 1e9, 2),
            "peak_gib": round(r["peak_mem_bytes"] / 2**30, 2),
            "reference_peak_gb": REFERENCE_GB,
            "note": "the reference (shared/reference/000) ran DDP over 8 x A100-40GB: its peak "
                    "holds DDP's gradient buckets (4 bytes a parameter), which a world of one has not",
        }
    return r


def train_result(run_dir):
    run_dir = Path(run_dir)
    out = {"run_dir": run_dir.name}
    try:
        res = json.loads((run_dir / "results.json").read_text())
    except (OSError, ValueError):
        return None
    keep = ("steps", "best_val_loss", "val_loss", "tokens_per_s", "wall_s", "stopped_by", "resumed_from",
            "resumed_step", "precision", "compile", "mfu", "peak_mem_bytes", "checkpoint_stall_s",
            "rollbacks", "restarts", "train_loss")
    out["results"] = {k: res[k] for k in keep if k in res} or res
    ckpt = run_dir / "checkpoints"
    out["checkpoints"] = sorted(p.name for p in ckpt.iterdir()) if ckpt.is_dir() else []
    samples = run_dir / "samples.txt"
    out["sample_head"] = samples.read_text(errors="replace")[:160] if samples.is_file() else None
    return out


def main():
    cmd, path = sys.argv[1], Path(sys.argv[2])
    if cmd == "init":
        mode, budget, started, notes, *names = sys.argv[3:]
        doc = {
            "script": "launch/gpu_check.sh", "mode": mode, "budget_s": int(budget),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(int(started))),
            "complete": False, "ok": None, "wall_s": 0, "env": None,
            "notes": [n for n in notes.split("|") if n],
            "steps": {n: {"status": "pending"} for n in names},
        }
        save(path, doc)
        return
    doc = json.loads(path.read_text())
    if cmd == "finish":
        doc["wall_s"] = int(sys.argv[3])
        doc["complete"] = True
        bad = [n for n, s in doc["steps"].items() if s["status"] not in ("ok", "skipped")]
        doc["ok"] = not bad
        save(path, doc)
        print(json.dumps({"written": str(path), "ok": doc["ok"], "wall_s": doc["wall_s"],
                          "steps": {n: s["status"] for n, s in doc["steps"].items()}}))
        sys.exit(0 if doc["ok"] else 1)
    # step NAME STATUS RC SECONDS TIMEOUT LEFT WALL KIND EXTRA OUTFILE LOG OFFSET REASON COMMAND
    (name, status, rc, seconds, timeout, left, wall, kind, extra, outfile, log, offset, reason,
     command) = sys.argv[3:17]
    entry = {"status": status}
    if status == "skipped":
        entry["reason"] = reason
    else:
        entry.update(timeout_s=int(timeout), budget_left_s=int(left), command=command)
    if status not in ("skipped", "running"):
        entry.update(rc=int(rc), seconds=int(seconds))
        result = None
        if kind == "bench":
            r = last_json(outfile)
            result = bench_result(name, r) if r else None
        elif kind in ("json", "env"):
            result = last_json(outfile)
        elif kind == "train":
            result = train_result(extra)
        elif kind == "sample":
            text = Path(outfile).read_text(errors="replace") if Path(outfile).is_file() else ""
            result = {"chars": len(text), "text_head": text[:200],
                      "attention_png_bytes": Path(extra).stat().st_size if Path(extra).is_file() else None}
            result = result if text.strip() else None
        elif kind == "wheels":
            wheels = sorted(Path(extra).glob("*.whl"))
            result = {"wheels": [w.name for w in wheels],
                      "bytes": sum(w.stat().st_size for w in wheels)}
        if result is not None:
            entry["result"] = result
        if status == "ok" and result is None and kind != "none":
            entry["status"] = status = "failed"
            entry["error"] = "exited 0 but left no result"
        if status != "ok":
            entry["log_tail"] = log_tail(log, offset)
        if kind == "env" and result:
            doc["env"] = result
    doc["steps"][name] = entry
    doc["wall_s"] = int(wall)
    save(path, doc)
    print(entry["status"])


main()
EOF
)

cat >"$WORK/env.py" <<'EOF'
import importlib, json, platform, subprocess, sys
info = {"python": platform.python_version(), "executable": sys.executable, "host": platform.node()}
try:
    import torch
    info.update(torch=torch.__version__, cuda=torch.version.cuda, cuda_available=torch.cuda.is_available())
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(device=p.name, device_count=torch.cuda.device_count(),
                    capability=f"{p.major}.{p.minor}", memory_bytes=p.total_memory,
                    multiprocessors=p.multi_processor_count, nccl=".".join(map(str, torch.cuda.nccl.version())))
    else:
        info["device"] = "cpu"
except Exception as e:  # noqa: BLE001
    info["torch_error"] = repr(e)
try:
    q = ["nvidia-smi", "--query-gpu=driver_version,name,memory.total", "--format=csv,noheader"]
    info["nvidia_smi"] = subprocess.run(q, capture_output=True, text=True, timeout=20).stdout.strip()
except (OSError, subprocess.SubprocessError):
    info["nvidia_smi"] = None
packages = {}
for mod in ("hydra", "omegaconf", "antlr4", "submitit", "numpy", "tiktoken", "psutil", "yaml", "matplotlib"):
    try:
        m = importlib.import_module(mod)
        packages[mod] = getattr(m, "__version__", "present")
    except Exception as e:  # noqa: BLE001
        packages[mod] = f"missing ({e})"
info["packages"] = packages
print(json.dumps(info))
EOF

record() { "$PY" -c "$RECORD_PY" "$@"; }
say() { echo "$*" | tee -a "$LOG" >&2; }
now() { date +%s; }
left() { echo $((BUDGET - ($(now) - T_START))); }

declare -A STATUS
FATAL=""

# cap_for NAME DEFAULT: the step's timeout, GPU_CHECK_TIMEOUTS over the default (x the scale)
cap_for() {
  local item cap=$(($2 * TIMEOUT_SCALE))
  for item in ${TIMEOUTS//,/ }; do
    if [ "${item%%=*}" = "$1" ]; then cap=${item#*=}; fi
  done
  echo "$cap"
}

skip() {  # skip NAME REASON
  STATUS[$1]=skipped
  say "== $1: skipped ($2)"
  record step "$OUT_JSON" "$1" skipped 0 0 0 0 $(($(now) - T_START)) none "" "" "$LOG" 0 "$2" "" >/dev/null
}

selected() {  # selected NAME: false (and recorded as skipped) when GPU_CHECK_ONLY leaves it out
  if [ -n "$FATAL" ]; then skip "$1" "$FATAL"; return 1; fi
  if [ -z "$ONLY" ] || [[ ",$ONLY," == *",$1,"* ]]; then return 0; fi
  skip "$1" "not in GPU_CHECK_ONLY=$ONLY"
  return 1
}

# run_step NAME KIND CAP MIN EXTRA -- COMMAND...: COMMAND under `timeout -k GRACE T`, T the cap or
# what the budget leaves, whichever is less; skipped when the budget leaves less than MIN seconds.
run_step() {
  local name=$1 kind=$2 cap min=$4 extra=$5
  cap=$(cap_for "$1" "$3")
  shift 6
  local avail t
  avail=$(($(left) - RESERVE - GRACE))
  t=$((cap < avail ? cap : avail))
  if [ "$avail" -lt "$min" ]; then
    skip "$name" "budget: $(left) s left of $BUDGET, the step needs at least $((min + RESERVE + GRACE)) s"
    return
  fi
  local command="$*" offset t0 rc status start_left
  start_left=$(left)
  say "== $name: budget left $(left) s of $BUDGET, timeout ${t} s: $command"
  offset=$(stat -c %s "$LOG")
  record step "$OUT_JSON" "$name" running 0 0 "$t" "$start_left" $(($(now) - T_START)) "$kind" "$extra" "" \
    "$LOG" "$offset" "" "$command" >/dev/null
  t0=$(now)
  timeout -k "$GRACE" "$t" "$@" >"$WORK/$name.out" 2>>"$LOG"
  rc=$?
  cat "$WORK/$name.out" >>"$LOG"
  case $rc in
    0) status=ok ;;
    124 | 137) status=timed_out ;;
    *) status=failed ;;
  esac
  # the status as recorded: "ok" becomes "failed" when the step left no result
  STATUS[$name]=$(record step "$OUT_JSON" "$name" "$status" "$rc" $(($(now) - t0)) "$t" "$start_left" \
    $(($(now) - T_START)) "$kind" "$extra" "$WORK/$name.out" "$LOG" "$offset" "" "$command")
  say "== $name: ${STATUS[$name]} (exit $rc) in $(($(now) - t0)) s; $(tail -n 1 "$WORK/$name.out" | cut -c1-300)"
}

NOTES="gpt1b and fsdp run under torchrun with one process: DDP's wrapper and FSDP2 over NCCL in a world of one\
|gpt1b's reference peak (27.66 GB) was DDP over 8 x A100-40GB"
record init "$OUT_JSON" "$MODE" "$BUDGET" "$T_START" "$NOTES" "${STEP_NAMES[@]}" || {
  echo "gpu_check: cannot write $OUT_JSON with $PY" >&2
  exit 1
}
say "gpu_check ($MODE): budget $BUDGET s, JSON $OUT_JSON, log $LOG, python $PY"

# wheels: the packages a lent machine lacks, from .whl/ (launch/gpu_wheels.sh)
if "$PY" -c "import hydra, omegaconf, submitit" 2>/dev/null; then
  skip wheels "hydra, omegaconf and submitit import already"
elif compgen -G ".whl/*.whl" >/dev/null; then
  run_step wheels wheels 120 10 "$REPO/.whl" -- "$PY" -m pip install -q --no-index --no-deps --no-compile \
    --no-cache-dir --upgrade --target "$SITE" "$REPO"/.whl/*.whl
  export PYTHONPATH=$SITE:$PYTHONPATH
  if ! "$PY" -c "import hydra, omegaconf, submitit" 2>>"$LOG"; then
    FATAL="hydra, omegaconf or submitit do not import after installing .whl/ (see the log)"
  fi
else
  skip wheels "no .whl/ folder"
  FATAL="hydra, omegaconf or submitit do not import, and there is no .whl/: run launch/gpu_wheels.sh \
where pip works and carry .whl"
fi

run_step env env 60 5 "" -- "$PY" "$WORK/env.py"

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
BENCH="bench.warmup=$WARMUP bench.steps=$STEPS"
RUNS=$WORK/runs
# a real run: two evaluations, two checkpoints, the end sample (longer than gpt_char's block, so
# the KV cache is rebuilt once) under the preset's attention
TRAIN="model=gpt_char train.eval_every=10 train.checkpoint_every=10 train.eval_steps=2 \
train.eval_batch_size=8 train.log_every=5 train.sample_tokens=100"

# shellcheck disable=SC2086  # the override lists split into words on purpose
{
if selected gpt2_124m; then
  run_step gpt2_124m bench 150 45 "" -- "$PY" -m gptlab.bench $BENCH $HW $COMMON model=gpt2_124m \
    train.batch_size=16 train.micro_batch_size=16 optimizer=adamw $FAST $SHRINK "hydra.run.dir=$RUNS/gpt2_124m"
fi
if selected gpt1b; then
  # under torchrun: parallelism=ddp launched alone joins an NCCL group and runs the DDP wrapper
  run_step gpt1b bench 120 30 "" -- "$PY" -m torch.distributed.run --standalone --nproc_per_node=1 --no-python \
    "$PY" -m gptlab.bench $BENCH $HW $COMMON model=gpt1b model.block_size=2048 \
    parallelism=ddp parallelism.activation_checkpointing=true train.batch_size=8 train.micro_batch_size=8 \
    optimizer=adamw $FAST hardware.compile=$GPT1B_COMPILE $SHRINK "hydra.run.dir=$RUNS/gpt1b"
fi
if selected train; then
  run_step train train 90 20 "$RUNS/train" -- "$PY" -m gptlab.train $HW $COMMON $TRAIN train.max_steps=20 \
    $SHRINK "hydra.run.dir=$RUNS/train"
fi
if selected train_resume; then
  if [ "${STATUS[train]:-}" != ok ]; then
    skip train_resume "needs the train step's checkpoint (train: ${STATUS[train]:-not run})"
  else
    run_step train_resume train 60 15 "$RUNS/train" -- "$PY" -m gptlab.train $HW $COMMON $TRAIN \
      train.max_steps=30 $SHRINK "hydra.run.dir=$RUNS/train"
  fi
fi
if selected sample; then
  if [ "${STATUS[train]:-}" != ok ]; then
    skip sample "needs the train step's checkpoint (train: ${STATUS[train]:-not run})"
  else
    run_step sample sample 45 10 "$WORK/attention.png" -- "$PY" -m gptlab.sample "run=$RUNS/train" \
      "device=$DEVICE" prompt=ROMEO: max_new_tokens=200 "attention.out=$WORK/attention.png"
  fi
fi
if selected fp16; then
  run_step fp16 train 60 15 "$RUNS/fp16" -- "$PY" -m gptlab.train $HW $COMMON $TRAIN train.max_steps=20 \
    optimizer=adamw hardware.precision=fp16 hardware.compile=false $SHRINK "hydra.run.dir=$RUNS/fp16"
fi
if selected fp16_resume; then
  if [ "${STATUS[fp16]:-}" != ok ]; then
    skip fp16_resume "needs the fp16 step's checkpoint (fp16: ${STATUS[fp16]:-not run})"
  else
    run_step fp16_resume train 45 15 "$RUNS/fp16" -- "$PY" -m gptlab.train $HW $COMMON $TRAIN \
      train.max_steps=30 optimizer=adamw hardware.precision=fp16 hardware.compile=false $SHRINK \
      "hydra.run.dir=$RUNS/fp16"
  fi
fi
if selected fsdp; then
  # torchrun's worker runs "$PY" itself (--no-python): the same interpreter and packages
  run_step fsdp bench 120 45 "" -- "$PY" -m torch.distributed.run --standalone --nproc_per_node=1 --no-python \
    "$PY" -m gptlab.bench $BENCH $HW $COMMON model=gpt2_124m parallelism=fsdp parallelism.activation_checkpointing=false \
    train.batch_size=16 train.micro_batch_size=16 optimizer=adamw $FAST $SHRINK "hydra.run.dir=$RUNS/fsdp"
fi
if selected chunked_loss; then
  run_step chunked_loss json 60 15 "" -- "$PY" benchmarks/chunked_loss.py $CHUNKED
fi
if selected gpt2_124m_muon; then
  run_step gpt2_124m_muon bench 90 30 "" -- "$PY" -m gptlab.bench $BENCH $HW $COMMON model=gpt2_124m \
    train.batch_size=16 train.micro_batch_size=16 optimizer=muon $FAST $SHRINK \
    "hydra.run.dir=$RUNS/gpt2_124m_muon"
fi
if selected gpt2_124m_stop; then
  run_step gpt2_124m_stop bench 90 30 "" -- "$PY" -m gptlab.bench $BENCH $HW $COMMON model=gpt2_124m \
    train.batch_size=16 train.micro_batch_size=16 optimizer=adamw train.on_divergence=stop $FAST $SHRINK \
    "hydra.run.dir=$RUNS/gpt2_124m_stop"
fi
# checkpoints that do not stop training: the stall per save, written whole and in the background
CKPT="model=gpt2_124m train.batch_size=16 train.micro_batch_size=16 optimizer=adamw train.max_steps=8 \
train.checkpoint_every=2 train.keep_checkpoints=2 train.eval_every=0 train.eval_steps=1 train.sample_tokens=0"
if selected ckpt_sync; then
  run_step ckpt_sync train 90 25 "$RUNS/ckpt_sync" -- "$PY" -m gptlab.train $HW $COMMON $CKPT $FAST \
    $SHRINK "hydra.run.dir=$RUNS/ckpt_sync"
fi
if selected ckpt_async; then
  run_step ckpt_async train 90 25 "$RUNS/ckpt_async" -- "$PY" -m gptlab.train $HW $COMMON $CKPT $FAST \
    train.checkpoint_async=true $SHRINK "hydra.run.dir=$RUNS/ckpt_async"
fi
# failures survived on the device: a NaN rolled back, a dead rank restarted by torchrun
if selected rollback; then
  run_step rollback train 60 15 "$RUNS/rollback" -- "$PY" -m gptlab.train $HW $COMMON $TRAIN \
    train.max_steps=20 "train.faults.nonfinite_loss_at=[7]" train.checkpoint_every=5 $SHRINK \
    "hydra.run.dir=$RUNS/rollback"
fi
if selected restart; then
  run_step restart train 90 30 "$RUNS/restart" -- "$PY" -m torch.distributed.run --standalone --nproc_per_node=1 \
    --max-restarts=1 --no-python "$PY" -m gptlab.train $HW $COMMON $TRAIN train.max_steps=20 \
    train.faults.crash_at_step=12 train.sample_tokens=0 $SHRINK "hydra.run.dir=$RUNS/restart"
fi
if [ "$LADDER" = off ]; then
  skip ladder "off (GPU_CHECK_LADDER names its overrides to run it with the budget left)"
elif selected ladder; then
  # the compile rung is skipped without a C++ compiler (CXX=no-such-compiler)
  run_step ladder json 600 60 "" -- "$PY" -m gptlab.bench bench.ladder=true $BENCH $HW $COMMON $LADDER $SHRINK \
    "hydra.run.dir=$RUNS/ladder"
fi
}

record finish "$OUT_JSON" $(($(now) - T_START))
rc=$?
say "gpu_check ($MODE): done in $(($(now) - T_START)) s of $BUDGET; JSON $OUT_JSON"
exit $rc
