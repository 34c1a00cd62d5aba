"""Pure-jnp reference implementations of the block ops.

They define the semantics the custom calls must reproduce bit for bit, and they are what a
user would write without jaxkv (XLA gather/scatter). They assume ids are in range; negative
ids are skipped exactly as the custom calls skip them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["copy_blocks", "gather_blocks", "scatter_blocks"]


def copy_blocks(cache: jax.Array, src_ids: jax.Array, dst_ids: jax.Array) -> jax.Array:
    """``cache[dst_ids[i]] = cache[src_ids[i]]`` for pairs with both ids non-negative.

    Example:
      >>> cache = jnp.arange(4.0)[:, None]
      >>> copy_blocks(cache, jnp.array([0, -1]), jnp.array([3, 1]))[:, 0].tolist()
      [0.0, 1.0, 2.0, 0.0]
    """
    src_ids = jnp.asarray(src_ids, jnp.int32)
    dst_ids = jnp.asarray(dst_ids, jnp.int32)
    num_blocks = cache.shape[0]
    skip = (src_ids < 0) | (dst_ids < 0)
    targets = jnp.where(skip, num_blocks, dst_ids)
    return cache.at[targets].set(cache[jnp.maximum(src_ids, 0)], mode="drop")


def gather_blocks(cache: jax.Array, ids: jax.Array) -> jax.Array:
    """``out[i] = cache[ids[i]]``; rows with negative ids are zero.

    Example:
      >>> gather_blocks(jnp.arange(3.0)[:, None], jnp.array([2, -1]))[:, 0].tolist()
      [2.0, 0.0]
    """
    ids = jnp.asarray(ids, jnp.int32)
    rows = cache[jnp.maximum(ids, 0)]
    keep = (ids >= 0).reshape((-1,) + (1,) * (cache.ndim - 1))
    return jnp.where(keep, rows, jnp.zeros((), cache.dtype))


def scatter_blocks(cache: jax.Array, blocks: jax.Array, ids: jax.Array) -> jax.Array:
    """``cache[ids[i]] = blocks[i]`` for non-negative ids.

    Example:
      >>> scatter_blocks(jnp.zeros((3, 1)), jnp.ones((2, 1)), jnp.array([2, -1]))[:, 0].tolist()
      [0.0, 0.0, 1.0]
    """
    ids = jnp.asarray(ids, jnp.int32)
    targets = jnp.where(ids < 0, cache.shape[0], ids)
    return cache.at[targets].set(blocks, mode="drop")
