#!/usr/bin/env bash
# Optional: the peers `quickdraft bench specbench --peers transformers llama-cpp` compares with.
# llama-cpp-python is compiled here (about 5-15 minutes on 2 cores); its default native flags
# produce a binary that crashes on these CPUs, hence explicit instruction sets: the AVX-512
# ones only where /proc/cpuinfo lists them (a build with them dies with SIGILL on an AVX2-only
# CPU such as AMD Zen 2). CMAKE_ARGS, when set, is used as given.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh "[peers]"
. .venv/bin/activate

cpu_flags() {
  local flags="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
  local have
  have=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || true)
  for pair in avx512f:AVX512 avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16; do
    if [[ " $have " == *" ${pair%%:*} "* ]]; then flags+=" -DGGML_${pair##*:}=ON"; else flags+=" -DGGML_${pair##*:}=OFF"; fi
  done
  echo "$flags"
}

python -c "import llama_cpp" 2>/dev/null || {
  CMAKE_ARGS="${CMAKE_ARGS:-$(cpu_flags)}"
  echo "building llama-cpp-python with CMAKE_ARGS=$CMAKE_ARGS"
  CMAKE_ARGS="$CMAKE_ARGS" python -m pip install -q llama-cpp-python
}
