"""Stubs for the tests of the shell scripts (`scripts/test.sh`, `scripts/gpu_validate.sh`);
not a test module."""

from __future__ import annotations

import os

# A stand-in interpreter: appends one line per run to $RUNS (platforms, expectation,
# arguments) and fails with 3 when its arguments contain $FAIL_WITH.
STUB_PYTHON = """#!/usr/bin/env bash
echo "${JAX_PLATFORMS:-unset}|${JAXKV_EXPECT_GPU:-unset}|$*" >> "$RUNS"
[[ -n "${FAIL_WITH:-}" && "$*" == *"$FAIL_WITH"* ]] && exit 3
exit 0
"""


def write_executable(path: str, text: str) -> None:
    """Writes `text` to `path` (its directories made) as an executable file."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, 0o755)


def read_runs(path: str) -> list[list[str]]:
    """The stub interpreter's runs recorded in `path`: [platforms, expectation, arguments]."""
    with open(path) as f:
        return [line.rstrip("\n").split("|") for line in f]
