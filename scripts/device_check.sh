#!/usr/bin/env bash
# Every GPU test and GPU benchmark variant in one call, with a summary, within 10 minutes: what
# the first CUDA machine lent to the project runs to verify what CPU hosts cannot (CUDA
# tensors through every relay, GPU placement, tensor parallelism over NCCL on 2 GPUs, the vLLM
# stages on vLLM's CUDA build, the relay benchmark on the GPU).
#
#   scripts/device_check.sh            # prints one line per check, then the summary
#   OUT=DIR scripts/device_check.sh    # also writes DIR/device_check.json and each check's log
#
# Without a CUDA device it says so and exits 0 (nothing to check). A check whose requirement is
# missing (a second GPU, vLLM's CUDA build) is reported as skipped with the reason, never as
# passed. Python: $PYTHON, else .venv/bin/python, else python3 (which must hold torch with
# CUDA and omnirail's dependencies; install them from wheels you bring, nothing is downloaded).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-}
if [[ -z $PY ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"

gpus=$("$PY" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>/dev/null || echo 0)
if [[ $gpus == 0 ]]; then
  echo "device_check: no CUDA device visible to $PY: nothing to check (skipped)"
  exit 0
fi
echo "device_check: $gpus CUDA device(s); python $("$PY" -c 'import sys; print(sys.version.split()[0])'); logs in $OUT"

results=()
failed=0
# check NAME SECONDS COMMAND...: runs it with a time limit; pass, fail, or skip when the
# command printed "SKIP: reason" and exited 0 without running anything.
check() {
  local name=$1 limit=$2
  shift 2
  local log="$OUT/$name.log" start=$SECONDS status
  timeout "$limit" "$@" >"$log" 2>&1
  local rc=$?
  local took=$((SECONDS - start))
  if [[ $rc == 0 ]] && grep -q '^SKIP: ' "$log"; then
    status="skip ($(grep -m1 '^SKIP: ' "$log" | cut -c7-))"
  elif [[ $rc == 0 ]] && grep -qE '^[0-9]+ skipped' "$log" && ! grep -qE '[0-9]+ passed' "$log"; then
    status="skip (pytest skipped every test: $(grep -m1 -oE 'SKIPPED.*' "$log" | head -c 120))"
  elif [[ $rc == 0 ]]; then
    status=pass
  elif [[ $rc == 124 ]]; then
    status="fail (over ${limit}s)"
    failed=1
  else
    status="fail (exit $rc; see $log)"
    failed=1
  fi
  printf '%-24s %5ss  %s\n' "$name" "$took" "$status"
  results+=("{\"check\": \"$name\", \"seconds\": $took, \"status\": \"${status//\"/\'}\"}")
}

pytest=("$PY" -m pytest -q -ra -p no:cacheprovider)
needs() {  # needs MODULE REASON: prints SKIP when MODULE does not import
  "$PY" -c "import $1" 2>/dev/null || { echo "SKIP: $2"; return 1; }
}

# CUDA tensors through every relay backend (the conformance suite's device=cuda cases).
for backend in shm nixl ucx torchdist; do
  check "relay-$backend-cuda" 150 "${pytest[@]}" tests/relay_conformance -k "$backend and cuda"
done
# A stage placed on a GPU, and the CPU fallback when CUDA is absent (skipped here).
check placement 120 "${pytest[@]}" tests/integration/test_placement.py
# Tensor parallelism over NCCL: two ranks on two GPUs give what one gives.
if [[ $gpus -ge 2 ]]; then
  check tensor-parallel-2gpu 180 "${pytest[@]}" tests/integration/test_tensor_parallel.py
else
  check tensor-parallel-2gpu 5 echo "SKIP: needs 2 CUDA devices, this host has $gpus"
fi
# The vLLM stages on vLLM's CUDA build (the vllm extra): the LLM stage and the Qwen3-Omni
# thinker on GPU 0 (float32, so that tokens still equal transformers').
if needs vllm "vLLM is not installed (pip install 'omnirail[vllm]')" >"$OUT/vllm-probe.log"; then
  check vllm-llm-stage-cuda 240 env OMNIRAIL_VLLM_GPU=1 "${pytest[@]}" tests/integration/test_vllm_llm.py
  check vllm-qwen3-thinker-cuda 240 env OMNIRAIL_VLLM_GPU=1 "${pytest[@]}" tests/integration/test_qwen3_omni_vllm.py
else
  check vllm-llm-stage-cuda 5 cat "$OUT/vllm-probe.log"
  check vllm-qwen3-thinker-cuda 5 cat "$OUT/vllm-probe.log"
fi
# The relay benchmark with the tensors on the GPU (JSON in the log).
check bench-relay-shm-cuda 120 "$PY" -m omnirail bench relay --backend shm --device cuda --sizes 1048576,67108864

printf '%s\n' "${results[@]}" | "$PY" -c 'import json, sys; print(json.dumps([json.loads(l) for l in sys.stdin], indent=1))' >"$OUT/device_check.json"
echo "device_check: $(grep -c '"pass"' "$OUT/device_check.json") passed, $(grep -c '"fail' "$OUT/device_check.json") failed, $(grep -c '"skip' "$OUT/device_check.json") skipped"
exit $failed
