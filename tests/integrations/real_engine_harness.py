"""Real serving engines in spawned processes (`jaxkv.demo._real_engines.EngineProcess`) for
the end-to-end tests of tests/integrations/vllmcpu and tests/integrations/tpui (not a test
module)."""

from __future__ import annotations

import numpy as np

from jaxkv.demo._real_engines import EngineProcess as Engine
from jaxkv.demo._real_engines import free_port as free_port_base

__all__ = ["Engine", "bits", "free_port_base", "prompts_of", "start"]


def start(engines: list[Engine]) -> None:
    """Waits for every engine (they build in parallel)."""
    for engine in engines:
        engine.wait_ready()


def prompts_of(lengths, seed=0, vocab=2048):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, size=n).tolist() for n in lengths]


def bits(x: np.ndarray) -> np.ndarray:
    x = np.ascontiguousarray(x)
    return x.view(np.uint32) if x.dtype.itemsize == 4 else x.view(np.uint16)
