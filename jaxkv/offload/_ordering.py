"""Ordering of copies between tiers, keyed by (tier, slot).

Every copy reads some locations and writes others. It must wait for the last earlier write of
each location it reads, and for the last earlier write and every earlier read (since that write)
of each location it writes. `SlotOrdering.claim` hands out exactly those dependencies and records
the new copy, atomically, so copies submitted from several threads are ordered as submitted.

A dependency is a `concurrent.futures.Future` (file I/O on a worker thread) or a `JaxCompletion`
(a dispatched JAX program, complete when its completion token is ready).
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Iterable
from typing import Any

from jaxkv.offload._types import OffloadTimeoutError, SlotKey

__all__ = ["Dependency", "DoneFlag", "JaxCompletion", "SlotOrdering", "wait_for"]


class JaxCompletion:
    """A dispatched JAX program: done when its completion token (a small output of the same
    executable, never donated) is ready. The token is attached right after dispatch."""

    __slots__ = ("_token",)

    def __init__(self) -> None:
        self._token: Any = None

    def attach(self, token: Any) -> None:
        """Sets the completion token (a JAX array output of the dispatched program)."""
        self._token = token

    def cancel(self) -> None:
        """Marks the copy done without a program (it was refused before dispatch)."""
        self._token = _Ready()

    def done(self) -> bool:
        token = self._token
        return token is not None and token.is_ready()


class DoneFlag:
    """A copy that runs on the thread that records it (e.g. `OffloadManager.read_file_now`):
    done once `set` is called. Lighter than a future: nothing waits on a condition, and other
    threads poll it as they poll a `JaxCompletion`."""

    __slots__ = ("_done",)

    def __init__(self) -> None:
        self._done = False

    def set(self) -> None:
        """Marks the copy done (finished or failed)."""
        self._done = True

    def done(self) -> bool:
        return self._done


class _Ready:
    @staticmethod
    def is_ready() -> bool:
        return True


Dependency = concurrent.futures.Future | JaxCompletion | DoneFlag


def wait_for(dependencies: Iterable[Dependency], deadline: float, what: str) -> None:
    """Waits until every dependency is done (failed futures count as done).

    Args:
      dependencies: futures and JAX completions.
      deadline: `time.monotonic()` value to give up at.
      what: the waiting copy, for the error message.

    Raises:
      OffloadTimeoutError: the deadline passed first.
    """
    for dependency in dependencies:
        if isinstance(dependency, concurrent.futures.Future):
            remaining = deadline - time.monotonic()
            done, _ = concurrent.futures.wait([dependency], timeout=max(0.0, remaining))
            if not done:
                raise OffloadTimeoutError(f"{what}: an earlier file operation is still running")
            continue
        pause = 1e-5
        while not dependency.done():
            if time.monotonic() >= deadline:
                raise OffloadTimeoutError(f"{what}: an earlier device/host copy is still running")
            time.sleep(pause)
            pause = min(pause * 2, 2e-3)


class _DoneMemo:
    """`dependency.done()` asked once per dependency during one claim: the keys of a batch
    share a few dependencies, and `Future.done` takes a lock. A copy seen unfinished may finish
    during the claim; waiting for it then costs nothing."""

    __slots__ = ("_seen",)

    def __init__(self) -> None:
        self._seen: dict[int, bool] = {}

    def __call__(self, dependency: Dependency) -> bool:
        key = id(dependency)
        known = self._seen.get(key)
        if known is None:
            known = self._seen[key] = dependency.done()
        return known


_MIN_PRUNE_AT = 4096  # Keys held before finished copies are pruned (then twice what is left).


class SlotOrdering:
    """Last writer and readers since that write, per `SlotKey`. Thread-safe.

    Example:
      >>> from jaxkv.offload._types import SlotKey, Tier
      >>> order = SlotOrdering()
      >>> first, second = concurrent.futures.Future(), concurrent.futures.Future()
      >>> order.claim(reads=[], writes=[SlotKey(Tier.HOST, 1)], op=first)
      []
      >>> order.claim(reads=[SlotKey(Tier.HOST, 1)], writes=[], op=second) == [first]
      True
      >>> order.claim(reads=[SlotKey(Tier.DEVICE, 1)], writes=[], op=second)   # another tier
      []
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._writer: dict[SlotKey, Dependency] = {}
        self._readers: dict[SlotKey, list[Dependency]] = {}
        self._prune_at = _MIN_PRUNE_AT

    def claim(
        self, reads: Iterable[SlotKey], writes: Iterable[SlotKey], op: Dependency
    ) -> list[Dependency]:
        """Records `op` as reading `reads` and writing `writes`; returns what it must wait for.

        Args:
          reads: locations the copy reads.
          writes: locations the copy writes.
          op: the copy's future or completion.

        Returns:
          The unfinished earlier copies it depends on (no duplicates, `op` excluded).
        """
        reads, writes = list(reads), list(writes)
        found: dict[int, Dependency] = {}
        done = _DoneMemo()  # A batch shares a few dependencies: ask each once.
        with self._lock:
            for key in reads:
                self._collect_locked(key, found, False, done)
            for key in writes:
                self._collect_locked(key, found, True, done)
            for key in writes:
                self._writer[key] = op
                self._readers.pop(key, None)
            written = set(writes) if reads and writes else ()
            for key in reads:
                if key in written:
                    continue
                readers = [r for r in self._readers.get(key, ()) if not done(r)]
                readers.append(op)
                self._readers[key] = readers
            # Keys of finished copies are dropped now and then (every key of a file tier is a
            # block hash: without this the tables would grow with every block ever moved).
            if len(self._writer) + len(self._readers) > self._prune_at:
                self._prune(done)
                self._prune_at = max(_MIN_PRUNE_AT, 2 * (len(self._writer) + len(self._readers)))
        found.pop(id(op), None)
        return list(found.values())

    def pending(self) -> list[Dependency]:
        """The unfinished copies last recorded per key (for a full sync point). Copies they
        superseded are covered: a later copy of a key waits for them before it completes."""
        done = _DoneMemo()
        with self._lock:
            ops = {id(d): d for d in self._writer.values() if not done(d)}
            for readers in self._readers.values():
                ops.update((id(d), d) for d in readers if not done(d))
            self._prune(done)
        return list(ops.values())

    def pending_for(self, keys: Iterable[SlotKey]) -> list[Dependency]:
        """Unfinished copies that read or write any of `keys`."""
        found: dict[int, Dependency] = {}
        done = _DoneMemo()
        with self._lock:
            for key in keys:
                self._collect_locked(key, found, True, done)
        return list(found.values())

    def _collect_locked(self, key: SlotKey, found: dict[int, Dependency],
                        with_readers: bool, done: _DoneMemo) -> None:
        """Adds the unfinished last writer of `key` (and, `with_readers`, its unfinished
        readers) to `found`, keyed by identity."""
        writer = self._writer.get(key)
        if writer is not None and not done(writer):
            found[id(writer)] = writer
        if with_readers:
            for reader in self._readers.get(key, ()):
                if not done(reader):
                    found[id(reader)] = reader

    def _prune(self, done: _DoneMemo) -> None:
        for key in [k for k, d in self._writer.items() if done(d)]:
            del self._writer[key]
        for key in list(self._readers):
            readers = [r for r in self._readers[key] if not done(r)]
            if readers:
                self._readers[key] = readers
            else:
                del self._readers[key]
