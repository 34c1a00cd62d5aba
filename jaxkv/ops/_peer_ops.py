"""Split and concat of a cross-layer cache for peers with another TP/PP layout (TensorRT-LLM's
cache formatter), as XLA FFI custom calls. The plan (which layers and heads go to which buffer)
comes from `jaxkv.ops.plan_peers`; the handlers move boxes of blocks with the shared engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from jaxkv._parallel import EngineConfig, PeerPlan, plan_peers
from jaxkv.ops._block_ops import _check_blocks_first, _ffi_call
from jaxkv.ops._ids import as_id_array, check_ids, concrete_ids
from jaxkv.ops._partition import block_shards
from jaxkv.ops._runner import run_per_shard

__all__ = ["concat_from_peers", "split_for_peers"]


# The head axis of an LKHTD cache array ([num_blocks, L, K, H, T, D]).
_HEAD_AXIS = 3
# What runs per shard is one rank's split or concat of whole blocks: only the block axis
# (data parallelism) and the head axis (TP ranks) may be sharded.
_WHOLE_BLOCK_AXES = tuple(
    (axis, f"split/concat cut whole {name} of a rank's blocks by the peer plan; only the "
     "block and head axes may be sharded")
    for axis, name in ((1, "layers"), (2, "K/V halves"), (4, "tokens"), (5, "head dims"))
)
_SEGMENT_ROLES = ((1, "segment", 0),)


def _local_block_shape(cache: Any) -> tuple[int, ...]:
    """Per-block shape of the cache as each shard sees it (the whole shape for a tracer)."""
    if isinstance(cache, jax.core.Tracer) or len(cache.sharding.device_set) == 1:
        return tuple(cache.shape[1:])
    return tuple(cache.sharding.shard_shape(cache.shape)[1:])


def _plan_for_cache(cache: Any, self_cfg: EngineConfig, peer_cfg: EngineConfig,
                    rank: int) -> tuple[PeerPlan, tuple[int, ...]]:
    """The plan and the block shape of one rank (the cache may hold several ranks' heads)."""
    for name, cfg in (("self_cfg", self_cfg), ("peer_cfg", peer_cfg)):
        if not isinstance(cfg, EngineConfig):
            raise TypeError(f"{name} must be a jaxkv.EngineConfig, got {type(cfg).__name__}")
    spec = self_cfg.spec
    if spec.layout != "LKHTD":
        raise ValueError(
            f"split/concat work on cross-layer LKHTD caches; self_cfg.spec.layout is "
            f"{spec.layout!r} (permute the blocks first, see permute_blocks)"
        )
    if spec.padded or spec.packing is not None or spec.kv_interleaved:
        raise ValueError(
            "split/concat move unpadded LKHTD blocks with separate K/V heads; this spec has "
            f"packing {spec.packing}, head_dim_alignment {spec.head_dim_alignment}, "
            f"kv_interleaved {spec.kv_interleaved} (stored layout {spec.stored_layout!r}). "
            "Packed or padded TPU layouts are not supported by split/concat"
        )
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)):
        raise TypeError(f"rank must be an integer, got {rank!r}")
    plan = plan_peers(self_cfg, peer_cfg, int(rank))
    _check_blocks_first(cache, "cache")
    expected = self_cfg.local_block_shape(plan.pp_rank)
    local = _local_block_shape(cache)
    if _ranks_held(local, expected, self_cfg) is None:
        raise ValueError(
            f"cache blocks are {local} per shard; rank {rank} of {self_cfg.tp_size} TP x "
            f"{self_cfg.pp_size} PP holds blocks of {expected} ([L_local, K, H_rank, T, D]), "
            "or the heads of several TP ranks of its stage side by side"
        )
    if np.dtype(cache.dtype) != spec.dtype:
        raise ValueError(f"cache dtype {cache.dtype} differs from the spec's {spec.dtype}")
    return plan, tuple(expected)


def _ranks_held(block: tuple[int, ...], expected: tuple[int, ...],
                cfg: EngineConfig) -> int | None:
    """How many TP ranks' heads a block of shape `block` holds side by side (None: not a
    whole number of ranks of `cfg` of the expected shape)."""
    h = _HEAD_AXIS - 1
    if len(block) != len(expected) or any(
        a != b for d, (a, b) in enumerate(zip(block, expected)) if d != h
    ):
        return None
    if block[h] % expected[h]:
        return None
    ranks = block[h] // expected[h]
    if ranks < 1 or cfg.tp_size % ranks or (
        ranks > 1 and ranks * expected[h] > cfg.spec.num_kv_heads
    ):
        return None
    return ranks


def _global_buffer_shape(cache: Any, rank_shape: tuple[int, ...],
                         unit: int) -> tuple[int, ...]:
    """A buffer's shape next to `cache` (a global array, or one shard's piece inside
    shard_map): one rank's buffer `rank_shape` (``[n, layers, K, heads, T, D]``) with the
    heads of as many ranks side by side as the cache holds (`unit`: heads of one rank)."""
    ranks = cache.shape[_HEAD_AXIS] // unit
    return (*rank_shape[:_HEAD_AXIS], rank_shape[_HEAD_AXIS] * ranks,
            *rank_shape[_HEAD_AXIS + 1:])


def _rank_slice(x: Any, rank: int, heads: int) -> Any:
    return jax.lax.slice_in_dim(x, rank * heads, (rank + 1) * heads, axis=_HEAD_AXIS)


def _data_shards(cache: Any) -> int:
    """How many shards split the block axis of a concrete cache (1 when none)."""
    if isinstance(cache, jax.core.Tracer):
        return 1
    sharding = cache.sharding
    if len(sharding.device_set) == 1 or not isinstance(sharding, NamedSharding):
        return 1
    return block_shards(sharding.mesh, sharding.spec)[1]


def _check_segments(host: np.ndarray, shards: int, num_blocks: int, op: str) -> None:
    """On a block axis split in `shards`: the ids come in equal segments, segment ``s``
    naming blocks of shard ``s`` (or padding)."""
    if shards == 1:
        return
    if host.shape[0] % shards:
        raise ValueError(
            f"jaxkv.ops.{op}: {host.shape[0]} block_ids for a block axis split in {shards} "
            f"shards: the buffers' rows come in {shards} equal segments, one per shard (pad "
            "the ids with -1)")
    segment, per_shard = host.shape[0] // shards, num_blocks // shards
    rows = np.arange(host.shape[0])
    wrong = np.flatnonzero((host >= 0) & (host // per_shard != rows // segment))
    if wrong.size:
        i = int(wrong[0])
        raise ValueError(
            f"jaxkv.ops.{op}: block_ids[{i}] = {int(host[i])} is in segment {i // segment} but "
            f"block {int(host[i])} belongs to data shard {int(host[i]) // per_shard} (each of "
            f"{shards} shards owns {per_shard} blocks and handles segment s of {segment} ids); "
            "moving a block between shards needs a collective")


def _split_local(cache, ids, *into, box_starts: tuple[int, ...],
                 shapes: tuple[tuple[int, ...], ...], validate_ids: bool,
                 unit: int | None = None):
    """One shard's split; `unit`: the heads of one TP rank in `cache` (None: all of them)."""
    from jaxkv.ops._dispatch import dispatch

    ranks = 1 if unit is None else cache.shape[_HEAD_AXIS] // unit
    if ranks > 1:  # several ranks' heads in one piece (one device, or a coarser sharding)
        heads = [shape[_HEAD_AXIS - 1] for shape in shapes]
        parts = [
            _split_local(_rank_slice(cache, r, unit or 0), ids,
                         *(_rank_slice(b, r, h) for b, h in zip(into, heads)),
                         box_starts=box_starts, shapes=shapes, unit=unit,
                         validate_ids=validate_ids)
            for r in range(ranks)
        ]
        return tuple(jnp.concatenate([part[k] for part in parts], axis=_HEAD_AXIS)
                     for k in range(len(shapes)))

    def ffi(cache, ids, *into):
        results = tuple(jax.ShapeDtypeStruct((ids.shape[0], *shape), cache.dtype)
                        for shape in shapes)
        aliases = {2 + i: i for i in range(len(into))} if into else None
        call = _ffi_call("jaxkv_split_blocks", results, aliases)
        return tuple(call(cache, ids, *into, box_starts=np.asarray(box_starts, np.int64),
                          validate_ids=validate_ids))

    return dispatch("split", ffi, cache, ids, *into, box_starts=box_starts, shapes=shapes,
                    validate_ids=validate_ids)


def _concat_local(cache, ids, *buffers, box_starts: tuple[int, ...], validate_ids: bool,
                  unit: int | None = None):
    """One shard's concat; `unit`: the heads of one TP rank in `cache` (None: all of them)."""
    from jaxkv.ops._dispatch import dispatch

    ranks = 1 if unit is None else cache.shape[_HEAD_AXIS] // unit
    if ranks > 1:  # several ranks' heads in one piece (one device, or a coarser sharding)
        heads = [b.shape[_HEAD_AXIS] // ranks for b in buffers]
        return jnp.concatenate([
            _concat_local(_rank_slice(cache, r, unit or 0), ids,
                          *(_rank_slice(b, r, h) for b, h in zip(buffers, heads)),
                          box_starts=box_starts, unit=unit, validate_ids=validate_ids)
            for r in range(ranks)
        ], axis=_HEAD_AXIS)

    def ffi(cache, ids, *buffers):
        call = _ffi_call("jaxkv_concat_blocks", jax.ShapeDtypeStruct(cache.shape, cache.dtype),
                         {0: 0})
        return call(cache, ids, *buffers, box_starts=np.asarray(box_starts, np.int64),
                    validate_ids=validate_ids)

    return dispatch("concat", ffi, cache, ids, *buffers, box_starts=box_starts,
                    validate_ids=validate_ids)


def split_for_peers(
    cache: jax.Array, block_ids: Any, self_cfg: EngineConfig, peer_cfg: EngineConfig, rank: int,
    *, out: Sequence[jax.Array] | None = None, validate_ids: bool = True,
) -> list[jax.Array]:
    """Splits listed blocks into the dense buffers a peer engine with another TP/PP layout
    needs (TensorRT-LLM's cache split; docs/data-movement.md section 4).

    Buffer ``i`` is ``[n, peer_layers, K, Hn, T, D]`` with
    ``out[(h // Hn) * dPP + r][b, lid, kv, h % Hn] = block_b[l, kv, h]``, where ``(r, lid)``
    locate local layer ``l`` among the peer PP ranks of the domain. Send buffer
    ``plan.connection_buffers[p]`` to peer rank ``plan.target_ranks[p]`` for
    ``plan = jaxkv.ops.plan_peers(self_cfg, peer_cfg, rank)``, if ``plan.sends``.

    Args:
      cache: this rank's cross-layer cache ``[num_blocks, L_local, K, H_rank, T, D]``
        (``self_cfg.spec.layout == "LKHTD"``, unpadded and unpacked); not modified. Also the
        array of several TP ranks of the stage, their heads side by side (``H = m * H_rank``),
        sharded or not; see "Shardings" below.
      block_ids: int32 ids of the blocks to send, shape ``[n]``; rows of negative ids are zero.
      self_cfg, peer_cfg: this engine and the peer engine.
      rank: this rank (``pp_rank * tp_size + tp_rank``). Only its PP rank changes the data
        movement, so under `shard_map` over the TP axis any rank of the pipeline stage works.
      out: optional buffers of the returned shapes to write into (donated) instead of
        allocating new ones: a staging area reused every step.
      validate_ids: see `jaxkv.ops.copy_blocks`.

    Shardings (eagerly, or traced inside the caller's jit; no collective either way):

    * heads over a TP mesh axis or a tuple of axes (``P(None, None, None, ("model",
      "expert"))``): each shard holding whole ranks splits its own heads; buffer ``k``'s
      head axis holds each rank's buffer ``k`` side by side (``m * Hn`` heads) and is sharded
      like the cache's, so a shard's piece of it is its rank's buffer ``k``.
    * the block axis over a data axis (``P("data", None, None, "model")``, data parallelism:
      shard ``s`` of ``S`` owns blocks ``[s * B / S, (s + 1) * B / S)``): ids stay global and
      come in ``S`` equal segments, segment ``s`` naming blocks of shard ``s`` (or -1); the
      buffers' rows are sharded like the block axis, row ``i`` written by the shard of
      segment ``i // (n / S)`` (concrete ids in another shard's segment raise; traced ones
      give zero rows). In your jit give the outputs the cache's sharding (``out_shardings``)
      or pass `out`, or XLA gathers them (on an Explicit mesh, ``jax.make_mesh``'s default,
      the outputs' types carry that sharding on their own).
    * replicated (``P()``): every device computes the same buffers, replicated.

    Returns:
      ``plan.num_buffers`` dense buffers, in buffer order, sharded like the cache.

    Raises:
      ValueError: incompatible engines (see `plan_peers`), a cache of the wrong shape, dtype or
        layout, a packed or padded spec, wrong `out` buffers, ids that do not come in equal
        segments of their data shards, a sharding of another axis than blocks and heads.
      IndexError: an id out of range (concrete ids).

    Example (docs/data-movement.md: sender TP=2 -> receiver TP=1 PP=2, rank 1 holds heads 2-3):
      >>> spec = KVCacheSpec(num_layers=4, num_kv_heads=4, head_dim=1, block_size=1,
      ...                    dtype="float32")
      >>> cache = jnp.arange(2 * 4 * 2 * 2.0).reshape(2, 4, 2, 2, 1, 1)
      >>> bufs = split_for_peers(cache, [1], EngineConfig(spec, 2), EngineConfig(spec, 1, 2), 1)
      >>> [b.shape for b in bufs], bufs[1].ravel().tolist()
      ([(1, 2, 2, 2, 1, 1), (1, 2, 2, 2, 1, 1)], [24.0, 25.0, 26.0, 27.0, 28.0, 29.0, 30.0, 31.0])
    """
    plan, rank_block = _plan_for_cache(cache, self_cfg, peer_cfg, rank)
    unit = rank_block[_HEAD_AXIS - 1]
    ids = as_id_array(block_ids, "block_ids")
    host = concrete_ids(ids)
    if host is not None:
        check_ids(host, "block_ids", cache.shape[0])
        _check_segments(host, _data_shards(cache), cache.shape[0], "split_for_peers")
    local_shapes = tuple(shape[1:] for shape in plan.buffer_shapes(ids.shape[0]))
    into: tuple[Any, ...] = ()
    if out is not None:
        into = tuple(out)
        if len(into) != plan.num_buffers:
            raise ValueError(f"out has {len(into)} buffers; the plan has {plan.num_buffers}")
        for i, (buffer, shape) in enumerate(zip(into, local_shapes)):
            _check_blocks_first(buffer, f"out[{i}]")
            expected = _global_buffer_shape(cache, (ids.shape[0], *shape), unit)
            if tuple(buffer.shape) != expected or buffer.dtype != cache.dtype:
                raise ValueError(
                    f"out[{i}] has shape {tuple(buffer.shape)} and dtype {buffer.dtype}; "
                    f"expected {expected} and {cache.dtype}"
                )
    count = len(into)
    result = run_per_shard(
        _split_local, (cache, ids, *into), ("blocks", "replicated") + ("blocks",) * count,
        dict(box_starts=plan.box_starts(), shapes=local_shapes, unit=unit,
             validate_ids=validate_ids),
        donate_argnums=tuple(range(2, 2 + count)), num_outputs=plan.num_buffers,
        op="split_for_peers", unsharded_axes=_WHOLE_BLOCK_AXES, roles=_SEGMENT_ROLES,
        grouped_axes=((_HEAD_AXIS, unit),),
    )
    return list(result)


def concat_from_peers(
    cache: jax.Array, buffers: Sequence[jax.Array], block_ids: Any, self_cfg: EngineConfig,
    peer_cfg: EngineConfig, rank: int, *, validate_ids: bool = True,
) -> jax.Array:
    """Writes the buffers received from a peer engine into listed blocks, in place
    (TensorRT-LLM's cache concat, the inverse of `split_for_peers`).

    ``block_b[l, kv, h] = buffers[(h // Hn) * dPP + r][b, lid, kv, h % Hn]``, where `buffers`
    are those of the connections the receiver keeps, in target-rank order
    (``plan.kept_ranks`` for ``plan = jaxkv.ops.plan_peers(self_cfg, peer_cfg, rank)``).

    Args:
      cache: this rank's cross-layer cache ``[num_blocks, L_local, K, H_rank, T, D]``, or
        several TP ranks' heads side by side, sharded as `split_for_peers` describes.
        Consumed (donated) outside jit.
      buffers: ``plan.num_buffers`` dense buffers of ``plan.buffer_shapes(n)`` (per rank
        held: ``m`` ranks' buffers side by side on the head axis), sharded like the cache
        (rows in segments over a sharded block axis, see `split_for_peers`).
      block_ids: int32 ids of the blocks to fill, shape ``[n]``; negative ids are skipped;
        unique.
      self_cfg, peer_cfg: this (receiving) engine and the sending engine.
      rank: this rank; see `split_for_peers`.
      validate_ids: see `jaxkv.ops.copy_blocks`.

    On a sharded block axis the ids come in one segment per data shard like
    `split_for_peers`' rows: shard ``s`` writes the blocks it owns named in segment ``s``
    from its rows of the buffers (concrete ids elsewhere raise; traced ones are skipped).

    Returns:
      The updated cache.

    Raises:
      ValueError: incompatible engines, a cache or buffers of the wrong shape or dtype, a
        packed or padded spec, the wrong number of buffers, repeated ids, ids outside their
        data shard's segment.
      IndexError: an id out of range (concrete ids).

    Example (docs/data-movement.md: receiver rank 0 of TP=1 PP=2 rebuilds layers 0-1 from 2
    senders):
      >>> spec = KVCacheSpec(num_layers=4, num_kv_heads=4, head_dim=1, block_size=1,
      ...                    dtype="float32")
      >>> parts = [jnp.full((1, 2, 2, 2, 1, 1), 1.0), jnp.full((1, 2, 2, 2, 1, 1), 2.0)]
      >>> cache = concat_from_peers(jnp.zeros((1, 2, 2, 4, 1, 1)), parts, [0],
      ...                           EngineConfig(spec, 1, 2), EngineConfig(spec, 2), rank=0)
      >>> cache[0, 0, 0].ravel().tolist()
      [1.0, 1.0, 2.0, 2.0]
    """
    plan, rank_block = _plan_for_cache(cache, self_cfg, peer_cfg, rank)
    unit = rank_block[_HEAD_AXIS - 1]
    ids = as_id_array(block_ids, "block_ids")
    buffers = tuple(
        b if isinstance(b, (jax.Array, jax.core.Tracer)) else jnp.asarray(b) for b in buffers
    )
    if len(buffers) != plan.num_buffers:
        raise ValueError(
            f"got {len(buffers)} buffers; rank {rank} keeps {plan.num_buffers} (from peer ranks "
            f"{list(plan.kept_ranks)})"
        )
    for i, (buffer, shape) in enumerate(zip(buffers, plan.buffer_shapes(ids.shape[0]))):
        _check_blocks_first(buffer, f"buffers[{i}]")
        expected = _global_buffer_shape(cache, shape, unit)
        if tuple(buffer.shape) != expected or buffer.dtype != cache.dtype:
            raise ValueError(
                f"buffers[{i}] has shape {tuple(buffer.shape)} and dtype {buffer.dtype}; "
                f"expected {expected} and {cache.dtype}"
            )
    host = concrete_ids(ids)
    if host is not None:
        check_ids(host, "block_ids", cache.shape[0], unique=True)
        _check_segments(host, _data_shards(cache), cache.shape[0], "concat_from_peers")
    if ids.shape[0] == 0:
        return cache
    return run_per_shard(
        _concat_local, (cache, ids, *buffers),
        ("blocks", "replicated") + ("blocks",) * len(buffers),
        dict(box_starts=plan.box_starts(), unit=unit, validate_ids=validate_ids),
        donate_argnums=(0,), op="concat_from_peers", unsharded_axes=_WHOLE_BLOCK_AXES,
        roles=_SEGMENT_ROLES, grouped_axes=((_HEAD_AXIS, unit),),
    )
