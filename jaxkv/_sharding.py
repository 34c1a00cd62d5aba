"""Head sharding of a KV cache over a tensor-parallel mesh axis (docs/data-movement.md section 2).

With ``tp <= num_kv_heads`` the head axis is split over the TP mesh axis. With more ranks than
heads, the TP axis is viewed as ``(num_kv_heads, tp // num_kv_heads)``: the head axis is split
over the first part and replicated over the second, so rank ``r`` holds head
``r // (tp // num_kv_heads)``. MLA caches are replicated on every rank.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxkv._spec import KVCacheSpec

__all__ = ["HeadSharding", "head_sharding"]


@dataclasses.dataclass(frozen=True)
class HeadSharding:
    """Where a cache's arrays live.

    Attributes:
      mesh: the mesh the cache arrays are sharded over (the caller's mesh, or a view of it whose
        TP axis is split into heads x replicas when TP exceeds the head count).
      head_axis: mesh axis (or tuple of axes) the head axis is split over, or None when heads
        are replicated.
      tp_axis: the caller's tensor-parallel axis name, or a tuple of names (e.g.
        ``("model", "expert")``) whose product is the TP size.
      tp_size: tensor-parallel size.
      source_mesh: the mesh the caller gave (equal to `mesh` unless TP exceeds the heads).
      data_axis: mesh axis the block axis is split over (data parallelism: shard ``s`` owns
        blocks ``[s * n / dp, (s + 1) * n / dp)``), or None.
    """

    mesh: Mesh
    head_axis: str | tuple[str, ...] | None
    tp_axis: str | tuple[str, ...]
    tp_size: int
    source_mesh: Mesh
    data_axis: str | None = None

    @property
    def data_size(self) -> int:
        """Data-parallel shards of the block axis (1 when it is not sharded)."""
        return int(self.mesh.shape[self.data_axis]) if self.data_axis else 1

    def partition_spec(self, spec: KVCacheSpec) -> PartitionSpec:
        """Partition spec of one cache array (block axis first, over `data_axis`)."""
        axes = [self.head_axis if letter == "H" else None for letter in spec.block_axes()]
        return PartitionSpec(self.data_axis, *axes)

    def named_sharding(self, spec: KVCacheSpec) -> NamedSharding:
        """NamedSharding of one cache array."""
        return NamedSharding(self.mesh, self.partition_spec(spec))


def head_sharding(
    spec: KVCacheSpec,
    mesh: Mesh | None = None,
    tp_axis: str | tuple[str, ...] = "tp",
    data_axis: str | None = None,
) -> HeadSharding:
    """Builds the head sharding of `spec` over `mesh`'s `tp_axis`.

    Args:
      spec: the cache spec.
      mesh: a mesh with a `tp_axis` axis; other axes replicate the cache. None: one device.
      tp_axis: name of the tensor-parallel axis, or a tuple of names sharded together (the
        head axis is split over their product, major axis first).
      data_axis: a mesh axis to split the block axis over (data parallelism), or None.

    Returns:
      A `HeadSharding`.

    Raises:
      ValueError: `tp_axis` is not in the mesh, or heads and TP size do not divide.

    Example:
      >>> mesh = jax.make_mesh((1,), ("tp",))  # one rank: nothing to split
      >>> head_sharding(KVCacheSpec(1, 2, 8, 4, "float32"), mesh).head_axis is None
      True
    """
    result = _head_sharding(spec, mesh, tp_axis)
    if data_axis is None:
        return result
    names = (result.tp_axis,) if isinstance(result.tp_axis, str) else result.tp_axis
    if data_axis not in result.mesh.axis_names or data_axis in names:
        raise ValueError(
            f"data_axis {data_axis!r} must be a mesh axis other than the TP axes "
            f"(mesh axes {result.source_mesh.axis_names})"
        )
    return dataclasses.replace(result, data_axis=data_axis)


def _head_sharding(spec: KVCacheSpec, mesh: Mesh | None, tp_axis) -> HeadSharding:
    if isinstance(tp_axis, (list, tuple)):
        tp_axis = tuple(tp_axis)
        if len(tp_axis) == 1:
            tp_axis = tp_axis[0]
    names = (tp_axis,) if isinstance(tp_axis, str) else tp_axis
    if mesh is None:
        mesh = Mesh(np.array(jax.devices()[:1]).reshape((1,) * len(names)), names)
    missing = [name for name in names if name not in mesh.axis_names]
    if missing or len(set(names)) != len(names):
        raise ValueError(f"mesh axes {mesh.axis_names} do not include the TP axis {tp_axis!r}")
    tp_size = int(np.prod([mesh.shape[name] for name in names]))
    if spec.mla or tp_size == 1 or "H" not in spec.layout:
        spec.heads_per_rank(tp_size)  # validates divisibility for non-MLA specs
        return HeadSharding(mesh, None, tp_axis, tp_size, mesh)
    spec.heads_per_rank(tp_size)
    if tp_size <= spec.num_kv_heads:
        return HeadSharding(mesh, tp_axis, tp_axis, tp_size, mesh)
    if not isinstance(tp_axis, str):
        raise ValueError(
            f"TP over the mesh axes {tp_axis} ({tp_size} ranks) exceeds the {spec.num_kv_heads} "
            "KV heads; replicating heads is supported over a single TP axis only"
        )
    replicas = tp_size // spec.num_kv_heads
    names = list(mesh.axis_names)
    position = names.index(tp_axis)
    devices = np.moveaxis(mesh.devices, position, -1)
    devices = devices.reshape(*devices.shape[:-1], spec.num_kv_heads, replicas)
    other = [n for n in names if n != tp_axis]
    view = Mesh(devices, (*other, tp_axis, f"{tp_axis}_replica"))
    return HeadSharding(view, tp_axis, tp_axis, tp_size, mesh)
