"""The split/concat formatter of the JAX transport (TensorRT-LLM's cache formatter).

A transport that moves whole arrays (`jax.experimental.transfer`) cannot read byte ranges out
of a peer's cache the way NIXL does. The producer therefore *formats* a request's blocks for
each consumer rank: it gathers the blocks of every producer rank it holds and splits them into
one dense buffer per consumer rank that needs them (`jaxkv.ops.split_for_peers`, planned by
`jaxkv.ops.plan_peers`); each consumer rank pulls the buffers of its source ranks and writes
them into its cache (`jaxkv.ops.concat_from_peers`), followed by the same conversions as the
byte-range path: sender blocks merged into larger receiver blocks, the receiver's layout.

Buffers travel in the canonical cross-layer arrangement ``[n, L, K, H, T, D]`` with the
producer's block size: heterogeneous TP (heads split, or replicated when TP exceeds the KV
heads; MLA caches replicated on every rank) and PP (layer ranges) follow from the plan; other
layouts are converted on either side (`to_canonical` / `from_canonical`).

Caches stored with padding (tpu-inference's: K/V interleaved on the head axis, heads packed
into 32-bit words, head dim aligned to 128 lanes; `KVCacheSpec.for_tpu_inference`) travel as
their values only: the producer extracts each rank's real heads and real head-dim lanes
(`unpack_blocks`: no phantom heads, no alignment padding on the wire), the consumer writes
them into its own storage (`pack_into_blocks`), leaving its phantom heads and padding lanes as
they were.

Pure planning (`send_routes`, `receive_routes`) needs no devices; `split_request` and
`concat_request` run the ops on the device shards of a `PagedKVCache`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from jaxkv._context import jit as own_jit
from jaxkv._context import no_context_mesh
from jaxkv._parallel import EngineConfig, PeerPlan, plan_peers
from jaxkv._spec import KVCacheSpec

__all__ = [
    "CANONICAL_LAYOUT",
    "FormatError",
    "Route",
    "canonical_config",
    "LAYER_GROUP_BYTES",
    "check_formattable",
    "concat_layers",
    "concat_request",
    "from_canonical",
    "rank_devices",
    "receive_layer_routes",
    "receive_routes",
    "pack_into_blocks",
    "layer_groups",
    "remote_tail",
    "send_layer_routes",
    "send_routes",
    "split_layers",
    "split_request",
    "to_canonical",
    "unpack_blocks",
    "values_metadata",
    "values_spec",
]

CANONICAL_LAYOUT = "LKHTD"
"""The arrangement of the buffers on the wire: ``[n, L, K, H, T, D]``, sender block size."""


class FormatError(ValueError):
    """A request the formatter cannot move (unsupported cache, ids, shapes that disagree)."""


@dataclasses.dataclass(frozen=True)
class Route:
    """One dense buffer moving from a producer rank to a consumer rank.

    Attributes:
      producer_rank, consumer_rank: the two ends.
      index: the buffer's index in the producer rank's split (`PeerPlan.connection_buffers`)
        on the producer side; its position among the kept buffers on the consumer side.
      shape: ``(n, layers, K, heads, T, D)`` of the buffer.
    """

    producer_rank: int
    consumer_rank: int
    index: int
    shape: tuple[int, ...]


def _stored_with_padding(spec: KVCacheSpec) -> bool:
    return spec.kv_interleaved or spec.packing is not None or spec.head_dim_alignment > 1


def values_spec(spec: KVCacheSpec) -> KVCacheSpec:
    """The spec of a cache's values without its storage details: K/V interleaved on the head
    axis become a ``K`` axis just before ``H``, packed words and head-dim alignment are
    dropped. An unpadded spec is returned as is.

    Example:
      >>> values_spec(KVCacheSpec.for_tpu_inference(2, 4, 96, 16)).block_shape(2)
      (16, 2, 2, 96)
    """
    if not _stored_with_padding(spec):
        return spec
    layout = spec.layout.replace("H", "KH") if spec.kv_interleaved else spec.layout
    return spec.replace(layout=layout, kv_interleaved=False, packing=None, packed_axis="H",
                        head_dim_alignment=1)


def values_metadata(meta: Any) -> Any:
    """A peer's (or this engine's) `EngineMetadata` as the values-only engine `values_spec`
    describes, its axes in canonical order (regions sized to the values' blocks): what a
    transport that moves formatted values plans its reads with (which blocks, which ranks,
    how many bytes, none of which depends on the axis order). Unpadded metadata is returned
    as is.

    Raises:
      FormatError: a storage the formatter cannot convert (`check_formattable`).
    """
    import msgspec

    if not meta.padded:
        return meta
    stored = meta.spec()
    check_formattable(stored)
    spec = values_spec(stored)
    spec = spec.replace(layout="".join(a for a in CANONICAL_LAYOUT if a in spec.layout))
    block_len = spec.block_nbytes(meta.tp_size)
    ranks = [
        msgspec.structs.replace(info, regions=[
            msgspec.structs.replace(r, block_len=block_len) for r in info.regions])
        for info in meta.ranks
    ]
    return msgspec.structs.replace(
        meta, layout=spec.layout, kv_interleaved=False, packing=None, packed_axis="H",
        head_dim_alignment=1, stored_head_dim=spec.head_dim, stored_layout=spec.layout,
        ranks=ranks)


def check_formattable(spec: KVCacheSpec) -> None:
    """Refuses caches the formatter cannot convert.

    Raises:
      FormatError: a cache with tokens packed into words (tpu-inference's MLA cache).
    """
    if spec.packing is not None and spec.packed_axis != "H":
        raise FormatError(
            f"the JAX transport's formatter moves caches packed on the head axis only; this "
            f"cache packs {spec.packed_axis!r} (layout {spec.layout!r}, packing {spec.packing})"
        )


def canonical_config(config: EngineConfig, block_size: int) -> EngineConfig:
    """`config` with the canonical layout and the given (sender's) block size, values only
    (`values_spec`): what `plan_peers` and the split/concat ops are called with."""
    spec = values_spec(config.spec).replace(layout=CANONICAL_LAYOUT, block_size=int(block_size))
    return EngineConfig(spec, config.tp_size, config.pp_size, config.layer_split)


def unpack_blocks(x: Any, spec: KVCacheSpec, tp_size: int) -> Any:
    """One rank's stored blocks ``[n, *spec.block_shape(tp_size)]`` as their values
    ``[n, *values_spec(spec).block_shape(tp_size)]`` (raw bits of the dtype's width): packed
    words unfolded and phantom entries dropped, interleaved K/V split onto a ``K`` axis, the
    head dim cut to its real lanes. Traceable (jnp slices and reshapes).

    Example:
      >>> spec = KVCacheSpec.for_tpu_inference(1, 1, 2, 1, dtype="float8_e4m3fn")
      >>> x = (10 * jnp.arange(4)[:, None] + jnp.arange(128)).astype(jnp.uint8)
      >>> unpack_blocks(x.reshape(1, 1, 1, 4, 128), spec, 1)[0, 0, :, 0].tolist()
      [[0, 1], [10, 11]]
    """
    import jax.numpy as jnp

    x = jnp.asarray(x)
    axes = list(spec.block_axes())
    sizes = spec.axis_sizes(tp_size)
    if spec.packing is not None:
        i = 1 + axes.index(spec.packed_axis)
        shape = x.shape
        x = x.reshape(*shape[:i], shape[i] * shape[i + 1], *shape[i + 2:])
        x = jax.lax.slice_in_dim(x, 0, sizes[spec.packed_axis], axis=i)
        del axes[i]  # the position-in-word axis (after the packed one)
    x = jax.lax.slice_in_dim(x, 0, spec.head_dim, axis=1 + axes.index("D"))
    if spec.kv_interleaved:
        j = 1 + axes.index("H")
        shape = x.shape
        x = x.reshape(*shape[:j], shape[j] // 2, 2, *shape[j + 1:])  # combined 2h + kv
        x = jnp.moveaxis(x, j + 1, j)
    return x


def pack_into_blocks(old: Any, values: Any, spec: KVCacheSpec, tp_size: int) -> Any:
    """The inverse of `unpack_blocks`: `values` written into the stored blocks `old` (same
    bit dtype), every padding entry (phantom heads, padded lanes) kept from `old`.

    Example:
      >>> spec = KVCacheSpec.for_tpu_inference(1, 1, 2, 1, dtype="float8_e4m3fn")
      >>> old = jnp.full((1, 1, 1, 4, 128), 7, jnp.uint8)
      >>> new = pack_into_blocks(old, jnp.ones((1, 1, 2, 1, 2), jnp.uint8), spec, 1)
      >>> new[0, 0, 0, :, :3].tolist()
      [[1, 1, 7], [1, 1, 7], [7, 7, 7], [7, 7, 7]]
    """
    import jax.numpy as jnp

    x = jnp.asarray(values)
    stored = spec.block_shape(tp_size)
    axes = list(spec.layout)
    if spec.kv_interleaved:
        j = 1 + axes.index("H")  # the K axis sits at j, H at j + 1 in the values
        x = jnp.moveaxis(x, j, j + 1)
        shape = x.shape
        x = x.reshape(*shape[:j], shape[j] * 2, *shape[j + 2:])
    d = 1 + axes.index("D")
    pad = [(0, 0)] * x.ndim
    pad[d] = (0, stored[spec.block_axes().index("D")] - x.shape[d])
    x = jnp.pad(x, pad)
    if spec.packing is not None:
        i = 1 + axes.index(spec.packed_axis)
        words = stored[spec.block_axes().index(spec.packed_axis)]
        pad = [(0, 0)] * x.ndim
        pad[i] = (0, words * spec.packing - x.shape[i])
        x = jnp.pad(x, pad)
        shape = x.shape
        x = x.reshape(*shape[:i], words, spec.packing, *shape[i + 1:])
    mask = jnp.asarray(spec.payload_mask(tp_size))
    return jnp.where(mask[None], x.astype(old.dtype), old)


def _check_pair(producer: EngineConfig, consumer: EngineConfig) -> int:
    for config in (producer, consumer):
        check_formattable(config.spec)
    p, c = producer.spec, consumer.spec
    fields = ("num_layers", "num_kv_heads", "head_dim", "kv_factor", "mla", "dtype")
    differ = [f"{f}: {getattr(p, f)} vs {getattr(c, f)}" for f in fields
              if getattr(p, f) != getattr(c, f)]
    if differ:
        raise FormatError("producer and consumer caches differ: " + "; ".join(differ))
    if c.block_size % p.block_size:
        raise FormatError(
            f"consumer block size {c.block_size} is not a multiple of the producer's "
            f"{p.block_size}"
        )
    return c.block_size // p.block_size


@functools.lru_cache(maxsize=512)
def _plan(self_cfg: EngineConfig, peer_cfg: EngineConfig, rank: int) -> PeerPlan:
    try:
        return plan_peers(self_cfg, peer_cfg, rank)
    except ValueError as error:
        raise FormatError(str(error)) from error


def send_routes(
    producer: EngineConfig, consumer: EngineConfig, producer_rank: int, num_blocks: int
) -> tuple[Route, ...]:
    """The buffers producer rank `producer_rank` sends for a request of `num_blocks` producer
    blocks (none when another rank holding the same heads sends them).

    Raises:
      FormatError: the engines cannot exchange blocks.

    Example:
      >>> spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4)
      >>> [(r.consumer_rank, r.shape) for r in
      ...  send_routes(EngineConfig(spec, 1), EngineConfig(spec, 2), 0, num_blocks=3)]
      [(0, (3, 2, 2, 1, 4, 4)), (1, (3, 2, 2, 1, 4, 4))]
    """
    _check_pair(producer, consumer)
    bs = producer.spec.block_size
    plan = _plan(canonical_config(producer, bs), canonical_config(consumer, bs), producer_rank)
    if not plan.sends:
        return ()
    return tuple(
        Route(producer_rank, target, index, plan.buffer_shape(index, num_blocks))
        for target, index in zip(plan.target_ranks, plan.connection_buffers)
    )


def receive_routes(
    consumer: EngineConfig, producer: EngineConfig, consumer_rank: int, num_remote_blocks: int
) -> tuple[Route, ...]:
    """The buffers consumer rank `consumer_rank` pulls for `num_remote_blocks` producer
    blocks, in the order `concat_request` takes them.

    Raises:
      FormatError: the engines cannot exchange blocks.

    Example:
      >>> spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4)
      >>> [(r.producer_rank, r.shape) for r in
      ...  receive_routes(EngineConfig(spec, 1), EngineConfig(spec, 2), 0, 3)]
      [(0, (3, 2, 2, 1, 4, 4)), (1, (3, 2, 2, 1, 4, 4))]
    """
    _check_pair(producer, consumer)
    bs = producer.spec.block_size
    plan = _plan(canonical_config(consumer, bs), canonical_config(producer, bs), consumer_rank)
    return tuple(
        Route(source, consumer_rank, i, plan.buffer_shape(i, num_remote_blocks))
        for i, source in enumerate(plan.kept_ranks)
    )


def remote_tail(
    consumer: EngineConfig, producer: EngineConfig, num_local: int, remote_ids: Sequence[int]
) -> np.ndarray:
    """The producer blocks a consumer reads into `num_local` blocks: the tail of the
    request's `remote_ids` (a partial prefix hit reads only what it lacks).

    Raises:
      FormatError: more local blocks than the remote blocks fill.

    Example:
      >>> spec = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=4, block_size=4)
      >>> remote_tail(EngineConfig(spec.replace(block_size=8), 1), EngineConfig(spec, 1), 1,
      ...             [5, 6, 7]).tolist()
      [7]
    """
    ratio = _check_pair(producer, consumer)
    ids = np.asarray(remote_ids, dtype=np.int64).reshape(-1)
    total = -(-len(ids) // ratio)
    hit = total - int(num_local)
    if hit < 0:
        raise FormatError(
            f"{num_local} local blocks but the {len(ids)} remote blocks of block size "
            f"{producer.spec.block_size} fill only {total} blocks of {consumer.spec.block_size}"
        )
    return ids[hit * ratio:]


# -- layout conversion (jitted jnp: pure byte moves) ----------------------------------------


def _expand_perm(layout: str) -> tuple[tuple[str, ...], tuple[int, ...]]:
    missing = tuple(a for a in CANONICAL_LAYOUT if a not in layout)
    letters = tuple(layout) + missing
    return missing, (0,) + tuple(1 + letters.index(a) for a in CANONICAL_LAYOUT)


def _as_bits(x: Any) -> Any:
    """`x` as unsigned ints of its width: XLA may canonicalize NaN payloads when it moves
    floating-point values (seen for bfloat16 on CPU); KV moves must keep every bit."""
    width = np.dtype(x.dtype).itemsize
    return jax.lax.bitcast_convert_type(x, np.dtype(f"u{width}"))


@functools.partial(own_jit, static_argnames=("layout", "keys", "block_shape"))
def to_canonical(arrays: Sequence[Any], layout: str, keys: tuple,
                 block_shape: tuple[int, ...] | None = None) -> Any:
    """Dense per-array blocks ``[n, *block]`` of a cache (`layout`, array `keys`) as one
    canonical ``[n, L, K, H, T, D]`` array.

    Example:
      >>> import jax.numpy as jnp
      >>> k, v = jnp.zeros((1, 2, 3, 4)), jnp.ones((1, 2, 3, 4))      # THD per (layer, kv)
      >>> to_canonical([k, v], "THD", ((0, 0), (0, 1))).shape
      (1, 1, 2, 3, 2, 4)
    """
    import jax.numpy as jnp

    dtype = arrays[0].dtype
    missing, perm = _expand_perm(layout)
    parts = []
    for x in arrays:
        x = _as_bits(x)
        if block_shape is not None:
            x = x.reshape(x.shape[0], *block_shape)
        x = x.reshape(*x.shape, *([1] * len(missing)))
        parts.append(jnp.transpose(x, perm))
    rows: list[Any] = []
    row: list[Any] = []
    for i, (layer, _) in enumerate(keys):
        row.append(parts[i])
        if i + 1 == len(keys) or keys[i + 1][0] != layer:
            rows.append(row[0] if len(row) == 1 else jnp.concatenate(row, axis=2))
            row = []
    out = rows[0] if len(rows) == 1 else jnp.concatenate(rows, axis=1)
    return jax.lax.bitcast_convert_type(out, dtype)


@functools.partial(own_jit, static_argnames=("layout", "keys", "ratio"))
def from_canonical(canon: Any, layout: str, keys: tuple, ratio: int = 1) -> tuple[Any, ...]:
    """The inverse of `to_canonical`, merging `ratio` consecutive sender blocks into one:
    ``[n * ratio, L, K, H, T, D]`` -> per array ``[n, *block]`` with ``T * ratio`` tokens
    (token ``j * T + t`` of a block is token ``t`` of sender block ``j``).

    Example:
      >>> import jax.numpy as jnp
      >>> x = jnp.arange(8.0).reshape(2, 1, 1, 1, 4, 1)                # two blocks of 4
      >>> from_canonical(x, "LKHTD", ((None, None),), ratio=2)[0].shape
      (1, 1, 1, 1, 8, 1)
    """
    import jax.numpy as jnp

    dtype = canon.dtype
    canon = _as_bits(canon)
    n = canon.shape[0] // ratio
    if ratio > 1:
        _, layers, kv, heads, t, d = canon.shape
        canon = canon.reshape(n, ratio, layers, kv, heads, t, d)
        canon = jnp.transpose(canon, (0, 2, 3, 4, 1, 5, 6)).reshape(
            n, layers, kv, heads, ratio * t, d)
    missing, perm = _expand_perm(layout)
    inverse = tuple(int(i) for i in np.argsort(perm))
    out = []
    for layer, kv in keys:
        x = canon
        if layer is not None:
            x = x[:, layer:layer + 1]
        if kv is not None:
            x = x[:, :, kv:kv + 1]
        x = jnp.transpose(x, inverse)
        x = x.reshape(x.shape[: x.ndim - len(missing)])
        out.append(jax.lax.bitcast_convert_type(x, dtype))
    return tuple(out)


# -- device side --------------------------------------------------------------------------


def rank_devices(cache: Any, config: EngineConfig, pp_rank: int = 0,
                 tp_rank: int | None = None) -> dict[int, Any]:
    """Engine rank -> device holding that rank's shard of `cache` (a cache sharded over
    every TP rank of the engine, or one TP rank's cache when `tp_rank` is given).

    Raises:
      FormatError: the cache's TP size does not match the engine's.
    """
    if tp_rank is not None:
        device = next(iter(cache.arrays[0].sharding.device_set))
        return {config.rank(tp_rank, pp_rank): device}
    if cache.tp_size != config.tp_size:
        raise FormatError(
            f"cache is sharded over tp={cache.tp_size}, the engine has tp={config.tp_size}"
        )
    if cache.sharding.data_size != 1:
        raise FormatError("the JAX transport's formatter does not move data-parallel caches")
    mesh = cache.sharding.source_mesh
    names = list(mesh.axis_names)
    tp_axes = cache.sharding.tp_axis
    tp_axes = (tp_axes,) if isinstance(tp_axes, str) else tuple(tp_axes)
    tp_pos = [names.index(a) for a in tp_axes]
    devices = np.moveaxis(mesh.devices, tp_pos, list(range(len(tp_pos)))).reshape(
        config.tp_size, -1)[:, 0]
    return {config.rank(i, pp_rank): d for i, d in enumerate(devices)}


def _shard(array: Any, device: Any) -> Any:
    for shard in array.addressable_shards:
        if shard.device == device:
            return shard.data
    raise FormatError(f"no shard of the cache lives on {device}")


def _layout_block_shape(spec: KVCacheSpec, tp_size: int, array: Any) -> tuple[int, ...] | None:
    """The spec's block shape on one rank when `array` (blocks first) stores its blocks in
    other axes of the same bytes (tpu-inference's cache under its word-column view), else
    None.

    Raises:
      FormatError: the array's blocks are not the spec's size.
    """
    stored = tuple(int(n) for n in array.sharding.shard_shape(array.shape)[1:])
    if len(stored) == len(spec.block_axes()):
        return None
    shape = tuple(int(n) for n in spec.block_shape(tp_size))
    if math.prod(shape) != math.prod(stored):
        raise FormatError(f"cache arrays store blocks of shape {stored}; the spec's layout "
                          f"{spec.layout!r} needs {shape} per rank")
    return shape


@no_context_mesh()
def split_request(
    cache: Any,
    producer: EngineConfig,
    consumer: EngineConfig,
    block_ids: Sequence[int],
    ranks: Mapping[int, Any],
    staging: Any = None,
) -> dict[tuple[int, int], Any]:
    """Producer side: the request's blocks, split into one buffer per (producer rank,
    consumer rank) route of the producer ranks in `ranks`.

    Args:
      cache: the producer's `PagedKVCache` of one pipeline rank (not modified).
      producer, consumer: the two engines' configs.
      block_ids: the producer blocks to send, in token order (after a partial-hit cut).
      ranks: producer rank -> the device holding its shard (`rank_devices`).
      staging: optional ``staging(device, [(shape, dtype), ...])`` returning reusable
        buffers of those shapes on `device` to split into (donated), or None
        (`PullServer.take`): a fresh multi-MiB output costs page faults on CPU.

    Returns:
      ``{(producer rank, consumer rank): buffer}``, each buffer a fresh single-device array
      (never a view of the cache: it may be donated while the buffer waits for its pull).

    Raises:
      FormatError: engines that cannot exchange blocks, an unsupported cache.
      IndexError: a block id out of range.
    """
    from jaxkv.ops import split_for_peers

    check_formattable(cache.spec)
    ids = np.asarray(block_ids, dtype=np.int32).reshape(-1)
    bs = producer.spec.block_size
    canon_p, canon_c = canonical_config(producer, bs), canonical_config(consumer, bs)
    layout, keys = values_spec(cache.spec).layout, tuple(cache.array_keys)
    block_shape = _layout_block_shape(cache.spec, producer.tp_size, cache.arrays[0])
    packed = (cache.spec, producer.tp_size) if _stored_with_padding(cache.spec) else None
    result: dict[tuple[int, int], Any] = {}
    for rank, device in sorted(ranks.items(), key=lambda item: item[0]):
        routes = send_routes(producer, consumer, rank, len(ids))
        if not routes:
            continue
        shards = [_shard(a, device) for a in cache.arrays]
        dev_ids = jax.device_put(ids, device)
        plan = _plan(canon_p, canon_c, rank)
        out = None
        if staging is not None:
            shapes = [(s, cache.spec.dtype) for s in plan.buffer_shapes(len(ids))]
            # Without pooled buffers, fresh ones: every request of a geometry then runs the
            # same program (with `out`), compiled once, not one for the first request and
            # another for the later ones that reuse the pool's buffers.
            out = staging(device, shapes) or [
                jax.device_put(np.zeros(shape, dtype), device) for shape, dtype in shapes]
        if layout == CANONICAL_LAYOUT and block_shape is None and packed is None:
            buffers = split_for_peers(shards[0], dev_ids, canon_p, canon_c, rank, out=out)
        else:
            buffers = _gather_split(shards, dev_ids, layout=layout, keys=keys, canon_p=canon_p,
                                    canon_c=canon_c, rank=rank, block_shape=block_shape,
                                    packed=packed, out=out)
        for route in routes:
            buffer = buffers[route.index]
            if tuple(buffer.shape) != route.shape:
                raise FormatError(f"buffer {route.index} of rank {rank} has shape "
                                  f"{tuple(buffer.shape)}, the plan says {route.shape}")
            result[(rank, route.consumer_rank)] = buffer
    return result


def _unpacked(dense: Any, spec: KVCacheSpec, tp_size: int) -> Any:
    """`unpack_blocks` in the cache's own dtype (moved as raw bits)."""
    return jax.lax.bitcast_convert_type(unpack_blocks(_as_bits(dense), spec, tp_size),
                                        dense.dtype)


@functools.partial(own_jit, static_argnames=("layout", "keys", "canon_p", "canon_c", "rank",
                                             "block_shape", "packed", "window"),
                   donate_argnames=("out",))
def _gather_split(shards: Sequence[Any], ids: Any, *, layout: str, keys: tuple,
                  canon_p: EngineConfig, canon_c: EngineConfig, rank: int,
                  block_shape: tuple[int, ...] | None = None,
                  packed: tuple[KVCacheSpec, int] | None = None,
                  window: tuple[int, int] | None = None,
                  out: Sequence[Any] | None = None) -> list[Any]:
    """One rank's gather of every cache array, its canonical arrangement and its split, as
    one program (one dispatch: a small request is dominated by per-op costs); a padded
    cache's values are extracted first (`packed`: its stored spec and TP size). `window`:
    only the layers ``[lo, hi)`` of arrays with an ``L`` axis are gathered (one gather of the
    window, never a copy of the cache's layers). `out`: buffers of the split's shapes to
    write into (donated: a pool's, reused request after request)."""
    from jaxkv.ops import gather_blocks, split_for_peers

    if window is None:
        dense = [gather_blocks(s, ids) for s in shards]
    else:
        axis = 1 + layout.index("L")
        index = (ids,) + (slice(None),) * (axis - 1) + (slice(*window),)
        # as raw bits: float moves may canonicalize NaN payloads
        dense = [jax.lax.bitcast_convert_type(_as_bits(s)[index], s.dtype) for s in shards]
    if packed is not None:
        dense = [_unpacked(d, *packed) for d in dense]
    canon = to_canonical(dense, layout, keys, block_shape)
    rows = jax.numpy.arange(ids.shape[0], dtype=jax.numpy.int32)
    return split_for_peers(canon, rows, canon_p, canon_c, rank, out=out)


@functools.partial(own_jit, static_argnames=("n_local", "ratio", "layout", "keys", "canon_c",
                                             "canon_p", "rank", "stored", "packed"))
def _concat_rearrange(buffers: list[Any], *, n_local: int, ratio: int, layout: str, keys: tuple,
                      canon_c: EngineConfig, canon_p: EngineConfig, rank: int,
                      stored: tuple[int, ...] | None = None,
                      packed: tuple[KVCacheSpec, int] | None = None,
                      old: Sequence[Any] = ()) -> tuple:
    """One rank's concat of its pulled buffers into canonical blocks, merged and rearranged
    into the local layout per cache array, as one program; for a padded cache (`packed`: its
    stored spec and TP size) the values are written into the blocks' current contents
    `old` (padding kept)."""
    from jaxkv.ops import concat_from_peers

    local_shape = canon_c.local_block_shape(canon_c.coordinates(rank)[1])
    zeros = jax.numpy.zeros((n_local * ratio, *local_shape), buffers[0].dtype)
    rows = jax.numpy.arange(buffers[0].shape[0], dtype=jax.numpy.int32)
    canon = concat_from_peers(zeros, buffers, rows, canon_c, canon_p, rank)
    out = from_canonical(canon, layout, keys, ratio)
    if packed is not None:
        out = tuple(
            jax.lax.bitcast_convert_type(
                pack_into_blocks(_as_bits(o), _as_bits(x), *packed), o.dtype)
            for x, o in zip(out, old)
        )
    elif stored is not None:  # the arrays keep the same bytes in other axes
        out = tuple(x.reshape(x.shape[0], *stored) for x in out)
    return out


def _assemble(shape: tuple[int, ...], like: Any, pieces: Mapping[Any, Any]) -> Any:
    """A global array sharded like `like` (blocks first) from per-device pieces."""
    import jax

    devices = list(like.sharding.addressable_devices)
    if len(devices) == 1 and len(like.sharding.device_set) == 1:
        return pieces[devices[0]]
    shard_shape = like.sharding.shard_shape(like.shape)
    piece = next(iter(pieces.values()))
    global_shape = (shape[0],) + tuple(
        p * (g // s) for p, g, s in zip(piece.shape[1:], like.shape[1:], shard_shape[1:]))
    del shape
    arrays = [pieces[d] for d in devices]
    return jax.make_array_from_single_device_arrays(global_shape, like.sharding, arrays)


@no_context_mesh()
def concat_request(
    cache: Any,
    consumer: EngineConfig,
    producer: EngineConfig,
    local_ids: Sequence[int],
    num_remote_blocks: int,
    pulled: Mapping[int, Sequence[Any]],
    ranks: Mapping[int, Any],
) -> Any:
    """Consumer side: writes pulled buffers into the request's local blocks.

    Args:
      cache: the consumer's `PagedKVCache` of one pipeline rank; consumed (donated): use
        the returned cache.
      consumer, producer: the two engines' configs.
      local_ids: the local blocks to fill, in token order.
      num_remote_blocks: producer blocks the buffers hold (`remote_tail`).
      pulled: consumer rank -> its buffers in `receive_routes` order (single-device arrays
        on that rank's device).
      ranks: consumer rank -> device (`rank_devices`), the ranks of `cache` in this process.

    Returns:
      The updated cache.

    Raises:
      FormatError: missing or misshapen buffers, too many remote blocks for the local ones.
    """

    from jaxkv.ops import concat_from_peers

    check_formattable(cache.spec)
    ratio = _check_pair(producer, consumer)
    ids = np.asarray(local_ids, dtype=np.int32).reshape(-1)
    n_local = len(ids)
    if n_local == 0:
        return cache
    if not (n_local - 1) * ratio < num_remote_blocks <= n_local * ratio:
        raise FormatError(f"{num_remote_blocks} remote blocks do not fill {n_local} local "
                          f"blocks of {ratio} remote blocks each")
    bs = producer.spec.block_size
    canon_c, canon_p = canonical_config(consumer, bs), canonical_config(producer, bs)
    expected = {}
    for rank in ranks:
        routes = receive_routes(consumer, producer, rank, num_remote_blocks)
        got = list(pulled.get(rank, ()))
        if len(got) != len(routes):
            raise FormatError(f"consumer rank {rank}: {len(got)} buffers, expected {len(routes)}")
        for route, buffer in zip(routes, got):
            if tuple(buffer.shape) != route.shape or buffer.dtype != cache.spec.dtype:
                raise FormatError(
                    f"consumer rank {rank}: buffer from producer rank {route.producer_rank} has "
                    f"shape {tuple(buffer.shape)} {buffer.dtype}, expected {route.shape} "
                    f"{cache.spec.dtype}")
        expected[rank] = routes
    first_rank = min(ranks)
    layout, keys = values_spec(cache.spec).layout, tuple(cache.array_keys)
    stored = None
    if _layout_block_shape(cache.spec, consumer.tp_size, cache.arrays[0]) is not None:
        a = cache.arrays[0]
        stored = tuple(int(n) for n in a.sharding.shard_shape(a.shape)[1:])
    packed = (cache.spec, consumer.tp_size) if _stored_with_padding(cache.spec) else None
    if layout == CANONICAL_LAYOUT and ratio == 1 and stored is None and packed is None:
        array = cache.arrays[0]
        count = len(expected[first_rank])
        buffers = [
            _assemble(expected[first_rank][i].shape, array,
                      {ranks[r]: pulled[r][i] for r in ranks})
            for i in range(count)
        ]
        new = concat_from_peers(array, buffers, ids, canon_c, canon_p, first_rank)
        return cache._with_arrays([new])
    pieces: list[dict[Any, Any]] = [{} for _ in cache.arrays]
    for rank, device in ranks.items():
        old: list[Any] = []
        if packed is not None:  # the blocks' current bytes: their padding stays
            from jaxkv.ops import gather_blocks

            dev_ids = jax.device_put(ids, device)
            old = [gather_blocks(_shard(a, device), dev_ids) for a in cache.arrays]
        dense_parts = _concat_rearrange(list(pulled[rank]), n_local=n_local, ratio=ratio,
                                        layout=layout, keys=keys, canon_c=canon_c,
                                        canon_p=canon_p, rank=rank, stored=stored,
                                        packed=packed, old=old)
        for index, dense in enumerate(dense_parts):
            pieces[index][device] = dense
    dense_all = [
        _assemble((n_local, *a.shape[1:]), a, pieces[i]) for i, a in enumerate(cache.arrays)
    ]
    return cache.scatter_blocks(dense_all, ids)


# -- layer groups (layer-wise pulls) ----------------------------------------------------------

LAYER_GROUP_BYTES = 4 << 20
"""The default least bytes of one layer group of a layer-wise pull (`layer_groups`)."""


def layer_groups(producer: EngineConfig, consumer_split: Sequence[int], num_blocks: int,
                 min_bytes: int) -> tuple[tuple[int, int], ...]:
    """The global layer ranges a layer-wise request is pulled in, the same on both sides.

    Consecutive layers are grouped until a group holds at least `min_bytes` of the request
    (all heads, the producer's blocks) or a pipeline-stage boundary of either engine is
    reached: every group lies in one producer stage and one consumer stage.

    Args:
      producer: the producer's config (its block size and layer split).
      consumer_split: the consumer's layers per pipeline rank.
      num_blocks: the producer blocks the read pulls.
      min_bytes: the least bytes of a group (<= 0: one layer per group).

    Returns:
      ``((start, stop), ...)`` covering ``[0, num_layers)`` in order.

    Raises:
      FormatError: a consumer split that does not cover the model's layers.

    Example:
      >>> spec = KVCacheSpec(num_layers=6, num_kv_heads=1, head_dim=4, block_size=4)
      >>> layer_groups(EngineConfig(spec, 1), [6], 2, 2 * 128)   # 128 bytes per layer
      ((0, 2), (2, 4), (4, 6))
      >>> layer_groups(EngineConfig(spec, 1, 2), [1, 5], 2, 1 << 20)
      ((0, 1), (1, 3), (3, 6))
    """
    spec = producer.spec
    num_layers = spec.num_layers
    split = [int(n) for n in consumer_split]
    if sum(split) != num_layers or any(n < 1 for n in split):
        raise FormatError(f"consumer layers per pipeline rank {split} do not cover the "
                          f"model's {num_layers} layers")
    layer_bytes = (int(num_blocks) * spec.block_size * spec.kv_factor * spec.num_kv_heads
                   * spec.head_dim * spec.itemsize)
    cuts = {0, num_layers}
    for layers in (producer.layer_split, split):
        cuts.update(int(c) for c in np.cumsum(layers))
    edges = sorted(cuts)
    groups: list[tuple[int, int]] = []
    for start, stop in zip(edges[:-1], edges[1:]):
        a = start
        while a < stop:
            b = a + 1
            while b < stop and (b - a) * layer_bytes < min_bytes:
                b += 1
            groups.append((a, b))
            a = b
    return tuple(groups)


def _window(config: EngineConfig, layers: tuple[int, int]) -> tuple[EngineConfig, int, int]:
    """The one-stage engine of the global layers ``[a, b)`` (inside one pipeline stage of
    `config`), that stage and its first global layer.

    Raises:
      FormatError: the layers are empty or span pipeline stages.
    """
    a, b = int(layers[0]), int(layers[1])
    if not 0 <= a < b <= config.spec.num_layers:
        raise FormatError(f"layers [{a}, {b}) are outside a model of "
                          f"{config.spec.num_layers} layers")
    stage = config.layer_owner(a)
    start, stop = config.layer_range(stage)
    if b > stop:
        raise FormatError(f"layers [{a}, {b}) span pipeline stages (stage {stage} holds "
                          f"[{start}, {stop}))")
    return EngineConfig(config.spec.replace(num_layers=b - a), config.tp_size), stage, start


def _window_arrays(cache: Any, lo: int, hi: int) -> tuple[list[int], tuple]:
    """The cache arrays holding the local layers ``[lo, hi)`` and their keys, relabeled from
    0 (every array, keys unchanged, when the layout has an ``L`` axis)."""
    keys = tuple(cache.array_keys)
    if "L" in cache.spec.layout:
        return list(range(len(keys))), keys
    chosen = [i for i, (layer, _) in enumerate(keys) if lo <= layer < hi]
    return chosen, tuple((keys[i][0] - lo, keys[i][1]) for i in chosen)


def _check_window_cache(cache: Any, tp_size: int, lo: int, hi: int) -> None:
    if not 0 <= lo < hi <= cache.spec.num_layers:
        raise FormatError(f"the cache holds {cache.spec.num_layers} layers, not local layers "
                          f"[{lo}, {hi})")
    if "L" in cache.spec.layout and (
            _stored_with_padding(cache.spec)
            or _layout_block_shape(cache.spec, tp_size, cache.arrays[0]) is not None):
        raise FormatError("layer groups of a padded cache with an L axis are not supported")


@no_context_mesh()
def split_layers(
    cache: Any,
    producer: EngineConfig,
    consumer: EngineConfig,
    block_ids: Sequence[int],
    ranks: Mapping[int, Any],
    layers: tuple[int, int],
    rows: Sequence[np.ndarray | None] | None = None,
    place: Any = None,
) -> dict[tuple[int, int], Any]:
    """Producer side: `split_request` of the global layers ``[a, b)`` only (one group of
    `layer_groups`): one buffer ``[n, b - a, K, H, T, D]`` per (producer rank, consumer
    rank) route. Only the group's layers of the request's blocks are gathered.

    Args:
      cache: the producer's `PagedKVCache` of the pipeline stage holding the layers.
      producer, consumer: the two engines' configs.
      block_ids: the producer blocks to send, in token order.
      ranks: producer rank -> device of its shard (`rank_devices`); ranks of other stages
        send nothing.
      layers: the global layers ``[a, b)``, inside one stage of each engine.
      rows: the group's bytes as host arrays instead of `cache`'s (whose arrays then only
        give their shapes, dtypes and shardings: a jitted step may have consumed them):
        per cache array, the request's rows (``[len(block_ids), ...]``, whole arrays, not
        shards) of the group's layers only (an ``L`` axis of ``b - a``), None for an array
        of other layers; bits in the array's dtype or an unsigned int of its width.

    Returns:
      ``{(producer rank, consumer rank): buffer}`` (engine ranks), fresh arrays.

    Raises:
      FormatError: engines that cannot exchange blocks, layers spanning stages.
    """
    check_formattable(cache.spec)
    w_p, p_stage, p_start = _window(producer, layers)
    w_c, q_stage, _ = _window(consumer, layers)
    lo, hi = int(layers[0]) - p_start, int(layers[1]) - p_start
    _check_window_cache(cache, producer.tp_size, lo, hi)
    ids = np.asarray(block_ids, dtype=np.int32).reshape(-1)
    bs = producer.spec.block_size
    canon_p, canon_c = canonical_config(w_p, bs), canonical_config(w_c, bs)
    layout = values_spec(cache.spec).layout
    chosen, keys = _window_arrays(cache, lo, hi)
    window = (lo, hi) if "L" in cache.spec.layout else None
    block_shape = _layout_block_shape(cache.spec, producer.tp_size, cache.arrays[0])
    packed = (cache.spec, producer.tp_size) if _stored_with_padding(cache.spec) else None
    result: dict[tuple[int, int], Any] = {}
    for rank, device in sorted(ranks.items(), key=lambda item: item[0]):
        tp_rank, pp_rank = producer.coordinates(rank)
        if pp_rank != p_stage:
            continue
        routes = send_routes(w_p, w_c, tp_rank, len(ids))
        if not routes:
            continue
        if rows is None:
            shards = [_shard(cache.arrays[i], device) for i in chosen]
            dev_ids = jax.device_put(ids, device)
        else:
            layer_axis = 1 + cache.spec.block_axes().index("L") if window else None
            target = device if place is None else place
            shards = [_rows_shard(rows[i], cache.arrays[i], device, len(ids), layer_axis,
                                  hi - lo, target) for i in chosen]
            dev_ids = jax.device_put(np.arange(len(ids), dtype=np.int32), target)
        buffers = _gather_split(shards, dev_ids, layout=layout, keys=keys,
                                canon_p=canon_p, canon_c=canon_c, rank=tp_rank,
                                block_shape=block_shape, packed=packed,
                                window=window if rows is None else window and (0, hi - lo))
        for route in routes:
            buffer = buffers[route.index]
            if tuple(buffer.shape) != route.shape:
                raise FormatError(f"buffer {route.index} of rank {rank} has shape "
                                  f"{tuple(buffer.shape)}, the plan says {route.shape}")
            result[(rank, consumer.rank(route.consumer_rank, q_stage))] = buffer
    return result


def _rows_shard(rows: np.ndarray | None, array: Any, device: Any, num_blocks: int,
                layer_axis: int | None, num_layers: int, target: Any) -> Any:
    """`device`'s part of an array's request rows (`split_layers`'s `rows`), on `target` in
    the array's dtype: the rows sliced as `array`'s shard on `device` is (its head range)
    along every axis but the blocks' and the layers' (`layer_axis`, ``num_layers`` long)."""
    if rows is None:
        raise FormatError("the rows of a layer group's array are missing")
    dtype = np.dtype(array.dtype)
    index = array.sharding.devices_indices_map(tuple(array.shape)).get(device)
    if index is None:
        raise FormatError(f"no shard of the cache lives on {device}")
    rows = np.asarray(rows)
    expected = [num_blocks, *array.shape[1:]]
    if layer_axis is not None:
        expected[layer_axis] = num_layers
    if list(rows.shape) != expected or rows.dtype.itemsize != dtype.itemsize:
        raise FormatError(f"rows {rows.dtype}{list(rows.shape)} do not match the cache "
                          f"array {dtype}{list(array.shape)} for {num_blocks} blocks and "
                          f"{num_layers} layers")
    part = rows[(slice(None),) + tuple(slice(None) if axis == layer_axis else index[axis]
                                       for axis in range(1, rows.ndim))]
    return jax.device_put(np.ascontiguousarray(part).view(dtype), target)


def send_layer_routes(producer: EngineConfig, consumer: EngineConfig, producer_rank: int,
                      num_blocks: int, layers: tuple[int, int]) -> tuple[Route, ...]:
    """`send_routes` of one layer group (engine ranks on both ends; none when the rank's
    stage does not hold the layers).

    Raises:
      FormatError: as `send_routes`, or layers spanning stages.
    """
    w_p, p_stage, _ = _window(producer, layers)
    w_c, q_stage, _ = _window(consumer, layers)
    tp_rank, pp_rank = producer.coordinates(producer_rank)
    if pp_rank != p_stage:
        return ()
    return tuple(
        dataclasses.replace(route, producer_rank=producer_rank,
                            consumer_rank=consumer.rank(route.consumer_rank, q_stage))
        for route in send_routes(w_p, w_c, tp_rank, num_blocks))


def receive_layer_routes(consumer: EngineConfig, producer: EngineConfig, consumer_rank: int,
                         num_remote_blocks: int, layers: tuple[int, int]) -> tuple[Route, ...]:
    """`receive_routes` of one layer group: the buffers consumer rank `consumer_rank` pulls
    for the global layers ``[a, b)``, producer ranks as engine ranks (none when the rank's
    stage does not hold the layers).

    Raises:
      FormatError: as `receive_routes`, or layers spanning stages.
    """
    w_c, q_stage, _ = _window(consumer, layers)
    w_p, p_stage, _ = _window(producer, layers)
    tp_rank, pp_rank = consumer.coordinates(consumer_rank)
    if pp_rank != q_stage:
        return ()
    return tuple(
        dataclasses.replace(route, producer_rank=producer.rank(route.producer_rank, p_stage),
                            consumer_rank=consumer_rank)
        for route in receive_routes(w_c, w_p, tp_rank, num_remote_blocks))


@functools.partial(own_jit, static_argnames=("axis", "window"), donate_argnums=0)
def _scatter_window(array: Any, dense: Any, ids: Any, *, axis: int,
                    window: tuple[int, int]) -> Any:
    """`array` with the layers ``window`` (on `axis`) of blocks `ids` set to `dense`."""
    index = (ids,) + (slice(None),) * (axis - 1) + (slice(*window),)
    updated = _as_bits(array).at[index].set(_as_bits(dense))  # raw bits: NaN payloads kept
    return jax.lax.bitcast_convert_type(updated, array.dtype)


@no_context_mesh()
def concat_layers(
    cache: Any,
    consumer: EngineConfig,
    producer: EngineConfig,
    local_ids: Sequence[int],
    num_remote_blocks: int,
    pulled: Mapping[int, Sequence[Any]],
    ranks: Mapping[int, Any],
    layers: tuple[int, int],
) -> Any:
    """Consumer side: `concat_request` of one layer group: writes the pulled buffers of the
    global layers ``[a, b)`` into the request's local blocks, every other layer untouched.

    Args:
      cache: the consumer's `PagedKVCache` of the stage holding the layers; consumed
        (donated): use the returned cache.
      consumer, producer, local_ids, num_remote_blocks: as `concat_request`.
      pulled: consumer rank -> its buffers in `receive_layer_routes` order.
      ranks: consumer rank -> device, the ranks of `cache` in this process.
      layers: the global layers ``[a, b)``.

    Returns:
      The updated cache.

    Raises:
      FormatError: missing or misshapen buffers, layers spanning stages.
    """
    check_formattable(cache.spec)
    w_c, _, q_start = _window(consumer, layers)
    w_p, _, _ = _window(producer, layers)
    lo, hi = int(layers[0]) - q_start, int(layers[1]) - q_start
    _check_window_cache(cache, consumer.tp_size, lo, hi)
    window_ranks = {consumer.coordinates(r)[0]: d for r, d in ranks.items()}
    window_pulled = {consumer.coordinates(r)[0]: list(b) for r, b in pulled.items()}
    ids = np.asarray(local_ids, dtype=np.int32).reshape(-1)
    if len(ids) == 0:
        return cache
    chosen, keys = _window_arrays(cache, lo, hi)
    if "L" not in cache.spec.layout:
        # The group's arrays are a cache of their own: written in place, the others kept.
        view = _layer_view(cache, w_c.spec.num_layers, [cache.arrays[i] for i in chosen])
        updated = concat_request(view, w_c, w_p, ids.tolist(), num_remote_blocks, window_pulled,
                                 window_ranks)
        arrays = list(cache.arrays)
        for i, array in zip(chosen, updated.arrays):
            arrays[i] = array
        return cache._with_arrays(arrays)
    # An L axis: the group's layers of the local blocks are assembled densely, then set in
    # one scatter per array (the other layers of those blocks are not rewritten).
    ratio = _check_pair(producer, consumer)
    n_local = len(ids)
    if not (n_local - 1) * ratio < num_remote_blocks <= n_local * ratio:
        raise FormatError(f"{num_remote_blocks} remote blocks do not fill {n_local} local "
                          f"blocks of {ratio} remote blocks each")
    bs = producer.spec.block_size
    canon_c, canon_p = canonical_config(w_c, bs), canonical_config(w_p, bs)
    layout = values_spec(cache.spec).layout
    pieces: list[dict[Any, Any]] = [{} for _ in cache.arrays]
    for tp_rank, device in window_ranks.items():
        routes = receive_routes(w_c, w_p, tp_rank, num_remote_blocks)
        got = window_pulled.get(tp_rank, [])
        if len(got) != len(routes):
            raise FormatError(f"consumer TP rank {tp_rank}: {len(got)} buffers of layers "
                              f"{tuple(layers)}, expected {len(routes)}")
        for route, buffer in zip(routes, got):
            if tuple(buffer.shape) != route.shape or buffer.dtype != cache.spec.dtype:
                raise FormatError(
                    f"consumer TP rank {tp_rank}: buffer from producer TP rank "
                    f"{route.producer_rank} has shape {tuple(buffer.shape)} {buffer.dtype}, "
                    f"expected {route.shape} {cache.spec.dtype}")
        dense_parts = _concat_rearrange(got, n_local=n_local, ratio=ratio, layout=layout,
                                        keys=keys, canon_c=canon_c, canon_p=canon_p,
                                        rank=tp_rank)
        for index, dense in enumerate(dense_parts):
            pieces[index][device] = dense
    axis = 1 + cache.spec.layout.index("L")
    arrays = []
    for i, array in enumerate(cache.arrays):
        dense = _assemble((n_local,), array, pieces[i])
        if axis == 1:
            # L right after the blocks: (block, layer) pairs are rows of the same bytes,
            # written in place by the blocks op (no copy of the array).
            from jaxkv.ops import scatter_blocks

            stage_layers = int(array.shape[1])
            rows = (ids[:, None].astype(np.int64) * stage_layers
                    + np.arange(lo, hi)[None]).reshape(-1)
            flat = scatter_blocks(_merge_rows(array), _merge_rows(dense, donate=False),
                                  rows.astype(np.int32))
            arrays.append(_split_rows(flat, layers=stage_layers))
        else:  # one scatter of the window (XLA:CPU copies the array for it)
            arrays.append(_scatter_window(array, dense, ids, axis=axis, window=(lo, hi)))
    return cache._with_arrays(arrays)


@functools.partial(own_jit, donate_argnums=0)
def _merge_rows_donated(array: Any) -> Any:
    return array.reshape(array.shape[0] * array.shape[1], *array.shape[2:])


@own_jit
def _merge_rows_kept(array: Any) -> Any:
    return array.reshape(array.shape[0] * array.shape[1], *array.shape[2:])


def _merge_rows(array: Any, donate: bool = True) -> Any:
    """``[N, L, ...]`` as ``[N * L, ...]`` (the same bytes; donated: no copy)."""
    return _merge_rows_donated(array) if donate else _merge_rows_kept(array)


@functools.partial(own_jit, static_argnames=("layers",), donate_argnums=0)
def _split_rows(array: Any, *, layers: int) -> Any:
    """The inverse of `_merge_rows` (donated: no copy)."""
    return array.reshape(array.shape[0] // layers, layers, *array.shape[1:])


def _layer_view(cache: Any, num_layers: int, arrays: Sequence[Any]) -> Any:
    """A cache of `arrays` (some of `cache`'s per-layer arrays) holding `num_layers` layers."""
    return type(cache)(cache.spec.replace(num_layers=num_layers), arrays, cache.sharding)
