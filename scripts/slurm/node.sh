#!/bin/bash
# One node of a multi-node run: a torchrun agent that starts this node's workers (one per GPU) and joins the
# other nodes' agents at a c10d rendezvous on the first node of the job. train.sbatch runs it on every node
# (srun, one task per node); tests/e2e/test_nodes.py runs it twice on one machine, as two nodes of 2 CPU workers.
#   scripts/slurm/node.sh --config-name vit_base_patch16_224 distributed.dp_outer=2 ...   (train.py's arguments)
set -eu
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
head=${RDZV_HOST:-$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)}   # the rendezvous host
nproc=${NPROC_PER_NODE:-${SLURM_GPUS_ON_NODE:-$(nvidia-smi --list-gpus | wc -l)}}  # workers on this node
# SIGTERM to torchrun (SLURM signals the task, which exec makes torchrun) is passed on to its workers, which save a
# checkpoint at the end of the current step and stop (checkpoint.save_on_signals); torchrun kills them with SIGKILL
# if they are still running this many seconds later: leave time for the save.
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-240}
exec torchrun --nnodes "$SLURM_NNODES" --nproc-per-node "$nproc" --rdzv-backend c10d \
    --rdzv-endpoint "$head:${RDZV_PORT:-29500}" --rdzv-id "$SLURM_JOB_ID" "$repo/train.py" "$@"
