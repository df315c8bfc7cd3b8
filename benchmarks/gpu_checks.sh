#!/usr/bin/env bash
# The GPU checks in one call (a lent CUDA machine; see benchmarks/RESULTS.md, "On a GPU"):
# the card and versions, `make test-gpu`, then the kernel benchmarks. Logs go to $OUT (or ./out).
set -u
out=${OUT:-out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
timeout "${TEST_TIMEOUT:-330}" make test-gpu GPU_PY=python3 > "$out/test_gpu.log" 2>&1; echo "make test-gpu rc=$?"
timeout "${BENCH_TIMEOUT:-150}" python3 benchmarks/gpu_kernels.py --json "$out/gpu_kernels.json" > "$out/gpu_kernels.log" 2>&1; echo "gpu_kernels rc=$?"
grep -E "^(FAILED|ERROR)|passed|failed" "$out/test_gpu.log" | tail -n 25
tail -n 14 "$out/gpu_kernels.log"
