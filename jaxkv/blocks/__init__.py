"""Host-side KV-cache block management (vLLM v1 semantics): the per-request, prefix-caching
`KVCacheManager` with what it returns (`CacheHit`, `TieredCacheHit`, `Allocation`), block
hashing (`hash_request_tokens`, `hash_identity`, `DEFAULT_HASH_SEED`; the hash function is
chosen by name), KV-cache events (`KVCacheEvent`: `BlockStored`, `BlockRemoved`,
`AllBlocksCleared`; in vLLM's wire format with `encode_vllm_event_batch` /
`decode_vllm_event_batch`), cache sizing (`plan_kv_cache` -> `KVCachePlan`, `AttentionLayers`,
`num_blocks_for_memory`, `estimate_max_model_len`) and the errors (`BlockError` and the ones
callers catch: `OutOfBlocksError`, `UnknownRequestError`, `InsufficientMemoryError`).

Pure Python and numpy: importing this package never imports JAX.
"""

from jaxkv._deprecation import deprecated_getattr as _deprecated_getattr
from jaxkv.blocks._errors import (
    BlockError,
    InsufficientMemoryError,
    OutOfBlocksError,
    UnknownRequestError,
)
from jaxkv.blocks._events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    decode_vllm_event_batch,
    encode_vllm_event_batch,
)
from jaxkv.blocks._hashing import DEFAULT_HASH_SEED, hash_identity, hash_request_tokens
from jaxkv.blocks._manager import Allocation, CacheHit, KVCacheManager, TieredCacheHit
from jaxkv.blocks._sizing import (
    AttentionLayers,
    KVCachePlan,
    estimate_max_model_len,
    num_blocks_for_memory,
    plan_kv_cache,
)

__all__ = [
    "AllBlocksCleared",
    "Allocation",
    "AttentionLayers",
    "BlockError",
    "BlockRemoved",
    "BlockStored",
    "CacheHit",
    "decode_vllm_event_batch",
    "DEFAULT_HASH_SEED",
    "encode_vllm_event_batch",
    "estimate_max_model_len",
    "hash_identity",
    "hash_request_tokens",
    "InsufficientMemoryError",
    "KVCacheEvent",
    "KVCacheManager",
    "KVCachePlan",
    "num_blocks_for_memory",
    "OutOfBlocksError",
    "plan_kv_cache",
    "TieredCacheHit",
    "UnknownRequestError",
]

# Names that left the public API, kept one release (docs/guide.md, "Deprecated names"):
# each use warns with a DeprecationWarning naming what to use instead.
_DEPRECATED = {
    "NONE_HASH": "jaxkv.blocks._hashing",
    "RANDOM_HASH_SEED": "jaxkv.blocks._hashing",
    "NULL_BLOCK_ID": "jaxkv.blocks._pool",
    "BlockHash": "jaxkv.blocks._hashing",
    "BlockId": "jaxkv.blocks._pool",
    "BlockPool": "jaxkv.blocks._pool",
    "DoubleFreeError": "jaxkv.blocks._errors",
    "EvictedBlock": "jaxkv.blocks._pool",
    "EvictionHook": "jaxkv.blocks._pool",
    "ExtraKeys": "jaxkv.blocks._hashing",
    "FreeBlockQueue": "jaxkv.blocks._free_queue",
    "HashFunction": "jaxkv.blocks._hashing",
    "InvalidBlockIdError": "jaxkv.blocks._errors",
    "KVCacheBuffer": "jaxkv.blocks._sizing",
    "KVCacheGroup": "jaxkv.blocks._sizing",
    "MultiModalInput": "jaxkv.blocks._hashing",
    "PartialBlockError": "jaxkv.blocks._errors",
    "PrefixCacheStats": "jaxkv.blocks._metrics",
    "PrefixCachingMetrics": "jaxkv.blocks._metrics",
    "TieredBlock": "jaxkv.blocks._pool",
    "RequestBlockHasher": "jaxkv.blocks._hashing",
    "VllmAllBlocksCleared": "jaxkv.blocks._events",
    "VllmBlockRemoved": "jaxkv.blocks._events",
    "VllmBlockStored": "jaxkv.blocks._events",
    "VllmKVEventBatch": "jaxkv.blocks._events",
    "block_extra_keys": "jaxkv.blocks._hashing",
    "blocks_per_request": "jaxkv.blocks._sizing",
    "encode_key": "jaxkv.blocks._hashing",
    "get_hash_function": "jaxkv.blocks._hashing",
    "hash_block_tokens": "jaxkv.blocks._hashing",
    "none_hash": "jaxkv.blocks._hashing",
    "random_hash_seed": "jaxkv.blocks._hashing",
    "sha256": "jaxkv.blocks._hashing",
    "sha256_cbor": "jaxkv.blocks._hashing",
    "to_vllm_event": "jaxkv.blocks._events",
    "xxhash128": "jaxkv.blocks._hashing",
}
_USE = {
    "BlockPool": "KVCacheManager.pool",
    "DoubleFreeError": "BlockError (its base class) to catch it",
    "InvalidBlockIdError": "BlockError (its base class) to catch it",
    "PartialBlockError": "BlockError (its base class) to catch it",
    "VllmAllBlocksCleared": "encode_vllm_event_batch / decode_vllm_event_batch",
    "VllmBlockRemoved": "encode_vllm_event_batch / decode_vllm_event_batch",
    "VllmBlockStored": "encode_vllm_event_batch / decode_vllm_event_batch",
    "VllmKVEventBatch": "encode_vllm_event_batch / decode_vllm_event_batch",
    "get_hash_function": "a name: hash_fn='sha256'",
    "sha256": "its name: hash_fn='sha256'",
    "sha256_cbor": "its name: hash_fn='sha256_cbor'",
    "to_vllm_event": "encode_vllm_event_batch",
    "xxhash128": "its name: hash_fn='xxhash128'",
}
__getattr__ = _deprecated_getattr('jaxkv.blocks', _DEPRECATED, _USE)
