"""The life cycle of a transfer, as two explicit state machines with one transition table.

A producer request (`RequestState`) and a consumer read (`ReadState`) each move through a
few states; every legal move is listed in `TRANSITIONS`, and `transition` refuses any other
with a `ProtocolError` naming the request and both states. The producer and consumer roles
(`jaxkv.transfer._producer`, `jaxkv.transfer._consumer`) change states only through it, so the
table is the whole protocol (like sglang-jax's ``KVPoll``)::

    producer request:  PINNED -> READING -> DONE        every expected consumer read confirmed
                          |         |----> ABORTED     abort_request (or a failed publication)
                          |         '----> EXPIRED     no heartbeat within the lease
                          '-> DONE | ABORTED | EXPIRED  (straight from PINNED)

    consumer read:     PLANNING -> WAITING_READY -> TRANSFERRING -> LANDED -> CONFIRMED
                          |              |   '-----------------------^        (every producer
                          '--------------+-> TRANSFERRING                      rank's Ack)
                          any non-terminal state -> FAILED (timeout, refused, transport error)

``READING``: at least one consumer rank's `Done` was counted. ``WAITING_READY``: a layer-wise
read waits for the producer's `Ready` announcements. ``LANDED``: the bytes arrived (the
transport completed) and `Done` went to every producer rank; the read is reported finished
only once ``CONFIRMED`` (every producer rank answered that the blocks were still pinned).

No JAX, no NIXL: pure Python.
"""

from __future__ import annotations

import enum
from typing import Any, TypeVar

__all__ = [
    "ProtocolError",
    "ReadState",
    "RequestState",
    "TERMINAL",
    "TRANSITIONS",
    "is_legal",
    "transition",
]


class RequestState(enum.Enum):
    """A producer request (the blocks it pinned for consumers)."""

    PINNED = "pinned"
    READING = "reading"
    DONE = "done"
    ABORTED = "aborted"
    EXPIRED = "expired"


class ReadState(enum.Enum):
    """A consumer read of a producer request."""

    PLANNING = "planning"
    WAITING_READY = "waiting_ready"
    TRANSFERRING = "transferring"
    LANDED = "landed"
    CONFIRMED = "confirmed"
    FAILED = "failed"


State = RequestState | ReadState

TRANSITIONS: dict[State, frozenset[State]] = {
    RequestState.PINNED: frozenset(
        {RequestState.READING, RequestState.DONE, RequestState.ABORTED, RequestState.EXPIRED}
    ),
    RequestState.READING: frozenset(
        {RequestState.DONE, RequestState.ABORTED, RequestState.EXPIRED}
    ),
    RequestState.DONE: frozenset(),
    RequestState.ABORTED: frozenset(),
    RequestState.EXPIRED: frozenset(),
    ReadState.PLANNING: frozenset(
        {ReadState.WAITING_READY, ReadState.TRANSFERRING, ReadState.FAILED}
    ),
    ReadState.WAITING_READY: frozenset(
        {ReadState.TRANSFERRING, ReadState.LANDED, ReadState.FAILED}
    ),
    ReadState.TRANSFERRING: frozenset({ReadState.LANDED, ReadState.FAILED}),
    ReadState.LANDED: frozenset({ReadState.CONFIRMED, ReadState.FAILED}),
    ReadState.CONFIRMED: frozenset(),
    ReadState.FAILED: frozenset(),
}
"""Every legal move: state -> the states it may go to. Anything else is a protocol error."""

TERMINAL: frozenset[State] = frozenset(s for s, nxt in TRANSITIONS.items() if not nxt)
"""States a request or read never leaves (it is then reported once and forgotten)."""


class ProtocolError(RuntimeError):
    """An illegal state transition: a bug in the engine, never a peer's fault (peers' messages
    are validated and ignored or refused before they change a state)."""


M = TypeVar("M")  # a record with a ``state`` (RequestState | ReadState) and a ``key``


def is_legal(old: State, new: State) -> bool:
    """Whether `TRANSITIONS` allows ``old -> new`` (same-kind states only).

    Example:
      >>> is_legal(ReadState.LANDED, ReadState.CONFIRMED)
      True
      >>> is_legal(ReadState.CONFIRMED, ReadState.FAILED)
      False
    """
    return new in TRANSITIONS.get(old, frozenset())


def transition(machine: M, new: State) -> M:
    """Moves `machine` (anything with a ``state`` and a ``key``) to `new`.

    Args:
      machine: a producer request or consumer read record.
      new: the next state.

    Returns:
      `machine`, for chaining.

    Raises:
      ProtocolError: ``machine.state -> new`` is not in `TRANSITIONS`.

    Example:
      >>> class Read:
      ...     key, state = "req-1", ReadState.TRANSFERRING
      >>> transition(Read(), ReadState.LANDED).state
      <ReadState.LANDED: 'landed'>
      >>> transition(Read(), ReadState.CONFIRMED)  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      ...
      jaxkv.transfer._protocol.ProtocolError: 'req-1': illegal transition transferring -> ...
    """
    record: Any = machine
    old = record.state
    if not is_legal(old, new):
        allowed = ", ".join(sorted(s.value for s in TRANSITIONS.get(old, frozenset()))) or "none"
        raise ProtocolError(
            f"{record.key!r}: illegal transition {old.value} -> {new.value} (allowed: {allowed})"
        )
    record.state = new
    return machine
