#!/usr/bin/env bash
# The CUDA checks, on a machine with a GPU and a CUDA build of torch, from the repository root:
# tests/engine/test_cuda.py (skipped where there is no GPU, as in CI), then
# benchmarks/cuda_invariance.py (which torch operations keep a row's bits whatever the batch,
# and a Gemma-3-270M-shaped forward's cost). Logs go to $OUT (default /tmp/cuda-check).
# EXTRA_PYTHONPATH: packages the machine lacks (e.g. gguf), as a folder to put on the path.
set -uo pipefail
OUT=${OUT:-/tmp/cuda-check}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${EXTRA_PYTHONPATH:+:$EXTRA_PYTHONPATH}" PYTHONUNBUFFERED=1
PYTHON=${PYTHON:-python3}
"$PYTHON" -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
"$PYTHON" -m pytest tests/engine/test_cuda.py -p no:cacheprovider -q -rfE -n "${WORKERS:-4}" \
  --junitxml "$OUT/cuda-tests.xml" 2>&1 | tee "$OUT/cuda-tests.log"
tests_status=${PIPESTATUS[0]}
"$PYTHON" benchmarks/cuda_invariance.py 2>&1 | tee "$OUT/cuda-invariance.log"
exit "$tests_status"
