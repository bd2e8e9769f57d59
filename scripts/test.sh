#!/usr/bin/env bash
# Set up (first time only) and run the test suite. Extra arguments go to pytest,
# e.g. `bash scripts/test.sh -m slow` for the real-model tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh "[test]"
. .venv/bin/activate
python -m pytest -q "$@"
