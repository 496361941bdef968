#!/usr/bin/env bash
# python -m gptlab.train on SLURM without Hydra's multirun: a plain batch script that starts one srun
# step, one task per process, on every node of the job.
#
#   sbatch --nodes=2 --ntasks-per-node=8 --gpus-per-node=8 --partition=gpu --account=myproject \
#       launch/sbatch_gptlab.sh hardware=a100x8 model=gpt1b
#   sbatch --nodes=2 --ntasks-per-node=2 launch/sbatch_gptlab.sh model=gpt_nano   # GPTLAB_SLURM_NODES=2 local cluster
#
# The arguments are gptlab.train's overrides. Unless they give them, the script adds
#   hardware.nodes=<the job's nodes> hardware.nproc_per_node=<its tasks per node>
#       (the allocation decides how many processes there are; gptlab checks that they add up)
#   hydra.run.dir=outputs/runs/slurm-<job id>
#       (one run folder per job, the same on every node and after a requeue: train.resume=auto
#       continues there), under the job's working folder (sbatch --chdir, default: where you submit)
# Each task then works out who it is as it does under submitit (gptlab/distributed/world.py): its rank and
# local rank from SLURM, the master from the first node of the step, and the rendezvous port from the
# job id (outside the node's ephemeral ports, the same on every node and after a requeue). One task
# that dies ends the whole job at once (--kill-on-bad-exit), and the job fails.
#
# Preemption and the time limit: SLURM sends this script SIGUSR2 300 s before the end (--signal); the
# script passes it to the tasks, which save a checkpoint at the next step and stop, and then it
# requeues the job (--requeue), which starts again in the same run folder and MLflow run.
#
# Environment: GPTLAB_PYTHON, the Python with gptlab installed (default: `python` on the PATH).
#SBATCH --job-name=gptlab
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --time=24:00:00
#SBATCH --signal=B:USR2@300
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=slurm-%j.out
set -euo pipefail

[ -n "${SLURM_JOB_ID:-}" ] || { echo "sbatch_gptlab: submit this script with sbatch" >&2; exit 2; }
python="${GPTLAB_PYTHON:-python}"
nodes="$SLURM_JOB_NUM_NODES"
tasks_per_node=$((${SLURM_NTASKS:-$nodes} / nodes))

given() {  # given KEY ARGS...: an override of KEY (key=, +key=, ++key=) is among ARGS
    local key="$1" arg
    shift
    for arg in "$@"; do
        case "$arg" in "$key="* | "+$key="* | "++$key="*) return 0 ;; esac
    done
    return 1
}
extra=()
given hardware.nodes "$@" || extra+=("hardware.nodes=$nodes")
given hardware.nproc_per_node "$@" || extra+=("hardware.nproc_per_node=$tasks_per_node")
given hydra.run.dir "$@" || extra+=("hydra.run.dir=outputs/runs/slurm-$SLURM_JOB_ID")

step=""
stop_asked=0
on_usr2() {
    stop_asked=1
    echo "sbatch_gptlab: SIGUSR2: asking the tasks to save a checkpoint and stop"
    if [ -n "$step" ]; then kill -USR2 "$step" 2>/dev/null || true; fi  # srun passes it to every task
}
trap on_usr2 USR2

echo "sbatch_gptlab: job $SLURM_JOB_ID: $nodes node(s) x $tasks_per_node task(s): $python -m gptlab.train ${extra[*]} $*"
srun --kill-on-bad-exit=1 --nodes="$nodes" --ntasks-per-node="$tasks_per_node" \
    "$python" -m gptlab.train "${extra[@]}" "$@" &
step=$!
rc=0
wait "$step" || rc=$?
while kill -0 "$step" 2>/dev/null; do  # a trapped signal ends `wait` early: wait for srun itself
    rc=0
    wait "$step" || rc=$?
done
if [ "$stop_asked" = 1 ] && [ "$rc" = 0 ]; then
    echo "sbatch_gptlab: the run stopped after saving; requeueing job $SLURM_JOB_ID"
    scontrol requeue "$SLURM_JOB_ID"
fi
exit "$rc"
