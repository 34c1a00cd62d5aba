"""Split and concat of a cross-layer cache for peers with another TP/PP layout (TensorRT-LLM's
cache formatter), as XLA FFI custom calls. The plan (which layers and heads go to which buffer)
comes from `jaxkv.plan_peers`; the handlers move boxes of blocks with the shared engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv._parallel import EngineConfig, PeerPlan, plan_peers
from jaxkv.ops._block_ops import _check_blocks_first, _ffi_call
from jaxkv.ops._ids import as_id_array, check_ids, concrete_ids
from jaxkv.ops._reshape_ops import run_per_shard

__all__ = ["concat_from_peers", "split_for_peers"]


def _local_block_shape(cache: Any) -> tuple[int, ...]:
    """Per-block shape of the cache as each shard sees it."""
    if isinstance(cache, jax.core.Tracer) or len(cache.sharding.device_set) == 1:
        return tuple(cache.shape[1:])
    return tuple(cache.sharding.shard_shape(cache.shape)[1:])


def _plan_for_cache(cache: Any, self_cfg: EngineConfig, peer_cfg: EngineConfig,
                    rank: int) -> PeerPlan:
    for name, cfg in (("self_cfg", self_cfg), ("peer_cfg", peer_cfg)):
        if not isinstance(cfg, EngineConfig):
            raise TypeError(f"{name} must be a jaxkv.EngineConfig, got {type(cfg).__name__}")
    if self_cfg.spec.layout != "LKHTD":
        raise ValueError(
            f"split/concat work on cross-layer LKHTD caches; self_cfg.spec.layout is "
            f"{self_cfg.spec.layout!r} (permute the blocks first, see permute_blocks)"
        )
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)):
        raise TypeError(f"rank must be an integer, got {rank!r}")
    plan = plan_peers(self_cfg, peer_cfg, int(rank))
    _check_blocks_first(cache, "cache")
    expected = self_cfg.local_block_shape(plan.pp_rank)
    local = _local_block_shape(cache)
    if local != expected:
        raise ValueError(
            f"cache blocks are {local} per shard; rank {rank} of {self_cfg.tp_size} TP x "
            f"{self_cfg.pp_size} PP holds blocks of {expected} ([L_local, K, H_rank, T, D])"
        )
    if np.dtype(cache.dtype) != self_cfg.spec.dtype:
        raise ValueError(f"cache dtype {cache.dtype} differs from the spec's {self_cfg.spec.dtype}")
    return plan


def _global_buffer_shape(cache: Any, local_shape: tuple[int, ...]) -> tuple[int, ...]:
    """A buffer's shape as a global array sharded like `cache` (equal to `local_shape` for an
    unsharded cache or inside shard_map)."""
    if isinstance(cache, jax.core.Tracer) or len(cache.sharding.device_set) == 1:
        return local_shape
    global_block = cache.shape[1:]
    shard_block = cache.sharding.shard_shape(cache.shape)[1:]
    return (local_shape[0],) + tuple(
        size * (g // s) for size, g, s in zip(local_shape[1:], global_block, shard_block)
    )


def _split_local(cache, ids, *into, box_starts: tuple[int, ...],
                 shapes: tuple[tuple[int, ...], ...], validate_ids: bool):
    from jaxkv.ops._dispatch import dispatch

    def ffi(cache, ids, *into):
        results = tuple(jax.ShapeDtypeStruct((ids.shape[0], *shape), cache.dtype)
                        for shape in shapes)
        aliases = {2 + i: i for i in range(len(into))} if into else None
        call = _ffi_call("jaxkv_split_blocks", results, aliases)
        return tuple(call(cache, ids, *into, box_starts=np.asarray(box_starts, np.int64),
                          validate_ids=validate_ids))

    return dispatch("split", ffi, cache, ids, *into, box_starts=box_starts, shapes=shapes,
                    validate_ids=validate_ids)


def _concat_local(cache, ids, *buffers, box_starts: tuple[int, ...], validate_ids: bool):
    from jaxkv.ops._dispatch import dispatch

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
        (``self_cfg.spec.layout == "LKHTD"``); not modified. A head-sharded array runs per
        shard and returns buffers sharded the same way.
      block_ids: int32 ids of the blocks to send, shape ``[n]``; rows of negative ids are zero.
      self_cfg, peer_cfg: this engine and the peer engine.
      rank: this rank (``pp_rank * tp_size + tp_rank``). Only its PP rank changes the data
        movement, so under `shard_map` over the TP axis any rank of the pipeline stage works.
      out: optional buffers of the returned shapes to write into (donated) instead of
        allocating new ones: a staging area reused every step.
      validate_ids: see `jaxkv.ops.copy_blocks`.

    Returns:
      ``plan.num_buffers`` dense buffers, in buffer order.

    Raises:
      ValueError: incompatible engines (see `plan_peers`), a cache of the wrong shape, dtype or
        layout, wrong `out` buffers.
      IndexError: an id out of range (concrete ids).

    Example (docs/data-movement.md: sender TP=2 -> receiver TP=1 PP=2, rank 1 holds heads 2-3):
      >>> spec = KVCacheSpec(num_layers=4, num_kv_heads=4, head_dim=1, block_size=1,
      ...                    dtype="float32")
      >>> cache = jnp.arange(2 * 4 * 2 * 2.0).reshape(2, 4, 2, 2, 1, 1)
      >>> bufs = split_for_peers(cache, [1], EngineConfig(spec, 2), EngineConfig(spec, 1, 2), 1)
      >>> [b.shape for b in bufs], bufs[1].ravel().tolist()
      ([(1, 2, 2, 2, 1, 1), (1, 2, 2, 2, 1, 1)], [24.0, 25.0, 26.0, 27.0, 28.0, 29.0, 30.0, 31.0])
    """
    plan = _plan_for_cache(cache, self_cfg, peer_cfg, rank)
    ids = as_id_array(block_ids, "block_ids")
    host = concrete_ids(ids)
    if host is not None:
        check_ids(host, "block_ids", cache.shape[0])
    local_shapes = tuple(shape[1:] for shape in plan.buffer_shapes(ids.shape[0]))
    into: tuple[Any, ...] = ()
    if out is not None:
        into = tuple(out)
        if len(into) != plan.num_buffers:
            raise ValueError(f"out has {len(into)} buffers; the plan has {plan.num_buffers}")
        for i, (buffer, shape) in enumerate(zip(into, local_shapes)):
            _check_blocks_first(buffer, f"out[{i}]")
            expected = _global_buffer_shape(cache, (ids.shape[0], *shape))
            if tuple(buffer.shape) != expected or buffer.dtype != cache.dtype:
                raise ValueError(
                    f"out[{i}] has shape {tuple(buffer.shape)} and dtype {buffer.dtype}; "
                    f"expected {expected} and {cache.dtype}"
                )
    count = len(into)
    result = run_per_shard(
        _split_local, (cache, ids, *into), ("blocks", "replicated") + ("blocks",) * count,
        dict(box_starts=plan.box_starts(), shapes=local_shapes, validate_ids=validate_ids),
        donate_argnums=tuple(range(2, 2 + count)), num_outputs=plan.num_buffers,
        op="split_for_peers",
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
      cache: this rank's cross-layer cache ``[num_blocks, L_local, K, H_rank, T, D]``.
        Consumed (donated) outside jit.
      buffers: ``plan.num_buffers`` dense buffers of ``plan.buffer_shapes(n)``.
      block_ids: int32 ids of the blocks to fill, shape ``[n]``; negative ids are skipped;
        unique.
      self_cfg, peer_cfg: this (receiving) engine and the sending engine.
      rank: this rank; see `split_for_peers`.
      validate_ids: see `jaxkv.ops.copy_blocks`.

    Returns:
      The updated cache.

    Raises:
      ValueError: incompatible engines, a cache or buffers of the wrong shape or dtype, the
        wrong number of buffers, repeated ids.
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
    plan = _plan_for_cache(cache, self_cfg, peer_cfg, rank)
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
        expected = _global_buffer_shape(cache, shape)
        if tuple(buffer.shape) != expected or buffer.dtype != cache.dtype:
            raise ValueError(
                f"buffers[{i}] has shape {tuple(buffer.shape)} and dtype {buffer.dtype}; "
                f"expected {expected} and {cache.dtype}"
            )
    host = concrete_ids(ids)
    if host is not None:
        check_ids(host, "block_ids", cache.shape[0], unique=True)
    if ids.shape[0] == 0:
        return cache
    return run_per_shard(
        _concat_local, (cache, ids, *buffers),
        ("blocks", "replicated") + ("blocks",) * len(buffers),
        dict(box_starts=plan.box_starts(), validate_ids=validate_ids), donate_argnums=(0,),
        op="concat_from_peers",
    )
