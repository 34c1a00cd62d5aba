"""Bit patterns and bit-for-bit comparison: the one way the tests compare KV data (not a test
module). A copy of KV data must keep every bit, NaN payloads included, so arrays are compared
as unsigned integers of their width."""

from __future__ import annotations

import numpy as np


def random_bits(rng: np.random.Generator, shape: tuple[int, ...], dtype) -> np.ndarray:
    """An array of `dtype` filled with random bit patterns (NaN payloads included), so that a
    byte copy is checked on every bit."""
    dtype = np.dtype(dtype)
    raw = rng.integers(0, 256, size=(*shape, dtype.itemsize), dtype=np.uint8)
    return raw.view(dtype).reshape(shape)


def bits(array) -> np.ndarray:
    """The raw bits of an array as unsigned integers of the same width."""
    array = np.asarray(array)
    return array.view(np.dtype(f"u{array.dtype.itemsize}"))


def assert_same_values(actual, expected) -> None:
    """Bit-equal, except that any NaN matches any NaN. For XLA's own gather/scatter, which may
    canonicalise NaN payloads (seen for bfloat16 on CPU); jaxkv's custom calls are compared
    with `bits` instead."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    same = bits(actual) == bits(expected)
    if not np.issubdtype(actual.dtype, np.integer):
        nan_a = np.isnan(actual.astype(np.float32))
        nan_e = np.isnan(expected.astype(np.float32))
        same |= nan_a & nan_e
    mismatches = np.argwhere(~same)
    assert mismatches.size == 0, f"{len(mismatches)} mismatches, first at {mismatches[0].tolist()}"


def assert_bits(actual, expected, msg: str = "") -> None:
    """`actual` holds exactly the bits of `expected` (arrays of the same shape and width)."""
    np.testing.assert_array_equal(bits(actual), bits(expected), err_msg=msg)
