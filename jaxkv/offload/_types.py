"""Tiers, slot keys and errors of the offload package."""

from __future__ import annotations

import enum
from typing import NamedTuple

__all__ = [
    "BlockCorruptError",
    "HostPoolFullError",
    "IncompatibleTierError",
    "OffloadError",
    "OffloadTimeoutError",
    "SlotKey",
    "Tier",
    "UnknownSlotError",
]


class Tier(str, enum.Enum):  # noqa: UP042 - StrEnum would change str(Tier.HOST).
    """Where a KV block lives: device memory, the host pool, or the file tier."""

    DEVICE = "device"
    HOST = "host"
    DISK = "disk"


class SlotKey(NamedTuple):
    """A location in one tier: ``(tier, index)``.

    `index` is a device block id (`Tier.DEVICE`), a host slot (`Tier.HOST`) or a block hash
    (`Tier.DISK`). Ordering is keyed by the pair, so device block 3 and host slot 3 are never
    confused (TensorRT-LLM PR 13124).
    """

    tier: Tier
    # The public field name shadows tuple.index(); renaming it would break callers.
    index: int | bytes  # type: ignore[assignment]


class OffloadError(RuntimeError):
    """Base class of the offload errors."""


class UnknownSlotError(OffloadError, KeyError):
    """A host slot holds no block (never written, or its file read missed)."""

    def __str__(self) -> str:  # KeyError would quote the message.
        return str(self.args[0]) if self.args else ""


class HostPoolFullError(OffloadError):
    """One batch needs more host slots than the pool has."""


class OffloadTimeoutError(OffloadError, TimeoutError):
    """A wait for an earlier copy (or a file operation) ran past its timeout."""


class IncompatibleTierError(OffloadError, ValueError):
    """A file tier directory or block file was written for a different model or spec."""


class BlockCorruptError(OffloadError):
    """A block file failed its checksum or header check (it is quarantined, never loaded)."""
