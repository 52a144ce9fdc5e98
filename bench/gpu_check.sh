#!/usr/bin/env bash
# Every GPU test and GPU benchmark in one run, for a session that is lent a GPU. The steps'
# time limits add up to 12.5 minutes, more than one 10-minute device command: run it in two
# parts with ONLY (a space-separated list of step names) if one run does not fit. Run from the
# repository root on the GPU machine:
#     bash bench/gpu_check.sh            # results under $OUT (default ./gpu_check_out)
#     ONLY="gpu_tests kv_attention" bash bench/gpu_check.sh
# It installs nothing: PY (default python3) must have a CUDA torch, triton and the project's
# dependencies; the checkout is put on PYTHONPATH.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_check_out}
mkdir -p "$OUT"
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PY:-python3}
"$PY" -c "import torch, triton; assert torch.cuda.is_available(), 'no CUDA'" || { echo "$PY: needs CUDA torch and triton"; exit 2; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
status=0
step() {  # name, timeout seconds, command...
  local name=$1 limit=$2
  shift 2
  [[ -z "${ONLY:-}" || " $ONLY " == *" $name "* ]] || return 0
  echo "=== $name"
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: exit $rc"
  [ "$rc" = 0 ] || status=1
}
step gpu_tests 150 "$PY" -m pytest -q -m gpu tests/test_paged_attention.py tests/test_kv_kernels.py tests/test_nvfp4_gemm.py tests/test_engine.py tests/test_sampling_controls.py tests/test_block_sparse_attention.py tests/test_prefill_kernels.py
step nvfp4_gemm 60 "$PY" bench/nvfp4_gemm_gpu.py
step paged_attention 60 "$PY" bench/paged_attention_gpu.py
step kv_attention 90 "$PY" bench/kv_attention_gpu.py
step kv_decode 120 "$PY" bench/kv_decode.py
step prefill_kernels 90 "$PY" bench/prefill_kernels_gpu.py
step engine_9b 180 "$PY" bench/engine_gpu.py
grep -h '^{' "$OUT"/*.log > "$OUT/results.jsonl" || true
exit $status
