#!/usr/bin/env bash
# One-GPU checks, run on a machine with one CUDA device (never in CI; a lent device is one GPU, where
# NCCL cannot put two ranks of one communicator). One short script:
#   1. the GPU-marked tests that need one device: training on CUDA with NCCL, the CUDA RNG snapshot and
#      rewind, a CUDA state staged through host memory by the hand-over pair, backend and spec selection,
#      a planned move of a one-rank bf16 job onto a standby warmed in its sandbox on the same GPU,
#      bit-identical to the run without it, the agent's GPU health read through NVML (needs
#      nvidia-ml-py, which the container image has), and the straggler watch's compute time taken on
#      the device's timeline (CUDA events split an iteration into compute and stalls);
#   2. a single-rank training job on CUDA, plain and on TrainMover's communicator (nccl_delta's backend
#      registered on CUDA, its groups of one), whose losses must be bit-identical;
#   3. the unit tests of nccl_delta with CUDA present (the NCCL transport imports, `auto` picks NCCL).
# The multi-GPU checks (NCCL groups, their replacement, moves, the communicator benchmark) are in
# scripts/gpu_check_multi.sh.
# Usage: bash scripts/gpu_check.sh [OUT_DIR]
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${1:-${OUT:-gpu_out}}
mkdir -p "$OUT"
PY=${PY:-python3}
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
$PY -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print('torch', torch.__version__, torch.cuda.get_device_name())" || exit 1
# The project installed (`pip install -e .` maps patches/ to trainmover_ext.patches) with its needs, and etcd.
$PY -c "import megatron.core, pyetcd, trainmover_ext.patches" || {
  echo "gpu_check.sh: install the project first (pip install -e . with megatron-core and etcd-sdk-python)"; exit 1; }
command -v etcd >/dev/null || { echo "gpu_check.sh: no etcd on PATH (apt-get install etcd-server)"; exit 1; }
status=0
# A skip of a one-GPU test is a failure here: the device is present.
$PY -m pytest -q -rs --timeout 600 tests/training/test_gpu.py tests/migration/test_handover_transport.py \
  tests/nccl_delta/test_units.py tests/nccl_delta/test_gpu.py::test_auto_transport_is_nccl_with_cuda \
  tests/migration/test_gpu_moves.py::test_a_planned_move_on_one_gpu_is_bit_identical \
  tests/launch/test_gpu_health.py::test_nvml_reads_every_local_gpu \
  tests/launch/test_device_time.py::test_cuda_events_split_a_gpu_iteration_into_compute_and_stalls \
  tests/migration/test_mirror_copy.py 2>&1 \
  | tee "$OUT/gpu_tests.log"
if [ "${PIPESTATUS[0]}" -ne 0 ] || grep -q "SKIPPED" "$OUT/gpu_tests.log"; then status=1; fi
for comm in native nccl_delta; do
  $PY -m trainmover_ext.cli launch --nproc-per-node 1 pretrain_gpt.py --num-layers 2 --hidden-size 256 \
    --num-attention-heads 8 --seq-length 256 --micro-batch-size 4 --global-batch-size 8 --train-iters 20 \
    --lr 1e-3 --mock-data --bf16 --tm-comm "$comm" \
    --tm-metrics-file "$OUT/gpu_train_$comm.jsonl" 2>&1 | tee "$OUT/gpu_train_$comm.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
done
# TrainMover's communicator (groups of one here) computes exactly what the native backend does.
$PY - "$OUT/gpu_train_native.jsonl" "$OUT/gpu_train_nccl_delta.jsonl" <<'PYEOF' || status=1
import json, sys
runs = [[(r["iteration"], r["loss"]) for r in map(json.loads, open(p)) if "loss" in r] for p in sys.argv[1:]]
same = len(runs[0]) == 20 and runs[0] == runs[1]
print(f"losses native vs nccl_delta over {len(runs[0])} iterations: {'bit-identical' if same else 'DIFFER'}")
sys.exit(0 if same else 1)
PYEOF
echo "gpu_check.sh: $([ $status -eq 0 ] && echo PASSED || echo FAILED) (logs in $OUT)"
exit $status
