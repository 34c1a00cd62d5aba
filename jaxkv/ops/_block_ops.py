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
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxkv import _ffi
from jaxkv._context import jit as own_jit
from jaxkv._placement import place_exactly
from jaxkv.ops._ids import as_id_array, check_ids, concrete_ids
from jaxkv.ops._partition import IdRoles, block_axes, localize_ids, partitioned_call

__all__ = ["copy_blocks", "gather_blocks", "scatter_blocks"]


def element_bits(dtype: Any) -> int:
    """Bits per element as XLA stores `dtype`: sub-byte types (int4, uint4, int2, uint2,
    float4_e2m1fn) are packed several to a byte in device buffers.

    Raises:
      TypeError: a dtype the custom calls cannot take: extended dtypes (PRNG keys), 1-bit
        integers (StableHLO custom calls refuse them) and the 6-bit floats (XLA has no device
        representation for them).
    """
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
    return int(np.prod(array.shape[1:], dtype=np.int64)) * element_bits(array.dtype) // 8


def _check_blocks_first(array: Any, name: str) -> None:
    if not isinstance(array, (jax.Array, jax.core.Tracer)):
        raise TypeError(f"{name} must be a jax.Array, got {type(array).__name__}")
    if array.ndim < 1:
        raise ValueError(f"{name} must be blocks-first [num_blocks, *block], got a scalar")
    bits = element_bits(array.dtype)
    elements = int(np.prod(array.shape[1:], dtype=np.int64))
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


_ROLES: dict[Callable[..., Any], IdRoles] = {
    _copy_local: ((1, "local", 0), (2, "local", 0)),
    _gather_local: ((1, "segment", 0),),
    _gather_into_local: ((1, "segment", 0),),
    _scatter_local: ((2, "segment", 0),),
}
"""How each op's ids find their shard on a sharded block axis (`_partition.IdRoles`)."""

_OP_NAMES = {
    _copy_local: "copy_blocks",
    _gather_local: "gather_blocks",
    _gather_into_local: "gather_blocks",
    _scatter_local: "scatter_blocks",
}


def _block_partition(
    array: jax.Array,
) -> tuple[jax.sharding.Mesh | jax.sharding.AbstractMesh, PartitionSpec] | None:
    """The mesh and spec to run a per-shard op under, or None for a one-device array."""
    sharding = array.sharding
    if len(sharding.device_set) == 1:
        return None
    if not isinstance(sharding, NamedSharding):
        raise ValueError(
            "a cache spread over several devices must use a NamedSharding "
            f"(got {type(sharding).__name__}); see jaxkv.PagedKVCache"
        )
    spec = tuple(sharding.spec) + (None,) * (array.ndim - len(sharding.spec))
    return sharding.mesh, PartitionSpec(*spec)


def data_parallel_local(local: Callable[..., Any], roles: IdRoles,
                        partition: tuple[Any, PartitionSpec] | None,
                        op: str) -> Callable[..., Any]:
    """`local` with its ids made shard-local when `partition` shards the block axis (run
    under shard_map); `local` itself otherwise."""
    if partition is None or partition[1][0] is None:
        return local
    if not roles:
        raise ValueError(f"jaxkv.ops.{op}: the block axis of the cache must not be sharded "
                         f"(partition spec {partition[1]})")
    mesh, spec = partition
    axes = block_axes(spec[0])
    count = 1
    for axis in axes:
        count *= mesh.shape[axis]

    def run(*operands, **kwargs):
        return local(*localize_ids(operands, roles, axes, count), **kwargs)

    return run


def check_data_parallel(partition: tuple[Any, PartitionSpec] | None, roles: IdRoles,
                        operands: Any, num_blocks: int, op: str) -> None:
    """On a sharded block axis: segment ids divide into the shards, and concrete ids that
    pair blocks (copy) name blocks of one shard.

    Raises:
      ValueError: ids that do not divide into the shards, or a pair across shards.
    """
    if partition is None or partition[1][0] is None:
        return
    mesh, spec = partition
    count = 1
    for axis in block_axes(spec[0]):
        count *= mesh.shape[axis]
    for position, role, _ in roles:
        if role == "segment" and operands[position].shape[0] % count:
            raise ValueError(
                f"jaxkv.ops.{op}: {operands[position].shape[0]} ids for a block axis split in "
                f"{count} shards: the rows of a dense array come in {count} equal segments, "
                "one per shard (pad the ids with -1)")
    pairs = [p for p, role, _ in roles if role == "local"]
    if len(pairs) == 2 and len({indexed for _, _, indexed in roles}) == 1:
        a, b = (concrete_ids(operands[p]) for p in pairs)
        if a is not None and b is not None:
            per_shard = num_blocks // count
            crossing = np.flatnonzero((a >= 0) & (b >= 0) & (a // per_shard != b // per_shard))
            if crossing.size:
                i = int(crossing[0])
                raise ValueError(
                    f"jaxkv.ops.{op}: pair {i} ({int(a[i])} -> {int(b[i])}) crosses data "
                    f"shards (each of {count} owns {per_shard} blocks); moving a block between "
                    "shards needs a collective")


@functools.lru_cache(maxsize=256)
def _eager_program(
    local: Callable[..., Any],
    partition: tuple[jax.sharding.Mesh, PartitionSpec] | None,
    operand_kinds: tuple[str, ...],
    donate_argnums: tuple[int, ...],
    validate_ids: bool,
) -> Callable[..., Any]:
    """A jitted program running `local` on every shard; operand kinds are "blocks" (sharded
    like the cache) or "ids" (replicated)."""
    program = functools.partial(
        data_parallel_local(local, _ROLES.get(local, ()), partition,
                            _OP_NAMES.get(local, local.__name__)),
        validate_ids=validate_ids)
    if partition is not None:
        mesh, spec = partition
        in_specs = tuple(spec if kind == "blocks" else PartitionSpec() for kind in operand_kinds)
        program = jax.shard_map(
            program, mesh=mesh, in_specs=in_specs, out_specs=spec, check_vma=False
        )
    return own_jit(program, donate_argnums=donate_argnums)


def _run(local, operands, kinds, *, donate_argnums: tuple[int, ...], validate_ids: bool):
    cache = operands[0]
    if any(isinstance(x, jax.core.Tracer) for x in operands):
        # Inside the caller's jit: a sharding rule keeps the op local to each shard.
        return partitioned_call(local, operands, kinds, dict(validate_ids=validate_ids),
                                op=_OP_NAMES.get(local, local.__name__),
                                roles=_ROLES.get(local, ()))
    partition = _block_partition(cache)
    check_data_parallel(partition, _ROLES.get(local, ()), operands, cache.shape[0],
                        _OP_NAMES.get(local, local.__name__))
    program = _eager_program(local, partition, kinds, donate_argnums, validate_ids)
    if partition is not None:
        # Outside jit, shard_map wants its operands placed as its in_specs say.
        mesh, spec = partition
        operands = (cache,) + tuple(
            place_exactly(x, NamedSharding(mesh, spec if kind == "blocks" else PartitionSpec()))
            for x, kind in zip(operands[1:], kinds[1:])
        )
    return program(*operands)


def copy_blocks(
    cache: jax.Array, src_ids: Any, dst_ids: Any, *, validate_ids: bool = True
) -> jax.Array:
    """Copies whole blocks inside one cache array, in place.

    Args:
      cache: blocks-first array ``[num_blocks, *block]`` of any dtype XLA can hold,
        including the packed sub-byte types (int4, uint4, int2, uint2, float4_e2m1fn) as long
        as a block is a whole number of bytes; 1-bit integers and the 6-bit floats are
        refused. Consumed (donated) when called outside jit.
      src_ids: int32 ids of the source blocks, shape ``[n]``.
      dst_ids: int32 ids of the destination blocks, shape ``[n]``. A pair with a negative id
        on either side is skipped (padding).
      validate_ids: on CUDA, copy traced ids to the host and check them before the launch
        (one small copy and a stream synchronisation). Concrete ids are always checked in
        Python, and CPU handlers always check. Without it, out-of-range ids are skipped on the
        device and never touch memory outside the buffer, but are not reported, and nothing
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
      The updated cache (the same buffer when donated).

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
    """
    _check_blocks_first(cache, "cache")
    src = as_id_array(src_ids, "src_ids")
    dst = as_id_array(dst_ids, "dst_ids")
    if src.shape != dst.shape:
        raise ValueError(
            f"src_ids and dst_ids must have the same length, got {src.shape[0]} and {dst.shape[0]}"
        )
    src_host, dst_host = concrete_ids(src), concrete_ids(dst)
    if src_host is not None:
        check_ids(src_host, "src_ids", cache.shape[0])
    if dst_host is not None:
        disjoint = (src_host, "src_ids") if src_host is not None else None
        check_ids(dst_host, "dst_ids", cache.shape[0], unique=True, disjoint_from=disjoint)
    return _run(
        _copy_local, (cache, src, dst), ("blocks", "ids", "ids"), donate_argnums=(0,),
        validate_ids=validate_ids,
    )


def gather_blocks(
    cache: jax.Array, ids: Any, *, out: jax.Array | None = None, validate_ids: bool = True
) -> jax.Array:
    """Gathers blocks into a dense array ``[n, *block]``.

    Args:
      cache: blocks-first array ``[num_blocks, *block]``; not modified.
      ids: int32 block ids, shape ``[n]``; rows with negative ids come out zero.
      out: optional ``[n, *block]`` buffer to write into instead of allocating a new array
        (for a staging buffer reused every step: a fresh multi-MiB output costs page faults
        on CPU). It is consumed (donated) outside jit; donate it in the caller's jit.
      validate_ids: see `copy_blocks`.

    On a cache whose block axis is sharded over ``S`` shards (data parallelism) the output's
    rows are sharded like the block axis: the ids come in ``S`` equal segments, and row ``i``,
    held by shard ``s = i // (n / S)``, is ``cache[ids[i]]`` when shard ``s`` owns that block
    and zeros otherwise; no collective moves a block between shards. Inside the caller's jit
    give the result that sharding (``out_shardings``, or pass `out`), or XLA gathers it.

    Returns:
      ``out[i] = cache[ids[i]]``, sharded like the cache (the `out` buffer when given).

    Raises:
      IndexError: an id is >= num_blocks.
      ValueError: `out` has the wrong shape or dtype.

    Example:
      >>> gather_blocks(jnp.arange(6.0).reshape(3, 2), [2, -1]).tolist()
      [[4.0, 5.0], [0.0, 0.0]]
    """
    _check_blocks_first(cache, "cache")
    ids = as_id_array(ids, "ids")
    host = concrete_ids(ids)
    if host is not None:
        check_ids(host, "ids", cache.shape[0])
    if out is None:
        return _run(_gather_local, (cache, ids), ("blocks", "ids"), donate_argnums=(),
                    validate_ids=validate_ids)
    _check_blocks_first(out, "out")
    expected = (ids.shape[0], *cache.shape[1:])
    if tuple(out.shape) != expected or out.dtype != cache.dtype:
        raise ValueError(
            f"out has shape {tuple(out.shape)} and dtype {out.dtype}; expected {expected} and "
            f"{cache.dtype}"
        )
    return _run(_gather_into_local, (cache, ids, out), ("blocks", "ids", "blocks"),
                donate_argnums=(2,), validate_ids=validate_ids)


def scatter_blocks(
    cache: jax.Array, blocks: jax.Array, ids: Any, *, validate_ids: bool = True
) -> jax.Array:
    """Writes dense blocks into a cache array, in place.

    Args:
      cache: blocks-first array ``[num_blocks, *block]``. Consumed (donated) outside jit.
      blocks: ``[n, *block]`` with the cache's dtype and per-block shape.
      ids: int32 destination ids, shape ``[n]``; negative ids are skipped.
      validate_ids: see `copy_blocks`.

    On a cache whose block axis is sharded over ``S`` shards, `blocks` rows are taken in
    ``S`` equal segments like `gather_blocks`' output: row ``i`` is written when shard
    ``i // (n / S)`` owns block ``ids[i]`` (a replicated `blocks` is sliced locally, without a
    collective).

    Returns:
      The updated cache with ``cache[ids[i]] = blocks[i]``.

    Raises:
      IndexError: an id is >= num_blocks.
      ValueError: a repeated id, or `blocks` whose shape or dtype does not match.

    Example:
      >>> scatter_blocks(jnp.zeros((3, 2)), jnp.ones((1, 2)), [1]).tolist()
      [[0.0, 0.0], [1.0, 1.0], [0.0, 0.0]]
    """
    _check_blocks_first(cache, "cache")
    _check_blocks_first(blocks, "blocks")
    ids = as_id_array(ids, "ids")
    if blocks.dtype != cache.dtype:
        raise ValueError(f"blocks have dtype {blocks.dtype}, the cache has {cache.dtype}")
    if tuple(blocks.shape[1:]) != tuple(cache.shape[1:]):
        raise ValueError(
            f"blocks have per-block shape {tuple(blocks.shape[1:])}, "
            f"the cache has {tuple(cache.shape[1:])}"
        )
    if blocks.shape[0] != ids.shape[0]:
        raise ValueError(f"{blocks.shape[0]} blocks for {ids.shape[0]} ids")
    host = concrete_ids(ids)
    if host is not None:
        check_ids(host, "ids", cache.shape[0], unique=True)
    return _run(
        _scatter_local, (cache, blocks, ids), ("blocks", "blocks", "ids"), donate_argnums=(0,),
        validate_ids=validate_ids,
    )
