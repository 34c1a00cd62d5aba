"""Layout permute, block-size merge and partial block copy as in-place XLA FFI custom calls.

Like the block ops (`_block_ops`), each op acts on one blocks-first array. Called on concrete
arrays it runs a cached jitted program that donates the cache (the argument is consumed; a
head-sharded cache runs per shard under `shard_map`); called on tracers it emits the custom
call with the cache aliased to the result, and the caller's jit must donate the cache.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.ops._block_ops import _check_blocks_first, _ffi_call, block_nbytes, element_bits
from jaxkv.ops._ids import as_id_array, check_ids, concrete_ids, saturate_to_int32
from jaxkv.ops._layouts import check_ratio, one_layout, packed_layout_pair
from jaxkv.ops._runner import run_per_shard

__all__ = ["copy_block_prefix", "merge_blocks", "permute_blocks"]

# Scratch for staging blocks inside permute/merge: on CUDA, the fallback when a staging unit
# exceeds shared memory (chunks of this many bytes); on CPU, one unit per thread. At least
# `_MIN_SCRATCH_BLOCKS` blocks (threads) on CPU when that many ids are given.
_SCRATCH_BYTES = 16 << 20
_MIN_SCRATCH_BLOCKS = 8
# Shared memory every CUDA kernel may use without opting in (ffi/block_copy_cuda.cu's
# kDefaultSharedBytes): a unit this small is staged in shared memory on every GPU.
_CUDA_SHARED_BYTES = 48 << 10
# CUDA's grid x limit (kMaxGridX): more units than this take the staged path.
_CUDA_MAX_GRID_X = 2**31 - 1


def _scratch_blocks(block_shape: tuple[int, ...], element_bits: int, src_layout: str,
                    dst_layout: str, ratio: int, num_ids: int, *, cuda: bool) -> int:
    """How many blocks of scratch a permute/merge custom call gets.

    CPU: one block per staging thread, at least `_MIN_SCRATCH_BLOCKS` (when that many ids are
    given), else `_SCRATCH_BYTES` worth. CUDA (ffi/block_copy_cuda.cu, `RewriteStagingBytes`):
    none when a staging unit fits the 48 KiB of shared memory every GPU grants (one pass, no
    scratch read); otherwise the staged path copies chunks of blocks through the scratch, at
    least one block and at most `_SCRATCH_BYTES` worth. Units between 48 KiB and the device's
    opt-in limit usually take the shared path too, but that limit is only known on the device
    (and the opt-in may fail), so they get the staged path's scratch.

    Args:
      block_shape: one block's shape in `dst_layout` (the cache's layout).
      element_bits: bits per element.
      src_layout, dst_layout: the rewrite's layouts (letters, one per block axis).
      ratio: sub-blocks merged per block (1: a permute).
      num_ids: ids in the call.
      cuda: size for the CUDA custom call rather than the CPU one.

    Returns:
      The number of blocks; 0 only on CUDA.
    """
    block_bytes = max(1, math.prod(block_shape) * element_bits // 8)
    if not cuda:
        return max(1, min(num_ids, max(_MIN_SCRATCH_BLOCKS, _SCRATCH_BYTES // block_bytes)))
    # The staging unit as RearrangeMap (ffi/block_index.h) cuts it: without a ratio, the
    # leading axes both layouts share are independent units.
    shared = 0
    if ratio == 1:
        while shared < len(dst_layout) and src_layout[shared] == dst_layout[shared]:
            shared += 1
    units_per_block = math.prod(block_shape[:shared])
    unit_bytes = math.prod(block_shape[shared:]) * element_bits // 8
    if unit_bytes <= _CUDA_SHARED_BYTES and num_ids * units_per_block <= _CUDA_MAX_GRID_X:
        return 0
    return max(1, min(num_ids, _SCRATCH_BYTES // block_bytes))


# ---------------------------------------------------------------------------------------------
# permute_blocks / merge_blocks


def _rearrange_local(cache, ids, *, target: str, src_layout: str, dst_layout: str, ratio: int,
                     validate_ids: bool, packed: int | None = None,
                     payload: tuple[str, int, int] | None = None):
    from jaxkv.ops._dispatch import dispatch

    stored = cache.shape
    if packed is not None:
        # The packed pair [words, packing] (array axes packed, packed + 1) as one axis of
        # combined entries: a free reshape of the contiguous pair.
        cache = cache.reshape(*stored[:packed], stored[packed] * stored[packed + 1],
                              *stored[packed + 2:])

    def ffi(cache, ids):
        block_bytes = block_nbytes(cache)
        # Traced for the default backend, as "auto" chooses the implementation.
        slots = _scratch_blocks(cache.shape[1:], element_bits(cache.dtype), src_layout,
                                dst_layout, ratio, ids.shape[0],
                                cuda=jax.default_backend() in ("gpu", "cuda"))
        results = (
            jax.ShapeDtypeStruct(cache.shape, cache.dtype),
            jax.ShapeDtypeStruct((slots * block_bytes,), jnp.uint8),
        )
        call = _ffi_call(target, results, {0: 0})
        out, _ = call(cache, ids, src_layout=src_layout, dst_layout=dst_layout,
                      ratio=np.int64(ratio), validate_ids=validate_ids)
        return out

    params: dict[str, Any] = dict(src_layout=src_layout, dst_layout=dst_layout, ratio=ratio)
    if payload is not None:
        params["payload"] = payload
    out = dispatch("rearrange", ffi if payload is None else None, cache, ids,
                   validate_ids=validate_ids, **params)
    return out.reshape(stored)


def _payload(cache, dst_stored: str, dst: str, packed: str | None, packed_size: Any,
             head_dim: Any) -> tuple[tuple[str, int, int] | None, list[tuple[int, str]]]:
    """The padding to zero, ``(axis, entries, lanes)`` or None, and the axes that must not be
    sharded for it."""
    if packed_size is None and head_dim is None:
        return None, []
    if packed is None and packed_size is not None:
        raise ValueError("packed_size needs a packed layout (a lowercase packed position, "
                         "e.g. 'THhD')")
    unsharded: list[tuple[int, str]] = []
    width = cache.shape[-1]
    lanes = width if head_dim is None else _positive(head_dim, "head_dim", width)
    if lanes < width:
        unsharded.append((cache.ndim - 1, f"head_dim={lanes} counts lanes of the whole D axis"))
    axis = packed or dst[0]
    entries = 0
    if packed is not None:
        k = 1 + dst_stored.index(packed)
        size = cache.shape[k] * cache.shape[k + 1]
        entries = size if packed_size is None else _positive(packed_size, "packed_size", size)
        unsharded.append((k + 1, "the packing position of a word cannot be split"))
    else:
        entries = cache.shape[1 + dst.index(axis)]
    return (axis, entries, lanes), unsharded


def _positive(value: Any, name: str, limit: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not (
        1 <= value <= limit
    ):
        raise ValueError(f"{name} must be an integer in [1, {limit}], got {value!r}")
    return int(value)


def _rearrange(cache, ids, ratio, src_layout, dst_layout, validate_ids, target,
               packed_size=None, head_dim=None):
    _check_blocks_first(cache, "cache")
    if cache.ndim < 2:
        raise ValueError("cache must be [num_blocks, *block] with at least one block axis")
    src, dst, packed = packed_layout_pair(src_layout, dst_layout, cache.ndim - 1)
    dst_stored = dst if packed is None else dst.replace(packed, packed + packed.lower())
    t = 1 + dst_stored.index("T")
    tokens = cache.shape[t] * (cache.shape[t + 1] if packed == "T" else 1)
    ratio = check_ratio(ratio, tokens)
    payload, unsharded_payload = _payload(cache, dst_stored, dst, packed, packed_size,
                                          head_dim)
    if packed == "T" and ratio > 1 and payload is not None and payload[1] < tokens:
        raise ValueError(
            f"a merge of blocks with phantom tokens (packed_size={payload[1]} of {tokens}) is "
            "not defined: the sender blocks would not be equal parts of the block"
        )
    ids = as_id_array(ids, "ids")
    host = concrete_ids(ids)
    if host is not None:
        check_ids(host, "ids", cache.shape[0], unique=True)
    if (ratio == 1 and src == dst and payload is None) or ids.shape[0] == 0:
        return cache  # nothing moves
    unsharded = list(unsharded_payload)
    if ratio > 1:
        unsharded.append((t, f"a merge splits the token axis T into {ratio} sender blocks of "
                          "the whole block"))
        if packed == "T":
            unsharded.append((t + 1, "the token axis is packed"))
    return run_per_shard(
        _rearrange_local, (cache, ids), ("blocks", "replicated"),
        dict(target=target, src_layout=src, dst_layout=dst, ratio=ratio,
             validate_ids=validate_ids,
             packed=None if packed is None else 1 + dst_stored.index(packed),
             payload=payload),
        donate_argnums=(0,), op=target.removeprefix("jaxkv_"), unsharded_axes=tuple(unsharded),
        roles=((1, "local", 0),),
    )


def permute_blocks(
    cache: jax.Array, block_ids: Any, src_layout: str, dst_layout: str, *,
    validate_ids: bool = True, packed_size: int | None = None, head_dim: int | None = None,
) -> jax.Array:
    """Rewrites listed blocks, in place, from `src_layout` into `dst_layout` (the cache's).

    The bytes of each listed block are currently arranged in `src_layout` (the same axes and
    sizes as `dst_layout`, in another order; for example received from an engine with another
    layout); afterwards they are arranged in `dst_layout`. Other blocks are untouched. This is
    vLLM's layout post-processing after a receive (docs/data-movement.md section 3), e.g.
    ``"HTD"`` -> ``"THD"``.

    Args:
      cache: blocks-first array ``[num_blocks, *block]`` whose blocks have `dst_layout`'s
        shape; any dtype `copy_blocks` takes (for packed sub-byte types every moved run must
        also be whole bytes, or the handler refuses the call). Consumed (donated) when called
        outside jit.
      block_ids: int32 ids of the blocks to rewrite, shape ``[n]``; negative ids are skipped;
        ids must be unique.
      src_layout, dst_layout: layout letters (or preset names, see `jaxkv.LAYOUT_PRESETS`)
        naming the same axes, as many as the cache's block axes. A packed cache (TPU
        frameworks' ``[T, words, packing, D]`` blocks) names its stored axes as
        `jaxkv.KVCacheSpec.block_axes` does: the packing position in lowercase right after
        its axis, ``"THhD"``; both layouts pack the same axis, and the pair moves as one axis
        of ``words * packing`` entries (K/V interleaving inside it is kept).
      validate_ids: see `jaxkv.ops.copy_blocks`.
      packed_size: valid entries of the packed axis per shard (e.g. ``2 * heads`` combined
        K/V heads); the rest are phantom entries. None: all valid.
      head_dim: valid lanes of ``D`` (the rest is alignment padding). None: all valid.
        With either, the padding of every rewritten block comes out zero (no padding value
        is carried into the result); the custom calls do not do this, so on cpu and cuda
        "auto" runs the jnp reference for it.

    On a sharded cache (eagerly, or traced inside the caller's jit) every shard rewrites its own
    local blocks (each rank received its own heads' bytes). On a sharded block axis (data
    parallelism) each shard rewrites the listed blocks it owns (ids stay global).

    Returns:
      The updated cache (the same buffer when donated).

    Raises:
      ValueError: layouts with different axes or the wrong axis count, repeated ids.
      IndexError: an id >= num_blocks (concrete ids; traced ones raise
        ``jax.errors.JaxRuntimeError`` from the handler).

    Example:
      >>> hnd = jnp.array([0, 1, 10, 11.0]).reshape(1, 2, 2, 1)   # [H, T, D] bytes in block 0
      >>> permute_blocks(hnd, [0], "HTD", "THD").ravel().tolist()
      [0.0, 10.0, 1.0, 11.0]
    """
    return _rearrange(cache, block_ids, 1, src_layout, dst_layout, validate_ids,
                      "jaxkv_permute_blocks", packed_size, head_dim)


def merge_blocks(
    cache: jax.Array, block_ids: Any, ratio: int, src_layout: str, dst_layout: str, *,
    validate_ids: bool = True, packed_size: int | None = None, head_dim: int | None = None,
) -> jax.Array:
    """Merges sender-sized sub-blocks into receiver blocks, in place (with a layout change).

    Each listed block of ``T`` tokens holds `ratio` sender blocks of ``n = T / ratio`` tokens
    back to back, each arranged in `src_layout`; it is rewritten as one block in `dst_layout`
    (the cache's) where token ``j * n + t`` comes from token ``t`` of sub-block ``j``: vLLM's
    block-size and block-size-and-layout post-processing (docs/data-movement.md section 3).

    Args:
      cache: blocks-first array in `dst_layout`. Consumed (donated) outside jit.
      block_ids: int32 ids of the blocks to rewrite; negative ids are skipped; unique.
      ratio: sender blocks per receiver block; must divide the block size.
      src_layout: the sender's layout (same axes as `dst_layout`).
      dst_layout: the cache's layout.
      validate_ids: see `jaxkv.ops.copy_blocks`.
      packed_size, head_dim: padding of a packed cache, see `permute_blocks` (a packed token
        axis with phantom tokens cannot be merged).

    On a sharded cache (eagerly, or traced inside the caller's jit) every shard rewrites its own
    local blocks (each rank received its own heads' bytes). On a sharded block axis (data
    parallelism) each shard rewrites the listed blocks it owns (ids stay global).

    Returns:
      The updated cache.

    Raises:
      ValueError: a ratio that does not divide the block size, incompatible layouts, repeated
        ids.
      IndexError: an id >= num_blocks (concrete ids).

    Example (the worked example of docs/data-movement.md):
      >>> received = jnp.array([0, 1, 10, 11, 2, 3, 12, 13.0])   # a0 a1 b0 b1 | a2 a3 b2 b3
      >>> merge_blocks(received.reshape(1, 2, 4, 1), [0], 2, "HTD", "HTD").ravel().tolist()
      [0.0, 1.0, 2.0, 3.0, 10.0, 11.0, 12.0, 13.0]
      >>> merge_blocks(received.reshape(1, 4, 2, 1), [0], 2, "HTD", "THD").ravel().tolist()
      [0.0, 10.0, 1.0, 11.0, 2.0, 12.0, 3.0, 13.0]
    """
    return _rearrange(cache, block_ids, ratio, src_layout, dst_layout, validate_ids,
                      "jaxkv_merge_blocks", packed_size, head_dim)


# ---------------------------------------------------------------------------------------------
# copy_block_prefix


def _prefix_local(src_cache, dst_cache, src_ids, dst_ids, num_tokens, *, layout: str,
                  validate_ids: bool):
    from jaxkv.ops._dispatch import dispatch

    def ffi(src_cache, dst_cache, src_ids, dst_ids, num_tokens):
        call = _ffi_call("jaxkv_copy_block_prefix",
                         jax.ShapeDtypeStruct(dst_cache.shape, dst_cache.dtype), {1: 0})
        return call(src_cache, dst_cache, src_ids, dst_ids, num_tokens, layout=layout,
                    validate_ids=validate_ids)

    return dispatch("prefix", ffi, src_cache, dst_cache, src_ids, dst_ids, num_tokens,
                    layout=layout, validate_ids=validate_ids)


def _prefix_in_place_local(cache, src_ids, dst_ids, num_tokens, *, layout: str,
                           validate_ids: bool):
    from jaxkv.ops._dispatch import dispatch

    def ffi(cache, src_ids, dst_ids, num_tokens):
        call = _ffi_call("jaxkv_copy_block_prefix_in_place",
                         jax.ShapeDtypeStruct(cache.shape, cache.dtype), {0: 0})
        return call(cache, src_ids, dst_ids, num_tokens, layout=layout,
                    validate_ids=validate_ids)

    return dispatch("prefix_in_place", ffi, cache, src_ids, dst_ids, num_tokens, layout=layout,
                    validate_ids=validate_ids)


def _token_count(num_tokens: Any):
    if isinstance(num_tokens, (jax.Array, jax.core.Tracer)):
        if num_tokens.ndim != 0 or not jnp.issubdtype(num_tokens.dtype, jnp.integer):
            raise TypeError(f"num_tokens must be an integer scalar, got {num_tokens.dtype}"
                            f"{list(num_tokens.shape)}")
        if isinstance(num_tokens, jax.core.Tracer):
            return saturate_to_int32(num_tokens)  # anything past T copies whole blocks
        num_tokens = np.asarray(num_tokens)
    if isinstance(num_tokens, int) and not isinstance(num_tokens, bool):
        num_tokens = max(-1, min(num_tokens, int(np.iinfo(np.int32).max)))  # any Python int
    value = np.asarray(num_tokens)
    if value.ndim != 0 or not np.issubdtype(value.dtype, np.integer):
        raise TypeError(f"num_tokens must be an integer, got {num_tokens!r}")
    return np.int32(np.clip(value, -1, np.iinfo(np.int32).max))


def copy_block_prefix(
    src_cache: jax.Array, dst_cache: jax.Array, src_ids: Any, dst_ids: Any, num_tokens: Any,
    layout: str, *, validate_ids: bool = True,
) -> jax.Array:
    """Copies the first `num_tokens` tokens of each source block into its destination block.

    For every index of the other axes, tokens ``[0, num_tokens)`` of block ``src_ids[i]`` of
    `src_cache` overwrite those of block ``dst_ids[i]`` of `dst_cache`; the rest of each
    destination block stays untouched (TensorRT-LLM's ``kvCacheBlockPartialCopy``, used for
    copy-on-partial-reuse of a prefix block; docs/data-movement.md section 5). `num_tokens` outside
    ``1 .. block_size-1`` copies whole blocks.

    Args:
      src_cache: blocks-first source array. Pass the same array as `dst_cache` to copy inside
        one cache (then sources and destinations must be disjoint).
      dst_cache: blocks-first destination array with the same per-block shape and dtype.
        Updated in place (consumed outside jit).
      src_ids, dst_ids: int32 block ids of equal length; a pair with a negative id is skipped;
        destinations must be unique.
      num_tokens: tokens to copy: a Python int or an int32 scalar array (an operand, so
        changing it does not recompile).
      layout: the blocks' layout (letters or a preset name), which says where the token axis
        ``T`` is.
      validate_ids: see `jaxkv.ops.copy_blocks`.

    On a sharded cache (eagerly, or traced inside the caller's jit) each shard copies its own
    part; neither the block axis nor the token axis may be sharded (a clear error otherwise).

    Returns:
      The updated destination cache.

    Raises:
      ValueError: mismatched shapes or dtypes, an invalid layout, id lists of different
        lengths, repeated destinations, a block both source and destination in one cache.
      IndexError: an id out of range (concrete ids).

    Example:
      >>> src, dst = jnp.ones((2, 4, 1)), jnp.zeros((2, 4, 1))
      >>> copy_block_prefix(src, dst, [0], [1], 3, "TD")[1, :, 0].tolist()
      [1.0, 1.0, 1.0, 0.0]
    """
    _check_blocks_first(src_cache, "src_cache")
    _check_blocks_first(dst_cache, "dst_cache")
    if dst_cache.ndim < 2:
        raise ValueError("dst_cache must be [num_blocks, *block] with at least one block axis")
    if src_cache.dtype != dst_cache.dtype or tuple(src_cache.shape[1:]) != tuple(
        dst_cache.shape[1:]
    ):
        raise ValueError(
            f"src_cache blocks {tuple(src_cache.shape[1:])} {src_cache.dtype} differ from "
            f"dst_cache blocks {tuple(dst_cache.shape[1:])} {dst_cache.dtype}"
        )
    layout = one_layout(layout, dst_cache.ndim - 1)
    src = as_id_array(src_ids, "src_ids")
    dst = as_id_array(dst_ids, "dst_ids")
    if src.shape != dst.shape:
        raise ValueError(
            f"src_ids and dst_ids must have the same length, got {src.shape[0]} and {dst.shape[0]}"
        )
    count = _token_count(num_tokens)
    same = src_cache is dst_cache
    src_host, dst_host = concrete_ids(src), concrete_ids(dst)
    if src_host is not None:
        check_ids(src_host, "src_ids", src_cache.shape[0])
    if dst_host is not None:
        disjoint = (src_host, "src_ids") if same and src_host is not None else None
        check_ids(dst_host, "dst_ids", dst_cache.shape[0], unique=True, disjoint_from=disjoint)
    if src.shape[0] == 0:
        return dst_cache
    static = dict(layout=layout, validate_ids=validate_ids)
    # A token prefix counts tokens of the whole block: a shard holding some tokens cannot copy
    # its part alone.
    unsharded = ((1 + layout.index("T"), "the prefix counts tokens of the whole token axis T"),)
    if same:
        return run_per_shard(
            _prefix_in_place_local, (dst_cache, src, dst, count),
            ("blocks", "replicated", "replicated", "replicated"), static, donate_argnums=(0,),
            op="copy_block_prefix", unsharded_axes=unsharded,
            roles=((1, "local", 0), (2, "local", 0)),
        )
    return run_per_shard(
        _prefix_local, (src_cache, dst_cache, src, dst, count),
        ("blocks", "blocks", "replicated", "replicated", "replicated"), static,
        donate_argnums=(1,), partition_of=1, op="copy_block_prefix", unsharded_axes=unsharded,
        roles=((2, "local", 0), (3, "local", 1)),
    )
