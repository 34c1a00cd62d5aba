#!/usr/bin/env bash
# Prepares the tpu-inference integration test environment (tpu-inference's KV connector
# interfaces and vLLM-TPU's scheduler beside jaxkv); idempotent.
#
# Usage: scripts/setup_tpu_inference.sh [--python PYTHON] [--venv DIR]
#   --python  a Python 3.12 interpreter (default: python3.12; vllm-tpu 0.32.0 ships cp312 only)
#   --venv    environment directory (default: .venv-tpui at the repository root)
#
# Installs vllm-tpu==0.32.0 and tpu-inference==0.32.0 (pinned: the connector API is marked
# experimental) with uv, which resolves them with jax 0.11.2, then NIXL (nixl-cu13, without its
# torch dependency; skipped when no wheel fits the interpreter) and jaxkv's build and test tools,
# then builds jaxkv into it with scripts/setup.sh. This stack cannot share an environment with
# vllm 0.33.0 (torchvision and numba pins differ), hence its own environment. The result is
# large (~10 GB) and needs the package registry once. The tests run with JAX_PLATFORMS=cpu.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON=""
VENV="$ROOT/.venv-tpui"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --python) PYTHON="$2"; shift 2 ;;
    --venv) VENV="$2"; shift 2 ;;
    *) echo "setup_tpu_inference.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
[[ "$VENV" = /* ]] || VENV="$ROOT/$VENV"
if [[ -z "$PYTHON" ]]; then
  # pyenv's python3.12 shim exists even where 3.12 is not the selected version: try it, then
  # pyenv's own 3.12 installs.
  if command -v python3.12 >/dev/null && python3.12 --version >/dev/null 2>&1; then
    PYTHON="$(command -v python3.12)"
  elif command -v pyenv >/dev/null; then
    for candidate in "$(pyenv root)"/versions/3.12*/bin/python3.12; do
      [[ -x "$candidate" ]] && PYTHON="$candidate"
    done
  fi
  [[ -n "$PYTHON" ]] || { echo "[setup-tpu-inference] no Python 3.12 interpreter found" >&2; exit 1; }
fi

log() { echo "[setup-tpu-inference] $*" >&2; }

if [[ ! -x "$VENV/bin/python" ]]; then
  log "creating $VENV with $("$PYTHON" --version 2>&1)"
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
if [[ "$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')" != 3.12 ]]; then
  echo "[setup-tpu-inference] vllm-tpu 0.32.0 needs Python 3.12" >&2
  exit 1
fi

REQS="vllm-tpu==0.32.0 tpu-inference==0.32.0 numpy ml_dtypes absl-py msgspec cbor2 xxhash \
prometheus-client pytest hypothesis ruff==0.17.6 scikit-build-core pybind11 ninja"
STAMP="$VENV/.jaxkv-tpui-requirements"
(
  exec 9>"$VENV/.jaxkv-tpui.lock"
  flock -w 1800 9 || { log "timed out waiting for $VENV/.jaxkv-tpui.lock"; exit 1; }
  if [[ ! -f "$STAMP" || "$(cat "$STAMP")" != "$REQS" ]]; then
    log "installing uv"
    "$PY" -m pip --disable-pip-version-check -q install uv
    log "installing vllm-tpu==0.32.0, tpu-inference==0.32.0 and the test tools (large: ~10 GB)"
    # shellcheck disable=SC2086
    "$VENV/bin/uv" pip install --python "$PY" $REQS
    log "installing nixl-cu13 without its torch dependency"
    "$VENV/bin/uv" pip install --python "$PY" --no-deps "nixl-cu13==1.5.1" \
      || log "NIXL unavailable for this interpreter; skipped"
    echo "$REQS" > "$STAMP"
  fi
  # vLLM's ModelConfig reads the model's config.json even without weights (offline cache).
  bash "$ROOT/scripts/offline_hf_config.sh" "$VENV/hf-home"
)

# jaxkv itself (rebuilt only when its sources changed); setup.sh's own dependency step keeps the
# jax that tpu-inference pinned (pip leaves satisfied requirements alone).
bash "$ROOT/scripts/setup.sh" --python "$PYTHON" --venv "$VENV"
log "ready: $VENV ($("$PY" -c 'import importlib.metadata as m; print("tpu-inference", m.version("tpu-inference"), "jax", m.version("jax"))'))"
