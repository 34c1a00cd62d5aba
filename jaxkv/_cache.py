"""`PagedKVCache`: a model's paged KV cache as a pytree of blocks-first JAX arrays."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxkv._context import jit as own_jit
from jaxkv._placement import place_exactly
from jaxkv._sharding import HeadSharding, head_sharding
from jaxkv._spec import ArrayKey, KVCacheSpec
from jaxkv.ops._block_ops import _copy_local, _gather_into_local, _gather_local, _scatter_local
from jaxkv.ops._ids import as_id_array, check_ids, concrete_ids

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
            of ``dp`` owns blocks ``[s * num_blocks / dp, (s + 1) * num_blocks / dp)``, and an
            op's ids come in ``dp`` equal segments, segment ``s`` naming shard ``s``'s blocks
            (or padding), so every op runs on the owning shards without collectives.

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

    def _execute(self, kind: str, operands: tuple[Any, ...], validate_ids: bool) -> Any:
        program = _cache_program(kind, self.spec, self.sharding, validate_ids)
        if any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(operands)):
            return program(*operands)
        # Outside jit, shard_map wants its operands placed as its in_specs say.
        named = self.sharding.named_sharding(self.spec)
        replicated = NamedSharding(self.sharding.mesh, PartitionSpec())
        placed = [operands[0]]
        for operand in operands[1:]:
            if isinstance(operand, tuple):
                placed.append(tuple(place_exactly(x, named) for x in operand))
            else:
                placed.append(place_exactly(operand, replicated))
        return _jitted(program, _DONATED_OPERAND[kind])(*placed)

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
        src = as_id_array(src_ids, "src_ids")
        dst = as_id_array(dst_ids, "dst_ids")
        if src.shape != dst.shape:
            raise ValueError(
                f"src_ids and dst_ids must have the same length, got {src.shape[0]} and "
                f"{dst.shape[0]}"
            )
        src_host, dst_host = concrete_ids(src), concrete_ids(dst)
        if src_host is not None:
            check_ids(src_host, "src_ids", self.num_blocks)
            self._check_owners(src_host, "src_ids")
        if dst_host is not None:
            disjoint = (src_host, "src_ids") if src_host is not None else None
            check_ids(dst_host, "dst_ids", self.num_blocks, unique=True, disjoint_from=disjoint)
            self._check_owners(dst_host, "dst_ids")
        self._check_segments(src.shape[0])
        return self._with_arrays(self._execute("copy", (self.arrays, src, dst), validate_ids))

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
        ids = as_id_array(ids, "ids")
        host = concrete_ids(ids)
        if host is not None:
            check_ids(host, "ids", self.num_blocks)
            self._check_owners(host, "ids")
        self._check_segments(ids.shape[0])
        if out is None:
            return tuple(self._execute("gather", (self.arrays, ids), validate_ids))
        out = tuple(out)
        self._check_dense(out, ids.shape[0], "out")
        return tuple(self._execute("gather_into", (self.arrays, ids, out), validate_ids))

    def _check_segments(self, count: int) -> None:
        dp = self.sharding.data_size
        if count % dp:
            raise ValueError(
                f"{count} ids for {dp} data-parallel shards: ids come in {dp} equal segments, "
                "one per shard (pad with -1)"
            )

    def _check_owners(self, ids: np.ndarray, name: str) -> None:
        """With a data-parallel block axis, segment ``s`` of the ids must name blocks of
        shard ``s`` (or be padding): moving a block between shards would need a collective."""
        dp = self.sharding.data_size
        if dp == 1 or ids.size % dp:
            return
        per_shard = self.num_blocks // dp
        owners = np.repeat(np.arange(dp), ids.size // dp)
        wrong = np.flatnonzero((ids >= 0) & (ids // per_shard != owners))
        if wrong.size:
            i = int(wrong[0])
            raise ValueError(
                f"{name}[{i}] = {int(ids[i])} is in data shard {int(ids[i]) // per_shard}, but "
                f"position {i} is in shard {int(owners[i])}'s segment (ids come in {dp} "
                f"segments of {ids.size // dp}; shard s owns blocks [s*{per_shard}, "
                f"(s+1)*{per_shard}))"
            )

    def _check_dense(self, dense: tuple[jax.Array, ...], rows: int, name: str) -> None:
        if len(dense) != len(self.arrays):
            raise ValueError(f"{len(dense)} {name} arrays for a cache of {len(self.arrays)} arrays")
        for index, (block, array) in enumerate(zip(dense, self.arrays)):
            if block.dtype != array.dtype or tuple(block.shape) != (rows, *array.shape[1:]):
                raise ValueError(
                    f"{name}[{index}] has shape {tuple(block.shape)} and dtype {block.dtype}; "
                    f"expected {(rows, *array.shape[1:])} and {array.dtype}"
                )

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
        blocks = tuple(blocks)
        ids = as_id_array(ids, "ids")
        self._check_dense(blocks, ids.shape[0], "block")
        host = concrete_ids(ids)
        if host is not None:
            check_ids(host, "ids", self.num_blocks, unique=True)
            self._check_owners(host, "ids")
        self._check_segments(ids.shape[0])
        return self._with_arrays(
            self._execute("scatter", (self.arrays, blocks, ids), validate_ids)
        )

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


_LOCAL_OPS: dict[str, Callable[..., Any]] = {
    "copy": _copy_local,
    "gather": _gather_local,
    "gather_into": _gather_into_local,
    "scatter": _scatter_local,
}

# Which operands of each cache program are updated in place (donated outside jit).
_DONATED_OPERAND: dict[str, tuple[int, ...]] = {
    "copy": (0,),
    "gather": (),
    "gather_into": (2,),
    "scatter": (0,),
}


@functools.lru_cache(maxsize=256)
def _cache_program(
    kind: str, spec: KVCacheSpec, sharding: HeadSharding, validate_ids: bool
) -> Callable[..., Any]:
    """A shard_map program applying one op to every array of a cache on every shard."""
    local = functools.partial(_LOCAL_OPS[kind], validate_ids=validate_ids)
    arrays_spec = (sharding.partition_spec(spec),) * spec.num_arrays
    data_axis = sharding.data_axis
    dp = sharding.data_size
    ids_spec = PartitionSpec()

    def localize(ids, arrays):
        """This shard's segment of the (replicated) global ids, as ids in its local block
        range; ids of other shards become padding. No collective: only this shard's axis
        index is read."""
        if data_axis is None:
            return ids
        per_shard = arrays[0].shape[0]
        shard = jax.lax.axis_index(data_axis)
        segment = ids.shape[0] // dp
        ids = jax.lax.dynamic_slice_in_dim(ids, shard * segment, segment)
        start = shard * per_shard
        return jnp.where((ids >= start) & (ids < start + per_shard), ids - start, -1)

    def copy_body(arrays, src, dst):
        src, dst = localize(src, arrays), localize(dst, arrays)
        return tuple(local(a, src, dst) for a in arrays)

    def gather_body(arrays, ids):
        ids = localize(ids, arrays)
        return tuple(local(a, ids) for a in arrays)

    def gather_into_body(arrays, ids, outs):
        ids = localize(ids, arrays)
        return tuple(local(a, ids, o) for a, o in zip(arrays, outs))

    def scatter_body(arrays, blocks, ids):
        ids = localize(ids, arrays)
        return tuple(local(a, b, ids) for a, b in zip(arrays, blocks))

    bodies: dict[str, tuple[Callable[..., Any], tuple[Any, ...]]] = {
        "copy": (copy_body, (arrays_spec, ids_spec, ids_spec)),
        "gather": (gather_body, (arrays_spec, ids_spec)),
        "gather_into": (gather_into_body, (arrays_spec, ids_spec, arrays_spec)),
        "scatter": (scatter_body, (arrays_spec, arrays_spec, ids_spec)),
    }
    body, in_specs = bodies[kind]
    return jax.shard_map(
        body, mesh=sharding.mesh, in_specs=in_specs, out_specs=arrays_spec, check_vma=False
    )


@functools.lru_cache(maxsize=256)
def _jitted(program: Callable[..., Any], donate_argnums: tuple[int, ...]) -> Callable[..., Any]:
    return own_jit(program, donate_argnums=donate_argnums)
