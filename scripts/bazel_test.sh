#!/usr/bin/env bash
# Bazel build and tests, offline: installs Debian's bazel-bootstrap (Bazel 4.2.3) when no bazel
# is on PATH, prepares .venv-bazel (the interpreter and headers Bazel uses), then runs
# `bazel test //...` (plus the CUDA module with --config=cuda where nvcc exists).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if ! command -v bazel >/dev/null; then
  echo "[bazel] installing bazel-bootstrap"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bazel-bootstrap
fi
# Its own environment with a copied (not editable) install: an editable install's import hook
# would take `jaxkv._ffi_cpu` from the environment instead of the Bazel-built runfiles.
bash "$ROOT/scripts/setup.sh" --venv .venv-bazel --no-editable
cd "$ROOT"
export JAXKV_PYTHON="$ROOT/.venv-bazel/bin/python"
CONFIG=()
if command -v nvcc >/dev/null; then CONFIG=(--config=cuda); fi
rc=0
bazel test "${CONFIG[@]}" --test_env=CI //... || rc=$?  # CI: derandomized property tests
bazel shutdown >/dev/null 2>&1 || true  # leave no Bazel server (a JVM) running
exit $rc
