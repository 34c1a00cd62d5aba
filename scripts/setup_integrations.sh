#!/usr/bin/env bash
# Prepares the integration test environment (vLLM's scheduler and connector API beside jaxkv);
# idempotent.
#
# Usage: scripts/setup_integrations.sh [--python PYTHON] [--venv DIR]
#   --python  a Python 3.11 interpreter (default: python3.11)
#   --venv    environment directory (default: .venv-vllm at the repository root)
#
# Installs vllm==0.33.0 (pinned: its KV connector API is marked experimental), jax/jaxlib
# 0.10.2, nixl-cu13 and jaxkv's build and test tools with uv, then builds jaxkv into it with
# scripts/setup.sh. vLLM 0.33.0 requires a certifi release newer than the registry's newest,
# so certifi is overridden (uv's --override); plain pip cannot resolve vllm==0.33.0. The result
# is large (~9 GB: vLLM pins a CUDA build of torch) and needs the package registry once.
#
# vLLM's ModelConfig reads the model's config.json even when no weights are loaded. The tests
# run offline, so a hand-written facebook/opt-125m config.json is placed in a Hugging Face cache
# under the environment ($VENV/hf-home); run the tests with HF_HOME pointing there and
# HF_HUB_OFFLINE=1 (tests/integrations/conftest.py does).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON=python3.11
VENV="$ROOT/.venv-vllm"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --python) PYTHON="$2"; shift 2 ;;
    --venv) VENV="$2"; shift 2 ;;
    *) echo "setup_integrations.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
[[ "$VENV" = /* ]] || VENV="$ROOT/$VENV"

log() { echo "[setup-integrations] $*" >&2; }

if [[ ! -x "$VENV/bin/python" ]]; then
  log "creating $VENV with $("$PYTHON" --version 2>&1)"
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
case "$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')" in
  3.11|3.12|3.13|3.14) ;;
  *) echo "[setup-integrations] vllm 0.33.0 needs Python >= 3.11" >&2; exit 1 ;;
esac

# 1. vLLM and the pinned stack, resolved together by uv (the certifi override is the only one).
REQS="vllm==0.33.0 jax==0.10.2 jaxlib==0.10.2 nixl-cu13==1.5.1 numpy ml_dtypes absl-py msgspec \
cbor2 xxhash prometheus-client pytest hypothesis matplotlib ruff==0.17.6 scikit-build-core \
pybind11 ninja"
STAMP="$VENV/.jaxkv-integrations-requirements"
(
  exec 9>"$VENV/.jaxkv-integrations.lock"
  flock -w 1800 9 || { log "timed out waiting for $VENV/.jaxkv-integrations.lock"; exit 1; }
  if [[ ! -f "$STAMP" || "$(cat "$STAMP")" != "$REQS" ]]; then
    log "installing uv"
    "$PY" -m pip --disable-pip-version-check -q install uv
    OVERRIDES="$VENV/.jaxkv-overrides.txt"
    echo 'certifi>=2026.1' > "$OVERRIDES"
    log "installing vllm==0.33.0 and the pinned stack (large: ~9 GB)"
    # shellcheck disable=SC2086
    "$VENV/bin/uv" pip install --python "$PY" --override "$OVERRIDES" $REQS
    echo "$REQS" > "$STAMP"
  fi

  # 2. The offline Hugging Face cache with facebook/opt-125m's config.json (no weights).
  bash "$ROOT/scripts/offline_hf_config.sh" "$VENV/hf-home"
)

# 3. jaxkv itself (rebuilt only when its sources changed).
bash "$ROOT/scripts/setup.sh" --python "$PYTHON" --venv "$VENV"
log "ready: $VENV ($("$PY" -c 'import importlib.metadata as m; print("vllm", m.version("vllm"), "jax", m.version("jax"))'))"
