#!/usr/bin/env bash
# The checks that need a CUDA GPU (docs/scale.md, "What is tested where"), in one run:
# the CUDA tests, the quick demo on the GPU, then the GPU-hours benchmark.
#   OUT=gpu-check bash benchmarks/gpu_check.sh        # from the repository root
# Logs and gpu_hours.{csv,md} go to $OUT. Each step has a time limit, so one that hangs
# cannot take the others' time.
set -uo pipefail
PY=${PYTHON:-python3}
OUT=${OUT:-gpu-check}
mkdir -p "$OUT"
fail=0  # every step runs; the exit status says whether any failed
export PYTHONUNBUFFERED=1
if ! $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "gpu_check.sh: PyTorch sees no CUDA device here (torch $($PY -c 'import torch; print(torch.__version__)' 2>/dev/null)); run it on a machine with a GPU and a CUDA build of torch" >&2
    exit 2
fi
$PY -c "import torch, transformers, transformer_lens.utilities; print('torch', torch.__version__, \
'| transformers', transformers.__version__, '|', torch.cuda.get_device_name(0))" 2>&1 | tee "$OUT/device.txt"
# deterministic cuBLAS, so the CUDA-vs-CPU training checks compare like with like
CUBLAS_WORKSPACE_CONFIG=:4096:8 timeout 240 $PY -m pytest -q -p no:cacheprovider -rs -k cuda \
    tests/test_devices.py 2>&1 | tee "$OUT/cuda_tests.log" || fail=1
timeout 150 $PY -m posinterp.cli demo --quick --device cuda --no-progress --out "$OUT/demo" \
    2>&1 | tail -4 | tee "$OUT/demo.log" || fail=1
rm -rf "$OUT/demo"
timeout 300 $PY benchmarks/gpu_hours.py --device cuda --out "$OUT" 2>&1 | tee "$OUT/gpu_hours.log" \
    || fail=1
exit $fail
