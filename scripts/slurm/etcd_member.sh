#!/usr/bin/env bash
# One member of the job's 3-member embedded etcd, on the node srun runs it on (started by
# trainmover.sbatch; the first member runs in the batch script itself).
#
#   etcd_member.sh NAME ADDR CLIENT_PORT DIR INITIAL_CLUSTER
#
# It stays in the foreground until etcd exits: the end of the job step (SIGTERM) stops it.
set -euo pipefail

(($# == 5)) || { echo "usage: $0 NAME ADDR CLIENT_PORT DIR INITIAL_CLUSTER" >&2; exit 2; }
# shellcheck source=scripts/slurm/etcd.sh
source "$(dirname "$0")/etcd.sh"
launch_etcd_member "$2" "$3" "$4" "$1" "$5"
echo "[etcd_member] $1 on ${SLURMD_NODENAME:-$(hostname)}: $EMBEDDED_ETCD_URL (pid $EMBEDDED_ETCD_PID, log $4/etcd.log)"
trap 'kill -TERM "$EMBEDDED_ETCD_PID" 2>/dev/null || true' TERM INT
wait "$EMBEDDED_ETCD_PID"
