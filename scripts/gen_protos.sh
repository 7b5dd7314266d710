#!/usr/bin/env bash
# Regenerates omnirail/v1/*_pb2*.py and omnirail/kserve/*_pb2*.py from protos/. Generated code is committed;
# tests/unit/wire/test_protos_fresh.py fails when this script would change it.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-.}"
mkdir -p "$out/omnirail/v1" "$out/omnirail/kserve"
"${PYTHON:-python}" -m grpc_tools.protoc -I protos \
  --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" \
  protos/omnirail/v1/*.proto protos/omnirail/kserve/*.proto
