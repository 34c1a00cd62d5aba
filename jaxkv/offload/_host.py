"""The host tier: a pool of block slots in host memory, and batched copies between a device
cache and the pool through the block ops.

On CPU the pool is a set of plain host arrays with the cache's sharding, and both directions are
one `copy_block_prefix` per array (device block -> host slot and back, in place, `num_tokens`
for partial onboarding). Where the platform has pinned host memory (GPU, TPU:
``memory_kind="pinned_host"``), the pool lives there and the copies stage through a device
buffer: `gather_blocks` on the device, a device-to-host copy, a row-sized dynamic update of
each slot (and the reverse: dynamic slices of the slots, a host-to-device copy, a block op).

The block ops run with the implementation in force (`jaxkv.ops.implementation`): custom calls
on CPU and CUDA, the Pallas kernels on TPU, the jnp reference anywhere; the host memory itself
is only touched by XLA (copies between memory kinds, row-sized dynamic slices and updates),
never by a custom call. Tested on CPU (which has a "pinned_host" memory) byte for byte with
every implementation; on GPU by tests/ops/cuda_test.py where one is present; on a TPU this path is
unvalidated (no TPU was available).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxkv import ops
from jaxkv._cache import PagedKVCache
from jaxkv._context import jit as own_jit
from jaxkv._context import no_context_mesh
from jaxkv._sharding import HeadSharding
from jaxkv._spec import KVCacheSpec
from jaxkv.ops._ids import as_id_array, check_ids, concrete_ids
from jaxkv.ops._reshape_ops import _token_count

__all__ = ["HostPool", "onboard_blocks", "offload_blocks"]


@jax.tree_util.register_pytree_node_class
class HostPool:
    """Host-memory slots for KV blocks: one ``[num_slots, *block_shape]`` array per cache array,
    sharded like the cache (a rank's slots hold its heads).

    A pytree (its arrays are the leaves), so it passes through ``jax.jit``; donate it to keep
    updates in place.

    Attributes:
      spec: the cache spec.
      arrays: one array per `spec.array_keys()` entry.
      sharding: the cache's `HeadSharding`.
      memory_kind: None for the default memory (CPU: host memory), or "pinned_host".

    Example:
      >>> spec = KVCacheSpec(num_layers=1, num_kv_heads=2, head_dim=4, block_size=4,
      ...                    dtype="float32", layout="KHTD")
      >>> cache = PagedKVCache.allocate(spec, num_blocks=8)
      >>> pool = HostPool.allocate(cache, num_slots=4)
      >>> pool.num_slots, pool.arrays[0].shape
      (4, (4, 2, 2, 4, 4))
    """

    def __init__(self, spec: KVCacheSpec, arrays: Any, sharding: HeadSharding,
                 memory_kind: str | None) -> None:
        self.spec = spec
        self.arrays = tuple(arrays)
        self.sharding = sharding
        self.memory_kind = memory_kind

    def tree_flatten(self):
        return self.arrays, (self.spec, self.sharding, self.memory_kind)

    @classmethod
    def tree_unflatten(cls, aux, arrays):
        return cls(aux[0], arrays, aux[1], aux[2])

    def __repr__(self) -> str:
        return (f"HostPool(num_slots={self.num_slots}, arrays={len(self.arrays)}, "
                f"memory_kind={self.memory_kind!r})")

    @classmethod
    def allocate(cls, cache: PagedKVCache, num_slots: int, *,
                 memory_kind: str | None = "auto") -> HostPool:
        """Allocates a zero-filled pool for blocks of `cache`.

        Args:
          cache: the device cache whose blocks the pool will hold (spec and sharding).
          num_slots: slots in the pool (each holds one block of every array).
          memory_kind: "auto" (pinned host memory on GPU and TPU, the default memory on
            CPU), None (the devices' default memory) or "pinned_host".

        Returns:
          The pool.

        Raises:
          ValueError: `num_slots` < 1 or an unknown memory kind.
        """
        if isinstance(num_slots, bool) or not isinstance(num_slots, (int, np.integer)) or (
            num_slots < 1
        ):
            raise ValueError(f"num_slots must be a positive integer, got {num_slots!r}")
        if memory_kind == "auto":
            platforms = {d.platform for d in cache.sharding.mesh.devices.flat}
            memory_kind = None if platforms == {"cpu"} else "pinned_host"
        if memory_kind not in (None, "pinned_host"):
            raise ValueError(f"memory_kind must be 'auto', None or 'pinned_host', got "
                             f"{memory_kind!r}")
        spec = cache.spec
        shape = spec.array_shape(int(num_slots))
        named = _pool_sharding(spec, cache.sharding, memory_kind)
        count = spec.num_arrays
        arrays = own_jit(
            lambda: tuple(jnp.zeros(shape, spec.dtype) for _ in range(count)),
            out_shardings=(named,) * count,
        )()
        return cls(spec, arrays, cache.sharding, memory_kind)

    @property
    def num_slots(self) -> int:
        """Slots in the pool."""
        return int(self.arrays[0].shape[0])

    @property
    def slot_nbytes(self) -> int:
        """Global bytes of one slot over all arrays (every head once)."""
        return self.spec.block_nbytes() * len(self.arrays)

    @property
    def nbytes(self) -> int:
        """Global bytes of the pool."""
        return self.slot_nbytes * self.num_slots

    def block_until_ready(self) -> HostPool:
        """Waits for every pending update of the pool."""
        jax.block_until_ready(self.arrays)
        return self


def _pool_sharding(spec: KVCacheSpec, sharding: HeadSharding,
                   memory_kind: str | None) -> NamedSharding:
    named = sharding.named_sharding(spec)
    return named if memory_kind is None else named.with_memory_kind(memory_kind)


def _check_pair(cache: PagedKVCache, pool: HostPool) -> None:
    if not isinstance(cache, PagedKVCache):
        raise TypeError(f"cache must be a PagedKVCache, got {type(cache).__name__}")
    if not isinstance(pool, HostPool):
        raise TypeError(f"pool must be a HostPool, got {type(pool).__name__}")
    if cache.spec != pool.spec:
        raise ValueError(f"the pool holds blocks of {pool.spec}, the cache is {cache.spec}")
    if cache.sharding != pool.sharding:
        raise ValueError("the pool and the cache are sharded differently; allocate the pool "
                         "with HostPool.allocate(cache, ...)")


def _check_ids(device_ids: Any, host_slots: Any, cache: PagedKVCache, pool: HostPool,
               writes: str) -> tuple[Any, Any]:
    device = as_id_array(device_ids, "device_ids")
    slots = as_id_array(host_slots, "host_slots")
    if device.shape != slots.shape:
        raise ValueError(f"device_ids and host_slots must have the same length, got "
                         f"{device.shape[0]} and {slots.shape[0]}")
    device_host, slots_host = concrete_ids(device), concrete_ids(slots)
    if device_host is not None:
        check_ids(device_host, "device_ids", cache.num_blocks, unique=writes == "device")
    if slots_host is not None:
        check_ids(slots_host, "host_slots", pool.num_slots, unique=writes == "host")
    return device, slots


# ---------------------------------------------------------------------------------------------
# Programs. Each returns the updated arrays and a completion token: a small output of the same
# executable, never donated, that says when the copy is done (see _ordering.JaxCompletion).


def _map_arrays(sharding: HeadSharding, spec: KVCacheSpec, body, num_blocks_operands: int,
                num_replicated: int):
    array_spec = (sharding.partition_spec(spec),) * spec.num_arrays
    in_specs = (array_spec,) * num_blocks_operands + (PartitionSpec(),) * num_replicated
    return jax.shard_map(body, mesh=sharding.mesh, in_specs=in_specs, out_specs=array_spec,
                         check_vma=False)


def _direct_copy(spec: KVCacheSpec, sharding: HeadSharding, validate_ids: bool):
    """src arrays, dst arrays, src ids, dst ids, num_tokens -> dst arrays (block op)."""
    layout = spec.layout
    # A packed cache (tpu-inference) stores its packed axis as [words, packing]: copied with
    # the pair as one axis of `spec.layout` (a free reshape), a token prefix of a packed token
    # axis is exactly the first tokens (token w * packing + p).
    pair = None if spec.packing is None else 1 + spec.block_axes().index(spec.packed_axis)

    def merged(x):
        if pair is None:
            return x
        return x.reshape(*x.shape[:pair], x.shape[pair] * x.shape[pair + 1],
                         *x.shape[pair + 2:])

    def body(src, dst, src_ids, dst_ids, num_tokens):
        return tuple(
            ops.copy_block_prefix(merged(s), merged(d), src_ids, dst_ids, num_tokens, layout,
                                  validate_ids=validate_ids).reshape(d.shape)
            for s, d in zip(src, dst)
        )

    return _map_arrays(sharding, spec, body, 2, 3)


def _offload_traced(cache: PagedKVCache, pool: HostPool, device_ids, host_slots,
                    validate_ids: bool) -> tuple[jax.Array, ...]:
    spec, sharding = cache.spec, cache.sharding
    if pool.memory_kind is None:
        copy = _direct_copy(spec, sharding, validate_ids)
        return copy(cache.arrays, pool.arrays, device_ids, host_slots, jnp.int32(0))
    # Pinned host pool: gather on the device, copy to host memory, update the slots there.
    staged = _stage_on_device(cache, device_ids, validate_ids)
    return _update_pool(pool, staged, device_ids, host_slots)


def _stage_on_device(cache: PagedKVCache, device_ids, validate_ids: bool):
    """The blocks to offload, gathered into dense device arrays (the implementation in force:
    custom calls, Pallas kernels or the jnp reference)."""
    spec, sharding = cache.spec, cache.sharding

    def gather(arrays, ids):
        return ops.gather_blocks(arrays, ids, validate_ids=validate_ids)

    return _map_arrays(sharding, spec, gather, 1, 1)(cache.arrays, device_ids)


# Host memory inside a program is touched only by copies between memory kinds and by dynamic
# slices / updates of whole rows: the patterns XLA's GPU host offloader turns into DMAs. Any
# other op on a host-memory operand (a scatter or gather with an index array, a bitcast) is
# turned into host compute, which XLA has crashed on for this very scatter
# (openxla/xla#34565). On CPU every memory is host memory and both are plain ops.


def _update_pool(pool: HostPool, staged, device_ids, host_slots) -> tuple[jax.Array, ...]:
    """Copies dense device rows to host memory and writes them into their pool slots: one
    row-sized dynamic update of the pool per pair (XLA only: no custom call touches host
    memory, and no scatter runs on it).

    A dynamic update cannot be skipped, so pairs to skip (a negative id or slot) are ordered
    first and write slot 0's own bytes back into slot 0 before any real write."""
    spec, sharding = pool.spec, pool.sharding
    host = _pool_sharding(spec, sharding, pool.memory_kind)
    device = sharding.named_sharding(spec)
    count = device_ids.shape[0]
    valid = (device_ids >= 0) & (host_slots >= 0) & (host_slots < pool.num_slots)
    order = jnp.argsort(valid.astype(jnp.int32), stable=True)  # skipped pairs first
    valid, slots = valid[order], jnp.where(valid, host_slots, 0)[order]
    # CPU's compiler runs a dynamic update of 8-bit floats in wider float arithmetic, which
    # canonicalises NaN payloads; there every memory is host memory, so the update runs on the
    # pool's bits. Elsewhere it stays a pure copy in the pool's own type: a bitcast of a
    # host-memory operand would be host compute.
    on_cpu = _on_cpu(sharding)
    updated = []
    for p, s in zip(pool.arrays, staged):
        # Moved as unsigned bits on the device: XLA's gather may canonicalise NaN payloads.
        rows = _bits(s)[order]
        kept = _bits(jax.device_put(jax.lax.dynamic_slice_in_dim(p, jnp.int32(0), 1), device))
        target = _bits(p) if on_cpu else p
        for i in range(count):
            row = jnp.where(valid[i], rows[i:i + 1], kept)
            row = row if on_cpu else _from_bits(row, p.dtype)
            target = jax.lax.dynamic_update_slice_in_dim(target, jax.device_put(row, host),
                                                         slots[i], axis=0)
        updated.append(_from_bits(target, p.dtype) if on_cpu else target)
    return tuple(updated)


def _on_cpu(sharding: HeadSharding) -> bool:
    """Whether the mesh is CPU devices only (where host memory is every op's memory)."""
    return {d.platform for d in sharding.mesh.devices.flat} == {"cpu"}


def _bits(x: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}"))


def _from_bits(x: jax.Array, dtype: Any) -> jax.Array:
    return jax.lax.bitcast_convert_type(x, dtype)


def _onboard_traced(pool: HostPool, cache: PagedKVCache, host_slots, device_ids, num_tokens,
                    validate_ids: bool) -> tuple[jax.Array, ...]:
    spec, sharding = cache.spec, cache.sharding
    copy = _direct_copy(spec, sharding, validate_ids)
    if pool.memory_kind is None:
        return copy(pool.arrays, cache.arrays, host_slots, device_ids, num_tokens)
    rows = _rows_from_pool(pool, host_slots)
    return _write_rows(cache, rows, host_slots, device_ids, num_tokens, validate_ids)


def _rows_from_pool(pool: HostPool, host_slots) -> tuple[jax.Array, ...]:
    """The listed slots of a pinned pool as dense device rows: one row-sized dynamic slice of
    the pool per slot, copied to the device (XLA only, no gather on host memory). Skipped
    slots (negative) read slot 0; their rows are not written anywhere."""
    spec, sharding = pool.spec, pool.sharding
    device = sharding.named_sharding(spec)
    slots = jnp.clip(host_slots, 0, pool.num_slots - 1)
    on_cpu = _on_cpu(sharding)  # as in _update_pool: NaN payloads kept by moving bits
    return tuple(
        _from_bits(jnp.concatenate([
            _bits(jax.device_put(jax.lax.dynamic_slice_in_dim(_bits(p) if on_cpu else p,
                                                              slots[i], 1), device))
            for i in range(host_slots.shape[0])]), p.dtype)
        for p in pool.arrays)


def _write_rows(cache: PagedKVCache, rows, host_slots, device_ids, num_tokens,
                validate_ids: bool) -> tuple[jax.Array, ...]:
    """Dense device rows into their cache blocks (token prefixes), in place."""
    copy = _direct_copy(cache.spec, cache.sharding, validate_ids)
    count = host_slots.shape[0]
    row_ids = jnp.where(host_slots >= 0, jnp.arange(count, dtype=jnp.int32), -1)
    return copy(rows, cache.arrays, row_ids, device_ids, num_tokens)


def offload_blocks(cache: PagedKVCache, pool: HostPool, device_ids: Any, host_slots: Any, *,
                   validate_ids: bool = True) -> HostPool:
    """Copies device blocks into host slots: ``pool[host_slots[i]] = cache[device_ids[i]]``.

    Works on concrete arrays and inside ``jax.jit`` (donate the pool there to keep it in
    place). Only the pool is written; the cache is read. Ordering against other copies follows
    the data flow (pass the latest cache and pool); `OffloadManager` adds the file tier.

    Args:
      cache: the device cache.
      pool: a pool allocated for this cache (`HostPool.allocate`).
      device_ids: int32 device block ids ``[n]``.
      host_slots: int32 host slots ``[n]``; pairs with a negative id on either side are skipped.
      validate_ids: see `jaxkv.ops.copy_blocks`.

    Returns:
      The updated pool.

    Raises:
      IndexError: an id or slot out of range (concrete ids).
      ValueError: a repeated slot, lists of different lengths, or a pool for another cache.

    Example:
      >>> spec = KVCacheSpec(1, 1, 2, 2, "float32", layout="THD")
      >>> cache = PagedKVCache.from_arrays(spec, [jnp.arange(16.0).reshape(4, 2, 1, 2)] * 2)
      >>> pool = offload_blocks(cache, HostPool.allocate(cache, 2), [3], [1])
      >>> pool.arrays[0][1].ravel().tolist()
      [12.0, 13.0, 14.0, 15.0]
    """
    _check_pair(cache, pool)
    device, slots = _check_ids(device_ids, host_slots, cache, pool, "host")
    traced = any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves((cache, pool)))
    if traced or isinstance(device, jax.core.Tracer) or isinstance(slots, jax.core.Tracer):
        arrays = _offload_traced(cache, pool, device, slots, validate_ids)
        return HostPool(pool.spec, arrays, pool.sharding, pool.memory_kind)
    arrays, _ = _program("offload", pool.memory_kind, validate_ids)(cache, pool, device, slots)
    return HostPool(pool.spec, arrays, pool.sharding, pool.memory_kind)


def onboard_blocks(pool: HostPool, cache: PagedKVCache, host_slots: Any, device_ids: Any,
                   num_tokens: Any = None, *, validate_ids: bool = True) -> PagedKVCache:
    """Copies host slots into device blocks: ``cache[device_ids[i]] = pool[host_slots[i]]``,
    or only the first `num_tokens` tokens of each block (docs/data-movement.md section 5).

    Works on concrete arrays and inside ``jax.jit`` (donate the cache there).

    Args:
      pool: the host pool.
      cache: the device cache; updated in place (consumed outside jit).
      host_slots: int32 host slots ``[n]``.
      device_ids: int32 destination device block ids ``[n]`` (unique); pairs with a negative
        id on either side are skipped.
      num_tokens: None for whole blocks, or a token count (Python int or int32 scalar array;
        an operand, so no recompilation): tokens ``[0, num_tokens)`` of every row of each
        block are copied, the rest of the destination stays as it was. Outside
        ``1 .. block_size - 1`` whole blocks are copied.
      validate_ids: see `jaxkv.ops.copy_blocks`.

    Returns:
      The updated cache.

    Raises:
      IndexError: an id or slot out of range (concrete ids).
      ValueError: a repeated device id, lists of different lengths, or a pool for another
        cache.
      TypeError: `num_tokens` is not an integer.

    Example:
      >>> spec = KVCacheSpec(1, 1, 1, 4, "float32", layout="THD")
      >>> cache = PagedKVCache.from_arrays(spec, [jnp.ones((2, 4, 1, 1))] * 2)
      >>> pool = offload_blocks(cache, HostPool.allocate(cache, 1), [0], [0])
      >>> cache = PagedKVCache.from_arrays(spec, [jnp.zeros((2, 4, 1, 1))] * 2)
      >>> onboard_blocks(pool, cache, [0], [1], num_tokens=3).arrays[0][1].ravel().tolist()
      [1.0, 1.0, 1.0, 0.0]
    """
    _check_pair(cache, pool)
    device, slots = _check_ids(device_ids, host_slots, cache, pool, "device")
    count = _token_count(0 if num_tokens is None else num_tokens)
    traced = any(isinstance(x, jax.core.Tracer)
                 for x in (*jax.tree.leaves((cache, pool)), device, slots, count))
    if traced:
        arrays = _onboard_traced(pool, cache, slots, device, count, validate_ids)
        return PagedKVCache(cache.spec, arrays, cache.sharding)
    arrays, _ = _program("onboard", pool.memory_kind, validate_ids)(pool, cache, slots, device,
                                                                    count)
    return PagedKVCache(cache.spec, arrays, cache.sharding)


def _program(direction: str, memory_kind: str | None, validate_ids: bool):
    """The donating program of one direction; returns (arrays, completion token)."""
    from jaxkv.ops._dispatch import current_implementation

    # Pallas's interpret mode (forced "pallas" off TPU) runs kernels through ordered host
    # callbacks, and jax 0.10 cannot lower a program with ordered effects whose outputs live
    # in pinned host memory: the device gather and the host update then run as two programs.
    interpreted = current_implementation() == "pallas" and jax.default_backend() != "tpu"
    return _programs(direction, memory_kind, validate_ids,
                     interpreted and memory_kind is not None)


@functools.lru_cache(maxsize=64)
def _programs(direction: str, memory_kind: str | None, validate_ids: bool, split: bool):
    if direction == "offload" and split:
        stage = own_jit(lambda cache, ids: _stage_on_device(cache, ids, validate_ids))

        def update(pool, staged, device_ids, host_slots):
            arrays = _update_pool(pool, staged, device_ids, host_slots)
            return arrays, _completion_token(arrays[0], pool.sharding, pool.spec,
                                             pool.memory_kind)

        update_jit = own_jit(update, donate_argnums=(0,))

        def offload_in_two(cache, pool, device_ids, host_slots):
            return update_jit(pool, stage(cache, device_ids), device_ids, host_slots)

        return offload_in_two
    if split:
        read = own_jit(lambda pool, slots: _rows_from_pool(pool, slots))

        def write(cache, rows, host_slots, device_ids, num_tokens):
            arrays = _write_rows(cache, rows, host_slots, device_ids, num_tokens, validate_ids)
            return arrays, _completion_token(arrays[0], cache.sharding, cache.spec, None)

        write_jit = own_jit(write, donate_argnums=(0,))

        def onboard_in_two(pool, cache, host_slots, device_ids, num_tokens):
            return write_jit(cache, read(pool, host_slots), host_slots, device_ids, num_tokens)

        return onboard_in_two
    if direction == "offload":

        def offload(cache, pool, device_ids, host_slots):
            arrays = _offload_traced(cache, pool, device_ids, host_slots, validate_ids)
            return arrays, _completion_token(arrays[0], pool.sharding, pool.spec,
                                             pool.memory_kind)

        return own_jit(offload, donate_argnums=(1,))

    def onboard(pool, cache, host_slots, device_ids, num_tokens):
        arrays = _onboard_traced(pool, cache, host_slots, device_ids, num_tokens, validate_ids)
        return arrays, _completion_token(arrays[0], cache.sharding, cache.spec, None)

    return own_jit(onboard, donate_argnums=(1,))


def _completion_token(array: jax.Array, sharding: HeadSharding, spec: KVCacheSpec,
                      memory_kind: str | None) -> jax.Array:
    """One element of `array` from every device (a data dependency on each device's part of
    the program), as a small array that is ready when the whole copy is done."""
    mesh = sharding.mesh
    array_spec = sharding.partition_spec(spec)
    with no_context_mesh():
        if memory_kind is not None:  # Pinned pool: a row copied to the device, as above.
            array = jax.device_put(jax.lax.dynamic_slice_in_dim(array, jnp.int32(0), 1),
                                   NamedSharding(mesh, array_spec))
        return jax.shard_map(
            lambda a: _bits(a.reshape(-1)[:1]), mesh=mesh, in_specs=(array_spec,),
            out_specs=PartitionSpec(tuple(mesh.axis_names)), check_vma=False,
        )(array)


def run_offload(cache: PagedKVCache, pool: HostPool, device_ids: np.ndarray,
                host_slots: np.ndarray) -> tuple[HostPool, jax.Array]:
    """`offload_blocks` on checked, padded numpy ids; also returns the completion token."""
    arrays, token = _program("offload", pool.memory_kind, True)(cache, pool, device_ids,
                                                                host_slots)
    return HostPool(pool.spec, arrays, pool.sharding, pool.memory_kind), token


def run_onboard(pool: HostPool, cache: PagedKVCache, host_slots: np.ndarray,
                device_ids: np.ndarray, num_tokens: int) -> tuple[PagedKVCache, jax.Array]:
    """`onboard_blocks` on checked, padded numpy ids; also returns the completion token."""
    arrays, token = _program("onboard", pool.memory_kind, True)(
        pool, cache, host_slots, device_ids, np.int32(num_tokens))
    return PagedKVCache(cache.spec, arrays, cache.sharding), token
