"""The consumer role: reads of producer requests, from planning to confirmation.

`start_read` fetches (or reuses) the producer's metadata, plans the read of every local
rank, and posts one transport fetch per (local rank, producer rank) (`ReadState.TRANSFERRING`)
or, for a layer-wise request, subscribes (`Want`) and posts each layer once its producer
rank announced it (``WAITING_READY``). Once every fetch completed (``LANDED``) every consumer
rank sends `Done` to every producer rank (or it rode on the fetch, with NIXL) and the received
blocks are post-processed in place; the read is reported finished when every producer rank
acknowledged (``CONFIRMED``), failed otherwise (``FAILED``: its local blocks listed invalid).

Integrity digests (``digests`` enabled, `jaxkv.transfer._digest`): once the bytes landed and
before post-processing rewrites them (or the host mirror is copied to the device), the
consumer digests every producer block image it received whole; when every producer rank
acknowledged, it compares them with the digests the `Ack`s carried. A mismatch (or a block it
cannot verify, or an Ack without digests) fails the read: the local blocks holding the bytes
of the mismatched producer blocks are listed invalid (all of the read's for other failures).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import numpy as np

from jaxkv.transfer._auth import DeploymentKey
from jaxkv.transfer._digest import (
    DigestError,
    DigestOptions,
    LandedDigest,
    algorithm_for,
    landed_pieces,
    sample_positions,
    sample_seed,
    verify_landed,
)
from jaxkv.transfer._formatted import (
    MIN_FORMATTED_BYTES,
    FormattedFetch,
    PathCosts,
)
from jaxkv.transfer._messages import (
    Ack,
    Done,
    Format,
    Formatted,
    Heartbeat,
    Hello,
    Ready,
    Released,
    Want,
    encode_message,
)
from jaxkv.transfer._metadata import (
    AgentInfo,
    EngineMetadata,
    IncompatibleEngineError,
    MetadataError,
    RankInfo,
    check_compatible,
)
from jaxkv.transfer._params import FailedRead, PollResult, TransferParams, address_tuple
from jaxkv.transfer._plan import PlanError, PostProcess, ReadPlan, plan_read
from jaxkv.transfer._post import apply_post_processing, group_post_steps
from jaxkv.transfer._protocol import TERMINAL, ReadState, transition
from jaxkv.transfer._registry import CacheRegistry, Registered
from jaxkv.transfer._side_channel import HandshakeError, fetch_metadata
from jaxkv.transfer._stats import TransferRecord, TransferStats
from jaxkv.transfer._transport import ControlChannel, Fetch, Transport

__all__ = ["Consumer", "Peer", "Reading", "merge_metadata"]

_log = logging.getLogger(__name__)
_attempt_counter = itertools.count(1)
MAX_OUTCOMES = 4096


@dataclasses.dataclass
class Peer:
    """A producer engine this process reads from."""

    meta: EngineMetadata
    addresses: tuple[tuple[str, int], ...]
    targets: dict[str, str]  # published agent name -> control channel target
    names: dict[str, str]  # published agent name -> the transport's name
    generations: dict[str, int] = dataclasses.field(default_factory=dict)  # agent -> generation
    stale: bool = False  # a producer process re-registered since: fetch again before reading


@dataclasses.dataclass
class Reading:
    """One consumer read in flight (see `ReadState`)."""

    request_id: str
    peer: str
    plans: list[ReadPlan]
    handles: list[Any]  # transport handles
    started: float
    deadline: float
    lease_s: float
    next_heartbeat: float
    done_at: float | None = None
    acks: dict[tuple[int, int], bool] = dataclasses.field(default_factory=dict)
    expected_acks: int = 0
    error: str | None = None
    local_block_ids: tuple[int, ...] = ()
    post_s: float = 0.0  # post-processing once the read landed (layers rewritten earlier,
    # as they landed, are not in it)
    # (id(registered cache entry), array index) rewritten already, as their layer landed
    post_done: set[tuple[int, int]] = dataclasses.field(default_factory=set)
    layerwise: bool = False
    # layer-wise: (global layer, remote rank, prepared fetch), posted once announced
    pending: list[tuple[int, int, Any]] = dataclasses.field(default_factory=list)
    ready: dict[int, int] = dataclasses.field(default_factory=dict)  # remote rank -> stop
    layer_handles: dict[int, list[Any]] = dataclasses.field(default_factory=dict)
    layers_total: tuple[int, ...] = ()  # global layers this process reads
    layer_arrival: dict[int, float] = dataclasses.field(default_factory=dict)  # wall time
    started_wall: float = 0.0
    needs_jax: bool = False  # post-processing or host staging (not inside a host callback)
    attempt: int = 0  # tags this read's Done / Ack messages
    # (local rank, remote rank) pairs whose Done travels as the notification of their fetch
    attached: set[tuple[int, int]] = dataclasses.field(default_factory=set)
    # remote rank -> generation of its process when the reads were planned (sent in Done)
    generations: dict[int, int] = dataclasses.field(default_factory=dict)
    stale: bool = False  # a producer answered that the planned regions are no longer current
    unpublished: bool = False  # a producer answered that it never published the request
    read_id: str = ""  # the consumer's key of this read (default: the producer's request id)
    state: ReadState = ReadState.PLANNING
    # -- integrity digests (jaxkv.transfer._digest) --
    # producer rank -> (algorithm, {position: digest}) from its Acks
    acked_digests: dict[int, tuple[str, dict[int, int]]] = dataclasses.field(
        default_factory=dict)
    landed: dict[tuple[int, int], LandedDigest] | None = None  # computed when landed
    digest_positions: np.ndarray | None = None  # positions verified (None: every one)
    digest_error: str | None = None  # why the landed bytes cannot be verified
    converted: bool = False  # the JAX formatter converted layout / block size (no sender image)
    num_remote_ids: int = 0
    invalid: tuple[int, ...] | None = None  # local blocks invalid on failure (None: all)
    # a formatted read (jaxkv.transfer._formatted): its fetches (one per local rank,
    # producer rank and, layer-wise, layer), each numbering its chunks from its own first
    formatted: list[FormattedFetch] = dataclasses.field(default_factory=list)
    formatted_path: bool = False  # the read goes formatted (layer-wise: as layers come)

    @property
    def key(self) -> str:
        return self.read_id

    @property
    def awaiting_announcement(self) -> bool:
        """Whether this read only waits for its producer to announce layers (`Ready`):
        nothing posted yet, or layer-wise with layers still to come and every layer it
        posted landed. Polling moves nothing then: the next step is the producer's."""
        if self.error is not None:
            return False
        if self.state is ReadState.WAITING_READY:
            return True
        # (copies: the engine's progress thread asks without its lock)
        return (self.layerwise and self.state is ReadState.TRANSFERRING and bool(self.pending)
                and all(layer in self.layer_arrival
                        for layer, handles in list(self.layer_handles.items()) if handles))


class Consumer:
    """The consumer side of one engine process (thread-safety: the engine's lock).

    Args:
      engine_id: this engine.
      registry: the registered caches and metadata.
      transport: moves the bytes.
      control: the control channel this process sends on.
      address: this process's side-channel address (sent in `Want`).
      stats: where reads are recorded.
      read_timeout_s, handshake_timeout_s, handshake_retries: bounds.
      key: the deployment key metadata fetches prove (None: plain fetches).
      digests: the engine's integrity digest options (default: off).
    """

    def __init__(
        self,
        engine_id: str,
        registry: CacheRegistry,
        transport: Transport,
        control: ControlChannel,
        address: tuple[str, int],
        stats: TransferStats,
        read_timeout_s: float,
        handshake_timeout_s: float,
        handshake_retries: int,
        key: DeploymentKey | None = None,
        digests: DigestOptions | None = None,
    ):
        self.engine_id = engine_id
        self.digests = digests or DigestOptions()
        self.key = key
        self.registry = registry
        self.transport = transport
        self.control = control
        self.address = address
        self.stats = stats
        self.read_timeout_s = read_timeout_s
        self.handshake_timeout_s = handshake_timeout_s
        self.handshake_retries = handshake_retries
        self.peers: dict[str, Peer] = {}
        self.reading: dict[str, Reading] = {}  # by read id (the consumer's request id)
        self.by_attempt: dict[int, Reading] = {}
        self.outcomes: dict[str, bool] = {}  # recent read outcomes (for in-jit waits)
        # The consumer's Done rides on its fetch as the notification (True, where the
        # transport can), or is sent on its own once the fetches completed (False); the
        # engine picks per control channel (benchmarks/RESULTS.md, small requests).
        self.attach_done = True
        # Formatted reads (`jaxkv.transfer._formatted`): "auto" (by cost), "always" or
        # "never"; the costs are calibrated per producer engine from this process's reads.
        self.formatted_reads = "auto"
        self.costs: dict[str, PathCosts] = {}
        self._block_bytes = (-1, 0)  # (registry generation, local bytes per block id)
        self._host_memory: dict[tuple[str, int], bool] = {}  # `_in_host_memory`

    @property
    def moving(self) -> bool:
        """Whether a read has something that polling moves (fetches in flight, landed bytes
        to check, confirmations to send); False when every read awaits announcements."""
        return any(not state.awaiting_announcement for state in list(self.reading.values()))

    def send(self, target: str, payload: bytes) -> bool:
        ok = self.control.send(target, payload)
        if not ok:
            self.stats.failed_notifications += 1
        return ok

    # -- handshake --------------------------------------------------------------------------

    def add_peer(self, engine_id: str, addresses: Sequence[tuple[str, int]]) -> EngineMetadata:
        """See `KVTransferEngine.add_peer`."""
        metas: list[EngineMetadata] = []
        try:
            for address in addresses:
                metas.append(
                    fetch_metadata(
                        address_tuple(address),
                        engine_id,
                        self.handshake_timeout_s,
                        self.handshake_retries,
                        key=self.key,
                        identity=self.engine_id,
                    )
                )
            merged = merge_metadata(metas)
            if self.registry.meta is None:
                raise RuntimeError("register_cache first")
            check_compatible(self.registry.meta, merged)
            self.transport.check_peer(merged)
        except (HandshakeError, IncompatibleEngineError, MetadataError):
            self.stats.failed_handshakes += 1
            raise
        old = self.peers.pop(engine_id, None)
        if old is not None:
            self.transport.disconnect_peer(old.names.values())
            for target in old.targets.values():
                self.control.forget(target)
        names = self.transport.connect_peer(merged.agents)
        targets = {}
        for address, meta in zip(addresses, metas):
            for agent in meta.agents:
                # A multi-controller engine serves every process's agent from one address;
                # each agent names the side channel of its own process.
                control = address_tuple(agent.control) if agent.control else address
                targets[agent.name] = self.control.connect(
                    address_tuple(control), agent.name, names[agent.name]
                )
        generations = {a.name: m.generation for m in metas for a in m.agents}
        self.peers[engine_id] = Peer(
            merged, tuple(address_tuple(a) for a in addresses), targets, names, generations
        )
        hello = encode_message(
            Hello(
                self.engine_id,
                self.registry.generation,
                self.transport.endpoint,
                self.control.hello_payload(),
            )
        )
        for target in targets.values():
            self.send(target, hello)
        return merged

    def peer(self, engine_id: str, addresses, generation: int = -1) -> Peer:
        peer = self.peers.get(engine_id)
        if (
            peer is None
            or peer.stale
            or (generation >= 0 and generation not in peer.generations.values())
        ):
            self.add_peer(engine_id, addresses)
            peer = self.peers[engine_id]
        return peer

    def suspect(self, engine_id: str) -> None:
        """The peer's metadata may be stale (a fetch failed, a producer answered `stale`):
        the next read fetches it again."""
        peer = self.peers.get(engine_id)
        if peer is not None:
            peer.stale = True

    # -- starting reads ---------------------------------------------------------------------

    def start(
        self,
        params: TransferParams,
        local_block_ids: Sequence[int],
        timeout_s: float | None,
        read_id: str | None = None,
    ) -> None:
        """See `KVTransferEngine.start_read`."""
        request_id = params.request_id
        key = request_id if read_id is None else read_id
        if not isinstance(key, str) or not 0 < len(key) <= 512:
            raise ValueError(f"read_id must be a str of 1 to 512 characters, got {read_id!r}")
        if key in self.reading:
            raise ValueError(f"read {key!r} is already in flight")
        now = time.monotonic()
        timeout = self.read_timeout_s if timeout_s is None else timeout_s
        state = Reading(
            request_id,
            params.engine_id,
            [],
            [],
            now,
            now + timeout,
            params.lease_s,
            now + params.lease_s / 3,
        )
        state.layerwise = bool(getattr(params, "layerwise", False))
        state.started_wall = time.time()
        state.attempt = next(_attempt_counter)
        state.read_id = key
        state.num_remote_ids = len(params.block_ids)
        if self.digests.mode == "sampled":
            # The producer draws the same positions (`sample_seed`): known to both sides
            # before the Ack arrives, so only they are digested when the bytes land.
            state.digest_positions = sample_positions(
                len(params.block_ids), self.digests, sample_seed(request_id, params.generation))
        self.reading[key] = state
        self.by_attempt[state.attempt] = state
        self.outcomes.pop(key, None)
        local_ids = np.asarray(local_block_ids, dtype=np.int64).reshape(-1)
        state.local_block_ids = tuple(int(b) for b in local_ids)
        registry = self.registry
        try:
            peer = self.peer(params.engine_id, params.addresses, params.generation)
            meta = registry.meta
            assert meta is not None  # add_peer checked it
            state.generations = {
                info.rank: peer.generations.get(info.agent_name, -1) for info in peer.meta.ranks
            }
            plan_local, plan_peer = meta, peer.meta
            if self.transport.moves_arrays:
                # formatted values move: planned between the values-only engines
                from jaxkv.transfer._formatter import FormatError, values_metadata

                try:
                    plan_local, plan_peer = values_metadata(meta), values_metadata(peer.meta)
                except FormatError as error:
                    raise PlanError(str(error)) from error
            for rank in registry.local_ranks:
                plan = plan_read(plan_local, rank, plan_peer, local_ids, params.block_ids,
                                 check=False)
                state.plans.append(plan)
            state.needs_jax = len(local_ids) > 0 and (
                any(p.post for p in state.plans)
                or any(registry.rank_cache[p.local_rank].mirror is not None for p in state.plans)
            )
            if self.transport.moves_arrays:
                self._start_arrays(state, peer, meta, len(local_ids))
                transition(state, ReadState.TRANSFERRING)
                return
            state.formatted_path = self._formats(state, peer, meta, len(local_ids))
            if state.formatted_path and not state.layerwise:
                for plan in state.plans:
                    for remote_rank in plan.read_ranks:
                        self._start_formatted(state, peer, meta, plan, remote_rank)
                transition(state, ReadState.TRANSFERRING)
                return
            if state.layerwise:
                self._plan_layers(state, peer, local_ids, params.block_ids)
            if state.layerwise or self.transport.announces_reads:
                want = encode_message(
                    Want(request_id, self.transport.endpoint, key, len(local_ids),
                         [self.address[0], self.address[1]])
                    if self.transport.announces_reads
                    else Want(request_id, self.transport.endpoint)
                )
                for target in peer.targets.values():
                    if not self.control.send(target, want):
                        raise ConnectionError(f"could not subscribe to producer {target!r}")
            if state.layerwise:
                transition(state, ReadState.WAITING_READY)
                return
            attach = self.attach_done and self.transport.attaches_notifications
            for plan in state.plans:
                for remote_rank in plan.read_ranks:
                    prepared = self.transport.prepare_fetch(
                        Fetch(request_id, key, meta, peer.meta, plan, remote_rank)
                    )
                    # The Done of this (local, remote) rank pair rides on the fetch: the
                    # transport delivers it once the fetch completed, so the producer's Ack
                    # is not delayed by this process noticing the completion first (the
                    # background progress thread keeps the producer answering while it
                    # computes).
                    done = b""
                    if attach:
                        done = self._done_message(state, plan.local_rank, remote_rank, ok=True)
                    state.handles.append(self.transport.start_fetch(prepared, done))
                    if done:
                        state.attached.add((plan.local_rank, remote_rank))
            transition(state, ReadState.TRANSFERRING)
        except (
            HandshakeError,
            IncompatibleEngineError,
            MetadataError,
            PlanError,
            ConnectionError,
            KeyError,
        ) as error:
            state.error = f"{type(error).__name__}: {error}"

    def _start_arrays(self, state: Reading, peer: Peer, meta: EngineMetadata,
                      num_local: int) -> None:
        """A read over a transport that moves arrays (`transport.moves_arrays`): the producer
        processes format the request for this process's ranks once asked (`Want` with the
        read and this engine's geometry); one fetch per local rank pulls its buffers from
        every source rank and writes them in the local layout (no post-processing left).

        A layer-wise request (with the transport's ``layer_group_bytes`` > 0) is pulled in
        layer groups (`JaxTransport.read_groups`, the ranges the producer derives from the
        Want): every group's pulls are posted now, the producer offers each once its layers
        are written, and each group is written into the cache as it arrives (its layers
        count as landed then); otherwise the request is pulled whole once every layer is
        written."""
        state.converted = any(p.post for p in state.plans)
        state.plans = [dataclasses.replace(p, post=()) for p in state.plans]
        state.needs_jax = num_local > 0  # the pulled buffers are written with JAX ops
        group_bytes = int(self.transport.layer_group_bytes)
        state.layerwise = state.layerwise and num_local > 0 and group_bytes > 0
        if not num_local:
            return  # notify only
        config = self.registry.config
        want = encode_message(Want(
            state.request_id, self.transport.endpoint, read_id=state.read_id,
            num_blocks=len(state.plans[0].remote_block_ids),
            address=[self.address[0], self.address[1]], attempt=state.attempt,
            layout=config.spec.layout, block_size=config.spec.block_size,
            tp_size=config.tp_size, pp_size=config.pp_size,
            layers_per_pp=list(config.layer_split), ranks=list(self.registry.local_ranks),
            layer_group_bytes=group_bytes if state.layerwise else 0))
        for target in peer.targets.values():
            if not self.control.send(target, want):
                raise ConnectionError(f"could not ask producer {target!r} for the request")
        transport: Any = self.transport
        for plan in state.plans:
            fetch = Fetch(state.request_id, state.read_id, meta, peer.meta, plan, -1,
                          attempt=state.attempt)
            if not state.layerwise:
                state.handles.append(transport.start_fetch(transport.prepare_fetch(fetch)))
                continue
            prepared = [(layers, transport.prepare_layers(fetch, layers))
                        for layers in transport.read_groups(fetch)]
            for layers, piece in prepared:
                if piece is None:
                    continue  # another pipeline stage's layers
                handle = transport.start_fetch(piece)
                state.handles.append(handle)
                for layer in range(*layers):
                    state.layer_handles.setdefault(layer, []).append(handle)
        state.layers_total = tuple(sorted(state.layer_handles))

    def _formats(self, state: Reading, peer: Peer, meta: EngineMetadata, num_local: int) -> bool:
        """Whether this read goes formatted (`jaxkv.transfer._formatted`): never for
        layer-wise reads, notify-only reads or a transport without formatted reads; only
        between host-memory caches; in ``"auto"`` mode when `PathCosts` says it is cheaper.

        Raises:
          PlanError: ``"always"`` for caches that are not both in host memory.
        """
        mode = self.formatted_reads
        if mode == "never" or not num_local or not self.transport.formats_reads:
            return False
        # A cheap upper bound first (per registration, not per read): small reads never pay
        # a round trip per chunk, nor this check's walk over the regions.
        if self._block_bytes[0] != self.registry.generation:
            self._block_bytes = (self.registry.generation, sum(
                r.block_len for info in meta.ranks for r in info.regions))
        if mode == "auto" and num_local * self._block_bytes[1] < MIN_FORMATTED_BYTES:
            return False
        host = self._in_host_memory(("", meta.generation), [
            meta.rank_info(rank) for rank in self.registry.local_ranks]) and \
            self._in_host_memory((state.peer, peer.meta.generation), peer.meta.ranks)
        if not host:
            if mode == "always":
                raise PlanError("formatted reads need both caches in host memory (CPU caches "
                                "or host-staged mirrors); read these directly")
            return False
        if mode == "always":
            return True
        costs = self.costs.setdefault(state.peer, PathCosts())
        nbytes = sum(p.num_bytes for p in state.plans)
        shares = sum(len(p.read_ranks) for p in state.plans)
        descriptors = sum(p.num_chunks for p in state.plans)
        return costs.formatted_s(shares, nbytes) < costs.direct_s(descriptors, nbytes)

    def _in_host_memory(self, key: tuple[str, int], ranks: Sequence[Any]) -> bool:
        """Whether every region of `ranks` is host memory, once per (engine, generation)."""
        known = self._host_memory.get(key)
        if known is None:
            if len(self._host_memory) > 64:
                self._host_memory.clear()
            known = self._host_memory[key] = all(
                r.memory_kind == "DRAM" for info in ranks for r in info.regions)
        return known

    def _start_formatted(self, state: Reading, peer: Peer, meta: EngineMetadata,
                         plan: ReadPlan, remote_rank: int, layer: int | None = None
                         ) -> FormattedFetch:
        """The formatted fetch of one (local rank, producer rank) share of `plan` (a layer's
        sub-plan: the producer gathers it once the layer is published): its chunks are asked
        for (`Format`) as receive-pool slots allow; `on_formatted` posts their READs."""
        transport: Any = self.transport
        generation = self.registry.generation  # the regions the plans write into
        target = peer.targets[peer.meta.rank_info(remote_rank).agent_name]
        first = sum(len(f.chunks) for f in state.formatted)  # chunk ids unique per read
        layer_stop = 0 if layer is None else layer + 1

        def ask(chunk: int, nbytes: int, fields: dict) -> bool:
            return self.send(target, encode_message(Format(
                state.request_id, self.engine_id, transport.endpoint, state.read_id,
                state.attempt, chunk, remote_rank, plan.local_rank,
                state.generations.get(remote_rank, -1), nbytes, layer_stop=layer_stop,
                **fields)))

        def released(chunk: int) -> bytes:
            return encode_message(Released(
                state.request_id, transport.endpoint, state.attempt, chunk, remote_rank,
                plan.local_rank))

        try:
            fetch = transport.start_formatted(
                Fetch(state.request_id, state.read_id, meta, peer.meta, plan, remote_rank,
                      layer),
                ask, released, lambda: self.registry.generation == generation,
                first_chunk=first)
        except ValueError as error:  # e.g. a chunk larger than the receive pool
            raise PlanError(f"formatted read: {error}") from error
        state.formatted.append(fetch)
        state.handles.append(fetch)
        return fetch

    def _plan_layers(self, state: Reading, peer: Peer, local_ids: np.ndarray, remote_ids) -> None:
        """Per (global layer, remote rank): a prepared fetch, posted once announced."""
        meta = self.registry.meta
        assert meta is not None
        layers: set[int] = set()
        for plan in state.plans:
            entry = self.registry.rank_cache[plan.local_rank]
            for layer in range(entry.layer_start, entry.layer_stop):
                layers.add(layer)
                if not len(local_ids):
                    continue
                sub = plan_read(
                    meta,
                    plan.local_rank,
                    peer.meta,
                    local_ids,
                    remote_ids,
                    check=False,
                    layers=(layer, layer + 1),
                )
                for remote_rank in sub.read_ranks:
                    if state.formatted_path:  # gathered once the layer is announced
                        state.pending.append((layer, remote_rank, sub))
                        continue
                    fetch = Fetch(
                        state.request_id, state.read_id, meta, peer.meta, sub, remote_rank, layer
                    )
                    state.pending.append(
                        (layer, remote_rank, self.transport.prepare_fetch(fetch))
                    )
        state.layers_total = tuple(sorted(layers))
        for layer in state.layers_total:
            state.layer_handles[layer] = []

    # -- messages ---------------------------------------------------------------------------

    def sender_ranks(self, engine_id: str, channel: str, sender: str) -> set[int]:
        """The ranks of producer engine `engine_id` served by the process this process
        talks to as `sender` on `channel` (its control target): the only ranks whose `Ack`
        and `Ready` that sender may give (a producer answers for its own requests only)."""
        peer = self.peers.get(engine_id)
        if peer is None or channel != self.control.name:
            return set()
        return {info.rank for info in peer.meta.ranks
                if peer.targets.get(info.agent_name) == sender}

    def _answered(self, message: Ack | Formatted, channel: str, sender: str) -> Reading | None:
        """The read a producer's answer is for (None: an earlier attempt's, or a sender that
        does not serve the producer rank it names: counted as refused)."""
        reading = self.by_attempt.get(message.attempt)
        if reading is None or message.request_id != reading.request_id:
            return None  # an answer to an earlier attempt
        if message.producer_rank not in self.sender_ranks(reading.peer, channel, sender):
            self.stats.refused_messages += 1
            return None
        return reading

    def on_ack(self, message: Ack, channel: str, sender: str) -> None:
        # May come before this process saw its fetches complete (Done attached).
        reading = self._answered(message, channel, sender)
        if reading is None:
            return
        reading.acks[(message.producer_rank, message.consumer_rank)] = message.pinned
        if message.pinned and message.digest_algorithm:
            values = np.frombuffer(message.digests, "<u8") if len(message.digests) % 8 == 0 \
                else np.zeros(0, np.uint64)
            positions = message.digest_positions or range(len(values))
            if len(positions) == len(values):
                reading.acked_digests[message.producer_rank] = (
                    message.digest_algorithm,
                    {int(p): int(v) for p, v in zip(positions, values)},
                )
            else:
                self.stats.malformed_messages += 1
        if message.stale:
            reading.stale = True
            self.suspect(reading.peer)
        reading.unpublished |= message.unpublished

    def on_formatted(self, message: Formatted, channel: str, sender: str) -> None:
        """A producer's answer to a `Format`: the chunk is READ (or the read fails)."""
        reading = self._answered(message, channel, sender)
        if reading is None:
            return
        fetch = next((f for f in reading.formatted if f.owns(message.chunk)
                      and (f.local_rank, f.remote_rank)
                      == (message.consumer_rank, message.producer_rank)), None)
        if fetch is None:
            self.stats.refused_messages += 1
            return
        fetch.on_formatted(message.chunk, message.address, message.nbytes, message.error)

    def on_ready(self, message: Ready, channel: str, sender: str) -> None:
        for reading in self.reading.values():
            if reading.request_id != message.request_id:
                continue
            allowed = self.sender_ranks(reading.peer, channel, sender)
            if not set(message.ranks) <= allowed:
                self.stats.refused_messages += 1
                continue
            for rank in message.ranks:
                reading.ready[rank] = max(reading.ready.get(rank, 0), message.layer_stop)

    # -- progress ---------------------------------------------------------------------------

    def poll(self, now: float, allow_jax: bool, result: PollResult) -> None:
        for request_id in list(self.reading):
            state = self.reading[request_id]
            if state.needs_jax and not allow_jax and state.error is None and now <= state.deadline:
                continue  # its rewrite runs JAX: left to the next `poll` outside callbacks
            self._progress(state, now, result)

    def _post_ready(self, state: Reading) -> None:
        """Posts the pending layer fetches whose producer rank announced the layer."""
        still = []
        for item in state.pending:
            layer, remote_rank, prepared = item
            if state.ready.get(remote_rank, 0) > layer:
                if state.formatted_path:  # `prepared` is the layer's sub-plan
                    peer = self.peers[state.peer]
                    meta = self.registry.meta
                    assert meta is not None
                    try:
                        handle = self._start_formatted(state, peer, meta, prepared,
                                                       remote_rank, layer)
                    except PlanError as error:
                        state.error = str(error)
                        return
                else:
                    handle = self.transport.start_fetch(prepared)
                    state.handles.append(handle)
                state.layer_handles[layer].append(handle)
                if state.state is ReadState.WAITING_READY:
                    transition(state, ReadState.TRANSFERRING)
            else:
                still.append(item)
        state.pending = still

    def _layers_arrived(self, state: Reading, result: PollResult) -> bool:
        """Records the arrival time of completed layers; True when every layer arrived."""
        waiting = {item[0] for item in state.pending}
        changed = False
        for layer in state.layers_total:
            if layer in state.layer_arrival or layer in waiting:
                continue
            handles = state.layer_handles[layer]
            if not handles and not any(
                state.ready.get(r, 0) > layer for r in self._source_ranks_of(state, layer)
            ):
                continue  # nothing to read for this layer, but not announced yet
            states = [self.transport.check(h) for h in handles]
            if "ERR" in states:
                state.error = f"a {self.transport.name} fetch of layer {layer} failed"
                reason = next((r for r in map(self.transport.error_of, handles) if r), None)
                if reason:
                    state.error += f": {reason}"
                self.suspect(state.peer)
                return False
            if all(st == "DONE" for st in states):
                state.layer_arrival[layer] = time.time()
                changed = True
                if self._posts_per_layer(state):
                    post_process(state, self.registry, layer=layer)
                    if state.error is not None:
                        return False
        if changed:
            result.layers[state.read_id] = len(state.layer_arrival)
        return len(state.layer_arrival) == len(state.layers_total)

    def _posts_per_layer(self, state: Reading) -> bool:
        """Whether a layer-wise read's received blocks are rewritten layer by layer as each
        lands (so only the last layer's rewrite is left once every layer arrived): when the
        rewrite acts on arrays of one layer each (not cross-layer blocks), no cache is
        host-staged (staging in copies whole blocks, once) and no digest is checked (digests
        are taken over the bytes as they landed, before any rewrite)."""
        if not state.layerwise or not state.needs_jax or self.digests.enabled:
            return False
        if not any(p.post for p in state.plans):
            return False
        for plan in state.plans:
            entry = self.registry.rank_cache[plan.local_rank]
            if entry.mirror is not None or any(
                    layer is None for layer, _ in entry.cache.spec.array_keys()):
                return False
        return True

    def _source_ranks_of(self, state: Reading, layer: int) -> list[int]:
        peer = self.peers.get(state.peer)
        if peer is None:
            return []
        config = peer.meta.config()
        pp = config.layer_owner(layer)
        return [config.rank(tp, pp) for tp in range(config.tp_size)]

    def _landed(self, state: Reading) -> None:
        state.done_at = time.monotonic()
        transition(state, ReadState.LANDED)
        self._send_done(state, ok=True)
        if self.digests.enabled and state.local_block_ids:
            # Before post-processing (or staging in) rewrites the landed bytes.
            self._digest_landed(state)
        # Overlaps the producer's acknowledgement round trip.
        post_process(state, self.registry)

    def _digest_landed(self, state: Reading) -> None:
        """Digests the producer block images this process received (see the module
        docstring); what cannot be verified is recorded in ``state.digest_error``."""
        t0 = time.perf_counter()
        try:
            peer = self.peers[state.peer]
            meta = self.registry.meta
            assert meta is not None
            plan_local, plan_peer = meta, peer.meta
            if self.transport.moves_arrays:
                from jaxkv.transfer._formatter import values_metadata

                plan_local, plan_peer = values_metadata(meta), values_metadata(peer.meta)
                if state.converted or meta.padded:
                    raise DigestError(
                        "the JAX transport converted this read's layout or block size (or the "
                        "local storage is packed / padded): the landed bytes are not the "
                        "producer's block images")
            if peer.meta.padded:
                raise DigestError("the producer's blocks store padding, which is never moved")
            from jaxkv.transfer._digest import device_arrays, rank_regions

            remote_ids = np.asarray(state.plans[0].remote_block_ids, np.int64)
            positions = None
            if state.digest_positions is not None:
                # The request's positions -> the read's (it reads the request's tail).
                offset = state.num_remote_ids - len(remote_ids)
                positions = [p - offset for p in state.digest_positions.tolist() if p >= offset]
            # Cached per geometry (the plans' planners): only `positions` are mapped.
            pieces = landed_pieces(state.plans, plan_local, plan_peer, remote_ids, positions)
            algorithms = {
                info.rank: algorithm_for([r.memory_kind for r in info.regions])
                for info in peer.meta.ranks
            }
            local_regions: dict[int, Any] = {}
            arrays: dict[int, list] = {}
            for plan in state.plans:
                entry = self.registry.rank_cache[plan.local_rank]
                regions = local_regions[plan.local_rank] = rank_regions(entry, plan.local_rank)
                if not regions.on_host:
                    arrays[plan.local_rank] = device_arrays(entry, regions)
            state.landed = verify_landed(pieces, algorithms, local_regions, arrays)
        except (DigestError, KeyError, ValueError) as error:
            state.digest_error = f"{type(error).__name__}: {error}"
        finally:
            self.stats.digest_s_total += time.perf_counter() - t0

    def _check_digests(self, state: Reading) -> None:
        """Compares the landed digests with the producers' (every Ack arrived); sets
        ``state.error`` (and ``state.invalid``: exactly the local blocks of mismatched
        producer blocks) when they differ or cannot be compared."""
        if not self.digests.enabled or not state.local_block_ids:
            return
        if state.digest_error is not None or state.landed is None:
            state.error = f"integrity digests: {state.digest_error or 'not computed'}"
            return
        # Positions in the landed pieces index the read's remote ids (the tail of the
        # request's); the producer's positions index the whole request.
        offset = state.num_remote_ids - len(state.plans[0].remote_block_ids)
        mismatched: list[tuple[int, int]] = []
        invalid: set[int] = set()
        problems: list[str] = []
        for (rank, pos), landed in sorted(state.landed.items()):
            acked = state.acked_digests.get(rank)
            if acked is None:
                problems.append(f"producer rank {rank} sent no digests")
                continue
            expected = acked[1].get(pos + offset)
            if expected is None:
                if self.digests.mode == "full":
                    problems.append(f"producer rank {rank} sent no digest of block {pos}")
                continue
            if not landed.verifiable:
                problems.append(
                    f"block {pos + offset} of producer rank {rank} landed only in part in this "
                    "process (or in device memory not mapping whole blocks): not verifiable")
                continue
            if any(value != expected for value in landed.values):
                mismatched.append((rank, pos + offset))
                invalid |= landed.local_blocks
            else:
                self.stats.digest_verified += 1
        if self.digests.mode == "sampled":
            # Both sides draw the same positions (`sample_positions`); a producer that drew
            # others (another jaxkv version) would otherwise leave its blocks unverified.
            read = {r for plan in state.plans for r in plan.read_ranks}
            for rank, (_, values) in state.acked_digests.items():
                if rank not in read:
                    continue  # the Ack of a rank this process notified only
                here = {pos + offset for (r, pos) in state.landed if r == rank}
                other = sorted(p for p in values if offset <= p < state.num_remote_ids
                               and p not in here)
                if other:
                    problems.append(
                        f"producer rank {rank} digested blocks {other[:4]} that this process "
                        "did not sample (the engines draw sampled positions differently: "
                        "run the same jaxkv version on both)")
        if mismatched:
            self.stats.digest_mismatches += len(mismatched)
            state.error = (
                "integrity digest mismatch: producer (rank, block position) "
                + ", ".join(f"({r}, {p})" for r, p in mismatched)
                + " landed with other bytes than published")
            state.invalid = tuple(sorted(invalid))
        elif problems:
            state.error = "integrity digests: " + "; ".join(sorted(set(problems))[:4])

    def _progress(self, state: Reading, now: float, result: PollResult) -> None:
        if state.error is None and now > state.deadline:
            state.error = (
                f"timed out after {now - state.started:.3f}s "
                f"({'confirming' if state.done_at else 'reading'})"
            )
        if state.error is None and state.done_at is None and state.layerwise:
            try:
                self._post_ready(state)
            except ConnectionError as error:
                state.error = f"{type(error).__name__}: {error}"
            if state.error is None and self._layers_arrived(state, result):
                self._landed(state)
        elif state.error is None and state.done_at is None:
            states = [self.transport.check(h) for h in state.handles]
            if "ERR" in states:
                state.error = f"a {self.transport.name} fetch failed"
                reason = next((r for r in map(self.transport.error_of, state.handles) if r),
                              None)
                if reason:
                    state.error += f": {reason}"
                self.suspect(state.peer)
            elif all(s == "DONE" for s in states):
                self._landed(state)
        if (
            state.error is None
            and state.done_at is not None
            and (len(state.acks) >= state.expected_acks)
        ):
            if all(state.acks.values()):
                self._check_digests(state)
                if state.error is None:
                    self._finish(state, result)
                    return
            else:
                state.error = (
                    "the producer re-registered its cache after this read was planned (stale "
                    "metadata: the next read fetches it again)"
                    if state.stale
                    else "the producer did not publish the request (within its "
                    "early_read_grace_s)"
                    if state.unpublished
                    else "the producer released the blocks before the read was confirmed"
                )
        if state.error is not None:
            self._fail(state, result)
            return
        if now >= state.next_heartbeat:
            self.heartbeat(state, now)

    def heartbeat(self, state: Reading, now: float) -> None:
        peer = self.peers.get(state.peer)
        state.next_heartbeat = now + state.lease_s / 3
        if peer is None:
            return
        message = encode_message(Heartbeat(state.request_id, self.engine_id))
        for target in peer.targets.values():
            self.send(target, message)

    def _done_message(self, state: Reading, local_rank: int, remote_rank: int, ok: bool) -> bytes:
        return encode_message(
            Done(
                state.request_id,
                self.engine_id,
                self.transport.endpoint,
                local_rank,
                remote_rank,
                self.registry.config.world_size,
                ok,
                state.attempt,
                state.generations.get(remote_rank, -1),
                "" if state.read_id == state.request_id else state.read_id,
            )
        )

    def _send_done(self, state: Reading, ok: bool) -> None:
        """Every consumer rank notifies every producer rank (those whose Done went with
        their fetch, on success, are only counted)."""
        peer = self.peers.get(state.peer)
        if peer is None:
            return
        state.expected_acks = 0
        for local_rank in self.registry.local_ranks:
            for remote_rank in range(peer.meta.world_size):
                if ok and (local_rank, remote_rank) in state.attached:
                    state.expected_acks += 1
                    continue
                info = peer.meta.rank_info(remote_rank)
                message = self._done_message(state, local_rank, remote_rank, ok)
                if self.send(peer.targets[info.agent_name], message):
                    state.expected_acks += 1
                elif ok:
                    state.error = f"could not notify producer rank {remote_rank}"

    def release_handles(self, state: Reading) -> bool:
        clean = True
        for handle in state.handles:
            clean &= self.transport.release(handle)
        state.handles = []
        return clean

    def _finish(self, state: Reading, result: PollResult) -> None:
        transition(state, ReadState.CONFIRMED)
        self.release_handles(state)
        del self.reading[state.read_id]
        self.by_attempt.pop(state.attempt, None)
        plans = state.plans
        self.stats.add(
            TransferRecord(
                request_id=state.read_id,
                bytes=sum(p.num_bytes for p in plans),
                descriptors=sum(p.num_descriptors for p in plans),
                expanded_descriptors=sum(p.num_chunks for p in plans),
                duration_s=(state.done_at or time.monotonic()) - state.started,
                # fetches complete -> confirmed, less the post-processing done meanwhile
                confirm_s=max(
                    0.0, time.monotonic() - (state.done_at or time.monotonic()) - state.post_s
                ),
                post_s=state.post_s,
                layer_arrival=tuple(sorted(state.layer_arrival.items())),
                started_at=state.started_wall,
                path="formatted" if state.formatted_path else "direct",
            )
        )
        self._calibrate(state)
        self._remember(state.read_id, True)
        result.finished.append(state.read_id)
        posts = [step for p in plans for step in p.post]
        if posts:
            result.post_applied[state.read_id] = posts

    def _calibrate(self, state: Reading) -> None:
        """Feeds a finished read's time to its producer's `PathCosts`."""
        costs = self.costs.get(state.peer)
        if costs is None or state.done_at is None or state.layerwise:
            return
        seconds = state.done_at - state.started
        nbytes = sum(p.num_bytes for p in state.plans)
        if state.formatted:
            costs.observe_formatted(len(state.formatted), nbytes, seconds)
        elif nbytes >= MIN_FORMATTED_BYTES:
            costs.observe_direct(sum(p.num_chunks for p in state.plans), nbytes,
                                 seconds)

    def _fail(self, state: Reading, result: PollResult) -> None:
        if state.state not in TERMINAL:
            transition(state, ReadState.FAILED)
        # Release (cancel) the fetches first: releasing a handle may cancel messages queued
        # behind it on the endpoint.
        self.release_handles(state)
        if state.done_at is None:
            self._send_done(state, ok=False)  # lets the producer free early
        del self.reading[state.read_id]
        self.by_attempt.pop(state.attempt, None)
        self.stats.failed_transfers += 1
        invalid = sorted({int(b) for b in state.local_block_ids} if state.invalid is None
                         else state.invalid)
        self._remember(state.read_id, False)
        result.failed.append(FailedRead(state.read_id, state.error or "failed", tuple(invalid)))

    def _remember(self, request_id: str, ok: bool) -> None:
        self.outcomes[request_id] = ok
        while len(self.outcomes) > MAX_OUTCOMES:
            del self.outcomes[next(iter(self.outcomes))]

    def abort(self, read_id: str) -> None:
        reading = self.reading.get(read_id)
        if reading is not None and reading.error is None:
            reading.error = "aborted"

    def close(self) -> None:
        for state in self.reading.values():
            self.release_handles(state)
        self.reading.clear()
        self.by_attempt.clear()


def post_process(state: Reading, registry: CacheRegistry, layer: int | None = None) -> None:
    """Rewrites the received blocks that arrived in the sender's arrangement, in place,
    in every registered cache they belong to; any failure fails the request.

    With `layer` (a global layer that landed; `Consumer._posts_per_layer`): only the arrays
    holding that layer, recorded in ``state.post_done``; without: host staging and every
    array not rewritten yet."""
    # per registered cache: its steps to apply, per local rank
    per_entry: dict[int, tuple[Registered, dict[int, list[PostProcess]]]] = {}
    for plan in state.plans:
        entry = registry.rank_cache[plan.local_rank]
        _, by_rank_steps = per_entry.setdefault(id(entry), (entry, {}))
        keep = _arrays_to_post(state, entry, layer)
        by_rank_steps.setdefault(plan.local_rank, []).extend(
            step for step in plan.post if keep(step.array_index))
    if not state.needs_jax:
        return
    start = time.perf_counter()
    try:
        for entry, by_rank_steps in per_entry.values():
            steps = [step for rank_steps in by_rank_steps.values() for step in rank_steps]
            if layer is None and entry.mirror is not None and state.local_block_ids:
                check_current(entry)
                updated = entry.mirror.stage_in(entry.cache, state.local_block_ids)
                updated.verify_unmoved(entry.buffers)
                entry.cache.arrays = updated.arrays
            if not steps:
                continue
            by_rank = {r: group_post_steps(rank_steps) for r, rank_steps in by_rank_steps.items()}
            first = next(iter(by_rank.values()))
            if any(
                g.keys() != first.keys()
                or any(g[k][0] != first[k][0] for k in g)
                for g in by_rank.values()
            ):
                raise ValueError(
                    "the ranks of one sharded cache need different post-processing"
                )
            cache = entry.cache
            check_current(entry)
            updated = apply_post_processing(cache, steps)
            updated.verify_unmoved(entry.buffers)
            # Keep the caller's object current: its donated arrays are replaced by the
            # results, which live in the same (registered) buffers.
            cache.arrays = updated.arrays
            state.post_done.update((id(entry), step.array_index) for step in steps)
    except Exception as error:  # noqa: BLE001 - reported as a failed request
        _log.error("post-processing of %s failed: %s", state.request_id, error)
        state.error = f"post-processing failed: {type(error).__name__}: {error}"
    if layer is None:
        state.post_s = time.perf_counter() - start


def _arrays_to_post(state: Reading, entry: Registered,
                    layer: int | None) -> Callable[[int], bool]:
    """Which array indices of `entry` a `post_process` call rewrites: those of global
    `layer`, or (None) every one not rewritten yet."""
    if layer is None:
        return lambda index: (id(entry), index) not in state.post_done
    local = layer - entry.layer_start
    keys = entry.cache.spec.array_keys()
    return lambda index: keys[index][0] == local


def check_current(entry: Registered) -> None:
    """Raises ValueError if the registered cache's arrays were consumed (deleted)."""
    if entry.consumed:
        raise ValueError(
            "the registered cache was consumed by another update: pass the current "
            "cache to update_cache() after each donated update"
        )


def merge_metadata(metas: list[EngineMetadata]) -> EngineMetadata:
    """One engine's metadata from the partial views of its processes."""
    first = metas[0]
    ranks: dict[int, RankInfo] = {}
    agents: dict[str, AgentInfo] = {}
    for meta in metas:
        shared = {
            k: v
            for k, v in msgspec.structs.asdict(meta).items()
            if k not in ("ranks", "agents", "generation")
        }
        reference = {
            k: v
            for k, v in msgspec.structs.asdict(first).items()
            if k not in ("ranks", "agents", "generation")
        }
        if shared != reference:
            raise MetadataError(
                f"processes of engine {first.engine_id!r} disagree on the engine description"
            )
        for info in meta.ranks:
            ranks[info.rank] = info
        for agent in meta.agents:
            agents[agent.name] = agent
    missing = sorted(set(range(first.world_size)) - set(ranks))
    if missing:
        raise MetadataError(f"engine {first.engine_id!r}: no process publishes ranks {missing}")
    generation = max(m.generation for m in metas)
    return msgspec.structs.replace(
        first,
        ranks=[ranks[r] for r in sorted(ranks)],
        agents=list(agents.values()),
        generation=generation,
    )
