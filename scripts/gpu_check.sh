#!/usr/bin/env bash
# On a CUDA machine: run the Triton kernel tests natively (no interpreter) and the kernel
# microbenchmark; everything goes under $OUT (default ./gpu_check_out), flat, at most 6 files.
# Needs python with torch (CUDA) + triton + pytest; the package is used from this checkout.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu_check_out}"
mkdir -p "$OUT"
if [ -n "${PYTHON:-}" ]; then PY="$PYTHON"
elif python3 -c "import torch, triton; assert torch.cuda.is_available()" 2>/dev/null; then PY=python3
else PY=.venv/bin/python; fi
unset TRITON_INTERPRET
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

{
  echo "date: $(date -u +%FT%TZ)"; echo "python: $PY"; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1
  "$PY" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__); print('device', torch.cuda.get_device_name(0))"
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

# Kernel tests natively. --confcutdir keeps the repo-level conftest (real engine fixtures) out; the
# engine test needs the packaged model and pytest-asyncio, so only the kernel-level files run here.
"$PY" -m pytest -q -p no:cacheprovider --confcutdir tests/kernels \
  tests/kernels/test_view_attention_triton.py tests/kernels/test_kernel_bench.py \
  --junitxml "$OUT/kernel_tests.xml" 2>&1 | tee "$OUT/kernel_tests.log"
tests_rc=${PIPESTATUS[0]}

"$PY" -m benchmarks.kernel_bench --out "$OUT" 2>&1 | tee "$OUT/kernel_bench.log"
bench_rc=${PIPESTATUS[0]}

echo "kernel tests rc=$tests_rc, bench rc=$bench_rc"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
