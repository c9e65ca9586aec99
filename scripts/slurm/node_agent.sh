#!/usr/bin/env bash
# One node's `trainmover launch` agent, started by trainmover.sbatch through srun.
#
#   node_agent.sh PY NPROC MASTER_ADDR MASTER_PORT MAX_RESTARTS SCRIPT [SCRIPT_ARGS...]
#
# The node's index and the node count come from srun's environment
# (SLURM_NODEID, SLURM_NNODES), so every node runs the same command line.
# With TM_NODE_ROLE=standby the node is a standby machine of the job instead
# (`trainmover launch --tm-role standby`): NPROC warm standbys, one per slot,
# for a job of TM_ACTIVE_NODES nodes; it reaches the job through the
# TRAINMOVER_ETCD_ENDPOINTS, TRAINMOVER_JOB and TRAINMOVER_JOB_TOKEN variables.
# The node's Slurm name is $SLURMD_NODENAME: `hostname` is the physical host,
# which differs from the Slurm node when several slurmd share a machine.
# The agent replaces this shell (exec), so its exit code is the task's. A SIGTERM (the job's time
# limit, see trainmover.sbatch) gives the ranks --term-timeout (TM_TERM_TIMEOUT, default 120 s) to
# save a checkpoint and exit.
set -euo pipefail

(($# >= 6)) || { echo "usage: $0 PY NPROC MASTER_ADDR MASTER_PORT MAX_RESTARTS SCRIPT [ARGS...]" >&2; exit 2; }
PY=$1 NPROC=$2 MASTER_ADDR=$3 MASTER_PORT=$4 MAX_RESTARTS=$5 SCRIPT=$6
shift 6
: "${SLURM_NODEID:?node_agent.sh must run inside srun (SLURM_NODEID is not set)}"
: "${SLURM_NNODES:?node_agent.sh must run inside srun (SLURM_NNODES is not set)}"
NODE=${SLURMD_NODENAME:-$(hostname)}
export TRAINMOVER_NODE_NAME=$NODE
# What the agent may run on: trainmover.sbatch gives it every CPU of the node (--cpus-per-task).
echo "[node_agent] node $NODE: cpus-per-task ${SLURM_CPUS_PER_TASK:-unset} of ${SLURM_CPUS_ON_NODE:-?}" \
     "on the node, $(nproc) usable"

if [[ ${TM_NODE_ROLE:-worker} == standby ]]; then
  : "${TM_ACTIVE_NODES:?a standby node needs TM_ACTIVE_NODES, the number of active nodes}"
  echo "[node_agent] node $NODE: standby machine with $NPROC slot(s) for a job of $TM_ACTIVE_NODES node(s)"
  PLACE=(--tm-role standby --nnodes "$TM_ACTIVE_NODES")
else
  echo "[node_agent] node $NODE (id $SLURM_NODEID of $SLURM_NNODES): $NPROC rank(s), rendezvous $MASTER_ADDR:$MASTER_PORT"
  PLACE=(--nnodes "$SLURM_NNODES" --node-rank "$SLURM_NODEID")
fi
exec "$PY" -m trainmover_ext.cli launch \
  --nproc-per-node "$NPROC" "${PLACE[@]}" \
  --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" --max-restarts "$MAX_RESTARTS" \
  --term-timeout "${TM_TERM_TIMEOUT:-120}" \
  --metrics-port "${TM_METRICS_PORT:-0}" --metrics-host "${TM_METRICS_HOST:-127.0.0.1}" \
  "$SCRIPT" "$@"
