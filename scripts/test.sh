#!/usr/bin/env bash
# Sets up .venv and runs everything CI runs: lint, generated-code freshness, all tests.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/python -m pytest -q -ra "$@"
