#!/usr/bin/env bash
# Set up (first time only) and run the demo on the embedded Gemma 3 270M.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
# Speculative generation (n-gram prompt lookup), then the same prompt decoded plainly for the speedup.
quickdraft generate "${1:-Summarize in one sentence: The quick brown fox jumps over the lazy dog. The quick brown fox is fast and the lazy dog sleeps all day. Summary:}" \
  --max-tokens "${2:-128}" --speculative-config '{"method": "ngram", "num_speculative_tokens": 5}' --compare-plain
