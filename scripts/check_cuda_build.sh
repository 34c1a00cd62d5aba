#!/usr/bin/env bash
# CUDA compile check: where nvcc exists, the environment's jaxkv must contain the CUDA module,
# built for sm_80 and sm_90, registering every custom-call target. Runs no GPU code. Ends by
# naming the JAX CUDA plugin that matches the toolkit the module was built with
# (scripts/cuda_plugin.sh).
#
# Usage: scripts/check_cuda_build.sh [VENV]   (default .venv; scripts/setup.sh builds it)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-$ROOT/.venv}"
[[ "$VENV" = /* ]] || VENV="$ROOT/$VENV"
if ! command -v nvcc >/dev/null; then
  echo "[cuda-check] nvcc not found: CUDA handlers are not built on this machine; skipped"
  exit 0
fi
BUILD_DIR="$ROOT/build/$(basename "$VENV")"
for arch in 80 90; do
  if ! grep -q "arch=compute_${arch},code=\[compute_${arch},sm_${arch}\]" "$BUILD_DIR/build.ninja"; then
    echo "[cuda-check] FAILED: no sm_${arch} code generation in $BUILD_DIR/build.ninja" >&2
    exit 1
  fi
done
(cd /tmp && "$VENV/bin/python" - <<'PY'
import pathlib, subprocess
import jaxkv._ffi_cuda as cuda_module
from jaxkv._ffi import CUSTOM_CALL_TARGETS
targets = set(cuda_module.registrations())
assert targets == set(CUSTOM_CALL_TARGETS), f"CUDA module registers {sorted(targets)}"
sections = subprocess.run(["readelf", "-S", cuda_module.__file__], check=True,
                          capture_output=True, text=True).stdout
assert ".nv_fatbin" in sections, "the CUDA module holds no device code"
print(f"[cuda-check] OK: {pathlib.Path(cuda_module.__file__).name} registers "
      f"{len(targets)} targets, device code for sm_80 and sm_90")
PY
)
"$ROOT/scripts/cuda_plugin.sh" "$VENV"
