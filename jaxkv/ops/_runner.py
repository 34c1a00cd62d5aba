"""The one way a per-shard op runs on a cache array (or on several arrays of one cache).

Every public op validates its arguments and then calls `run_per_shard` with its per-shard
function (``_*_local`` in the op modules: the custom call, Pallas kernel or jnp reference,
chosen by `_dispatch`):

* on tracers (inside the caller's ``jax.jit`` or ``shard_map``), under the sharding rule of
  `_partition`, so the op stays local to each shard of whatever mesh the caller uses;
* on concrete arrays, through a cached jitted program that donates the updated operand (the
  update happens in place; the argument is consumed), run per shard under ``shard_map`` when
  the array spans several devices, with the other operands placed as that program expects.

On a sharded block axis (data parallelism) ids stay global and each shard keeps those it owns
(`_partition.IdRoles`), without collectives. Operands given as tuples are several arrays of one
cache with one sharding (e.g. every layer of a `jaxkv.PagedKVCache`): the op runs on each of
them in the same program, which costs one dispatch instead of one per array.

The programs are keyed by the implementation in force (`_dispatch.program_key`), so choosing
an implementation never needs to clear a cache: neither jaxkv's nor JAX's.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxkv._context import jit as own_jit
from jaxkv._placement import place_exactly
from jaxkv.ops._dispatch import program_key
from jaxkv.ops._ids import concrete_ids
from jaxkv.ops._partition import (
    GroupedAxes,
    IdRoles,
    ShardingError,
    block_shards,
    localize_ids,
    partitioned_call,
)

Partition = tuple[jax.sharding.Mesh | jax.sharding.AbstractMesh, PartitionSpec]


def block_partition(array: jax.Array) -> Partition | None:
    """The mesh and partition spec to run a per-shard op under, or None for an array on one
    device.

    Raises:
      ValueError: an array over several devices without a NamedSharding.
    """
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


def _data_parallel_local(local: Callable[..., Any], roles: IdRoles,
                         partition: Partition | None, op: str) -> Callable[..., Any]:
    """`local` with its ids made shard-local when `partition` shards the block axis (run
    under shard_map); `local` itself otherwise."""
    if partition is None or partition[1][0] is None:
        return local
    if not roles:
        raise ValueError(f"jaxkv.ops.{op}: the block axis of the cache must not be sharded "
                         f"(partition spec {partition[1]})")
    axes, count = block_shards(*partition)

    def run(*operands, **kwargs):
        return local(*localize_ids(operands, roles, axes, count), **kwargs)

    return run


def _check_data_parallel(partition: Partition | None, roles: IdRoles, operands: Sequence[Any],
                         num_blocks: int, op: str) -> None:
    """On a sharded block axis, concrete ids must be ones the shards can handle alone: segment
    ids divide into the shards and segment ``s`` names blocks of shard ``s`` (or padding), and
    ids that pair blocks (copy) name blocks of one shard. Traced ids that break these rules
    are skipped like padding (no collective could do better).

    Raises:
      ValueError: naming the first offending id.
    """
    if partition is None or partition[1][0] is None:
        return
    _, count = block_shards(*partition)
    per_shard = num_blocks // count
    for position, role, _ in roles:
        if role != "segment":
            continue
        size = operands[position].shape[0]
        if size % count:
            raise ValueError(
                f"jaxkv.ops.{op}: {size} ids for a block axis split in {count} shards: the "
                f"rows of a dense array come in {count} equal segments, one per shard (pad "
                "the ids with -1)")
        ids = concrete_ids(operands[position])
        if ids is None:
            continue
        owners = np.repeat(np.arange(count), size // count)
        wrong = np.flatnonzero((ids >= 0) & (ids // per_shard != owners))
        if wrong.size:
            i = int(wrong[0])
            raise ValueError(
                f"jaxkv.ops.{op}: ids[{i}] = {int(ids[i])} is in data shard "
                f"{int(ids[i]) // per_shard}, but position {i} is in shard {int(owners[i])}'s "
                f"segment (ids come in {count} segments of {size // count}; shard s owns "
                f"blocks [s*{per_shard}, (s+1)*{per_shard}))")
    pairs = [p for p, role, _ in roles if role == "local"]
    if len(pairs) == 2 and len({indexed for _, _, indexed in roles}) == 1:
        a, b = (concrete_ids(operands[p]) for p in pairs)
        if a is not None and b is not None:
            crossing = np.flatnonzero((a >= 0) & (b >= 0) & (a // per_shard != b // per_shard))
            if crossing.size:
                i = int(crossing[0])
                raise ValueError(
                    f"jaxkv.ops.{op}: pair {i} ({int(a[i])} -> {int(b[i])}) crosses data "
                    f"shards (each of {count} owns {per_shard} blocks); moving a block between "
                    "shards needs a collective")


def _arrays_at(operands: Sequence[Any], index: int) -> list[Any]:
    """The operands of the op's run on array `index` (tuple operands give their `index`th)."""
    return [x[index] if isinstance(x, tuple) else x for x in operands]


@functools.lru_cache(maxsize=512)
def _program(
    local: Callable[..., Any],
    static: tuple[tuple[str, Any], ...],
    partition: Partition | None,
    operand_kinds: tuple[str, ...],
    num_outputs: int | None,
    donate_argnums: tuple[int, ...],
    roles: IdRoles,
    op: str,
    num_arrays: int | None,
    implementation: tuple[str, str],
) -> Callable[..., Any]:
    """A jitted program running ``local(*operands, **static)`` on every shard (on each of
    `num_arrays` arrays when some operands are tuples). `implementation` only keys the cache:
    `local` picks its implementation while this program is traced."""
    del implementation
    kwargs = dict(static)
    run = _data_parallel_local(local, roles, partition, op)

    def program(*operands):
        if num_arrays is None:
            return run(*operands, **kwargs)
        return tuple(run(*_arrays_at(operands, i), **kwargs) for i in range(num_arrays))

    if partition is not None:
        mesh, spec = partition
        per_array = spec if num_outputs is None else (spec,) * num_outputs
        out_specs = per_array if num_arrays is None else (per_array,) * num_arrays
        in_specs = tuple(spec if kind == "blocks" else PartitionSpec() for kind in operand_kinds)
        program = jax.shard_map(
            program, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False
        )
    return own_jit(program, donate_argnums=donate_argnums)


def run_per_shard(
    local: Callable[..., Any],
    operands: Sequence[Any],
    kinds: Sequence[str],
    static: dict[str, Any],
    *,
    op: str,
    donate_argnums: tuple[int, ...] = (),
    num_outputs: int | None = None,
    partition_of: int = 0,
    unsharded_axes: Sequence[tuple[int, str]] = (),
    roles: IdRoles = (),
    grouped_axes: GroupedAxes = (),
) -> Any:
    """Runs ``local(*operands, **static)`` on every shard.

    Args:
      local: the per-shard function; returns one array (`num_outputs` None) or a tuple.
      operands: arrays or tracers. ``kinds[i] == "blocks"`` marks block arrays sharded like
        operand `partition_of` (the cache); any other kind is replicated. A tuple operand
        holds several arrays of one cache (same shape and sharding): `local` runs once per
        array, taking each tuple's `i`th element, and the result is a tuple over the arrays.
      static: hashable keyword arguments of `local`.
      op: the public op's name, for errors.
      donate_argnums: operands updated in place (donated by the eager program).
      num_outputs: None when `local` returns one array, else the length of its tuple.
      partition_of: the operand whose sharding the program follows.
      unsharded_axes: ``(axis, why)``: axes of the cache that must not be sharded.
      roles: how ids find their shard on a sharded block axis (none: such a sharding is
        refused).
      grouped_axes: see `_partition.GroupedAxes` (inside the caller's jit).

    Returns:
      What `local` returns (a tuple of those over the arrays of tuple operands).

    Raises:
      ValueError: a sharding the op cannot run under locally, tuple operands of different
        lengths, or concrete ids of a data-parallel cache that cross shards.
      ShardingError: an axis in `unsharded_axes` is sharded.
    """
    num_arrays = None
    leaves = operands
    if any(type(x) is tuple for x in operands):
        lengths = {len(x) for x in operands if type(x) is tuple}
        if len(lengths) > 1:
            raise ValueError(
                f"jaxkv.ops.{op}: array lists of different lengths {sorted(lengths)}")
        num_arrays = lengths.pop()
        leaves = [y for x in operands for y in (x if type(x) is tuple else (x,))]
    if any(isinstance(x, jax.core.Tracer) for x in leaves):
        # Inside the caller's jit: a sharding rule keeps the op local to each shard.
        def traced(ops):
            return partitioned_call(local, ops, kinds, static, op=op, reference=partition_of,
                                    unsharded_axes=unsharded_axes, roles=roles,
                                    grouped_axes=grouped_axes)

        if num_arrays is None:
            return traced(operands)
        return tuple(traced(_arrays_at(operands, i)) for i in range(num_arrays))
    reference = operands[partition_of]
    arrays = reference if isinstance(reference, tuple) else (reference,)
    partition = block_partition(arrays[0])
    for other in arrays[1:]:
        if block_partition(other) != partition:
            raise ValueError(
                f"jaxkv.ops.{op}: the arrays must share one sharding; got {arrays[0].sharding} "
                f"and {other.sharding}")
    _check_data_parallel(partition, roles, operands, arrays[0].shape[0], op)
    if partition is not None:
        for axis, why in unsharded_axes:
            if partition[1][axis] is not None:
                raise ShardingError(
                    f"jaxkv.ops.{op}: axis {axis} of the cache is sharded "
                    f"({partition[1]}), but {why}; shard another axis."
                )
    program = _program(local, tuple(sorted(static.items())), partition, tuple(kinds),
                       num_outputs, donate_argnums, tuple(roles), op, num_arrays,
                       program_key())
    return program(*_placed(operands, kinds, partition, partition_of, donate_argnums, arrays))


def _placed(operands: Sequence[Any], kinds: Sequence[str], partition: Partition | None,
            partition_of: int, donate_argnums: tuple[int, ...],
            arrays: Sequence[jax.Array]) -> list[Any]:
    """The operands placed as the eager program expects (shard_map wants its operands laid
    out as its in_specs say; a one-device program wants its block arrays on that device)."""

    def place(x: Any, target: Any) -> Any:
        if isinstance(x, tuple):
            return tuple(place_exactly(y, target) for y in x)
        return place_exactly(x, target)

    placed = list(operands)
    if partition is not None:
        mesh, spec = partition
        for i, (x, kind) in enumerate(zip(operands, kinds)):
            if i in donate_argnums and i == partition_of:
                continue  # the cache itself: already laid out as the program follows
            placed[i] = place(x, NamedSharding(mesh, spec if kind == "blocks" else PartitionSpec()))
        return placed
    device = next(iter(arrays[0].sharding.device_set))
    for i, (x, kind) in enumerate(zip(operands, kinds)):
        if kind != "blocks" or i == partition_of:
            continue
        members = x if isinstance(x, tuple) else (x,)
        if any(isinstance(y, jax.Array) and y.sharding.device_set != {device} for y in members):
            placed[i] = place(x, device)
    return placed
