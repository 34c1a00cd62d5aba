"""KV-cache events: what a KV-aware router needs to mirror an engine's prefix cache.

A pool created with ``enable_events=True`` queues one event per change of its hash -> block
map; a consumer drains them with ``take_events()`` (the queue is then empty). Replaying the
events in order on an empty set of hashes yields exactly the set of hashes the engine can hit.
"""

from __future__ import annotations

import dataclasses

from jaxkv.blocks._hashing import BlockHash, ExtraKeys

__all__ = ["AllBlocksCleared", "BlockRemoved", "BlockStored", "KVCacheEvent"]


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
