"""Paged attention in plain `jax.numpy`, reading and writing a `PagedKVCache` through block
tables, for any cache layout that has the ``H``, ``T`` and ``D`` axes.

The functions act on one device's view of the cache arrays (inside `shard_map`, each rank sees
its own KV heads). Pages are gathered from the blocks-first arrays, then the block's axes are
transposed to the canonical ``[H, T, D]`` order, so the same attention code serves every
layout; new tokens are scattered into the arrays in the layout's own order (in place when the
enclosing jit donates the cache).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jaxkv._spec import KVCacheSpec

__all__ = [
    "attend",
    "binary_exponent",
    "check_spec",
    "pow2",
    "quantize_rows",
    "read_pages",
    "write_tokens",
]

_MASKED = float(jnp.finfo(jnp.float32).min)


def check_spec(spec: KVCacheSpec) -> None:
    """Checks that the demo's attention can use a cache of this spec.

    Args:
      spec: the cache spec.

    Raises:
      ValueError: an MLA or K-only cache, or a layout without the H, T and D axes.

    Example:
      >>> check_spec(KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4,
      ...                        layout="THD"))
    """
    if spec.mla or spec.kv_factor != 2:
        raise ValueError("the demo model needs a cache with separate K and V (not MLA)")
    missing = [axis for axis in "HTD" if axis not in spec.layout]
    if missing:
        raise ValueError(f"layout {spec.layout!r} lacks axes {missing}; the demo needs H, T, D")


def _locate(spec: KVCacheSpec, layer: int, kv: int) -> tuple[int, dict[str, int]]:
    """The array holding ``(layer, kv)`` and the fixed indices of its L / K axes."""
    for index, (key_layer, key_kv) in enumerate(spec.array_keys()):
        if key_layer in (None, layer) and key_kv in (None, kv):
            fixed = {}
            if "L" in spec.layout:
                fixed["L"] = layer
            if "K" in spec.layout:
                fixed["K"] = kv
            return index, fixed
    raise KeyError(f"no cache array holds layer {layer}, kv {kv}")


def read_pages(
    arrays: Sequence[jax.Array], spec: KVCacheSpec, layer: int, kv: int, block_tables: jax.Array
) -> jax.Array:
    """Gathers the K (``kv=0``) or V (``kv=1``) pages of every sequence.

    Args:
      arrays: the cache arrays (one device's shard inside `shard_map`).
      spec: the cache spec (its layout says how a block is arranged).
      layer: the layer.
      kv: 0 for K, 1 for V.
      block_tables: ``[B, num_pages]`` int32 block ids (any valid id for unused pages).

    Returns:
      ``[B, H, num_pages * block_size, D]`` in the cache dtype: token ``s`` of sequence ``b``
      is token ``s % T`` of block ``block_tables[b, s // T]``.

    Example:
      >>> spec = KVCacheSpec(num_layers=1, num_kv_heads=2, head_dim=4, block_size=2,
      ...                    dtype="float32", layout="KTHD")
      >>> arrays = [jnp.arange(8 * 2 * 2 * 2 * 4, dtype=jnp.float32).reshape(8, 2, 2, 2, 4)]
      >>> read_pages(arrays, spec, 0, 0, jnp.array([[3, 1]])).shape
      (1, 2, 4, 4)
    """
    index, fixed = _locate(spec, layer, kv)
    pages = arrays[index][block_tables]  # [B, P, *block axes]
    letters = list(spec.layout)
    pages = pages[(slice(None), slice(None), *[fixed.get(c, slice(None)) for c in letters])]
    rest = [c for c in letters if c not in fixed]  # a permutation of H, T, D
    pages = jnp.transpose(pages, (0, 1, *[2 + rest.index(c) for c in "HTD"]))  # [B, P, H, T, D]
    b, p, h, t, d = pages.shape
    return jnp.transpose(pages, (0, 2, 1, 3, 4)).reshape(b, h, p * t, d)


def write_tokens(
    arrays: Sequence[jax.Array],
    spec: KVCacheSpec,
    layer: int,
    kv: int,
    values: jax.Array,
    block_ids: jax.Array,
    offsets: jax.Array,
) -> list[jax.Array]:
    """Scatters one layer's K or V of ``M`` tokens into their cache slots.

    Args:
      arrays: the cache arrays (one device's shard inside `shard_map`).
      spec: the cache spec.
      layer: the layer.
      kv: 0 for K, 1 for V.
      values: ``[M, H, D]`` (cast to the cache dtype).
      block_ids: ``[M]`` the block of each token; an id >= the number of blocks drops the token
        (padding).
      offsets: ``[M]`` the token's position inside its block.

    Returns:
      The arrays with the slots written (in place when the caller's jit donates them).

    Example:
      >>> spec = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=2, block_size=2,
      ...                    dtype="float32", layout="HTD")
      >>> arrays = [jnp.zeros((4, 1, 2, 2)), jnp.zeros((4, 1, 2, 2))]
      >>> out = write_tokens(arrays, spec, 0, 1, jnp.ones((1, 1, 2)), jnp.array([2]),
      ...                    jnp.array([1]))
      >>> out[1][2].tolist()
      [[[0.0, 0.0], [1.0, 1.0]]]
    """
    index, fixed = _locate(spec, layer, kv)
    selector: list[Any] = [block_ids]
    for c in spec.layout:
        if c in fixed:
            selector.append(fixed[c])
        elif c == "T":
            selector.append(offsets)
        else:
            selector.append(slice(None))
    # Advanced indices (block, L, K, T) come first in the indexed shape, then the sliced H and
    # D in layout order, which is always H before D: the values' [M, H, D].
    out = list(arrays)
    array = out[index]
    out[index] = array.at[tuple(selector)].set(values.astype(array.dtype), mode="drop")
    return out


def pow2(exponent: jax.Array) -> jax.Array:
    """``2.0 ** exponent`` as float32, exactly (built from its bits; exponents clamped to the
    normal range [-126, 127])."""
    biased = (jnp.clip(exponent, -126, 127) + 127).astype(jnp.int32) << 23
    return jax.lax.bitcast_convert_type(biased, jnp.float32)


def binary_exponent(x: jax.Array) -> jax.Array:
    """The int32 ``e`` with ``2 ** (e - 1) <= x < 2 ** e`` (0 for 0).

    Example:
      >>> binary_exponent(jnp.array([0.75, 4.0, 0.0])).tolist()
      [0, 3, 0]
    """
    return jnp.frexp(x)[1].astype(jnp.int32)


def quantize_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Symmetric int8 quantization of each row (last axis) with a power-of-two scale: ``x ~ q *
    scale``, ``|q| <= 127``.

    The scale is a power of two so that every scaling is exact: no rounding that a compiler
    could order differently in different programs (a division by ``amax / 127`` is rounded
    once in one program and rewritten as a multiplication by a reciprocal in another).

    Returns:
      ``(q, scale)``: int8 values and the float32 ``[..., 1]`` scale of each row. A row's max
      is exact, so its values do not depend on other rows.

    Example:
      >>> q, scale = quantize_rows(jnp.array([[0.5, -1.0]]))
      >>> q.tolist(), float(scale[0, 0])
      ([[32, -64]], 0.015625)
    """
    amax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
    shift = 7 - binary_exponent(amax)  # |x| * 2 ** shift < 2 ** 7
    q = jnp.clip(jnp.round(x * pow2(shift)), -127, 127)
    return q.astype(jnp.int8), pow2(-shift)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, q_positions: jax.Array) -> jax.Array:
    """Causal grouped-query attention of queries against gathered pages, with exact sums.

    A query's output depends only on the query, the visible keys and values and the number of
    key slots: every reduction is an integer sum (order-free) or a max, so the result does not
    change with how many queries, rows or heads are computed together. Scores are an int32 dot
    of int8-quantized queries and keys (per row); the softmax weights are fixed-point integers
    (their sum exact in int32); values are int8 per key, and the weighted sum of values an int32
    dot. The fixed-point widths follow from the key count ``S`` so that no sum can overflow.

    Args:
      q: ``[B, N, Hq, D]`` queries (``Hq`` a multiple of the KV heads).
      k, v: ``[B, Hkv, S, D]`` keys and values (pages, token order; any dtype); ``S <= 2**20``.
      q_positions: ``[B, N]`` position of each query; key ``s`` is visible to a query at
        position ``p`` when ``s <= p``. A negative position marks a padding query (its output
        is finite and meaningless).

    Returns:
      ``[B, N, Hq, D]`` float32.

    Example:
      >>> q = jnp.ones((1, 1, 2, 4)); kv = jnp.ones((1, 1, 3, 4))
      >>> attend(q, kv, kv, jnp.array([[1]])).tolist()[0][0][0]
      [1.0, 1.0, 1.0, 1.0]
    """
    b, n, hq, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    if s > 1 << 20:
        raise ValueError(f"{s} key slots exceed the 2**20 the fixed-point softmax allows")
    log_s = max(1, (s - 1).bit_length())
    weight_bits = 30 - log_s  # sum of S weights <= 2**30
    value_bits = 23 - log_s  # S * 2**value_bits * 127 < 2**31 (scaled values < 2**value_bits)
    group = hq // hkv
    key_pos = jnp.arange(s, dtype=jnp.int32)
    # Slots past every query of a row may hold stale bytes (even NaN): zero them so that no
    # garbage reaches a quantization scale or a sum.
    last = jnp.max(q_positions, axis=1)  # [B]
    live = (key_pos[None, :] <= last[:, None])[:, None, :, None]  # [B, 1, S, 1]
    kf = jnp.where(live, k.astype(jnp.float32), 0)
    vf = jnp.where(live, v.astype(jnp.float32), 0)
    q_int, q_scale = quantize_rows(q.astype(jnp.float32).reshape(b, n, hkv, group, d))
    k_int, k_scale = quantize_rows(kf)  # [B, H, S, D], [B, H, S, 1]
    v_int, v_scale = quantize_rows(vf)
    dots = jnp.einsum("bnhgd,bhsd->bhgns", q_int, k_int, preferred_element_type=jnp.int32)
    q_scale = jnp.transpose(q_scale, (0, 2, 3, 1, 4))  # [B, H, G, N, 1]
    k_scale = k_scale[:, :, None, None, :, 0]  # [B, H, 1, 1, S]
    # powers of two: exact in any order; then one rounding by 1/sqrt(d)
    scores = dots.astype(jnp.float32) * (q_scale * k_scale) * (1.0 / float(d) ** 0.5)
    visible = key_pos[None, None, :] <= q_positions[:, :, None]  # [B, N, S]
    scores = jnp.where(visible[:, None, None], scores, _MASKED)
    weights = jnp.exp(scores - jnp.max(scores, axis=-1, keepdims=True))  # (0, 1], max 1
    weights = jnp.where(visible[:, None, None], weights, 0)
    # The normalizer: fixed-point weights summed in int32 (exact).
    total = jnp.sum(jnp.round(weights * pow2(jnp.int32(weight_bits))).astype(jnp.int32),
                    axis=-1, keepdims=True)
    # The numerator: sum_s w_s * v_scale_s * v_int[s]; w_s * v_scale_s (exact: v_scale is a
    # power of two) in fixed point relative to the row's largest, and the sum an int32 dot.
    scaled = weights * v_scale[:, :, None, None, :, 0]  # [B, H, G, N, S]
    shift = value_bits - binary_exponent(jnp.max(scaled, axis=-1, keepdims=True))
    scaled_int = jnp.round(scaled * pow2(shift)).astype(jnp.int32)
    numerator = jnp.einsum("bhgns,bhsd->bhgnd", scaled_int, v_int.astype(jnp.int32),
                           preferred_element_type=jnp.int32)
    reciprocal = 1.0 / jnp.maximum(total, 1).astype(jnp.float32)
    out = numerator.astype(jnp.float32) * pow2(weight_bits - shift) * reciprocal
    return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, n, hq, d)
