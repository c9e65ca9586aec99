#!/usr/bin/env bash
# Drain a node for maintenance: move every rank it serves to a warm standby
# with planned migrations (`trainmover migrate --rank R`), then optionally mark
# the node DRAIN in Slurm so no new job lands there.
#
#   drain_node.sh --node NODE (--slurm-job ID [--nproc-per-node N] | --ranks "R1 R2 ...")
#                 [--tm-etcd-endpoints E --tm-job NAME --tm-job-token TOKEN ...] [--slurm-drain] [--dry-run]
#
# Which ranks NODE serves:
#   --slurm-job ID   from the job's placement by trainmover.sbatch: node i of the
#                    job's node list serves ranks [i*N, (i+1)*N), N = GPUs per node
#                    from the job's TresPerNode, else --nproc-per-node N.
#                    This is the placement at start: a rank moved by an earlier
#                    migration is not followed (check `trainmover status`).
#   --ranks "..."    explicit logical ranks (from `trainmover status`).
# Every --tm-* option (with its value) is passed to `trainmover migrate`, so
# the job, its token and etcd's TLS/auth flags work as in `trainmover status`;
# TRAINMOVER_ETCD_ENDPOINTS / TRAINMOVER_JOB / TRAINMOVER_JOB_TOKEN work too.
#   --python PY      interpreter with TrainMover installed [TM_PYTHON, default python3]
#   --slurm-drain    after the requests, `scontrol update NodeName=NODE State=DRAIN`
#   --dry-run        print the commands, run nothing
# The controller picks a standby for each rank; follow with `trainmover status`.
# Exit code: 0 when every request was accepted, else that of the first failure.
set -euo pipefail

die() { echo "drain_node.sh: error: $*" >&2; exit 2; }

NODE='' JOB_ID='' NPROC='' RANKS='' SLURM_DRAIN=0 DRY=0
PY=${TM_PYTHON:-python3}
TM_FLAGS=()
while (($#)); do
  case "$1" in
    --node|--slurm-job|--nproc-per-node|--ranks|--python)
      (($# >= 2)) || die "$1 needs a value"
      case "$1" in
        --node) NODE=$2 ;; --slurm-job) JOB_ID=$2 ;; --nproc-per-node) NPROC=$2 ;;
        --ranks) RANKS=$2 ;; --python) PY=$2 ;;
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
if [[ -z "$RANKS" ]]; then
  [[ -n "$JOB_ID" ]] || die "say which ranks to move: --slurm-job ID (placement by trainmover.sbatch) or --ranks \"R1 R2\""
  info=$(timeout 30 scontrol -o show job "$JOB_ID") || die "scontrol cannot show job $JOB_ID: is it still known to Slurm?"
  state=$(tr ' ' '\n' <<< "$info" | sed -n 's/^JobState=//p')
  [[ "$state" == RUNNING ]] || die "job $JOB_ID is $state, not RUNNING: only a running job's nodes can be drained"
  nodelist=$(tr ' ' '\n' <<< "$info" | sed -n 's/^NodeList=//p')
  if [[ -z "$NPROC" ]]; then
    NPROC=$(tr ' ' '\n' <<< "$info" | sed -n 's/^TresPerNode=.*gpu[^,]*:\([0-9][0-9]*\).*/\1/p')
    [[ -n "$NPROC" ]] || die "job $JOB_ID has no GPUs per node in TresPerNode: pass --nproc-per-node N (as given to trainmover.sbatch)"
  fi
  [[ "$NPROC" =~ ^[1-9][0-9]*$ ]] || die "--nproc-per-node must be a positive integer, got '$NPROC'"
  index=$(timeout 30 scontrol show hostnames "$nodelist" | grep -n -x -F "$NODE" | cut -d: -f1 || true)
  [[ -n "$index" ]] || die "node $NODE is not in job $JOB_ID's node list ($nodelist)"
  first=$(((index - 1) * NPROC))
  RANKS=$(seq -s ' ' "$first" $((first + NPROC - 1)))
fi
for r in $RANKS; do [[ "$r" =~ ^[0-9]+$ ]] || die "rank '$r' is not a non-negative integer"; done

echo "[drain_node] node $NODE serves ranks: $RANKS"
status=0
for r in $RANKS; do
  # --wait 0: queue every rank's move at once; the controller carries them out one epoch at a time.
  cmd=("$PY" -m trainmover_ext.cli migrate --rank "$r" --wait 0 "${TM_FLAGS[@]}")
  if ((DRY)); then
    echo "[drain_node] would run: ${cmd[*]}"
    continue
  fi
  rc=0
  timeout 120 "${cmd[@]}" || rc=$?
  if ((rc)); then
    echo "[drain_node] rank $r: migrate failed (exit $rc)" >&2
    ((status)) || status=$rc
  fi
done

if ((SLURM_DRAIN)); then
  drain=(scontrol update "NodeName=$NODE" State=DRAIN "Reason=trainmover drain_node.sh")
  if ((DRY)); then
    echo "[drain_node] would run: ${drain[*]}"
  elif ((status == 0)); then
    rc=0
    timeout 30 "${drain[@]}" || rc=$?
    if ((rc)); then
      echo "[drain_node] scontrol update failed (exit $rc)" >&2
      status=$rc
    else
      echo "[drain_node] node $NODE is DRAIN in Slurm; resume it with: scontrol update NodeName=$NODE State=RESUME"
    fi
  else
    echo "[drain_node] not draining $NODE in Slurm: some migration requests failed" >&2
  fi
fi
((DRY)) || ((status)) || echo "[drain_node] requested; follow with: trainmover status (with the same --tm-* flags)"
exit "$status"
