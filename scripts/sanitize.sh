#!/usr/bin/env bash
# Sanitizer run of the CPU custom calls: builds jaxkv._ffi_cpu with
# -fsanitize=address,undefined (streaming stores off: AddressSanitizer does not check
# _mm_stream_si128 stores), runs the thread pool's standalone test under ASan+UBSan and TSan,
# puts a copy of the package holding the sanitized module first on the path, and runs the ops
# tests under it. Any out-of-bounds access or undefined behaviour in a
# handler aborts the run with a report. CI-able: exits non-zero on a failure.
#
# Usage: scripts/sanitize.sh [--venv DIR] [pytest arguments...]
#   defaults: .venv and the ops test files; e.g. scripts/sanitize.sh tests/ops/ops_test.py -x
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
if [[ "${1:-}" == --venv ]]; then VENV="$2"; shift 2; fi
[[ "$VENV" = /* ]] || VENV="$ROOT/$VENV"
log() { echo "[sanitize] $*" >&2; }

bash "$ROOT/scripts/setup.sh" --venv "$VENV"  # dependencies and the FFI headers
PY="$VENV/bin/python"
CXX="${CXX:-c++}"
HEADERS="$VENV/.jaxkv-ffi-headers/jaxlib-0.10.2"
BUILD="$ROOT/build/sanitize-$(basename "$VENV")"

log "building the CPU handlers with -fsanitize=address,undefined in $BUILD"
cmake -S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_MAKE_PROGRAM="$VENV/bin/ninja" \
  -DCMAKE_CXX_COMPILER="$CXX" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DPython_EXECUTABLE="$PY" -Dpybind11_DIR="$("$PY" -m pybind11 --cmakedir)" \
  -DJAXKV_FFI_INCLUDE_DIR="$HEADERS" -DJAXKV_ENABLE_CUDA=OFF \
  -DJAXKV_SANITIZE=address,undefined >/dev/null
cmake --build "$BUILD" --target _ffi_cpu >/dev/null

# The thread pool on its own (no Python, so ThreadSanitizer works too).
for sanitizers in address,undefined thread; do
  "$CXX" -std=c++17 -O1 -g -fsanitize="$sanitizers" -fno-sanitize-recover=all -I"$ROOT/ffi" \
    "$ROOT/ffi/thread_pool.cc" "$ROOT/ffi/thread_pool_test.cc" -pthread \
    -o "$BUILD/thread_pool_test_${sanitizers//,/_}"
  log "thread pool under -fsanitize=$sanitizers: $("$BUILD/thread_pool_test_${sanitizers//,/_}")"
done

# The package from the source tree with the sanitized module; first on sys.path.
SITE="$BUILD/site"
rm -rf "$SITE" && mkdir -p "$SITE"
cp -r "$ROOT/jaxkv" "$SITE/jaxkv"
find "$SITE/jaxkv" -name '_ffi_*.so' -delete
cp "$BUILD"/_ffi_cpu*.so "$SITE/jaxkv/"

# The ASan runtime must be loaded before anything else in the process (python is not
# instrumented), and libstdc++ with it (else ASan's __cxa_throw interceptor finds nothing to
# wrap and aborts at jaxlib's first C++ exception); leaks are not checked (the interpreter and
# XLA keep memory until exit).
export LD_PRELOAD="$("$CXX" -print-file-name=libasan.so) $("$CXX" -print-file-name=libstdc++.so.6)"
export ASAN_OPTIONS="detect_leaks=0:halt_on_error=1:abort_on_error=1:${ASAN_OPTIONS:-}"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:${UBSAN_OPTIONS:-}"
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
cd "$ROOT"
module="$("$PY" -P -c 'import jaxkv._ffi_cpu as m; print(m.__file__)')"
[[ "$module" == "$SITE"/* ]] || { log "FAILED: imported $module, not the sanitized module"; exit 1; }
log "running the tests against $module"

TARGETS=(tests/ops/ops_test.py tests/ops/ops_dtypes_test.py tests/ops/ops_ids_test.py
         tests/ops/ops_sharding_test.py tests/ops/reshape_ops_test.py tests/ops/reshape_peers_test.py)
for arg in "$@"; do
  [[ "$arg" != -* && -e "${arg%%::*}" ]] && TARGETS=()
done
exec "$PY" -P -m pytest -p no:cacheprovider -q "${TARGETS[@]}" "$@"
