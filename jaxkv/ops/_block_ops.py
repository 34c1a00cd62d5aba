"""Block copy, gather and scatter as XLA FFI custom calls.

Each op works on one blocks-first array ``[num_blocks, *block]``. Called on a concrete array
it runs a cached jitted program that donates the cache, so the update happens in place (the
argument is consumed; use the returned array). Called on a tracer (inside the caller's
``jax.jit`` / ``shard_map``) it emits the custom call with the cache aliased to the result;
the caller's jit must donate the cache for the update to stay in place. A cache sharded over
its per-block axes (heads, layers, tokens; over one mesh axis or several) runs locally on every
shard, in jit too, and the result keeps the cache's sharding (see `jaxkv.ops._partition`). On a
sharded block axis (data parallelism) each shard handles the global ids it owns, without
collectives (see `copy_blocks`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jaxkv import _ffi
from jaxkv.ops._ids import as_id_array, check_ids, concrete_ids
from jaxkv.ops._runner import run_per_shard

__all__ = ["copy_blocks", "gather_blocks", "scatter_blocks"]


def element_bits(dtype: Any) -> int:
    """Bits per element as XLA stores `dtype`: sub-byte types (int4, uint4, int2, uint2,
    float4_e2m1fn) are packed several to a byte in device buffers.

    Raises:
      TypeError: a dtype the custom calls cannot take: extended dtypes (PRNG keys), 1-bit
        integers (StableHLO custom calls refuse them) and the 6-bit floats (XLA has no device
        representation for them).
    """
    return _element_bits(dtype)


@functools.lru_cache(maxsize=64)
def _element_bits(dtype: Any) -> int:
    # Cached: every eager op checks its arrays' dtype, and the JAX dtype queries cost a few
    # microseconds per call.
    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        raise TypeError(f"the block ops move plain arrays; got the extended dtype {dtype}")
    bits = int(jax.dtypes.itemsize_bits(dtype))
    if bits not in (2, 4) and bits % 8:
        raise TypeError(
            f"dtype {np.dtype(dtype).name} has {bits}-bit elements, which XLA's custom calls "
            "cannot take"
        )
    return bits


def block_nbytes(array: Any) -> int:
    """Bytes of one block of a (local) blocks-first array, packed sub-byte elements included."""
    return math.prod(array.shape[1:]) * element_bits(array.dtype) // 8


def _check_blocks_first(array: Any, name: str) -> None:
    if not isinstance(array, (jax.Array, jax.core.Tracer)):
        raise TypeError(f"{name} must be a jax.Array, got {type(array).__name__}")
    if array.ndim < 1:
        raise ValueError(f"{name} must be blocks-first [num_blocks, *block], got a scalar")
    bits = element_bits(array.dtype)
    elements = math.prod(array.shape[1:])
    if (elements * bits) % 8:
        raise ValueError(
            f"{name}: a block of {elements} {np.dtype(array.dtype).name} elements ({bits} bits "
            "each, packed) is not a whole number of bytes; sub-byte dtypes need blocks of a "
            f"multiple of {8 // bits} elements"
        )


def _ffi_call(target: str, result: jax.ShapeDtypeStruct, aliases: dict[int, int] | None):
    _ffi.ensure_registered()
    return jax.ffi.ffi_call(
        target, result, input_output_aliases=aliases, vmap_method="sequential"
    )


def _copy_local(cache, src_ids, dst_ids, *, validate_ids: bool):
    from jaxkv.ops._dispatch import dispatch

    def ffi(cache, src_ids, dst_ids):
        result = jax.ShapeDtypeStruct(cache.shape, cache.dtype)
        call = _ffi_call("jaxkv_copy_blocks", result, {0: 0})
        return call(cache, src_ids, dst_ids, validate_ids=validate_ids)

    return dispatch("copy", ffi, cache, src_ids, dst_ids, validate_ids=validate_ids)


def _gather_local(cache, ids, *, validate_ids: bool):
    from jaxkv.ops._dispatch import dispatch

    def ffi(cache, ids):
        result = jax.ShapeDtypeStruct((ids.shape[0], *cache.shape[1:]), cache.dtype)
        call = _ffi_call("jaxkv_gather_blocks", result, None)
        return call(cache, ids, validate_ids=validate_ids)

    return dispatch("gather", ffi, cache, ids, validate_ids=validate_ids)


def _gather_into_local(cache, ids, out, *, validate_ids: bool):
    from jaxkv.ops._dispatch import dispatch

    def ffi(cache, ids, out):
        result = jax.ShapeDtypeStruct(out.shape, out.dtype)
        call = _ffi_call("jaxkv_gather_blocks_into", result, {2: 0})
        return call(cache, ids, out, validate_ids=validate_ids)

    return dispatch("gather_into", ffi, cache, ids, out, validate_ids=validate_ids)


def _scatter_local(cache, blocks, ids, *, validate_ids: bool):
    from jaxkv.ops._dispatch import dispatch

    def ffi(cache, blocks, ids):
        result = jax.ShapeDtypeStruct(cache.shape, cache.dtype)
        call = _ffi_call("jaxkv_scatter_blocks", result, {0: 0})
        return call(cache, blocks, ids, validate_ids=validate_ids)

    return dispatch("scatter", ffi, cache, blocks, ids, validate_ids=validate_ids)


def _arrays(cache: Any, name: str, host_ok: bool = False) -> tuple[tuple[Any, ...], bool]:
    """`cache` as a tuple of blocks-first arrays with one block count, and whether it was one
    array (the op then returns one array, not a tuple); `host_ok` also takes numpy arrays.

    Raises:
      TypeError, ValueError: an argument that is not such an array or list of arrays.
    """
    single = not isinstance(cache, (list, tuple))
    arrays = (cache,) if single else tuple(cache)
    if not arrays:
        raise ValueError(f"{name} is an empty list of arrays")
    for i, array in enumerate(arrays):
        if not (host_ok and isinstance(array, np.ndarray)):
            _check_blocks_first(array, name if single else f"{name}[{i}]")
        if array.shape[0] != arrays[0].shape[0]:
            raise ValueError(f"{name}[{i}] has {array.shape[0]} blocks, {name}[0] has "
                             f"{arrays[0].shape[0]}")
    return arrays, single


def _operand(arrays: tuple[jax.Array, ...], single: bool) -> Any:
    """The operand `run_per_shard` takes for these arrays (a tuple runs on each)."""
    return arrays[0] if single else arrays


def copy_blocks(
    cache: jax.Array | Sequence[jax.Array], src_ids: Any, dst_ids: Any, *,
    validate_ids: bool = True,
) -> Any:
    """Copies whole blocks inside one cache array (or each of several), in place.

    Args:
      cache: blocks-first array ``[num_blocks, *block]`` of any dtype XLA can hold,
        including the packed sub-byte types (int4, uint4, int2, uint2, float4_e2m1fn) as long
        as a block is a whole number of bytes; 1-bit integers and the 6-bit floats are
        refused. Or a list of such arrays with one block count and one sharding (e.g. one per
        layer, like vLLM's ``copy_blocks`` over its per-layer caches): the same pairs are
        copied in each, in one program. Consumed (donated) when called outside jit.
      src_ids: int32 ids of the source blocks, shape ``[n]``.
      dst_ids: int32 ids of the destination blocks, shape ``[n]``. A pair with a negative id
        on either side is skipped (padding).
      validate_ids: on CUDA, check traced ids on the device before the op (no host
        synchronisation): a bad list makes the op write nothing and is recorded for
        `jaxkv.ops.check_id_errors`. Concrete ids are always checked in Python, and CPU
        handlers always check. Without it, out-of-range ids are skipped on the device and
        never touch memory outside the buffer, but are not reported, and nothing
        checks that ids are unique or that sources and destinations are disjoint: with
        duplicate destinations, or a block both read and written, the CUDA threads race and
        the result is undefined (the bytes stay inside the buffer). Traced ids wider than int32
        are saturated, never wrapped: values past int32 become ``2**31 - 1`` (out of range).

    On a cache whose block axis is sharded (data parallelism: shard ``s`` of ``S`` owns
    blocks ``[s * B / S, (s + 1) * B / S)``), ids stay global and each shard copies the pairs
    whose two blocks it owns, with no collective (eagerly, and inside the caller's jit); a
    pair across shards would need one: concrete ids raise, traced ones are skipped like
    out-of-range ids. `gather_blocks` and `scatter_blocks` work on such a cache too.

    Returns:
      The updated cache (the same buffer when donated); a tuple for a list of arrays.

    Raises:
      IndexError: an id is >= num_blocks (concrete ids).
      ValueError: id lists of different lengths, a repeated destination, a block that is
        both a source and a destination, or (block-sharded cache) a pair across shards.
        Traced ids that fail the checks raise ``jax.errors.JaxRuntimeError`` with the same
        message from the handler.

    Example:
      >>> cache = jnp.arange(8.0).reshape(4, 2)
      >>> copy_blocks(cache, [0, 1], [2, 3]).tolist()
      [[0.0, 1.0], [2.0, 3.0], [0.0, 1.0], [2.0, 3.0]]
      >>> keys, values = jnp.arange(4.0).reshape(4, 1), jnp.arange(10.0, 14.0).reshape(4, 1)
      >>> [a.ravel().tolist() for a in copy_blocks([keys, values], [0], [3])]
      [[0.0, 1.0, 2.0, 0.0], [10.0, 11.0, 12.0, 10.0]]
    """
    arrays, single = _arrays(cache, "cache")
    num_blocks = arrays[0].shape[0]
    src = as_id_array(src_ids, "src_ids")
    dst = as_id_array(dst_ids, "dst_ids")
    if src.shape != dst.shape:
        raise ValueError(
            f"src_ids and dst_ids must have the same length, got {src.shape[0]} and {dst.shape[0]}"
        )
    src_host, dst_host = concrete_ids(src), concrete_ids(dst)
    if src_host is not None:
        check_ids(src_host, "src_ids", num_blocks)
    if dst_host is not None:
        disjoint = (src_host, "src_ids") if src_host is not None else None
        check_ids(dst_host, "dst_ids", num_blocks, unique=True, disjoint_from=disjoint)
    return run_per_shard(
        _copy_local, (_operand(arrays, single), src, dst), ("blocks", "ids", "ids"),
        dict(validate_ids=validate_ids), op="copy_blocks", donate_argnums=(0,),
        roles=((1, "local", 0), (2, "local", 0)),
    )


def gather_blocks(
    cache: jax.Array | Sequence[jax.Array], ids: Any, *,
    out: jax.Array | Sequence[jax.Array] | None = None, validate_ids: bool = True,
) -> Any:
    """Gathers blocks into a dense array ``[n, *block]``.

    Args:
      cache: blocks-first array ``[num_blocks, *block]``, or a list of such arrays with one
        block count and one sharding (each is gathered, in one program); not modified.
      ids: int32 block ids, shape ``[n]``; rows with negative ids come out zero.
      out: optional ``[n, *block]`` buffer to write into instead of allocating a new array
        (for a staging buffer reused every step: a fresh multi-MiB output costs page faults
        on CPU), one per array for a list. It is consumed (donated) outside jit; donate it in
        the caller's jit.
      validate_ids: see `copy_blocks`.

    On a cache whose block axis is sharded over ``S`` shards (data parallelism) the output's
    rows are sharded like the block axis: the ids come in ``S`` equal segments, and row ``i``,
    held by shard ``s = i // (n / S)``, is ``cache[ids[i]]`` when shard ``s`` owns that block
    and zeros otherwise (concrete ids outside their segment's shard raise); no collective moves
    a block between shards. Inside the caller's jit
    give the result that sharding (``out_shardings``, or pass `out`), or XLA gathers it.

    Returns:
      ``out[i] = cache[ids[i]]``, sharded like the cache (the `out` buffer when given); a
      tuple of those for a list of arrays.

    Raises:
      IndexError: an id is >= num_blocks.
      ValueError: `out` has the wrong shape or dtype, the arrays of a list differ in block
        count or sharding, or (block-sharded cache) concrete ids outside their segment's shard.

    Example:
      >>> gather_blocks(jnp.arange(6.0).reshape(3, 2), [2, -1]).tolist()
      [[4.0, 5.0], [0.0, 0.0]]
    """
    arrays, single = _arrays(cache, "cache")
    ids = as_id_array(ids, "ids")
    host = concrete_ids(ids)
    if host is not None:
        check_ids(host, "ids", arrays[0].shape[0])
    roles = ((1, "segment", 0),)
    if out is None:
        return run_per_shard(_gather_local, (_operand(arrays, single), ids), ("blocks", "ids"),
                             dict(validate_ids=validate_ids), op="gather_blocks", roles=roles)
    outs, out_single = _arrays(out, "out")
    if out_single != single or len(outs) != len(arrays):
        raise ValueError(f"{len(outs)} out arrays for a cache of {len(arrays)} arrays")
    for i, (o, array) in enumerate(zip(outs, arrays)):
        expected = (ids.shape[0], *array.shape[1:])
        if tuple(o.shape) != expected or o.dtype != array.dtype:
            raise ValueError(
                f"{'out' if single else f'out[{i}]'} has shape {tuple(o.shape)} and dtype "
                f"{o.dtype}; expected {expected} and {array.dtype}"
            )
    return run_per_shard(
        _gather_into_local, (_operand(arrays, single), ids, _operand(outs, single)),
        ("blocks", "ids", "blocks"), dict(validate_ids=validate_ids), op="gather_blocks",
        donate_argnums=(2,), roles=roles)


def scatter_blocks(
    cache: jax.Array | Sequence[jax.Array], blocks: jax.Array | Sequence[jax.Array], ids: Any,
    *, validate_ids: bool = True,
) -> Any:
    """Writes dense blocks into a cache array (or each of several), in place.

    Args:
      cache: blocks-first array ``[num_blocks, *block]``, or a list of such arrays with one
        block count and one sharding. Consumed (donated) outside jit.
      blocks: ``[n, *block]`` with the cache's dtype and per-block shape (one per array for
        a list, as `gather_blocks` returns them).
      ids: int32 destination ids, shape ``[n]``; negative ids are skipped.
      validate_ids: see `copy_blocks`.

    On a cache whose block axis is sharded over ``S`` shards, `blocks` rows are taken in
    ``S`` equal segments like `gather_blocks`' output: row ``i`` is written when shard
    ``i // (n / S)`` owns block ``ids[i]`` (a replicated `blocks` is sliced locally, without a
    collective).

    Returns:
      The updated cache with ``cache[ids[i]] = blocks[i]``; a tuple for a list of arrays.

    Raises:
      IndexError: an id is >= num_blocks.
      ValueError: a repeated id, or `blocks` whose shape or dtype does not match.

    Example:
      >>> scatter_blocks(jnp.zeros((3, 2)), jnp.ones((1, 2)), [1]).tolist()
      [[0.0, 0.0], [1.0, 1.0], [0.0, 0.0]]
    """
    arrays, single = _arrays(cache, "cache")
    # Host rows (numpy) are fine: the program places them like the cache (converting them
    # here would put them on the default device, or the caller's context mesh).
    dense, dense_single = _arrays(blocks, "blocks", host_ok=True)
    ids = as_id_array(ids, "ids")
    if dense_single != single or len(dense) != len(arrays):
        raise ValueError(f"{len(dense)} block arrays for a cache of {len(arrays)} arrays")
    for i, (rows, array) in enumerate(zip(dense, arrays)):
        name = "blocks" if single else f"blocks[{i}]"
        if rows.dtype != array.dtype:
            raise ValueError(f"{name} have dtype {rows.dtype}, the cache has {array.dtype}")
        if tuple(rows.shape[1:]) != tuple(array.shape[1:]):
            raise ValueError(
                f"{name} have per-block shape {tuple(rows.shape[1:])}, "
                f"the cache has {tuple(array.shape[1:])}"
            )
        if rows.shape[0] != ids.shape[0]:
            raise ValueError(f"{rows.shape[0]} blocks for {ids.shape[0]} ids")
    host = concrete_ids(ids)
    if host is not None:
        check_ids(host, "ids", arrays[0].shape[0], unique=True)
    return run_per_shard(
        _scatter_local, (_operand(arrays, single), _operand(dense, single), ids),
        ("blocks", "blocks", "ids"), dict(validate_ids=validate_ids), op="scatter_blocks",
        donate_argnums=(0,), roles=((2, "segment", 0),),
    )
