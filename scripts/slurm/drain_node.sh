#!/usr/bin/env bash
# Drain a node for maintenance: move every rank it serves to a standby machine
# in one planned migration (`trainmover drain --node NODE`), then optionally
# mark the node DRAIN in Slurm so no new job lands there.
#
#   drain_node.sh --node NODE [--wait SECONDS] [--tm-etcd-endpoints E --tm-job NAME --tm-job-token TOKEN ...]
#                 [--python PY] [--slurm-drain] [--dry-run]
#
#   --node NODE      the Slurm node name (the name `trainmover status` shows under 'host')
#   --wait SECONDS   how long `trainmover drain` waits until every rank of the node handed its
#                    state over [default 300; 0 only queues the request]
# Every --tm-* option (with its value) is passed to `trainmover drain`, so the
# job, its token and etcd's TLS/auth flags work as in `trainmover status`;
# TRAINMOVER_ETCD_ENDPOINTS / TRAINMOVER_JOB / TRAINMOVER_JOB_TOKEN work too.
#   --python PY      interpreter with TrainMover installed [TM_PYTHON, default python3]
#   --slurm-drain    once the node is free (or the request is queued, with --wait 0),
#                    `scontrol update NodeName=NODE State=DRAIN`
#   --dry-run        print the commands, run nothing
# The controller moves the node's ranks to one standby machine with enough idle
# warm standbys (trainmover.sbatch --standby-nodes S starts them), or rejects the
# drain and says why. Exit code: that of `trainmover drain` (0 free, 1 rejected,
# 3 not done in time), or scontrol's when it fails.
set -euo pipefail

die() { echo "drain_node.sh: error: $*" >&2; exit 2; }

NODE='' WAIT=300 SLURM_DRAIN=0 DRY=0
PY=${TM_PYTHON:-python3}
TM_FLAGS=()
while (($#)); do
  case "$1" in
    --node|--wait|--python)
      (($# >= 2)) || die "$1 needs a value"
      case "$1" in
        --node) NODE=$2 ;; --wait) WAIT=$2 ;; --python) PY=$2 ;;
      esac
      shift 2 ;;
    --tm-*) (($# >= 2)) || die "$1 needs a value"; TM_FLAGS+=("$1" "$2"); shift 2 ;;
    --slurm-drain) SLURM_DRAIN=1; shift ;;
    --dry-run) DRY=1; shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown option '$1' (see --help)" ;;
  esac
done

[[ -n "$NODE" ]] || die "--node NODE is required (a Slurm node name, as in squeue's NODELIST)"
[[ "$WAIT" =~ ^[0-9]+$ ]] || die "--wait must be a whole number of seconds, got '$WAIT'"

cmd=("$PY" -m trainmover_ext.cli drain --node "$NODE" --wait "$WAIT" "${TM_FLAGS[@]}")
drain=(scontrol update "NodeName=$NODE" State=DRAIN "Reason=trainmover drain_node.sh")
if ((DRY)); then
  echo "[drain_node] would run: ${cmd[*]}"
  ((SLURM_DRAIN)) && echo "[drain_node] would run: ${drain[*]}"
  exit 0
fi
status=0
timeout $((WAIT + 60)) "${cmd[@]}" || status=$?
if ((SLURM_DRAIN)); then
  if ((status == 0)); then
    rc=0
    timeout 30 "${drain[@]}" || rc=$?
    if ((rc)); then
      echo "[drain_node] scontrol update failed (exit $rc)" >&2
      status=$rc
    else
      echo "[drain_node] node $NODE is DRAIN in Slurm; resume it with: scontrol update NodeName=$NODE State=RESUME"
    fi
  else
    echo "[drain_node] not draining $NODE in Slurm: \`trainmover drain\` exited $status" >&2
  fi
fi
exit "$status"
