"""jaxkv: paged KV caches for LLM serving as JAX arrays, with in-place block operations.

Public names:
  KVCacheSpec, LAYOUT_PRESETS, CACHE_PRESETS     (jaxkv._spec; no JAX needed)
  EngineConfig                                    (jaxkv._parallel; TP/PP split; no JAX)
  PagedKVCache, ShardBuffer, BufferMovedError     (jaxkv._cache)
  __version__

Subpackages (each imported on first access):
  ops                                             (block ops: copy, gather, scatter; reshaping
                                                   ops: permute, merge, prefix, split, concat)
  blocks                                          (block manager; no JAX needed)
  transfer                                        (KV transfer between engines)
  offload                                         (device <-> host <-> file tiers for blocks)
  integrations, demo                              (vLLM / tpu-inference connectors; the demo)

Names that need JAX are loaded on first access, so `import jaxkv.blocks` (host-side
bookkeeping) never starts a JAX backend.
"""

import importlib as _importlib
import typing as _typing

from jaxkv._deprecation import deprecated_getattr as _deprecated_getattr
from jaxkv._parallel import EngineConfig
from jaxkv._spec import CACHE_PRESETS, LAYOUT_PRESETS, KVCacheSpec
from jaxkv._version import __version__

if _typing.TYPE_CHECKING:
    from jaxkv import blocks as blocks
    from jaxkv import demo as demo
    from jaxkv import integrations as integrations
    from jaxkv import offload as offload
    from jaxkv import ops as ops
    from jaxkv import transfer as transfer
    from jaxkv._cache import BufferMovedError, PagedKVCache, ShardBuffer

__all__ = [
    "BufferMovedError",
    "CACHE_PRESETS",
    "EngineConfig",
    "KVCacheSpec",
    "LAYOUT_PRESETS",
    "PagedKVCache",
    "ShardBuffer",
    "__version__",
]

_SUBPACKAGES = ("ops", "blocks", "transfer", "offload", "integrations", "demo")

_LAZY_ATTRIBUTES = {
    "PagedKVCache": "jaxkv._cache",
    "ShardBuffer": "jaxkv._cache",
    "BufferMovedError": "jaxkv._cache",
}

# Names that left the public API, kept one release (docs/guide.md, "Deprecated names"):
# each use warns with a DeprecationWarning naming what to use instead.
_DEPRECATED = {
    "PeerPlan": "jaxkv._parallel",
    "SUPPORTED_DTYPES": "jaxkv._spec",
    "plan_peers": "jaxkv._parallel",
}
_USE = {"PeerPlan": "jaxkv.ops.PeerPlan", "plan_peers": "jaxkv.ops.plan_peers"}
_deprecated = _deprecated_getattr("jaxkv", _DEPRECATED, _USE)


def __getattr__(name: str) -> _typing.Any:
    if name in _SUBPACKAGES:
        return _importlib.import_module(f"jaxkv.{name}")
    if name in _LAZY_ATTRIBUTES:
        return getattr(_importlib.import_module(_LAZY_ATTRIBUTES[name]), name)
    return _deprecated(name)


def __dir__() -> list[str]:
    return sorted([*__all__, *_SUBPACKAGES])
