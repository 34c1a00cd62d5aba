"""What one engine process registered: its caches, their ranks and regions, and the
`EngineMetadata` it publishes on its side channel (with its transport's entry)."""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Any

import msgspec
import numpy as np

from jaxkv._parallel import EngineConfig
from jaxkv.transfer._metadata import EngineMetadata, RankInfo, RegionInfo, engine_metadata
from jaxkv.transfer._side_channel import MetadataServer
from jaxkv.transfer._staging import HostMirror
from jaxkv.transfer._transport import Transport

__all__ = ["CacheRegistry", "Registered", "new_generation"]

_generation_counter = itertools.count()


def new_generation() -> int:
    """A fresh process generation (time-based, unique within the process)."""
    return (time.time_ns() // 1000 + next(_generation_counter)) & ((1 << 62) - 1)


@dataclasses.dataclass
class Registered:
    """One registered cache (of one pipeline rank, one or all TP ranks)."""

    cache: Any  # the current PagedKVCache (kept alive; post-processing updates it in place)
    buffers: tuple  # ShardBuffers as registered with the transport
    ranks: tuple[int, ...]
    mirror: HostMirror | None = None  # host staging: the transport registers the mirror
    layer_start: int = 0  # first global layer of the cache (its pipeline rank's)
    layer_stop: int = 0
    version: int = 0  # bumped by update_cache: which step's output `cache` is
    rank_devices: dict[int, int] = dataclasses.field(default_factory=dict)  # rank -> device id
    # the last `update_cache` found every buffer where it was (the step wrote in place)
    in_place: bool = False

    @property
    def consumed(self) -> bool:
        """Whether a step consumed (donated) the current cache and its output was not handed
        over yet (`update_cache`): its arrays are deleted, nothing may read or write them."""
        return any(a.is_deleted() for a in self.cache.arrays)


class CacheRegistry:
    """The registered caches of one engine process and the metadata describing them.

    Args:
      engine_id: the engine's name.
      config: the engine's config.
      transport: registers the regions and describes itself in the metadata.
      server: the side channel that serves the metadata.
      host_staging: see `KVTransferEngine`.
      block_hashing: published in the metadata.
      generation: the process's first generation (`new_generation`).
      digests: the integrity digest mode published in the metadata (``"off"``, ``"full"``,
        ``"sampled:K"``).
    """

    def __init__(
        self,
        engine_id: str,
        config: EngineConfig,
        transport: Transport,
        server: MetadataServer,
        host_staging: bool | None,
        block_hashing: str | None,
        generation: int,
        digests: str = "off",
    ):
        self.engine_id = engine_id
        self.digests = digests
        self.config = config
        self.transport = transport
        self.server = server
        self.host_staging = host_staging
        self.block_hashing = block_hashing
        self.generation = generation
        self.ranks: dict[int, RankInfo] = {}
        self.caches: list[Registered] = []
        self.rank_cache: dict[int, Registered] = {}
        self.meta: EngineMetadata | None = None

    @property
    def local_ranks(self) -> tuple[int, ...]:
        return tuple(sorted(self.ranks))

    @property
    def staged(self) -> bool:
        """Whether any registered cache is host-staged."""
        return any(entry.mirror is not None for entry in self.caches)

    @property
    def versions(self) -> tuple[int, ...]:
        """Each registered cache's version (`Registered.version`), in `caches` order."""
        return tuple(entry.version for entry in self.caches)

    def register(self, cache: Any, pp_rank: int, tp_rank: int | None) -> None:
        """See `KVTransferEngine.register_cache`."""
        config = self.config
        local_spec = config.local_spec(pp_rank)
        buffers = cache.shard_buffers()
        if tp_rank is None:
            if cache.tp_size != config.tp_size:
                raise ValueError(
                    f"cache is sharded over tp={cache.tp_size}, the engine has "
                    f"tp={config.tp_size}; pass tp_rank for a one-rank cache"
                )
            expected_spec = local_spec
            mesh = cache.sharding.source_mesh
            names = list(mesh.axis_names)
            tp_axes = cache.sharding.tp_axis
            tp_axes = (tp_axes,) if isinstance(tp_axes, str) else tuple(tp_axes)
            # TP over a tuple of mesh axes: ranks run over their product, first axis major.
            tp_pos = [names.index(a) for a in tp_axes]
            devices = np.moveaxis(mesh.devices, tp_pos, list(range(len(tp_pos)))).reshape(
                config.tp_size, -1)[:, 0]
            rank_of = {d.id: config.rank(i, pp_rank) for i, d in enumerate(devices)}
        else:
            expected_spec = (
                local_spec.replace(num_kv_heads=config.heads_per_rank)
                if not local_spec.mla
                else local_spec
            )
            rank_of = {b.device.id: config.rank(tp_rank, pp_rank) for b in buffers}
        if cache.spec != expected_spec:
            raise ValueError(f"cache spec {cache.spec} does not match the engine's {expected_spec}")
        staging = self.host_staging
        if staging is None:
            staging = any(b.device.platform not in ("cpu", "gpu", "cuda") for b in buffers)
        mirror = HostMirror(cache) if staging else None
        per_rank: dict[int, list] = {}
        for b in buffers:
            if b.device.id in rank_of:
                per_rank.setdefault(rank_of[b.device.id], []).append(b)
        new_ranks = {}
        replaced = [e for e in self.caches if set(e.ranks) & set(per_rank)]
        for entry in replaced:
            if not set(entry.ranks) <= set(per_rank):
                raise ValueError(
                    f"register_cache: ranks {sorted(per_rank)} overlap the registered cache of "
                    f"ranks {list(entry.ranks)} only partly; re-register that whole cache"
                )
        for rank, bufs in per_rank.items():
            tp, pp = config.coordinates(rank)
            l0, _ = config.layer_range(pp)
            h0, h1 = config.head_range(tp)
            bufs.sort(key=lambda b: b.array_index)
            regions = [
                RegionInfo(
                    array_index=b.array_index,
                    layer=-1 if b.layer is None else b.layer + l0,
                    kv=-1 if b.kv is None else b.kv,
                    head_start=h0,
                    head_stop=h1,
                    base_address=(
                        b.address if mirror is None else mirror.address(b.array_index, b.device.id)
                    ),
                    block_len=b.nbytes // cache.num_blocks,
                    num_blocks=cache.num_blocks,
                    device_id=b.device.id if b.memory_kind == "VRAM" and mirror is None else 0,
                    memory_kind=b.memory_kind if mirror is None else "DRAM",
                )
                for b in bufs
            ]
            new_ranks[rank] = RankInfo(
                rank=rank, agent_name=self.transport.endpoint, regions=regions
            )
        regions = [r for info in new_ranks.values() for r in info.regions]
        old_regions = [
            r for entry in replaced for rank in entry.ranks for r in self.ranks[rank].regions
        ]
        self.transport.register(regions)  # first: buffers kept in place keep their registration
        self.transport.deregister(old_regions)
        self.caches = [e for e in self.caches if e not in replaced]
        self.ranks.update(new_ranks)
        l0, l1 = config.layer_range(pp_rank)
        entry = Registered(cache, buffers, tuple(sorted(new_ranks)), mirror, l0, l1,
                           rank_devices={rank: bufs[0].device.id
                                         for rank, bufs in per_rank.items()})
        self.caches.append(entry)
        for rank in new_ranks:
            self.rank_cache[rank] = entry
        if self.meta is not None:
            # The regions changed: peers holding the old metadata must not read them. They
            # see the new generation in new requests' params (and re-handshake), and reads
            # planned against the old one are refused at confirmation (`Ack.stale`).
            self.generation = (self.generation + 1) & ((1 << 62) - 1)
        self.publish()

    def entry_of(self, cache: Any) -> Registered | None:
        """The registered entry of `cache` (by object, else by arrays and devices)."""
        current = cache.shard_buffers()
        keys = {(b.array_index, b.device.id) for b in current}
        for entry in self.caches:
            if entry.cache is cache:
                return entry
        for entry in self.caches:
            if {(b.array_index, b.device.id) for b in entry.buffers} == keys:
                return entry
        return None

    def _control_address(self) -> tuple[str, int] | None:
        """Where peers send this process's control messages; None (the address they fetched
        the metadata from) when the side channel listens on a wildcard address."""
        host, port = self.server.address
        return None if host in ("", "0.0.0.0", "::") else (host, port)

    def publish(self) -> None:
        """Publishes the current metadata on the side channel."""
        self.meta = engine_metadata(
            self.engine_id,
            self.config,
            list(self.ranks.values()),
            [msgspec.structs.replace(agent, control=self._control_address())
             for agent in self.transport.describe()],
            self.generation,
            self.block_hashing,
            self.transport.name,
            self.digests,
        )
        self.server.publish(self.meta)
