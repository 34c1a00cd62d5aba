"""`KVTransferEngine`: one process's side of KV-block transfers between engines.

One NIXL agent per process; it may hold several ranks of an engine (TP ranks as devices of
one process) or one (a process per rank). Both roles live in the same object:

* **Producer** (prefill): `register_cache`, then `publish_request(request_id, block_ids)`
  pins the blocks under a lease; `poll()` reports in `PollResult.freeable` the requests whose
  blocks may be freed: every consumer rank notified (`Done`, unique per request, producer
  rank and consumer rank; with ``expected_reads=N``, by N distinct consumer reads), the lease
  expired (consumers extend it with heartbeats), or `abort_request`. A consumer's
  confirmation that arrives before the request was published (a serving framework's
  scheduler hands the params out before its worker pins the blocks) is held up to
  ``early_read_grace_s``: confirmed if the request is published meanwhile, refused after.
* **Consumer** (decode): `start_read(params, local_block_ids, read_id=...)` plans and posts
  the READs and returns at once; `poll()` reports `finished` and `failed` reads by their read
  id (default: the producer's request id; e.g. the consumer's own request id, so that several
  consumer requests may read one producer request at once). A read is
  successful only after every producer rank acknowledged (`Ack`) that the blocks were still
  pinned when the consumer's `Done` (sent after the READs completed) arrived, so data read
  after a lease expired is never reported as good. A failed request lists its local block ids
  as invalid. Blocks that arrived in the sender's arrangement (another layout with several
  heads per read, a smaller sender block size) are rewritten in place (`permute_blocks` /
  `merge_blocks` on exactly the received blocks) right after the READs complete, before the
  request is reported finished: a finished request's blocks are always in the local layout.
  The registered `PagedKVCache` object is kept current (its donated arrays are replaced by the
  results, in the same registered buffers); after updating the cache elsewhere with donated
  operations, hand the new version to `update_cache`.

Every wait is bounded: handshakes (`handshake_timeout_s`, retries), reads and confirmations
(`read_timeout_s`), leases (`lease_s`).

Readiness (layer-wise publishing, publishing from inside a jitted step): a request published
with ``layerwise=True`` is pinned but not readable yet; `publish_layers(request_id, stop)`
declares the global layers ``[0, stop)`` written (monotonic). Its consumers subscribe
(`Want`) and read each layer as the producer processes announce it (`Ready`); the request is
finished only when every layer arrived (`TransferRecord.layer_arrival` has the per-layer wall
times, `TransferStats.publications` the producer's).

Host staging (``host_staging=True``, automatic for devices NIXL cannot register, e.g. TPUs):
NIXL moves a registered host mirror of the cache (`HostMirror`); the producer copies published
blocks device -> mirror with the gather custom call, the consumer mirror -> device with the
scatter custom call before post-processing. Same bytes as the direct mode.

The engine is thread-safe (one lock): host callbacks of jitted steps (`jaxkv.transfer`'s
`publish_in_jit` / `wait_in_jit`) call into it from XLA's threads.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import threading
import time
from collections.abc import Sequence
from typing import Any, cast

import msgspec
import numpy as np

from jaxkv._parallel import EngineConfig
from jaxkv.transfer._agent import AgentOptions, NixlAgent
from jaxkv.transfer._messages import (
    Ack,
    Done,
    Heartbeat,
    Hello,
    Ready,
    Want,
    decode_message,
    encode_message,
)
from jaxkv.transfer._metadata import (
    AgentInfo,
    EngineMetadata,
    IncompatibleEngineError,
    MetadataError,
    RankInfo,
    RegionInfo,
    check_compatible,
    engine_metadata,
)
from jaxkv.transfer._plan import PlanError, PostProcess, ReadPlan, plan_read
from jaxkv.transfer._post import apply_post_processing, group_post_steps
from jaxkv.transfer._side_channel import HandshakeError, MetadataServer, fetch_metadata
from jaxkv.transfer._staging import HostMirror
from jaxkv.transfer._stats import PublishRecord, TransferRecord, TransferStats

__all__ = [
    "FailedRead",
    "KVTransferEngine",
    "PollResult",
    "TransferParams",
    "make_transfer_params",
]

_log = logging.getLogger(__name__)
_generation_counter = itertools.count()
_attempt_counter = itertools.count(1)
_MAX_HANDLES = 1 << 16
_MAX_OUTCOMES = 4096


class TransferParams(msgspec.Struct, frozen=True):
    """What a producer hands to the consumer of a request (through the router).

    Attributes:
      engine_id: the producer engine.
      addresses: side-channel ``(host, port)`` of every producer process.
      request_id: the request.
      block_ids: the request's blocks on the producer, in token order.
      lease_s: how long the producer pins them without a heartbeat.
      generation: the producer's generation (-1: whatever its processes publish now).
      layerwise: the blocks become readable layer by layer (`KVTransferEngine.publish_layers`);
        the consumer waits for the producer's announcements before reading each layer.
    """

    engine_id: str
    addresses: list[tuple[str, int]]
    request_id: str
    block_ids: list[int]
    lease_s: float
    generation: int = -1
    layerwise: bool = False


def make_transfer_params(
    engine_id: str,
    addresses: tuple[str, int] | Sequence[tuple[str, int]],
    request_id: str,
    block_ids: Sequence[int],
    lease_s: float = 30.0,
    *,
    num_tokens: int | None = None,
    block_size: int | None = None,
    generation: int = -1,
    layerwise: bool = False,
) -> TransferParams:
    """Builds a request's `TransferParams` where no `KVTransferEngine` runs (a serving
    framework's scheduler process): what the producer's workers pin with
    `KVTransferEngine.publish_request` and the consumer reads with `start_read`.

    The consumer fetches the producer's metadata from `addresses` (every producer process's
    side channel, i.e. each worker's `KVTransferEngine.address`); ``generation=-1`` accepts
    whatever the producer's processes publish when the read starts. When the workers may pin
    the blocks after the consumer already read them, keep the producer's
    ``early_read_grace_s`` above that delay.

    Args:
      engine_id: the producer engine's id (shared by all of its processes).
      addresses: one ``(host, port)`` or a list of them, in process order; ports > 0.
      request_id: the producer's request id (the one its workers publish).
      block_ids: the request's blocks on the producer, in token order.
      lease_s: the lease the producer's workers pin the blocks with (`publish_request`).
      num_tokens, block_size: when both are given, `block_ids` is cut to the blocks that hold
        `num_tokens` tokens of `block_size` (a scheduler's block list may be longer).
      generation: the producer's generation, or -1 (any).
      layerwise: the workers publish the request layer by layer.

    Returns:
      The params, as `publish_request` would return them (the addresses as given).

    Raises:
      ValueError: an empty id, no address or a malformed one, a negative block id, too few
        blocks for `num_tokens`, a non-positive lease or block size.

    Example:
      >>> p = make_transfer_params("prefill", ("10.0.0.5", 5600), "req-7", [4, 9, 2, 8],
      ...                          lease_s=20.0, num_tokens=40, block_size=16)
      >>> p.addresses, p.block_ids, p.lease_s, p.generation
      ([('10.0.0.5', 5600)], [4, 9, 2], 20.0, -1)
      >>> make_transfer_params("prefill", [], "req-7", [4])
      Traceback (most recent call last):
      ...
      ValueError: addresses: at least one (host, port) is needed
    """
    if not isinstance(engine_id, str) or not engine_id:
        raise ValueError(f"engine_id must be a non-empty str, got {engine_id!r}")
    if not isinstance(request_id, str) or not request_id:
        raise ValueError(f"request_id must be a non-empty str, got {request_id!r}")
    if isinstance(addresses, tuple) and len(addresses) == 2 and isinstance(addresses[0], str):
        addresses = [addresses]
    try:
        pairs = [(host, port) for host, port in addresses]
    except (TypeError, ValueError) as error:
        raise ValueError(
            f"addresses must be (host, port) pairs, got {addresses!r}"
        ) from error
    if not pairs:
        raise ValueError("addresses: at least one (host, port) is needed")
    checked = []
    for host, port in pairs:
        if not isinstance(host, str) or not host:
            raise ValueError(f"addresses: bad host {host!r}")
        if isinstance(port, bool) or not isinstance(port, (int, np.integer)):
            raise ValueError(f"addresses: port {port!r} of {host!r} is not an int")
        if not 0 < int(port) < 65536:
            raise ValueError(f"addresses: port {port} of {host!r} is outside [1, 65535]")
        checked.append((host, int(port)))
    ids = []
    for block in block_ids:
        if isinstance(block, bool) or not isinstance(block, (int, np.integer)) or block < 0:
            raise ValueError(f"block_ids must be ints >= 0, got {block!r}")
        ids.append(int(block))
    if (num_tokens is None) != (block_size is None):
        raise ValueError("num_tokens and block_size go together")
    if num_tokens is not None and block_size is not None:
        if int(block_size) < 1 or int(num_tokens) < 0:
            raise ValueError(f"bad num_tokens {num_tokens} / block_size {block_size}")
        needed = -(-int(num_tokens) // int(block_size))
        if needed > len(ids):
            raise ValueError(
                f"{num_tokens} tokens need {needed} blocks of {block_size}, got {len(ids)}"
            )
        ids = ids[:needed]
    if not float(lease_s) > 0:
        raise ValueError(f"lease_s must be > 0, got {lease_s}")
    if int(generation) < -1:
        raise ValueError(f"generation must be >= -1, got {generation}")
    return TransferParams(
        engine_id, checked, request_id, ids, float(lease_s), int(generation), bool(layerwise)
    )


@dataclasses.dataclass(frozen=True)
class FailedRead:
    """A read that failed: its read id (`start_read`'s ``read_id``, by default the producer's
    request id), why, and the local blocks it left invalid."""

    request_id: str
    reason: str
    invalid_block_ids: tuple[int, ...]


@dataclasses.dataclass
class PollResult:
    """What `KVTransferEngine.poll` reports (each request once): consumer reads by their read
    id (`start_read`), producer requests (`freeable`) by their request id."""

    finished: list[str] = dataclasses.field(default_factory=list)
    failed: list[FailedRead] = dataclasses.field(default_factory=list)
    freeable: list[str] = dataclasses.field(default_factory=list)
    post_applied: dict[str, list[PostProcess]] = dataclasses.field(default_factory=dict)
    """Per finished request, the post-processing steps the engine already applied to the
    registered cache (informational: do not apply them again)."""
    layers: dict[str, int] = dataclasses.field(default_factory=dict)
    """Layer-wise reads in flight whose progress changed: the number of this process's
    layers that arrived so far (in every local rank)."""

    def extend(self, other: PollResult) -> None:
        """Appends another result (used to carry results found inside host callbacks)."""
        self.finished += other.finished
        self.failed += other.failed
        self.freeable += other.freeable
        self.post_applied.update(other.post_applied)
        self.layers.update(other.layers)


@dataclasses.dataclass
class _Registered:
    cache: Any  # the current PagedKVCache (kept alive; post-processing updates it in place)
    buffers: tuple  # ShardBuffers as registered with NIXL
    ranks: tuple[int, ...]
    mirror: HostMirror | None = None  # host staging: NIXL registers the mirror instead
    layer_start: int = 0  # first global layer of the cache (its pipeline rank's)
    layer_stop: int = 0
    version: int = 0  # bumped by update_cache: which step's output `cache` is


@dataclasses.dataclass
class _Peer:
    meta: EngineMetadata
    addresses: tuple[tuple[str, int], ...]
    agents: dict[str, str]  # published agent name -> NIXL name
    generations: dict[str, int] = dataclasses.field(default_factory=dict)  # agent -> generation
    stale: bool = False  # a producer process re-registered since: fetch again before reading


@dataclasses.dataclass
class _Pinned:
    block_ids: tuple[int, ...]
    deadline: float
    # producer rank -> {(consumer engine, read id): {consumer ranks that notified}}
    notified: dict[int, dict[tuple[str, str], set[int]]]
    expected: dict[tuple[str, str], int]  # (consumer engine, read id) -> its world size
    lease_s: float
    expected_reads: int = 1  # consumer reads to confirm before the blocks are freeable
    layer_stop: int = 0  # global layers [0, layer_stop) are written and readable
    subscribers: set[str] = dataclasses.field(default_factory=set)  # consumer NIXL agents
    published_at: list[tuple[int, float]] = dataclasses.field(default_factory=list)
    staged_s: float = 0.0


@dataclasses.dataclass
class _Reading:
    request_id: str
    peer: str
    plans: list[ReadPlan]
    handles: list[tuple[str, Any]]  # (remote agent, handle)
    started: float
    deadline: float
    lease_s: float
    next_heartbeat: float
    done_at: float | None = None
    acks: dict[tuple[int, int], bool] = dataclasses.field(default_factory=dict)
    expected_acks: int = 0
    error: str | None = None
    local_block_ids: tuple[int, ...] = ()
    post_s: float = 0.0
    layerwise: bool = False
    # layer-wise: (global layer, remote rank, remote agent, local descs, remote descs, kinds)
    pending: list[tuple] = dataclasses.field(default_factory=list)
    ready: dict[int, int] = dataclasses.field(default_factory=dict)  # remote rank -> stop
    layer_handles: dict[int, list[Any]] = dataclasses.field(default_factory=dict)
    layers_total: tuple[int, ...] = ()  # global layers this process reads
    layer_arrival: dict[int, float] = dataclasses.field(default_factory=dict)  # wall time
    started_wall: float = 0.0
    needs_jax: bool = False  # post-processing or host staging (not inside a host callback)
    attempt: int = 0  # tags this read's Done / Ack messages
    # (local rank, remote rank) pairs whose Done travels as the notification of their READ
    attached: set[tuple[int, int]] = dataclasses.field(default_factory=set)
    # remote rank -> generation of its process when the READs were planned (sent in Done)
    generations: dict[int, int] = dataclasses.field(default_factory=dict)
    stale: bool = False  # a producer answered that the planned regions are no longer current
    unpublished: bool = False  # a producer answered that it never published the request
    read_id: str = ""  # the consumer's key of this read (default: the producer's request id)


class KVTransferEngine:
    """One process of an engine taking part in KV transfers (see the module docstring).

    Args:
      engine_id: the engine's stable name (shared by all of its processes).
      config: the engine's `EngineConfig`.
      agent_options: NIXL agent options.
      host, port: where this process's side channel listens (port 0: a free one).
      lease_s: producer lease without heartbeats.
      read_timeout_s: consumer deadline for reads plus confirmations.
      handshake_timeout_s, handshake_retries: side-channel fetch bounds.
      host_staging: register a host mirror of each cache instead of its device buffers (True),
        the device buffers (False), or decide per cache (None: staging for devices NIXL cannot
        register, i.e. other than CPU and CUDA GPUs).
      block_hashing: the engine's block hashing scheme (opaque, e.g. ``"sha256_cbor:seed=ab12"``),
        published in the metadata: a peer that declares another one is refused at handshake.
      progress_interval_s: while requests are pinned or read, a daemon thread polls the engine
        this often whenever it is not in use (no JAX; what it finds is reported by the next
        `poll`): peers' READs, notifications, completions and acknowledgements move while the
        caller computes between polls. None: only `poll` and the in-jit callbacks do.
      early_read_grace_s: producer: how long a consumer's confirmation (`Done`) of a request
        this process has not published yet is held before it is refused. A serving
        framework's scheduler may hand the params to the consumer before its worker pinned
        the blocks (already written by the step that computed them); a read landing in
        between is confirmed once `publish_request` pins the request within this window,
        and refused after it (the consumer reports the request failed). 0: refuse at once.
        Not for host staging (the mirror holds the bytes only once published: such early
        reads are always refused) nor layer-wise requests (their reads wait for `Ready`).
    """

    def __init__(
        self,
        engine_id: str,
        config: EngineConfig,
        agent_options: AgentOptions | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        lease_s: float = 30.0,
        read_timeout_s: float = 30.0,
        handshake_timeout_s: float = 5.0,
        handshake_retries: int = 2,
        host_staging: bool | None = None,
        block_hashing: str | None = None,
        progress_interval_s: float | None = 0.001,
        early_read_grace_s: float = 5.0,
    ):
        if not early_read_grace_s >= 0:
            raise ValueError(f"early_read_grace_s must be >= 0, got {early_read_grace_s}")
        self.early_read_grace_s = float(early_read_grace_s)
        self.engine_id = engine_id
        self.config = config
        self.block_hashing = block_hashing
        self.generation = (time.time_ns() // 1000 + next(_generation_counter)) & ((1 << 62) - 1)
        self.lease_s = lease_s
        self.read_timeout_s = read_timeout_s
        self.handshake_timeout_s = handshake_timeout_s
        self.handshake_retries = handshake_retries
        self.agent = NixlAgent(
            f"{engine_id}/{os.getpid()}/{self.generation}", agent_options or AgentOptions()
        )
        self.server = MetadataServer(host, port)
        self.stats = TransferStats()
        self._ranks: dict[int, RankInfo] = {}
        self._caches: list[_Registered] = []
        self._rank_cache: dict[int, _Registered] = {}
        self._meta: EngineMetadata | None = None
        self._peers: dict[str, _Peer] = {}
        self._hello_sent: set[str] = set()
        self._consumers: dict[str, str] = {}  # consumer agent name (published) -> NIXL name
        self._pinned: dict[str, _Pinned] = {}
        self._reading: dict[str, _Reading] = {}  # by read id (the consumer's request id)
        self._by_attempt: dict[int, _Reading] = {}
        self._closed = False
        self.host_staging = host_staging
        self._lock = threading.RLock()
        self._tls = threading.local()
        self._early_wants: dict[str, tuple[set[str], float]] = {}
        # Done messages of requests not published yet: request -> [(message, expiry)]
        self._early_dones: dict[str, list[tuple[Done, float]]] = {}
        self._stashed = PollResult()  # found by polls inside host callbacks
        # publications from host callbacks that need JAX (host staging): (request, stop,
        # the cache versions at the callback); staged from a later version (the step's output)
        self._deferred: list[tuple[str, int, tuple[int, ...]]] = []
        self._handles: dict[int, str] = {}
        self._handle_of: dict[str, int] = {}
        self._next_handle = 1
        self._outcomes: dict[str, bool] = {}  # recent request outcomes (for in-jit waits)
        self._released: dict[str, bool] = {}  # producer: recently freed requests (confirmed?)
        self._progress_interval_s = progress_interval_s
        # The consumer's Done rides on its READ as the notification (True), or is sent on its
        # own once the READs completed (False). Measured (benchmarks/RESULTS.md, small
        # requests): landed equal, confirmed ~1.5x faster riding on the READ.
        self._attach_done = True
        self._progress_thread: threading.Thread | None = None
        if progress_interval_s is not None:
            if progress_interval_s <= 0:
                raise ValueError(f"progress_interval_s must be > 0, got {progress_interval_s}")
            self._progress_thread = threading.Thread(
                target=self._progress_loop, name=f"jaxkv-progress-{engine_id}", daemon=True
            )
            self._progress_thread.start()

    # -- registration ---------------------------------------------------------------------

    @property
    def address(self) -> tuple[str, int]:
        return self.server.address

    @property
    def metadata(self) -> EngineMetadata:
        if self._meta is None:
            raise RuntimeError("register_cache first")
        return self._meta

    @property
    def local_ranks(self) -> tuple[int, ...]:
        return tuple(sorted(self._ranks))

    def register_cache(self, cache: Any, pp_rank: int = 0, tp_rank: int | None = None) -> None:
        """Registers every shard of a `PagedKVCache` and publishes the metadata.

        Args:
          cache: the cache of pipeline rank `pp_rank`; either sharded over all TP ranks of the
            engine (one device per TP rank), or one TP rank's cache (``tp_rank`` given, its
            spec holding that rank's heads).
          pp_rank: the pipeline rank the cache belongs to.
          tp_rank: the TP rank of a one-rank cache.

        Raises:
          ValueError: the cache does not match the engine config (nothing is registered).
        """
        with self._lock:
            self._register_cache(cache, pp_rank, tp_rank)

    def _register_cache(self, cache: Any, pp_rank: int, tp_rank: int | None) -> None:
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
        replaced = [e for e in self._caches if set(e.ranks) & set(per_rank)]
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
            new_ranks[rank] = RankInfo(rank=rank, agent_name=self.agent.name, regions=regions)
        regs = [
            (r.base_address, r.block_len * r.num_blocks, r.device_id, r.memory_kind)
            for info in new_ranks.values()
            for r in info.regions
        ]
        old_regs = [
            (r.base_address, r.block_len * r.num_blocks, r.device_id, r.memory_kind)
            for entry in replaced
            for rank in entry.ranks
            for r in self._ranks[rank].regions
        ]
        self.agent.register(regs)  # first: buffers kept in place keep their registration
        self.agent.deregister(old_regs)
        self._caches = [e for e in self._caches if e not in replaced]
        self._ranks.update(new_ranks)
        l0, l1 = config.layer_range(pp_rank)
        entry = _Registered(cache, buffers, tuple(sorted(new_ranks)), mirror, l0, l1)
        self._caches.append(entry)
        for rank in new_ranks:
            self._rank_cache[rank] = entry
        if self._meta is not None:
            # The regions changed: peers holding the old metadata must not read them. They
            # see the new generation in new requests' params (and re-handshake), and reads
            # planned against the old one are refused at confirmation (`Ack.stale`).
            self.generation = (self.generation + 1) & ((1 << 62) - 1)
        self._publish()

    def check_registrations(self, cache: Any) -> None:
        """Raises `BufferMovedError` if a registered shard of `cache` moved (call after updates
        that should have been in place); re-register with `register_cache` after fixing."""
        entry = self._entry_of(cache)
        if entry is not None:
            cache.verify_unmoved(entry.buffers)

    def _entry_of(self, cache: Any) -> _Registered | None:
        current = cache.shard_buffers()
        keys = {(b.array_index, b.device.id) for b in current}
        for entry in self._caches:
            if entry.cache is cache:
                return entry
        for entry in self._caches:
            if {(b.array_index, b.device.id) for b in entry.buffers} == keys:
                return entry
        return None

    def update_cache(self, cache: Any) -> None:
        """Makes `cache` the current version of a registered cache (after the caller updated
        it with donated, in-place operations: `cache = step(cache)`). Post-processing of
        received blocks acts on the current version.

        Raises:
          BufferMovedError: a buffer is not where it was registered (re-register).
          ValueError: no registered cache has these arrays and devices.
        """
        # Wait outside the lock: the step that produced `cache` may be blocked in a host
        # callback that needs the lock (publish_in_jit / wait_in_jit).
        cache.block_until_ready()
        with self._lock:
            entry = self._entry_of(cache)
            if entry is None:
                raise ValueError("update_cache: no registered cache has these arrays and devices")
            cache.verify_unmoved(entry.buffers)
            if cache is not entry.cache:
                entry.cache = cache
                entry.version += 1
            self._stage_deferred()

    @property
    def caches(self) -> tuple[Any, ...]:
        """The registered caches, current versions (post-processing updates them)."""
        return tuple(entry.cache for entry in self._caches)

    def _publish(self) -> None:
        agents = [AgentInfo(name=self.agent.name, metadata=self.agent.metadata())]
        self._meta = engine_metadata(
            self.engine_id,
            self.config,
            list(self._ranks.values()),
            agents,
            self.generation,
            self.block_hashing,
        )
        self.server.publish(self._meta)

    # -- handshake ------------------------------------------------------------------------

    def add_peer(self, engine_id: str, addresses: Sequence[tuple[str, int]]) -> EngineMetadata:
        """Fetches (or re-fetches) a peer engine's metadata from all of its processes, checks
        compatibility and loads its agents (the explicit warm-up; `start_read` does it lazily).

        Raises:
          HandshakeError, IncompatibleEngineError: nothing is loaded then.
        """
        metas: list[EngineMetadata] = []
        try:
            for address in addresses:
                metas.append(
                    fetch_metadata(
                        _address(address),
                        engine_id,
                        self.handshake_timeout_s,
                        self.handshake_retries,
                    )
                )
            merged = _merge(metas)
            check_compatible(self.metadata, merged)
        except (HandshakeError, IncompatibleEngineError, MetadataError):
            self.stats.failed_handshakes += 1
            raise
        old = self._peers.pop(engine_id, None)
        if old is not None:
            for name in old.agents.values():
                self.agent.remove_remote(name)
                self._hello_sent.discard(name)
        agents = {a.name: self.agent.add_remote(a.metadata) for a in merged.agents}
        for name in agents.values():
            self.agent.connect(name)
        generations = {a.name: m.generation for m in metas for a in m.agents}
        self._peers[engine_id] = _Peer(
            merged, tuple(_address(a) for a in addresses), agents, generations
        )
        hello = encode_message(
            Hello(self.engine_id, self.generation, self.agent.name, self.agent.metadata())
        )
        for name in agents.values():
            if self.agent.send(name, hello):
                self._hello_sent.add(name)
            else:
                self.stats.failed_notifications += 1
        return merged

    def _peer(self, engine_id: str, addresses, generation: int = -1) -> _Peer:
        peer = self._peers.get(engine_id)
        if (
            peer is None
            or peer.stale
            or (generation >= 0 and generation not in peer.generations.values())
        ):
            self.add_peer(engine_id, addresses)
            peer = self._peers[engine_id]
        return peer

    # -- producer -------------------------------------------------------------------------

    def publish_request(
        self,
        request_id: str,
        block_ids: Sequence[int],
        lease_s: float | None = None,
        *,
        layerwise: bool = False,
        expected_reads: int = 1,
    ) -> TransferParams:
        """Pins a request's blocks until every consumer rank notified or the lease expired.

        Args:
          request_id: the request.
          block_ids: its blocks on this engine, in token order.
          lease_s: the lease (default: the engine's `lease_s`).
          layerwise: the blocks are not written yet: consumers read each layer once
            `publish_layers` announced it (the request's params say so). Otherwise the blocks
            are readable now (host staging copies them to the mirror before returning).
          expected_reads: how many consumer reads (distinct read ids, `start_read`'s
            ``read_id``) must finish before the blocks are freeable; the lease bounds the
            wait for those that never come.

        Returns:
          The `TransferParams` to hand to the consumer.

        Example:
          >>> params = engine.publish_request("req-1", [3, 4, 5])  # doctest: +SKIP
        """
        lease = self.lease_s if lease_s is None else lease_s
        ids = tuple(int(b) for b in block_ids)
        if int(expected_reads) < 1:
            raise ValueError(f"expected_reads must be >= 1, got {expected_reads}")
        with self._lock:
            pinned = _Pinned(
                ids,
                time.monotonic() + lease,
                {r: {} for r in self._ranks},
                {},
                lease,
                int(expected_reads),
            )
            self._pinned[request_id] = pinned
            self._released.pop(request_id, None)
            early = self._early_wants.pop(request_id, None)
            if early is not None:
                pinned.subscribers |= early[0]
            if not layerwise:
                self._publish_layers(request_id, pinned, self.config.spec.num_layers)
            for message, _ in self._early_dones.pop(request_id, []):
                # Held reads: the blocks held the request's bytes already (direct mode);
                # confirmed (or refused) now that the request is pinned.
                self._on_done(message)
        return TransferParams(
            self.engine_id,
            [_address(self.address)],
            request_id,
            list(ids),
            lease,
            self.generation,
            layerwise,
        )

    def publish_layers(self, request_id: str, layer_stop: int | None = None) -> None:
        """Declares the global layers ``[0, layer_stop)`` of a layer-wise request written.

        Call it as prefill finishes each layer (or group of layers); consumers read the newly
        ready layers at once. Only increasing values have an effect. With host staging the
        new layers' bytes are copied to the host mirror first (from the current registered
        cache: pass updated caches to `update_cache`).

        Args:
          request_id: a request published with ``layerwise=True``.
          layer_stop: one past the last written layer (None: every layer).

        Raises:
          KeyError: the request is not pinned (never published, freed or expired).
          ValueError: `layer_stop` is outside ``[0, num_layers]``.

        Example:
          >>> for layer in range(num_layers):  # doctest: +SKIP
          ...     cache = prefill_layer(cache, layer)
          ...     engine.publish_layers("req-1", layer + 1)
        """
        num_layers = self.config.spec.num_layers
        stop = num_layers if layer_stop is None else int(layer_stop)
        if not 0 <= stop <= num_layers:
            raise ValueError(f"layer_stop {stop} is outside [0, {num_layers}]")
        with self._lock:
            pinned = self._pinned.get(request_id)
            if pinned is None:
                raise KeyError(f"request {request_id!r} is not pinned")
            self._publish_layers(request_id, pinned, stop)

    def _publish_layers(self, request_id: str, pinned: _Pinned, stop: int) -> None:
        start = pinned.layer_stop
        if stop <= start:
            return
        t0 = time.perf_counter()
        for entry in self._caches:
            if entry.mirror is None:
                continue
            lo, hi = max(start, entry.layer_start), min(stop, entry.layer_stop)
            if lo >= hi:
                continue
            layers = (lo - entry.layer_start, hi - entry.layer_start)
            whole = layers == (0, entry.layer_stop - entry.layer_start)
            entry.mirror.stage_out(entry.cache, pinned.block_ids, None if whole else layers)
        pinned.staged_s += time.perf_counter() - t0
        pinned.layer_stop = stop
        pinned.published_at.append((stop, time.time()))
        if stop == self.config.spec.num_layers:
            self.stats.add_publication(
                PublishRecord(request_id, tuple(pinned.published_at), pinned.staged_s)
            )
        message = encode_message(Ready(request_id, list(self.local_ranks), stop))
        for target in pinned.subscribers:
            if not self.agent.send(target, message):
                self.stats.failed_notifications += 1

    def handle(self, request_id: str) -> int:
        """A small positive int naming `request_id` inside jitted code (host callbacks carry
        ids, not strings); stable while the engine remembers the request.

        Example:
          >>> h = engine.handle("req-1")  # doctest: +SKIP
        """
        with self._lock:
            handle = self._handle_of.get(request_id)
            if handle is None:
                handle = self._next_handle
                self._next_handle = self._next_handle % ((1 << 31) - 2) + 1
                old = self._handles.pop(handle, None)
                if old is not None:
                    self._handle_of.pop(old, None)
                self._handles[handle] = request_id
                self._handle_of[request_id] = handle
                while len(self._handles) > _MAX_HANDLES:
                    oldest = next(iter(self._handles))
                    self._handle_of.pop(self._handles.pop(oldest), None)
            return handle

    def request_of(self, handle: int) -> str:
        """The request id of a `handle` (KeyError if unknown)."""
        with self._lock:
            return self._handles[int(handle)]

    def abort_request(self, request_id: str) -> None:
        """Producer: releases a request's blocks now (reported by the next `poll` as freeable);
        consumers still reading get their confirmation refused. Consumer: stops the read of
        that read id (`start_read`'s ``read_id``) and reports it failed."""
        with self._lock:
            if request_id in self._pinned:
                self._pinned[request_id].deadline = -1.0
            reading = self._reading.get(request_id)
            if reading is not None and reading.error is None:
                reading.error = "aborted"

    @property
    def num_pinned(self) -> int:
        return len(self._pinned)

    @property
    def num_reading(self) -> int:
        return len(self._reading)

    # -- consumer -------------------------------------------------------------------------

    def start_read(
        self,
        params: TransferParams,
        local_block_ids: Sequence[int],
        timeout_s: float | None = None,
        *,
        read_id: str | None = None,
    ) -> None:
        """Plans and posts the reads of a request for every local rank; returns at once.

        A layer-wise request (``params.layerwise``) subscribes to the producer's
        announcements; each layer's reads are posted when its producer rank announced it.

        Args:
          params: the producer's `TransferParams`.
          local_block_ids: the local blocks to fill, in token order.
          timeout_s: deadline of the reads plus confirmations (default `read_timeout_s`).
          read_id: this read's key, e.g. the consumer's own request id (default: the
            producer's request id): `poll` reports it, `abort_request` and `handle` take it.
            Several consumer requests may read one producer request at once under distinct
            read ids (every process of the consumer engine must use the same one); the
            producer frees it after ``expected_reads`` of them (`publish_request`).

        Failures (handshake, planning, posting) are reported by `poll` as failed requests;
        a read id already in flight raises ValueError.

        Example:
          >>> engine.start_read(params, [7, 8], read_id="decode-req-3")  # doctest: +SKIP
        """
        with self._lock:
            self._start_read(params, local_block_ids, timeout_s, read_id)

    def _start_read(
        self,
        params: TransferParams,
        local_block_ids: Sequence[int],
        timeout_s: float | None,
        read_id: str | None = None,
    ) -> None:
        request_id = params.request_id
        key = request_id if read_id is None else read_id
        if not isinstance(key, str) or not 0 < len(key) <= 512:
            raise ValueError(f"read_id must be a str of 1 to 512 characters, got {read_id!r}")
        if key in self._reading:
            raise ValueError(f"read {key!r} is already in flight")
        now = time.monotonic()
        timeout = self.read_timeout_s if timeout_s is None else timeout_s
        state = _Reading(
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
        self._reading[key] = state
        self._by_attempt[state.attempt] = state
        self._outcomes.pop(key, None)
        local_ids = np.asarray(local_block_ids, dtype=np.int64).reshape(-1)
        state.local_block_ids = tuple(int(b) for b in local_ids)
        try:
            peer = self._peer(params.engine_id, params.addresses, params.generation)
            state.generations = {
                info.rank: peer.generations.get(info.agent_name, -1) for info in peer.meta.ranks
            }
            for rank in self.local_ranks:
                plan = plan_read(
                    self.metadata, rank, peer.meta, local_ids, params.block_ids, check=False
                )
                state.plans.append(plan)
            state.needs_jax = len(local_ids) > 0 and (
                any(p.post for p in state.plans)
                or any(self._rank_cache[p.local_rank].mirror is not None for p in state.plans)
            )
            if state.layerwise:
                self._plan_layers(state, peer, local_ids, params.block_ids)
                want = encode_message(Want(request_id, self.agent.name))
                for name in peer.agents.values():
                    if not self.agent.send(name, want):
                        raise ConnectionError(f"could not subscribe to producer agent {name!r}")
                return
            for plan in state.plans:
                for remote_rank in plan.read_ranks:
                    info = peer.meta.rank_info(remote_rank)
                    name = peer.agents[info.agent_name]
                    kind = self._ranks[plan.local_rank].regions[0].memory_kind
                    remote_kind = info.regions[0].memory_kind
                    # The Done of this (local, remote) rank pair rides on the READ: NIXL
                    # delivers it once the READ completed, so the producer's Ack is not
                    # delayed by this process noticing the completion first (the background
                    # progress thread keeps the producer answering while it computes).
                    done = b""
                    if self._attach_done:
                        done = self._done_message(state, plan.local_rank, remote_rank, ok=True)
                    handle = self.agent.read_plan(
                        plan, self.metadata, peer.meta, remote_rank, name, kind, remote_kind, done
                    )
                    state.handles.append((name, handle))
                    if done:
                        state.attached.add((plan.local_rank, remote_rank))
        except (
            HandshakeError,
            IncompatibleEngineError,
            MetadataError,
            PlanError,
            ConnectionError,
            KeyError,
        ) as error:
            state.error = f"{type(error).__name__}: {error}"

    def _plan_layers(self, state: _Reading, peer: _Peer, local_ids: np.ndarray, remote_ids) -> None:
        """Per (global layer, remote rank): the descriptors, posted once announced."""
        layers: set[int] = set()
        for plan in state.plans:
            entry = self._rank_cache[plan.local_rank]
            kind = self._ranks[plan.local_rank].regions[0].memory_kind
            for layer in range(entry.layer_start, entry.layer_stop):
                layers.add(layer)
                if not len(local_ids):
                    continue
                sub = plan_read(
                    self.metadata,
                    plan.local_rank,
                    peer.meta,
                    local_ids,
                    remote_ids,
                    check=False,
                    layers=(layer, layer + 1),
                )
                for remote_rank in sub.read_ranks:
                    loc, rem = sub.expanded_descriptors(self.metadata, peer.meta, remote_rank)
                    info = peer.meta.rank_info(remote_rank)
                    name = peer.agents[info.agent_name]
                    state.pending.append(
                        (layer, remote_rank, name, loc, rem, kind, info.regions[0].memory_kind)
                    )
        state.layers_total = tuple(sorted(layers))
        for layer in state.layers_total:
            state.layer_handles[layer] = []

    def _post_ready(self, state: _Reading) -> None:
        """Posts the pending layer reads whose producer rank announced the layer."""
        still = []
        for item in state.pending:
            layer, remote_rank, name, loc, rem, kind, remote_kind = item
            if state.ready.get(remote_rank, 0) > layer:
                handle = self.agent.read(loc, rem, name, kind, remote_kind)
                state.handles.append((name, handle))
                state.layer_handles[layer].append(handle)
            else:
                still.append(item)
        state.pending = still

    def _layers_arrived(self, state: _Reading, result: PollResult) -> bool:
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
            states = [self.agent.state(h) for h in handles]
            if "ERR" in states:
                state.error = f"a NIXL READ of layer {layer} failed"
                self._suspect(state.peer)
                return False
            if all(st == "DONE" for st in states):
                state.layer_arrival[layer] = time.time()
                changed = True
        if changed:
            result.layers[state.read_id] = len(state.layer_arrival)
        return len(state.layer_arrival) == len(state.layers_total)

    def _source_ranks_of(self, state: _Reading, layer: int) -> list[int]:
        peer = self._peers.get(state.peer)
        if peer is None:
            return []
        config = peer.meta.config()
        pp = config.layer_owner(layer)
        return [config.rank(tp, pp) for tp in range(config.tp_size)]

    # -- polling --------------------------------------------------------------------------

    def poll(self) -> PollResult:
        """Makes progress on everything in flight; returns what changed since the last poll."""
        with self._lock:
            self._stage_deferred()
            result, self._stashed = self._stashed, PollResult()
            result.extend(self._poll(allow_jax=True))
            return result

    def _stage_deferred(self) -> None:
        """Stages the publications of host callbacks (host staging) once every registered
        cache was replaced by a later version than the one of the callback's step: the
        callback ran inside the step, whose input cache is donated (deleted) and whose
        output is handed over by `update_cache` after the step."""
        still = []
        for request_id, stop, versions in self._deferred:
            pinned = self._pinned.get(request_id)
            if pinned is None:
                continue  # freed or expired meanwhile
            current = all(
                e.mirror is None
                or (e.version > v and not any(a.is_deleted() for a in e.cache.arrays))
                for e, v in zip(self._caches, versions)
            )
            if not current or len(versions) != len(self._caches):
                if len(versions) == len(self._caches):
                    still.append((request_id, stop, versions))
                    continue
                _log.error("publishing %s failed: the caches were re-registered", request_id)
                pinned.deadline = -1.0
                continue
            try:
                self._publish_layers(request_id, pinned, stop)
            except Exception as error:  # noqa: BLE001 - the request is aborted
                _log.error("publishing %s failed: %s", request_id, error)
                pinned.deadline = -1.0
        self._deferred = still

    def _poll(self, allow_jax: bool) -> PollResult:
        result = PollResult()
        now = time.monotonic()
        self._handle_messages(now)
        for request_id in list(self._reading):
            state = self._reading[request_id]
            if state.needs_jax and not allow_jax and state.error is None and now <= state.deadline:
                continue  # its rewrite runs JAX: left to the next `poll` outside callbacks
            self._progress_read(state, now, result)
        for request_id, (_, expiry) in list(self._early_wants.items()):
            if now > expiry:
                del self._early_wants[request_id]
        for request_id, held in list(self._early_dones.items()):
            keep = [(m, expiry) for m, expiry in held if now <= expiry]
            for message, expiry in held:
                if now > expiry:
                    self._on_done(message, hold=False)  # refused: never published in time
            if keep:
                self._early_dones[request_id] = keep
            else:
                del self._early_dones[request_id]
        for request_id, pinned in list(self._pinned.items()):
            complete = all(
                sum(
                    len(ranks) >= pinned.expected[read]
                    for read, ranks in pinned.notified[r].items()
                )
                >= pinned.expected_reads
                for r in pinned.notified
            )
            if complete or now > pinned.deadline:
                if not complete and pinned.deadline >= 0:
                    self.stats.expired_leases += 1
                del self._pinned[request_id]
                self._released[request_id] = complete
                while len(self._released) > _MAX_OUTCOMES:
                    del self._released[next(iter(self._released))]
                result.freeable.append(request_id)
        self.agent.progress()  # push what this poll sent, even if the caller goes idle
        return result

    def _handle_messages(self, now: float) -> None:
        for sender, messages in self.agent.notifications().items():
            for payload in messages:
                try:
                    message = decode_message(payload)
                except ValueError:
                    self.stats.malformed_messages += 1
                    continue
                if isinstance(message, Hello):
                    old = self._consumers.pop(message.agent_name, None)
                    if old is not None:
                        self.agent.remove_remote(old)
                    try:
                        self._consumers[message.agent_name] = self.agent.add_remote(
                            message.agent_metadata
                        )
                    except Exception:  # noqa: BLE001 - bad metadata from a peer
                        self.stats.malformed_messages += 1
                elif isinstance(message, Heartbeat):
                    pinned = self._pinned.get(message.request_id)
                    if pinned is not None and now <= pinned.deadline:  # not after expiry
                        pinned.deadline = max(pinned.deadline, now + pinned.lease_s)
                elif isinstance(message, Done):
                    self._on_done(message)
                elif isinstance(message, Ack):
                    # May come before this process saw its READs complete (Done attached).
                    reading = self._by_attempt.get(message.attempt)
                    if reading is not None and message.request_id == reading.request_id:
                        reading.acks[(message.producer_rank, message.consumer_rank)] = (
                            message.pinned
                        )
                        if message.stale:
                            reading.stale = True
                            self._suspect(reading.peer)
                        reading.unpublished |= message.unpublished
                elif isinstance(message, Want):
                    self._on_want(message, now)
                elif isinstance(message, Ready):
                    for reading in self._reading.values():
                        if reading.request_id != message.request_id:
                            continue
                        for rank in message.ranks:
                            reading.ready[rank] = max(reading.ready.get(rank, 0),
                                                      message.layer_stop)
            del sender

    def _on_want(self, message: Want, now: float) -> None:
        target = self._consumers.get(message.agent_name)
        if target is None:
            self.stats.failed_notifications += 1
            return
        pinned = self._pinned.get(message.request_id)
        if pinned is None:  # subscribed before this process published: remember for a lease
            targets, _ = self._early_wants.get(message.request_id, (set(), 0.0))
            targets.add(target)
            self._early_wants[message.request_id] = (targets, now + self.lease_s)
            return
        pinned.subscribers.add(target)
        if pinned.layer_stop > 0:
            ready = Ready(message.request_id, list(self.local_ranks), pinned.layer_stop)
            if not self.agent.send(target, encode_message(ready)):
                self.stats.failed_notifications += 1

    def _on_done(self, message: Done, hold: bool = True) -> None:
        pinned = self._pinned.get(message.request_id)
        stale = message.generation != self.generation
        if hold and self._holds_early(message, pinned, stale):
            held = self._early_dones.setdefault(message.request_id, [])
            held.append((message, time.monotonic() + self.early_read_grace_s))
            return
        live = (
            not stale
            and pinned is not None
            and pinned.deadline >= 0
            and time.monotonic() <= pinned.deadline
            and message.producer_rank in pinned.notified
        )
        if live:
            assert pinned is not None  # implied by `live`
            read = (message.engine_id, message.read_id or message.request_id)
            pinned.notified[message.producer_rank].setdefault(read, set()).add(
                message.consumer_rank
            )
            pinned.expected[read] = message.expected
        target = self._consumers.get(message.agent_name)
        ack = encode_message(
            Ack(
                message.request_id,
                message.producer_rank,
                message.consumer_rank,
                live,
                message.attempt,
                stale,
                pinned is None and message.request_id not in self._released,
            )
        )
        if target is None or not self.agent.send(target, ack):
            self.stats.failed_notifications += 1

    def _holds_early(self, message: Done, pinned: _Pinned | None, stale: bool) -> bool:
        """Whether a Done is for a request this process has not published yet and may still
        publish: a successful read of a rank of this process, in direct mode, within the
        grace window's bounds (the number of held requests is bounded too)."""
        return (
            pinned is None
            and message.ok
            and not stale
            and self.early_read_grace_s > 0
            and message.request_id not in self._released
            and message.producer_rank in self._ranks
            and all(entry.mirror is None for entry in self._caches)
            and (
                message.request_id in self._early_dones
                or len(self._early_dones) < _MAX_OUTCOMES
            )
        )

    def _progress_read(self, state: _Reading, now: float, result: PollResult) -> None:
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
                state.done_at = time.monotonic()
                self._send_done(state, ok=True)
                self._post_process(state)
        elif state.error is None and state.done_at is None:
            states = [self.agent.state(h) for _, h in state.handles]
            if "ERR" in states:
                state.error = "a NIXL READ failed"
                self._suspect(state.peer)
            elif all(s == "DONE" for s in states):
                state.done_at = time.monotonic()
                self._send_done(state, ok=True)
                # Overlaps the producer's acknowledgement round trip.
                self._post_process(state)
        if (
            state.error is None
            and state.done_at is not None
            and (len(state.acks) >= state.expected_acks)
        ):
            if all(state.acks.values()):
                self._finish(state, result)
                return
            state.error = (
                "the producer re-registered its cache after this read was planned (stale "
                "metadata: the next read fetches it again)"
                if state.stale
                else "the producer did not publish the request (within its early_read_grace_s)"
                if state.unpublished
                else "the producer released the blocks before the read was confirmed"
            )
        if state.error is not None:
            self._fail(state, result)
            return
        if now >= state.next_heartbeat:
            self._heartbeat(state, now)

    def _suspect(self, engine_id: str) -> None:
        """The peer's metadata may be stale (a READ failed, a producer answered `stale`):
        the next read fetches it again."""
        peer = self._peers.get(engine_id)
        if peer is not None:
            peer.stale = True

    def _post_process(self, state: _Reading) -> None:
        """Rewrites the received blocks that arrived in the sender's arrangement, in place,
        in every registered cache they belong to; any failure fails the request."""
        per_entry: dict[int, tuple[_Registered, list[PostProcess], set[int]]] = {}
        for plan in state.plans:
            entry = self._rank_cache[plan.local_rank]
            _, steps, ranks = per_entry.setdefault(id(entry), (entry, [], set()))
            ranks.add(plan.local_rank)
            steps.extend(plan.post)
        if not state.needs_jax:
            return
        start = time.perf_counter()
        try:
            for entry, steps, ranks in per_entry.values():
                if entry.mirror is not None and state.local_block_ids:
                    self._check_current(entry)
                    updated = entry.mirror.stage_in(entry.cache, state.local_block_ids)
                    updated.verify_unmoved(entry.buffers)
                    entry.cache.arrays = updated.arrays
                if not steps:
                    continue
                by_rank = {
                    r: group_post_steps(s for p in state.plans if p.local_rank == r for s in p.post)
                    for r in ranks
                }
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
                self._check_current(entry)
                updated = apply_post_processing(cache, steps)
                updated.verify_unmoved(entry.buffers)
                # Keep the caller's object current: its donated arrays are replaced by the
                # results, which live in the same (registered) buffers.
                cache.arrays = updated.arrays
        except Exception as error:  # noqa: BLE001 - reported as a failed request
            _log.error("post-processing of %s failed: %s", state.request_id, error)
            state.error = f"post-processing failed: {type(error).__name__}: {error}"
        state.post_s = time.perf_counter() - start

    @staticmethod
    def _check_current(entry: _Registered) -> None:
        if any(a.is_deleted() for a in entry.cache.arrays):
            raise ValueError(
                "the registered cache was consumed by another update: pass the current "
                "cache to update_cache() after each donated update"
            )

    def _heartbeat(self, state: _Reading, now: float) -> None:
        peer = self._peers.get(state.peer)
        state.next_heartbeat = now + state.lease_s / 3
        if peer is None:
            return
        message = encode_message(Heartbeat(state.request_id, self.engine_id))
        for name in peer.agents.values():
            if not self.agent.send(name, message):
                self.stats.failed_notifications += 1

    def _done_message(
        self, state: _Reading, local_rank: int, remote_rank: int, ok: bool
    ) -> bytes:
        return encode_message(
            Done(
                state.request_id,
                self.engine_id,
                self.agent.name,
                local_rank,
                remote_rank,
                self.config.world_size,
                ok,
                state.attempt,
                state.generations.get(remote_rank, -1),
                "" if state.read_id == state.request_id else state.read_id,
            )
        )

    def _send_done(self, state: _Reading, ok: bool) -> None:
        """Every consumer rank notifies every producer rank (those whose Done went with
        their READ, on success, are only counted)."""
        peer = self._peers.get(state.peer)
        if peer is None:
            return
        state.expected_acks = 0
        for local_rank in self.local_ranks:
            for remote_rank in range(peer.meta.world_size):
                if ok and (local_rank, remote_rank) in state.attached:
                    state.expected_acks += 1
                    continue
                info = peer.meta.rank_info(remote_rank)
                name = peer.agents[info.agent_name]
                message = self._done_message(state, local_rank, remote_rank, ok)
                if self.agent.send(name, message):
                    state.expected_acks += 1
                else:
                    self.stats.failed_notifications += 1
                    if ok:
                        state.error = f"could not notify producer rank {remote_rank}"

    def _release_handles(self, state: _Reading) -> bool:
        clean = True
        for _, handle in state.handles:
            clean &= self.agent.release(handle)
        state.handles = []
        return clean

    def _finish(self, state: _Reading, result: PollResult) -> None:
        self._release_handles(state)
        del self._reading[state.read_id]
        self._by_attempt.pop(state.attempt, None)
        plans = state.plans
        self.stats.add(
            TransferRecord(
                request_id=state.read_id,
                bytes=sum(p.num_bytes for p in plans),
                descriptors=sum(p.num_descriptors for p in plans),
                expanded_descriptors=sum(int(p.copies[:, 6].sum()) for p in plans),
                duration_s=(state.done_at or time.monotonic()) - state.started,
                # READs complete -> confirmed, less the post-processing done meanwhile
                confirm_s=max(
                    0.0, time.monotonic() - (state.done_at or time.monotonic()) - state.post_s
                ),
                post_s=state.post_s,
                layer_arrival=tuple(sorted(state.layer_arrival.items())),
                started_at=state.started_wall,
            )
        )
        self._remember(state.read_id, True)
        result.finished.append(state.read_id)
        posts = [step for p in plans for step in p.post]
        if posts:
            result.post_applied[state.read_id] = posts

    def _fail(self, state: _Reading, result: PollResult) -> None:
        # Release (cancel) the READs first: releasing a handle may cancel messages queued
        # behind it on the endpoint.
        self._release_handles(state)
        if state.done_at is None:
            self._send_done(state, ok=False)  # lets the producer free early
        del self._reading[state.read_id]
        self._by_attempt.pop(state.attempt, None)
        self.stats.failed_transfers += 1
        invalid = sorted({int(b) for b in state.local_block_ids})
        self._remember(state.read_id, False)
        result.failed.append(FailedRead(state.read_id, state.error or "failed", tuple(invalid)))

    def _remember(self, request_id: str, ok: bool) -> None:
        self._outcomes[request_id] = ok
        while len(self._outcomes) > _MAX_OUTCOMES:
            del self._outcomes[next(iter(self._outcomes))]

    # -- host callbacks (jaxkv.transfer._jit) ---------------------------------------------

    def _callback_publish(self, handle: int, block_ids: np.ndarray, layer_stop: int) -> int:
        """From a jitted step's host callback: publish (or mark written) a request's layers
        ``[0, layer_stop)``. Returns 1, or 0 when refused (logged). Never runs JAX: with
        host staging the copy to the mirror is left to the first `poll` (or `update_cache`)
        after the step's output was handed to `update_cache`."""
        ids = [int(b) for b in np.asarray(block_ids).reshape(-1) if b >= 0]
        num_layers = self.config.spec.num_layers
        stop = num_layers if layer_stop < 0 else min(int(layer_stop), num_layers)
        if not self._lock.acquire(timeout=self.read_timeout_s):
            _log.error("publish from a jitted step: the engine stayed busy")
            return 0
        try:
            request_id = self._handles.get(int(handle))
            if request_id is None:
                _log.error("publish from a jitted step: unknown handle %d", handle)
                return 0
            # Subscriptions (Want) that arrived since the last poll: the announcement must
            # reach consumers that subscribed while the step ran.
            self._handle_messages(time.monotonic())
            pinned = self._pinned.get(request_id)
            if pinned is None:
                if self._released.get(request_id):
                    # Every consumer confirmed it already (it read the layers announced
                    # before): a late announcement of a finished request is no error.
                    _log.debug("publish from a jitted step: %s already confirmed", request_id)
                    return 1
                _log.error("publish from a jitted step: %s is not published", request_id)
                return 0
            if ids and tuple(ids) != pinned.block_ids:
                _log.error(
                    "publish from a jitted step: %s wrote blocks %s, it was published with %s",
                    request_id, ids, list(pinned.block_ids),
                )
                pinned.deadline = -1.0
                return 0
            if any(entry.mirror is not None for entry in self._caches):
                # The step's output is not available here: staged from it once the caller
                # hands it to update_cache (never from the donated input, see _stage_deferred).
                self._deferred.append((request_id, stop, tuple(e.version for e in self._caches)))
            else:
                self._publish_layers(request_id, pinned, stop)
            self.agent.progress()
            return 1
        finally:
            self._lock.release()

    def _callback_wait(self, handle: int, timeout_s: float) -> int:
        """From a jitted step's host callback: wait until a request finished (1), failed (0),
        the wait timed out (-1) or the request needs JAX work outside the callback (-2:
        post-processing or host staging; `poll` outside jit instead). Polls the engine
        itself (no JAX), stashing what it finds for the next `poll`."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self._lock.acquire(timeout=max(0.0, min(0.05, deadline - time.monotonic()))):
                try:
                    request_id = self._handles.get(int(handle))
                    if request_id is None:
                        return 0
                    outcome = self._outcomes.get(request_id)
                    if outcome is not None:
                        return 1 if outcome else 0
                    state = self._reading.get(request_id)
                    if state is None:
                        return 0
                    if state.needs_jax:
                        return -2
                    self._stashed.extend(self._poll(allow_jax=False))
                    outcome = self._outcomes.get(request_id)
                    if outcome is not None:
                        return 1 if outcome else 0
                finally:
                    self._lock.release()
            if time.monotonic() >= deadline:
                return -1
            time.sleep(0.0002)

    # -- background progress --------------------------------------------------------------

    def _progress_loop(self) -> None:
        """While something is in flight, polls the engine (without JAX; what it finds is
        reported by the caller's next `poll`), never waiting for it: when the caller holds
        it (a poll, a callback), that makes progress anyway. Completions, confirmations and
        acknowledgements so move while the caller computes between polls."""
        interval = float(self._progress_interval_s or 0.001)
        while not self._closed:
            if not (self._pinned or self._reading or self._early_dones):
                time.sleep(max(interval, 0.01))
                continue
            if self._lock.acquire(blocking=False):
                try:
                    if not self._closed:
                        # No JAX here: reads that need it are left to the caller's poll.
                        self._stashed.extend(self._poll(allow_jax=False))
                except Exception as error:  # noqa: BLE001 - the next poll reports failures
                    _log.debug("background progress: %s", error)
                finally:
                    self._lock.release()
            time.sleep(interval)

    # -- shutdown -------------------------------------------------------------------------

    def close(self) -> None:
        """Releases handles, registrations, peers and the side channel (idempotent)."""
        if self._closed:
            return
        self._closed = True
        locked = self._lock.acquire(timeout=self.read_timeout_s)
        try:
            for state in self._reading.values():
                self._release_handles(state)
            self._reading.clear()
            self._by_attempt.clear()
            self._pinned.clear()
            self._early_dones.clear()
            self.server.close()
            self.agent.close()
            self._caches.clear()
        finally:
            if locked:
                self._lock.release()
        if self._progress_thread is not None:
            self._progress_thread.join(timeout=1.0)

    def __enter__(self) -> KVTransferEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _address(address: Sequence[Any]) -> tuple[str, int]:
    """A ``(host, port)`` address as a tuple (decoded messages carry it as a list)."""
    return cast(tuple[str, int], tuple(address))


def _merge(metas: list[EngineMetadata]) -> EngineMetadata:
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
