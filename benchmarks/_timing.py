"""Timing shared by the benchmarks: contenders run interleaved, round by round, so that each
round's ratios compare runs made under the same background load (the machine is shared)."""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any


def interleaved_seconds(steps: dict[str, Callable[[], Any]], iters: int) -> dict[str, list[float]]:
    """Runs every step once (compile, warm up), then `iters` rounds of one run each; returns the
    seconds of each run per step name. Results are waited for with `jax.block_until_ready`."""
    import jax

    for step in steps.values():
        jax.block_until_ready(step())
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(iters):
        for name, step in steps.items():
            begin = time.perf_counter()
            jax.block_until_ready(step())
            times[name].append(time.perf_counter() - begin)
    return times


def median_ratio(numerator: Sequence[float], denominator: Sequence[float]) -> float:
    """Median over rounds of numerator time / denominator time (> 1: the denominator's
    contender is faster)."""
    return statistics.median(n / d for n, d in zip(numerator, denominator))


def write_json(report: dict[str, Any], path: str | None) -> None:
    """Writes a benchmark report as indented JSON to `path` (creating its directory); no-op
    without a path."""
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as out:
        json.dump(report, out, indent=2)
