#!/usr/bin/env bash
# GPU checks, run on a machine with CUDA (never in CI). One short script:
#   1. the GPU-marked tests (NCCL transport, CUDA device, TransformerEngine spec);
#   2. the demo job's layout parity on NCCL (1 GPU: TP1 vs the same job on gloo is not possible, so
#      it trains the tiny GPT on one GPU with NCCL and checks the loss falls);
#   3. the communicator benchmark on GPU, when it exists;
#   4. nccl_delta's framing on real NCCL links (2+ GPUs): one link's groups kept apart;
#   5. a planned move and a failover of a 2-rank job onto a standby machine of 2 slots (2+ GPUs; with
#      4+ the machine has GPUs of its own and the hand-over runs on an NCCL pair).
# Usage: bash scripts/gpu_check.sh [OUT_DIR]
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${1:-${OUT:-gpu_out}}
mkdir -p "$OUT"
PY=${PY:-python3}
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
$PY -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print('torch', torch.__version__, torch.cuda.get_device_name())" || exit 1
status=0
$PY -m pytest -q -m gpu --timeout 600 2>&1 | tee "$OUT/gpu_tests.log" || status=1
$PY -m trainmover_ext.cli launch --nproc-per-node 1 pretrain_gpt.py --num-layers 2 --hidden-size 256 \
  --num-attention-heads 8 --seq-length 256 --micro-batch-size 4 --global-batch-size 8 --train-iters 20 \
  --lr 1e-3 --mock-data --bf16 --hidden-dropout 0 --attention-dropout 0 \
  --tm-metrics-file "$OUT/gpu_train.jsonl" 2>&1 | tee "$OUT/gpu_train.log" || status=1
# nccl_delta: the NCCL transport's collective tests (need 2 GPUs; they skip, and say so, on 1), then
# the communicator benchmark: all-reduce against NCCL's own (with bus bandwidth) on as many ranks as
# there are GPUs, the switch, and the training ratio.
$PY -m pytest -q -rs --timeout 600 tests/nccl_delta/test_gpu.py tests/nccl_delta/test_units.py 2>&1 \
  | tee "$OUT/nccl_delta_tests.log" || status=1
NGPU=$($PY -c "import torch; print(torch.cuda.device_count())")
# Groups kept apart on real NCCL links (framing, tests/nccl_delta/test_framing.py -m gpu): needs 2 GPUs.
# With 2+ a skip is a failure; with fewer it is reported as not run, never as passed.
if [ "$NGPU" -ge 2 ]; then
  $PY -m pytest -q -rs --timeout 600 -m gpu tests/nccl_delta/test_framing.py 2>&1 | tee "$OUT/nccl_framing.log"
  if [ "${PIPESTATUS[0]}" -ne 0 ] || grep -q "skipped" "$OUT/nccl_framing.log"; then status=1; fi
else
  echo "nccl framing on NCCL links: NOT RUN (needs 2 GPUs, found $NGPU)" | tee "$OUT/nccl_framing.log"
fi
# A planned move and a failover on NCCL (tests/migration/test_gpu_moves.py): needs 2 GPUs.
if [ "$NGPU" -ge 2 ]; then
  $PY -m pytest -q -rs --timeout 900 tests/migration/test_gpu_moves.py 2>&1 | tee "$OUT/gpu_moves.log"
  if [ "${PIPESTATUS[0]}" -ne 0 ] || grep -q "skipped" "$OUT/gpu_moves.log"; then status=1; fi
else
  echo "planned move and failover on NCCL: NOT RUN (needs 2 GPUs, found $NGPU)" | tee "$OUT/gpu_moves.log"
fi
RANKS=$([ "$NGPU" -ge 4 ] && echo 2,4 || echo 2)
$PY benchmarks/comm.py --quick --ranks "$RANKS" --sizes-mb 1,16,64,256 --json "$OUT/comm_gpu.json" 2>&1 \
  | tee "$OUT/comm_gpu.log" || status=1
exit $status
