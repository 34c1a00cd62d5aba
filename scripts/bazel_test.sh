#!/usr/bin/env bash
# Bazel build and tests, offline: installs Debian's bazel-bootstrap (Bazel 4.2.3) when no bazel
# is on PATH, prepares .venv (the interpreter and headers Bazel uses), then runs
# `bazel test //...` (plus the CUDA module with --config=cuda where nvcc exists).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if ! command -v bazel >/dev/null; then
  echo "[bazel] installing bazel-bootstrap"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bazel-bootstrap
fi
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
export JAXKV_PYTHON="$ROOT/.venv/bin/python"
CONFIG=()
if command -v nvcc >/dev/null; then CONFIG=(--config=cuda); fi
rc=0
bazel test "${CONFIG[@]}" --test_env=CI //... || rc=$?  # CI: derandomized property tests
bazel shutdown >/dev/null 2>&1 || true  # leave no Bazel server (a JVM) running
exit $rc
