#!/usr/bin/env bash
# Idempotent set-up on a fresh machine: a virtualenv in .venv with the CPU build of torch
# (pinned: an unpinned torch pulls a multi-GB CUDA build) and quickdraft installed editable.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip >/dev/null
python -c "import torch" 2>/dev/null || python -m pip install -q torch==2.13.0
python -m pip install -q -e ".${extras}"
