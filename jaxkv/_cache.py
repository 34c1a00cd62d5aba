"""`PagedKVCache`: a model's paged KV cache as a pytree of blocks-first JAX arrays."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from jaxkv import ops
from jaxkv._context import jit as own_jit
from jaxkv._sharding import HeadSharding, head_sharding
from jaxkv._spec import ArrayKey, KVCacheSpec

__all__ = ["BufferMovedError", "PagedKVCache", "ShardBuffer"]


class BufferMovedError(RuntimeError):
    """A cache shard's device buffer is no longer where it was recorded (for example after an
    update that was not donated). Anything that registered the old address (NIXL) must
    re-register."""


@dataclasses.dataclass(frozen=True)
class ShardBuffer:
    """One device buffer of a cache: what a transfer engine registers.

    Attributes:
      array_index: position of the array in `PagedKVCache.arrays`.
      layer: the layer the array holds, or None when the array spans all layers.
      kv: 0 for K, 1 for V, or None when the array holds both.
      device: the JAX device holding the buffer.
      address: raw buffer address (valid while the array is alive and not donated elsewhere).
      nbytes: buffer length in bytes.
      head_start: first KV head (model numbering) in the buffer.
      head_stop: one past the last KV head in the buffer.
      block_start: first global block id in the buffer (0 unless the blocks are split over a
        data-parallel axis).
      block_stop: one past the last global block id in the buffer (-1: all blocks).
      tp_rank: the global tensor-parallel rank of the buffer's device: its position along the
        TP axes of the cache's mesh (first axis major), whichever process owns the device.

    In a multi-controller program (``jax.distributed``), `PagedKVCache.shard_buffers` lists
    only the calling process's buffers (its addressable shards), each with its global
    `tp_rank` and head range.
    """

    array_index: int
    layer: int | None
    kv: int | None
    device: jax.Device
    address: int
    nbytes: int
    head_start: int
    head_stop: int
    block_start: int = 0
    block_stop: int = -1
    tp_rank: int = 0

    @property
    def process_index(self) -> int:
        """The JAX process owning the buffer's device (``jax.process_index()`` there)."""
        return int(self.device.process_index)

    @property
    def memory_kind(self) -> str:
        """NIXL memory type of the buffer: "DRAM" for CPU devices, "VRAM" otherwise."""
        return "DRAM" if self.device.platform == "cpu" else "VRAM"


@jax.tree_util.register_pytree_node_class
class PagedKVCache:
    """A paged KV cache: blocks-first arrays laid out as `spec.layout` says, head-sharded.

    The arrays are the pytree leaves, so a cache passes through ``jax.jit`` (donate it to keep
    updates in place) and ``jax.tree_util`` functions. Build one with `allocate` or
    `from_arrays`.

    Attributes:
      spec: the `KVCacheSpec`.
      arrays: one array per `spec.array_keys()` entry, each ``[num_blocks, *block_shape]``
        (global shape: all KV heads; each device holds its heads).
      sharding: the `HeadSharding` (mesh and head axis).

    Example:
      >>> spec = KVCacheSpec(num_layers=2, num_kv_heads=4, head_dim=8, block_size=4,
      ...                    dtype="float32", layout="KHTD")
      >>> cache = PagedKVCache.allocate(spec, num_blocks=16)
      >>> len(cache.arrays), cache.arrays[0].shape
      (2, (16, 2, 4, 4, 8))
      >>> cache = cache.copy_blocks([0], [5])
    """

    def __init__(self, spec: KVCacheSpec, arrays: Sequence[jax.Array], sharding: HeadSharding):
        self.spec = spec
        self.arrays = tuple(arrays)
        self.sharding = sharding

    # -- pytree -----------------------------------------------------------------------------

    def tree_flatten(self):
        return self.arrays, (self.spec, self.sharding)

    @classmethod
    def tree_unflatten(cls, aux, arrays):
        spec, sharding = aux
        return cls(spec, arrays, sharding)

    def __repr__(self) -> str:
        return (
            f"PagedKVCache(layout={self.spec.layout!r}, num_blocks={self.num_blocks}, "
            f"arrays={len(self.arrays)}, block_shape={self.spec.block_shape()}, "
            f"dtype={self.spec.dtype.name}, tp_size={self.tp_size})"
        )

    # -- construction -----------------------------------------------------------------------

    @classmethod
    def allocate(
        cls,
        spec: KVCacheSpec,
        num_blocks: int,
        *,
        mesh: Mesh | None = None,
        tp_axis: str | tuple[str, ...] = "tp",
        data_axis: str | None = None,
    ) -> PagedKVCache:
        """Allocates a zero-filled cache directly in its sharded form (inside jit, so no
        device ever holds more than its shard).

        Args:
          spec: what the cache holds.
          num_blocks: blocks per array.
          mesh: mesh with a `tp_axis` axis; None for one device.
          tp_axis: the tensor-parallel mesh axis (or a tuple of axes); heads are split (or
            replicated) over it.
          data_axis: a mesh axis to split the blocks over (data parallelism): shard ``s``
            of ``dp`` owns blocks ``[s * num_blocks / dp, (s + 1) * num_blocks / dp)``, and
            every op runs on the owning shards without collectives (ids as `jaxkv.ops` takes
            them on such an array: global copy pairs within one shard; gather and scatter
            ids in ``dp`` equal segments, segment ``s`` naming shard ``s``'s blocks).

        Returns:
          The cache.

        Raises:
          ValueError: bad `num_blocks` (or not divisible by the data-parallel size), a mesh
            without `tp_axis`, or heads and TP size that do not divide.
        """
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive integer, got {num_blocks!r}")
        layout = head_sharding(spec, mesh, tp_axis, data_axis)
        if num_blocks % layout.data_size:
            raise ValueError(
                f"{num_blocks} blocks cannot be split evenly over {layout.data_size} "
                f"data-parallel shards"
            )
        shape = (num_blocks, *spec.global_block_shape(layout.tp_size))
        named = layout.named_sharding(spec)
        count = spec.num_arrays
        zeros = own_jit(
            lambda: tuple(jnp.zeros(shape, spec.dtype) for _ in range(count)),
            out_shardings=(named,) * count,
        )()
        return cls(spec, zeros, layout)

    @classmethod
    def from_arrays(
        cls,
        spec: KVCacheSpec,
        arrays: Sequence[jax.Array],
        *,
        mesh: Mesh | None = None,
        tp_axis: str | tuple[str, ...] = "tp",
        data_axis: str | None = None,
    ) -> PagedKVCache:
        """Builds a cache from existing arrays (global shapes), copied onto the cache's
        sharding so that the cache owns its buffers (see `wrap` to adopt arrays instead).

        Raises:
          ValueError: wrong number of arrays, shapes or dtypes.
        """
        arrays = tuple(a if isinstance(a, jax.Array) else np.asarray(a) for a in arrays)
        if len(arrays) != spec.num_arrays:
            raise ValueError(
                f"layout {spec.layout!r} needs {spec.num_arrays} arrays, got {len(arrays)}"
            )
        if not arrays:
            raise ValueError("a cache needs at least one array")
        num_blocks = int(arrays[0].shape[0]) if arrays[0].ndim else 0
        if num_blocks < 1:
            raise ValueError("arrays must be blocks-first with at least one block")
        tp_size = head_sharding(spec, mesh, tp_axis).tp_size
        expected = (num_blocks, *spec.global_block_shape(tp_size))
        for index, array in enumerate(arrays):
            if tuple(array.shape) != expected or array.dtype != spec.dtype:
                raise ValueError(
                    f"array {index} has shape {tuple(array.shape)} and dtype {array.dtype}; "
                    f"the spec needs {expected} and {spec.dtype.name}"
                )
        # Copy into freshly allocated buffers with the scatter custom call (a byte copy). On
        # CPU, device_put may leave the arrays sharing the caller's numpy memory, or one buffer
        # among all replicas, and a donated update could then not happen in place.
        cache = cls.allocate(spec, num_blocks, mesh=mesh, tp_axis=tp_axis, data_axis=data_axis)
        return cache.scatter_blocks(arrays, np.arange(num_blocks, dtype=np.int32))

    @classmethod
    def wrap(
        cls,
        arrays: Sequence[jax.Array],
        spec: KVCacheSpec,
        mesh: Mesh | None = None,
        *,
        tp_axis: str | tuple[str, ...] = "tp",
        data_axis: str | None = None,
    ) -> PagedKVCache:
        """Adopts existing device arrays as a cache, zero-copy: the cache's arrays are the
        given ones (same buffers), e.g. the per-layer caches a serving framework allocated.
        Donate the cache to later updates as usual; the caller must stop using the arrays.

        Args:
          arrays: one global array per `spec.array_keys()` entry, ``[num_blocks,
            *spec.global_block_shape(tp)]``, already sharded as the cache would shard them
            (block axis and other axes unsharded, the head axis over `tp_axis`).
          spec: what the arrays hold (e.g. `KVCacheSpec.for_tpu_inference`).
          mesh: the mesh the arrays are sharded over; None for arrays on one device.
          tp_axis: the tensor-parallel mesh axis, or a tuple of axes (``("model",
            "expert")``).
          data_axis: the mesh axis the block axis is split over, if any (see `allocate`).

        Returns:
          The cache, holding the same `jax.Array` objects.

        Raises:
          ValueError: wrong number of arrays, shapes, dtypes, deleted arrays, or arrays sharded
            differently from the cache's sharding (adopting them would need a copy).

        Example:
          >>> spec = KVCacheSpec.for_tpu_inference(1, 2, 64, 16, dtype="bfloat16")
          >>> layer = jnp.zeros((8, *spec.block_shape()), spec.dtype)
          >>> PagedKVCache.wrap([layer], spec).arrays[0] is layer
          True
        """
        arrays = tuple(arrays)
        if len(arrays) != spec.num_arrays or not arrays:
            raise ValueError(
                f"spec {spec.layout!r} needs {spec.num_arrays} arrays, got {len(arrays)}"
            )
        for index, array in enumerate(arrays):
            if not isinstance(array, jax.Array):
                raise ValueError(f"array {index} is a {type(array).__name__}, not a jax.Array")
            if array.is_deleted():
                raise ValueError(f"array {index} has been deleted (donated)")
        if mesh is None:
            devices = arrays[0].sharding.device_set
            if len(devices) != 1:
                raise ValueError("arrays spread over several devices need their mesh")
            names = (tp_axis,) if isinstance(tp_axis, str) else tuple(tp_axis)
            mesh = Mesh(np.array(list(devices)).reshape((1,) * len(names)), names)
        layout = head_sharding(spec, mesh, tp_axis, data_axis)
        num_blocks = int(arrays[0].shape[0]) if arrays[0].ndim else 0
        if num_blocks < 1:
            raise ValueError("arrays must be blocks-first with at least one block")
        expected = (num_blocks, *spec.global_block_shape(layout.tp_size))
        named = layout.named_sharding(spec)
        for index, array in enumerate(arrays):
            if tuple(array.shape) != expected or array.dtype != spec.dtype:
                raise ValueError(
                    f"array {index} has shape {tuple(array.shape)} and dtype {array.dtype}; "
                    f"the spec needs {expected} and {spec.dtype.name}"
                )
            if not array.sharding.is_equivalent_to(named, array.ndim):
                raise ValueError(
                    f"array {index} is sharded as {array.sharding}; the cache needs "
                    f"{named.spec} over mesh axes {dict(named.mesh.shape)} (adopting it would "
                    "copy: use from_arrays to copy on purpose)"
                )
        return cls(spec, arrays, layout)

    # -- shape ------------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        """Blocks per array."""
        return int(self.arrays[0].shape[0])

    @property
    def tp_size(self) -> int:
        """Tensor-parallel size the heads are sharded over."""
        return self.sharding.tp_size

    @property
    def array_keys(self) -> tuple[ArrayKey, ...]:
        """``(layer, kv)`` of each array (None: the array spans that axis)."""
        return self.spec.array_keys()

    @property
    def nbytes(self) -> int:
        """Global bytes of all arrays (every head counted once)."""
        return sum(int(a.size) * a.dtype.itemsize for a in self.arrays)

    def array(self, layer: int | None = None, kv: int | None = None) -> jax.Array:
        """The array holding `layer` / `kv` (None where the layout spans that axis).

        Raises:
          KeyError: no array holds that slice.
        """
        for key, array in zip(self.array_keys, self.arrays):
            if key == (layer, kv):
                return array
        raise KeyError(f"no array for layer={layer}, kv={kv}; arrays are {self.array_keys}")

    def partition_spec(self) -> PartitionSpec:
        """The partition spec every array of the cache uses."""
        return self.sharding.partition_spec(self.spec)

    def block_until_ready(self) -> PagedKVCache:
        """Waits for every pending update of the arrays."""
        jax.block_until_ready(self.arrays)
        return self

    # -- block operations -------------------------------------------------------------------

    def _with_arrays(self, arrays: Sequence[jax.Array]) -> PagedKVCache:
        return PagedKVCache(self.spec, arrays, self.sharding)

    def copy_blocks(
        self, src_ids: Any, dst_ids: Any, *, validate_ids: bool = True
    ) -> PagedKVCache:
        """`jaxkv.ops.copy_blocks` on every array, in place (the cache is consumed outside jit).

        Args:
          src_ids: int32 source block ids ``[n]``.
          dst_ids: int32 destination block ids ``[n]``; pairs with a negative id are skipped.
          validate_ids: see `jaxkv.ops.copy_blocks`.

        Returns:
          The updated cache.

        Raises:
          IndexError, ValueError: as `jaxkv.ops.copy_blocks`.
        """
        return self._with_arrays(
            ops.copy_blocks(self.arrays, src_ids, dst_ids, validate_ids=validate_ids))

    def gather_blocks(
        self,
        ids: Any,
        *,
        out: Sequence[jax.Array] | None = None,
        validate_ids: bool = True,
    ) -> tuple[jax.Array, ...]:
        """`jaxkv.ops.gather_blocks` on every array.

        Args:
          ids: int32 block ids ``[n]``; rows of negative ids come out zero.
          out: optional buffers to write into (one ``[n, *block_shape]`` array per cache
            array, e.g. the result of an earlier gather); consumed outside jit.
          validate_ids: see `jaxkv.ops.copy_blocks`.

        Returns:
          One dense ``[n, *block_shape]`` array per cache array, sharded like the cache.

        Raises:
          IndexError: an id is >= num_blocks.
          ValueError: `out` does not match.
        """
        return tuple(ops.gather_blocks(self.arrays, ids, out=None if out is None else tuple(out),
                                       validate_ids=validate_ids))

    def scatter_blocks(
        self, blocks: Sequence[jax.Array], ids: Any, *, validate_ids: bool = True
    ) -> PagedKVCache:
        """`jaxkv.ops.scatter_blocks` on every array, in place.

        Args:
          blocks: one ``[n, *block_shape]`` array per cache array (as `gather_blocks` returns).
          ids: int32 destination ids ``[n]``; negative ids are skipped.

        Raises:
          ValueError: wrong number, shape or dtype of blocks; repeated ids.
          IndexError: an id is >= num_blocks.
        """
        return self._with_arrays(
            ops.scatter_blocks(self.arrays, tuple(blocks), ids, validate_ids=validate_ids))

    # -- raw buffers ------------------------------------------------------------------------

    def shard_buffers(self) -> tuple[ShardBuffer, ...]:
        """Every device buffer of the cache this process holds, with its address, length,
        device and global TP rank.

        Waits for pending updates first. The addresses stay valid while this cache's arrays
        are alive; re-check them with `verify_unmoved` after each update. Over a global mesh
        (multi-controller JAX) only the addressable shards are listed: nothing here reads or
        waits for another process's data.
        """
        self.block_until_ready()
        tp_rank_of = self._tp_ranks()
        axes = self.spec.block_axes()
        head_axis = 1 + axes.index("H") if "H" in axes and not self.spec.mla else None
        per_rank = self.spec.heads_per_rank(self.tp_size)
        buffers = []
        for index, (key, array) in enumerate(zip(self.array_keys, self.arrays)):
            for shard in array.addressable_shards:
                heads = (0, self.spec.num_kv_heads)
                if head_axis is not None:
                    start, stop, _ = shard.index[head_axis].indices(array.shape[head_axis])
                    if stop - start != array.shape[head_axis]:  # a head shard
                        first = start // (stop - start) * per_rank
                        heads = (first, first + per_rank)
                blocks = shard.index[0].indices(array.shape[0])[:2]
                buffers.append(
                    ShardBuffer(
                        array_index=index,
                        layer=key[0],
                        kv=key[1],
                        device=shard.device,
                        address=int(shard.data.unsafe_buffer_pointer()),
                        nbytes=int(shard.data.nbytes),
                        head_start=heads[0],
                        head_stop=heads[1],
                        block_start=blocks[0],
                        block_stop=blocks[1],
                        tp_rank=tp_rank_of[shard.device.id],
                    )
                )
        return tuple(buffers)

    def _tp_ranks(self) -> dict[int, int]:
        """Device id -> global TP rank (position along the TP axes, first axis major)."""
        mesh = self.sharding.source_mesh
        names = list(mesh.axis_names)
        tp_axes = self.sharding.tp_axis
        tp_axes = (tp_axes,) if isinstance(tp_axes, str) else tuple(tp_axes)
        positions = [names.index(a) for a in tp_axes]
        grid = np.moveaxis(mesh.devices, positions, list(range(len(positions))))
        grid = grid.reshape(self.tp_size, -1)
        return {d.id: rank for rank, row in enumerate(grid) for d in row}

    def verify_unmoved(self, previous: Sequence[ShardBuffer]) -> None:
        """Checks that every buffer is still where `previous` (from `shard_buffers`) saw it.

        Raises:
          BufferMovedError: listing each buffer whose address or length changed.
        """
        current = {(b.array_index, b.device.id): b for b in self.shard_buffers()}
        moved = []
        for old in previous:
            new = current.get((old.array_index, old.device.id))
            if new is None or (new.address, new.nbytes) != (old.address, old.nbytes):
                where = "gone" if new is None else f"now {new.address:#x} ({new.nbytes} bytes)"
                moved.append(
                    f"array {old.array_index} on {old.device}: was {old.address:#x} "
                    f"({old.nbytes} bytes), {where}"
                )
        if moved:
            raise BufferMovedError(
                "cache buffers moved (was the cache donated to every update?): " + "; ".join(moved)
            )
