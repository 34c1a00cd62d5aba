"""The public value types of transfers: a request's `TransferParams` (what the producer hands
to the consumer), `PollResult` and `FailedRead` (what `TransferEngine.poll` reports)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, cast

import msgspec
import numpy as np

from jaxkv.transfer._plan import PostProcess

__all__ = ["FailedRead", "PollResult", "TransferParams", "make_transfer_params"]


class TransferParams(msgspec.Struct, frozen=True):
    """What a producer hands to the consumer of a request (through the router).

    Attributes:
      engine_id: the producer engine.
      addresses: side-channel ``(host, port)`` of every producer process.
      request_id: the request.
      block_ids: the request's blocks on the producer, in token order.
      lease_s: how long the producer pins them without a heartbeat.
      generation: the producer's generation (-1: whatever its processes publish now).
      layerwise: the blocks become readable layer by layer (`TransferEngine.publish_layers`);
        the consumer waits for the producer's announcements before reading each layer.
      groups: an engine with several cache groups: per group name, that group's params
        (its protocol engine ``f"{engine_id}.{group}"``, its side channel and blocks); the
        top-level `addresses` and `block_ids` are then empty. Empty for one group.
    """

    engine_id: str
    addresses: list[tuple[str, int]]
    request_id: str
    block_ids: list[int]
    lease_s: float
    generation: int = -1
    layerwise: bool = False
    groups: dict[str, TransferParams] = {}


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
    """Builds a request's `TransferParams` where no `TransferEngine` runs (a serving
    framework's scheduler process): what the producer's workers pin with
    `TransferEngine.publish_request` and the consumer reads with `start_read`.

    The consumer fetches the producer's metadata from `addresses` (every producer process's
    side channel, i.e. each worker's `TransferEngine.address`); ``generation=-1`` accepts
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
    request id), why, and the local blocks it left invalid.

    Attributes:
      request_id: the read id.
      reason: what failed (a group's failure names the group).
      invalid_block_ids: every local block the read may have written, sorted (several
        groups: the union over groups).
      invalid_by_group: several cache groups: per group, its invalid local blocks (empty
        for one group).
    """

    request_id: str
    reason: str
    invalid_block_ids: tuple[int, ...]
    invalid_by_group: dict[str, tuple[int, ...]] = dataclasses.field(
        default_factory=dict, hash=False)

    @classmethod
    def of_groups(cls, request_id: str, reason: str,
                  invalid: dict[str, tuple[int, ...]]) -> FailedRead:
        """The failure of a read of several groups, from each group's invalid blocks.

        Example:
          >>> FailedRead.of_groups("r", "lost", {"full": (3, 1), "swa": (3,)}).invalid_block_ids
          (1, 3)
        """
        union = tuple(sorted({int(b) for ids in invalid.values() for b in ids}))
        return cls(request_id, reason, union, {g: tuple(ids) for g, ids in invalid.items()})


@dataclasses.dataclass
class PollResult:
    """What `TransferEngine.poll` reports (each request once): consumer reads by their read
    id (`start_read`), producer requests (`freeable`) by their request id.

    In a multi-controller engine (several processes), `finished`, `failed`, `freeable` and
    `published` are engine-level outcomes, reported by process 0 only once every process
    ended its part; `local` holds this process's own part in every process.
    """

    finished: list[str] = dataclasses.field(default_factory=list)
    failed: list[FailedRead] = dataclasses.field(default_factory=list)
    freeable: list[str] = dataclasses.field(default_factory=list)
    post_applied: dict[str, list[PostProcess]] = dataclasses.field(default_factory=dict)
    """Per finished request, the post-processing steps the engine already applied to the
    registered cache (informational: do not apply them again)."""
    layers: dict[str, int] = dataclasses.field(default_factory=dict)
    """Layer-wise reads in flight whose progress changed: the number of this process's
    layers that arrived so far (in every local rank)."""
    published: list[str] = dataclasses.field(default_factory=list)
    """Multi-controller engines (process 0): layer-wise requests every process announced
    completely (every layer, e.g. by the in-jit callbacks of every process)."""
    local: PollResult | None = None
    """Multi-controller engines: this process's own part (None for one process)."""

    def extend(self, other: PollResult) -> None:
        """Appends another result (used to carry results found inside host callbacks)."""
        self.finished += other.finished
        self.failed += other.failed
        self.freeable += other.freeable
        self.published += other.published
        self.post_applied.update(other.post_applied)
        self.layers.update(other.layers)



def address_tuple(address: Sequence[Any]) -> tuple[str, int]:
    """A ``(host, port)`` address as a tuple (decoded messages carry it as a list)."""
    return cast(tuple[str, int], tuple(address))
