#!/usr/bin/env bash
# Set up (first time only) and run the demo on the embedded Gemma 3 270M.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
# Speculative generation (hybrid: suffix-tree retrieval, and where it finds no match the EAGLE-3
# head shipped for the embedded model, its paths cut below probability 0.2), then the same prompt
# decoded plainly for the speedup.
quickdraft generate "${1:-Summarize in one sentence: The quick brown fox jumps over the lazy dog. The quick brown fox is fast and the lazy dog sleeps all day. Summary:}" \
  --max-tokens "${2:-128}" --speculative-config '{"method": "hybrid", "drafters": [{"method": "suffix"}, {"method": "eagle3", "top_k": 1, "head_dtype": "bfloat16", "min_draft_prob": 0.2}], "skip_after": 2, "max_draft_tokens": 12}' --compare-plain
