#!/usr/bin/env bash
# Set up (first time only) and run the demo on the embedded Gemma 3 270M.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
quickdraft generate "${1:-The three most important ideas in computer science are}" --max-tokens "${2:-64}"
