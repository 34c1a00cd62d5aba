"""Offload tiers for KV blocks: device <-> host pool <-> files.

- `OffloadManager`: both tiers with the block-manager integration (eviction hook, tiered
  prefix lookup, `load_hit`); most users need only this.
- `HostPool` with `offload_blocks` / `onboard_blocks`: batched copies between a device cache
  and host memory through the block custom calls (inside or outside jit; partial onboarding).
- `FileTier`: a content-addressed, checksummed, size-bounded store of blocks in files named by
  their prefix hash, with a manifest, through NIXL's POSIX backend or plain files.
- `OffloadError`: the base class of every offload failure.
"""

from jaxkv._deprecation import deprecated_getattr as _deprecated_getattr
from jaxkv.offload._file import FileTier
from jaxkv.offload._host import HostPool, offload_blocks, onboard_blocks
from jaxkv.offload._manager import OffloadManager
from jaxkv.offload._types import OffloadError

__all__ = [
    "FileTier",
    "HostPool",
    "offload_blocks",
    "OffloadError",
    "OffloadManager",
    "onboard_blocks",
]

# Names that left the public API, kept one release (docs/guide.md, "Deprecated names"):
# each use warns with a DeprecationWarning naming what to use instead.
_DEPRECATED = {
    "BlockCorruptError": "jaxkv.offload._types",
    "FORMAT_VERSION": "jaxkv.offload._file",
    "FileTierStats": "jaxkv.offload._file",
    "HostPoolFullError": "jaxkv.offload._types",
    "IncompatibleTierError": "jaxkv.offload._types",
    "JaxCompletion": "jaxkv.offload._ordering",
    "OffloadStats": "jaxkv.offload._manager",
    "OffloadTimeoutError": "jaxkv.offload._types",
    "SlotKey": "jaxkv.offload._types",
    "SlotOrdering": "jaxkv.offload._ordering",
    "Tier": "jaxkv.offload._types",
    "TierFuture": "jaxkv.offload._file",
    "UnknownSlotError": "jaxkv.offload._types",
    "file_compat_fields": "jaxkv.offload._file",
}
_USE = {
    "BlockCorruptError": "OffloadError (its base class) to catch it",
    "HostPoolFullError": "OffloadError (its base class) to catch it",
    "IncompatibleTierError": "OffloadError (its base class) to catch it",
    "OffloadTimeoutError": "OffloadError (its base class) to catch it",
    "UnknownSlotError": "OffloadError (its base class) to catch it",
}
__getattr__ = _deprecated_getattr('jaxkv.offload', _DEPRECATED, _USE)
