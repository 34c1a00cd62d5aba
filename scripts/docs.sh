#!/usr/bin/env bash
# Builds the documentation site (docs/ plus API pages generated from the docstrings) into
# build/site/ with MkDocs, treating every warning as an error (mkdocs.yml sets strict).
#
# Usage: scripts/docs.sh [--venv DIR] [mkdocs build arguments...]
#   e.g. `scripts/docs.sh` (build), `.venv/bin/mkdocs serve` to browse while editing.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
if [[ "${1:-}" == --venv ]]; then
  VENV="$2"
  shift 2
fi
[[ "$VENV" = /* ]] || VENV="$ROOT/$VENV"
bash "$ROOT/scripts/setup.sh" --venv "$VENV"
cd "$ROOT"
exec "$VENV/bin/mkdocs" build --strict --clean "$@"
