#!/usr/bin/env bash
# Regenerates omnirail/v1/*_pb2*.py and omnirail/kserve/*_pb2*.py from protos/. Generated
# code is committed; tests/unit/wire/test_protos_fresh.py fails when this script would
# change it.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-.}"
mkdir -p "$out/omnirail/v1" "$out/omnirail/kserve"
"${PYTHON:-python}" -m grpc_tools.protoc -I protos \
  --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" \
  protos/omnirail/v1/*.proto protos/omnirail/kserve/*.proto
# The KServe messages live in a descriptor pool of their own: their package is the
# protocol's (`inference`), and tritonclient registers the same names from its own file in
# the default pool, so both in one process (a test, an application using both) would
# otherwise fail to import with "duplicate symbol 'inference.ServerLiveRequest'".
sed -i 's/^DESCRIPTOR = _descriptor_pool.Default().AddSerializedFile(/DESCRIPTOR = _descriptor_pool.DescriptorPool().AddSerializedFile(/' \
  "$out/omnirail/kserve/grpc_predict_v2_pb2.py"
grep -q "^DESCRIPTOR = _descriptor_pool.DescriptorPool()" "$out/omnirail/kserve/grpc_predict_v2_pb2.py"
