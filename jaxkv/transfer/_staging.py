"""Host staging: a registered host mirror of a cache, for devices NIXL cannot register.

vLLM's host-buffer mode. The mirror has one host buffer per device buffer of the cache (same
length, same block geometry), so block ``b`` of the mirror holds block ``b`` of the device
cache and the read planner works unchanged on the mirror's addresses:

* the producer copies the published blocks device -> mirror: `jaxkv.ops` gather custom call
  into a reused dense buffer (``gather_blocks(out=...)``), then one host copy per shard into
  the mirror rows (only the published layers' bytes for a layer-wise publication); or, for a
  layer announced from inside a jitted step (`jaxkv.transfer.publish_layer_in_jit`), the
  layer's rows arrive on the host as the announcement callback's operands and
  `HostMirror.write_rows` puts each shard's part in place, before the layer is announced;
* the consumer's READs land in its mirror; the received rows go mirror -> device with the
  scatter custom call (``scatter_blocks``), in place in the registered cache, before the
  post-processing and before the request is reported finished. A cache whose blocks store
  padding (`KVCacheSpec.payload_mask`: packed phantom heads or tokens, padded head-dim lanes)
  keeps its own padding: the received blocks are merged with the cache's current blocks on
  the device (only the payload positions taken from the mirror) before the scatter.

The mirror is plain page-aligned numpy memory registered as NIXL "DRAM". The copy to host is
``np.asarray`` of the gathered shard (zero-copy on CPU devices, one device-to-host copy
elsewhere). With ``memory_kind="pinned_host"`` the gathered rows first move to the devices'
pinned host memory (and received rows come back through it), the path a TPU or GPU DMAs.

No custom call is needed: the gather and scatter are `PagedKVCache` methods, so they run
with the implementation in force (`jaxkv.ops.implementation`): the Pallas kernels on TPU, the
jnp reference anywhere. On CPU both implementations and both memory kinds are tested byte for
byte; the TPU path (Pallas kernels, pinned host memory on a TPU) is unvalidated: no TPU was
available.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["HostMirror"]

_ALIGN = 4096


def _aligned(nbytes: int) -> np.ndarray:
    raw = np.zeros(nbytes + _ALIGN, dtype=np.uint8)
    start = (-raw.ctypes.data) % _ALIGN
    return raw[start : start + nbytes]


class HostMirror:
    """Host buffers mirroring every device buffer of one `PagedKVCache`.

    Args:
      cache: the device cache (its `shard_buffers()` define the mirror's buffers).
      memory_kind: None (copy between device memory and the mirror directly) or
        "pinned_host" (stage the copies through the devices' pinned host memory).

    Raises:
      ValueError: an unknown memory kind, or one the cache's devices do not have.

    Example:
      >>> from jaxkv import KVCacheSpec, PagedKVCache
      >>> spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=4, block_size=2,
      ...                    dtype="float32", layout="LKHTD")
      >>> cache = PagedKVCache.allocate(spec, num_blocks=8)
      >>> mirror = HostMirror(cache)
      >>> mirror.stage_out(cache, [1, 2])
      >>> cache = mirror.stage_in(cache, [3])
      >>> len(mirror.buffers)
      1
    """

    def __init__(self, cache: Any, memory_kind: str | None = None):
        if memory_kind not in (None, "pinned_host"):
            raise ValueError(f"memory_kind must be None or 'pinned_host', got {memory_kind!r}")
        if memory_kind is not None:
            for array in cache.arrays:
                for device in array.sharding.device_set:
                    kinds = {m.kind for m in device.addressable_memories()}
                    if memory_kind not in kinds:
                        raise ValueError(f"device {device} has no {memory_kind!r} memory "
                                         f"(it has {sorted(kinds)})")
        self.memory_kind = memory_kind
        self.spec = cache.spec
        self.num_blocks = cache.num_blocks
        self.buffers: dict[tuple[int, int], np.ndarray] = {}
        for b in cache.shard_buffers():
            self.buffers[(b.array_index, b.device.id)] = _aligned(b.nbytes)
        # The payload positions of one shard's block, where the blocks store padding (else
        # None): `stage_in` writes only those (the mirror's padding bytes are not the cache's).
        payload = cache.spec.payload_mask(cache.tp_size)
        self._payload = None if payload.all() else payload
        self._dense: dict[int, tuple] = {}  # padded length -> reusable gather output
        # array index -> [(device id, the shard's index of a block: its slices of the block
        # axes)]: where `write_rows` puts the parts of rows that arrive whole (global).
        self._shards: dict[int, list[tuple[int, tuple[slice, ...]]]] = {}
        self._block_shapes = [tuple(a.shape[1:]) for a in cache.arrays]
        self._itemsizes = [a.dtype.itemsize for a in cache.arrays]
        for index, array in enumerate(cache.arrays):
            for device, where in array.sharding.devices_indices_map(array.shape).items():
                if (index, device.id) in self.buffers:
                    self._shards.setdefault(index, []).append((device.id, tuple(where[1:])))
        # Blocks split over devices (a data-parallel axis): rows are not written whole.
        self._whole_rows = all(
            where[0] == slice(None) or where[0].indices(self.num_blocks)[:2] == (0, self.num_blocks)
            for array in cache.arrays
            for where in array.sharding.devices_indices_map(array.shape).values())
        # (array, device, padded length) -> reusable host rows for `stage_in` (fresh pages
        # on every call cost more than the copies themselves)
        self._rows_in: dict[tuple[int, int, int], np.ndarray] = {}

    def address(self, array_index: int, device_id: int) -> int:
        """Base address of the mirror of one device buffer."""
        return int(self.buffers[(array_index, device_id)].ctypes.data)

    def nbytes(self) -> int:
        """Host bytes held by the mirror."""
        return sum(b.nbytes for b in self.buffers.values())

    def _rows(
        self, array_index: int, device_id: int, shape: tuple[int, ...], width: np.dtype
    ) -> np.ndarray:
        buffer = self.buffers[(array_index, device_id)].view(width)
        return buffer.reshape(self.num_blocks, *shape)

    def stage_out(
        self, cache: Any, block_ids: Sequence[int], layers: tuple[int, int] | None = None
    ) -> None:
        """Copies blocks device -> mirror (the producer side), waiting for the copy.

        Args:
          cache: the current version of the mirrored cache.
          block_ids: blocks to copy.
          layers: only these local layers ``[start, stop)`` of cross-layer arrays and only
            the per-layer arrays of these layers (None: everything).
        """
        from jaxkv.ops import pad_block_ids

        ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
        if not len(ids):
            return
        padded = pad_block_ids(ids)
        wait_for_torch = getattr(cache, "wait_for_torch", None)
        if wait_for_torch is not None:
            wait_for_torch()  # adopted torch memory: read it after torch's queued writes
        out = self._dense.pop(len(padded), None)
        dense = cache.gather_blocks(padded, out=out) if out is not None else None
        if dense is None:
            dense = cache.gather_blocks(padded)
        layout = self.spec.block_axes()  # stored axes: a packed axis is two of them
        source = tuple(dense)
        if self.memory_kind is not None:
            import jax

            source = tuple(jax.device_put(a, a.sharding.with_memory_kind(self.memory_kind))
                           for a in source)
        for index, ((layer, _), array) in enumerate(zip(cache.array_keys, source)):
            if layers is not None and layer is not None and not layers[0] <= layer < layers[1]:
                continue
            select: tuple = (ids,)
            if layers is not None and "L" in layout:
                select += tuple(slice(*layers) if a == "L" else slice(None) for a in layout)
            for shard in array.addressable_shards:
                rows = np.asarray(shard.data)
                width = np.dtype(f"u{rows.dtype.itemsize}")
                rows = rows.view(width)
                target = self._rows(index, shard.device.id, rows.shape[1:], width)
                target[select] = rows[(slice(0, len(ids)),) + select[1:]]
                del rows
        self._dense[len(padded)] = dense

    @property
    def writes_rows(self) -> bool:
        """Whether `write_rows` can take rows of this cache (its blocks are not split over
        devices)."""
        return self._whole_rows

    def write_rows(
        self,
        block_ids: Sequence[int] | np.ndarray,
        rows: Sequence[np.ndarray | None],
        layers: tuple[int, int],
    ) -> None:
        """Writes blocks' bytes that arrived on the host into the mirror (the producer side:
        a jitted step's layer announcement hands its callback the layer's blocks, see
        `jaxkv.transfer.publish_layer_in_jit`), instead of copying them from the device.

        Every shape is checked before anything is written: a refused call leaves the mirror
        as it was.

        Args:
          block_ids: one block id per row (negative: padding, skipped).
          rows: per cache array (in `PagedKVCache.arrays` order) its rows of these blocks, as
            the global array's ``[n, *block]`` in unsigned ints of the dtype's width; for an
            array spanning the layers, only the local layers `layers` on its L axis; None for
            an array that holds none of these layers.
          layers: the local layers ``[start, stop)`` the rows hold.

        Raises:
          ValueError: rows of the wrong count, shape or width, block ids out of range, or a
            cache whose blocks are split over devices (`writes_rows`).

        Example:
          >>> mirror.write_rows([3, 4], [rows_of_array_0], (0, 1))  # doctest: +SKIP
        """
        if not self._whole_rows:
            raise ValueError("write_rows: the cache's blocks are split over devices")
        ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
        keep = ids >= 0
        if (ids[keep] >= self.num_blocks).any():
            raise ValueError(f"write_rows: block ids {ids[keep].tolist()} outside "
                             f"[0, {self.num_blocks})")
        if len(rows) != len(self._block_shapes):
            raise ValueError(f"write_rows: {len(rows)} arrays of rows for a cache of "
                             f"{len(self._block_shapes)}")
        layout = self.spec.block_axes()
        axis = layout.index("L") if "L" in layout else None
        start, stop = layers
        for index, part in enumerate(rows):  # check everything first
            if part is None:
                continue
            want = list(self._block_shapes[index])
            if axis is not None:
                want[axis] = stop - start
            if (part.shape != (len(ids), *want) or part.dtype.kind != "u"
                    or part.dtype.itemsize != self._itemsizes[index]):
                raise ValueError(f"write_rows: array {index}: rows {part.dtype}{list(part.shape)}, "
                                 f"expected unsigned [{len(ids)}, {', '.join(map(str, want))}]")
        valid = ids[keep]
        for index, part in enumerate(rows):
            if part is None:
                continue
            part = part[keep]
            for device_id, where in self._shards[index]:
                if axis is not None:  # the rows hold only these layers: index from 0
                    where = where[:axis] + (slice(None),) + where[axis + 1:]
                local = part[(slice(None),) + where]
                shape = tuple(len(range(*s.indices(d)))  # the shard's block (every layer)
                              for s, d in zip(where, self._block_shapes[index]))
                target = self._rows(index, device_id, shape, local.dtype)
                select: tuple = (valid,)
                if axis is not None:
                    select += tuple(slice(start, stop) if a == axis else slice(None)
                                    for a in range(len(shape)))
                target[select] = local

    def stage_in(self, cache: Any, block_ids: Sequence[int]) -> Any:
        """Copies blocks mirror -> device (the consumer side), in place, waiting for the copy.

        Args:
          cache: the current version of the mirrored cache (consumed).
          block_ids: blocks to copy.

        Returns:
          The updated cache (same buffers).
        """
        import jax

        from jaxkv.ops import pad_block_ids

        ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
        if not len(ids):
            return cache
        padded = pad_block_ids(ids)
        dense = []
        current = cache.gather_blocks(padded) if self._payload is not None else None
        for index, array in enumerate(cache.arrays):
            pieces = []
            for shard in array.addressable_shards:
                local_shape = shard.data.shape[1:]
                width = np.dtype(f"u{array.dtype.itemsize}")
                key = (index, shard.device.id, len(padded))
                rows = self._rows_in.get(key)
                if rows is None:
                    count = len(padded) * int(np.prod(local_shape))
                    rows = _aligned(count * width.itemsize).view(width)
                    rows = rows.reshape(len(padded), *local_shape)
                    self._rows_in[key] = rows
                # Padding rows (ids -1) are skipped by the scatter: left as they are.
                source = self._rows(index, shard.device.id, local_shape, width)
                np.take(source, ids, axis=0, out=rows[: len(ids)])
                target = shard.device if self.memory_kind is None else (
                    jax.sharding.SingleDeviceSharding(shard.device, memory_kind=self.memory_kind))
                pieces.append(jax.device_put(rows.view(array.dtype), target))
            sharding = array.sharding if self.memory_kind is None else (
                array.sharding.with_memory_kind(self.memory_kind))
            staged = jax.make_array_from_single_device_arrays(
                (len(padded), *array.shape[1:]), sharding, pieces)
            if self.memory_kind is not None:  # pinned host -> device memory
                staged = jax.device_put(staged, array.sharding)
            if current is not None and self._payload is not None:
                staged = _keep_padding(staged, current[index], self._payload)
            dense.append(staged)
        # Wait: the next call refills the same host rows, which a pending copy may still read.
        return cache.scatter_blocks(dense, padded).block_until_ready()


def _keep_padding(received: Any, current: Any, payload: np.ndarray) -> Any:
    """`received` blocks where a shard's block holds values, `current` ones on its padding
    (both ``[n, *global block shape]``, sharded alike; `payload` is one shard's block)."""
    import jax
    import jax.numpy as jnp

    mask = np.zeros(received.shape[1:], bool)
    for shard in received.addressable_shards:  # each shard's block at its place
        mask[shard.index[1:]] = payload
    # Selected as unsigned ints of the same width: a float select may canonicalize NaNs.
    width = jnp.dtype(f"uint{8 * received.dtype.itemsize}")
    bits = jnp.where(mask, jax.lax.bitcast_convert_type(received, width),
                     jax.lax.bitcast_convert_type(current, width))
    return jax.lax.bitcast_convert_type(bits, received.dtype)
