"""Block-id operands: conversion to int32 arrays and host-side validation.

Ids are array operands of the custom calls (never attributes), so different ids reuse one
compiled program. Negative ids are padding: the ops skip them.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["as_id_array", "check_ids", "concrete_ids", "pad_block_ids", "saturate_to_int32"]


_INT32_MAX = int(np.iinfo(np.int32).max)


def saturate_to_int32(values: jax.Array) -> jax.Array:
    """Traced integers as int32 without wrapping: values above the int32 range become
    ``2**31 - 1`` (out of range for any cache, so the handlers report them, or skip them on
    CUDA without validation) and values below it ``-1`` (negative: padding). A plain
    ``astype(int32)`` would turn uint32 4294967295 into -1 (skipped silently) and int64
    ``2**32 + 1`` into 1 (the wrong block)."""
    if values.dtype == jnp.int32:
        return values
    if jnp.iinfo(values.dtype).bits < 32 or (
        jnp.iinfo(values.dtype).bits == 32 and jnp.issubdtype(values.dtype, jnp.signedinteger)
    ):
        return values.astype(jnp.int32)
    if jnp.issubdtype(values.dtype, jnp.unsignedinteger):
        return jnp.minimum(values, _INT32_MAX).astype(jnp.int32)
    return jnp.clip(values, -1, _INT32_MAX).astype(jnp.int32)


def as_id_array(ids: Any, name: str) -> jax.Array | np.ndarray:
    """Returns `ids` as a 1-D int32 array (numpy when concrete, a JAX array or tracer
    otherwise).

    Concrete ids (lists, numpy arrays, jax arrays that are not int32) are range-checked here;
    traced ids wider than int32 are saturated (see `saturate_to_int32`), never wrapped.

    Raises:
      TypeError: ids are not integers.
      ValueError: ids are not one-dimensional or do not fit in int32.
    """
    if isinstance(ids, (jax.Array, jax.core.Tracer)):
        if ids.ndim != 1:
            raise ValueError(f"{name} must be one-dimensional, got shape {tuple(ids.shape)}")
        if not jnp.issubdtype(ids.dtype, jnp.integer):
            raise TypeError(f"{name} must hold integers, got {ids.dtype}")
        if ids.dtype == jnp.int32:
            return ids
        if isinstance(ids, jax.core.Tracer):
            return saturate_to_int32(ids)
        ids = np.asarray(ids)  # concrete: checked below like any host ids
    array = np.asarray(ids)
    if array.size == 0:
        array = array.astype(np.int32).reshape(0)
    if array.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {array.shape}")
    if not np.issubdtype(array.dtype, np.integer):
        raise TypeError(f"{name} must hold integers, got {array.dtype}")
    int32 = np.iinfo(np.int32)
    if array.size and (array.max() > int32.max or array.min() < int32.min):
        raise ValueError(f"{name} has values that do not fit in int32")
    return array.astype(np.int32, copy=False)


def concrete_ids(ids: jax.Array | np.ndarray) -> np.ndarray | None:
    """The values of `ids` when known on the host now, else None (a tracer)."""
    if isinstance(ids, jax.core.Tracer):
        return None
    return np.asarray(ids)


def check_ids(
    ids: np.ndarray,
    name: str,
    num_blocks: int,
    *,
    unique: bool = False,
    disjoint_from: tuple[np.ndarray, str] | None = None,
) -> None:
    """Validates concrete ids against a buffer of `num_blocks` blocks.

    Raises:
      IndexError: an id is >= num_blocks.
      ValueError: a repeated id where `unique`, or an id shared with `disjoint_from`.
    """
    too_large = np.flatnonzero(ids >= num_blocks)
    if too_large.size:
        i = int(too_large[0])
        raise IndexError(
            f"{name}[{i}] = {int(ids[i])} is out of range for a cache of {num_blocks} blocks"
        )
    valid = ids[ids >= 0]
    if unique and valid.size:
        values, counts = np.unique(valid, return_counts=True)
        repeated = values[counts > 1]
        if repeated.size:
            raise ValueError(f"duplicate id {int(repeated[0])} in {name}")
    if disjoint_from is not None:
        other, other_name = disjoint_from
        shared = np.intersect1d(valid, other[other >= 0])
        if shared.size:
            raise ValueError(
                f"block {int(shared[0])} is both in {other_name} and in {name}; an in-place "
                "copy needs disjoint sources and destinations"
            )


def pad_block_ids(ids: Any, length: int | None = None, *, minimum: int = 8) -> np.ndarray:
    """Pads an id list with -1 to `length`, or to the next power of two >= `minimum`.

    Padding ids to a few bucketed lengths bounds recompilation when the op runs under jit: the
    ops skip negative ids.

    Args:
      ids: 1-D integer ids.
      length: target length; None picks the next power of two.
      minimum: the smallest bucket when `length` is None.

    Returns:
      An int32 numpy array.

    Raises:
      ValueError: `length` is shorter than `ids`.

    Example:
      >>> pad_block_ids([3, 5, 9]).tolist()
      [3, 5, 9, -1, -1, -1, -1, -1]
    """
    array = as_id_array(np.asarray(ids), "ids")
    if length is None:
        length = max(minimum, 1 << max(0, int(array.size - 1).bit_length()))
    if length < array.size:
        raise ValueError(f"cannot pad {array.size} ids to length {length}")
    out = np.full(length, -1, np.int32)
    out[: array.size] = array
    return out
