#!/usr/bin/env bash
# Sets up .venv and runs everything CI runs: lint, import layers, the documentation site
# (mkdocs --strict: a broken link, a missing page or an undescribed config field fails),
# generated-code freshness, all tests.
# Each relay backend's conformance run gets its own pytest process: nixl and ucxx each
# bring their own UCX build, and tests need not load both into one interpreter (stage
# processes load only the backends their edges use).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
command -v ip >/dev/null || { apt-get install -y -q iproute2 >/dev/null 2>&1 || true; }
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/python scripts/lint_layers.py   # import-linter contracts: layers, no cycles
site=$(mktemp -d)
# Not --quiet: it hides the warnings --strict counts, and the build passes whatever they say.
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --site-dir "$site"
rm -rf "$site"
pytest=(.venv/bin/python -m pytest -q -ra -p no:cacheprovider)
backends=(shm nixl ucx torchdist)
ignore=(--ignore=tests/relay_conformance)
for backend in "${backends[@]}"; do
  ignore+=("--ignore=tests/unit/relay/test_$backend.py")
  ignore+=("--ignore=tests/fuzz/test_relay_descriptor_fuzz_$backend.py")
done
"${pytest[@]}" "${ignore[@]}" "$@"
for backend in "${backends[@]}"; do
  unit=()
  for f in tests/unit/relay/test_$backend.py tests/fuzz/test_relay_descriptor_fuzz_$backend.py; do
    [[ -f $f ]] && unit+=("$f")
  done
  "${pytest[@]}" tests/relay_conformance "${unit[@]}" -k "$backend"
done
