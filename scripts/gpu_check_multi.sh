#!/usr/bin/env bash
# Multi-GPU checks, for a machine with 2 to 8 CUDA devices (never in CI): what needs NCCL between ranks.
#   1. nccl_delta on NCCL: every collective megatron issues, on native NCCL groups (tests/nccl_delta/test_gpu.py);
#   2. WORLD's framed NCCL links keep their messages apart (tests/nccl_delta/test_framing.py -m gpu);
#   3. a planned move and a failover of a 2-rank job onto a standby machine of 2 slots
#      (tests/migration/test_gpu_moves.py; with 4+ GPUs the hand-over runs on an NCCL pair), and with 4+
#      GPUs a slowed rank of a PP2 x DP2 job named from the devices' timelines;
#   4. context parallelism (TransformerEngine's attention): CP2 trains one rank's losses, and with 4+
#      GPUs a rank of a CP2 x DP2 job is killed and recovered bit-identically
#      (tests/training/test_context_parallel.py);
#   5. the distributed optimizer's host-memory mirror: a DP2 job's shards copied from the devices on a side
#      stream, a rank killed and its shard taken from its peer's host memory, bit-identically
#      (tests/migration/test_optimizer_mirror.py -m gpu);
#   6. the communicator benchmark on NCCL: all-reduce against torch's own groups with bus bandwidth,
#      a planned replacement (groups rebuilt, and the device memory the pending communicators hold),
#      at as many ranks as there are GPUs (multiples of 4 for the replacement).
# A skip is a failure here; with fewer than 2 GPUs the script says NOT RUN and exits 2.
# Usage: bash scripts/gpu_check_multi.sh [OUT_DIR]
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${1:-${OUT:-gpu_out_multi}}
mkdir -p "$OUT"
PY=${PY:-python3}
NGPU=$($PY -c "import torch; print(torch.cuda.device_count())")
if [ "$NGPU" -lt 2 ]; then
  echo "gpu_check_multi.sh: NOT RUN (needs 2 GPUs, found $NGPU)" | tee "$OUT/summary.txt"
  exit 2
fi
status=0
run() {  # name, then the pytest arguments
  local name=$1; shift
  $PY -m pytest -q -rs --timeout 900 "$@" 2>&1 | tee "$OUT/$name.log"
  if [ "${PIPESTATUS[0]}" -ne 0 ] || grep -q "SKIPPED" "$OUT/$name.log"; then status=1; fi
}
run nccl_groups tests/nccl_delta/test_gpu.py
if [ "$NGPU" -ge 4 ]; then  # context parallelism: CP2 against one rank, and a failure under CP2 x DP2
  run context_parallel -m gpu tests/training/test_context_parallel.py
else
  run context_parallel -m gpu tests/training/test_context_parallel.py -k "not failure"
fi
run nccl_framing -m gpu tests/nccl_delta/test_framing.py
if [ "$NGPU" -ge 4 ]; then
  run gpu_moves tests/migration/test_gpu_moves.py
else  # the straggler check needs a GPU per rank of its 4
  run gpu_moves tests/migration/test_gpu_moves.py -k "not devices_timelines"
fi
run optimizer_mirror -m gpu tests/migration/test_optimizer_mirror.py
RANKS=2 SWITCH=4 SECTIONS=allreduce
if [ "$NGPU" -ge 4 ]; then RANKS=2,4; SECTIONS=allreduce,replacement; fi
if [ "$NGPU" -ge 8 ]; then RANKS=2,4,8; SWITCH=4,8; fi
$PY benchmarks/comm.py --sections "$SECTIONS" --ranks "$RANKS" --switch-ranks "$SWITCH" --sizes-mb 1,16,64,256 \
  --json "$OUT/comm_gpu.json" 2>&1 | tee "$OUT/comm_gpu.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
echo "gpu_check_multi.sh: $([ $status -eq 0 ] && echo PASSED || echo FAILED) (logs in $OUT)" | tee "$OUT/summary.txt"
exit $status
