#!/usr/bin/env bash
# Set up (first time only) and run the test suite. Extra arguments go to pytest,
# e.g. `bash scripts/test.sh -m slow` for the real-model tests.  Two pytest-xdist workers by
# default (QUICKDRAFT_TEST_WORKERS=0: one process): many tests are single-threaded Python on tiny
# models, so two share the 2 cores well; the Ray tests stay together on one worker (xdist_group).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh "[test]"
. .venv/bin/activate
python -m pytest -q -n "${QUICKDRAFT_TEST_WORKERS:-2}" --dist loadgroup "$@"
