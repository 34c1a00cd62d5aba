"""BlockPool and FreeBlockQueue: allocation, eviction order, prefix cache, events, errors."""

import numpy as np
from absl.testing import absltest, parameterized

from jaxkv.blocks import AllBlocksCleared, BlockError, BlockRemoved, BlockStored, OutOfBlocksError
from jaxkv.blocks._errors import DoubleFreeError, InvalidBlockIdError
from jaxkv.blocks._free_queue import FreeBlockQueue
from jaxkv.blocks._pool import BlockPool

# Lists of up to 8 ids take the pool's scalar path, longer lists and arrays the numpy path.
_PATHS = (("scalar", list), ("numpy", np.array))


def _h(i):
    return f"hash-{i}".encode()


class FreeBlockQueueTest(parameterized.TestCase):

    def test_order_and_removal(self):
        queue = FreeBlockQueue(10, range(1, 10))
        self.assertEqual(queue.popleft(), 1)
        queue.remove(5)
        queue.remove(2)
        self.assertEqual(queue.popleft_n(3).tolist(), [3, 4, 6])
        queue.append(5)
        queue.prepend_n(np.array([2, 1]))
        queue.prepend(3)
        self.assertEqual(queue.to_list(), [3, 2, 1, 7, 8, 9, 5])
        self.assertLen(queue, 7)
        self.assertIn(5, queue)
        self.assertNotIn(4, queue)
        queue.check()

    def test_errors(self):
        queue = FreeBlockQueue(3, [1])
        with self.assertRaises(InvalidBlockIdError):
            queue.remove(2)
        with self.assertRaises(OutOfBlocksError):
            queue.popleft_n(2)
        queue.popleft()
        with self.assertRaises(OutOfBlocksError):
            queue.popleft()
        with self.assertRaises(InvalidBlockIdError):
            FreeBlockQueue(3, [1, 1])
        with self.assertRaises(InvalidBlockIdError):
            FreeBlockQueue(3, [3])

    @parameterized.named_parameters(
        ("list", list), ("tuple", tuple),
        ("range", lambda ids: range(ids[0], ids[0] + 1) if ids else range(0)),
        ("int32_array", lambda ids: np.asarray(ids, np.int32)),
        ("uint64_array", lambda ids: np.asarray(ids, np.uint64)))
    def test_bulk_operations_accept_any_int_sequence(self, make):
        queue = FreeBlockQueue(10, [1, 2, 3])
        queue.append_n(make([7]))
        queue.prepend_n(make([8]))
        self.assertEqual(queue.to_list(), [8, 1, 2, 3, 7])
        queue.remove_n(make([2]))
        self.assertEqual(queue.to_list(), [8, 1, 3, 7])
        queue.append_n(make([]))
        queue.check()

    def test_lists_of_several_ids(self):
        queue = FreeBlockQueue(10, [1])
        queue.append_n([4, 3])
        queue.prepend_n([6, 5])
        self.assertEqual(queue.to_list(), [6, 5, 1, 4, 3])
        queue.remove_n([5, 3])
        self.assertEqual(queue.to_list(), [6, 1, 4])
        queue.check()

    def test_bulk_operations_reject_bad_ids(self):
        queue = FreeBlockQueue(4, [1])
        for bad in ([1.5], ["a"], [4], [-1], [[1]], [None]):
            for method in (queue.append_n, queue.prepend_n, queue.remove_n):
                with self.assertRaises(InvalidBlockIdError, msg=f"{method.__name__}({bad})"):
                    method(bad)
        with self.assertRaises(InvalidBlockIdError):
            queue.remove_n([2])  # Not queued.
        self.assertEqual(queue.to_list(), [1])
        queue.check()

    def test_front_stack_keeps_queue_order(self):
        """Single-block prepends live on the front stack; every operation sees one queue."""
        queue = FreeBlockQueue(12, range(1, 6))
        queue.prepend(9)
        queue.prepend(8)
        self.assertEqual(queue.to_list(), [8, 9, 1, 2, 3, 4, 5])
        self.assertIn(9, queue)
        self.assertLen(queue, 7)
        queue.remove(9)  # From the stack.
        self.assertNotIn(9, queue)
        self.assertEqual(queue.popleft(), 8)
        queue.prepend(10)
        queue.prepend(11)
        queue.prepend_n([6])  # Bulk: the stack goes into the array first, order kept.
        self.assertEqual(queue.to_list(), [6, 11, 10, 1, 2, 3, 4, 5])
        queue.prepend(7)
        self.assertEqual(queue.popleft_n(3).tolist(), [7, 6, 11])
        queue.check()
        with self.assertRaises(InvalidBlockIdError):
            queue.remove(7)

    def test_many_stale_entries_and_compaction(self):
        rng = np.random.default_rng(0)
        n = 2000
        queue = FreeBlockQueue(n, range(n))
        model = list(range(n))
        for step in range(3000):
            op = rng.integers(4)
            if op == 0 and model:
                block = model[rng.integers(len(model))]
                queue.remove(block)
                model.remove(block)
            elif op == 1 and model:
                count = int(rng.integers(1, 40))
                count = min(count, len(model))
                self.assertEqual(queue.popleft_n(count).tolist(), model[:count])
                del model[:count]
            else:
                free = sorted(set(range(n)) - set(model))
                if free:
                    picked = rng.choice(free, size=min(len(free), int(rng.integers(1, 30))),
                                        replace=False)
                    if op == 2:
                        queue.append_n(picked)
                        model.extend(picked.tolist())
                    else:
                        queue.prepend_n(picked)
                        model[:0] = picked.tolist()
            if step % 97 == 0:
                queue.check()
                self.assertEqual(queue.to_list(), model)
        queue.check()
        self.assertEqual(queue.to_list(), model)


class AllocateFreeTest(parameterized.TestCase):

    def test_null_block_and_initial_state(self):
        pool = BlockPool(5)
        self.assertEqual(pool.null_block, 0)
        self.assertEqual(pool.num_free_blocks, 4)
        self.assertEqual(pool.free_block_ids(), [1, 2, 3, 4])
        self.assertEqual(pool.usage, 0.0)
        self.assertEqual(pool.allocate(4), [1, 2, 3, 4])
        self.assertEqual(pool.usage, 1.0)
        pool.check_invariants()

    @parameterized.named_parameters(*_PATHS)
    def test_freed_uncached_first_then_cached_tail_first(self, as_ids):
        pool = BlockPool(12)
        blocks = pool.allocate(10)
        pool.cache_blocks(as_ids(blocks[:6]), [_h(i) for i in range(6)])
        pool.free(as_ids(blocks[:5][::-1]))  # Request A: 1..5, all cached.
        pool.free(as_ids(blocks[5:][::-1]))  # Request B: 6 cached, 7..10 not.
        self.assertEqual(pool.free_block_ids(), [10, 9, 8, 7, 11, 5, 4, 3, 2, 1, 6])
        # LRU + tail first: the next allocations evict in exactly this order.
        self.assertEqual(pool.allocate(6), [10, 9, 8, 7, 11, 5])
        self.assertIsNone(pool.get_cached_block(_h(4)))
        self.assertEqual(pool.get_cached_block(_h(3)), 4)
        pool.check_invariants()

    @parameterized.named_parameters(*_PATHS)
    def test_caching_disabled_appends_in_order(self, as_ids):
        pool = BlockPool(6, enable_caching=False)
        blocks = pool.allocate(3)
        pool.free(as_ids(blocks[::-1]))
        self.assertEqual(pool.free_block_ids(), [4, 5, 3, 2, 1])
        with self.assertRaises(BlockError):
            pool.cache_blocks([4], [b"x"])
        pool.check_invariants()

    def test_shared_block_freed_once_per_reference(self):
        pool = BlockPool(4)
        (block,) = pool.allocate(1)
        pool.cache_blocks([block], [b"a"])
        pool.touch([block])
        pool.free([block])
        self.assertFalse(pool.is_free(block))
        self.assertEqual(pool.ref_count(block), 1)
        pool.free([block])
        self.assertTrue(pool.is_free(block))
        pool.check_invariants()

    @parameterized.named_parameters(*_PATHS)
    def test_duplicate_ids_in_one_free(self, as_ids):
        pool = BlockPool(12)
        blocks = pool.allocate(10)
        pool.touch(as_ids([1, 1]))
        self.assertEqual(pool.ref_count(1), 3)
        pool.free(as_ids([1, 2, 1] + blocks[2:4]))
        self.assertEqual(pool.ref_count(1), 1)
        self.assertEqual(pool.free_block_ids()[:3], [2, 3, 4])
        with self.assertRaisesRegex(DoubleFreeError, "freed 2 times but holds 1"):
            pool.free(as_ids([1, 1] + blocks[4:9]))
        self.assertEqual(pool.ref_count(1), 1)
        pool.check_invariants()

    def test_null_block_is_skipped(self):
        pool = BlockPool(4)
        blocks = pool.allocate(2)
        pool.free([0, blocks[0], 0])
        pool.touch([0])
        self.assertEqual(pool.ref_count(0), 1)
        pool.free(np.array([0] * 12 + [blocks[1]]))
        self.assertEqual(pool.num_free_blocks, 3)
        pool.check_invariants()

    def test_allocate_zero_and_bad_counts(self):
        pool = BlockPool(4)
        self.assertEqual(pool.allocate(0), [])
        self.assertEqual(pool.allocate(np.int64(1)), [1])
        with self.assertRaises(ValueError):
            pool.allocate(-1)
        with self.assertRaises(TypeError):
            pool.allocate(1.0)
        with self.assertRaises(TypeError):
            pool.allocate(True)
        with self.assertRaises(ValueError):
            BlockPool(1)
        with self.assertRaises(TypeError):
            BlockPool(3.0)


class ErrorsKeepInvariantsTest(parameterized.TestCase):
    """Bad input raises a clear error and leaves the pool exactly as it was."""

    def _snapshot(self, pool):
        return (pool.free_block_ids(), [pool.ref_count(b) for b in range(pool.num_blocks)],
                [pool.block_hash(b) for b in range(pool.num_blocks)])

    def _pool(self):
        pool = BlockPool(12)
        blocks = pool.allocate(9)
        pool.cache_blocks(blocks[:3], [_h(i) for i in range(3)])
        pool.free(blocks[:4][::-1])
        return pool

    @parameterized.named_parameters(
        ("double_free", lambda p: p.free([5, 5, 5]), DoubleFreeError, "freed 3 times"),
        ("free_free_block", lambda p: p.free([5, 2]), DoubleFreeError, "already free"),
        ("free_free_block_numpy", lambda p: p.free(np.arange(5, 10).tolist() + [1, 10]),
         DoubleFreeError, "already free"),
        ("free_unknown", lambda p: p.free([5, 12]), InvalidBlockIdError, "out of range"),
        ("free_negative", lambda p: p.free(np.array([5, -1])), InvalidBlockIdError, "out of range"),
        ("free_non_int", lambda p: p.free([5, "6"]), InvalidBlockIdError, "ints"),
        ("free_float_array", lambda p: p.free(np.array([5.0])), InvalidBlockIdError, "integers"),
        ("free_2d", lambda p: p.free(np.ones((2, 2), np.int64)), InvalidBlockIdError, "one-dim"),
        ("over_allocate", lambda p: p.allocate(7), OutOfBlocksError, "cannot allocate 7 blocks: 6"),
        ("touch_uncached_free", lambda p: p.touch([5, 4]), InvalidBlockIdError, "no cached data"),
        ("touch_uncached_free_numpy", lambda p: p.touch(np.array([5, 4])), InvalidBlockIdError,
         "no cached data"),
        ("touch_unknown", lambda p: p.touch([99]), InvalidBlockIdError, "out of range"),
        ("cache_free_block", lambda p: p.cache_blocks([5, 1], [b"x", b"y"]),
         InvalidBlockIdError, "free"),
        ("cache_null_block", lambda p: p.cache_blocks([0], [b"x"]), InvalidBlockIdError, "null"),
        ("cache_twice_same_call", lambda p: p.cache_blocks([5, 5], [b"x", b"y"]),
         InvalidBlockIdError, "twice"),
        ("cache_length_mismatch", lambda p: p.cache_blocks([5], [b"x", b"y"]), BlockError,
         "2 hashes"),
        ("cache_bad_hash", lambda p: p.cache_blocks([5], ["x"]), TypeError, "bytes"),
        ("cache_numpy_twice", lambda p: p.cache_blocks(np.array([5, 6, 5]), [b"a", b"b", b"c"]),
         InvalidBlockIdError, "twice"),
        ("evict_unknown", lambda p: p.evict([3, 40]), InvalidBlockIdError, "out of range"),
        ("group_negative", lambda p: p.cache_blocks([5], [b"x"], group=-1), ValueError, "group"),
    )
    def test_error(self, operation, error, message):
        pool = self._pool()
        before = self._snapshot(pool)
        with self.assertRaisesRegex(error, message):
            operation(pool)
        self.assertEqual(self._snapshot(pool), before)
        pool.check_invariants()

    def test_recache_with_other_hash(self):
        pool = BlockPool(4)
        blocks = pool.allocate(2)
        pool.cache_blocks(blocks, [b"a", b"b"])
        self.assertEqual(pool.cache_blocks(blocks, [b"a", b"b"]), 0)  # Same hashes: no-op.
        with self.assertRaisesRegex(BlockError, "already caches"):
            pool.cache_blocks(blocks, [b"a", b"c"])
        with self.assertRaisesRegex(BlockError, "already caches"):
            pool.cache_blocks(blocks[:1], [b"a"], group=1)
        pool.check_invariants()


class PrefixCacheTest(parameterized.TestCase):

    @parameterized.named_parameters(*_PATHS)
    def test_longest_hit_and_touch(self, as_ids):
        pool = BlockPool(40)
        blocks = pool.allocate(30)
        hashes = [_h(i) for i in range(30)]
        pool.cache_blocks(as_ids(blocks), hashes)
        self.assertEqual(pool.find_longest_cache_hit(hashes + [b"x"]), blocks)
        self.assertEqual(pool.find_longest_cache_hit(hashes[:17] + [b"x"] + hashes[18:]),
                         blocks[:17])
        self.assertEqual(pool.find_longest_cache_hit([b"x"] + hashes), [])
        self.assertEqual(pool.find_longest_cache_hit(hashes, group=1), [])
        pool.free(as_ids(blocks[::-1]))
        self.assertEqual(pool.num_free_blocks, 39)
        hit = pool.find_longest_cache_hit(hashes[:12])
        pool.touch(as_ids(hit))
        self.assertEqual(pool.num_free_blocks, 27)
        # Blocks in use are never evicted, even when everything else is.
        pool.allocate(27)
        self.assertEqual(pool.find_longest_cache_hit(hashes), hit)
        pool.check_invariants()

    def test_groups_are_separate(self):
        pool = BlockPool(6)
        a = pool.allocate(2)
        pool.cache_blocks(a[:1], [b"h"], group=0)
        pool.cache_blocks(a[1:], [b"h"], group=1)
        self.assertEqual(pool.get_cached_block(b"h", 0), a[0])
        self.assertEqual(pool.get_cached_block(b"h", 1), a[1])
        self.assertEqual(pool.block_group(a[1]), 1)
        pool.check_invariants()

    def test_duplicate_hashes(self):
        pool = BlockPool(8)
        first = pool.allocate(2)
        second = pool.allocate(2)
        pool.cache_blocks(first, [b"a", b"b"])
        pool.cache_blocks(second, [b"a", b"b"])  # Computed concurrently by two requests.
        self.assertEqual(pool.find_longest_cache_hit([b"a", b"b"]), first)
        pool.free(first[::-1])
        pool.allocate(5)  # Evicts 5, 6, 7 (uncached) and then first's blocks 2, 1.
        self.assertEqual(pool.find_longest_cache_hit([b"a", b"b"]), second)
        pool.check_invariants()
        self.assertEqual(pool.evict(second), 2)
        self.assertEqual(pool.find_longest_cache_hit([b"a"]), [])
        pool.check_invariants()

    def test_duplicates_within_one_call(self):
        pool = BlockPool(30)
        blocks = pool.allocate(20)
        hashes = [_h(i % 7) for i in range(20)]
        pool.cache_blocks(blocks, hashes)
        self.assertEqual(pool.get_cached_block(_h(3)), blocks[3])
        pool.check_invariants()
        pool.free(blocks[::-1])
        pool.allocate(29)
        self.assertEqual(pool.num_cached_blocks, 0)
        pool.check_invariants()

    def test_reset(self):
        pool = BlockPool(6, enable_events=True)
        blocks = pool.allocate(2)
        pool.cache_blocks(blocks, [b"a", b"b"])
        self.assertFalse(pool.reset_prefix_cache())
        self.assertEqual(pool.get_cached_block(b"a"), blocks[0])
        pool.free(blocks)
        self.assertTrue(pool.reset_prefix_cache())
        self.assertIsNone(pool.get_cached_block(b"a"))
        self.assertEqual(pool.num_cached_blocks, 0)
        self.assertIsInstance(pool.take_events()[-1], AllBlocksCleared)
        pool.check_invariants()

    def test_cache_epoch(self):
        pool = BlockPool(4)
        blocks = pool.allocate(1)
        pool.cache_blocks(blocks, [b"a"])
        epoch = pool.cache_epoch
        pool.free(blocks)
        self.assertEqual(pool.cache_epoch, epoch)
        pool.allocate(3)  # Evicts block 1.
        self.assertGreater(pool.cache_epoch, epoch)


class FastFreePathTest(parameterized.TestCase):
    """free() of a few blocks takes a fast path that must undo itself exactly when it meets a
    block it does not handle, so the general path sees the original state."""

    def _pool(self):
        pool = BlockPool(12)
        a, b, c, d = pool.allocate(4)
        pool.touch([c])  # c is shared (ref 2)
        pool.cache_blocks([d], [b"d"])
        free = pool.allocate(1)[0]
        pool.free([free])
        return pool, a, b, c, d, free

    def test_undo_then_error(self):
        cases = [
            (lambda a, b, c, d, f: [a, b, a], DoubleFreeError),
            (lambda a, b, c, d, f: [a, b, f], DoubleFreeError),
            (lambda a, b, c, d, f: [a, b, 99], InvalidBlockIdError),
            (lambda a, b, c, d, f: [a, b, -1], InvalidBlockIdError),
            (lambda a, b, c, d, f: [a, b, 2.0], InvalidBlockIdError),
            (lambda a, b, c, d, f: [a, b, True], InvalidBlockIdError),
        ]
        for make, error in cases:
            pool, a, b, c, d, free = self._pool()
            before = [pool.ref_count(x) for x in range(12)]
            queue = pool.free_block_ids()
            with self.assertRaises(error):
                pool.free(make(a, b, c, d, free))
            self.assertEqual([pool.ref_count(x) for x in range(12)], before)
            self.assertEqual(pool.free_block_ids(), queue)
            pool.check_invariants()

    def test_mixed_lists_take_the_general_path(self):
        pool, a, b, c, d, free = self._pool()
        pool.free([a, c, d, 0, b])  # shared, cached and null blocks after fast-path ones
        self.assertEqual(pool.ref_count(c), 1)
        self.assertEqual(pool.free_block_ids()[:3], [a, b, free])  # uncached first, in order
        self.assertEqual(pool.free_block_ids()[-1], d)  # cached at the back
        pool.check_invariants()
        pool.free([c])
        self.assertEqual(pool.free_block_ids()[0], c)
        pool.check_invariants()


class EventsTest(parameterized.TestCase):

    def test_stored_removed_cleared(self):
        pool = BlockPool(4, enable_events=True)
        blocks = pool.allocate(2)
        pool.cache_blocks(blocks, [b"a", b"b"], parent_block_hash=b"p", token_ids=[1, 2, 3, 4],
                          block_size=2, extra_keys=[None, ("salt",)], lora_id=3)
        events = pool.take_events()
        self.assertEqual(events, [BlockStored((b"a", b"b"), b"p", (1, 2, 3, 4), 2,
                                              (None, ("salt",)), 3, 0)])
        self.assertEqual(pool.take_events(), [])
        pool.free(blocks[::-1])
        pool.allocate(3)
        # One event per evicted block, in eviction order (as vLLM).
        self.assertEqual(pool.take_events(), [BlockRemoved((b"b",), 0), BlockRemoved((b"a",), 0)])
        self.assertEqual(pool.evict([1, 2]), 0)
        self.assertEqual(pool.take_events(), [])

    def test_router_replay_matches_cache(self):
        """Replaying the events as a multiset of hashes gives exactly the hittable hashes."""
        rng = np.random.default_rng(1)
        pool = BlockPool(16, enable_events=True)
        held = []
        counts = {}
        for step in range(400):
            if held and rng.random() < 0.4:
                blocks = held.pop(int(rng.integers(len(held))))
                pool.free(blocks[::-1])
            else:
                count = int(rng.integers(1, 5))
                if count > pool.num_free_blocks:
                    continue
                blocks = pool.allocate(count)
                hashes = [_h(int(rng.integers(12))) for _ in blocks]
                unique = list(dict.fromkeys(hashes))
                pool.cache_blocks(blocks[: len(unique)], unique)
                held.append(blocks)
            if step == 200:
                for blocks in held:
                    pool.free(blocks[::-1])
                held = []
                pool.reset_prefix_cache()
            for event in pool.take_events():
                if isinstance(event, BlockStored):
                    for h in event.block_hashes:
                        counts[h] = counts.get(h, 0) + 1
                elif isinstance(event, BlockRemoved):
                    for h in event.block_hashes:
                        counts[h] -= 1
                else:
                    counts.clear()
            live = {h for h, c in counts.items() if c > 0}
            cached = {h for h in map(_h, range(12)) if pool.get_cached_block(h) is not None}
            self.assertEqual(live, cached)
        pool.check_invariants()

    def test_events_off(self):
        pool = BlockPool(4)
        pool.cache_blocks(pool.allocate(1), [b"a"])
        self.assertEqual(pool.take_events(), [])
        self.assertFalse(pool.enable_events)


if __name__ == "__main__":
    absltest.main()
