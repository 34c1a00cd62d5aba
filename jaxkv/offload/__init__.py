"""Offload tiers for KV blocks: device <-> host pool <-> files, ordered by (tier, slot).

- `HostPool` with `offload_blocks` / `onboard_blocks`: batched copies between a device cache
  and host memory through the block custom calls (inside or outside jit; partial onboarding).
- `FileTier`: a content-addressed, checksummed, size-bounded store of blocks in files named by
  their prefix hash, with a manifest, through NIXL's POSIX backend or plain files.
- `OffloadManager`: both tiers with ordering (`SlotOrdering`, keyed by `SlotKey(tier, index)`)
  and the block-manager integration (eviction hook, tiered prefix lookup, `load_hit`).
"""

from jaxkv.offload._file import (
    FORMAT_VERSION,
    FileTier,
    FileTierStats,
    TierFuture,
    file_compat_fields,
)
from jaxkv.offload._host import HostPool, offload_blocks, onboard_blocks
from jaxkv.offload._manager import OffloadManager, OffloadStats
from jaxkv.offload._ordering import JaxCompletion, SlotOrdering
from jaxkv.offload._types import (
    BlockCorruptError,
    HostPoolFullError,
    IncompatibleTierError,
    OffloadError,
    OffloadTimeoutError,
    SlotKey,
    Tier,
    UnknownSlotError,
)

__all__ = [
    "BlockCorruptError",
    "FORMAT_VERSION",
    "FileTier",
    "FileTierStats",
    "HostPool",
    "HostPoolFullError",
    "IncompatibleTierError",
    "JaxCompletion",
    "OffloadError",
    "OffloadManager",
    "OffloadStats",
    "OffloadTimeoutError",
    "SlotKey",
    "SlotOrdering",
    "Tier",
    "TierFuture",
    "UnknownSlotError",
    "file_compat_fields",
    "offload_blocks",
    "onboard_blocks",
]
