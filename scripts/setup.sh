#!/usr/bin/env bash
# Creates .venv and installs omnirail with its dev and docs tools. constraints.txt keeps torch on
# the local CPU build (2.13.0) so no CUDA packages are downloaded.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/pip install --quiet --upgrade pip
.venv/bin/pip install --quiet -c constraints.txt -e '.[dev,nixl,ucx,hf,docs]'
