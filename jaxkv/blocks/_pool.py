"""`BlockPool`: a fixed set of physical KV-cache blocks with ref counts and a prefix cache.

Block ids are *physical* ids: the index of a block in the cache arrays (``BlockId``). A
request's block table maps its *logical* block index (token position // block size) to a
`BlockId`; the pool never sees logical indices, and every id it receives is checked against
``[0, num_blocks)``.

Behaviour follows vLLM's ``BlockPool`` (v1): block 0 is the null block (never allocated, freed
or cached; it stands for "no block" in a block table); a free block may still hold a cached
hash and is evicted (its hash dropped) only when it is handed out again; freed blocks without
a hash go to the front of the free queue (reused first) and cached ones to the back, in the
order given, so freeing a request's blocks in reverse order evicts its tail first (LRU, then
tail-first).
"""

from __future__ import annotations

import collections
import logging
import operator
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, NewType

import numpy as np

from jaxkv.blocks._errors import (
    BlockError,
    DoubleFreeError,
    InvalidBlockIdError,
    OutOfBlocksError,
)
from jaxkv.blocks._events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from jaxkv.blocks._free_queue import FreeBlockQueue
from jaxkv.blocks._hashing import BlockHash, ExtraKeys

__all__ = ["NULL_BLOCK_ID", "BlockId", "BlockPool", "EvictedBlock", "EvictionHook", "TieredBlock"]

_log = logging.getLogger(__name__)

BlockId = NewType("BlockId", int)
"""A physical block id: the block's index in the cache arrays, in ``[0, num_blocks)``."""

NULL_BLOCK_ID: BlockId = BlockId(0)
"""The null block: a placeholder in block tables (e.g. positions a sliding window dropped)."""

_SCALAR_MAX = 8  # Up to this many ids, plain Python beats numpy's per-call overhead.


class EvictedBlock(NamedTuple):
    """A cached block whose hash was dropped because the block was handed out again; its
    bytes are still intact until the new owner writes it (for an offload tier to save them).

    Attributes:
      block_id: the physical block.
      block_hash: the hash it cached.
      group: the KV-cache group of the hash.

    Example:
      >>> EvictedBlock(BlockId(3), b"h", 0).block_hash
      b'h'
    """

    block_id: BlockId
    block_hash: BlockHash
    group: int


EvictionHook = Callable[[list[EvictedBlock]], None]
"""Called by `BlockPool.allocate` with the cached blocks it evicted (see `set_eviction_hook`)."""


class TieredBlock(NamedTuple):
    """One block of a tiered prefix hit (`BlockPool.find_longest_tiered_hit`).

    Attributes:
      tier: "device" for a block of this pool, else the name of the lower tier that holds it.
      block_id: the device block for "device", None otherwise.

    Example:
      >>> TieredBlock("host", None).tier
      'host'
    """

    tier: str
    block_id: BlockId | None


class BlockPool:
    """Physical blocks ``0 .. num_blocks - 1`` with ref counts, a free queue and a prefix cache.

    Every block other than the null block is either *free* (ref count 0, in the free queue;
    it may still hold a cached hash) or *in use* (ref count > 0). Each cached hash maps to a
    block that carries it. Every method either completes or raises before changing anything.

    Args:
      num_blocks: blocks in the pool, including the null block (so ``num_blocks - 1`` are
        usable). At least 2.
      enable_caching: keep full blocks' hashes for prefix hits. When off, freed blocks all go
        to the back of the free queue and `cache_blocks` raises.
      enable_events: queue `BlockStored` / `BlockRemoved` / `AllBlocksCleared` events, drained
        with `take_events`.

    Raises:
      ValueError: ``num_blocks < 2``.

    Example:
      >>> pool = BlockPool(8)
      >>> blocks = pool.allocate(3)
      >>> blocks
      [1, 2, 3]
      >>> pool.cache_blocks(blocks[:2], [b"h0", b"h1"])
      2
      >>> pool.free(blocks[::-1])          # a request frees its blocks in reverse order
      >>> pool.find_longest_cache_hit([b"h0", b"h1", b"h2"])
      [1, 2]
      >>> pool.free_block_ids()            # uncached first, then LRU with the tail first
      [3, 4, 5, 6, 7, 2, 1]
    """

    def __init__(
        self, num_blocks: int, *, enable_caching: bool = True, enable_events: bool = False
    ) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, (int, np.integer)):
            raise TypeError(f"num_blocks must be an int, got {type(num_blocks).__name__}")
        num_blocks = int(num_blocks)
        if num_blocks < 2:
            raise ValueError(
                f"a pool needs at least 2 blocks (the null block and one usable), got {num_blocks}"
            )
        self._num_blocks = num_blocks
        self._enable_caching = bool(enable_caching)
        self._ref = np.zeros(num_blocks, dtype=np.int32)
        self._ref[0] = 1  # The null block is pinned: never free, never allocated.
        self._hashed = np.zeros(num_blocks, dtype=np.bool_)
        self._group = np.zeros(num_blocks, dtype=np.int32)
        self._refv = self._ref.data  # memoryviews: cheap scalar access to the same memory.
        self._hashedv = self._hashed.data
        self._groupv = self._group.data
        self._hash = np.full(num_blocks, None, dtype=object)  # BlockHash | None per block.
        self._mark = np.zeros(num_blocks, dtype=np.int64)  # Scratch: duplicate detection.
        self._maps: list[dict[BlockHash, int]] = [{}]
        self._dups: dict[tuple[int, BlockHash], list[int]] = {}
        self._num_cached = 0
        self._epoch = 0
        self._queue = FreeBlockQueue(num_blocks, np.arange(1, num_blocks))
        # The queue's front stack (front block last). With caching on it holds only blocks
        # without a cached hash (freed uncached blocks go to the front), so taking one never
        # evicts anything: the decode hot path.
        self._front = self._queue._front
        self._events: list[KVCacheEvent] | None = [] if enable_events else None
        self._evict_hook: EvictionHook | None = None

    def __repr__(self) -> str:
        return (
            f"BlockPool(num_blocks={self._num_blocks}, free={len(self._queue)}, "
            f"cached={self._num_cached})"
        )

    # ------------------------------------------------------------------ properties

    @property
    def num_blocks(self) -> int:
        """Blocks in the pool, including the null block."""
        return self._num_blocks

    @property
    def null_block(self) -> BlockId:
        """The null block's id (0)."""
        return NULL_BLOCK_ID

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be allocated now (free, cached or not)."""
        return len(self._queue)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks that hold a cached hash (in use or free)."""
        return self._num_cached

    @property
    def usage(self) -> float:
        """Fraction of usable blocks in use, in ``[0, 1]``."""
        return 1.0 - len(self._queue) / (self._num_blocks - 1)

    @property
    def enable_caching(self) -> bool:
        """Whether prefix caching is on."""
        return self._enable_caching

    @property
    def enable_events(self) -> bool:
        """Whether events are queued."""
        return self._events is not None

    @property
    def cache_epoch(self) -> int:
        """A counter that grows whenever a cached hash is dropped (eviction or reset): a lookup
        result taken at the same epoch is still valid."""
        return self._epoch

    # ------------------------------------------------------------------ id validation

    def _check_id(self, block_id: Any) -> int:
        if type(block_id) is not int:
            if isinstance(block_id, np.integer):
                block_id = int(block_id)
            else:
                raise InvalidBlockIdError(
                    f"block ids must be ints, got {type(block_id).__name__} {block_id!r}"
                )
        if not 0 <= block_id < self._num_blocks:
            raise InvalidBlockIdError(
                f"block id {block_id} is out of range for a pool of {self._num_blocks} blocks"
            )
        return block_id

    def _id_array(self, block_ids: Any) -> np.ndarray:
        array = FreeBlockQueue._as_ids(block_ids)
        if array.size == 0:
            return array
        low, high = array.min(), array.max()
        if low < 0 or high >= self._num_blocks:
            bad = int(low) if low < 0 else int(high)
            raise InvalidBlockIdError(
                f"block id {bad} is out of range for a pool of {self._num_blocks} blocks"
            )
        return array

    def _last_occurrence(self, array: np.ndarray) -> np.ndarray:
        """Mask of the positions holding each id's last occurrence."""
        positions = np.arange(array.size)
        self._mark[array] = positions
        return self._mark[array] == positions

    # ------------------------------------------------------------------ allocate / free / touch

    def allocate(self, num_blocks: int) -> list[BlockId]:
        """Takes blocks from the front of the free queue, evicting any cached hash they hold.

        Args:
          num_blocks: how many blocks.

        Returns:
          Their ids, each with ref count 1, in free-queue order.

        Raises:
          OutOfBlocksError: fewer than ``num_blocks`` blocks are free.
          ValueError: ``num_blocks < 0``.
          TypeError: ``num_blocks`` is not an int.

        Example:
          >>> BlockPool(4).allocate(2)
          [1, 2]
        """
        front = self._front  # Empty when caching is off (freed blocks then go to the back).
        if type(num_blocks) is int and 0 < num_blocks <= len(front):
            if num_blocks == 1:
                block = front.pop()
                self._refv[block] = 1
                return [block]  # type: ignore[list-item]
            taken: list[Any] = front[: -num_blocks - 1 : -1]  # The front block first.
            del front[-num_blocks:]
            refv = self._refv
            for block in taken:
                refv[block] = 1
            return taken
        if isinstance(num_blocks, bool):
            raise TypeError("num_blocks must be an int, got bool")
        count = operator.index(num_blocks)
        if count < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({count})")
        free = len(self._queue)
        if count > free:
            raise OutOfBlocksError(
                f"cannot allocate {count} blocks: {free} of the pool's "
                f"{self._num_blocks - 1} usable blocks are free"
            )
        if count == 0:
            return []
        evicted: list[EvictedBlock] = []
        if count <= _SCALAR_MAX:
            queue = self._queue
            refv = self._refv
            hashedv = self._hashedv
            out: list[Any]
            if not front and not queue._stale:
                # The array holds only live entries: take a slice (no per-block pops).
                head = queue._head
                out = queue._bufv[head : head + count].tolist()
                queue._head = head + count
                queue._len -= count
                posv = queue._posv
                for block in out:
                    posv[block] = -1
            else:
                popleft = queue.popleft
                out = [popleft() for _ in range(count)]
            for block in out:
                if hashedv[block]:
                    if self._evict_hook is not None:
                        evicted.append(EvictedBlock(BlockId(block), self._hash[block],
                                                    self._groupv[block]))
                    self._drop_hash(block)
                refv[block] = 1
        else:
            return self.allocate_array(count).tolist()
        if evicted:
            self._notify_evicted(evicted)
        return out  # type: ignore[return-value]

    def allocate_array(self, count: int) -> np.ndarray:
        """`allocate` for the block manager, which checked ``0 < count <= num_free_blocks``:
        the ids as an int64 array.

        Example:
          >>> BlockPool(8).allocate_array(2).tolist()
          [1, 2]
        """
        ids = self._queue.popleft_n(count)
        if self._num_cached:
            cached = self._hashed[ids]
            if cached.any():
                dropped = ids[cached]
                evicted = None
                if self._evict_hook is not None:
                    evicted = [
                        EvictedBlock(block, self._hash[block], int(self._group[block]))
                        for block in dropped.tolist()
                    ]
                self._drop_hashes(dropped)
                if evicted:
                    self._ref[ids] = 1
                    self._notify_evicted(evicted)
                    return ids
        self._ref[ids] = 1
        return ids

    def set_eviction_hook(self, hook: EvictionHook | None) -> None:
        """Calls `hook` with the cached blocks that `allocate` evicts (hands out again), so an
        offload tier can save their bytes instead of dropping them. Explicit `evict` and
        `reset_prefix_cache` (invalid data) do not call it.

        The hook runs after the allocation is complete, before `allocate` returns: the evicted
        blocks' bytes are intact until their new owner writes them. An exception from the
        hook is logged and the blocks are dropped as without a hook.

        Args:
          hook: a callable taking a list of `EvictedBlock`, or None to remove it.

        Example:
          >>> pool = BlockPool(2)
          >>> seen = []
          >>> pool.set_eviction_hook(seen.extend)
          >>> block = pool.allocate(1); _ = pool.cache_blocks(block, [b"h"]); pool.free(block)
          >>> _ = pool.allocate(1); seen
          [EvictedBlock(block_id=1, block_hash=b'h', group=0)]
        """
        if hook is not None and not callable(hook):
            raise TypeError(f"the eviction hook must be callable, got {type(hook).__name__}")
        self._evict_hook = hook

    def _notify_evicted(self, evicted: list[EvictedBlock]) -> None:
        hook = self._evict_hook
        if hook is None:
            return
        try:
            hook(evicted)
        except Exception:  # The pool is consistent: the blocks are just not saved.
            _log.exception("block pool eviction hook failed; %d evicted blocks dropped",
                           len(evicted))

    def _drop_hashes(self, ids: np.ndarray) -> None:
        """Evicts the hashes of distinct cached blocks, vectorised where possible."""
        groups = self._group[ids]
        group = int(groups[0])
        if self._dups or (len(self._maps) > 1 and not (groups == group).all()):
            for block in ids.tolist():
                self._drop_hash(block)
            return
        # One group and no duplicate hashes: every cached block is its hash's only entry.
        hashes = self._hash[ids].tolist()
        cache = self._maps[group]
        for block_hash in hashes:
            del cache[block_hash]
        self._hash[ids] = None
        self._hashed[ids] = False
        self._num_cached -= len(hashes)
        self._epoch += len(hashes)
        if self._events is not None:  # One event per block, in eviction order (as vLLM).
            self._events.extend([BlockRemoved((block_hash,), group) for block_hash in hashes])

    def free(self, block_ids: Sequence[int] | np.ndarray) -> None:
        """Drops one reference to each block; blocks reaching zero become free.

        ``block_ids`` is in eviction priority: among the blocks freed here, those without a
        cached hash go to the front of the free queue (reused first) and cached ones to the
        back, each in the given order. A request frees its blocks in reverse so its last blocks
        are evicted first. The null block is skipped. A block listed k times drops k references
        and is queued at its last occurrence.

        Args:
          block_ids: ids of blocks in use.

        Raises:
          DoubleFreeError: a block is free already, or is listed more often than it is
            referenced (nothing is freed).
          InvalidBlockIdError: an id out of range or not an integer (nothing is freed).

        Example:
          >>> pool = BlockPool(4)
          >>> pool.free(pool.allocate(2))
          >>> pool.free([1])
          Traceback (most recent call last):
          ...
          jaxkv.blocks._errors.DoubleFreeError: block 1 is already free (double free, or ...
        """
        if type(block_ids) is list and 0 < len(block_ids) <= 8 and self._enable_caching:
            # Decode hot path: blocks a request holds alone (ref count 1), without a cached
            # hash; they go to the front of the queue, the first given block in front. Any
            # other case is undone and takes the general path.
            refv = self._refv
            hashedv = self._hashedv
            try:  # An id past the end raises IndexError from the memoryview.
                for block in block_ids:
                    if type(block) is int and block > 0 and refv[block] == 1 \
                            and not hashedv[block]:
                        refv[block] = 0
                    else:
                        break
                else:
                    if len(block_ids) == 1:
                        self._front.append(block_ids[0])
                    else:
                        self._front.extend(block_ids[::-1])
                    return
            except IndexError:
                pass
            self._undo_fast_free(block_ids)
        if not isinstance(block_ids, np.ndarray) and len(block_ids) <= _SCALAR_MAX:
            self._free_small(block_ids)
        else:
            self.free_array(self._id_array(block_ids))

    def _undo_fast_free(self, block_ids: list[Any]) -> None:
        """Restores the ref counts the fast path of `free` zeroed before it met a block it does
        not handle. Those blocks are distinct, valid, uncached, at ref count 0 and not queued;
        the first block that is not all of these is where the fast path stopped (a block that
        is really free is queued)."""
        refv = self._refv
        queue = self._queue
        seen: set[int] = set()
        for block in block_ids:
            if type(block) is not int or not 0 < block < self._num_blocks or block in seen:
                return
            if refv[block] != 0 or self._hashedv[block] or block in queue:
                return
            refv[block] = 1
            seen.add(block)

    def _free_small(self, block_ids: Sequence[int]) -> None:
        ids = [self._check_id(block) for block in block_ids]
        refv = self._refv
        if len(ids) > 1 and len(set(ids)) != len(ids):
            for block, count in collections.Counter(ids).items():
                if block and refv[block] < count:
                    raise self._double_free(block, count)
        else:
            for block in ids:
                if block and refv[block] <= 0:
                    raise self._double_free(block, 1)
        fresh = []
        cached = []
        caching = self._enable_caching
        hashedv = self._hashedv
        for block in ids:
            if block == 0:
                continue
            count = refv[block] - 1
            refv[block] = count
            if count == 0:
                if caching and not hashedv[block]:
                    fresh.append(block)
                else:
                    cached.append(block)
        queue = self._queue
        for block in reversed(fresh):
            queue.prepend(block)
        for block in cached:
            queue.append(block)

    def free_array(self, ids: np.ndarray) -> None:
        """`free` for the block manager: an int64 array of ids it holds (null ids skipped).

        Example:
          >>> pool = BlockPool(8)
          >>> pool.free_array(pool.allocate_array(2)); pool.num_free_blocks
          7
        """
        if ids.size == 0:
            return
        nonnull = ids != 0
        if not nonnull.all():
            ids = ids[nonnull]
            if ids.size == 0:
                return
        refs = self._ref[ids]
        if (refs <= 0).any():
            raise self._double_free(int(ids[refs <= 0][0]), 1)
        last = self._last_occurrence(ids)
        if last.all():
            self._ref[ids] = refs - 1
            freeable = ids[refs == 1]
        else:
            unique, counts = np.unique(ids, return_counts=True)
            over = counts > self._ref[unique]
            if over.any():
                raise self._double_free(int(unique[over][0]), int(counts[over][0]))
            np.subtract.at(self._ref, ids, 1)
            freeable = ids[last & (self._ref[ids] == 0)]
        if freeable.size == 0:
            return
        if self._enable_caching:
            cached = self._hashed[freeable]
            if cached.any():
                if not cached.all():
                    self._queue._prepend_unchecked(freeable[~cached])
                self._queue._append_unchecked(freeable[cached])
            else:
                self._queue._prepend_unchecked(freeable)
        else:
            self._queue._append_unchecked(freeable)

    def _double_free(self, block: int, count: int) -> DoubleFreeError:
        refs = self._refv[block]
        if refs <= 0:
            return DoubleFreeError(
                f"block {block} is already free (double free, or never allocated)"
            )
        return DoubleFreeError(f"block {block} is freed {count} times but holds {refs} references")

    def touch(self, block_ids: Sequence[int] | np.ndarray) -> None:
        """Adds one reference to each block (a prefix-cache hit): a cached free block leaves
        the free queue, so it is not evicted while in use. The null block is skipped.

        Args:
          block_ids: blocks in use, or free blocks that hold a cached hash.

        Raises:
          InvalidBlockIdError: an id out of range, or a free block without a cached hash (it
            holds no data worth sharing: allocate instead). Nothing is touched.

        Example:
          >>> pool = BlockPool(4)
          >>> block = pool.allocate(1)
          >>> _ = pool.cache_blocks(block, [b"h"]); pool.free(block)
          >>> pool.touch(block); pool.ref_count(block[0]), pool.num_free_blocks
          (1, 2)
        """
        if not isinstance(block_ids, np.ndarray) and len(block_ids) <= _SCALAR_MAX:
            ids = [self._check_id(block) for block in block_ids]
            refv = self._refv
            hashedv = self._hashedv
            for block in ids:
                if block and refv[block] == 0 and not hashedv[block]:
                    raise self._touch_error(block)
            queue = self._queue
            for block in ids:
                if block == 0:
                    continue
                if refv[block] == 0:
                    queue.remove(block)
                refv[block] += 1
            return
        array = self._id_array(block_ids)
        if array.size == 0:
            return
        nonnull = array != 0
        if not nonnull.all():
            array = array[nonnull]
        refs = self._ref[array]
        free = refs == 0
        free_ids = array[free]
        if free_ids.size:
            uncached = ~self._hashed[free_ids]
            if uncached.any():
                raise self._touch_error(int(free_ids[uncached][0]))
        if self._last_occurrence(array).all():
            self._queue._remove_unchecked(free_ids)
            self._ref[array] = refs + 1
        else:
            self._queue._remove_unchecked(np.unique(free_ids))
            np.add.at(self._ref, array, 1)

    @staticmethod
    def _touch_error(block: int) -> InvalidBlockIdError:
        return InvalidBlockIdError(
            f"block {block} is free and holds no cached data; allocate blocks instead of "
            "touching free ones"
        )

    # ------------------------------------------------------------------ prefix cache

    def _map(self, group: int) -> dict[BlockHash, int]:
        while group >= len(self._maps):
            self._maps.append({})
        return self._maps[group]

    @staticmethod
    def _check_group(group: Any) -> int:
        if isinstance(group, bool) or not isinstance(group, (int, np.integer)) or group < 0:
            raise ValueError(f"group must be an int >= 0, got {group!r}")
        return int(group)

    def cache_blocks(
        self,
        block_ids: Sequence[int] | np.ndarray,
        block_hashes: Sequence[BlockHash],
        *,
        group: int = 0,
        parent_block_hash: BlockHash | None = None,
        token_ids: Sequence[int] | None = None,
        block_size: int = 0,
        extra_keys: Sequence[ExtraKeys | None] | None = None,
        lora_id: int | str | None = None,
    ) -> int:
        """Registers full blocks' hashes so later requests can hit them.

        Blocks that already carry the same hash (prefix hits) are skipped. A hash may be
        carried by several blocks (two requests computed the same prefix at once); lookups
        return the first.

        Args:
          block_ids: blocks in use that are full.
          block_hashes: their hashes (same length).
          group: the KV-cache group the blocks belong to (hashes are per group).
          parent_block_hash, token_ids, block_size, extra_keys, lora_id: only copied into the
            `BlockStored` event (when events are on); see `BlockStored`.

        Returns:
          The number of blocks newly cached.

        Raises:
          BlockError: caching is disabled, lengths differ, or a block already carries a
            different hash.
          InvalidBlockIdError: the null block, a free block, an id out of range, or the same
            block twice.
          TypeError: a hash that is not non-empty bytes.

        Example:
          >>> pool = BlockPool(4)
          >>> pool.cache_blocks(pool.allocate(2), [b"a", b"b"])
          2
          >>> pool.get_cached_block(b"b")
          2
        """
        for block_hash in block_hashes:
            if type(block_hash) is not bytes or not block_hash:
                raise TypeError(f"block hashes must be non-empty bytes, got {block_hash!r}")
        return self._cache_blocks(
            block_ids, block_hashes, self._check_group(group), parent_block_hash, token_ids,
            block_size, extra_keys, lora_id,
        )

    def cache_trusted(
        self,
        id_list: Sequence[int],
        ids: np.ndarray,
        hashes: list[BlockHash],
        group: int,
        parent_block_hash: BlockHash | None,
        token_ids: Sequence[int] | None,
        block_size: int,
        extra_keys: Sequence[ExtraKeys | None] | None,
        lora_id: int | str | None,
    ) -> int:
        """`cache_blocks` for the block manager, which guarantees distinct blocks in use,
        bytes hashes and caching on; the arguments are `cache_blocks`' with the ids given
        both as a list and as an int64 array.

        Example:
          >>> pool = BlockPool(8)
          >>> ids = pool.allocate_array(2)
          >>> pool.cache_trusted(ids.tolist(), ids, [b"h0", b"h1"], 0, None, None, 0, None, None)
          2
        """
        if self._hashed[ids].any():  # Never expected from the manager: take the checked path.
            return self._cache_blocks(ids, hashes, group, parent_block_hash, token_ids,
                                      block_size, extra_keys, lora_id)
        return self._apply_cache(id_list, ids, hashes, group, parent_block_hash, token_ids,
                                 block_size, extra_keys, lora_id)

    def _cache_blocks(
        self,
        block_ids: Sequence[int] | np.ndarray,
        block_hashes: Sequence[BlockHash],
        group: int,
        parent_block_hash: BlockHash | None,
        token_ids: Sequence[int] | None,
        block_size: int,
        extra_keys: Sequence[ExtraKeys | None] | None,
        lora_id: int | str | None,
    ) -> int:
        if not self._enable_caching:
            raise BlockError("prefix caching is disabled for this pool")
        count = len(block_ids)
        if len(block_hashes) != count:
            raise BlockError(f"got {count} blocks but {len(block_hashes)} hashes")
        if count == 0:
            return 0
        small = count <= _SCALAR_MAX and not isinstance(block_ids, np.ndarray)
        if small:
            ids = [self._check_id(block) for block in block_ids]
            refv = self._refv
            for block in ids:
                if block == 0:
                    raise InvalidBlockIdError("the null block cannot be cached")
                if refv[block] <= 0:
                    raise InvalidBlockIdError(
                        f"block {block} is free: only blocks in use can be cached"
                    )
            if len(set(ids)) != count:
                raise InvalidBlockIdError(f"a block appears twice in {ids}")
            already = [self._hashedv[block] for block in ids]
            any_already = any(already)
        else:
            array = self._id_array(block_ids)
            if (array == 0).any():
                raise InvalidBlockIdError("the null block cannot be cached")
            free = self._ref[array] <= 0
            if free.any():
                raise InvalidBlockIdError(
                    f"block {int(array[free][0])} is free: only blocks in use can be cached"
                )
            if not self._last_occurrence(array).all():
                raise InvalidBlockIdError("a block appears twice in the blocks to cache")
            already_mask = self._hashed[array]
            any_already = bool(already_mask.any())
            ids = array.tolist()
            already = already_mask.tolist()
        hashes = block_hashes if isinstance(block_hashes, list) else list(block_hashes)
        if any_already:
            keep = []
            for index, (block, block_hash) in enumerate(zip(ids, hashes)):
                if already[index]:
                    if self._hash[block] != block_hash or self._groupv[block] != group:
                        raise BlockError(
                            f"block {block} already caches hash {self._hash[block]!r} "
                            f"(group {self._groupv[block]}); cannot cache {block_hash!r} "
                            f"(group {group})"
                        )
                else:
                    keep.append(index)
            ids = [ids[index] for index in keep]
            hashes = [hashes[index] for index in keep]
            if not ids:
                return 0
            small = True  # Per-block updates below.
        return self._apply_cache(ids, None if small else array, hashes, group, parent_block_hash,
                                 token_ids, block_size, extra_keys, lora_id)

    def _apply_cache(
        self,
        ids: Sequence[int],
        array: np.ndarray | None,
        hashes: list[BlockHash],
        group: int,
        parent_block_hash: BlockHash | None,
        token_ids: Sequence[int] | None,
        block_size: int,
        extra_keys: Sequence[ExtraKeys | None] | None,
        lora_id: int | str | None,
    ) -> int:
        cache = self._map(group)
        if cache.keys().isdisjoint(hashes):
            before = len(cache)
            cache.update(zip(hashes, ids))
            if len(cache) - before != len(ids):  # Repeated hashes within the batch.
                for block_hash in hashes:
                    cache.pop(block_hash, None)
                self._insert_each(cache, group, ids, hashes)
        else:
            self._insert_each(cache, group, ids, hashes)
        if array is None:
            hash_array = self._hash
            hashedv = self._hashedv
            groupv = self._groupv
            for block, block_hash in zip(ids, hashes):
                hash_array[block] = block_hash
                hashedv[block] = True
                groupv[block] = group
        else:
            self._hash[array] = hashes
            self._hashed[array] = True
            self._group[array] = group
        self._num_cached += len(ids)
        if self._events is not None:
            self._events.append(
                BlockStored(
                    block_hashes=tuple(hashes),
                    parent_block_hash=parent_block_hash,
                    token_ids=tuple(token_ids) if token_ids is not None else (),
                    block_size=int(block_size),
                    extra_keys=tuple(extra_keys) if extra_keys is not None else None,
                    lora_id=lora_id,
                    group_id=group,
                )
            )
        return len(ids)

    def _insert_each(
        self, cache: dict[BlockHash, int], group: int, ids: Sequence[int], hashes: list[BlockHash]
    ) -> None:
        for block, block_hash in zip(ids, hashes):
            if block_hash in cache:
                self._dups.setdefault((group, block_hash), []).append(block)
            else:
                cache[block_hash] = block

    def cache_block(self, block: int, block_hash: BlockHash) -> bool:
        """Caches one full block of group 0 that the block manager holds, if nothing else has
        to happen (no event to record, the block not yet cached, the hash not cached under
        another block); returns whether it did (if not, use `cache_trusted`). The decode fast
        path: one call per block a step filled.

        Example:
          >>> pool = BlockPool(8)
          >>> block, other = pool.allocate(2)
          >>> pool.cache_block(block, b"h"), pool.cache_block(other, b"h")
          (True, False)
        """
        cache = self._maps[0]
        if self._events is not None or self._hashedv[block] or block_hash in cache:
            return False
        cache[block_hash] = block
        self._hash[block] = block_hash
        self._hashedv[block] = True
        self._groupv[block] = 0
        self._num_cached += 1
        return True

    def count_unreferenced(self, ids: np.ndarray) -> int:
        """How many of `ids` no request holds (cached, free blocks that a hit would take).

        Example:
          >>> pool = BlockPool(8)
          >>> pool.free(pool.allocate(1)); pool.count_unreferenced(np.array([1, 2]))
          2
        """
        return int(np.count_nonzero(self._ref[ids] == 0))

    def get_cached_block(self, block_hash: BlockHash, group: int = 0) -> BlockId | None:
        """The block caching ``block_hash`` in ``group``, or None.

        Example:
          >>> BlockPool(4).get_cached_block(b"missing") is None
          True
        """
        if group >= len(self._maps):
            return None
        return self._maps[group].get(block_hash)  # type: ignore[return-value]

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], group: int = 0
    ) -> list[BlockId]:
        """The blocks of the longest cached prefix of a chain of block hashes.

        Lookup only: nothing is touched (call `touch` on the result to use it).

        Args:
          block_hashes: a request's block hashes, first block first.
          group: the KV-cache group.

        Returns:
          Block ids of ``block_hashes[:k]`` for the largest k where all are cached.

        Example:
          >>> pool = BlockPool(8)
          >>> _ = pool.cache_blocks(pool.allocate(2), [b"a", b"b"])
          >>> pool.find_longest_cache_hit([b"a", b"b", b"c"]), pool.find_longest_cache_hit([b"x"])
          ([1, 2], [])
        """
        if group >= len(self._maps):
            return []
        get = self._maps[group].get
        found: list[Any]
        # Probe a short prefix first (misses are usually early), then map the rest in one call.
        found = list(map(get, block_hashes[:64]))
        if len(block_hashes) > 64 and None not in found:
            found.extend(map(get, block_hashes[64:]))
        if None in found:
            del found[found.index(None) :]
        return found

    def find_longest_tiered_hit(
        self,
        block_hashes: Sequence[BlockHash],
        lower_tiers: Sequence[tuple[str, Callable[[BlockHash], bool]]],
        group: int = 0,
    ) -> list[TieredBlock]:
        """The longest prefix of a hash chain found in this pool or in lower tiers.

        Each block is looked up on the device first (this pool), then in each lower tier in
        order (e.g. host, then disk); the prefix ends at the first block found nowhere.
        Lookup only: nothing is touched.

        Args:
          block_hashes: a request's block hashes, first block first.
          lower_tiers: ``(name, contains)`` per lower tier, fastest first.
          group: the KV-cache group.

        Returns:
          One `TieredBlock` per block of the prefix.

        Example:
          >>> pool = BlockPool(8)
          >>> _ = pool.cache_blocks(pool.allocate(1), [b"a"])
          >>> host = {b"b"}.__contains__
          >>> [t.tier for t in pool.find_longest_tiered_hit([b"a", b"b", b"c"], [("host", host)])]
          ['device', 'host']
        """
        found: list[TieredBlock] = []
        cache = self._maps[group] if group < len(self._maps) else {}
        for block_hash in block_hashes:
            block = cache.get(block_hash)
            if block is not None:
                found.append(TieredBlock("device", block))  # type: ignore[arg-type]
                continue
            for name, contains in lower_tiers:
                if contains(block_hash):
                    found.append(TieredBlock(name, None))
                    break
            else:
                break
        return found

    def evict(self, block_ids: Sequence[int] | np.ndarray) -> int:
        """Drops the cached hashes of the given blocks (in use or free); blocks stay where they
        are. Blocks without a hash and the null block are skipped.

        Args:
          block_ids: blocks whose cached data must no longer be hit (e.g. a connector
            reported their KV invalid).

        Returns:
          How many hashes were dropped.

        Raises:
          InvalidBlockIdError: an id out of range (nothing is evicted).

        Example:
          >>> pool = BlockPool(4)
          >>> blocks = pool.allocate(1); _ = pool.cache_blocks(blocks, [b"a"])
          >>> pool.evict(blocks), pool.get_cached_block(b"a")
          (1, None)
        """
        ids = [self._check_id(block) for block in block_ids]
        count = 0
        for block in ids:
            if self._hashedv[block]:
                self._drop_hash(block)
                count += 1
        return count

    def _drop_hash(self, block: int) -> None:
        block_hash = self._hash[block]
        group = self._groupv[block]
        cache = self._maps[group]
        key = (group, block_hash)
        if cache.get(block_hash) == block:
            others = self._dups.get(key) if self._dups else None
            if others:
                cache[block_hash] = others.pop(0)
                if not others:
                    del self._dups[key]
            else:
                del cache[block_hash]
        else:
            others = self._dups[key]
            others.remove(block)
            if not others:
                del self._dups[key]
        self._hash[block] = None
        self._hashedv[block] = False
        self._num_cached -= 1
        self._epoch += 1
        if self._events is not None:  # One event per block, in eviction order (as vLLM).
            self._events.append(BlockRemoved((block_hash,), group))

    def reset_prefix_cache(self) -> bool:
        """Drops every cached hash, e.g. after a weight update. Only possible when no block is
        in use.

        Returns:
          True when reset; False (and nothing changes) while blocks are in use.

        Example:
          >>> pool = BlockPool(4)
          >>> blocks = pool.allocate(1); _ = pool.cache_blocks(blocks, [b"a"])
          >>> pool.reset_prefix_cache()
          False
          >>> pool.free(blocks); pool.reset_prefix_cache(), pool.num_cached_blocks
          (True, 0)
        """
        if len(self._queue) != self._num_blocks - 1:
            return False
        self._maps = [{} for _ in self._maps]
        self._dups = {}
        self._hash[:] = None
        self._hashed[:] = False
        self._num_cached = 0
        self._epoch += 1
        if self._events is not None:
            self._events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVCacheEvent]:
        """Returns the queued events, oldest first, and empties the queue ([] when events are
        off).

        Example:
          >>> pool = BlockPool(4, enable_events=True)
          >>> _ = pool.cache_blocks(pool.allocate(1), [b"a"])
          >>> [type(event).__name__ for event in pool.take_events()], pool.take_events()
          (['BlockStored'], [])
        """
        if self._events is None:
            return []
        events = self._events
        self._events = []
        return events

    # ------------------------------------------------------------------ inspection

    def ref_count(self, block_id: int) -> int:
        """The block's reference count (0 = free). The null block reports 1.

        Raises:
          InvalidBlockIdError: an id out of range.

        Example:
          >>> pool = BlockPool(4); _ = pool.allocate(1)
          >>> pool.ref_count(1), pool.ref_count(2), pool.ref_count(0)
          (1, 0, 1)
        """
        return self._refv[self._check_id(block_id)]

    def is_free(self, block_id: int) -> bool:
        """Whether the block is in the free queue.

        Raises:
          InvalidBlockIdError: an id out of range.

        Example:
          >>> pool = BlockPool(4); _ = pool.allocate(1)
          >>> pool.is_free(1), pool.is_free(2)
          (False, True)
        """
        return self._refv[self._check_id(block_id)] == 0

    def block_hash(self, block_id: int) -> BlockHash | None:
        """The hash the block caches, or None.

        Raises:
          InvalidBlockIdError: an id out of range.

        Example:
          >>> pool = BlockPool(4); _ = pool.cache_blocks(pool.allocate(1), [b"h"])
          >>> pool.block_hash(1), pool.block_hash(2)
          (b'h', None)
        """
        return self._hash[self._check_id(block_id)]

    def block_group(self, block_id: int) -> int | None:
        """The group of the hash the block caches, or None when it caches none.

        Raises:
          InvalidBlockIdError: an id out of range.

        Example:
          >>> pool = BlockPool(4); _ = pool.cache_blocks(pool.allocate(1), [b"h"], group=2)
          >>> pool.block_group(1), pool.block_group(2)
          (2, None)
        """
        block_id = self._check_id(block_id)
        return self._groupv[block_id] if self._hashedv[block_id] else None

    def free_block_ids(self) -> list[BlockId]:
        """The free blocks in eviction order (next allocated first). O(num_blocks).

        Example:
          >>> pool = BlockPool(5); pool.free(pool.allocate(2)[::-1])
          >>> pool.free_block_ids()
          [2, 1, 3, 4]
        """
        return self._queue.to_list()  # type: ignore[return-value]

    def check_invariants(self) -> None:
        """Verifies every pool invariant. O(num_blocks); for tests and debugging.

        Checked: the null block is pinned, never free or cached; every other block is either
        free (ref count 0, queued exactly once) or in use (ref count > 0, not queued); the
        free-queue length equals the free count; every cached hash maps to a block that
        carries it (with its group), and every block carrying a hash is reachable from the
        map exactly once.

        Raises:
          AssertionError: naming the violated invariant.

        Example:
          >>> pool = BlockPool(4); pool.free(pool.allocate(3)); pool.check_invariants()
        """
        ref = self._ref
        if ref[0] != 1 or self._hashed[0] or self._hash[0] is not None:
            raise AssertionError("the null block must stay pinned (ref 1) and uncached")
        if (ref < 0).any():
            negative = np.flatnonzero(ref < 0).tolist()
            raise AssertionError(f"negative ref counts at blocks {negative}")
        self._queue.check()
        free = np.flatnonzero(ref == 0)
        queued = np.sort(np.asarray(self._queue.to_list(), dtype=np.int64))
        if not np.array_equal(free, queued):
            raise AssertionError(
                f"free blocks {free.tolist()} and free-queue entries {queued.tolist()} differ"
            )
        if len(self._queue) != free.size:
            raise AssertionError("free-queue length differs from the number of free blocks")
        carriers = [b for b, h in enumerate(self._hash.tolist()) if h is not None]
        if not np.array_equal(np.flatnonzero(self._hashed), np.asarray(carriers, dtype=np.int64)):
            raise AssertionError("the cached-flag array and the per-block hashes disagree")
        if len(carriers) != self._num_cached:
            raise AssertionError(
                f"{len(carriers)} blocks carry hashes, counter says {self._num_cached}"
            )
        reached: list[int] = []
        for group, cache in enumerate(self._maps):
            for block_hash, block in cache.items():
                if self._hash[block] != block_hash or self._group[block] != group:
                    raise AssertionError(
                        f"hash {block_hash!r} (group {group}) maps to block {block}, which carries "
                        f"{self._hash[block]!r} (group {self._group[block]})"
                    )
                reached.append(block)
        for (group, block_hash), blocks in self._dups.items():
            if not blocks or block_hash not in self._maps[group]:
                raise AssertionError(f"orphan duplicate entry for {block_hash!r}")
            for block in blocks:
                if self._hash[block] != block_hash or self._group[block] != group:
                    raise AssertionError(
                        f"duplicate entry block {block} does not carry {block_hash!r}"
                    )
                reached.append(block)
        if sorted(reached) != carriers:
            raise AssertionError("cached blocks and hash-map entries do not match one to one")
