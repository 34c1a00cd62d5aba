"""Host-side KV-cache block management: prefix-caching block pool, per-request manager,
block hashing, KV-cache events, hit-rate metrics and cache sizing (vLLM v1 semantics).

Pure Python and numpy: importing this package never imports JAX.
"""

from jaxkv.blocks._errors import BlockError as BlockError
from jaxkv.blocks._errors import DoubleFreeError as DoubleFreeError
from jaxkv.blocks._errors import InsufficientMemoryError as InsufficientMemoryError
from jaxkv.blocks._errors import InvalidBlockIdError as InvalidBlockIdError
from jaxkv.blocks._errors import OutOfBlocksError as OutOfBlocksError
from jaxkv.blocks._errors import PartialBlockError as PartialBlockError
from jaxkv.blocks._errors import UnknownRequestError as UnknownRequestError
from jaxkv.blocks._events import AllBlocksCleared as AllBlocksCleared
from jaxkv.blocks._events import BlockRemoved as BlockRemoved
from jaxkv.blocks._events import BlockStored as BlockStored
from jaxkv.blocks._events import KVCacheEvent as KVCacheEvent
from jaxkv.blocks._events import VllmAllBlocksCleared as VllmAllBlocksCleared
from jaxkv.blocks._events import VllmBlockRemoved as VllmBlockRemoved
from jaxkv.blocks._events import VllmBlockStored as VllmBlockStored
from jaxkv.blocks._events import VllmKVEventBatch as VllmKVEventBatch
from jaxkv.blocks._events import decode_vllm_event_batch as decode_vllm_event_batch
from jaxkv.blocks._events import encode_vllm_event_batch as encode_vllm_event_batch
from jaxkv.blocks._events import to_vllm_event as to_vllm_event
from jaxkv.blocks._free_queue import FreeBlockQueue as FreeBlockQueue
from jaxkv.blocks._hashing import DEFAULT_HASH_SEED as DEFAULT_HASH_SEED
from jaxkv.blocks._hashing import NONE_HASH as NONE_HASH
from jaxkv.blocks._hashing import RANDOM_HASH_SEED as RANDOM_HASH_SEED
from jaxkv.blocks._hashing import BlockHash as BlockHash
from jaxkv.blocks._hashing import ExtraKeys as ExtraKeys
from jaxkv.blocks._hashing import HashFunction as HashFunction
from jaxkv.blocks._hashing import MultiModalInput as MultiModalInput
from jaxkv.blocks._hashing import RequestBlockHasher as RequestBlockHasher
from jaxkv.blocks._hashing import block_extra_keys as block_extra_keys
from jaxkv.blocks._hashing import encode_key as encode_key
from jaxkv.blocks._hashing import get_hash_function as get_hash_function
from jaxkv.blocks._hashing import hash_block_tokens as hash_block_tokens
from jaxkv.blocks._hashing import hash_identity as hash_identity
from jaxkv.blocks._hashing import hash_request_tokens as hash_request_tokens
from jaxkv.blocks._hashing import none_hash as none_hash
from jaxkv.blocks._hashing import random_hash_seed as random_hash_seed
from jaxkv.blocks._hashing import sha256 as sha256
from jaxkv.blocks._hashing import sha256_cbor as sha256_cbor
from jaxkv.blocks._hashing import xxhash128 as xxhash128
from jaxkv.blocks._manager import Allocation as Allocation
from jaxkv.blocks._manager import CacheHit as CacheHit
from jaxkv.blocks._manager import KVCacheManager as KVCacheManager
from jaxkv.blocks._manager import TieredCacheHit as TieredCacheHit
from jaxkv.blocks._metrics import PrefixCacheStats as PrefixCacheStats
from jaxkv.blocks._metrics import PrefixCachingMetrics as PrefixCachingMetrics
from jaxkv.blocks._pool import NULL_BLOCK_ID as NULL_BLOCK_ID
from jaxkv.blocks._pool import BlockId as BlockId
from jaxkv.blocks._pool import BlockPool as BlockPool
from jaxkv.blocks._pool import EvictedBlock as EvictedBlock
from jaxkv.blocks._pool import EvictionHook as EvictionHook
from jaxkv.blocks._pool import TieredBlock as TieredBlock
from jaxkv.blocks._sizing import AttentionLayers as AttentionLayers
from jaxkv.blocks._sizing import KVCacheBuffer as KVCacheBuffer
from jaxkv.blocks._sizing import KVCacheGroup as KVCacheGroup
from jaxkv.blocks._sizing import KVCachePlan as KVCachePlan
from jaxkv.blocks._sizing import blocks_per_request as blocks_per_request
from jaxkv.blocks._sizing import estimate_max_model_len as estimate_max_model_len
from jaxkv.blocks._sizing import num_blocks_for_memory as num_blocks_for_memory
from jaxkv.blocks._sizing import plan_kv_cache as plan_kv_cache

__all__ = [
    "DEFAULT_HASH_SEED",
    "NONE_HASH",
    "RANDOM_HASH_SEED",
    "NULL_BLOCK_ID",
    "AllBlocksCleared",
    "Allocation",
    "AttentionLayers",
    "BlockError",
    "BlockHash",
    "BlockId",
    "BlockPool",
    "BlockRemoved",
    "BlockStored",
    "CacheHit",
    "DoubleFreeError",
    "EvictedBlock",
    "EvictionHook",
    "ExtraKeys",
    "FreeBlockQueue",
    "HashFunction",
    "InsufficientMemoryError",
    "InvalidBlockIdError",
    "KVCacheBuffer",
    "KVCacheEvent",
    "KVCacheGroup",
    "KVCacheManager",
    "KVCachePlan",
    "MultiModalInput",
    "OutOfBlocksError",
    "PartialBlockError",
    "PrefixCacheStats",
    "PrefixCachingMetrics",
    "TieredBlock",
    "TieredCacheHit",
    "RequestBlockHasher",
    "UnknownRequestError",
    "VllmAllBlocksCleared",
    "VllmBlockRemoved",
    "VllmBlockStored",
    "VllmKVEventBatch",
    "block_extra_keys",
    "decode_vllm_event_batch",
    "encode_vllm_event_batch",
    "blocks_per_request",
    "encode_key",
    "estimate_max_model_len",
    "get_hash_function",
    "hash_block_tokens",
    "hash_identity",
    "hash_request_tokens",
    "none_hash",
    "random_hash_seed",
    "num_blocks_for_memory",
    "plan_kv_cache",
    "sha256",
    "sha256_cbor",
    "to_vllm_event",
    "xxhash128",
]
