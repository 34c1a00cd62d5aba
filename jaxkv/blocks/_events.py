"""KV-cache events: what a KV-aware router needs to mirror an engine's prefix cache.

A pool created with ``enable_events=True`` queues one event per change of its hash -> block
map; a consumer drains them with ``take_events()`` (the queue is then empty). Replaying the
events in order on an empty set of hashes yields exactly the set of hashes the engine can hit.

Events follow vLLM's: one `BlockStored` per batch of newly cached blocks, one `BlockRemoved` per
evicted block, in eviction order, and `AllBlocksCleared` on a reset. `encode_vllm_event_batch`
serialises them in vLLM's wire shape (msgspec msgpack of a ``KVEventBatch`` holding tagged
``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` structs with vLLM's field names and
order), so a KV-aware router that follows vLLM's event stream can read them; with
``hash_fn="sha256_cbor"`` the hashes are the ones vLLM computes too.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable
from typing import Any

import msgspec

from jaxkv.blocks._hashing import BlockHash, ExtraKeys

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KVCacheEvent",
    "VllmAllBlocksCleared",
    "VllmBlockRemoved",
    "VllmBlockStored",
    "VllmKVEventBatch",
    "decode_vllm_event_batch",
    "encode_vllm_event_batch",
    "to_vllm_event",
]


@dataclasses.dataclass(frozen=True, slots=True)
class BlockStored:
    """Full blocks became hittable (their hashes were added to the cache).

    Attributes:
      block_hashes: the new hashes, in request order (each block's parent is the previous one).
      parent_block_hash: the hash of the block before ``block_hashes[0]``, or None when the
        first of them is a request's first block.
      token_ids: the tokens of these blocks, concatenated (``block_size`` per block); empty when
        the caller did not supply them.
      block_size: tokens per block.
      extra_keys: each block's extra keys (None for a block without), or None when no block has
        any.
      lora_id: the LoRA adapter of the request that stored them, if any.
      group_id: the KV-cache group (0 unless the model is hybrid).

    Example:
      >>> event = BlockStored((b"h1", b"h2"), None, (1, 2, 3, 4), 2, None, None, 0)
      >>> len(event.block_hashes)
      2
    """

    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    extra_keys: tuple[ExtraKeys | None, ...] | None
    lora_id: int | str | None
    group_id: int


@dataclasses.dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Cached blocks were evicted: their hashes no longer hit.

    A pool emits one event per evicted block (``block_hashes`` of length 1), in the order the
    blocks were evicted, as vLLM does.

    Attributes:
      block_hashes: the removed hashes.
      group_id: the KV-cache group.

    Example:
      >>> BlockRemoved((b"h1",), 0).block_hashes
      (b'h1',)
    """

    block_hashes: tuple[BlockHash, ...]
    group_id: int


@dataclasses.dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The whole prefix cache was reset: no hash hits any more.

    Example:
      >>> AllBlocksCleared() == AllBlocksCleared()
      True
    """


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
"""Any event a pool emits."""


# ----------------------------------------------------------------------------- vLLM wire shape


class _VllmEvent(msgspec.Struct, omit_defaults=True, gc=False):
    """Base of the wire structs (vLLM's ``KVCacheEvent``: tagged, defaults omitted)."""


class VllmBlockStored(_VllmEvent, tag="BlockStored"):
    """vLLM's ``BlockStored`` wire struct (same field names and order; msgpack tag
    ``"BlockStored"`` in the ``type`` field).

    Example:
      >>> VllmBlockStored([b"h"], None, [1, 2], 2, None, "GPU", None).block_size
      2
    """

    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class VllmBlockRemoved(_VllmEvent, tag="BlockRemoved"):
    """vLLM's ``BlockRemoved`` wire struct.

    Example:
      >>> VllmBlockRemoved([b"h"], "GPU", 0).group_idx
      0
    """

    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None


class VllmAllBlocksCleared(_VllmEvent, tag="AllBlocksCleared"):
    """vLLM's ``AllBlocksCleared`` wire struct.

    Example:
      >>> VllmAllBlocksCleared() == VllmAllBlocksCleared()
      True
    """


class VllmKVEventBatch(msgspec.Struct, omit_defaults=True, gc=False):
    """vLLM's ``KVEventBatch``: what its publisher sends (msgpack) per scheduler step.

    Attributes:
      ts: the batch's wall-clock time (seconds since the epoch).
      events: the events, oldest first.
      data_parallel_rank: the engine's data-parallel rank, if any.

    Example:
      >>> VllmKVEventBatch(0.0, [VllmAllBlocksCleared()]).events
      [VllmAllBlocksCleared()]
    """

    ts: float
    events: list[VllmBlockStored | VllmBlockRemoved | VllmAllBlocksCleared]
    data_parallel_rank: int | None = None


_MASK_64 = (1 << 64) - 1


def _wire_hash(block_hash: bytes, int_block_hashes: bool) -> bytes | int:
    # vLLM's VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES: the low 64 bits of the big-endian integer.
    return int.from_bytes(block_hash, "big") & _MASK_64 if int_block_hashes else block_hash


def to_vllm_event(
    event: KVCacheEvent, *, medium: str | None = "GPU", int_block_hashes: bool = False
) -> VllmBlockStored | VllmBlockRemoved | VllmAllBlocksCleared:
    """Converts an event to vLLM's wire struct.

    An int ``lora_id`` goes to ``lora_id``, a str one to ``lora_name``; ``group_id`` goes to
    ``group_idx``.

    Args:
      event: a `BlockStored`, `BlockRemoved` or `AllBlocksCleared`.
      medium: the tier the blocks live in (vLLM's ``"GPU"`` for device blocks).
      int_block_hashes: send hashes as 64-bit ints, as vLLM does with
        ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`` (default: the digest bytes).

    Returns:
      The `VllmBlockStored`, `VllmBlockRemoved` or `VllmAllBlocksCleared`.

    Raises:
      TypeError: not an event.

    Example:
      >>> to_vllm_event(BlockRemoved((b"h",), 0))
      VllmBlockRemoved(block_hashes=[b'h'], medium='GPU', group_idx=0)
    """
    if isinstance(event, BlockRemoved):
        return VllmBlockRemoved(
            [_wire_hash(h, int_block_hashes) for h in event.block_hashes], medium, event.group_id
        )
    if isinstance(event, BlockStored):
        lora = event.lora_id
        return VllmBlockStored(
            block_hashes=[_wire_hash(h, int_block_hashes) for h in event.block_hashes],
            parent_block_hash=None if event.parent_block_hash is None
            else _wire_hash(event.parent_block_hash, int_block_hashes),
            token_ids=list(event.token_ids),
            block_size=event.block_size,
            lora_id=lora if isinstance(lora, int) else None,
            medium=medium,
            lora_name=lora if isinstance(lora, str) else None,
            extra_keys=None if event.extra_keys is None else list(event.extra_keys),
            group_idx=event.group_id,
        )
    if isinstance(event, AllBlocksCleared):
        return VllmAllBlocksCleared()
    raise TypeError(f"not a KV-cache event: {type(event).__name__}")


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(VllmKVEventBatch)


def encode_vllm_event_batch(
    events: Iterable[KVCacheEvent],
    *,
    ts: float | None = None,
    data_parallel_rank: int | None = None,
    medium: str | None = "GPU",
    int_block_hashes: bool = False,
) -> bytes:
    """Serialises events as one vLLM ``KVEventBatch`` (msgspec msgpack): the payload vLLM's
    ZMQ event publisher sends, readable by a router that decodes vLLM's events.

    Args:
      events: e.g. `KVCacheManager.take_events()`.
      ts: the batch time (default: now).
      data_parallel_rank: the engine's data-parallel rank (omitted when None).
      medium, int_block_hashes: as in `to_vllm_event`.

    Returns:
      The msgpack bytes.

    Raises:
      TypeError: an element that is not an event.

    Example:
      >>> data = encode_vllm_event_batch([BlockRemoved((b"h",), 0)], ts=1.0)
      >>> decode_vllm_event_batch(data).events[0].block_hashes
      [b'h']
    """
    batch = VllmKVEventBatch(
        time.time() if ts is None else float(ts),
        [to_vllm_event(e, medium=medium, int_block_hashes=int_block_hashes) for e in events],
        data_parallel_rank,
    )
    return _ENCODER.encode(batch)


def decode_vllm_event_batch(data: bytes) -> VllmKVEventBatch:
    """Parses a vLLM ``KVEventBatch`` payload (from `encode_vllm_event_batch` or vLLM).

    Raises:
      msgspec.ValidationError, msgspec.DecodeError: not a valid batch.

    Example:
      >>> decode_vllm_event_batch(encode_vllm_event_batch([], ts=2.0)).ts
      2.0
    """
    return _DECODER.decode(data)
