"""The NIXL transport: one-sided READs of registered memory (`NixlAgent`), and the control
channel over NIXL notifications.

The producer's registered memory is passively readable: `offer` / `withdraw` do nothing; the
consumer READs byte ranges planned by `ReadPlan.expanded_descriptors`. A READ may carry a
notification, delivered to the producer once the READ completed (the consumer's `Done`).

It also serves *formatted* reads (`jaxkv.transfer._formatted`, ``formats_reads``): two
registered host pools per process, one the producer gathers requested chunks into, one the
consumer READs them into before scattering them into its cache.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from jaxkv.transfer._agent import AgentOptions, NixlAgent
from jaxkv.transfer._formatted import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_POOL_BYTES,
    FormatServer,
    FormattedFetch,
    HostPool,
)
from jaxkv.transfer._metadata import (
    AgentInfo,
    EngineMetadata,
    MetadataError,
    RankInfo,
    RegionInfo,
)
from jaxkv.transfer._transport import ControlChannel, Fetch, Offer

__all__ = ["NixlNotificationChannel", "NixlTransport"]


def _key(region: RegionInfo) -> tuple[int, int, int, str]:
    return (
        region.base_address,
        region.block_len * region.num_blocks,
        region.device_id,
        region.memory_kind,
    )


class NixlTransport:
    """`Transport` over one NIXL agent (named `endpoint`).

    Args:
      endpoint: the agent's name (unique per process and generation).
      options: NIXL agent options.
      pool_bytes: the size of each formatted-read pool (send and receive; registered at
        start so that the published metadata covers them; pages are touched only when used).
        0: no formatted reads.
      chunk_bytes: the most bytes one formatted chunk moves.

    Raises:
      ImportError: NIXL is not installed.
    """

    name = "nixl"
    attaches_notifications = True
    announces_reads = False
    moves_arrays = False  # reads registered memory by address
    takes_layer_rows = False  # reads the registered cache (or its host mirror) directly
    layer_group_bytes = 0  # reads layer by layer, by address

    def __init__(self, endpoint: str, options: AgentOptions | None = None,
                 pool_bytes: int = DEFAULT_POOL_BYTES, chunk_bytes: int = DEFAULT_CHUNK_BYTES):
        if pool_bytes < 0 or chunk_bytes <= 0:
            raise ValueError(f"pool_bytes must be >= 0 and chunk_bytes > 0, got {pool_bytes} "
                             f"and {chunk_bytes}")
        self.endpoint = endpoint
        self.agent = NixlAgent(endpoint, options or AgentOptions())
        self._names: dict[str, str] = {}  # published agent name -> NIXL name
        self._extents_cache: dict[int, tuple[RankInfo, list[tuple[int, int]], list[int]]] = {}
        self.format_server: FormatServer | None = None
        self.receive_pool: HostPool | None = None
        self.chunk_bytes = int(min(chunk_bytes, max(pool_bytes // 2, 1)))
        if pool_bytes:
            self.format_server = FormatServer(HostPool(self.agent, pool_bytes))
            self.receive_pool = HostPool(self.agent, pool_bytes)
        # whether this process serves and makes formatted reads (it has the pools)
        self.formats_reads = self.format_server is not None

    # -- registration and metadata ---------------------------------------------------------

    def register(self, regions: Sequence[RegionInfo]) -> None:
        self.agent.register([_key(r) for r in regions])

    def deregister(self, regions: Sequence[RegionInfo]) -> None:
        self.agent.deregister([_key(r) for r in regions])

    def describe(self) -> list[AgentInfo]:
        return [AgentInfo(name=self.endpoint, metadata=self.agent.metadata())]

    def check_peer(self, meta: EngineMetadata) -> None:
        for agent in meta.agents:
            if not agent.metadata:
                raise MetadataError(f"agent {agent.name!r} publishes no NIXL metadata")

    def connect_peer(self, agents: Sequence[AgentInfo]) -> dict[str, str]:
        names = {a.name: self.agent.add_remote(a.metadata) for a in agents}
        for name in names.values():
            self.agent.connect(name)
        self._names.update(names)
        return names

    def disconnect_peer(self, names: Iterable[str]) -> None:
        gone = set(names)
        for name in gone:
            self.agent.remove_remote(name)
        self._names = {k: v for k, v in self._names.items() if v not in gone}

    # -- producer: passively readable memory -------------------------------------------------

    def offer(self, offer: Offer) -> None:
        del offer

    def withdraw(self, request_id: str, confirmed: bool = False) -> None:
        del request_id, confirmed

    # -- consumer ---------------------------------------------------------------------------

    def prepare_fetch(self, fetch: Fetch) -> tuple:
        """The READ's target: (fetch, NIXL name, kinds, descriptors). Plans from a cached
        planner post by index from prepared descriptor lists (`NixlAgent.read_plan`), so
        their descriptors are expanded only if that is not possible; others expand here."""
        info = fetch.peer.rank_info(fetch.remote_rank)
        name = self._names[info.agent_name]
        kind = fetch.local.rank_info(fetch.plan.local_rank).regions[0].memory_kind
        descriptors = None
        if fetch.plan.planner is None:
            descriptors = fetch.plan.expanded_descriptors(
                fetch.local, fetch.peer, fetch.remote_rank
            )
        return fetch, name, kind, info.regions[0].memory_kind, descriptors

    def start_fetch(self, prepared: tuple, notification: bytes = b"") -> Any:
        fetch, name, kind, remote_kind, descriptors = prepared
        if descriptors is None:
            return self.agent.read_plan(
                fetch.plan, fetch.local, fetch.peer, fetch.remote_rank, name, kind, remote_kind,
                notification,
            )
        loc, rem = descriptors
        return self.agent.read(loc, rem, name, kind, remote_kind, notif=notification)

    def attach(self, registry: Any) -> None:
        """Nothing to do: peers read the registered regions by address."""

    def control_channels(self) -> dict[str, ControlChannel]:
        """The agent's notifications carry control messages too (``control="nixl"``)."""
        return {"nixl": NixlNotificationChannel(self.agent)}

    def reads_step_memory(self, cache: Any) -> bool:
        """False: it takes no layer rows (peers READ the registered memory themselves)."""
        del cache
        return False

    def serve(self) -> None:
        """Nothing to do: registered memory is passively readable."""

    def start_formatted(self, fetch: Fetch, ask: Callable[[int, int, dict], bool],
                        released: Callable[[int], bytes],
                        regions_current: Callable[[], bool] = lambda: True,
                        first_chunk: int = 0) -> FormattedFetch:
        """A formatted read of one (local rank, producer rank) pair (see
        `jaxkv.transfer._formatted`); its handle is checked and released like a READ's.

        Raises:
          ValueError: no pools, or a chunk larger than the receive pool.
        """
        if self.receive_pool is None:
            raise ValueError("this engine was made without formatted-read pools")
        info = fetch.peer.rank_info(fetch.remote_rank)
        regions, _ = self._extents(fetch.local.rank_info(fetch.plan.local_rank))
        _, block_lens = self._extents(info)
        return FormattedFetch(
            self.agent, self.receive_pool, self._names[info.agent_name], fetch.plan.local_rank,
            fetch.remote_rank, fetch.plan.block_share(fetch.remote_rank)
            or fetch.plan.copies_for(fetch.remote_rank), regions,
            self.chunk_bytes, ask, released, regions_current,
            remote_ids=fetch.plan.remote_block_ids,
            remote_block_lens=block_lens, first_chunk=first_chunk)

    def _extents(self, info: RankInfo) -> tuple[list[tuple[int, int]], list[int]]:
        """A rank's regions as ``(base address, size)`` and their bytes per block, once per
        `RankInfo` object (a formatted read asks for them per rank pair; a new registration
        or handshake makes new objects)."""
        cached = self._extents_cache.get(id(info))
        if cached is None or cached[0] is not info:
            if len(self._extents_cache) > 256:
                self._extents_cache.clear()
            cached = self._extents_cache[id(info)] = (
                info, [(r.base_address, r.block_len * r.num_blocks) for r in info.regions],
                [r.block_len for r in info.regions])
        return cached[1], cached[2]

    def check(self, handle: Any) -> str:
        if isinstance(handle, FormattedFetch):
            return handle.check()
        return self.agent.state(handle)

    def error_of(self, handle: Any) -> str | None:
        """Why a formatted read failed; NIXL reports a failed READ by its state only."""
        if isinstance(handle, FormattedFetch):
            return handle.error
        return None

    def release(self, handle: Any) -> bool:
        if isinstance(handle, FormattedFetch):
            return handle.release()
        return self.agent.release(handle)

    def notifications(self) -> list[tuple[str, bytes]]:
        return [(s, m) for s, ms in self.agent.notifications().items() for m in ms]

    def progress(self) -> None:
        self.agent.progress()

    def close(self) -> None:
        if self.format_server is not None:
            self.format_server.close()
        if self.receive_pool is not None:
            self.receive_pool.close()
        self.agent.close()


class NixlNotificationChannel:
    """`ControlChannel` over the NIXL agent's notifications: a consumer's `Hello` carries its
    agent metadata, which the producer loads to answer."""

    name = "nixl"

    def __init__(self, agent: NixlAgent):
        self.agent = agent

    def hello_payload(self) -> bytes:
        return self.agent.metadata()

    def connect(self, address: tuple[str, int], agent: str, transport_name: str) -> str:
        del address, agent
        return transport_name

    def accept(self, agent: str, sender: str, payload: bytes) -> str:
        del agent, sender
        try:
            return self.agent.add_remote(payload)
        except Exception as error:  # noqa: BLE001 - bad metadata from a peer
            raise ValueError(f"unusable NIXL agent metadata: {error}") from error

    def send(self, target: str, payload: bytes) -> bool:
        return self.agent.send(target, payload)

    def receive(self) -> list[tuple[str, bytes]]:
        return [(s, m) for s, ms in self.agent.notifications().items() for m in ms]

    def forget(self, target: str) -> None:
        self.agent.remove_remote(target)

    def identity(self, sender: str) -> str | None:
        del sender  # NIXL names the notifying agent; only key holders got this agent's
        return None  # metadata to load (the side channel), nothing proved per message

    def close(self) -> None:
        pass

