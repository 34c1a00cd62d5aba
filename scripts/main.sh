#!/usr/bin/env bash
# Prepares .venv (idempotent; see scripts/setup.sh) and runs the disaggregated prefill/decode
# demo, jaxkv-demo. Arguments are passed to it, e.g.
#   scripts/main.sh --prefill_tp=4 --json_out=report.json --plot_out=ttft.png
# (`jaxkv-demo --help` lists them). The block-op demonstration is the `jaxkv` command.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
exec "$ROOT/.venv/bin/jaxkv-demo" "$@"
