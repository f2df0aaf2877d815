#!/usr/bin/env bash
# Launch train.py on this node through torchrun's c10d rendezvous: one node or many, CPU or GPU.
#
#   NGPU=8 NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 scripts/run_train.sh --config llama_debug   # on node0
#   NGPU=8 NNODES=2 NODE_RANK=1 MASTER_ADDR=node0 scripts/run_train.sh --config llama_debug   # on node1
#
# Every argument goes to train.py unchanged (a --config and any --section.key overrides); without a
# --config, CONFIG_FILE is used. Under SLURM (scripts/multinode_trainer.slurm) the node count, this
# node's rank, the first host of the allocation and the job id are read from SLURM's variables.
#
# Environment (all optional):
#   NGPU            processes on this node (default: the GPUs torch sees, else 1)
#   NNODES          nodes in the job (default: SLURM_NNODES, else 1)
#   NODE_RANK       this node's index, 0 … NNODES-1 (default: SLURM_NODEID, else 0); node 0 hosts
#                   the rendezvous store at MASTER_ADDR:MASTER_PORT
#   MASTER_ADDR     address of node 0 (default: first host of SLURM_JOB_NODELIST, else 127.0.0.1)
#   MASTER_PORT     rendezvous port on node 0 (default 29500)
#   RDZV_ID         the job's name, the same on every node (default: SLURM_JOB_ID, else kiln)
#   RDZV_TIMEOUT    seconds a node waits for the others to join (default 600)
#   MAX_RESTARTS    times torchrun restarts the workers after a failure (default 0; Kiln resumes
#                   from its latest checkpoint on restart)
#   CONFIG_FILE     config used when the arguments name none (default train_configs/llama_debug.toml)
#   OMP_NUM_THREADS threads per process (default: this node's cores / NGPU, at least 1)
#   TORCHRUN        the torchrun command (default: python scripts/launch.py, torchrun that passes a
#                   SIGTERM on to the workers and ends quietly after them: exit 0 when they saved
#                   and stopped, one line after Kiln's own error rather than torchrun's report)
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ -n "${SLURM_JOB_ID:-}" ]]; then
    NNODES="${NNODES:-${SLURM_NNODES:-1}}"
    NODE_RANK="${NODE_RANK:-${SLURM_NODEID:-0}}"
    RDZV_ID="${RDZV_ID:-$SLURM_JOB_ID}"
    if [[ -z "${MASTER_ADDR:-}" && -n "${SLURM_JOB_NODELIST:-}" ]]; then
        MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
    fi
    if [[ -z "${NGPU:-}" && -n "${SLURM_GPUS_ON_NODE:-}" ]]; then
        NGPU="$SLURM_GPUS_ON_NODE"
    fi
fi

PYTHON="${PYTHON:-python}"
NNODES="${NNODES:-1}"
NODE_RANK="${NODE_RANK:-0}"
MASTER_PORT="${MASTER_PORT:-29500}"
RDZV_ID="${RDZV_ID:-kiln}"
RDZV_TIMEOUT="${RDZV_TIMEOUT:-600}"
MAX_RESTARTS="${MAX_RESTARTS:-0}"
CONFIG_FILE="${CONFIG_FILE:-train_configs/llama_debug.toml}"
if [[ -z "${NGPU:-}" ]]; then
    NGPU="$("$PYTHON" -c 'import torch; print(max(torch.cuda.device_count(), 1))')"
fi
if (( NODE_RANK < 0 || NODE_RANK >= NNODES )); then
    echo "run_train.sh: NODE_RANK=$NODE_RANK is not in 0 … NNODES-1 = $((NNODES - 1))" >&2
    exit 2
fi
if (( NNODES > 1 )) && [[ -z "${MASTER_ADDR:-}" ]]; then
    echo "run_train.sh: NNODES=$NNODES needs MASTER_ADDR, the address of node 0 that every node can reach" >&2
    exit 2
fi
MASTER_ADDR_GIVEN="${MASTER_ADDR:-}"
MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
# Each process gets its share of the cores: more threads than cores makes every process slower.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( $(nproc) / NGPU > 0 ? $(nproc) / NGPU : 1 ))}"

args=("$@")
has_config=0
for a in "${args[@]}"; do
    [[ "$a" == "--config" || "$a" == --config=* ]] && has_config=1
done
(( has_config )) || args=(--config "$CONFIG_FILE" "${args[@]}")

# Node 0 hosts the rendezvous store, said explicitly (is_host) rather than guessed from hostnames,
# which fails when every node resolves MASTER_ADDR to a loopback or a second interface.
is_host=0
(( NODE_RANK == 0 )) && is_host=1
read -r -a torchrun <<< "${TORCHRUN:-$PYTHON scripts/launch.py}"

if (( NNODES == 1 )) && [[ -z "${MASTER_ADDR_GIVEN:-}" ]]; then
    # One node and no address given: torchrun's standalone rendezvous on a free local port.
    rdzv=(--standalone)
else
    rdzv=(--rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "$RDZV_ID"
          --rdzv-conf "is_host=$is_host,join_timeout=$RDZV_TIMEOUT")
fi

set -x
exec "${torchrun[@]}" --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$NGPU" \
    "${rdzv[@]}" --max-restarts "$MAX_RESTARTS" train.py "${args[@]}"
