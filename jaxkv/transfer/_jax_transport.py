"""The JAX transfer-server transport: KV moved as arrays with `jax.experimental.transfer`.

`jax.experimental.transfer` (the transport of JAX serving on TPUs: tpu-inference's TPU
connector, sglang-jax's disaggregation) moves whole arrays between processes over TCP/DCN: a
producer posts arrays under an integer uuid (`TransferServer.await_pull`), a consumer fetches
them by uuid and shape (`TransferConnection.pull`). It needs no NIXL and no registered memory.
The request's blocks are formatted for each consumer rank by `jaxkv.transfer._formatter`.

* `PullServer` (producer): one transfer server per engine process. `offer` posts a request's
  buffers, one uuid per (request, producer rank, consumer rank, generation) (`pull_uuid`),
  and keeps them alive until `release` (the consumer's `Done` confirmed the pull) or until
  the offer's lease expired (`expire`; the server's own entry expires at the same deadline
  and is swept). Buffers are fresh arrays made by the formatter, never views of a cache that
  a later step may donate (no ``use_raw_buffers``). The bytes held by pending offers are
  bounded by ``budget_bytes``: an offer beyond it raises `PullBudgetError` (nothing is
  posted), and the caller waits for releases or fails the request.
* `Puller` (consumer): pulls buffers by uuid onto the consumer rank's device; `PendingPull`
  reports completion without blocking; a pull not complete by its deadline is failed by
  poisoning its connection (a transfer-server pull of a uuid that is never posted, or whose
  offer expired, never completes by itself), and the next pull reconnects.

The API is the same on jax 0.10.2 and 0.12 (`start_transfer_server`, `await_pull`,
`connect(...).pull`, absolute `datetime` timeouts).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime
import functools
import hashlib
import itertools
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = [
    "JaxTransport",
    "PendingPull",
    "PullBudgetError",
    "PullServer",
    "PullTimeoutError",
    "Puller",
    "jax_transfer_available",
    "pull_uuid",
]

_UUID_MASK = (1 << 62) - 1
_SWEEP_BASE = 1 << 62  # uuids of the sweeping offers: never a pull_uuid
_sweep_counter = itertools.count()


class PullBudgetError(RuntimeError):
    """An offer would exceed the bytes the producer may hold for pending pulls."""


class PullTimeoutError(TimeoutError):
    """A pull did not complete by its deadline (the offer expired, was never made, or the
    producer died)."""


def jax_transfer_available() -> bool:
    """Whether this jax provides `jax.experimental.transfer` with a transfer server."""
    try:
        from jax.experimental import transfer
    except ImportError:
        return False
    return hasattr(transfer, "start_transfer_server")


def pull_uuid(key: str, generation: int, producer_rank: int, consumer_rank: int) -> int:
    """The uuid both sides derive for one buffer route of one request.

    Args:
      key: names the request and its read on both sides (e.g. ``"engine/request/read"``).
      generation: the producer's generation (a restarted producer never serves old uuids).
      producer_rank, consumer_rank: the route.

    Returns:
      A 62-bit integer (blake2b of the fields).

    Example:
      >>> pull_uuid("prefill/req-1/read-1", 7, 0, 1) == pull_uuid("prefill/req-1/read-1", 7, 0, 1)
      True
      >>> pull_uuid("prefill/req-1/read-1", 7, 0, 1) != pull_uuid("prefill/req-1/read-1", 7, 1, 0)
      True
    """
    text = f"{key}\x00{int(generation)}\x00{int(producer_rank)}\x00{int(consumer_rank)}"
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & _UUID_MASK


def _deadline(seconds: float) -> datetime.datetime:
    return datetime.datetime.now() + datetime.timedelta(seconds=max(0.0, float(seconds)))


def _default_client() -> Any:
    import jax

    return jax.devices()[0].client


@dataclasses.dataclass
class _Offer:
    request_id: str
    uuid: int
    arrays: list[Any]
    nbytes: int
    deadline: float  # time.monotonic()


class PullServer:
    """Producer side: one `jax.experimental.transfer` server and the buffers it offers.

    Args:
      host: the interface to listen on (the address peers connect to).
      budget_bytes: the most bytes pending offers may hold (None: unbounded).
      pool_bytes: the most bytes of released buffers kept for reuse (`take`): buffers whose
        pull was confirmed are split into again instead of allocating fresh ones.
      client: the JAX client whose devices hold the buffers (default: the first device's).

    Raises:
      RuntimeError: this jax has no transfer server.

    Example:
      >>> server = PullServer(budget_bytes=1 << 20)
      >>> uuid = pull_uuid("prefill/r1", 0, 0, 0)
      >>> server.offer("r1", uuid, [jnp.arange(4.0)], lease_s=5.0)
      16
      >>> server.held_bytes, server.release("r1"), server.held_bytes
      (16, 16, 0)
      >>> server.offer("r2", pull_uuid("prefill/r2", 0, 0, 0), [jnp.zeros(1 << 19)], 5.0)
      Traceback (most recent call last):
      ...
      jaxkv.transfer._jax_transport.PullBudgetError: request 'r2' needs 2097152 bytes ...
    """

    def __init__(self, host: str = "127.0.0.1", budget_bytes: int | None = None,
                 pool_bytes: int = 256 << 20, client: Any = None):
        if not jax_transfer_available():
            raise RuntimeError("this jax has no jax.experimental.transfer server")
        from jax.experimental import transfer

        if budget_bytes is not None and budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self._client = client if client is not None else _default_client()
        self._server = transfer.start_transfer_server(
            self._client, f"{host}:0", [f"{host}:0"])
        self._lock = threading.Lock()
        self._offers: dict[int, _Offer] = {}
        self._by_request: dict[str, set[int]] = {}
        self._held = 0
        self.pool_bytes = int(pool_bytes)
        self._pool: dict[tuple, list[Any]] = {}
        self._pooled = 0
        self._expired_in_server = False
        self._tiny: Any = None
        self._closed = False

    @property
    def address(self) -> str:
        """``host:port`` consumers connect to."""
        return str(self._server.address())

    @property
    def server(self) -> Any:
        """The underlying `jax.experimental.transfer.TransferServer` (a consumer in the same
        process connects through it)."""
        return self._server

    @property
    def held_bytes(self) -> int:
        """Bytes of the buffers of pending offers."""
        return self._held

    @property
    def num_offers(self) -> int:
        return len(self._offers)

    def pending_requests(self) -> list[str]:
        with self._lock:
            return sorted(self._by_request)

    def fits(self, nbytes: int) -> bool:
        """Whether offers of `nbytes` more would stay within the budget now."""
        return self.budget_bytes is None or self._held + int(nbytes) <= self.budget_bytes

    def check_budget(self, request_id: str, nbytes: int) -> None:
        """Raises `PullBudgetError` unless offers of `nbytes` more fit the budget now (call
        before formatting a request, so that a refused one costs nothing)."""
        if not self.fits(nbytes):
            raise PullBudgetError(
                f"request {request_id!r} needs {int(nbytes)} bytes for pending pulls; "
                f"{self._held} of the {self.budget_bytes}-byte budget are held")

    def offer(self, request_id: str, uuid: int, arrays: Sequence[Any], lease_s: float) -> int:
        """Posts `arrays` for one pull of `uuid`, held until `release` or `lease_s` passed.

        Args:
          request_id: the request the buffers belong to (`release` / `expire` key).
          uuid: the pull's uuid (`pull_uuid`), unused by a pending offer.
          arrays: fresh device arrays (not views of a cache that may be donated).
          lease_s: seconds the offer waits for its pull.

        Returns:
          The bytes now held for the offer.

        Raises:
          PullBudgetError: the offer does not fit the budget (nothing was posted).
          ValueError: a uuid already pending, a non-positive lease, or a closed server.
        """
        return self.offer_many(request_id, [(uuid, arrays)], lease_s)

    def offer_many(self, request_id: str, items: Sequence[tuple[int, Sequence[Any]]],
                   lease_s: float) -> int:
        """`offer` for several uuids of one request, all or nothing against the budget."""
        if not lease_s > 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s}")
        posted = [(int(uuid), list(arrays)) for uuid, arrays in items]
        nbytes = sum(int(a.nbytes) for _, arrays in posted for a in arrays)
        with self._lock:
            if self._closed:
                raise ValueError("the pull server is closed")
            for uuid, _ in posted:
                if uuid in self._offers or not 0 <= uuid <= _UUID_MASK:
                    raise ValueError(f"uuid {uuid} is pending or outside [0, 2^62)")
            self.check_budget(request_id, nbytes)
            deadline = time.monotonic() + float(lease_s)
            for uuid, arrays in posted:
                self._server.await_pull(uuid, arrays, timeout=_deadline(lease_s))
                self._offers[uuid] = _Offer(request_id, uuid, arrays,
                                            sum(int(a.nbytes) for a in arrays), deadline)
                self._by_request.setdefault(request_id, set()).add(uuid)
            self._held += nbytes
        return nbytes

    def offer_failures(self, items: Sequence[tuple[int, Sequence[Any]]],
                       lease_s: float) -> None:
        """Posts error arrays (`jax.experimental.transfer.make_error_array`) under the uuids
        of `items` that have no pending offer, so that their pulls fail at once; held by the
        transfer server only (no budget, no request), until pulled or `lease_s` passed."""
        with self._lock:
            for uuid, arrays in items:
                if int(uuid) not in self._offers:
                    self._server.await_pull(int(uuid), list(arrays),
                                            timeout=_deadline(lease_s))

    def release(self, request_id: str, pulled: bool = True) -> int:
        """Drops the buffers of a request: its pulls completed (the consumer's `Done` said
        so: the buffers go to the reuse pool), or it was aborted (``pulled=False``: dropped;
        the transfer server keeps an unpulled offer until its lease passed and it is swept).

        Returns:
          The bytes released (0 for a request with no pending offers).
        """
        with self._lock:
            return self._drop(request_id, pulled)

    def _drop(self, request_id: str, pulled: bool = False) -> int:
        freed = 0
        now = time.monotonic()
        for uuid in self._by_request.pop(request_id, set()):
            offer = self._offers.pop(uuid)
            freed += offer.nbytes
            if offer.deadline <= now:
                self._expired_in_server = True
            elif pulled:
                # Reused (donated) by a later split. An offer of the request that was never
                # pulled (another reader's, freed with the request) then fails its pull
                # ("donated buffer") instead of serving other bytes; such a reader's Done is
                # refused anyway (the request is freed).
                for array in offer.arrays:
                    self._keep(array)
        self._held -= freed
        return freed

    def _keep(self, array: Any) -> None:
        nbytes = int(array.nbytes)
        if self._pooled + nbytes > self.pool_bytes:
            return
        key = (tuple(array.shape), str(array.dtype), next(iter(array.sharding.device_set)))
        self._pool.setdefault(key, []).append(array)
        self._pooled += nbytes

    @property
    def pooled_bytes(self) -> int:
        """Bytes of released buffers kept for reuse."""
        return self._pooled

    def take(self, device: Any, shapes: Sequence[tuple[tuple[int, ...], Any]]) -> list | None:
        """Reusable buffers of these ``(shape, dtype)`` on `device` from the pool, all or
        none (None); they leave the pool (donate them to the op that fills them)."""
        keys = [(tuple(int(d) for d in shape), str(np.dtype(dtype)), device)
                for shape, dtype in shapes]
        with self._lock:
            need: dict[tuple, int] = {}
            for key in keys:
                need[key] = need.get(key, 0) + 1
            if any(len(self._pool.get(key, ())) < count for key, count in need.items()):
                return None
            out = [self._pool[key].pop() for key in keys]
            self._pooled -= sum(int(a.nbytes) for a in out)
            return out

    def expire(self, now: float | None = None) -> list[str]:
        """Drops every request with an offer whose lease passed, and sweeps the server's
        expired entries (the transfer server frees an expired buffer only when its table is
        next touched: a tiny offer that expires at once touches it).

        Returns:
          The requests dropped.
        """
        now = time.monotonic() if now is None else now
        with self._lock:
            expired = sorted({o.request_id for o in self._offers.values() if o.deadline <= now})
            for request_id in expired:
                self._drop(request_id)
            if expired or self._expired_in_server:
                self._sweep()
        return expired

    def _sweep(self) -> None:
        import jax.numpy as jnp

        self._expired_in_server = False
        uuid = _SWEEP_BASE + next(_sweep_counter) % _SWEEP_BASE
        if self._tiny is None:
            self._tiny = jnp.zeros((1,), jnp.uint8)
        self._server.await_pull(uuid, [self._tiny], timeout=_deadline(0.0))

    def close(self) -> None:
        """Drops every pending offer (idempotent). The server itself lives until the process
        ends (jax offers no way to stop it); its table is reset."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._offers.clear()
            self._by_request.clear()
            self._pool.clear()
            self._held = self._pooled = 0
            reset = getattr(self._server, "_reset_rendevous_table", None)
            if reset is not None:
                reset()


class PendingPull:
    """Buffers being pulled for one uuid (see `Puller.pull`)."""

    def __init__(self, puller: Puller, address: str, uuid: int, arrays: list[Any],
                 deadline: float):
        self._puller = puller
        self.address = address
        self.uuid = uuid
        self.arrays = arrays
        self.deadline = deadline
        self.error: str | None = None

    def status(self, now: float | None = None) -> str:
        """``"DONE"`` (every array arrived), ``"PROC"`` or ``"ERR"`` (failed, or past the
        deadline: its connection is poisoned and dropped). Never blocks."""
        if self.error is not None:
            return "ERR"
        try:
            if all(a.is_ready() for a in self.arrays):
                for a in self.arrays:
                    a.block_until_ready()  # raises the pull's error, if any
                return "DONE"
        except Exception as error:  # noqa: BLE001 - a failed pull surfaces as its array's error
            self.error = f"pull {self.uuid} from {self.address} failed: {error}"
            return "ERR"
        now = time.monotonic() if now is None else now
        if now >= self.deadline:
            self.error = (f"pull {self.uuid} from {self.address} did not complete in time (the "
                          "offer expired or was never made, or the producer is gone)")
            self._puller.poison(self.address)
            return "ERR"
        return "PROC"

    def wait(self, timeout_s: float) -> list[Any]:
        """Blocks until done (polling), at most `timeout_s` (the pull keeps its deadline).

        Raises:
          PullTimeoutError: not done in time.
          RuntimeError: the pull failed.
        """
        started = time.monotonic()
        limit = started + float(timeout_s)
        while True:
            state = self.status()
            if state == "DONE":
                return self.arrays
            if state == "ERR":
                assert self.error is not None
                if "in time" in self.error:
                    raise PullTimeoutError(self.error)
                raise RuntimeError(self.error)
            now = time.monotonic()
            if now >= limit:
                raise PullTimeoutError(f"pull {self.uuid} from {self.address} still running "
                                       f"after {timeout_s} s")
            # yield at once for the first millisecond (small pulls), then back off (a
            # polling loop takes CPU from the transfer itself on a busy host): at most 1 ms
            # or 2% late
            elapsed = now - started
            time.sleep(0 if elapsed < 0.001 else min(0.001, elapsed / 50))


class Puller:
    """Consumer side: pulls offered buffers, one cached connection per producer address.

    Args:
      server: a `PullServer` of this process (its transfer server makes the connections),
        or None to start one.
      host: the interface of the server started when `server` is None.
    """

    def __init__(self, server: PullServer | None = None, host: str = "127.0.0.1"):
        self.server = server if server is not None else PullServer(host)
        self._connections: dict[str, Any] = {}
        self._lock = threading.Lock()

    def _connection(self, address: str) -> Any:
        with self._lock:
            conn = self._connections.get(address)
            if conn is None:
                conn = self.server.server.connect(address)
                self._connections[address] = conn
            return conn

    def drop(self, address: str) -> None:
        """Forgets the connection to `address` (pulls in flight on it continue)."""
        with self._lock:
            self._connections.pop(address, None)

    def poison(self, address: str) -> None:
        """Fails every pull in flight on the connection to `address` and drops it."""
        with self._lock:
            conn = self._connections.pop(address, None)
        if conn is not None:
            conn._poison_connection()

    def pull(self, address: str, uuid: int, shapes: Sequence[tuple[tuple[int, ...], Any]],
             device: Any, timeout_s: float) -> PendingPull:
        """Starts pulling the buffers of `uuid` from the producer at `address` onto `device`.

        Args:
          address: the producer's `PullServer.address`.
          uuid: the offer's uuid (`pull_uuid`).
          shapes: ``(shape, dtype)`` of each buffer, in offer order.
          device: where the buffers land.
          timeout_s: the pull fails (`PendingPull.status` -> ``"ERR"``) if not complete by then.

        Returns:
          A `PendingPull` (never blocks).
        """
        import jax

        sharding = jax.sharding.SingleDeviceSharding(device)
        avals = [jax.ShapeDtypeStruct(tuple(s), d, sharding=sharding) for s, d in shapes]
        conn = self._connection(address)
        arrays = list(conn.pull(int(uuid), avals))
        return PendingPull(self, address, int(uuid), arrays, time.monotonic() + float(timeout_s))


# -- the Transport of KVTransferEngine(transport="jax") --------------------------------------


@dataclasses.dataclass
class _Want:
    """A consumer process's subscription to a request (from its `Want`)."""

    message: Any
    expiry: float = 0.0  # time.monotonic() past which an unpublished request's want is dropped
    served: bool = False
    # a layer-wise read (``message.layer_group_bytes > 0``): its layer groups
    # (`layer_groups`) and how many of them were offered (or are not this process's)
    groups: tuple[tuple[int, int], ...] | None = None
    offered: int = 0
    consumer: Any = None  # the consumer's EngineConfig (`_consumer_config`), once made

    def waits_for(self, stop: int) -> bool:
        """Whether a layer-wise subscription's next group is not written yet (layers
        ``[0, stop)`` are): nothing to offer it until more layers are published."""
        return (self.groups is not None and self.offered < len(self.groups)
                and self.groups[self.offered][1] > stop)


@dataclasses.dataclass
class _Piece:
    """One consumer rank's share of a read: its pulls (one per source rank)."""

    group: _ReadGroup
    rank: int
    routes: tuple
    addresses: tuple[str, ...]
    uuids: tuple[int, ...]
    device: Any
    pulls: list[PendingPull] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _ReadGroup:
    """Every piece of one read in this process: written into the caches together once all
    their pulls arrived."""

    key: tuple
    local_ids: tuple[int, ...]
    num_remote: int
    consumer: Any  # EngineConfig
    producer: Any  # EngineConfig
    pieces: list[_Piece] = dataclasses.field(default_factory=list)
    written: bool = False
    error: str | None = None
    layers: tuple[int, int] | None = None  # one layer group of a layer-wise read (else all)
    expected: int = 0  # pieces prepared: written only once every one of them arrived


def _group_key(key: tuple[str, str, int], layers: tuple[int, int]) -> str:
    """The uuid key of one layer group of a read (`pull_uuid`): the read's key and the
    group's global layer range, so that each side derives it from the range alone."""
    return f"{key[0]}/{key[1]}/{key[2]}/layers:{int(layers[0])}-{int(layers[1])}"


def _address_of(agent: Any) -> str:
    from jaxkv.transfer._metadata import MetadataError

    try:
        address = bytes(agent.metadata).decode("ascii")
    except UnicodeDecodeError as error:
        raise MetadataError(f"agent {agent.name!r}: its transfer-server address is not "
                            "ASCII") from error
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise MetadataError(f"agent {agent.name!r} publishes no transfer-server address "
                            f"host:port (got {address[:64]!r})")
    return address


def entry_devices(entry: Any, config: Any) -> dict[int, Any]:
    """Engine rank -> device of a registered cache (`Registered`): one TP rank's cache or
    one sharded over every TP rank of its pipeline stage."""
    from jaxkv.transfer._formatter import rank_devices

    pp_rank = config.coordinates(entry.ranks[0])[1]
    if entry.cache.tp_size != config.tp_size or len(entry.ranks) == 1 and config.tp_size > 1:
        tp_rank = config.coordinates(entry.ranks[0])[0]
        return rank_devices(entry.cache, config, pp_rank, tp_rank)
    return rank_devices(entry.cache, config, pp_rank)


def gather_layer_rows(entry: Any, buffers: Sequence[Any], block_ids: Sequence[int],
                      layers: tuple[int, int]) -> list[np.ndarray | None]:
    """`split_layers`'s rows of the global layers ``[a, b)`` of blocks `block_ids`, copied
    from the memory of a registered cache's device buffers (`PagedKVCache.shard_buffers`,
    XLA:CPU: host memory), no JAX: per cache array the rows of those layers (unsigned ints
    of the array's width), None for an array of other layers.

    For a running step that consumed (donated) the cache and writes it in place: the layers
    it announced are final in that memory (the announcement was ordered after their writes).

    Raises:
      FormatError: a buffer's size does not match its shard's shape.
    """
    import ctypes

    from jaxkv.transfer._formatter import FormatError

    cache = entry.cache
    axes = cache.spec.block_axes()
    layer_axis = 1 + axes.index("L") if "L" in axes else None
    lo, hi = int(layers[0]) - entry.layer_start, int(layers[1]) - entry.layer_start
    ids = np.asarray(block_ids, dtype=np.intp).reshape(-1)
    out: list[np.ndarray | None] = []
    for index, ((array_layer, _), array) in enumerate(zip(cache.array_keys, cache.arrays)):
        if array_layer is None and layer_axis is not None:
            window: slice | None = slice(lo, hi)
        elif array_layer is not None and lo <= array_layer < hi:
            window = None
        else:
            out.append(None)
            continue
        dtype = np.dtype(f"u{np.dtype(array.dtype).itemsize}")
        shape = [len(ids), *array.shape[1:]]
        if window is not None and layer_axis is not None:
            shape[layer_axis] = hi - lo
        rows = np.empty(shape, dtype)
        where = array.sharding.devices_indices_map(tuple(array.shape))
        shard = array.sharding.shard_shape(tuple(array.shape))
        for buffer in buffers:
            if buffer.array_index != index:
                continue
            place = where[buffer.device]
            if int(np.prod(shard)) * dtype.itemsize != buffer.nbytes:
                raise FormatError(f"array {index}'s buffer on {buffer.device} holds "
                                  f"{buffer.nbytes} bytes, its shard {shard} "
                                  f"{int(np.prod(shard)) * dtype.itemsize}")
            memory = (ctypes.c_char * buffer.nbytes).from_address(buffer.address)
            view = np.frombuffer(memory, dtype).reshape(shard)
            pick = (ids,) + tuple(window if a == layer_axis else slice(None)
                                  for a in range(1, view.ndim))
            rows[(slice(None),) + tuple(slice(None) if a == layer_axis else place[a]
                                        for a in range(1, view.ndim))] = view[pick]
        out.append(rows)
    return out


class JaxTransport:
    """`Transport` over `jax.experimental.transfer` (``KVTransferEngine(transport="jax")``).

    Producer: a consumer process's `Want` names its read and geometry; once the request is
    published (every layer written), its blocks are formatted for that process's ranks
    (`jaxkv.transfer._formatter.split_request`) and offered on the `PullServer` under
    `pull_uuid` ``(consumer endpoint/read id/attempt, 0, producer rank, consumer rank)``,
    until `withdraw` (the request was freed: every read confirmed, aborted or expired). An
    offer beyond ``budget_bytes`` waits (retried from `progress`) while the request is
    pinned; a request that can never fit, or cannot be formatted, is offered as error arrays
    (the consumer's pull fails at once with the reason).

    Consumer: one fetch per local rank pulls the buffers of its source ranks; once every
    fetch of the read in this process arrived, `check` writes them into the registered
    caches (`concat_request`, in place) and reports ``"DONE"``.

    Layer-wise reads (``Want.layer_group_bytes > 0``): the request travels in layer groups
    (`jaxkv.transfer._formatter.layer_groups`: consecutive layers of at least
    ``layer_group_bytes``, never across a pipeline stage of either engine; both sides derive
    the same ranges from the Want), each under its own uuids (the read's key and the range).
    The consumer posts every group's pulls at once (`prepare_layers`); the producer offers a
    group once its layers are published (`serve`, from the engine's `poll`), and the consumer
    writes each group into its cache as it arrives (`concat_layers`: only those layers).
    Layers announced from inside a jitted step (`publish_layer_in_jit`) arrive with their
    rows (``takes_layer_rows``: host copies of the request's rows of those layers, the only
    bytes of them there are while the step runs: its cache is donated): a worker thread
    formats each group whose layers are all announced from those rows and offers it, while
    the step computes the later layers (no JAX runs in the step's callback; on XLA:CPU the
    worker's programs run beside the step). The rows are kept until every subscriber was
    served (or the request is freed). A cache over several XLA:CPU devices takes no rows: the
    worker gathers the groups from the memory the step writes in place and formats them on a
    host device outside the step's mesh (`reads_step_memory`).

    Args:
      endpoint: this process's unique name.
      host: the interface the transfer server listens on.
      budget_bytes, pool_bytes: see `PullServer`.
      pull_timeout_s: a pull not complete by then fails.
      lease_s: the default lease of an offer.
      layer_group_bytes: the least bytes of a layer group of this process's layer-wise
        reads (sent in its `Want`; the producer follows it); 0: layer-wise requests are
        pulled whole once every layer is written.
    """

    name = "jax"
    attaches_notifications = False
    announces_reads = True  # the consumer's `Want` (sent by `Consumer._start_arrays`)
    moves_arrays = True
    formats_reads = False  # its own formatter moves arrays (no registered memory)
    takes_layer_rows = True  # formats layers announced inside a step from their rows
    format_server = None

    def __init__(self, endpoint: str, host: str = "127.0.0.1", budget_bytes: int | None = None,
                 pool_bytes: int = 256 << 20, pull_timeout_s: float = 30.0,
                 lease_s: float = 30.0, layer_group_bytes: int | None = None):
        from jaxkv.transfer._formatter import LAYER_GROUP_BYTES

        self.endpoint = endpoint
        self.layer_group_bytes = (LAYER_GROUP_BYTES if layer_group_bytes is None
                                  else int(layer_group_bytes))
        if self.layer_group_bytes < 0:
            raise ValueError(f"layer_group_bytes must be >= 0, got {layer_group_bytes}")
        self.server = PullServer(host, budget_bytes, pool_bytes)
        self.puller = Puller(self.server)
        self.pull_timeout_s = float(pull_timeout_s)
        self.lease_s = float(lease_s)
        self.registry: Any = None
        self._addresses: dict[str, str] = {}  # published agent name -> server address
        self._wants: dict[str, dict[tuple[str, str, int], _Want]] = {}
        # ids, lease, layer stop (layers [0, stop) written)
        self._published: dict[str, tuple[tuple[int, ...], float, int]] = {}
        self._groups: dict[tuple, _ReadGroup] = {}
        self.errors: list[str] = []  # recent formatting / offering failures (producer side)
        # Rows of layers announced from inside a jitted step (`Offer.rows`): request ->
        # global layer -> {cache array index: that layer's request rows}.
        self._layer_rows: dict[str, dict[int, dict[int, np.ndarray]]] = {}
        # Layers announced from inside the step that consumed the registered cache, where
        # the announcements carry no rows (`reads_step_memory`): request -> the registry's
        # versions then (its groups are gathered from that step's memory while they hold),
        # and the buffer addresses its groups were gathered from (checked against the
        # step's output before the rest is formatted from it).
        self._step_versions: dict[str, tuple[int, ...]] = {}
        self._memory_read: dict[str, dict[tuple[int, int], int]] = {}
        self._format_devices: dict[tuple[int, ...], Any] = {}
        # The worker formatting those rows' groups while the step runs; its bookkeeping
        # (`_jobs_lock`): groups in flight per request, requests withdrawn meanwhile (their
        # groups are not offered) and the bytes the groups in flight will hold.
        self._worker = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="jaxkv-layer-format")
        self._jobs_lock = threading.Lock()
        self._jobs: dict[str, int] = {}
        self._withdrawn: set[str] = set()
        self._reserved = 0

    def attach(self, registry: Any) -> None:
        """The engine's `CacheRegistry` (the caches to format from and write into)."""
        self.registry = registry

    def control_channels(self) -> dict[str, Any]:
        """None of its own: control messages travel over TCP."""
        return {}

    def reads_step_memory(self, cache: Any) -> bool:
        """True for a cache over several XLA:CPU devices (`steps_hold_buffers`, blocks not
        split) when this process has another XLA:CPU device (`format_device`): nothing on
        the step's devices can be pulled before the step ends, so the worker gathers each
        announced layer group from the cache's memory (which the step writes in place) and
        formats and offers it on that device while the step computes the later layers."""
        from jaxkv.transfer._jit import steps_hold_buffers

        return (steps_hold_buffers(cache) and cache.sharding.data_size == 1
                and self.format_device(cache) is not None)

    def format_device(self, cache: Any) -> Any:
        """A local XLA:CPU device outside `cache`'s mesh (the first), or None."""
        mesh_devices = cache.sharding.mesh.devices.flat
        key = tuple(sorted(d.id for d in mesh_devices))
        if key not in self._format_devices:
            import jax

            try:
                local = jax.local_devices(backend="cpu")
            except RuntimeError:  # no CPU backend in this process
                local = []
            self._format_devices[key] = next((d for d in local if d.id not in key), None)
        return self._format_devices[key]

    # -- registration and metadata ---------------------------------------------------------

    def register(self, regions: Sequence[Any]) -> None:
        del regions  # arrays are offered per request: nothing to register

    def deregister(self, regions: Sequence[Any]) -> None:
        del regions

    def describe(self) -> list[Any]:
        from jaxkv.transfer._metadata import AgentInfo

        return [AgentInfo(name=self.endpoint, metadata=self.server.address.encode("ascii"))]

    def check_peer(self, meta: Any) -> None:
        for agent in meta.agents:
            _address_of(agent)

    def connect_peer(self, agents: Sequence[Any]) -> dict[str, str]:
        names = {}
        for agent in agents:
            self._addresses[agent.name] = _address_of(agent)
            names[agent.name] = agent.name
        return names

    def disconnect_peer(self, names: Any) -> None:
        for name in names:
            address = self._addresses.pop(name, None)
            if address is not None and address not in self._addresses.values():
                self.puller.drop(address)

    # -- producer ---------------------------------------------------------------------------

    def offer(self, offer: Any) -> None:
        if offer.want is not None:
            message = offer.want
            if not message.layout:
                return  # a layer-wise subscription of a consumer that reads byte ranges
            key = (message.agent_name, message.read_id or offer.request_id, message.attempt)
            if offer.gone:
                self._offer_errors(offer.request_id, key, message,
                                   f"request {offer.request_id!r} was freed before this read "
                                   "(confirmed, aborted or expired)", self.lease_s)
                return
            wants = self._wants.setdefault(offer.request_id, {})
            lease = self.lease_s if offer.lease_s is None else float(offer.lease_s)
            wants.setdefault(key, _Want(message, time.monotonic() + lease))
        if offer.block_ids and self.registry is not None and offer.layer_stop > 0:
            lease = self.lease_s if offer.lease_s is None else float(offer.lease_s)
            self._published[offer.request_id] = (tuple(offer.block_ids), lease,
                                                 int(offer.layer_stop))
            if offer.rows is not None and self._keep_rows(offer.request_id, offer.rows,
                                                         int(offer.layer_stop)):
                # From a jitted step's callback: no JAX here, the worker formats.
                self._serve(offer.request_id, in_step=True)
            elif (offer.in_step and len(self.registry.caches) == 1
                  and self.reads_step_memory(self.registry.caches[0].cache)):
                # Likewise, gathered from the memory the step writes in place.
                self._step_versions[offer.request_id] = self.registry.versions
                self._serve(offer.request_id, in_step=True)

    def _keep_rows(self, request_id: str, rows: tuple[int, list[Any]], stop: int) -> bool:
        """Keeps (copies: the callback's operands may alias the step's buffers) the rows of
        the global layers ``[rows[0], stop)`` per layer; False when they cannot stand for
        the cache (it is not the only one registered: the groups wait for the step's
        output)."""
        caches = self.registry.caches
        start, parts = rows
        if len(caches) != 1 or len(parts) != len(caches[0].cache.arrays):
            return False
        entry = caches[0]
        axes = entry.cache.spec.block_axes()
        axis = 1 + axes.index("L") if "L" in axes else None
        held = self._layer_rows.setdefault(request_id, {})
        for layer in range(max(start, entry.layer_start), min(stop, entry.layer_stop)):
            local = layer - entry.layer_start
            kept = held.setdefault(layer, {})
            for index, ((array_layer, _), part) in enumerate(zip(entry.cache.array_keys,
                                                                 parts)):
                if part is None:
                    continue
                if array_layer is None and axis is not None:  # this layer of an L array
                    at = layer - start
                    kept[index] = np.array(part[(slice(None),) * axis + (slice(at, at + 1),)])
                elif array_layer == local:
                    kept[index] = np.array(part)
        return True

    def _group_rows(self, request_id: str, layers: tuple[int, int]) -> list[Any] | None:
        """`split_layers`'s rows of a layer group from the kept rows, or None unless every
        layer of the group has its rows."""
        held = self._layer_rows.get(request_id)
        caches = self.registry.caches
        if not held or len(caches) != 1:
            return None
        entry = caches[0]
        a, b = layers
        axes = entry.cache.spec.block_axes()
        axis = 1 + axes.index("L") if "L" in axes else None
        out: list[Any] = []
        for index, (array_layer, _) in enumerate(entry.cache.array_keys):
            if array_layer is None and axis is not None:
                found = [held.get(layer, {}).get(index) for layer in range(a, b)]
                parts = [p for p in found if p is not None]
                if len(parts) < len(found):
                    return None
                out.append(parts[0] if len(parts) == 1 else np.concatenate(parts, axis))
            elif array_layer is not None and a <= array_layer + entry.layer_start < b:
                part = held.get(array_layer + entry.layer_start, {}).get(index)
                if part is None:
                    return None
                out.append(part)
            else:
                out.append(None)
        return out

    def _ready(self, request_id: str) -> bool:
        """Whether a published request has a subscriber this process can offer more to now
        (a layer-wise one: whose next group's layers are all published; the engine polls
        this every few milliseconds while a step announces layers, so it stays cheap)."""
        published = self._published.get(request_id)
        if published is None:
            return False
        stop = published[2]
        complete = stop >= self.registry.config.spec.num_layers
        return any(not w.served and (complete or w.message.layer_group_bytes > 0
                                     and not w.waits_for(stop))
                   for w in self._wants.get(request_id, {}).values())

    def _serve(self, request_id: str, in_step: bool = False) -> None:
        """Offers what the request's subscribers wait for and its published layers allow.

        `in_step`: called from a jitted step's callback (no JAX on this thread: only layer
        groups with kept rows are offered, formatted by the worker)."""
        published = self._published.get(request_id)
        wants = self._wants.get(request_id)
        if published is None or not wants:
            return
        block_ids, lease_s, stop = published
        complete = stop >= self.registry.config.spec.num_layers
        # A step consumed (donated) the registered cache and its output was not handed over
        # yet (`update_cache`): what needs the cache waits for it, the subscriptions stay.
        cache_live = not in_step and not any(entry.consumed for entry in self.registry.caches)
        for key, want in wants.items():
            if want.served or not (complete or want.message.layer_group_bytes > 0):
                continue
            try:
                if want.message.layer_group_bytes > 0:
                    offered = self._offer_groups(request_id, key, want, block_ids, lease_s, stop,
                                                 in_step, cache_live)
                elif cache_live:
                    offered = self._offer_want(request_id, key, want.message, block_ids,
                                               lease_s)
                else:
                    continue
            except Exception as error:  # noqa: BLE001 - reported to the consumer
                message = f"request {request_id!r} for {key[0]!r}: {type(error).__name__}: {error}"
                self.errors.append(message)
                del self.errors[:-64]
                self._offer_errors(request_id, key, want.message, message, lease_s)
                offered = True
            want.served = offered
        if complete and all(w.served for w in wants.values()):
            self._layer_rows.pop(request_id, None)  # later subscribers read the cache
            self._step_versions.pop(request_id, None)
            self._memory_read.pop(request_id, None)

    def _request_groups(self, message: Any) -> tuple[tuple[int, int], ...]:
        from jaxkv.transfer._formatter import layer_groups

        return layer_groups(self.registry.config, message.layers_per_pp or [
            self.registry.config.spec.num_layers], max(message.num_blocks, 0),
            message.layer_group_bytes)

    def _offer_groups(self, request_id: str, key: tuple[str, str, int], want: _Want,
                      block_ids: tuple[int, ...], lease_s: float, stop: int,
                      in_step: bool = False, cache_live: bool = True) -> bool:
        """Offers the layer groups of a layer-wise read whose layers are all written, in
        order; True once every group was offered (or handed to the worker, or belongs to
        another process). A group is formatted from its kept rows when it has them (by the
        worker when `in_step` or while a step holds the cache), else from the registered
        cache when it is live."""
        from jaxkv.transfer._formatter import FormatError, send_layer_routes

        message = want.message
        if want.groups is None:
            want.groups = self._request_groups(message)
        if want.waits_for(stop):
            return False  # later layers are not written yet
        producer = self.registry.config
        if want.consumer is None:
            want.consumer = self._consumer_config(message)
        consumer = want.consumer
        wanted = set(message.ranks)
        if message.num_blocks < 0 or message.num_blocks > len(block_ids):
            raise FormatError(f"the consumer reads {message.num_blocks} of the request's "
                              f"{len(block_ids)} blocks")
        ids = list(block_ids[len(block_ids) - message.num_blocks:])
        while want.offered < len(want.groups):
            layers = want.groups[want.offered]
            if layers[1] > stop:
                return False  # later layers are not written yet
            rows = self._group_rows(request_id, layers)
            memory = None
            if rows is None and not cache_live:
                memory = self._step_memory(request_id, layers)
                if memory is None:
                    return False  # needs the registered cache: after the step (`update_cache`)
            elif rows is None:
                self._check_in_place(request_id)
            if rows is not None and len(ids) < len(block_ids):
                # The consumer holds the request's first blocks (a prefix hit): the rows
                # cover the whole request, block for block; it reads their tail.
                skip = len(block_ids) - len(ids)
                rows = [None if part is None else part[skip:] for part in rows]
            entries = [e for e in self.registry.caches
                       if e.layer_start <= layers[0] < e.layer_stop]
            need = 0
            plans = []
            for entry in entries:
                devices = entry_devices(entry, producer)
                for rank in devices:
                    for route in send_layer_routes(producer, consumer, rank, len(ids), layers):
                        if route.consumer_rank in wanted:
                            need += int(np.prod(route.shape)) * producer.spec.itemsize
                plans.append((entry, devices))
            if not self._room_for(need, f"layers {layers}"):
                return False  # waits for releases (`serve` retries)
            job = functools.partial(self._group_items, key, consumer, wanted, ids, layers,
                                    plans, rows, memory)
            if in_step or not cache_live:
                # From a step's callback, or a poll while a step runs: the worker formats
                # (no JAX here, none under the engine's lock while the step may need it)
                with self._jobs_lock:
                    self._jobs[request_id] = self._jobs.get(request_id, 0) + 1
                    self._reserved += need
                self._worker.submit(self._offer_in_background, request_id, key, message,
                                    layers, job, lease_s, need)
            else:
                items = job()
                if items:
                    self.server.offer_many(request_id, items, lease_s)
            want.offered += 1
        return True

    def _step_memory(self, request_id: str, layers: tuple[int, int]
                     ) -> tuple[tuple[Any, ...], Any] | None:
        """``(the registered cache's buffers, the device to format on)`` when the layer
        group can be gathered from the memory of the step that consumed the cache and
        announced its layers (`reads_step_memory`), and the last step handed to
        `update_cache` wrote the cache in place (`Registered.in_place`: else the memory may
        be freed once the step ends), else None. The group of the cache's last layer never
        is (with pipeline stages: this stage's last layer): it waits for the step's output,
        so that `_check_in_place` runs before a read can complete."""
        caches = self.registry.caches
        if (request_id not in self._step_versions or len(caches) != 1
                or not caches[0].in_place
                or self._step_versions[request_id] != self.registry.versions
                or layers[1] >= caches[0].layer_stop):
            return None
        entry = caches[0]
        buffers = tuple(entry.buffers)
        self._memory_read.setdefault(request_id, {}).update(
            {(b.array_index, b.device.id): b.address for b in buffers})
        return buffers, self.format_device(entry.cache)

    def _check_in_place(self, request_id: str) -> None:
        """Before a group is formatted from the step's output: the groups gathered from the
        step's memory were read from its output's buffers.

        Raises:
          FormatError: the step did not update the cache in place (its buffers moved), so
            those groups may hold stale bytes (the read fails with this reason).
        """
        from jaxkv.transfer._formatter import FormatError

        read = self._memory_read.get(request_id)
        if not read:
            return
        now = {(b.array_index, b.device.id): b.address
               for entry in self.registry.caches for b in entry.buffers}
        if any(now.get(where) != address for where, address in read.items()):
            raise FormatError(
                "the step that announced its layers did not update the cache in place (its "
                "buffers moved), so the layer groups gathered from its memory during the "
                "step may be stale: donate the cache to the step (donate_argnums)")

    def _group_items(self, key: tuple[str, str, int], consumer: Any, wanted: set[int],
                     ids: list[int], layers: tuple[int, int], plans: list[tuple[Any, Any]],
                     rows: list[Any] | None,
                     memory: tuple[tuple[Any, ...], Any] | None = None,
                     ) -> list[tuple[int, list[Any]]]:
        """The ``(uuid, [buffer])`` offers of one layer group (JAX ops: formats it from the
        cache, from `rows`, or from the rows gathered from a running step's memory, on the
        device `_step_memory` named)."""
        from jaxkv.transfer._formatter import split_layers

        place = None
        if memory is not None:
            rows = gather_layer_rows(plans[0][0], memory[0], ids, layers)
            place = memory[1]
        items = []
        for entry, devices in plans:
            buffers = split_layers(entry.cache, self.registry.config, consumer, ids, devices,
                                   layers, rows=rows, place=place)
            for (p_rank, c_rank), buffer in buffers.items():
                if c_rank in wanted:
                    items.append((pull_uuid(_group_key(key, layers), 0, p_rank, c_rank),
                                  [buffer]))
        return items

    def _offer_in_background(self, request_id: str, key: tuple[str, str, int], message: Any,
                             layers: tuple[int, int], job: Any, lease_s: float,
                             need: int) -> None:
        """The worker: formats one layer group (`job`) and offers it, unless the request was
        withdrawn meanwhile; a failure is offered as error arrays of the group's uuids."""
        import jax

        error = None
        items: list[tuple[int, list[Any]]] = []
        try:
            items = job()
            # Computed before the lock: a step's callback takes it, and on XLA:CPU these
            # programs may wait for that step's threads.
            jax.block_until_ready([arrays for _, arrays in items])
        except Exception as failure:  # noqa: BLE001 - reported to the consumer
            error = f"{type(failure).__name__}: {failure}"
        with self._jobs_lock:
            try:
                if request_id in self._withdrawn:
                    return
                if error is None and items:
                    try:
                        self.server.offer_many(request_id, items, lease_s)
                    except Exception as failure:  # noqa: BLE001 - reported to the consumer
                        error = f"{type(failure).__name__}: {failure}"
                if error is not None:
                    reason = (f"request {request_id!r} for {key[0]!r}, layers {layers}: "
                              f"{error}")
                    self.errors.append(reason)
                    self._offer_errors(request_id, key, message, reason, lease_s, [layers])
            finally:
                self._reserved -= need
                left = self._jobs.pop(request_id) - 1
                if left:
                    self._jobs[request_id] = left
                else:
                    self._withdrawn.discard(request_id)

    def _room_for(self, need: int, what: str) -> bool:
        """Whether offers of `need` bytes fit the pending-pull budget now, besides the bytes
        of the groups the worker is formatting (False: wait).

        Raises:
          PullBudgetError: they can never fit (above the whole budget).
        """
        with self._jobs_lock:
            reserved = self._reserved
        if self.server.fits(need + reserved):
            return True
        if self.server.budget_bytes is not None and need > self.server.budget_bytes:
            raise PullBudgetError(f"{what} needs {need} bytes of pending pulls, above the "
                                  f"whole {self.server.budget_bytes}-byte budget")
        return False

    def _consumer_config(self, message: Any) -> Any:
        from jaxkv._parallel import EngineConfig
        from jaxkv.transfer._formatter import values_spec

        # The consumer's storage (packing, padding) is its own business: the producer
        # formats values only, planned by the layout and geometry the Want names.
        spec = values_spec(self.registry.config.spec).replace(layout=message.layout,
                                                              block_size=message.block_size)
        return EngineConfig(spec, message.tp_size, message.pp_size,
                            tuple(message.layers_per_pp))

    def _offer_want(self, request_id: str, key: tuple[str, str, int], message: Any,
                    block_ids: tuple[int, ...], lease_s: float) -> bool:
        """Formats and offers the request for one subscriber; False: over budget for now."""
        from jaxkv.transfer._formatter import FormatError, send_routes, split_request

        producer = self.registry.config
        consumer = self._consumer_config(message)
        wanted = set(message.ranks)
        if message.num_blocks < 0 or message.num_blocks > len(block_ids):
            raise FormatError(f"the consumer reads {message.num_blocks} of the request's "
                              f"{len(block_ids)} blocks")
        ids = list(block_ids[len(block_ids) - message.num_blocks:])
        uuid_key = f"{key[0]}/{key[1]}/{key[2]}"
        plans = []
        need = 0
        for entry in self.registry.caches:
            devices = entry_devices(entry, producer)
            for rank in devices:
                for route in send_routes(producer, consumer, rank, len(ids)):
                    if route.consumer_rank in wanted:
                        need += int(np.prod(route.shape)) * producer.spec.itemsize
            plans.append((entry, devices))
        if not self._room_for(need, "the request"):
            return False  # waits for releases (`progress` retries)
        items = []
        for entry, devices in plans:
            buffers = split_request(entry.cache, producer, consumer, ids, devices,
                                    staging=self.server.take)
            for (p_rank, c_rank), buffer in buffers.items():
                if c_rank in wanted:
                    items.append((pull_uuid(uuid_key, 0, p_rank, c_rank), [buffer]))
        self.server.offer_many(request_id, items, lease_s)
        return True

    def _offer_errors(self, request_id: str, key: tuple[str, str, int], message: Any,
                      reason: str, lease_s: float,
                      groups: Sequence[tuple[int, int]] | None = None) -> None:
        """Offers error arrays under the subscriber's uuids (of a layer-wise read: those of
        `groups`, default every group) that have no pending offer: its pulls fail with
        `reason`."""
        from jax.experimental import transfer

        make_error = getattr(transfer, "make_error_array", None)
        if make_error is None or self.registry is None:
            return  # the consumer's pulls time out instead
        try:
            import jax

            from jaxkv.transfer._formatter import send_layer_routes, send_routes

            producer = self.registry.config
            consumer = self._consumer_config(message)
            num_blocks = max(message.num_blocks, 0)
            # a layer-wise read's uuids are per layer group
            ranges: list[tuple[int, int] | None] = [None]
            if message.layer_group_bytes > 0:
                ranges = list(self._request_groups(message) if groups is None else groups)
            items = []
            for layers in ranges:
                uuid_key = (f"{key[0]}/{key[1]}/{key[2]}" if layers is None
                            else _group_key(key, layers))
                for entry in self.registry.caches:
                    for rank, device in entry_devices(entry, producer).items():
                        routes = (send_routes(producer, consumer, rank, num_blocks)
                                  if layers is None else
                                  send_layer_routes(producer, consumer, rank, num_blocks, layers))
                        for route in routes:
                            if route.consumer_rank not in message.ranks:
                                continue
                            aval = jax.ShapeDtypeStruct(
                                route.shape, producer.spec.dtype,
                                sharding=jax.sharding.SingleDeviceSharding(device))
                            items.append((pull_uuid(uuid_key, 0, rank, route.consumer_rank),
                                          [make_error(aval, reason)]))
            self.server.offer_failures(items, lease_s)
        except Exception as error:  # noqa: BLE001 - best effort: the pulls time out otherwise
            self.errors.append(f"could not offer the failure of {request_id!r}: {error}")

    def withdraw(self, request_id: str, confirmed: bool = False) -> None:
        with self._jobs_lock:  # the worker's groups of it in flight are not offered
            if request_id in self._jobs:
                self._withdrawn.add(request_id)
        self._layer_rows.pop(request_id, None)
        self._step_versions.pop(request_id, None)
        self._memory_read.pop(request_id, None)
        self._published.pop(request_id, None)
        # Subscriptions not served yet (e.g. they arrived after an abort, before the poll
        # that released the request) fail now: dropped, their pulls would wait for their
        # timeout.
        for key, want in self._wants.pop(request_id, {}).items():
            if not want.served:
                self._offer_errors(request_id, key, want.message,
                                   f"request {request_id!r} was freed before this read "
                                   "(confirmed, aborted or expired)", self.lease_s)
        self.server.release(request_id, pulled=confirmed)

    # -- consumer ---------------------------------------------------------------------------

    def prepare_fetch(self, fetch: Any) -> _Piece:
        """Plans the pulls of one local rank (``fetch.remote_rank`` is ignored: the
        formatter's routes name the source ranks)."""
        piece = self._prepare(fetch, None)
        assert piece is not None  # a whole read has routes on every rank
        return piece

    def read_groups(self, fetch: Any) -> tuple[tuple[int, int], ...]:
        """The layer groups of a layer-wise read (`layer_groups` with this process's
        ``layer_group_bytes``, what its `Want` asks the producer for)."""
        from jaxkv.transfer._formatter import layer_groups

        return layer_groups(fetch.peer.config(), fetch.local.config().layer_split,
                            len(fetch.plan.remote_block_ids), self.layer_group_bytes)

    def prepare_layers(self, fetch: Any, layers: tuple[int, int]) -> _Piece | None:
        """Plans the pulls of one local rank for one layer group of a layer-wise read; None
        when the rank's pipeline stage does not hold those layers."""
        return self._prepare(fetch, (int(layers[0]), int(layers[1])))

    def _prepare(self, fetch: Any, layers: tuple[int, int] | None) -> _Piece | None:
        from jaxkv.transfer._formatter import receive_layer_routes, receive_routes

        local_cfg, peer_cfg = fetch.local.config(), fetch.peer.config()
        plan = fetch.plan
        key = (fetch.read_id, fetch.attempt, layers)
        group = self._groups.get(key)
        if group is None:
            group = _ReadGroup(key, tuple(int(b) for b in plan.local_block_ids),
                               len(plan.remote_block_ids), local_cfg, peer_cfg, layers=layers)
        if layers is None:
            routes = receive_routes(local_cfg, peer_cfg, plan.local_rank, group.num_remote)
        else:
            routes = receive_layer_routes(local_cfg, peer_cfg, plan.local_rank,
                                          group.num_remote, layers)
            if not routes:
                return None
        addresses = []
        for route in routes:
            agent = fetch.peer.rank_info(route.producer_rank).agent_name
            if agent not in self._addresses:
                raise KeyError(f"producer agent {agent!r} is not connected")
            addresses.append(self._addresses[agent])
        read_key = (self.endpoint, fetch.read_id, fetch.attempt)
        uuid_key = "/".join(map(str, read_key)) if layers is None else _group_key(read_key,
                                                                                   layers)
        uuids = tuple(pull_uuid(uuid_key, 0, r.producer_rank, plan.local_rank) for r in routes)
        entry = self.registry.rank_cache[plan.local_rank]
        device = entry_devices(entry, local_cfg)[plan.local_rank]
        self._groups[key] = group
        group.expected += 1
        return _Piece(group, plan.local_rank, routes, tuple(addresses), uuids, device)

    def start_fetch(self, prepared: _Piece, notification: bytes = b"") -> _Piece:
        del notification
        dtype = prepared.group.consumer.spec.dtype
        for route, address, uuid in zip(prepared.routes, prepared.addresses, prepared.uuids):
            prepared.pulls.append(self.puller.pull(address, uuid, [(route.shape, dtype)],
                                                   prepared.device, self.pull_timeout_s))
        prepared.group.pieces.append(prepared)
        return prepared

    def check(self, handle: _Piece) -> str:
        group = handle.group
        if group.error is not None:
            return "ERR"
        if group.written:
            return "DONE"
        states = [p.status() for piece in group.pieces for p in piece.pulls]
        if len(group.pieces) < group.expected:
            states.append("PROC")  # a piece not started yet: never written without it
        if "ERR" in states:
            errors = [p.error for piece in group.pieces for p in piece.pulls if p.error]
            group.error = errors[0] if errors else "a pull failed"
            return "ERR"
        if "PROC" in states:
            return "PROC"
        try:
            self._write(group)
        except Exception as error:  # noqa: BLE001 - the read fails with the reason
            group.error = f"writing the pulled buffers failed: {type(error).__name__}: {error}"
            return "ERR"
        group.written = True
        return "DONE"

    def _write(self, group: _ReadGroup) -> None:
        from jaxkv.transfer._formatter import concat_layers, concat_request

        per_entry: dict[int, tuple[Any, dict[int, list[Any]], dict[int, Any]]] = {}
        for piece in group.pieces:
            entry = self.registry.rank_cache[piece.rank]
            _, pulled, devices = per_entry.setdefault(id(entry), (entry, {}, {}))
            pulled[piece.rank] = [p.arrays[0] for p in piece.pulls]
            devices[piece.rank] = piece.device
        for entry, pulled, devices in per_entry.values():
            if entry.consumed:
                raise ValueError("the registered cache was consumed by another update: pass "
                                 "the current cache to update_cache() after each donated update")
            if group.layers is None:
                updated = concat_request(entry.cache, group.consumer, group.producer,
                                         group.local_ids, group.num_remote, pulled, devices)
            else:
                updated = concat_layers(entry.cache, group.consumer, group.producer,
                                        group.local_ids, group.num_remote, pulled, devices,
                                        group.layers)
            updated.block_until_ready()
            # Nothing registered these buffers: an update that was not in place (a backend
            # that copied instead of aliasing) is as good; the caller learns the new arrays
            # from the engine's current cache (`KVTransferEngine.caches`).
            entry.cache.arrays = updated.arrays  # keep the caller's object current
            entry.buffers = entry.cache.shard_buffers()

    def error_of(self, handle: _Piece) -> str | None:
        """Why a fetch failed (None: it did not)."""
        return handle.group.error

    def release(self, handle: _Piece) -> bool:
        group = handle.group
        if handle in group.pieces:
            group.pieces.remove(handle)
        if not group.pieces:
            self._groups.pop(group.key, None)
        return True

    def notifications(self) -> list[tuple[str, bytes]]:
        return []

    def progress(self) -> None:
        """Frees the buffers of offers whose lease passed, forgets subscriptions to requests
        never published within a lease (no JAX computation)."""
        self.server.expire()
        now = time.monotonic()
        for request_id in [r for r, w in self._wants.items() if r not in self._published
                           and all(x.expiry < now for x in w.values())]:
            del self._wants[request_id]

    @property
    def num_subscriptions(self) -> int:
        """Subscriptions (consumer reads) this producer process keeps."""
        return sum(len(w) for w in self._wants.values())

    def serve(self) -> None:
        """Formats and offers the published requests that subscribers wait for (JAX ops:
        called by the engine's `poll`, never from a jitted step's host callback)."""
        for request_id in [r for r in self._wants if self._ready(r)]:
            self._serve(request_id)

    def close(self) -> None:
        self._worker.shutdown(wait=True, cancel_futures=True)
        self._layer_rows.clear()
        self._step_versions.clear()
        self._memory_read.clear()
        self._groups.clear()
        self._wants.clear()
        self._published.clear()
        self.server.close()
