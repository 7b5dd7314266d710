#!/bin/sh
# Runs inside the Dockerfile's build stages (not on the host): installs into /opt/omnirail
# either offline from the wheelhouse bind-mounted at /ctx/.wheelhouse or from the indexes.
#   omnirail-pip-install deps       the dependencies of omnirail[$EXTRAS], pinned
#   omnirail-pip-install omnirail   omnirail itself, --no-deps; its files also under /out
# Env (build args): EXTRAS, TORCH (cpu|cuda), WHEELHOUSE (auto|yes|no), TORCH_CPU_INDEX.
set -eu
cd /src
pip=/opt/omnirail/bin/pip
wheels=/ctx/.wheelhouse

offline=no
if [ "${WHEELHOUSE:-auto}" != no ] && ls "$wheels"/*.whl >/dev/null 2>&1; then
  offline=yes
elif [ "${WHEELHOUSE:-auto}" = yes ]; then
  echo "WHEELHOUSE=yes but the build context has no .wheelhouse/*.whl" >&2
  exit 1
fi

case "$1" in
deps)
  # Requirements straight from pyproject.toml, so this step needs no omnirail build.
  /opt/omnirail/bin/python -c '
import sys, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
extras = [e for e in sys.argv[1].split(",") if e.strip()]
reqs = list(project["dependencies"])
for extra in extras:
    reqs += project["optional-dependencies"][extra.strip()]
print("\n".join(reqs))
' "${EXTRAS:-}" >/tmp/requirements.txt
  if [ $offline = yes ]; then
    echo "installing dependencies offline from the wheelhouse (TORCH is what it holds)"
    $pip install --no-index --find-links "$wheels" -c constraints.txt -r /tmp/requirements.txt
  else
    case "${TORCH:-cpu}" in
    # torch first from the CPU index; the constraint's ==X.Y.Z matches X.Y.Z+cpu.
    cpu) $pip install -c constraints.txt --index-url "$TORCH_CPU_INDEX" torch ;;
    cuda) ;;
    *) echo "TORCH must be cpu or cuda, not ${TORCH}" >&2; exit 1 ;;
    esac
    $pip install -c constraints.txt -r /tmp/requirements.txt
  fi
  ;;
omnirail)
  if [ $offline = yes ]; then
    set -- "$wheels"/omnirail-*.whl
    [ $# -eq 1 ] || { echo "expected one omnirail wheel in the wheelhouse: $*" >&2; exit 1; }
    $pip install --no-index --no-deps "$1"
  else
    $pip install --no-deps .
  fi
  $pip check
  # Its files alone (RECORD: packages, bytecode, bin/omnirail) under /out, so the final
  # stage adds a small layer on top of the cached dependencies instead of a new venv copy.
  /opt/omnirail/bin/python -c '
import importlib.metadata, pathlib, shutil
dist = importlib.metadata.distribution("omnirail")
for f in dist.files:
    src = pathlib.Path(dist.locate_file(f)).resolve()
    if src.is_file():
        dst = pathlib.Path("/out" + str(src))
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst)
'
  ;;
*)
  echo "usage: $0 deps|omnirail" >&2
  exit 2
  ;;
esac
rm -f /tmp/requirements.txt
