#!/usr/bin/env bash
# The main job: prepare .venv (idempotent) and run the disaggregated prefill/decode demo
# (jaxkv.demo). Extra arguments are passed to it (e.g. --prefill_tp=4 --json_out=report.json).
# The block-op demonstration of earlier versions is still installed as `jaxkv`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
exec "$ROOT/.venv/bin/jaxkv-demo" "$@"
