#!/usr/bin/env bash
# Optional: the peers `quickdraft bench specbench --peers transformers llama-cpp` compares with.
# llama-cpp-python is compiled here (about 5-15 minutes on 2 cores); its default native flags
# produce a binary that crashes on these CPUs, hence the explicit instruction sets.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh "[peers]"
. .venv/bin/activate
python -c "import llama_cpp" 2>/dev/null || \
  CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_BF16=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON}" \
  python -m pip install -q llama-cpp-python
