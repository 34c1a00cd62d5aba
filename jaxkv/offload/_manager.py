"""`OffloadManager`: a device cache, its host pool and an optional file tier, with every copy
ordered by (tier, slot), and the hooks that connect them to the block manager.

Two levels:
- slot level (TensorRT-LLM's KV-cache transfer manager): `offload`, `onboard` (with
  `num_tokens` for partial reuse), `write_file`, `read_file`, `wait`;
- hash level (a cache of evicted prefix blocks): `on_evict` / `flush_evictions` (an eviction
  hook for `KVCacheManager.set_eviction_hook`), `lower_tiers` for
  `KVCacheManager.get_computed_blocks_tiered`, and `load_hit` to bring a tiered hit back.

Device and host copies are JAX programs ordered by data flow: each consumes the latest cache or
pool and returns the next one, so pass the cache the previous call returned. File copies run on
worker threads; `SlotOrdering` makes each copy wait for earlier writes of what it reads and for
earlier reads and writes of what it writes, keyed by `SlotKey(tier, index)`.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jaxkv._cache import BufferMovedError, PagedKVCache
from jaxkv.blocks._hashing import BlockHash
from jaxkv.blocks._manager import TieredCacheHit
from jaxkv.blocks._pool import EvictedBlock
from jaxkv.offload._file import FileTier, Region, TierFuture
from jaxkv.offload._host import HostPool, _check_ids, _check_pair, run_offload, run_onboard
from jaxkv.offload._ordering import DoneFlag, JaxCompletion, SlotOrdering, wait_for
from jaxkv.offload._types import (
    HostPoolFullError,
    OffloadTimeoutError,
    SlotKey,
    Tier,
    UnknownSlotError,
)
from jaxkv.ops._ids import pad_block_ids

__all__ = ["OffloadManager", "OffloadStats"]


class OffloadStats:
    """Counters of an `OffloadManager` (blocks moved per direction and sync waits)."""

    def __init__(self) -> None:
        self.offloaded = 0
        self.onboarded = 0
        self.file_writes = 0
        self.file_reads = 0
        self.evictions_saved = 0
        self.host_evictions = 0
        self.waits = 0

    def __repr__(self) -> str:
        return "OffloadStats(" + ", ".join(f"{k}={v}" for k, v in vars(self).items()) + ")"


def _pad_pair(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    length = len(pad_block_ids(a))
    return pad_block_ids(a, length), pad_block_ids(b, length)


class OffloadManager:
    """Moves KV blocks between a device cache, a host pool and a file tier, in order.

    Not meant to be driven from several threads at once (the scheduler thread calls it); file
    I/O runs on the file tier's workers.

    Args:
      cache: the device cache (its spec and sharding; the manager keeps no reference).
      num_host_slots: slots in the host pool.
      file_tier: an optional `FileTier` for the same spec (and the cache's TP size).
      memory_kind: host pool memory, see `HostPool.allocate`.
      write_through: when saving evicted blocks (`flush_evictions`), also write them to the
        file tier (so they survive a restart).
      timeout_s: timeout of every wait.

    Raises:
      ValueError: a file tier for another spec or TP size, or bad sizes.

    Example:
      >>> spec = KVCacheSpec(1, 2, 4, 4, "float32", layout="KHTD")
      >>> data = np.arange(512, dtype=np.float32).reshape(8, 2, 2, 4, 4)
      >>> cache = PagedKVCache.from_arrays(spec, [data])
      >>> offloader = OffloadManager(cache, num_host_slots=4)
      >>> offloader.offload(cache, device_ids=[5, 6], host_slots=[0, 1])
      >>> cache = offloader.onboard(cache, host_slots=[0], device_ids=[2])   # async dispatch
      >>> bool((cache.arrays[0][2] == cache.arrays[0][5]).all())
      True
    """

    def __init__(
        self,
        cache: PagedKVCache,
        num_host_slots: int,
        *,
        file_tier: FileTier | None = None,
        memory_kind: str | None = "auto",
        write_through: bool = True,
        timeout_s: float = 60.0,
    ) -> None:
        if not isinstance(cache, PagedKVCache):
            raise TypeError(f"cache must be a PagedKVCache, got {type(cache).__name__}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if file_tier is not None and (file_tier.spec != cache.spec
                                      or file_tier.fields["tp_size"] != cache.tp_size):
            raise ValueError(
                f"the file tier stores blocks of {file_tier.spec} at TP "
                f"{file_tier.fields['tp_size']}; the cache is {cache.spec} at TP "
                f"{cache.tp_size}")
        self.spec = cache.spec
        self._pool = HostPool.allocate(cache, num_host_slots, memory_kind=memory_kind)
        self.file_tier = file_tier
        self.write_through = bool(write_through)
        self.timeout_s = float(timeout_s)
        self.stats = OffloadStats()
        self._order = SlotOrdering()
        # Built once: ordering keys of host slots (a batch of file I/O claims one per block).
        self._host_keys = [SlotKey(Tier.HOST, s) for s in range(self._pool.num_slots)]
        # Whether each slot holds a block: bytes for the per-call file paths (item stores, no
        # numpy), viewed as a bool array for the vectorised ones.
        self._valid_bytes = bytearray(self._pool.num_slots)
        self._valid = np.frombuffer(self._valid_bytes, dtype=bool)
        self._valid_lock = threading.Lock()
        self._regions, self._replicas, self._addresses = self._slot_layout()
        self._replica_count = max((len(c) for c in self._replicas), default=0)
        if file_tier is not None:
            file_tier.register_memory(self._buffers())
        # Hash level: which host slot holds which block hash, least recently used first.
        self._host_index: dict[BlockHash, int] = {}
        self._slot_hash: list[BlockHash | None] = [None] * self._pool.num_slots
        self._lru: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._free_slots = list(range(self._pool.num_slots - 1, -1, -1))
        self._pending_evictions: list[EvictedBlock] = []

    # ------------------------------------------------------------------ properties

    @property
    def pool(self) -> HostPool:
        """The current host pool (do not donate it: the manager keeps using it)."""
        return self._pool

    @property
    def num_host_slots(self) -> int:
        """Slots in the host pool."""
        return self._pool.num_slots

    def slot_valid(self, host_slot: int) -> bool:
        """Whether the slot holds a block (written by `offload` or a successful file read;
        pending copies count as done)."""
        with self._valid_lock:
            return bool(self._valid[host_slot])

    # ------------------------------------------------------------------ raw memory of slots

    def _settle_for_pointers(self) -> None:
        """Reading a pending buffer's address waits for it while holding the GIL, which the
        host callbacks of Pallas's interpret mode (forced "pallas" off TPU) need to finish it:
        wait without the GIL first there (elsewhere no wait: copies stay asynchronous)."""
        from jaxkv.ops._dispatch import current_implementation

        if current_implementation() == "pallas" and jax.default_backend() != "tpu":
            jax.block_until_ready(self._pool.arrays)

    def _slot_layout(self) -> tuple[list[tuple[int, int]], list[list[int]], list[int]]:
        """Per array and head range: the primary shard buffer and its replicas."""
        self._settle_for_pointers()
        primary: list[tuple[int, int]] = []  # (address, bytes per slot) in payload order
        replicas: list[list[int]] = []
        addresses: list[int] = []
        for array in self._pool.arrays:
            groups: dict[Any, list[Any]] = {}
            for shard in array.addressable_shards:
                key = tuple((s.start, s.stop) for s in shard.index)
                groups.setdefault(key, []).append(shard)
            for key in sorted(groups, key=lambda k: tuple((a or 0) for a, _ in k)):
                shards = groups[key]
                per_slot = int(shard_nbytes(shards[0])) // self._pool.num_slots
                pointers = [int(s.data.unsafe_buffer_pointer()) for s in shards]
                primary.append((pointers[0], per_slot))
                replicas.append(pointers[1:])
                addresses.extend(pointers)
        return primary, replicas, addresses

    def _buffers(self) -> list[Region]:
        out = []
        for (address, per_slot), copies in zip(self._regions, self._replicas):
            for pointer in [address, *copies]:
                out.append((pointer, per_slot * self._pool.num_slots))
        return out

    def _check_unmoved(self) -> None:
        self._settle_for_pointers()
        now = [int(s.data.unsafe_buffer_pointer()) for a in self._pool.arrays
               for s in a.addressable_shards]
        if sorted(now) != sorted(self._addresses):
            raise BufferMovedError("the host pool's buffers moved (an update was not in place); "
                                   "file I/O would target stale memory")

    def _slot_regions(self, slot: int) -> tuple[list[Region], list[list[Region]]]:
        regions = [(address + slot * n, n) for address, n in self._regions]
        count = self._replica_count
        if not count:
            return regions, []
        copies = []
        for r in range(count):
            copies.append([(c[r] + slot * n, n) if r < len(c) else (address + slot * n, 0)
                           for (address, n), c in zip(self._regions, self._replicas)])
        return regions, copies

    # ------------------------------------------------------------------ waiting

    def _wait_file_ops(self, dependencies, what: str) -> None:
        """Waits for the file copies among `dependencies` (JAX ones are ordered by data)."""
        file_ops = [d for d in dependencies if not isinstance(d, JaxCompletion)]
        if file_ops:
            self.stats.waits += 1
            wait_for(file_ops, time.monotonic() + self.timeout_s, what)

    def wait(self, timeout: float | None = None) -> None:
        """Sync point: waits until every copy issued so far is done (file I/O included).

        Raises:
          OffloadTimeoutError: something is still running after the timeout.
        """
        deadline = time.monotonic() + (self.timeout_s if timeout is None else timeout)
        wait_for(self._order.pending(), deadline, "OffloadManager.wait")
        self._pool.block_until_ready()

    # ------------------------------------------------------------------ slot level

    def offload(self, cache: PagedKVCache, device_ids: Any, host_slots: Any) -> None:
        """Copies device blocks into host slots (asynchronous: returns after dispatch).

        Waits (bounded) only for file reads into, or file writes from, the same host slots.
        The cache is read, not consumed: keep using it (JAX orders later writes after this
        read).

        Args:
          cache: the current device cache (after the compute that wrote the blocks).
          device_ids: device block ids ``[n]``.
          host_slots: destination host slots ``[n]`` (unique); negative ids skip a pair.

        Raises:
          IndexError: an id or slot out of range.
          ValueError: repeated slots, lists of different lengths, another cache's spec.
          OffloadTimeoutError: an earlier file copy of these slots did not finish in time.
        """
        _check_pair(cache, self._pool)
        device, slots = _check_ids(np.asarray(device_ids), np.asarray(host_slots), cache,
                                   self._pool, "host")
        keep = (device >= 0) & (slots >= 0)
        device, slots = device[keep], slots[keep]
        if not device.size:
            return
        op = JaxCompletion()
        deps = self._order.claim(
            reads=[SlotKey(Tier.DEVICE, int(d)) for d in device],
            writes=[self._host_keys[s] for s in slots.tolist()], op=op)
        try:
            self._wait_file_ops(deps, "offload")
            padded_device, padded_slots = _pad_pair(device, slots)
            self._pool, token = run_offload(cache, self._pool, padded_device, padded_slots)
        except BaseException:
            op.cancel()  # Never dispatched: later copies must not wait for it.
            raise
        op.attach(token)
        self._check_unmoved()
        with self._valid_lock:
            self._valid[slots] = True
        self.stats.offloaded += int(device.size)

    def onboard(self, cache: PagedKVCache, host_slots: Any, device_ids: Any,
                num_tokens: int | None = None) -> PagedKVCache:
        """Copies host slots into device blocks (asynchronous: returns after dispatch).

        Waits (bounded) for pending file reads into the same slots, then checks that each slot
        holds a block.

        Args:
          cache: the current device cache; consumed (use the returned one).
          host_slots: source host slots ``[n]``.
          device_ids: destination device block ids ``[n]`` (unique).
          num_tokens: None for whole blocks, else copy only tokens ``[0, num_tokens)`` of each
            block (docs/data-movement.md section 5).

        Returns:
          The updated cache.

        Raises:
          UnknownSlotError: a slot holds no block (never written, or its file read missed).
          IndexError, ValueError: bad ids, as `offload`.
          OffloadTimeoutError: a pending file read did not finish in time.
        """
        _check_pair(cache, self._pool)
        device, slots = _check_ids(np.asarray(device_ids), np.asarray(host_slots), cache,
                                   self._pool, "device")
        if num_tokens is not None and (isinstance(num_tokens, bool)
                                       or not isinstance(num_tokens, (int, np.integer))):
            raise TypeError(f"num_tokens must be an int or None, got {num_tokens!r}")
        keep = (device >= 0) & (slots >= 0)
        device, slots = device[keep], slots[keep]
        if not device.size:
            return cache
        op = JaxCompletion()
        deps = self._order.claim(
            reads=[self._host_keys[s] for s in slots.tolist()],
            writes=[SlotKey(Tier.DEVICE, int(d)) for d in device], op=op)
        try:
            self._wait_file_ops(deps, "onboard")
            with self._valid_lock:
                invalid = slots[~self._valid[slots]]
            if invalid.size:
                raise UnknownSlotError(f"host slot {int(invalid[0])} holds no block (never "
                                       "offloaded, or its file read missed)")
            padded_slots, padded_device = _pad_pair(slots, device)
            cache, token = run_onboard(self._pool, cache, padded_slots, padded_device,
                                       0 if num_tokens is None else int(num_tokens))
        except BaseException:
            op.cancel()  # Never dispatched: later copies must not wait for it.
            raise
        op.attach(token)
        self.stats.onboarded += int(device.size)
        return cache

    def write_file(self, host_slots: Any, block_hashes: Sequence[bytes]
                   ) -> concurrent.futures.Future:
        """Writes host slots to the file tier under their block hashes (asynchronous).

        The write starts after earlier copies into those slots; a later copy into a slot
        waits for it. A slot that turns out to hold no block (its file read missed) is not
        written (its result is False).

        Args:
          host_slots: source slots ``[n]``.
          block_hashes: the hash of each slot's block.

        Returns:
          A future of one bool per block (see `FileTier.write_async`).

        Raises:
          ValueError: no file tier, lengths differ, bad hashes.
          IndexError: a slot out of range.
          UnknownSlotError: a slot never written.
        """
        tier = self._require_file_tier()
        slots = self._check_slots(host_slots)
        hashes = [bytes(h) for h in block_hashes]
        if len(hashes) != len(slots):
            raise ValueError(f"{len(slots)} host slots for {len(hashes)} block hashes")
        with self._valid_lock:
            never = [s for s in slots if not self._valid[s] and not self._order.pending_for(
                [self._host_keys[s]])]
        if never:
            raise UnknownSlotError(f"host slot {never[0]} holds no block")
        result = TierFuture()
        deps = self._order.claim(
            reads=[self._host_keys[s] for s in slots],
            writes=[SlotKey(Tier.DISK, h) for h in hashes], op=result)
        inner = TierFuture()
        tier.write_async([(h, self._slot_regions(s)[0]) for h, s in zip(hashes, slots)],
                         after=deps, skip=lambda: [not self.slot_valid(s) for s in slots],
                         future=inner)
        result.help_with(inner.run_if_queued)
        _chain(inner, result, None)
        self.stats.file_writes += len(slots)
        return result

    def read_file(self, block_hashes: Sequence[bytes], host_slots: Any
                  ) -> concurrent.futures.Future:
        """Reads blocks from the file tier into host slots (asynchronous).

        A thread that waits for the future while the read is still queued runs it itself;
        `read_file_now` skips the queue altogether.

        Args:
          block_hashes: blocks to read.
          host_slots: destination slots ``[n]`` (unique).

        Returns:
          A future of one bool per block: True when loaded and verified; False for a miss
          (the slot then holds no block: `onboard` refuses it).

        Raises:
          ValueError: no file tier, lengths differ, repeated slots.
          IndexError: a slot out of range.
        """
        tier = self._require_file_tier()
        slots, hashes = self._check_read(block_hashes, host_slots)
        result = TierFuture()
        deps = self._order.claim(
            reads=[SlotKey(Tier.DISK, h) for h in hashes],
            writes=[self._host_keys[s] for s in slots], op=result)

        def mark(results: list[bool]) -> None:
            self._mark_valid(slots, results)

        # Everything is wired before the read is queued: a caller that waits at once then
        # finds it still queued and runs it itself, instead of racing the woken worker.
        inner = TierFuture()
        result.help_with(inner.run_if_queued)
        _chain(inner, result, mark, on_error=lambda: mark([False] * len(slots)))
        try:
            items, replicas = self._read_items(hashes, slots)
            tier.read_async(items, replicas=replicas, after=deps, future=inner)
        except BaseException as error:
            # Never queued (e.g. the tier is closed): complete the ordered future, so that
            # later copies of these slots do not wait for it (they hold no block).
            inner.set_exception(error)
            raise
        self.stats.file_reads += len(slots)
        return result

    def read_file_now(self, block_hashes: Sequence[bytes], host_slots: Any) -> list[bool]:
        """Reads blocks from the file tier into host slots on the calling thread, in order
        with the other copies (it first waits, bounded, for earlier copies of its slots).

        The synchronous `read_file`, for callers that need the blocks at once (`load_hit`):
        no worker thread is woken, which on a busy or small machine saves the hand-off and the
        woken thread's contention for the GIL (about 0.1 ms per call measured here).

        Returns:
          One bool per block, as `read_file`'s future.

        Raises:
          As `read_file`; OffloadTimeoutError: earlier copies of the slots did not finish
          in time; OSError: a failed read.

        Example:
          >>> manager.read_file_now([block_hash], [slot])   # doctest: +SKIP
          [True]
        """
        tier = self._require_file_tier()
        slots, hashes = self._check_read(block_hashes, host_slots)
        # Everything here runs on this thread: a flag, not a future, records the read in the
        # ordering (this path runs right after other big copies, with cold caches: the fewer
        # objects and code paths it touches, the faster it is).
        op = DoneFlag()
        deps = self._order.claim(
            reads=[SlotKey(Tier.DISK, h) for h in hashes],
            writes=[self._host_keys[s] for s in slots], op=op)
        try:
            items, replicas = self._read_items(hashes, slots)
            # Inline: the future comes back done (a zero timeout only reads its result).
            results = tier.read_async(items, replicas=replicas, after=deps,
                                      inline=True).result(0)
        except BaseException:
            self._mark_valid(slots, [False] * len(slots))
            raise
        finally:
            op.set()
        self._mark_valid(slots, results)
        self.stats.file_reads += len(slots)
        return results

    def _mark_valid(self, slots: list[int], results: list[bool]) -> None:
        valid = self._valid_bytes
        with self._valid_lock:
            for slot, ok in zip(slots, results):
                valid[slot] = ok

    def _check_read(self, block_hashes: Sequence[bytes], host_slots: Any
                    ) -> tuple[list[int], list[bytes]]:
        slots = self._check_slots(host_slots, unique=True)
        hashes = [bytes(h) for h in block_hashes]
        if len(hashes) != len(slots):
            raise ValueError(f"{len(slots)} host slots for {len(hashes)} block hashes")
        return slots, hashes

    def _read_items(self, hashes: list[bytes], slots: list[int]
                    ) -> tuple[list[tuple[bytes, list[Region]]], list[list[list[Region]]] | None]:
        """`FileTier.read_async`'s items and replicas for reading `hashes` into `slots` (the
        regions come from the pool's own layout)."""
        items, replicas = [], []
        for block_hash, slot in zip(hashes, slots):
            regions, copies = self._slot_regions(slot)
            items.append((block_hash, regions))
            replicas.append(copies)
        return items, replicas if self._replica_count else None

    def _require_file_tier(self) -> FileTier:
        if self.file_tier is None:
            raise ValueError("this OffloadManager has no file tier")
        return self.file_tier

    def _check_slots(self, host_slots: Any, unique: bool = False) -> list[int]:
        slots = np.asarray(host_slots)
        # dtype.kind, not np.issubdtype: this runs per file I/O call, often with cold caches.
        if slots.ndim != 1 or (slots.size and slots.dtype.kind not in "iu"):
            raise ValueError(f"host_slots must be a 1-D integer sequence, got {host_slots!r}")
        values = slots.tolist()  # Python ints.
        num_slots = self._pool.num_slots
        if values and (min(values) < 0 or max(values) >= num_slots):
            bad = next(v for v in values if not 0 <= v < num_slots)
            raise IndexError(f"host slot {bad} is out of range for a pool of "
                             f"{num_slots} slots")
        if unique and len(set(values)) != len(values):
            raise ValueError("repeated host slot")
        return values

    # ------------------------------------------------------------------ hash level

    def host_slot_of(self, block_hash: BlockHash) -> int | None:
        """The host slot holding a block hash (hash level), or None."""
        return self._host_index.get(block_hash)

    def lower_tiers(self) -> list[tuple[str, Callable[[BlockHash], bool]]]:
        """``(name, contains)`` of the host tier and (if any) the file tier, for
        `KVCacheManager.get_computed_blocks_tiered`."""
        tiers: list[tuple[str, Callable[[BlockHash], bool]]] = [
            ("host", self._host_index.__contains__)]
        if self.file_tier is not None:
            tiers.append(("disk", self.file_tier.contains))
        return tiers

    def _claim_slots(self, count: int, protect: set[int]) -> list[int]:
        """Free host slots, evicting least recently used hash entries (documented policy)."""
        if count > self._pool.num_slots - len(protect):
            raise HostPoolFullError(
                f"need {count} host slots but the pool has {self._pool.num_slots} "
                f"({len(protect)} in use by this batch)")
        out: list[int] = []
        while len(out) < count and self._free_slots:
            out.append(self._free_slots.pop())
        for slot in list(self._lru):
            if len(out) == count:
                break
            if slot in protect:
                continue
            self._forget_slot(slot)
            self._free_slots.remove(slot)
            out.append(slot)
            self.stats.host_evictions += 1
        return out

    def _forget_slot(self, slot: int) -> None:
        old = self._slot_hash[slot]
        if old is not None:
            del self._host_index[old]
            self._slot_hash[slot] = None
            self._lru.pop(slot, None)
            self._free_slots.append(slot)

    def _remember(self, slot: int, block_hash: BlockHash) -> None:
        self._forget_slot(slot)
        if block_hash in self._host_index:
            self._forget_slot(self._host_index[block_hash])
        if slot in self._free_slots:
            self._free_slots.remove(slot)
        self._slot_hash[slot] = block_hash
        self._host_index[block_hash] = slot
        self._lru[slot] = None

    def on_evict(self, blocks: list[EvictedBlock]) -> None:
        """Eviction hook for `KVCacheManager.set_eviction_hook` / `BlockPool`: queues the
        evicted blocks; `flush_evictions` saves them. Group 0 only (one full-attention group).
        """
        self._pending_evictions.extend(b for b in blocks if b.group == 0)

    @property
    def num_pending_evictions(self) -> int:
        """Evicted blocks queued by `on_evict`, not yet saved."""
        return len(self._pending_evictions)

    def flush_evictions(self, cache: PagedKVCache) -> int:
        """Saves the queued evicted blocks: device -> host (and host -> file when
        `write_through`). Call it after allocating and before the compute step that writes the
        newly allocated blocks (their old bytes are read first: JAX orders the compute's write
        after this read).

        When the host pool is full, its least recently used entries are dropped (they are in
        the file tier already with `write_through`); with more blocks than host slots, the
        blocks go through the pool in chunks (without a file tier only the last chunk stays).

        Returns:
          The number of blocks saved.
        """
        pending, self._pending_evictions = self._pending_evictions, []
        todo: dict[BlockHash, int] = {}
        for block in pending:
            if block.block_hash in self._host_index:
                self._lru.move_to_end(self._host_index[block.block_hash])
                continue
            todo[block.block_hash] = int(block.block_id)
        if not todo:
            return 0
        todo_items = list(todo.items())
        size = self._pool.num_slots
        for start in range(0, len(todo_items), size):
            # More blocks than slots: chunks reuse slots; ordering makes each chunk's offload
            # wait for the previous chunk's file writes from the same slots.
            chunk = todo_items[start : start + size]
            slots = self._claim_slots(len(chunk), set())
            self.offload(cache, [d for _, d in chunk], slots)
            for (block_hash, _), slot in zip(chunk, slots):
                self._remember(slot, block_hash)
            if self.file_tier is not None and self.write_through:
                new = [(h, s) for (h, _), s in zip(chunk, slots)
                       if not self.file_tier.contains(h)]
                if new:
                    self.write_file([s for _, s in new], [h for h, _ in new])
        self.stats.evictions_saved += len(todo_items)
        return len(todo_items)

    def load_hit(self, cache: PagedKVCache, hit: TieredCacheHit,
                 device_ids: Sequence[int]) -> tuple[PagedKVCache, int]:
        """Brings the blocks of a tiered hit after its device prefix into device blocks.

        Host blocks are onboarded directly; disk blocks are read into host slots first
        (waiting for the reads, bounded); device blocks that follow a lower-tier block are
        copied. Stops at the first block that cannot be loaded (e.g. a corrupted file: a miss).

        Args:
          cache: the current device cache; consumed.
          hit: from `KVCacheManager.get_computed_blocks_tiered`.
          device_ids: destination blocks for ``hit.blocks[hit.num_device_blocks:]``, e.g. the
            first entries of `Allocation.new_block_ids[0]`.

        Returns:
          ``(cache, num_loaded)``: the updated cache and how many blocks (from the first lower
          block on) now hold their KV; the rest must be computed.

        Raises:
          ValueError: fewer device ids than blocks to load.
          OffloadTimeoutError: a file read did not finish in time.
        """
        todo = hit.blocks[hit.num_device_blocks:]
        hashes = hit.block_hashes[hit.num_device_blocks:]
        if len(device_ids) < len(todo):
            raise ValueError(f"{len(todo)} blocks to load but {len(device_ids)} device ids")
        targets = [int(d) for d in device_ids[: len(todo)]]
        protect = {self._host_index[h] for h in hashes if h in self._host_index}
        capacity = self._pool.num_slots - len(protect)
        pairs: list[tuple[int, int]] = []       # (host slot, device block) to onboard
        copies: list[tuple[int, int]] = []      # (device block, device block)
        count, index = 0, 0
        while index < len(todo):
            block_hash = hashes[index]
            slot = self._host_index.get(block_hash)
            if slot is not None:
                self._lru.move_to_end(slot)
                pairs.append((slot, targets[index]))
                index += 1
                count = index
                continue
            if todo[index].tier == "device":
                block_id = todo[index].block_id
                assert block_id is not None  # a device block always carries its id
                if int(block_id) != targets[index]:
                    copies.append((int(block_id), targets[index]))
                index += 1
                count = index
                continue
            if self.file_tier is None or capacity < 1:
                if self.file_tier is not None:
                    raise HostPoolFullError("every host slot holds a block of this hit; no slot "
                                            "left to read disk blocks into")
                break
            # A run of disk blocks, at most `capacity` at a time: read them into host slots
            # (waiting, bounded), then onboard; a later run may reuse the slots (ordered).
            run: list[int] = []
            while (index + len(run) < len(todo) and len(run) < capacity
                   and todo[index + len(run)].tier != "device"
                   and hashes[index + len(run)] not in self._host_index):
                run.append(index + len(run))
            fresh = self._claim_slots(len(run), protect)
            try:
                results = self.read_file_now([hashes[i] for i in run], fresh)
            except OffloadTimeoutError as error:
                raise OffloadTimeoutError(f"load_hit: file reads did not finish in time "
                                          f"({error})") from None
            for i, slot_read, ok in zip(run, fresh, results):
                if not ok:
                    break
                self._remember(slot_read, hashes[i])
                pairs.append((slot_read, targets[i]))
                count = i + 1
            else:
                index = run[-1] + 1
                cache = self._onboard_pairs(cache, pairs)
                pairs = []
                continue
            break
        cache = self._onboard_pairs(cache, pairs)
        copies = [(s, d) for s, d in copies if targets.index(d) < count]
        if copies:
            cache = cache.copy_blocks([s for s, _ in copies], [d for _, d in copies])
        return cache, count

    def _onboard_pairs(self, cache: PagedKVCache, pairs: list[tuple[int, int]]) -> PagedKVCache:
        if not pairs:
            return cache
        return self.onboard(cache, [s for s, _ in pairs], [d for _, d in pairs])

    def close(self) -> None:
        """Waits for pending copies (bounded) and closes the file tier."""
        try:
            self.wait()
        finally:
            if self.file_tier is not None:
                self.file_tier.close()


def shard_nbytes(shard: Any) -> int:
    return int(shard.data.nbytes)


def _chain(inner: concurrent.futures.Future, outer: concurrent.futures.Future,
           on_result: Callable[[Any], None] | None,
           on_error: Callable[[], None] | None = None) -> None:
    """Completes `outer` from `inner`, running `on_result` first (so that waiters of `outer`
    see its effects)."""

    def done(future: concurrent.futures.Future) -> None:
        error = future.exception()
        if error is not None:
            if on_error is not None:
                on_error()
            outer.set_exception(error)
            return
        value = future.result()
        if on_result is not None:
            on_result(value)
        outer.set_result(value)

    inner.add_done_callback(done)

