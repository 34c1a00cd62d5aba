"""jaxkv: paged KV caches for LLM serving as JAX arrays, with in-place block operations.

Public names:
  KVCacheSpec, LAYOUT_PRESETS, CACHE_PRESETS     (jaxkv._spec; no JAX needed)
  SUPPORTED_DTYPES
  EngineConfig, PeerPlan, plan_peers              (jaxkv._parallel; TP/PP split; no JAX)
  PagedKVCache, ShardBuffer, BufferMovedError     (jaxkv._cache)
  ops                                             (block ops: copy, gather, scatter; reshaping
                                                   ops: permute, merge, prefix, split, concat)
  blocks                                          (block manager; no JAX needed)
  transfer                                        (KV transfer between engines over NIXL)
  offload                                         (device <-> host <-> file tiers for blocks)

Names that need JAX are loaded on first access, so `import jaxkv.blocks` (host-side
bookkeeping) never starts a JAX backend.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from jaxkv._parallel import EngineConfig, PeerPlan, plan_peers
from jaxkv._spec import CACHE_PRESETS, LAYOUT_PRESETS, SUPPORTED_DTYPES, KVCacheSpec
from jaxkv._version import __version__

if TYPE_CHECKING:
    from jaxkv import blocks, offload, ops, transfer
    from jaxkv._cache import BufferMovedError, PagedKVCache, ShardBuffer

__all__ = [
    "BufferMovedError",
    "EngineConfig",
    "CACHE_PRESETS",
    "KVCacheSpec",
    "LAYOUT_PRESETS",
    "PagedKVCache",
    "PeerPlan",
    "SUPPORTED_DTYPES",
    "ShardBuffer",
    "__version__",
    "blocks",
    "offload",
    "ops",
    "plan_peers",
    "transfer",
]

_LAZY_ATTRIBUTES = {
    "PagedKVCache": "jaxkv._cache",
    "ShardBuffer": "jaxkv._cache",
    "BufferMovedError": "jaxkv._cache",
}


def __getattr__(name: str) -> Any:
    if name in ("ops", "blocks", "transfer", "offload"):
        return importlib.import_module(f"jaxkv.{name}")
    if name in _LAZY_ATTRIBUTES:
        return getattr(importlib.import_module(_LAZY_ATTRIBUTES[name]), name)
    raise AttributeError(f"module 'jaxkv' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
