"""`KVTransferEngine`: one process's side of KV-block transfers between engines.

One transport endpoint per process (a NIXL agent with the default transport); it may hold
several ranks of an engine (TP ranks as devices of one process) or one (a process per rank).
Both roles live in the same object:

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

Structure: this facade composes the roles and layers of `jaxkv.transfer`: `CacheRegistry`
(registered caches, metadata), `Producer` and `Consumer` (the roles, driving the request state
machines of `jaxkv.transfer._protocol`), a `Transport` that moves the bytes (``"nixl"``;
``"jax"`` for `jax.experimental.transfer`) and the control channels that carry the messages.

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

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jaxkv._context import no_context_mesh
from jaxkv._parallel import EngineConfig
from jaxkv.transfer._agent import AgentOptions, NixlAgent, nixl_available
from jaxkv.transfer._auth import DeploymentKey, check_exposure, load_auth_key
from jaxkv.transfer._consumer import Consumer, Reading
from jaxkv.transfer._control import TcpControlChannel
from jaxkv.transfer._digest import DigestOptions
from jaxkv.transfer._formatted import DEFAULT_POOL_BYTES, FORMATTED_MODES
from jaxkv.transfer._jit import HandleTable, steps_hold_buffers
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
    decode_message,
)
from jaxkv.transfer._metadata import EngineMetadata
from jaxkv.transfer._params import (
    FailedRead,
    PollResult,
    TransferParams,
    address_tuple,
    make_transfer_params,
)
from jaxkv.transfer._producer import Pinned, Producer
from jaxkv.transfer._registry import CacheRegistry, new_generation
from jaxkv.transfer._side_channel import MetadataServer
from jaxkv.transfer._stats import TransferStats
from jaxkv.transfer._transport import ControlChannel, Transport

__all__ = [
    "FailedRead",
    "KVTransferEngine",
    "PollResult",
    "TransferParams",
    "CONTROLS",
    "TRANSPORTS",
    "make_transfer_params",
]

_log = logging.getLogger(__name__)
_MAX_HANDLES = 1 << 16
# How long after a control message, a publication or an announcement the background progress
# thread keeps its full rate: peers answer within it (a Want, a Format, the READs of a layer,
# a Done), and then it backs off until the next (`progress_idle_s`).
PROGRESS_ACTIVE_WINDOW_S = 0.05

# Measured with benchmarks/bench_transfer.py --small --control (benchmarks/RESULTS.md, load
# 7-8 on 2 cores): a small read confirmed in 6.3 / 10.6 ms (idle / busy producer, medians of
# five rounds) with NIXL notifications and the Done riding on the READ, 3.4 / 3.3 ms with a
# Done sent over TCP once the READ completed; large pulls did not differ measurably.
DEFAULT_CONTROL = "tcp"
TRANSPORTS = ("nixl", "jax", "auto")
"""The `TransferEngine` ``transport`` choices."""


def make_transport(name: str, endpoint: str, agent_options: AgentOptions | None,
                   format_pool_bytes: int = DEFAULT_POOL_BYTES, **jax_options: Any) -> Transport:
    """The transport ``name`` (``"nixl"``, ``"jax"`` or ``"auto"``) for one process.

    Args:
      format_pool_bytes: NIXL: the size of each formatted-read pool (0: none).
      jax_options: keyword arguments of `JaxTransport` (transport ``"jax"``).

    Raises:
      ValueError: an unknown name.
      RuntimeError: ``"jax"`` with a jax that has no `jax.experimental.transfer` server.
      ImportError: ``"nixl"`` without NIXL installed.
    """
    if name not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {name!r}")
    if name == "auto":
        name = "nixl" if nixl_available() else "jax"
    if name == "jax":
        from jaxkv.transfer._jax_transport import JaxTransport

        return JaxTransport(endpoint, **jax_options)
    from jaxkv.transfer._nixl_transport import NixlTransport

    return NixlTransport(endpoint, agent_options, pool_bytes=format_pool_bytes)


CONTROLS = ("nixl", "tcp", "auto")
"""The `TransferEngine` ``control`` choices."""


def _addresses(buffers: Sequence[Any]) -> set[tuple[int, int, int]]:
    return {(b.array_index, b.device.id, b.address) for b in buffers}


def next_progress_interval(interval: float, wanted: bool, fast: float, idle: float) -> float:
    """The background progress thread's next sleep: `fast` while progress is wanted, else
    twice the last one, up to `idle` (a pinned request whose step computes for seconds costs
    a few dozen polls, not thousands, and a burst of activity is served at full rate).

    Example:
      >>> next_progress_interval(0.004, False, 0.001, 0.01)
      0.008
      >>> next_progress_interval(0.008, False, 0.001, 0.01)
      0.01
      >>> next_progress_interval(0.01, True, 0.001, 0.01)
      0.001
    """
    return fast if wanted else min(idle, 2 * interval)


def control_channels(
    transport: Transport, on_message: Callable[[], None], key: DeploymentKey | None = None,
    identity: str = "",
) -> dict[str, ControlChannel]:
    """Every control channel a process listens on: ``"tcp"`` (persistent connections to the
    side channels, keyed with `key` proving `identity`) always, plus the transport's own
    (`Transport.control_channels`: ``"nixl"``, the agent's notifications, with NIXL)."""
    channels: dict[str, ControlChannel] = {
        "tcp": TcpControlChannel(on_message, key=key, identity=identity)
    }
    channels.update(transport.control_channels())
    return channels


def pick_control(name: str, channels: dict[str, ControlChannel]) -> ControlChannel:
    """The channel a process sends on: ``name``, or for ``"auto"`` the measured default.

    Raises:
      ValueError: an unknown name, or ``"nixl"`` without the NIXL transport.
    """
    if name not in CONTROLS:
        raise ValueError(f"control must be one of {CONTROLS}, got {name!r}")
    if name == "auto":
        name = DEFAULT_CONTROL if DEFAULT_CONTROL in channels else "tcp"
    if name not in channels:
        raise ValueError(f"control={name!r} needs the NIXL transport")
    return channels[name]


class KVTransferEngine:
    """One process of an engine taking part in KV transfers (see the module docstring).

    Args:
      engine_id: the engine's stable name (shared by all of its processes).
      config: the engine's `EngineConfig`.
      agent_options: NIXL agent options (transport ``"nixl"``).
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
      progress_idle_s: the thread's longest interval while nothing happens: when for
        `PROGRESS_ACTIVE_WINDOW_S` no control message arrived, nothing was published or
        announced, no formatted chunk waits for its READ and this process reads nothing
        (e.g. a layer-wise request pinned while its prefill step computes) or its reads only
        await announcements that come over TCP (`control`: the message wakes the thread), or
        a step holds the registered cache and this process reads nothing (the step's
        announcements' callbacks progress the engine), it backs off from
        `progress_interval_s` up to this (a poll every millisecond costs a CPU-bound step on
        the same core 2-4%; an idle interval below `progress_interval_s` is that one); an
        announcement brings it back at once. With nothing pinned or read it sleeps this
        long (at least 10 ms) unless a publication, a read, an announcement, a control
        message over TCP or a step's output handed to `update_cache` wakes it. None: never
        backs off
        (a producer whose peers READ over a transport that needs its progress for the whole
        READ, e.g. UCX over TCP without RDMA or shared memory, may want that).
      early_read_grace_s: producer: how long a consumer's confirmation (`Done`) of a request
        this process has not published yet is held before it is refused. A serving
        framework's scheduler may hand the params to the consumer before its worker pinned
        the blocks (already written by the step that computed them); a read landing in
        between is confirmed once `publish_request` pins the request within this window,
        and refused after it (the consumer reports the request failed). 0: refuse at once.
        Not for host staging (the mirror holds the bytes only once published: such early
        reads are always refused) nor layer-wise requests (their reads wait for `Ready`).
      transport: what moves the KV: ``"nixl"`` (one-sided READs of registered memory),
        ``"jax"`` (`jax.experimental.transfer`: the producer formats each read's blocks for
        the consumer's ranks and offers them as arrays, see `JaxTransport`) or ``"auto"``
        (NIXL when importable). Both engines of a transfer must use the same.
      control: what carries the control messages this process sends: ``"tcp"`` (persistent
        connections to the producers' side channels), ``"nixl"`` (NIXL notifications) or
        ``"auto"`` (the faster one measured, see ``DEFAULT_CONTROL``). Every process listens
        on both; a producer answers on the channel a consumer used.
      jax_transport_options: keyword arguments of `JaxTransport` (transport ``"jax"``), e.g.
        ``{"budget_bytes": 1 << 30}`` (the most bytes offered requests may hold until pulled)
        or ``{"pool_bytes": 0}``.
      auth_key: the deployment key (at least 16 bytes; every engine of the deployment holds
        the same): the side channel answers, and the control channel talks to, only peers
        that prove it (`jaxkv.transfer._auth`: challenge-response, then a MAC on every
        message). None: `load_auth_key` (``JAXKV_AUTH_KEY_FILE`` or ``JAXKV_AUTH_KEY``),
        else no key: the plain protocol, which keyed peers refuse, naming the key mismatch.
      allow_unauthenticated: serve a non-loopback `host` without a key (logged as a
        warning). Without it such an engine is refused: whoever reaches the side channel
        gets the metadata that lets a NIXL agent READ every registered cache.
      digests: end-to-end integrity digests (`jaxkv.transfer._digest`): ``"off"``,
        ``"full"`` (the producer digests every published block per rank, the consumer
        verifies every block it received before reporting the read finished; a mismatch
        fails the read with those blocks invalid and counts ``stats.digest_mismatches``)
        or ``"sampled:K"`` (K blocks per request, the last always among them). Published in
        the metadata: both engines of a transfer must declare the same, else the handshake
        fails with `IncompatibleEngineError`.
      formatted_reads: NIXL reads between host-memory caches may go *formatted*
        (`jaxkv.transfer._formatted`: the producer gathers the planned byte ranges into a
        registered send buffer, the consumer reads it in large chunks and scatters it):
        ``"auto"`` picks per read by estimated cost (descriptors x per-descriptor cost
        against bytes x copy cost, calibrated from the reads made with each producer),
        ``"always"`` / ``"never"`` force either. The path taken is in
        `TransferRecord.path` and Prometheus ``jaxkv_transfer_reads_by_path_total``.
      format_pool_bytes: NIXL: the size of each of this process's two formatted-read
        pools (send and receive, registered host memory touched only when used); 0: this
        process neither makes nor serves formatted reads.

    Raises:
      ValueError: bad arguments, a key shorter than 16 bytes, or a non-loopback `host`
        without a key (see `allow_unauthenticated`).
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
        progress_idle_s: float | None = 0.01,
        early_read_grace_s: float = 5.0,
        transport: str = "nixl",
        control: str = "auto",
        jax_transport_options: dict[str, Any] | None = None,
        auth_key: bytes | str | None = None,
        allow_unauthenticated: bool = False,
        digests: str = "off",
        formatted_reads: str = "auto",
        format_pool_bytes: int = DEFAULT_POOL_BYTES,
    ):
        if formatted_reads not in FORMATTED_MODES:
            raise ValueError(f"formatted_reads must be one of {FORMATTED_MODES}, got "
                             f"{formatted_reads!r}")
        digest_options = DigestOptions.parse(digests)
        raw_key = load_auth_key(auth_key)
        key = DeploymentKey(raw_key) if raw_key is not None else None
        check_exposure(host, key, allow_unauthenticated)
        if not early_read_grace_s >= 0:
            raise ValueError(f"early_read_grace_s must be >= 0, got {early_read_grace_s}")
        if progress_interval_s is not None and progress_interval_s <= 0:
            raise ValueError(f"progress_interval_s must be > 0, got {progress_interval_s}")
        if progress_idle_s is not None and not progress_idle_s > 0:
            raise ValueError(f"progress_idle_s must be > 0, got {progress_idle_s}")
        if control not in CONTROLS:
            raise ValueError(f"control must be one of {CONTROLS}, got {control!r}")
        self.engine_id = engine_id
        self.config = config
        self.lease_s = lease_s
        self.read_timeout_s = read_timeout_s
        self._closed = False
        self._progress_thread: threading.Thread | None = None
        self._lock = threading.RLock()
        self._stashed = PollResult()  # found by polls inside host callbacks
        generation = new_generation()
        jax_options = dict(host=host, pull_timeout_s=read_timeout_s, lease_s=lease_s,
                           **(jax_transport_options or {}))
        self.transport = make_transport(
            transport, f"{engine_id}/{os.getpid()}/{generation}", agent_options,
            format_pool_bytes, **jax_options
        )
        if self.transport.name == "jax":
            host_staging = False  # arrays are formatted from the device cache itself
        self._key = key
        self._channels = control_channels(self.transport, self._on_control, key, engine_id)
        tcp = self._channels["tcp"]
        assert isinstance(tcp, TcpControlChannel)
        try:
            self.control = pick_control(control, self._channels)
            self.server = MetadataServer(host, port, on_control=tcp.adopt, key=key)
        except BaseException:
            for channel in self._channels.values():
                channel.close()
            self.transport.close()
            raise
        self.stats = TransferStats()
        self._registry = CacheRegistry(
            engine_id, config, self.transport, self.server, host_staging, block_hashing,
            generation, digest_options.wire,
        )
        self.transport.attach(self._registry)
        self.producer = Producer(
            engine_id, self._registry, self.transport, self._channels, self.stats, lease_s,
            float(early_read_grace_s), digest_options,
        )
        self.consumer = Consumer(
            engine_id, self._registry, self.transport, self.control,
            address_tuple(self.server.address), self.stats, read_timeout_s,
            handshake_timeout_s, handshake_retries, key, digest_options,
        )
        # The Done rides on the READ only where control messages travel as NIXL
        # notifications anyway; over TCP it is sent apart as soon as the READ completed.
        self.consumer.attach_done = self.control.name == "nixl"
        self.consumer.formatted_reads = formatted_reads
        self._handles = HandleTable(_MAX_HANDLES)
        self._progress_interval_s = progress_interval_s
        self._progress_idle_s = progress_idle_s
        self._last_message = 0.0  # monotonic time control messages last arrived
        self._wake = threading.Event()  # an announcement: the progress thread polls at once
        if progress_interval_s is not None:
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
        if self._registry.meta is None:
            raise RuntimeError("register_cache first")
        return self._registry.meta

    @property
    def deployment_key(self) -> DeploymentKey | None:
        """The deployment key this engine proves and asks for (None: none), e.g. for the
        metadata server of a `MultiControllerEngine`."""
        return self._key

    @property
    def generation(self) -> int:
        """This process's generation (bumped whenever its registered regions change)."""
        return self._registry.generation

    @property
    def local_ranks(self) -> tuple[int, ...]:
        return self._registry.local_ranks

    @property
    def agent(self) -> NixlAgent:
        """The NIXL agent (transport ``"nixl"`` only; benchmarks time bare READs with it)."""
        from jaxkv.transfer._nixl_transport import NixlTransport

        if not isinstance(self.transport, NixlTransport):
            raise AttributeError(f"transport {self.transport.name!r} has no NIXL agent")
        return self.transport.agent

    @no_context_mesh()
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
            self._registry.register(cache, pp_rank, tp_rank)


    def check_registrations(self, cache: Any) -> None:
        """Raises `BufferMovedError` if a registered shard of `cache` moved (call after updates
        that should have been in place); re-register with `register_cache` after fixing."""
        entry = self._registry.entry_of(cache)
        if entry is not None:
            cache.verify_unmoved(entry.buffers)

    def holds(self, cache: Any) -> bool:
        """Whether a registered cache is `cache` or has its buffers (addresses and devices:
        the output of a donated, in-place update of a registered cache)."""
        where = _addresses(cache.shard_buffers())
        with self._lock:
            return any(entry.cache is cache or where == _addresses(entry.buffers)
                       for entry in self._registry.caches)

    @property
    def registers_memory(self) -> bool:
        """Whether the transport reads and writes the registered buffers by address (NIXL),
        so that they must stay in place; False for a transport that moves arrays (``"jax"``:
        it formats from, and writes into, whatever arrays are current)."""
        return not self.transport.moves_arrays

    @no_context_mesh()
    def update_cache(self, cache: Any) -> None:
        """Makes `cache` the current version of a registered cache (after the caller updated
        it with donated, in-place operations: `cache = step(cache)`). Post-processing of
        received blocks acts on the current version.

        Over a transport that does not register memory (`registers_memory` False: the JAX
        transport), buffers that moved are adopted as they are: nothing addresses them.

        Raises:
          BufferMovedError: a buffer is not where it was registered (re-register), with a
            transport that registers memory.
          ValueError: no registered cache has these arrays and devices.
        """
        # Wait outside the lock: the step that produced `cache` may be blocked in a host
        # callback that needs the lock (publish_in_jit / wait_in_jit).
        cache.block_until_ready()
        with self._lock:
            entry = self._registry.entry_of(cache)
            if entry is None:
                raise ValueError("update_cache: no registered cache has these arrays and devices")
            if self.registers_memory:
                cache.verify_unmoved(entry.buffers)
                entry.in_place = True
            elif cache is not entry.cache:
                buffers = cache.shard_buffers()
                entry.in_place = _addresses(buffers) == _addresses(entry.buffers)
                entry.buffers = buffers
            if cache is not entry.cache:
                entry.cache = cache
                entry.version += 1
            self.producer.stage_deferred()
        self._wake.set()  # a step's output handed over: the background thread's back-off ends

    @property
    def caches(self) -> tuple[Any, ...]:
        """The registered caches, current versions (post-processing updates them)."""
        return tuple(entry.cache for entry in self._registry.caches)

    def adopt_generation(self, generation: int) -> None:
        """Sets this process's generation (and republishes its metadata): every process of a
        multi-controller engine serves one merged metadata under one generation
        (`jaxkv.transfer.MultiControllerEngine` calls this; peers check it in every `Done`).

        Raises:
          ValueError: a generation outside ``[0, 2**62)``.
        """
        if not 0 <= int(generation) < (1 << 62):
            raise ValueError(f"generation must be in [0, 2**62), got {generation}")
        with self._lock:
            self._registry.generation = int(generation)
            if self._registry.meta is not None:
                self._registry.publish()

    def published_layers(self, request_id: str) -> int | None:
        """Producer: how many global layers of a pinned request are published (readable:
        ``[0, n)``), or None when the request is not pinned (never published, freed, expired
        or aborted). With ``n == num_layers`` the whole request is readable."""
        with self._lock:
            pinned = self.producer.pinned.get(request_id)
            return None if pinned is None or pinned.deadline < 0 else pinned.layer_stop

    # -- handshake ------------------------------------------------------------------------

    def add_peer(self, engine_id: str, addresses: Sequence[tuple[str, int]]) -> EngineMetadata:
        """Fetches (or re-fetches) a peer engine's metadata from all of its processes, checks
        compatibility and loads its agents (the explicit warm-up; `start_read` does it lazily).

        Raises:
          HandshakeError, IncompatibleEngineError: nothing is loaded then.
        """
        with self._lock:
            return self.consumer.add_peer(engine_id, addresses)

    # -- producer -------------------------------------------------------------------------

    @no_context_mesh()
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
        with self._lock:
            params = self.producer.publish(
                request_id, block_ids, lease_s, layerwise, expected_reads,
                address_tuple(self.address),
            )
        self._wake.set()
        return params

    @no_context_mesh()
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
            pinned = self.producer.pinned.get(request_id)
            if pinned is None:
                raise KeyError(f"request {request_id!r} is not pinned")
            self.producer.publish_layers(pinned, stop)
        self._wake.set()

    def handle(self, request_id: str) -> int:
        """A small positive int naming `request_id` inside jitted code (host callbacks carry
        ids, not strings); stable while the engine remembers the request.

        Example:
          >>> h = engine.handle("req-1")  # doctest: +SKIP
        """
        with self._lock:
            return self._handles.handle(request_id)

    def request_of(self, handle: int) -> str:
        """The request id of a `handle` (KeyError if unknown)."""
        with self._lock:
            return self._handles[int(handle)]

    def abort_request(self, request_id: str) -> None:
        """Producer: releases a request's blocks now (reported by the next `poll` as freeable);
        consumers still reading get their confirmation refused. Consumer: stops the read of
        that read id (`start_read`'s ``read_id``) and reports it failed."""
        with self._lock:
            self.producer.abort(request_id)
            self.consumer.abort(request_id)

    @property
    def num_pinned(self) -> int:
        return len(self.producer.pinned)

    @property
    def num_reading(self) -> int:
        return len(self.consumer.reading)

    # -- consumer -------------------------------------------------------------------------

    @no_context_mesh()
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
            self.consumer.start(params, local_block_ids, timeout_s, read_id)
        self._wake.set()  # the background thread's full rate while this process reads

    # -- polling --------------------------------------------------------------------------

    @no_context_mesh()
    def poll(self) -> PollResult:
        """Makes progress on everything in flight; returns what changed since the last poll."""
        with self._lock:
            self.producer.stage_deferred()
            result, self._stashed = self._stashed, PollResult()
            result.extend(self._poll(allow_jax=True))
            return result

    def progress(self) -> None:
        """Moves what is in flight (peers' READs, notifications, completions) without any JAX
        work: safe while a jitted step computes on the registered cache. What it finds is
        reported by the next `poll`."""
        with self._lock:
            self._stashed.extend(self._poll(allow_jax=False))

    def _poll(self, allow_jax: bool) -> PollResult:
        result = PollResult()
        now = time.monotonic()
        self._handle_messages(now)
        self.consumer.poll(now, allow_jax, result)
        self.producer.poll(now, result)
        if allow_jax:
            self.transport.serve()  # e.g. formats requests for subscribers (JAX ops)
        self.transport.progress()  # push what this poll sent, even if the caller goes idle
        return result

    def _handle_messages(self, now: float) -> None:
        """Routes the control messages that arrived (on every channel, and attached to
        transport fetches) to the producer or consumer role."""
        arrived = [(self.transport.name, s, p) for s, p in self.transport.notifications()]
        for name, channel in self._channels.items():
            arrived += [(name, s, p) for s, p in channel.receive()]
        if arrived:
            self._last_message = now
        producer, consumer = self.producer, self.consumer
        for channel_name, sender, payload in arrived:
            try:
                message = decode_message(payload)
            except ValueError:
                self.stats.malformed_messages += 1
                continue
            # A consumer acts on its own reads only: its messages must come from where it
            # introduced itself (`Hello`); a producer's answers from that producer's process
            # (checked by the consumer role).
            if isinstance(message, Hello):
                producer.on_hello(message, channel_name, sender)
            elif isinstance(message, (Ack, Ready, Formatted)):
                if isinstance(message, Ack):
                    consumer.on_ack(message, channel_name, sender)
                elif isinstance(message, Formatted):
                    consumer.on_formatted(message, channel_name, sender)
                else:
                    consumer.on_ready(message, channel_name, sender)
            elif not producer.from_owner(
                channel_name, sender, getattr(message, "agent_name", None),
                getattr(message, "engine_id", None),
            ):
                self.stats.refused_messages += 1
            elif isinstance(message, Heartbeat):
                producer.on_heartbeat(message, now)
            elif isinstance(message, Done):
                producer.on_done(message)
            elif isinstance(message, Want):
                producer.on_want(message, now)
            elif isinstance(message, Format):
                producer.on_format(message, now)
            elif isinstance(message, Released):
                producer.on_released(message)

    def _on_control(self) -> None:
        """Control messages arrived (the TCP channel's thread): handled now when the engine
        is idle (no JAX), else by the poll that holds it. Not without background progress
        (``progress_interval_s=None``: only `poll` and the in-jit callbacks progress)."""
        if self._closed or self._progress_thread is None:
            return
        self._wake.set()  # the background thread's full rate while peers act on it
        if not self._lock.acquire(blocking=False):
            return
        try:
            if not self._closed:
                self._stashed.extend(self._poll(allow_jax=False))
        finally:
            self._lock.release()

    # -- host callbacks (jaxkv.transfer._jit) ---------------------------------------------

    def _layer_rows_span(self, written: Any) -> tuple[int, int, str] | None:
        """For `publish_layer_in_jit`, at trace time: None when the announcements need no
        rows (no registered cache is host-staged and the transport does not take layer
        rows, ``Transport.takes_layer_rows``); else the global layers ``[start, stop)`` of
        the registered cache and why the announcement's callback cannot take `written`'s
        rows ("": it can). It can where `written` is a version of the only registered cache
        (same spec and array shapes) whose blocks are not split over devices."""
        with self._lock:
            caches = self._registry.caches
            staged = any(entry.mirror is not None for entry in caches)
            if not caches or not (staged or self.transport.takes_layer_rows):
                return None
            entry = caches[0]
            spec, arrays = getattr(written, "spec", None), getattr(written, "arrays", None)
            reason = ""
            if len(caches) != 1:
                reason = "the engine holds several caches"
            elif spec is None or arrays is None:
                reason = "`written` is not the registered cache (pass the PagedKVCache)"
            elif entry.cache.spec != spec or [a.shape for a in entry.cache.arrays] != [
                    tuple(a.shape) for a in arrays]:
                reason = "`written` is not a version of the registered cache"
            elif (entry.mirror is None or not entry.mirror.writes_rows) if staged else (
                    entry.cache.sharding.data_size != 1):
                reason = "the cache's blocks are split over devices"
            elif not staged and self.transport.reads_step_memory(entry.cache):
                return None  # it formats the announced layers from the step's memory
            elif not staged and steps_hold_buffers(entry.cache):
                reason = ("the cache spans several XLA:CPU devices, whose transfer server "
                          "serves no buffer of theirs before the running step ends, and the "
                          "process has no other XLA:CPU device to format the layers on (give "
                          "it one more: --xla_force_host_platform_device_count)")
            return entry.layer_start, entry.layer_stop, reason

    def _callback_publish(
        self,
        handle: int,
        block_ids: np.ndarray,
        layer_stop: int,
        rows: tuple[int, list[np.ndarray | None]] | None = None,
    ) -> int:
        """From a jitted step's host callback: publish (or mark written) a request's layers
        ``[0, layer_stop)``. Returns 1, or 0 when refused (logged). Never runs JAX. With host
        staging, `rows` (``(first global layer, per cache array the rows of layers [first,
        layer_stop) or None)``, from `publish_layer_in_jit`) are written to the mirror and
        the layers announced now; without them the copy to the mirror is left to the first
        `poll` (or `update_cache`) after the step's output was handed to `update_cache`. A
        transport that takes layer rows (the JAX transport) gets them with the announcement
        (`Offer.rows`) and serves them before the step ends."""
        num_layers = self.config.spec.num_layers
        stop = num_layers if layer_stop < 0 else min(int(layer_stop), num_layers)
        if not self._lock.acquire(timeout=self.read_timeout_s):
            _log.error("publish from a jitted step: the engine stayed busy")
            return 0
        try:
            request_id = self._handles.get(handle)
            if request_id is None:
                _log.error("publish from a jitted step: unknown handle %d", handle)
                return 0
            # Subscriptions (Want) that arrived since the last poll: the announcement must
            # reach consumers that subscribed while the step ran.
            self._handle_messages(time.monotonic())
            status = self.producer.callback_publish(request_id, block_ids, stop, rows)
            if status:
                self.transport.progress()
                self._wake.set()  # the background thread back to its full rate
            return status
        finally:
            self._lock.release()

    def _callback_wait(self, handle: int, timeout_s: float) -> int:
        """From a jitted step's host callback: wait until a request finished (1), failed (0),
        the wait timed out (-1) or the request needs JAX work outside the callback (-2:
        post-processing or host staging; `poll` outside jit instead). Polls the engine
        itself (no JAX), stashing what it finds for the next `poll`."""
        deadline = time.monotonic() + timeout_s
        outcomes = self.consumer.outcomes
        while True:
            if self._lock.acquire(timeout=max(0.0, min(0.05, deadline - time.monotonic()))):
                try:
                    request_id = self._handles.get(handle)
                    if request_id is None:
                        return 0
                    outcome = outcomes.get(request_id)
                    if outcome is not None:
                        return 1 if outcome else 0
                    state = self.consumer.reading.get(request_id)
                    if state is None:
                        return 0
                    if state.needs_jax:
                        return -2
                    self._stashed.extend(self._poll(allow_jax=False))
                    outcome = outcomes.get(request_id)
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
        acknowledgements so move while the caller computes between polls. Backs off while
        nothing happens (`progress_idle_s`)."""
        fast = float(self._progress_interval_s or 0.001)
        idle = max(fast, float(self._progress_idle_s or fast))
        interval = fast
        while not self._closed:
            if not (self.producer.busy or self.consumer.reading):
                # Nothing in flight: sleep until a publication, read or announcement wakes
                # the thread (each wake-up costs a CPU-bound step on the same core).
                interval = fast
                self._wake.wait(max(idle, 0.01))
                self._wake.clear()
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
            interval = next_progress_interval(interval, self._progress_wanted(time.monotonic()),
                                              fast, idle)
            self._wake.wait(interval)
            self._wake.clear()

    def _progress_wanted(self, now: float) -> bool:
        """Whether the background thread should poll at its full rate: this process reads
        (unless its reads only await announcements that reach it over TCP), formatted chunks
        wait for their READs (their slots free only as notifications are polled), or, unless
        a step holds the registered cache, a control message, publication or announcement
        came within `PROGRESS_ACTIVE_WINDOW_S` (peers act on them: Wants, Formats, READs,
        Dones)."""
        producer = self.producer
        if producer.serving_chunks:
            return True
        if self.consumer.reading and (self.consumer.moving or self.control.name != "tcp"):
            # A layer-wise read waiting for its producer's next layer (a prefill step computes
            # for seconds) needs no polls: the announcement (`Ready`, answered on the channel
            # this process subscribed on) wakes the thread as it arrives over TCP. Polling at
            # the full rate through the step cost the consumer's core ~500 wake-ups a second
            # (the demo). NIXL notifications reach it only by polling.
            return True
        if any(entry.consumed for entry in self._registry.caches):
            # A step holds the registered cache: each of its announcements' callbacks handles
            # the messages and progresses the transport itself, and where the step shares
            # this thread's core every wake-up lengthens it (benchmarks/bench_layerwise.py:
            # polling at the full rate through a layer-wise step of ~150 ms cost it 20-50 ms
            # on one core). Back off until the step's output is handed over.
            return False
        recent = max(self._last_message, producer.last_announced)
        return now - recent < PROGRESS_ACTIVE_WINDOW_S

    # -- internals kept for tests and benchmarks ------------------------------------------

    @property
    def _reading(self) -> dict[str, Reading]:
        return self.consumer.reading

    @property
    def _pinned(self) -> dict[str, Pinned]:
        return self.producer.pinned

    @property
    def _attach_done(self) -> bool:
        return self.consumer.attach_done

    @_attach_done.setter
    def _attach_done(self, value: bool) -> None:
        self.consumer.attach_done = bool(value)

    def _heartbeat(self, state: Reading, now: float) -> None:
        self.consumer.heartbeat(state, now)

    # -- shutdown -------------------------------------------------------------------------

    def close(self) -> None:
        """Releases handles, registrations, peers and the side channel (idempotent)."""
        if self._closed:
            return
        self._closed = True
        locked = self._lock.acquire(timeout=self.read_timeout_s)
        try:
            self.consumer.close()
            self.producer.close()
            self.server.close()
            for channel in self._channels.values():
                channel.close()
            self.transport.close()
            self._registry.caches.clear()
        finally:
            if locked:
                self._lock.release()
        if self._progress_thread is not None:
            self._wake.set()
            self._progress_thread.join(timeout=1.0)

    def __enter__(self) -> KVTransferEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
