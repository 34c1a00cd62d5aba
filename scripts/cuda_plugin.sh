#!/usr/bin/env bash
# Names (and with --install installs) the JAX CUDA plugin that matches the CUDA toolkit jaxkv's
# CUDA module was built with: jax[cuda12] for a CUDA 12 toolkit, jax[cuda13] for CUDA 13,
# pinned to the environment's jax version (the plugin must equal jaxlib's version). Without
# it jaxlib sees no GPU, `implementation("auto")` runs the jnp reference and the GPU tests skip.
# Pairing and driver requirements: docs/backends.md#cuda-toolkit-driver-and-plugin.
#
# Usage: scripts/cuda_plugin.sh [VENV] [--install]   (default .venv; run scripts/setup.sh first)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
INSTALL=0
for arg in "$@"; do
  case "$arg" in
    --install) INSTALL=1 ;;
    *) VENV="$arg" ;;
  esac
done
[[ "$VENV" = /* ]] || VENV="$ROOT/$VENV"

# The toolkit CMake used for the module (the build directory of scripts/setup.sh), else the
# nvcc on PATH (what the next build would find).
BUILD_DIR="$ROOT/build/$(basename "$VENV")"
TOOLKIT="$(sed -n 's/^set(CMAKE_CUDA_COMPILER_TOOLKIT_VERSION "\([0-9.]*\)")$/\1/p' \
  "$BUILD_DIR"/CMakeFiles/*/CMakeCUDACompiler.cmake 2>/dev/null | head -n1 || true)"
SOURCE="the build in $BUILD_DIR"
if [[ -z "$TOOLKIT" ]] && command -v nvcc >/dev/null; then
  TOOLKIT="$(nvcc --version | sed -n 's/.*release \([0-9.]*\),.*/\1/p')"
  SOURCE="nvcc on PATH (no CUDA build yet)"
fi
if [[ -z "$TOOLKIT" ]]; then
  echo "[cuda-plugin] no CUDA toolkit found (no CUDA build, no nvcc): the CUDA module is not built" >&2
  exit 1
fi
MAJOR="${TOOLKIT%%.*}"
case "$MAJOR" in
  12) DRIVER="R525 or newer (CUDA 12 minor-version compatibility)" ;;
  13) DRIVER="R580 or newer" ;;
  *)
    echo "[cuda-plugin] CUDA $TOOLKIT (from $SOURCE): JAX ships plugins for CUDA 12 and 13 only" >&2
    exit 1
    ;;
esac
JAX_VERSION="$("$VENV/bin/python" -c 'import jax; print(jax.__version__)')"
REQUIREMENT="jax[cuda${MAJOR}]==${JAX_VERSION}"
echo "[cuda-plugin] CUDA $TOOLKIT (from $SOURCE): install \"$REQUIREMENT\"; needs an NVIDIA driver $DRIVER"
if [[ "$INSTALL" = 1 ]]; then
  "$VENV/bin/python" -m pip --disable-pip-version-check -q install "$REQUIREMENT"
  "$VENV/bin/python" -c 'import jax; print("[cuda-plugin] JAX sees", jax.devices())'
fi
