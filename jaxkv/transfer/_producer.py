"""The producer role: requests pinned for consumers, their leases, confirmations and release.

`publish_request` pins a request's blocks (`RequestState.PINNED`) under a lease; consumers
extend it with `Heartbeat`s. Each consumer rank's `Done` is answered with an `Ack` saying
whether the blocks were still pinned (``READING`` once one was counted); the request becomes
``DONE`` when every expected read was confirmed by every consumer rank for every local
producer rank, ``ABORTED`` (`abort`) or ``EXPIRED`` (lease), and is then reported freeable.
A `Done` for a request not published yet is held up to ``early_read_grace_s``. Layer-wise
requests announce their written layers (`Ready`) to the consumers that subscribed (`Want`);
with host staging the published layers are first copied to the host mirror.

Integrity digests (``digests`` enabled, `jaxkv.transfer._digest`): when a request becomes
fully readable (all layers published, after the copy to the host mirror) the producer digests
its blocks per local rank where peers read them, and sends each rank's digests with its `Ack`
of a consumer's `Done` (see `jaxkv.transfer._digest` for why the Ack carries them).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxkv.transfer._digest import (
    DigestOptions,
    RankDigests,
    producer_digests,
    sample_positions,
    sample_seed,
)
from jaxkv.transfer._formatted import FormatServer, WaitingChunk
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
from jaxkv.transfer._params import PollResult, TransferParams
from jaxkv.transfer._protocol import RequestState, transition
from jaxkv.transfer._registry import CacheRegistry
from jaxkv.transfer._stats import PublishRecord, TransferStats
from jaxkv.transfer._transport import ControlChannel, Offer, Transport

__all__ = ["Pinned", "Producer"]

_log = logging.getLogger(__name__)
MAX_OUTCOMES = 4096

Target = tuple[str, str]  # (control channel name, the channel's target)


@dataclasses.dataclass
class Pinned:
    """A published request (see `RequestState`)."""

    request_id: str
    block_ids: tuple[int, ...]
    deadline: float  # -1: aborted
    # producer rank -> {(consumer engine, read id): {consumer ranks that notified}}
    notified: dict[int, dict[tuple[str, str], set[int]]]
    expected: dict[tuple[str, str], int]  # (consumer engine, read id) -> its world size
    lease_s: float
    expected_reads: int = 1  # consumer reads to confirm before the blocks are freeable
    layer_stop: int = 0  # global layers [0, layer_stop) are written and readable
    subscribers: set[Target] = dataclasses.field(default_factory=set)
    published_at: list[tuple[int, float]] = dataclasses.field(default_factory=list)
    staged_s: float = 0.0
    state: RequestState = RequestState.PINNED
    # producer rank -> its digests, once the whole request is readable (digests enabled)
    digests: dict[int, RankDigests] = dataclasses.field(default_factory=dict)
    digest_s: float = 0.0  # seconds spent computing them
    # Registered-cache versions a jitted step consumed (donated) while its callback announced
    # layers of this request (None: none so far): those layers are written in place, in the
    # registered memory, before the step's output is handed over (`update_cache`).
    step_versions: tuple[int, ...] | None = None

    @property
    def key(self) -> str:
        return self.request_id

    def complete(self) -> bool:
        """Every local producer rank counted `expected_reads` fully confirmed reads."""
        return all(
            sum(len(ranks) >= self.expected[read] for read, ranks in reads.items())
            >= self.expected_reads
            for reads in self.notified.values()
        )


class Producer:
    """The producer side of one engine process (thread-safety: the engine's lock).

    Args:
      engine_id: this engine.
      registry: the registered caches and metadata.
      transport: offered each readable request, withdrawn once freed; progressed after
        each formatted chunk it gathers.
      channels: the control channels by name (answers go back on the one a consumer used).
      stats: where publications and expiries are counted.
      lease_s: default lease.
      early_read_grace_s: how long a `Done` for an unpublished request is held.
      digests: the engine's integrity digest options (default: off).
    """

    def __init__(
        self,
        engine_id: str,
        registry: CacheRegistry,
        transport: Transport,
        channels: dict[str, ControlChannel],
        stats: TransferStats,
        lease_s: float,
        early_read_grace_s: float,
        digests: DigestOptions | None = None,
    ):
        self.engine_id = engine_id
        self.digests = digests or DigestOptions()
        self.registry = registry
        self.transport = transport
        self.channels = channels
        self.stats = stats
        self.lease_s = lease_s
        self.early_read_grace_s = early_read_grace_s
        self.pinned: dict[str, Pinned] = {}
        self.consumers: dict[str, Target] = {}  # consumer agent name (published) -> target
        # Who may act on what: the engine id each consumer agent introduced itself with
        # (`Hello`), and the agent that introduced itself on each (channel, sender).
        self.introduced: dict[str, str] = {}
        self.senders: dict[Target, str] = {}
        self.early_wants: dict[str, tuple[set[Target], float]] = {}
        # Done messages of requests not published yet: request -> [(message, expiry)]
        self.early_dones: dict[str, list[tuple[Done, float]]] = {}
        self.released: dict[str, bool] = {}  # recently freed requests (confirmed?)
        # publications from host callbacks that need JAX (host staging): (request, stop,
        # the cache versions at the callback); staged from a later version (the step's output)
        self.deferred: list[tuple[str, int, tuple[int, ...]]] = []
        # formatted reads (`jaxkv.transfer._formatted`): None where the transport has none
        self.formats: FormatServer | None = transport.format_server
        self.last_announced = 0.0  # monotonic time of the last publication or announcement

    @property
    def busy(self) -> bool:
        return bool(self.pinned or self.early_dones
                    or (self.formats is not None and self.formats.waiting))

    @property
    def serving_chunks(self) -> bool:
        """Whether gathered formatted chunks wait for their consumers' READs (or chunks wait
        to be gathered): their slots free only as notifications are polled."""
        return self.formats is not None and bool(self.formats.waiting
                                                 or self.formats.held_bytes)

    def send(self, target: Target, payload: bytes) -> None:
        channel = self.channels.get(target[0])
        if channel is None or not channel.send(target[1], payload):
            self.stats.failed_notifications += 1

    # -- publishing -----------------------------------------------------------------------

    def publish(
        self,
        request_id: str,
        block_ids: Sequence[int],
        lease_s: float | None,
        layerwise: bool,
        expected_reads: int,
        address: tuple[str, int],
    ) -> TransferParams:
        """See `KVTransferEngine.publish_request`."""
        lease = self.lease_s if lease_s is None else lease_s
        ids = tuple(int(b) for b in block_ids)
        if int(expected_reads) < 1:
            raise ValueError(f"expected_reads must be >= 1, got {expected_reads}")
        pinned = Pinned(
            request_id,
            ids,
            time.monotonic() + lease,
            {r: {} for r in self.registry.ranks},
            {},
            lease,
            int(expected_reads),
        )
        self.pinned[request_id] = pinned
        self.released.pop(request_id, None)
        early = self.early_wants.pop(request_id, None)
        if early is not None:
            pinned.subscribers |= early[0]
        if not layerwise:
            self.publish_layers(pinned, self.registry.config.spec.num_layers)
        for message, _ in self.early_dones.pop(request_id, []):
            # Held reads: the blocks held the request's bytes already (direct mode);
            # confirmed (or refused) now that the request is pinned.
            self.on_done(message)
        return TransferParams(
            self.engine_id,
            [address],
            request_id,
            list(ids),
            lease,
            self.registry.generation,
            layerwise,
        )

    def publish_layers(self, pinned: Pinned, stop: int, staged: bool = False,
                       rows: tuple[int, list[Any]] | None = None,
                       in_step: bool = False) -> None:
        """Marks the global layers ``[0, stop)`` written: stages them (host staging; not when
        `staged`: their bytes were written to the mirror already, `write_layer_rows`),
        offers them to the transport (with their `rows` from a jitted step, for a transport
        that takes them; `in_step`: announced by the step that consumed the registered
        caches, `Offer.in_step`) and announces them to the subscribers."""
        start = pinned.layer_stop
        if stop <= start:
            return
        t0 = time.perf_counter()
        for entry in self.registry.caches:
            if entry.mirror is None or staged:
                continue
            lo, hi = max(start, entry.layer_start), min(stop, entry.layer_stop)
            if lo >= hi:
                continue
            layers = (lo - entry.layer_start, hi - entry.layer_start)
            whole = layers == (0, entry.layer_stop - entry.layer_start)
            entry.mirror.stage_out(entry.cache, pinned.block_ids, None if whole else layers)
        pinned.staged_s += time.perf_counter() - t0
        if self.digests.enabled and stop == self.registry.config.spec.num_layers:
            # Every layer is written and staged: digest what peers read from now on.
            t1 = time.perf_counter()
            positions = sample_positions(
                len(pinned.block_ids), self.digests,
                sample_seed(pinned.request_id, self.registry.generation))
            pinned.digests = producer_digests(self.registry, pinned.block_ids, positions)
            pinned.digest_s = time.perf_counter() - t1
            self.stats.digest_s_total += pinned.digest_s
        pinned.layer_stop = stop
        pinned.published_at.append((stop, time.time()))
        self.last_announced = time.monotonic()
        if stop == self.registry.config.spec.num_layers:
            self.stats.add_publication(
                PublishRecord(pinned.request_id, tuple(pinned.published_at), pinned.staged_s)
            )
        self.transport.offer(
            Offer(pinned.request_id, pinned.block_ids, stop, tuple(self.registry.caches),
                  lease_s=pinned.lease_s, rows=rows, in_step=in_step)
        )
        message = encode_message(Ready(pinned.request_id, list(self.registry.local_ranks), stop))
        for target in pinned.subscribers:
            self.send(target, message)

    def abort(self, request_id: str) -> None:
        if request_id in self.pinned:
            self.pinned[request_id].deadline = -1.0

    def stage_deferred(self) -> None:
        """Stages the publications of host callbacks (host staging) once every registered
        cache was replaced by a later version than the one of the callback's step: the
        callback ran inside the step, whose input cache is donated (deleted) and whose
        output is handed over by `update_cache` after the step."""
        caches = self.registry.caches
        still = []
        for request_id, stop, versions in self.deferred:
            pinned = self.pinned.get(request_id)
            if pinned is None:
                continue  # freed or expired meanwhile
            current = all(
                e.mirror is None
                or (e.version > v and not e.consumed)
                for e, v in zip(caches, versions)
            )
            if not current or len(versions) != len(caches):
                if len(versions) == len(caches):
                    still.append((request_id, stop, versions))
                    continue
                _log.error("publishing %s failed: the caches were re-registered", request_id)
                pinned.deadline = -1.0
                continue
            try:
                self.publish_layers(pinned, stop)
            except Exception as error:  # noqa: BLE001 - the request is aborted
                _log.error("publishing %s failed: %s", request_id, error)
                pinned.deadline = -1.0
        self.deferred = still

    def callback_publish(
        self,
        request_id: str,
        block_ids: np.ndarray,
        stop: int,
        rows: tuple[int, list[np.ndarray | None]] | None = None,
    ) -> int:
        """A jitted step's publication (see `KVTransferEngine._callback_publish`); the
        engine's lock is held and the new messages handled. Returns 1 or 0 (refused).

        With host staging, `rows` (the first global layer they hold, and per cache array the
        request's rows of layers ``[start, stop)``, `publish_layer_in_jit`) are written into
        the mirror and the layers announced now, from inside the step; without them (or when
        they cannot be used, `write_layer_rows`) the copy waits for the step's output. A
        transport that takes layer rows gets them with the announcement."""
        ids = [int(b) for b in np.asarray(block_ids).reshape(-1) if b >= 0]
        pinned = self.pinned.get(request_id)
        if pinned is None:
            if self.released.get(request_id):
                # Every consumer confirmed it already (it read the layers announced
                # before): a late announcement of a finished request is no error.
                _log.debug("publish from a jitted step: %s already confirmed", request_id)
                return 1
            if request_id in self.released:  # aborted or expired while the step ran
                _log.warning("publish from a jitted step: %s was aborted or expired; its "
                             "layers are not announced", request_id)
                return 0
            _log.error("publish from a jitted step: %s is not published", request_id)
            return 0
        if pinned.deadline < 0:  # aborted, not released yet: nothing more is announced
            _log.warning("publish from a jitted step: %s was aborted; its layers are not "
                         "announced", request_id)
            return 0
        if ids and tuple(ids) != pinned.block_ids:
            _log.error(
                "publish from a jitted step: %s wrote blocks %s, it was published with %s",
                request_id, ids, list(pinned.block_ids),
            )
            pinned.deadline = -1.0
            return 0
        if self.registry.staged:
            if rows is not None:
                written = self.write_layer_rows(pinned, block_ids, stop, rows)
                if written is None:  # the rows were bad: the request is aborted
                    return 0
                if written:
                    self.publish_layers(pinned, stop, staged=True)
                    return 1
            # The step's output is not available here: staged from it once the caller
            # hands it to update_cache (never from the donated input, see stage_deferred).
            self.deferred.append((request_id, stop, self.registry.versions))
        elif rows is not None and self.transport.takes_layer_rows:
            start, parts = rows
            keep = np.asarray(block_ids).reshape(-1) >= 0  # one row per id (-1: padding)
            if not keep.all():
                parts = [None if p is None else np.asarray(p)[keep] for p in parts]
            self.publish_layers(pinned, stop, rows=(start, parts))
        else:
            in_step = any(entry.consumed for entry in self.registry.caches)
            if in_step:
                pinned.step_versions = self.registry.versions
            self.publish_layers(pinned, stop, in_step=in_step)
        return 1

    def write_layer_rows(
        self,
        pinned: Pinned,
        block_ids: np.ndarray,
        stop: int,
        rows: tuple[int, list[np.ndarray | None]],
    ) -> bool | None:
        """Writes a jitted step's rows of layers ``[start, stop)`` (host bytes handed to its
        announcement's callback) into the host mirror, so that they are readable before the
        step ends. Only the layers not staged yet are written, and only where the rows can
        stand for the device copy: one registered (staged) cache holding those layers whose
        blocks are not split over devices, the request's blocks, and no layer missing
        before `start` (an earlier announcement that was deferred).

        Returns:
          True: written (announce them); False: not usable, nothing written (defer the copy
          to the step's output, as without rows); None: refused rows (bad shapes): nothing
          written, the request is aborted (logged).
        """
        start, parts = rows
        padded = np.asarray(block_ids, np.int64).reshape(-1)  # one per row (-1: padding)
        ids = tuple(int(b) for b in padded if b >= 0)
        caches = self.registry.caches
        if len(caches) != 1 or caches[0].mirror is None or not caches[0].mirror.writes_rows:
            return False
        entry = caches[0]
        mirror = entry.mirror
        assert mirror is not None
        if (ids != pinned.block_ids or len(parts) != len(entry.cache.arrays)
                or start > max(pinned.layer_stop, entry.layer_start)
                or any(r == pinned.request_id for r, _, _ in self.deferred)
                or not entry.layer_start <= start < stop <= entry.layer_stop):
            return False
        first = max(start, pinned.layer_stop)  # layers before it are staged and announced
        # (a pipeline rank's process holds layers from entry.layer_start on: none before)
        if first >= stop:
            return True
        local = (first - entry.layer_start, stop - entry.layer_start)
        axes = entry.cache.spec.block_axes()
        axis = 1 + axes.index("L") if "L" in axes else None
        new: list[np.ndarray | None] = []
        for (layer, _), part in zip(entry.cache.array_keys, parts):
            if layer is not None and not local[0] <= layer < local[1]:
                new.append(None)  # another layer's array
            elif part is None:
                return False  # a layer's bytes are missing: never announce it from here
            elif layer is None and axis is not None and first > start:
                new.append(part[(slice(None),) * axis + (slice(first - start, None),)])
            else:
                new.append(part)
        t0 = time.perf_counter()
        try:
            mirror.write_rows(padded, new, local)
        except ValueError as error:
            _log.error("publish from a jitted step: %s: %s", pinned.request_id, error)
            pinned.deadline = -1.0
            return None
        pinned.staged_s += time.perf_counter() - t0
        return True

    # -- messages ---------------------------------------------------------------------------

    def on_hello(self, message: Hello, channel: str, sender: str) -> None:
        """A consumer process introduces itself: binds its agent and engine id to the
        channel it came on (refused when the connection proved another engine id with the
        deployment key, or the agent name belongs to another engine already)."""
        # A channel that cannot tell who sent (an older or test channel): no identity.
        identify = getattr(self.channels.get(channel), "identity", None)
        owner = identify(sender) if identify is not None else None
        known = self.introduced.get(message.agent_name, message.engine_id)
        if (owner is not None and owner != message.engine_id) or known != message.engine_id:
            self.stats.refused_messages += 1
            _log.warning("refused a Hello of %r as engine %r (the connection is %r's)",
                         message.agent_name, message.engine_id, owner or known)
            return
        old = self.consumers.pop(message.agent_name, None)
        if old is not None and old[0] in self.channels:
            self.channels[old[0]].forget(old[1])
            self.senders.pop(old, None)
        try:
            target = self.channels[channel].accept(
                message.agent_name, sender, message.agent_metadata
            )
        except (KeyError, ValueError):  # bad metadata from a peer
            self.stats.malformed_messages += 1
            return
        self.consumers[message.agent_name] = (channel, target)
        self.introduced[message.agent_name] = message.engine_id
        self.senders[(channel, sender)] = message.agent_name

    def from_owner(self, channel: str, sender: str, agent_name: str | None,
                   engine_id: str | None) -> bool:
        """Whether a consumer message naming `agent_name` / `engine_id` (None: the message
        names none) came from that consumer: the agent that introduced itself on this
        (channel, sender), or, where the channel names the sending agent itself (NIXL
        notifications), that introduced agent. A consumer so acts on its own reads only."""
        agent = self.senders.get((channel, sender))
        if agent is None and sender in self.introduced:
            agent = sender  # NIXL: the sender is the notifying agent's name
        if agent is None or (agent_name is not None and agent != agent_name):
            return False
        return engine_id is None or self.introduced.get(agent) == engine_id

    def on_heartbeat(self, message: Heartbeat, now: float) -> None:
        pinned = self.pinned.get(message.request_id)
        if pinned is not None and now <= pinned.deadline:  # not after expiry
            pinned.deadline = max(pinned.deadline, now + pinned.lease_s)

    def on_want(self, message: Want, now: float) -> None:
        target = self.consumers.get(message.agent_name)
        if target is None:
            self.stats.failed_notifications += 1
            return
        pinned = self.pinned.get(message.request_id)
        if pinned is None:  # subscribed before this process published: remember for a lease
            targets, _ = self.early_wants.get(message.request_id, (set(), 0.0))
            targets.add(target)
            self.early_wants[message.request_id] = (targets, now + self.lease_s)
            # a transport that formats per reader keeps the subscription until published, or
            # fails the reader's fetches of a request freed already
            self.transport.offer(Offer(message.request_id, (), 0, (), message.agent_name,
                                       message, self.lease_s,
                                       gone=message.request_id in self.released))
            return
        pinned.subscribers.add(target)
        self.transport.offer(
            Offer(
                pinned.request_id,
                pinned.block_ids,
                pinned.layer_stop,
                tuple(self.registry.caches),
                message.agent_name,
                message,
                pinned.lease_s,
            )
        )
        if pinned.layer_stop > 0:
            ready = Ready(message.request_id, list(self.registry.local_ranks), pinned.layer_stop)
            self.send(target, encode_message(ready))

    def on_format(self, message: Format, now: float) -> None:
        """A consumer asks for one chunk of a formatted read (`from_owner` checked it):
        gathered into the send pool and answered with `Formatted` (where, or why not). A
        request not published yet, or a full pool, makes the chunk wait (`retry_formats`)
        up to the lease."""
        target = self.consumers.get(message.agent_name)
        if target is None:
            self.stats.failed_notifications += 1
            return
        error = self._format(message, target)
        if error is None:
            # A gather takes a while: let the transport complete what consumers' earlier
            # READs need from this side meanwhile (their notifications), or they finish only
            # once the last chunk is gathered.
            self.transport.progress()
            return
        if error == "wait":
            assert self.formats is not None
            self.formats.waiting.append(WaitingChunk(message, target, now + self.lease_s))
            return
        self._answer_format(target, message, error=error)

    def _format(self, message: Format, target: Target) -> str | None:
        """Gathers and answers a chunk: None when answered, "wait", or the error to send."""
        if self.formats is None:
            return "this engine serves no formatted reads (no send pool)"
        if message.producer_rank not in self.registry.ranks:
            return f"rank {message.producer_rank} is not served by this process"
        if message.generation not in (-1, self.registry.generation):
            return ("stale: the producer re-registered its cache after this read was planned "
                    f"(generation {self.registry.generation}, planned {message.generation})")
        pinned = self.pinned.get(message.request_id)
        num_layers = self.registry.config.spec.num_layers
        needed = min(message.layer_stop or num_layers, num_layers)
        if pinned is None or pinned.layer_stop < needed:
            if message.request_id in self.released:
                return f"request {message.request_id!r} was freed before this read"
            return "wait"  # the layers it reads are not published yet
        entry = self.registry.rank_cache.get(message.producer_rank)
        if (entry is not None and entry.mirror is None and entry.consumed
                and not self._written_in_step(pinned, entry)):
            # A step consumed (donated) the registered cache and its output is not handed
            # over yet (`update_cache`): its memory may be freed or rewritten meanwhile.
            return "wait"
        meta = self.registry.meta
        assert meta is not None
        info = meta.rank_info(message.producer_rank)
        regions = [(r.base_address, r.block_len * r.num_blocks) for r in info.regions]
        try:
            got = self.formats.gather(message, regions, [r.block_len for r in info.regions],
                                      pinned.block_ids)
        except (ValueError, IndexError) as error:
            self.stats.malformed_messages += 1
            return f"{type(error).__name__}: {error}"
        if got is None:
            return "wait"  # the send pool is full: retried as slots free
        self.stats.formatted_chunks_total = self.formats.formatted_chunks
        self._answer_format(target, message, address=got[0], nbytes=got[1])
        return None

    def _written_in_step(self, pinned: Pinned, entry: Any) -> bool:
        """Whether the request's published layers were announced by the step that consumed
        `entry`'s current version (`publish_layer_in_jit`): the step writes them in place,
        in the registered memory, which direct reads READ during the step too, so a chunk of
        those layers is gathered from it now rather than after the step."""
        versions = pinned.step_versions
        caches = self.registry.caches
        if versions is None or len(versions) != len(caches):
            return False
        return any(e is entry and versions[i] == e.version for i, e in enumerate(caches))

    def _answer_format(self, target: Target, message: Format, address: int = 0,
                       nbytes: int = 0, error: str = "") -> None:
        self.send(target, encode_message(Formatted(
            message.request_id, message.attempt, message.chunk, message.producer_rank,
            message.consumer_rank, address, nbytes, error[:1024])))

    def retry_formats(self, now: float) -> None:
        """Gathers the waiting chunks that can be now; fails those past their deadline."""
        if self.formats is None or not self.formats.waiting:
            return
        waiting, self.formats.waiting = self.formats.waiting, []
        for item in waiting:
            error = self._format(item.message, item.target)
            if error == "wait" and now <= item.expiry:
                self.formats.waiting.append(item)
            elif error is not None:
                self._answer_format(item.target, item.message, error=(
                    "timed out waiting for the request's publication or send-pool room"
                    if error == "wait" else error))

    def on_released(self, message: Released) -> None:
        """A consumer's READ of a formatted chunk completed: its send slot is free."""
        if self.formats is not None:
            self.formats.release(FormatServer.key(message))

    def on_done(self, message: Done, hold: bool = True) -> None:
        """A consumer rank's confirmation (`from_owner` checked it): counted while the
        request is pinned, held while it may still be published, answered with `Ack`."""
        pinned = self.pinned.get(message.request_id)
        stale = message.generation != self.registry.generation
        if hold and self._holds_early(message, pinned, stale):
            held = self.early_dones.setdefault(message.request_id, [])
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
            if pinned.state is RequestState.PINNED:
                transition(pinned, RequestState.READING)
        target = self.consumers.get(message.agent_name)
        digests = (pinned.digests.get(message.producer_rank)
                   if live and pinned is not None else None)
        every = digests is not None and pinned is not None and (
            len(digests.positions) == len(pinned.block_ids))
        ack = encode_message(
            Ack(
                message.request_id,
                message.producer_rank,
                message.consumer_rank,
                live,
                message.attempt,
                stale,
                pinned is None and message.request_id not in self.released,
                digest_algorithm=digests.algorithm if digests else "",
                digest_positions=(
                    [] if digests is None or every else digests.positions.tolist()),
                digests=digests.values.astype("<u8").tobytes() if digests else b"",
            )
        )
        if target is None:
            self.stats.failed_notifications += 1
        else:
            self.send(target, ack)

    def _holds_early(self, message: Done, pinned: Pinned | None, stale: bool) -> bool:
        """Whether a Done is for a request this process has not published yet and may still
        publish: a successful read of a rank of this process, in direct mode, within the
        grace window's bounds (the number of held requests is bounded too)."""
        return (
            pinned is None
            and message.ok
            and not stale
            and self.early_read_grace_s > 0
            and message.request_id not in self.released
            and message.producer_rank in self.registry.ranks
            and not self.registry.staged
            and (
                message.request_id in self.early_dones
                or len(self.early_dones) < MAX_OUTCOMES
            )
        )

    # -- polling ----------------------------------------------------------------------------

    def poll(self, now: float, result: PollResult) -> None:
        """Expires held messages, releases finished requests into ``result.freeable``."""
        self.retry_formats(now)
        for request_id, (_, expiry) in list(self.early_wants.items()):
            if now > expiry:
                del self.early_wants[request_id]
        for request_id, held in list(self.early_dones.items()):
            keep = [(m, expiry) for m, expiry in held if now <= expiry]
            for message, expiry in held:
                if now > expiry:
                    self.on_done(message, hold=False)  # refused: never published in time
            if keep:
                self.early_dones[request_id] = keep
            else:
                del self.early_dones[request_id]
        for request_id, pinned in list(self.pinned.items()):
            complete = pinned.complete()
            if complete:
                transition(pinned, RequestState.DONE)
            elif pinned.deadline < 0:
                transition(pinned, RequestState.ABORTED)
            elif now > pinned.deadline:
                self.stats.expired_leases += 1
                transition(pinned, RequestState.EXPIRED)
            else:
                continue
            del self.pinned[request_id]
            self.transport.withdraw(request_id, complete)
            if self.formats is not None:
                self.formats.drop_request(request_id)
            self.released[request_id] = complete
            while len(self.released) > MAX_OUTCOMES:
                del self.released[next(iter(self.released))]
            result.freeable.append(request_id)

    def close(self) -> None:
        for request_id in list(self.pinned):
            self.transport.withdraw(request_id)
        self.pinned.clear()
        self.early_dones.clear()
