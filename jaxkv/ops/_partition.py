"""Sharding rules for the custom calls, so that an op traced inside the caller's ``jax.jit`` on a
sharded cache runs on each shard's local blocks.

Without a rule XLA's partitioner cannot look inside a custom call: it all-gathers every sharded
operand and replicates the result (the whole cache on every device, one full copy per call).
Each op is wrapped in `jax.experimental.custom_partitioning` with a Shardy sharding rule (and
the equivalent GSPMD callbacks) that says:

* every per-block axis of the cache (heads, layers, tokens, ...) maps to the same axis of the
  result and of the other block arrays (dense blocks, destination caches, peer buffers) when the
  sizes agree, so any sharding of those axes, over one mesh axis or several, stays local and the
  result keeps the cache's sharding;
* a sharded block axis (data parallelism: shard ``s`` of ``S`` owns blocks
  ``[s * B / S, (s + 1) * B / S)``) is supported by the ops that name `IdRoles`: ids stay
  global and replicated, and each shard keeps the ids it owns as local ids (the others become
  padding), with no collective. Ids whose rows are those of a dense array (gather's output,
  scatter's blocks) come in ``S`` equal segments, segment ``s`` for shard ``s``, and the dense
  arrays' rows are sharded like the block axis. Ops without roles refuse such a sharding with
  an error naming the op, never silently all-gathered;
* ids and other small operands are replicated.

The per-shard function (``_*_local`` in the op modules) is what runs on each shard: inside a
fully manual ``shard_map``, on one device, or under ``vmap`` (custom_partitioning has no
batching rule) it is called directly.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from jaxkv.ops._dispatch import current_implementation, program_key

try:  # private, but the only way to tell a vmap tracer; without it, vmap is not detected
    from jax._src.interpreters.batching import BatchTracer

    _BATCH_TRACERS: tuple[type, ...] = (BatchTracer,)
except ImportError:  # pragma: no cover
    _BATCH_TRACERS = ()

__all__ = ["GroupedAxes", "IdRoles", "ShardingError", "localize_ids", "partitioned_call"]

IdRoles = tuple[tuple[int, str, int], ...]
"""How an op's ids find their shard on a sharded block axis: ``(operand index of the ids,
"local" or "segment", operand index of the array they index)``. "local": every shard keeps
the ids in its block range; "segment": shard ``s`` first takes segment ``s`` of ``S`` equal
segments (the ids of the rows it holds of a dense array)."""


class ShardingError(ValueError):
    """A sharding under which an op cannot run shard-locally (raised while compiling)."""


GroupedAxes = tuple[tuple[int, int], ...]
"""Axes of the cache made of whole units side by side: ``(axis, unit)``, the cache's axis
holding ``size // unit`` units of `unit` entries (e.g. the heads of several TP ranks), every
other block array holding as many units of its own along that axis (a rank's buffer heads).
A shard holds whole units: a sharding of the cache's axis carries over to the others' axes."""


def _rule(shapes: Sequence[tuple[int, ...]], kinds: Sequence[str], reference: int,
          result_shapes: Sequence[tuple[int, ...]], grouped: GroupedAxes = (),
          ) -> tuple[str, tuple[str, ...], tuple[int, ...], dict[str, int]]:
    """The einsum-like Shardy rule, the factors that need replication, the per-block axes
    of the reference operand that other block arrays do not share (must stay unsharded) and
    the sizes of the factors used only inside compound factors."""
    ref_shape = shapes[reference]
    block_factors = [f"a{d}" for d in range(1, len(ref_shape))]
    unique = iter(f"u{i}" for i in range(10_000))
    replicated: list[str] = []
    unshared: set[int] = set()
    sizes: dict[str, int] = {}
    whole: set[str] = set()  # factors that are a whole dimension somewhere
    # Grouped axes: the reference's axis is (g, a) with g = the number of units.
    groups = {d: ref_shape[d] // unit for d, unit in grouped
              if 0 < d < len(ref_shape) and unit > 0 and ref_shape[d] % unit == 0
              and ref_shape[d] // unit > 1}

    def factor(name: str, size: int) -> str:
        sizes[name] = size
        return name

    def grouped_dim(d: int, size: int, inner: str) -> str:
        """Dimension `d` of `size` entries as units ``g{d}`` times `inner`."""
        outer = factor(f"g{d}", groups[d])
        if size == groups[d]:
            whole.add(outer)
            return outer
        return f"({outer} {factor(inner, size // groups[d])})"

    def reference_dim(d: int) -> str:
        if d in groups:
            return grouped_dim(d, ref_shape[d], block_factors[d - 1])
        whole.add(block_factors[d - 1])
        return block_factors[d - 1]

    def plain(name: str) -> str:
        whole.add(name)
        return name

    def blocks_mapping(shape: tuple[int, ...], leading: str) -> str:
        factors = [plain(leading)]
        for d in range(1, len(shape)):
            if len(shape) == len(ref_shape) and shape[d] == ref_shape[d]:
                factors.append(reference_dim(d))
            elif len(shape) == len(ref_shape) and d in groups and shape[d] % groups[d] == 0:
                factors.append(grouped_dim(d, shape[d], next(unique)))
            else:
                factors.append(plain(next(unique)))
                if d < len(ref_shape):
                    unshared.add(d)
        return " ".join(factors)

    def reference_mapping() -> str:
        return " ".join([plain("n"), *(reference_dim(d) for d in range(1, len(ref_shape)))])

    operands = []
    dense: dict[tuple[int, ...], str] = {}
    for i, (shape, kind) in enumerate(zip(shapes, kinds)):
        if i == reference:
            operands.append(reference_mapping())
        elif kind == "blocks":
            operands.append(blocks_mapping(shape, next(unique)))
            dense.setdefault(tuple(shape), operands[-1])
        else:
            factors = [plain(next(unique)) for _ in shape]
            replicated.extend(factors)
            operands.append(" ".join(factors))
    results = []
    for shape in result_shapes:
        if tuple(shape) == tuple(ref_shape):
            results.append(reference_mapping())
        elif tuple(shape) in dense:  # written into that operand (gather's `out`)
            results.append(dense[tuple(shape)])
        else:
            results.append(blocks_mapping(shape, next(unique)))
    rule = ", ".join(operands) + " -> " + ", ".join(results)
    compound_only = {name: size for name, size in sizes.items() if name not in whole}
    return rule, tuple(replicated), tuple(sorted(unshared)), compound_only


def localize_ids(operands: Sequence[Any], roles: IdRoles, axes: tuple[str, ...],
                 count: int) -> list[Any]:
    """Per shard of a block axis sharded over mesh `axes` (`count` shards): every id operand
    of `roles` as local ids of this shard, ids of other shards (and out-of-range ones) as -1.
    Only this shard's axis index is read: no collective.

    Args:
      operands: the op's per-shard operands (ids replicated, block arrays local).
      roles: see `IdRoles`.
      axes: the mesh axes of the block axis, major first.
      count: the number of shards of the block axis.

    Returns:
      The operands with the ids replaced.
    """
    import jax.numpy as jnp

    shard = jax.lax.axis_index(axes if len(axes) > 1 else axes[0])
    out = list(operands)
    for position, role, indexed in roles:
        ids = out[position]
        if role == "segment":
            segment = ids.shape[0] // count
            ids = jax.lax.dynamic_slice_in_dim(ids, shard * segment, segment)
        local = out[indexed].shape[0]
        start = (shard * local).astype(ids.dtype)
        owned = (ids >= start) & (ids < start + local)
        out[position] = jnp.where(owned, ids - start, jnp.asarray(-1, ids.dtype))
    return out


def block_axes(spec_entry: Any) -> tuple[str, ...]:
    """The mesh axes of one partition-spec entry, as a tuple."""
    if spec_entry is None:
        return ()
    return tuple(spec_entry) if isinstance(spec_entry, (tuple, list)) else (spec_entry,)


def block_shards(mesh: Any, spec: Any) -> tuple[tuple[str, ...], int]:
    """The mesh axes sharding the block axis (entry 0 of partition spec `spec`) and the
    number of shards they make (1 when none)."""
    axes = block_axes(tuple(spec)[0] if len(tuple(spec)) else None)
    count = 1
    for axis in axes:
        count *= mesh.shape[axis]
    return axes, count


def _sharded_axes(shape: Sequence[int], sharding: jax.sharding.Sharding) -> list[int]:
    local = sharding.shard_shape(tuple(shape))
    return [d for d, (g, s) in enumerate(zip(shape, local)) if g != s]


def _replicated_like(sharding: jax.sharding.Sharding, mesh) -> jax.sharding.Sharding:
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, PartitionSpec())
    if mesh is not None and not mesh.empty:
        return NamedSharding(mesh, PartitionSpec())
    from jax._src.sharding_impls import GSPMDSharding  # no mesh: XLA handed a raw sharding

    return GSPMDSharding.get_replicated(sharding._device_assignment)


@functools.lru_cache(maxsize=512)
def _partitioned(
    local: Callable[..., Any],
    op: str,
    static: tuple[tuple[str, Any], ...],
    kinds: tuple[str, ...],
    shapes: tuple[tuple[int, ...], ...],
    result_shapes: tuple[tuple[int, ...], ...],
    reference: int,
    multiple_results: bool,
    unsharded_axes: tuple[tuple[int, str], ...],
    roles: IdRoles = (),
    grouped: GroupedAxes = (),
    implementation: tuple[str, str] = ("", ""),
) -> tuple[Callable[..., Any], Callable[[Any, Any], Callable[..., Any]]]:
    # `implementation` (`_dispatch.program_key`) only keys the cache: `local` picks its
    # implementation when traced, and JAX may reuse a custom_partitioning's trace.
    del implementation
    kwargs = dict(static)
    rule, need_replication, unshared, factor_sizes = _rule(shapes, kinds, reference,
                                                           result_shapes, grouped)

    def run(*operands):
        return local(*operands, **kwargs)

    def data_parallel(sharding) -> tuple[tuple[str, ...], int]:
        """The mesh axes and shard count of a sharded block axis."""
        if not isinstance(sharding, NamedSharding):
            raise ShardingError(f"jaxkv.ops.{op}: a sharded block axis needs a NamedSharding "
                                f"of the cache, got {sharding}")
        axes, count = block_shards(sharding.mesh, sharding.spec)
        for position, role, _ in roles:
            if role == "segment" and shapes[position][0] % count:
                raise ShardingError(
                    f"jaxkv.ops.{op}: {shapes[position][0]} ids for a block axis split in "
                    f"{count} shards: the rows of a dense array come in {count} equal "
                    "segments, one per shard (pad the ids with -1)")
        return axes, count

    def shardings(arg_shapes):
        ref = arg_shapes[reference]
        sharding = ref.sharding
        sharded = _sharded_axes(ref.shape, sharding)
        if 0 in sharded and not roles:
            raise ShardingError(
                f"jaxkv.ops.{op}: the block axis (axis 0) of its cache operand is sharded "
                f"({sharding}); the op moves blocks between arbitrary ids, which one shard "
                "cannot do alone. Shard the other axes (heads, layers, tokens) instead, or "
                "gather the cache first."
            )
        for axis, why in unsharded_axes:
            if axis in sharded:
                raise ShardingError(
                    f"jaxkv.ops.{op}: axis {axis} of the cache is sharded ({sharding}), but "
                    f"{why}; shard another axis."
                )
        local = sharding.shard_shape(tuple(ref.shape))
        for axis, unit in grouped:
            if axis in sharded and local[axis] % unit:
                raise ShardingError(
                    f"jaxkv.ops.{op}: axis {axis} of the cache is sharded ({sharding}) into "
                    f"pieces of {local[axis]}, which do not hold whole units of {unit} (one "
                    "rank's entries); shard it over at most as many devices as it has units."
                )
        bad = [d for d in sharded if d in unshared]
        if bad:
            raise ShardingError(
                f"jaxkv.ops.{op}: axes {bad} of the cache are sharded ({sharding}) but the other "
                "block arrays of the op have different sizes along them, so no shard holds "
                "matching pieces; run the op under shard_map with per-shard arrays."
            )
        return sharding, _replicated_like(sharding, None)

    def partition(mesh, arg_shapes, result_shape):
        blocks, replicated = shardings(arg_shapes)
        arg_shardings = tuple(blocks if k == "blocks" else replicated for k in kinds)
        results = tuple(blocks for _ in result_shapes)
        lower = run
        if 0 in _sharded_axes(arg_shapes[reference].shape, blocks):
            axes, count = data_parallel(blocks)

            def lower(*operands):
                return local(*localize_ids(operands, roles, axes, count), **kwargs)

        return mesh, lower, results if multiple_results else results[0], arg_shardings

    def infer(mesh, arg_shapes, result_shape):
        blocks, _ = shardings(arg_shapes)
        results = tuple(blocks for _ in result_shapes)
        return results if multiple_results else results[0]

    def explicit(mesh, spec):
        """The op as a `jax.shard_map` over an Explicit mesh (shardings known when tracing)."""
        blocks, _ = shardings(tuple(
            jax.ShapeDtypeStruct(shape, jax.numpy.int8, sharding=NamedSharding(mesh, spec))
            if i == reference else None for i, shape in enumerate(shapes)))
        lower = run
        if 0 in _sharded_axes(shapes[reference], blocks):
            axes, count = data_parallel(blocks)

            def lower(*operands):
                return local(*localize_ids(operands, roles, axes, count), **kwargs)

        in_specs = tuple(spec if k == "blocks" else PartitionSpec() for k in kinds)
        out_specs = tuple(spec for _ in result_shapes)
        program = jax.shard_map(lower, mesh=mesh, in_specs=in_specs,
                                out_specs=out_specs if multiple_results else out_specs[0])

        def call(*operands):
            # Other block arrays laid out like the cache (a replicated one is sliced locally),
            # ids replicated, as the shard_map's types demand.
            return program(*(
                x if _spec_of(x) == _trimmed(want)
                else jax.sharding.reshard(x, NamedSharding(mesh, want))
                for x, want in zip(operands, in_specs)))

        return call

    wrapped = custom_partitioning(run)
    wrapped.def_partition(
        partition=partition,
        infer_sharding_from_operands=infer,
        sharding_rule=rule,
        need_replication_factors=need_replication,
        **factor_sizes,
    )
    return wrapped, explicit


def _without_rule() -> bool:
    # Pallas's TPU interpret mode (forced "pallas" off TPU) runs kernels through ordered host
    # callbacks, whose effects custom_partitioning cannot lower; it is a debugging aid on
    # unsharded arrays, so the op runs without a sharding rule there.
    return current_implementation() == "pallas" and jax.default_backend() != "tpu"


def partitioned_call(
    local: Callable[..., Any],
    operands: Sequence[Any],
    kinds: Sequence[str],
    static: dict[str, Any],
    *,
    op: str,
    reference: int = 0,
    unsharded_axes: Sequence[tuple[int, str]] = (),
    roles: IdRoles = (),
    grouped_axes: GroupedAxes = (),
):
    """Calls ``local(*operands, **static)`` under a sharding rule (see the module docstring).

    Args:
      local: the per-shard function; returns one array or a tuple of arrays.
      operands: arrays or tracers; ``kinds[i] == "blocks"`` marks block arrays laid out like
        the cache (operand `reference`), anything else is replicated.
      static: hashable keyword arguments of `local`.
      op: the public op's name, for errors.
      reference: index of the cache operand whose sharding the block arrays follow.
      unsharded_axes: ``(axis, why)`` pairs: axes of the cache that the op cannot split
        (a shard-local run would compute something else); a sharding of one is refused.
      roles: how ids find their shard when the block axis is sharded (see `IdRoles`); none:
        a sharded block axis is refused.
      grouped_axes: axes of the cache made of whole units whose sharding the other block
        arrays follow with units of their own size (see `GroupedAxes`).

    Returns:
      What `local` returns.
    """
    if any(isinstance(x, _BATCH_TRACERS) for x in operands) or _without_rule():
        return local(*operands, **static)
    explicit_spec = _explicit_sharding(operands[reference])
    operands = tuple(jax.numpy.asarray(x) if not isinstance(x, (jax.Array, jax.core.Tracer))
                     else x for x in operands)
    # Shapes only (no shardings: the abstract evaluation of an op cannot index a block axis
    # that an Explicit mesh shards).
    out = jax.eval_shape(lambda *xs: local(*xs, **static),
                         *(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in operands))
    multiple = isinstance(out, (tuple, list))
    result_shapes = tuple(tuple(o.shape) for o in out) if multiple else (tuple(out.shape),)
    wrapped, explicit = _partitioned(
        local, op, tuple(sorted(static.items())), tuple(kinds),
        tuple(tuple(x.shape) for x in operands), result_shapes, reference, multiple,
        tuple(unsharded_axes), tuple(roles), tuple(grouped_axes), program_key(),
    )
    if explicit_spec is not None:
        # Under an Explicit mesh the result's sharding is part of its type, and a
        # custom_partitioning result comes out with the block axis unsharded (all-gathered);
        # jnp's indexing refuses such an axis outright. The shardings are known while
        # tracing: a shard_map over them stays local.
        ref = operands[reference]
        mesh = (jax.typeof(ref).sharding.mesh if isinstance(ref, jax.core.Tracer)
                else ref.sharding.mesh)
        result = explicit(mesh, explicit_spec)(*operands)
    else:
        result = wrapped(*operands)
    return tuple(result) if multiple else result


def _trimmed(spec: Any) -> tuple[Any, ...]:
    """A partition spec as a tuple without trailing Nones (equal specs compare equal)."""
    entries = list(spec or ())
    while entries and entries[-1] is None:
        entries.pop()
    return tuple(entries)


def _spec_of(x: Any) -> tuple[Any, ...]:
    """`x`'s partition spec in its type (`_trimmed`)."""
    return _trimmed(getattr(getattr(jax.typeof(x), "sharding", None), "spec", ()))


def _explicit_sharding(x: Any) -> PartitionSpec | None:
    """The partition spec of `x` when Explicit mesh axes shard any of its axes (its sharding
    is then part of its type)."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if sharding is None or mesh is None or getattr(mesh, "empty", True):
        return None
    spec = tuple(sharding.spec)
    used = {axis for entry in spec for axis in block_axes(entry)}
    if not used & set(getattr(mesh, "explicit_axes", ())):
        return None
    return PartitionSpec(*spec)
