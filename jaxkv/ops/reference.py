"""Pure-jnp reference implementations of the block ops.

They define the semantics the custom calls must reproduce bit for bit, and they are what a
user would write without jaxkv (XLA gather/scatter, transposes). They assume ids are in range;
negative ids are skipped exactly as the custom calls skip them.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxkv._parallel import EngineConfig, plan_peers
from jaxkv.ops._layouts import check_ratio, layout_pair, one_layout, source_shape

__all__ = [
    "concat_from_peers",
    "copy_block_prefix",
    "copy_blocks",
    "gather_blocks",
    "merge_blocks",
    "permute_blocks",
    "scatter_blocks",
    "split_for_peers",
]


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


def merge_blocks(
    cache: jax.Array, ids: jax.Array, ratio: int, src_layout: str, dst_layout: str
) -> jax.Array:
    """Each listed block holds `ratio` sub-blocks of ``T / ratio`` tokens in `src_layout`;
    rewrite it in `dst_layout` (the cache's) with token ``j * n + t`` from token ``t`` of
    sub-block ``j`` (docs/data-movement.md section 3). Negative ids are skipped.

    Example (the worked example of docs/data-movement.md: H=2, T=4, n=2, D=1, a/b = head 0/1):
      >>> received = jnp.array([0, 1, 10, 11, 2, 3, 12, 13.0]).reshape(1, 2, 4, 1)
      >>> merge_blocks(received, jnp.array([0]), 2, "HTD", "HTD").ravel().tolist()
      [0.0, 1.0, 2.0, 3.0, 10.0, 11.0, 12.0, 13.0]
      >>> merged = merge_blocks(received.reshape(1, 4, 2, 1), jnp.array([0]), 2, "HTD", "THD")
      >>> merged.ravel().tolist()
      [0.0, 10.0, 1.0, 11.0, 2.0, 12.0, 3.0, 13.0]
    """
    src, dst = layout_pair(src_layout, dst_layout, cache.ndim - 1)
    ratio = check_ratio(ratio, cache.shape[1 + dst.index("T")])
    ids = jnp.asarray(ids, jnp.int32)
    blocks = cache[jnp.maximum(ids, 0)]
    count = blocks.shape[0]
    # The bytes of each block, read as [ratio, *src_layout with T / ratio].
    arranged = blocks.reshape((count, *source_shape(cache.shape[1:], src, dst, ratio)))
    order = [0]
    for axis in dst:
        order += [1, 2 + src.index("T")] if axis == "T" else [2 + src.index(axis)]
    merged = jnp.transpose(arranged, order).reshape(blocks.shape)
    targets = jnp.where(ids < 0, cache.shape[0], ids)
    return cache.at[targets].set(merged, mode="drop")


def permute_blocks(cache: jax.Array, ids: jax.Array, src_layout: str, dst_layout: str) -> jax.Array:
    """The bytes of each listed block are arranged in `src_layout`; rewrite them in
    `dst_layout`, the cache's layout (a merge with ratio 1).

    Example:
      >>> hnd = jnp.array([0, 1, 10, 11.0]).reshape(1, 2, 2, 1)   # [H, T, D] bytes
      >>> permute_blocks(hnd, jnp.array([0]), "HTD", "THD").ravel().tolist()
      [0.0, 10.0, 1.0, 11.0]
    """
    return merge_blocks(cache, ids, 1, src_layout, dst_layout)


def copy_block_prefix(
    src_cache: jax.Array,
    dst_cache: jax.Array,
    src_ids: jax.Array,
    dst_ids: jax.Array,
    num_tokens: Any,
    layout: str,
) -> jax.Array:
    """Copies the first `num_tokens` tokens (axis ``T`` of `layout`) of each source block into
    its destination block, for every other axis index; the rest of the destination is kept.
    `num_tokens` outside ``1 .. T-1`` copies whole blocks (docs/data-movement.md section 5).

    Example:
      >>> src, dst = jnp.ones((2, 4, 1)), jnp.zeros((2, 4, 1))
      >>> copy_block_prefix(src, dst, jnp.array([0]), jnp.array([1]), 3, "TD")[1, :, 0].tolist()
      [1.0, 1.0, 1.0, 0.0]
    """
    layout = one_layout(layout, dst_cache.ndim - 1)
    t_axis = 1 + layout.index("T")
    tokens = dst_cache.shape[t_axis]
    count = jnp.asarray(num_tokens, jnp.int32)
    count = jnp.where((count <= 0) | (count >= tokens), tokens, count)
    src_ids = jnp.asarray(src_ids, jnp.int32)
    dst_ids = jnp.asarray(dst_ids, jnp.int32)
    rows = src_cache[jnp.maximum(src_ids, 0)]
    old = dst_cache[jnp.maximum(dst_ids, 0)]
    mask_shape = [1] * dst_cache.ndim
    mask_shape[t_axis] = tokens
    mask = (jnp.arange(tokens) < count).reshape(mask_shape)
    targets = jnp.where((src_ids < 0) | (dst_ids < 0), dst_cache.shape[0], dst_ids)
    return dst_cache.at[targets].set(jnp.where(mask, rows, old), mode="drop")


def split_for_peers(
    cache: jax.Array, block_ids: jax.Array, self_cfg: EngineConfig, peer_cfg: EngineConfig,
    rank: int,
) -> list[jax.Array]:
    """The dense per-peer buffers of `jaxkv.ops.split_for_peers`: buffer ``i`` is the box
    (local layers ``plan.buffer_layers[i]``, heads ``plan.buffer_heads[i]``) of each listed
    ``LKHTD`` block; rows of negative ids are zero.

    Example:
      >>> spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=1, block_size=1)
      >>> cache = jnp.arange(16.0).reshape(2, 2, 2, 2, 1, 1)
      >>> out = split_for_peers(cache, jnp.array([1]), EngineConfig(spec, 1),
      ...                       EngineConfig(spec, 2), rank=0)
      >>> [o.ravel().tolist() for o in out]
      [[8.0, 10.0, 12.0, 14.0], [9.0, 11.0, 13.0, 15.0]]
    """
    plan = plan_peers(self_cfg, peer_cfg, rank)
    blocks = gather_blocks(cache, block_ids)
    return [
        blocks[:, l0:l1, :, h0:h1]
        for (l0, l1), (h0, h1) in zip(plan.buffer_layers, plan.buffer_heads)
    ]


def concat_from_peers(
    cache: jax.Array, buffers: list[jax.Array], block_ids: jax.Array, self_cfg: EngineConfig,
    peer_cfg: EngineConfig, rank: int,
) -> jax.Array:
    """The inverse of `split_for_peers`: buffer ``i`` (of the kept connections, in order) fills
    its box of each listed block; negative ids are skipped.

    Example:
      >>> spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=1, block_size=1)
      >>> parts = [jnp.full((1, 2, 2, 1, 1, 1), 7.0), jnp.full((1, 2, 2, 1, 1, 1), 8.0)]
      >>> out = concat_from_peers(jnp.zeros((2, 2, 2, 2, 1, 1)), parts, jnp.array([1]),
      ...                         EngineConfig(spec, 1), EngineConfig(spec, 2), rank=0)
      >>> out[1].ravel().tolist(), float(out[0].sum())
      ([7.0, 8.0, 7.0, 8.0, 7.0, 8.0, 7.0, 8.0], 0.0)
    """
    plan = plan_peers(self_cfg, peer_cfg, rank)
    ids = jnp.asarray(block_ids, jnp.int32)
    targets = jnp.where(ids < 0, cache.shape[0], ids)
    for buffer, (l0, l1), (h0, h1) in zip(buffers, plan.buffer_layers, plan.buffer_heads):
        cache = cache.at[targets, l0:l1, :, h0:h1].set(buffer, mode="drop")
    return cache
