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

import dataclasses
import datetime
import hashlib
import itertools
import threading
import time
from collections.abc import Sequence
from typing import Any

__all__ = [
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
        import numpy as np

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
        tiny = jnp.zeros((1,), jnp.uint8)
        self._server.await_pull(uuid, [tiny], timeout=_deadline(0.0))

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
        limit = time.monotonic() + float(timeout_s)
        while True:
            state = self.status()
            if state == "DONE":
                return self.arrays
            if state == "ERR":
                assert self.error is not None
                if "in time" in self.error:
                    raise PullTimeoutError(self.error)
                raise RuntimeError(self.error)
            if time.monotonic() >= limit:
                raise PullTimeoutError(f"pull {self.uuid} from {self.address} still running "
                                       f"after {timeout_s} s")
            time.sleep(0.0005)


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
