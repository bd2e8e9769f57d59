#!/usr/bin/env bash
# Set up (first time only), then lint, check formatting and type-check (settings in pyproject.toml:
# ruff at 120 columns over the package, tests, benchmarks and scripts; mypy over the engine,
# verification, cache and drafter packages). `ruff format` fixes what the format check finds.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh "[test]"
. .venv/bin/activate
ruff check quickdraft tests benchmarks scripts
ruff format --check quickdraft tests benchmarks scripts
mypy
