#!/usr/bin/env bash
# One node's `trainmover launch` agent, started by trainmover.sbatch through srun.
#
#   node_agent.sh PY NPROC MASTER_ADDR MASTER_PORT MAX_RESTARTS SCRIPT [SCRIPT_ARGS...]
#
# The node's index and the node count come from srun's environment
# (SLURM_NODEID, SLURM_NNODES), so every node runs the same command line.
# The node's Slurm name is $SLURMD_NODENAME: `hostname` is the physical host,
# which differs from the Slurm node when several slurmd share a machine.
# The agent replaces this shell (exec), so its exit code is the task's.
set -euo pipefail

(($# >= 6)) || { echo "usage: $0 PY NPROC MASTER_ADDR MASTER_PORT MAX_RESTARTS SCRIPT [ARGS...]" >&2; exit 2; }
PY=$1 NPROC=$2 MASTER_ADDR=$3 MASTER_PORT=$4 MAX_RESTARTS=$5 SCRIPT=$6
shift 6
: "${SLURM_NODEID:?node_agent.sh must run inside srun (SLURM_NODEID is not set)}"
: "${SLURM_NNODES:?node_agent.sh must run inside srun (SLURM_NNODES is not set)}"
NODE=${SLURMD_NODENAME:-$(hostname)}
export TRAINMOVER_NODE_NAME=$NODE

echo "[node_agent] node $NODE (id $SLURM_NODEID of $SLURM_NNODES): $NPROC rank(s), rendezvous $MASTER_ADDR:$MASTER_PORT"
exec "$PY" -m trainmover_ext.cli launch \
  --nproc-per-node "$NPROC" --nnodes "$SLURM_NNODES" --node-rank "$SLURM_NODEID" \
  --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" --max-restarts "$MAX_RESTARTS" \
  --metrics-port "${TM_METRICS_PORT:-0}" --metrics-host "${TM_METRICS_HOST:-127.0.0.1}" \
  "$SCRIPT" "$@"
