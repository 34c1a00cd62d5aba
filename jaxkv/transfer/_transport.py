"""What moves the bytes (`Transport`) and what carries the control messages (`ControlChannel`).

The transfer protocol (`jaxkv.transfer._protocol`, the producer and consumer roles) is written
against these two small interfaces; `KVTransferEngine(transport=...)` picks the
implementations.

A **transport** moves a request's KV from producer ranks to consumer ranks. It is asked:

* at registration: `register` / `deregister` the regions of the registered caches (NIXL
  registers the memory; a transport that moves arrays may ignore them);
* for the metadata: `describe` returns this process's `AgentInfo` entries of
  `EngineMetadata.agents` (NIXL: the agent's serialized metadata; another transport: e.g. its
  server address), and ``name`` goes into `EngineMetadata.transport`; a peer's entries are
  validated with `check_peer` before `connect_peer` loads them;
* on the producer side: `offer` when a request (or more of its layers) becomes readable, or
  a consumer subscribed to it (`Offer.consumer`), and `withdraw` once the request is freed,
  aborted or expired (a transport that keeps per-request buffers frees them there). Both are
  no-ops for NIXL, whose registered memory is passively readable;
* on the consumer side: `prepare_fetch` (pure planning, may raise `PlanError`) then
  `start_fetch` for each (local rank, producer rank) piece of a read, `check` until
  ``"DONE"`` (or ``"ERR"``), `release` each handle; `progress` from every poll;
* ``announces_reads``: whether every read starts with the consumer's `Want` (its read id,
  number of blocks and side-channel address), which the producer hands to `offer`: for a
  transport that prepares one buffer per consumer rank (False for NIXL);
* ``attaches_notifications``: whether `start_fetch` can deliver a control message to the
  producer when the fetch completed (NIXL: the READ's notification); such messages come out
  of the producer's `notifications`;
* ``moves_arrays``: whether it moves arrays (formats the request on the producer, writes the
  pulled values into the consumer's current cache with JAX ops) rather than reading
  registered memory by address. Such a transport is given the engine's cache registry
  (`attach`), does its JAX work in `serve` (called from the engine's poll) or on a thread of
  its own, never in a jitted step's callback, and its consumer reads skip the producer-side
  post-processing;
* ``takes_layer_rows``: whether a layer announced from inside a jitted step
  (`publish_layer_in_jit`) should carry the request's rows of that layer to the transport
  (`Offer.rows`: host bytes, the step's cache is donated until the step ends) so that it can
  serve them before the step ends (the JAX transport formats and offers them from a worker
  thread; NIXL reads registered memory and needs no rows);
* ``formats_reads``: whether it can make and serve *formatted* reads
  (`jaxkv.transfer._formatted`: the producer gathers a read's byte ranges into a registered
  send buffer, the consumer READs it in large chunks and scatters it; NIXL with its pools);
  such a transport has `start_formatted` and a ``format_server``;
* `control_channels`: the control channels it brings besides TCP (NIXL: its notifications);
* `error_of`: why a fetch failed, when the transport knows.

Every capability is declared: the protocol layer never asks which transport it has.

A **control channel** carries the msgspec control messages (`Hello`, `Heartbeat`, `Want`,
`Ready`, `Done`, `Ack`) between a consumer process and a producer process: the consumer
`connect`s to each producer process (its side-channel address and published agent), sends
`Hello` with `hello_payload`, and the producer `accept`s it as the target of its answers.
A channel that authenticates its connections (TCP with a deployment key) tells the engine id
a sender proved (`identity`): the producer binds it to the consumer's `Hello`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from jaxkv.transfer._metadata import AgentInfo, EngineMetadata, RegionInfo
from jaxkv.transfer._plan import ReadPlan

__all__ = ["ControlChannel", "Fetch", "Offer", "Transport"]


@dataclasses.dataclass(frozen=True)
class Fetch:
    """One piece of a consumer read: what one local rank reads from one producer rank.

    Attributes:
      request_id: the producer's request id.
      read_id: the consumer's key of the read.
      local: this engine's metadata.
      peer: the producer engine's (merged) metadata.
      plan: the local rank's read plan (restricted to `layer` for a layer-wise read).
      remote_rank: the producer rank read from (one of ``plan.read_ranks``).
      layer: the global layer of a layer-wise piece (None: every layer of the plan).
    """

    request_id: str
    read_id: str
    local: EngineMetadata
    peer: EngineMetadata
    plan: ReadPlan
    remote_rank: int
    layer: int | None = None
    attempt: int = 0  # the consumer's attempt number of the read (unique per process)


@dataclasses.dataclass(frozen=True)
class Offer:
    """A producer request a transport may prepare for its consumers.

    Attributes:
      request_id: the request.
      block_ids: its blocks on this engine, in token order.
      layer_stop: the global layers ``[0, layer_stop)`` are written and readable.
      caches: the registry's entries (`jaxkv.transfer._registry.Registered`: the current
        cache, its ranks and global layer range) to gather the bytes from.
      consumer: the published agent name of a consumer process that subscribed (`Want`), or
        None when the request (or more of its layers) was published.
      want: that consumer's `Want` (its read id, how many blocks it reads, its side-channel
        address: see ``Transport.announces_reads``), or None.
      lease_s: the request's lease (None: the transport's default).
      gone: the subscriber asked for a request already freed here.
      rows: the announced layers' rows, for a transport that ``takes_layer_rows``.
      in_step: the layers were announced from inside the jitted step that consumed
        (donated) the registered caches, which it writes in place: while it runs their bytes
        are only in that step's memory (see ``Transport.reads_step_memory``).
    """

    request_id: str
    block_ids: tuple[int, ...]
    layer_stop: int
    caches: Sequence[Any]
    consumer: str | None = None
    want: Any = None  # the subscriber's `Want` message (a transport that formats per reader)
    lease_s: float | None = None  # the request's lease
    gone: bool = False  # the subscriber asked for a request already freed here
    # layers announced from inside a jitted step (``takes_layer_rows``): ``(first global
    # layer, per array of the registered cache its request rows of the announced layers
    # (numpy, the array's dtype bits) or None)``
    rows: tuple[int, list[Any]] | None = None
    in_step: bool = False


class Transport(Protocol):
    """Moves KV bytes between the ranks of two engines (see the module docstring)."""

    name: str
    endpoint: str
    attaches_notifications: bool
    announces_reads: bool  # the consumer sends `Want` for every read (not only layer-wise)
    moves_arrays: bool  # moves arrays with JAX ops instead of reading memory by address
    formats_reads: bool  # gathered (formatted) reads, `jaxkv.transfer._formatted`
    takes_layer_rows: bool  # in-step layer announcements carry their rows (`Offer.rows`)
    layer_group_bytes: int  # the least bytes of a layer group of its layer-wise reads (0: none)
    format_server: Any  # `jaxkv.transfer._formatted.FormatServer` of formatted reads, or None

    def attach(self, registry: Any) -> None:
        """The engine's `CacheRegistry`, once (a transport that moves arrays formats from,
        and writes into, its current caches; others ignore it)."""
        ...

    def control_channels(self) -> dict[str, ControlChannel]:
        """Control channels this transport carries besides TCP, by name (may be empty)."""
        ...

    def reads_step_memory(self, cache: Any) -> bool:
        """Whether this transport (one that ``takes_layer_rows``) serves the layers a jitted
        step announces from `cache`'s memory while the step runs, so that the step carries
        no rows (False for a transport that takes no rows)."""
        ...

    def serve(self) -> None:
        """Producer: work that runs JAX ops (formatting offered requests), from the engine's
        poll only; a no-op for a transport without such work."""
        ...

    def error_of(self, handle: Any) -> str | None:
        """Why a fetch failed (None: it did not, or the transport cannot tell)."""
        ...

    def register(self, regions: Sequence[RegionInfo]) -> None:
        """Makes registered-cache regions readable by peers (repeats take a reference)."""
        ...

    def deregister(self, regions: Sequence[RegionInfo]) -> None:
        """Drops one reference to each region (released with the last)."""
        ...

    def describe(self) -> list[AgentInfo]:
        """This process's entries of `EngineMetadata.agents` (named ``endpoint``)."""
        ...

    def check_peer(self, meta: EngineMetadata) -> None:
        """Raises `MetadataError` if a peer's transport entries are unusable."""
        ...

    def connect_peer(self, agents: Sequence[AgentInfo]) -> dict[str, str]:
        """Loads a peer's processes; returns published agent name -> transport's name."""
        ...

    def disconnect_peer(self, names: Iterable[str]) -> None:
        """Forgets peer processes by the names `connect_peer` returned."""
        ...

    def offer(self, offer: Offer) -> None:
        """Producer: a request (or more of its layers, or a new consumer) is readable."""
        ...

    def withdraw(self, request_id: str, confirmed: bool = False) -> None:
        """Producer: the request was freed (``confirmed``: every read of it confirmed);
        nothing of it may be read any more."""
        ...

    def prepare_fetch(self, fetch: Fetch) -> Any:
        """Consumer: plans one piece (no I/O); raises `PlanError` / `KeyError`."""
        ...

    def start_fetch(self, prepared: Any, notification: bytes = b"") -> Any:
        """Consumer: posts a prepared piece; returns its handle. `notification` (only when
        ``attaches_notifications``) reaches the producer once the piece completed.

        Raises:
          ConnectionError: the transport refused to post it.
        """
        ...

    def check(self, handle: Any) -> str:
        """``"DONE"``, ``"PROC"`` or ``"ERR"``."""
        ...

    def release(self, handle: Any) -> bool:
        """Frees a handle (cancels it if still running); False if it could not be."""
        ...

    def notifications(self) -> list[tuple[str, bytes]]:
        """Control messages delivered by the transport (attached to fetches): (sender,
        payload), each once."""
        ...

    def progress(self) -> None:
        """Moves queued work along (called from every poll)."""
        ...

    def close(self) -> None:
        """Releases everything (idempotent)."""
        ...


class ControlChannel(Protocol):
    """Carries encoded control messages between engine processes (see the module docstring).

    Targets and senders are opaque strings chosen by the channel.
    """

    name: str

    def hello_payload(self) -> bytes:
        """What this process's `Hello` carries for the producer's `accept`."""
        ...

    def connect(self, address: tuple[str, int], agent: str, transport_name: str) -> str:
        """Consumer: the target of a producer process (its side-channel address, published
        agent name and the transport's name for it). Raises `ConnectionError`."""
        ...

    def accept(self, agent: str, sender: str, payload: bytes) -> str:
        """Producer: the target to answer a consumer process whose `Hello` (`payload`) came
        from `sender`. Raises `ValueError` for a payload it cannot use."""
        ...

    def send(self, target: str, payload: bytes) -> bool:
        """Sends one message (never blocks for long); False if the target is gone."""
        ...

    def receive(self) -> list[tuple[str, bytes]]:
        """Messages that arrived, (sender, payload), each once."""
        ...

    def forget(self, target: str) -> None:
        """Drops a target `accept` returned (its process re-introduced itself)."""
        ...

    def identity(self, sender: str) -> str | None:
        """The engine id the sender proved with the deployment key (None: not proved)."""
        ...

    def close(self) -> None:
        """Closes every connection (idempotent)."""
        ...
