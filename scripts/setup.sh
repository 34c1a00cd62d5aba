#!/usr/bin/env bash
# Prepares a virtual environment with jaxkv built and installed; idempotent.
#
# Usage: scripts/setup.sh [--python PYTHON] [--venv DIR] [--no-nixl] [--no-editable]
#   --python      interpreter for the environment (default: python3)
#   --venv        environment directory (default: .venv at the repository root)
#   --no-nixl     skip the optional NIXL install
#   --no-editable install a copy of the package (default: a development install, below)
#
# The environment gets the newest jax that the interpreter supports (0.10.2 on Python 3.11),
# the build and test tools (pytest, and pytest-xdist to run test files in parallel), NIXL
# without torch (its wheel declares torch but its Python API does not use it),
# prometheus-client (the optional metrics export, so that its tests run),
# matplotlib (the `demo` extra: jaxkv-demo --plot_out), ruff and mypy (the linter and the type
# checker CI runs), and jaxkv itself, rebuilt only when its sources changed. The custom calls
# are compiled against the XLA FFI headers of jaxlib 0.10.2, the oldest supported jaxlib.
#
# jaxkv is installed for development (scikit-build-core's editable mode): the Python modules
# are imported from this source tree, the compiled modules from the environment, so
# `python -m jaxkv.demo` works from the repository root too and Python edits need no
# reinstall (C++/CUDA edits do: re-run this script).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON=python3
VENV="$ROOT/.venv"
WITH_NIXL=1
EDITABLE=1
while [[ $# -gt 0 ]]; do
  case "$1" in
    --python) PYTHON="$2"; shift 2 ;;
    --venv) VENV="$2"; shift 2 ;;
    --no-nixl) WITH_NIXL=0; shift ;;
    --no-editable) EDITABLE=0; shift ;;
    *) echo "setup.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
[[ "$VENV" = /* ]] || VENV="$ROOT/$VENV"
FFI_JAXLIB=0.10.2

log() { echo "[setup] $*" >&2; }

if [[ ! -x "$VENV/bin/python" ]]; then
  log "creating $VENV with $("$PYTHON" --version 2>&1)"
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
# One set-up at a time per environment: concurrent test runs would otherwise build into the
# same build directory and install over each other.
exec 9>"$VENV/.jaxkv-setup.lock"
flock -w 1800 9 || { echo "[setup] timed out waiting for $VENV/.jaxkv-setup.lock" >&2; exit 1; }
PIP=("$PY" -m pip --disable-pip-version-check -q)

# 1. Dependencies (pip is a no-op when they are already satisfied).
REQS_STAMP="$VENV/.jaxkv-requirements"
REQS="jax jaxlib numpy ml_dtypes absl-py msgspec cbor2 xxhash prometheus-client pytest pytest-xdist hypothesis matplotlib ruff==0.17.6 mypy==2.4.1 scikit-build-core pybind11 ninja mkdocs mkdocstrings[python]"
if [[ ! -f "$REQS_STAMP" || "$(cat "$REQS_STAMP")" != "$REQS $WITH_NIXL" ]]; then
  log "installing dependencies"
  "${PIP[@]}" install --upgrade pip
  # shellcheck disable=SC2086
  "${PIP[@]}" install $REQS
  if [[ "$WITH_NIXL" = 1 ]]; then
    log "installing nixl-cu13 without its torch dependency"
    "${PIP[@]}" install --no-deps "nixl-cu13>=1.5" || log "NIXL unavailable for this interpreter; skipped"
  fi
  echo "$REQS $WITH_NIXL" > "$REQS_STAMP"
fi

# 2. XLA FFI headers of the oldest supported jaxlib.
HEADERS="$VENV/.jaxkv-ffi-headers/jaxlib-$FFI_JAXLIB"
if [[ ! -f "$HEADERS/xla/ffi/api/ffi.h" ]]; then
  if [[ "$("$PY" -c 'import jaxlib; print(jaxlib.__version__)')" == "$FFI_JAXLIB" ]]; then
    mkdir -p "$(dirname "$HEADERS")"
    ln -sfn "$("$PY" -c 'import os, jaxlib; print(os.path.join(os.path.dirname(jaxlib.__file__), "include"))')" "$HEADERS"
  else
    log "fetching the FFI headers of jaxlib $FFI_JAXLIB"
    WHEELS="$(mktemp -d)"
    "${PIP[@]}" download --no-deps --only-binary=:all: -d "$WHEELS" "jaxlib==$FFI_JAXLIB"
    "$PY" - "$WHEELS" "$HEADERS" <<'PYEOF'
import pathlib, sys, zipfile
wheel = next(pathlib.Path(sys.argv[1]).glob("jaxlib-*.whl"))
target = pathlib.Path(sys.argv[2])
with zipfile.ZipFile(wheel) as archive:
    for name in archive.namelist():
        if name.startswith("jaxlib/include/xla/ffi/"):
            out = target / name[len("jaxlib/include/"):]
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(archive.read(name))
PYEOF
    rm -rf "$WHEELS"
  fi
fi

# 3. jaxkv itself, rebuilt only when its sources changed.
SOURCES_HASH="$(cd "$ROOT" && find jaxkv ffi CMakeLists.txt pyproject.toml -type f \
  \( -name '*.py' -o -name '*.h' -o -name '*.cc' -o -name '*.cu' -o -name '*.txt' -o -name '*.toml' \) \
  -print0 | sort -z | xargs -0 sha256sum | sha256sum | cut -d' ' -f1)"
BUILD_STAMP="$VENV/.jaxkv-build"
INSTALL=(.)
[[ "$EDITABLE" = 1 ]] && INSTALL=(--editable .)
if [[ ! -f "$BUILD_STAMP" || "$(cat "$BUILD_STAMP")" != "$SOURCES_HASH ${INSTALL[*]}" ]]; then
  log "building and installing jaxkv (${INSTALL[*]})"
  (cd "$ROOT" && "${PIP[@]}" install --no-build-isolation --no-deps \
    -C "cmake.define.JAXKV_FFI_INCLUDE_DIR=$HEADERS" \
    -C "build-dir=build/$(basename "$VENV")" "${INSTALL[@]}")
  echo "$SOURCES_HASH ${INSTALL[*]}" > "$BUILD_STAMP"
fi
log "ready: $VENV ($("$PY" -c 'import jax; print("jax", jax.__version__)'))"
