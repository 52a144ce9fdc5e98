#!/usr/bin/env bash
# Every GPU test and GPU benchmark in one command of at most 9 minutes (the steps' limits add up
# to 535 s), for a session that is lent a GPU; ONLY (a space-separated list of step names) runs
# a subset. Run from the repository root on the GPU machine:
#     bash bench/gpu_check.sh            # results under $OUT (default ./gpu_check_out)
#     ONLY="tune engine_9b" bash bench/gpu_check.sh
# It installs nothing: PY (default python3) must have a CUDA torch, triton and the project's
# dependencies; the checkout is put on PYTHONPATH. What only a GPU can check runs here: the
# kernels' results and speed on the device, CUDA graphs and torch.compile on CUDA (the engine
# steps), and bench/tune_kernels.py's timing of candidate tiles, whose fastest it prints as table
# entries to write back (every kernel's build for every target is checked without a GPU, in CI:
# python -m sala.compile_check). The last block is a summary of every step and every figure.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_check_out}
mkdir -p "$OUT"
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PY:-python3}
"$PY" -c "import torch, triton; assert torch.cuda.is_available(), 'no CUDA'" || { echo "$PY: needs CUDA torch and triton"; exit 2; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
status=0
summary=()
step() {  # name, time limit in seconds, command...
  local name=$1 limit=$2
  shift 2
  [[ -z "${ONLY:-}" || " $ONLY " == *" $name "* ]] || return 0
  echo "=== $name"
  local start=$SECONDS
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: exit $rc"
  summary+=("$(printf '%-16s exit %-3s %4ss of %ss' "$name" "$rc" "$((SECONDS - start))" "$limit")")
  [ "$rc" = 0 ] || status=1
}
step gpu_tests 100 "$PY" -m pytest -q -m gpu tests/kernels tests/engine
step tune 80 "$PY" bench/tune_kernels.py
step nvfp4_gemm 40 "$PY" bench/nvfp4_gemm_gpu.py
step paged_attention 40 "$PY" bench/paged_attention_gpu.py
step kv_attention 50 "$PY" bench/kv_attention_gpu.py
step kv_decode 60 "$PY" bench/kv_decode.py
step prefill_kernels 45 "$PY" bench/prefill_kernels_gpu.py
step engine_9b 120 "$PY" bench/engine_gpu.py --batches 1 8 32 64
echo
echo "=== summary ($(head -2 "$OUT/gpu.txt" | tail -1))"
printf '%s\n' "${summary[@]}"
grep -h -E '^(ratio|  kernels/)' "$OUT"/*.log || true
grep -h '^{' "$OUT"/*.log | tee "$OUT/results.jsonl" || true
exit $status
