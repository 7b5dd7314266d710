#!/usr/bin/env bash
# Builds the wheelhouse the Dockerfile installs from offline: .wheelhouse/ in the build
# context, holding an omnirail wheel and a wheel of every dependency of
# omnirail[$WHEELHOUSE_EXTRAS] (torch as constraints.txt pins it: the CPU build on these
# machines), made on the host so the image build needs no network.
#
# Cached: dependencies are fetched again only when pyproject.toml, constraints.txt, the
# extras or the interpreter change (a fresh directory then, so no stale wheels ride along);
# the omnirail wheel is rebuilt whenever a source file changes.
#   scripts/container/wheelhouse.sh [--force]
set -euo pipefail
cd "$(dirname "$0")/../.."

out=.wheelhouse
# The Dockerfile's default EXTRAS, so a plain build finds every wheel it installs.
extras=${WHEELHOUSE_EXTRAS:-$(sed -n 's/^ARG EXTRAS=\(.*\)$/\1/p' Dockerfile | head -1)}
say() { echo "[wheelhouse.sh] $*" >&2; }

# The image's interpreter is Debian bookworm's python3 (3.11, glibc 2.36): the host's must
# be the same minor version, so pip picks matching wheels.
python=${PYTHON:-}
if [[ -z $python ]]; then
  if [[ -x .venv/bin/python ]]; then python=.venv/bin/python; else python=python3; fi
fi
pyver=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
[[ $pyver == 3.11 ]] || { say "need Python 3.11 like the image, $python is $pyver (set PYTHON=)"; exit 1; }
pip=("$python" -m pip --disable-pip-version-check)
# Runs pip, dropping the warnings a machine's pip.conf may cause for file:// indexes that
# lack a package (one line per package).
run_pip() { "${pip[@]}" "$@" 2> >(grep -v "^WARNING: Location 'file:" >&2); }

[[ ${1:-} == --force ]] && rm -rf "$out"

sources=(pyproject.toml README.md omnirail coordinator stage_service relay)
hash_files() {
  find "$@" -type f ! -path '*/__pycache__/*' ! -name '*.pyc' -print0 | sort -z |
    xargs -0 sha256sum | sha256sum | cut -c1-16
}
deps_key="$(cat pyproject.toml constraints.txt | sha256sum | cut -c1-16)-$extras-py$pyver"
src_key=$(hash_files "${sources[@]}")

# pip builds omnirail from a clean copy: an in-tree build leaves build/ in the checkout,
# and setuptools' build/ keeps files that were deleted from the sources.
tmp=$(mktemp -d /tmp/ctr_omnirail_src.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
tar -c --exclude=__pycache__ --exclude='*.pyc' "${sources[@]}" | tar -x -C "$tmp"

if [[ $(cat "$out/.stamp-deps" 2>/dev/null) != "$deps_key" ]]; then
  say "fetching dependencies of omnirail[$extras] (constraints.txt)"
  rm -rf "$out"
  mkdir -p "$out"
  started=$SECONDS
  # Builds the omnirail wheel too, from the same copy as the step below would.
  run_pip wheel --quiet -c constraints.txt -w "$out" "${tmp}[${extras}]"
  echo "$deps_key" >"$out/.stamp-deps"
  echo "$src_key" >"$out/.stamp-omnirail"
  say "dependencies: $(find "$out" -name '*.whl' | wc -l) wheels in $((SECONDS - started)) s"
fi

if [[ $(cat "$out/.stamp-omnirail" 2>/dev/null) != "$src_key" ]] || ! ls "$out"/omnirail-*.whl >/dev/null 2>&1; then
  say "building the omnirail wheel"
  rm -f "$out"/omnirail-*.whl
  run_pip wheel --quiet --no-deps -w "$out" "$tmp"
  echo "$src_key" >"$out/.stamp-omnirail"
fi

say "$out: $(find "$out" -name '*.whl' | wc -l) wheels, $(du -sh "$out" | cut -f1)"
