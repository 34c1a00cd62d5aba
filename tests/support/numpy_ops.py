"""Independent numpy references of the block ops (not a test module)."""

from __future__ import annotations

import numpy as np


def numpy_copy_blocks(cache: np.ndarray, src, dst) -> np.ndarray:
    """Independent reference: copy pairs with both ids non-negative, reading the old cache."""
    out = cache.copy()
    for s, d in zip(src, dst):
        if s >= 0 and d >= 0:
            out[d] = cache[s]
    return out


def numpy_gather_blocks(cache: np.ndarray, ids) -> np.ndarray:
    out = np.zeros((len(ids), *cache.shape[1:]), cache.dtype)
    for i, block in enumerate(ids):
        if block >= 0:
            out[i] = cache[block]
    return out


def numpy_scatter_blocks(cache: np.ndarray, blocks: np.ndarray, ids) -> np.ndarray:
    out = cache.copy()
    for i, block in enumerate(ids):
        if block >= 0:
            out[block] = blocks[i]
    return out
