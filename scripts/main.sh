#!/usr/bin/env bash
# The main job: prepare .venv (idempotent) and run the jaxkv demonstration command.
# Extra arguments are passed to it (e.g. --layout=KTHD --tp=2 --json_out=report.json).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
exec "$ROOT/.venv/bin/jaxkv" "$@"
