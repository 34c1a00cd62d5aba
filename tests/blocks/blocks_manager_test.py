"""KVCacheManager: behaviours modelled on vLLM's tests/v1/core/test_prefix_caching.py."""

import numpy as np
from absl.testing import absltest, parameterized

from jaxkv.blocks import (
    AllBlocksCleared,
    BlockError,
    BlockRemoved,
    BlockStored,
    CacheHit,
    KVCacheManager,
    UnknownRequestError,
    hash_request_tokens,
)
from jaxkv.blocks._hashing import MultiModalInput, hash_block_tokens

BS = 16
COMMON = [i for i in range(3) for _ in range(BS)]  # Three full blocks.


def _alloc(manager, rid, hit=True, **kwargs):
    """Looks up the prefix and allocates the whole request, as a scheduler admits it."""
    found = manager.get_computed_blocks(rid) if hit else None
    computed = found.num_computed_tokens if found else 0
    return found, manager.allocate_slots(rid, manager.num_tokens(rid) - computed, found, **kwargs)


class PrefillTest(parameterized.TestCase):

    @parameterized.parameters("sha256", "xxh3_128")
    def test_prefill_partial_hits_and_eviction_order(self, hash_fn):
        manager = KVCacheManager(11, BS, max_model_len=8192, hash_fn=hash_fn)
        pool = manager.pool
        manager.add_request("0", COMMON + [3] * 7)
        hit, alloc = _alloc(manager, "0")
        self.assertEqual(hit.num_computed_tokens, 0)
        self.assertEqual(alloc.new_block_ids, ((1, 2, 3, 4),))
        parent = None
        for block in (1, 2, 3):
            parent = hash_block_tokens(parent, COMMON[(block - 1) * BS : block * BS],
                                       hash_fn=hash_fn)
            self.assertEqual(pool.block_hash(block), parent)
            self.assertEqual(pool.ref_count(block), 1)
        self.assertIsNone(pool.block_hash(4))

        # Hit on the common prefix while its blocks are still in use.
        manager.add_request("1", COMMON + [3] * 5)
        hit, alloc = _alloc(manager, "1")
        self.assertEqual(hit.block_ids, ((1, 2, 3),))
        self.assertEqual(hit.num_computed_tokens, 48)
        self.assertEqual(alloc.new_block_ids, ((5,),))
        self.assertEqual([pool.ref_count(b) for b in (1, 2, 3)], [2, 2, 2])
        self.assertEqual(manager.num_free_blocks, 5)

        manager.free("0")
        manager.free("1")
        self.assertEqual(manager.num_free_blocks, 10)
        # Uncached partial blocks first (reused at once), untouched blocks, then the cached
        # prefix tail first.
        self.assertEqual(pool.free_block_ids(), [5, 4, 6, 7, 8, 9, 10, 3, 2, 1])

        # Hit on the prefix while its blocks are free (they leave the free queue).
        manager.add_request("2", COMMON + [3] * 6)
        hit, alloc = _alloc(manager, "2")
        self.assertEqual(hit.block_ids, ((1, 2, 3),))
        self.assertEqual(alloc.new_block_ids, ((5,),))
        self.assertEqual(manager.num_free_blocks, 6)
        manager.free("2")

        # A miss evicts in exactly the free-queue order.
        manager.add_request("3", [99] * (BS * 10))
        hit, alloc = _alloc(manager, "3")
        self.assertEqual(hit.num_computed_tokens, 0)
        self.assertEqual(alloc.new_block_ids, ((5, 4, 6, 7, 8, 9, 10, 3, 2, 1),))
        self.assertEqual(manager.num_free_blocks, 0)
        pool.check_invariants()

    def test_full_prompt_hit_recomputes_last_block(self):
        manager = KVCacheManager(10, BS)
        manager.add_request("a", COMMON)
        _alloc(manager, "a")
        manager.add_request("b", COMMON)
        hit, alloc = _alloc(manager, "b")
        self.assertEqual(hit.num_computed_tokens, 32)  # 48 - 1 tokens allowed -> 2 blocks.
        self.assertEqual(alloc.new_block_ids, ((4,),))
        self.assertEqual(manager.get_block_ids("b"), ((1, 2, 4),))

    def test_computed_blocks_not_evicted(self):
        manager = KVCacheManager(3, BS)
        manager.add_request("0", list(range(BS)))
        self.assertEqual(_alloc(manager, "0")[1].new_block_ids, ((1,),))
        manager.add_request("1", list(range(BS, 2 * BS)))
        self.assertEqual(_alloc(manager, "1")[1].new_block_ids, ((2,),))
        manager.free("0")
        manager.free("1")
        manager.add_request("2", list(range(2 * BS)))
        hit, alloc = _alloc(manager, "2")
        self.assertEqual(hit.block_ids, ((1,),))
        self.assertEqual(alloc.new_block_ids, ((2,),))  # Evicts block 2, never the hit.
        self.assertEqual(manager.pool.get_cached_block(manager.get_block_hashes("2")[0]), 1)

    def test_evict_order_after_two_requests(self):
        manager = KVCacheManager(11, BS)
        manager.add_request("0", list(range(5 * BS + 7)))
        self.assertLen(_alloc(manager, "0")[1].new_block_ids[0], 6)
        manager.add_request("1", list(range(5 * BS + 7, 8 * BS + 7)))
        self.assertLen(_alloc(manager, "1")[1].new_block_ids[0], 3)
        self.assertEqual(manager.num_free_blocks, 1)
        manager.free("0")
        manager.free("1")
        self.assertEqual(manager.pool.free_block_ids(), [6, 10, 5, 4, 3, 2, 1, 9, 8, 7])
        manager.add_request("2", list(range(2 * BS + 3)))
        hit, alloc = _alloc(manager, "2")
        self.assertEqual(hit.block_ids, ((1, 2),))
        self.assertEqual(alloc.new_block_ids, ((6,),))

    def test_identical_prompts_in_flight_both_cached(self):
        manager = KVCacheManager(10, BS)
        manager.add_request("a", COMMON + [7])
        manager.add_request("b", COMMON + [7])
        _, first = _alloc(manager, "a", hit=False)
        _, second = _alloc(manager, "b", hit=False)
        self.assertEqual(first.new_block_ids, ((1, 2, 3, 4),))
        self.assertEqual(second.new_block_ids, ((5, 6, 7, 8),))
        manager.pool.check_invariants()
        manager.add_request("c", COMMON + [7])
        self.assertEqual(manager.get_computed_blocks("c").block_ids, ((1, 2, 3),))


class DecodeTest(parameterized.TestCase):

    def test_decode_appends_and_caches_full_blocks(self):
        manager = KVCacheManager(11, BS, max_model_len=8192)
        manager.add_request("0", COMMON + [3] * 7)
        _alloc(manager, "0")
        manager.append_tokens("0", [8] * 4)
        alloc = manager.allocate_slots("0", 4)
        self.assertEqual(alloc.new_block_ids, ((),))
        blocks = manager.get_block_ids("0")[0]
        self.assertIsNone(manager.pool.block_hash(blocks[-1]))
        manager.append_tokens("0", [7] * 19)  # Fills block 4 and 10 tokens of a new one.
        alloc = manager.allocate_slots("0", 19)
        self.assertLen(alloc.new_block_ids[0], 1)
        blocks = manager.get_block_ids("0")[0]
        expected = hash_request_tokens(COMMON + [3] * 7 + [8] * 4 + [7] * 5, BS)[3]
        self.assertEqual(manager.pool.block_hash(blocks[-2]), expected)
        self.assertIsNone(manager.pool.block_hash(blocks[-1]))
        self.assertEqual(manager.num_computed_tokens("0"), 78)

    def test_one_token_at_a_time(self):
        manager = KVCacheManager(8, 4)
        manager.add_request("r", [1, 2, 3])
        _alloc(manager, "r")
        for token in range(10, 22):
            manager.append_tokens("r", [token])
            manager.allocate_slots("r", 1)
        self.assertEqual(manager.get_block_ids("r"), ((1, 2, 3, 4),))
        self.assertEqual(manager.pool.num_cached_blocks, 3)
        tokens = [1, 2, 3] + list(range(10, 22))
        self.assertEqual(manager.get_block_hashes("r"), tuple(hash_request_tokens(tokens, 4)))

    def test_lookahead_slots(self):
        manager = KVCacheManager(8, 4, max_model_len=10)
        manager.add_request("r", [1, 2, 3])
        alloc = manager.allocate_slots("r", 3, num_lookahead_tokens=4)
        self.assertEqual(alloc.new_block_ids, ((1, 2),))
        self.assertEqual(manager.num_computed_tokens("r"), 3)
        manager.append_tokens("r", [4, 5, 6, 7])
        alloc = manager.allocate_slots("r", 4, num_lookahead_tokens=20)  # Capped at 10.
        self.assertEqual(alloc.new_block_ids, ((3,),))

    def test_out_of_blocks_changes_nothing(self):
        manager = KVCacheManager(4, 4)
        manager.add_request("a", list(range(8)))
        _alloc(manager, "a")
        manager.add_request("b", list(range(8)) + [5, 5, 5, 5, 5])
        hit = manager.get_computed_blocks("b")
        self.assertEqual(hit.block_ids, ((1, 2),))
        self.assertIsNone(manager.allocate_slots("b", 5, hit))
        self.assertEqual(manager.get_block_ids("b"), ((),))
        self.assertEqual([manager.pool.ref_count(b) for b in (1, 2)], [1, 1])
        self.assertEqual(manager.num_free_blocks, 1)
        manager.pool.check_invariants()


class ExtraKeysManagerTest(parameterized.TestCase):

    def test_cache_salting(self):
        manager = KVCacheManager(20, BS)
        tokens = list(range(3 * BS + 1))
        manager.add_request("a", tokens, cache_salt="salt1")
        _alloc(manager, "a")
        for rid, salt, expected_hit in (("b", "salt1", 48), ("c", "salt2", 0), ("d", None, 0)):
            manager.add_request(rid, tokens, cache_salt=salt)
            self.assertEqual(manager.get_computed_blocks(rid).num_computed_tokens, expected_hit)
        salted = manager.get_block_hashes("a")
        plain = manager.get_block_hashes("d")
        self.assertTrue(all(s != p for s, p in zip(salted, plain)))

    def test_lora_isolation(self):
        manager = KVCacheManager(20, BS)
        tokens = list(range(2 * BS + 1))
        manager.add_request("a", tokens, lora_id=1)
        _alloc(manager, "a")
        manager.add_request("b", tokens, lora_id=1)
        manager.add_request("c", tokens, lora_id=2)
        manager.add_request("d", tokens)
        self.assertEqual(manager.get_computed_blocks("b").num_computed_tokens, 32)
        self.assertEqual(manager.get_computed_blocks("c").num_computed_tokens, 0)
        self.assertEqual(manager.get_computed_blocks("d").num_computed_tokens, 0)

    def test_multimodal_prefix_caching(self):
        manager = KVCacheManager(20, BS)
        tokens = [1] * 3 + [-1] * 7 + [2] * 22 + [-1] * 8 + [3] * 4  # 44 tokens.
        mm = [MultiModalInput("img-a", 3, 7), MultiModalInput("img-b", 32, 8)]
        manager.add_request("a", tokens, mm_inputs=mm)
        hashes = manager.get_block_hashes("a")
        self.assertEqual(hashes, tuple(hash_request_tokens(tokens, BS, mm_inputs=mm)))
        _alloc(manager, "a")
        # Same placeholders, other image in the first block: nothing hits.
        manager.add_request("b", tokens, mm_inputs=[("img-x", 3, 7), ("img-b", 32, 8)])
        self.assertEqual(manager.get_computed_blocks("b").num_computed_tokens, 0)
        # Other second image (block 2): the first two blocks hit.
        manager.add_request("c", tokens, mm_inputs=[("img-a", 3, 7), ("img-y", 32, 8)])
        self.assertEqual(manager.get_computed_blocks("c").num_computed_tokens, 32)
        # Same image at another offset inside the block: a different key.
        shifted = [1] * 4 + [-1] * 7 + [2] * 33
        manager.add_request("d", shifted, mm_inputs=[("img-a", 4, 7)])
        self.assertEqual(manager.get_computed_blocks("d").num_computed_tokens, 0)


class HybridTest(parameterized.TestCase):
    """One full-attention group and two sliding-window groups (vLLM's hybrid tests)."""

    def _manager(self, num_blocks=21):
        return KVCacheManager(num_blocks, BS, sliding_windows=(None, 2 * BS, 2 * BS))

    def test_prefill_hybrid(self):
        manager = self._manager()
        manager.add_request("0", COMMON + [3] * 7)
        _, alloc = _alloc(manager, "0")
        self.assertEqual(alloc.new_block_ids, ((1, 2, 3, 4), (5, 6, 7, 8), (9, 10, 11, 12)))
        pool = manager.pool
        for group, blocks in enumerate(((1, 2, 3), (5, 6, 7), (9, 10, 11))):
            self.assertEqual([pool.block_group(b) for b in blocks], [group] * 3)
            self.assertEqual([pool.block_hash(b) for b in blocks],
                             list(manager.get_block_hashes("0")))
        manager.add_request("1", COMMON + [3] * 5)
        hit, alloc = _alloc(manager, "1")
        self.assertEqual(hit.block_ids, ((1, 2, 3), (0, 6, 7), (0, 10, 11)))
        self.assertEqual(alloc.new_block_ids, ((13,), (14,), (15,)))
        self.assertEqual([pool.ref_count(b) for b in (1, 2, 3, 6, 7, 10, 11)], [2] * 7)
        self.assertEqual(pool.ref_count(5), 1)  # Outside the window: not shared.
        manager.free("0")
        manager.free("1")
        pool.check_invariants()

    @parameterized.named_parameters(
        ("outside_window", [(5, 1), (9, 2)], 3),
        ("first_full_block", [(1, 0)], 0),
        ("last_block_everywhere", [(3, 0), (7, 1), (11, 2)], 2),
        ("last_full_block", [(3, 0)], 2),
        ("last_window_block", [(7, 1)], 2),
        ("middle_window_block", [(6, 1)], 1),
    )
    def test_partial_hit(self, evict, expected_blocks):
        manager = self._manager()
        manager.add_request("0", COMMON + [3] * 7)
        _alloc(manager, "0")
        manager.free("0")
        manager.pool.evict([block for block, _ in evict])
        manager.add_request("1", COMMON + [3] * 5)
        hit = manager.get_computed_blocks("1")
        self.assertEqual(hit.num_computed_tokens, expected_blocks * BS)
        self.assertTrue(all(len(g) == expected_blocks for g in hit.block_ids))

    def test_sliding_window_releases_blocks(self):
        manager = KVCacheManager(40, 4, sliding_windows=(None, 8))
        manager.add_request("r", list(range(30)))
        _alloc(manager, "r")
        full, window = manager.get_block_ids("r")
        self.assertLen(full, 8)
        self.assertLen(window, 8)
        manager.append_tokens("r", [1])
        manager.allocate_slots("r", 1)
        full, window = manager.get_block_ids("r")
        # 30 computed tokens, window 8: tokens < 23 are not needed -> blocks 0..4 released.
        self.assertEqual(window[:5], (0, 0, 0, 0, 0))
        self.assertNotIn(0, window[5:])
        self.assertEqual(manager.num_free_blocks, 39 - 16 + 5)
        manager.free("r")
        self.assertEqual(manager.num_free_blocks, 39)
        manager.pool.check_invariants()

    def test_sliding_window_long_prompt_skips_blocks_after_hit(self):
        manager = KVCacheManager(64, 4, sliding_windows=(None, 8))
        tokens = list(range(40))
        manager.add_request("a", tokens)
        _alloc(manager, "a")
        manager.free("a")
        manager.add_request("b", tokens + [7, 7, 7])
        hit, alloc = _alloc(manager, "b")
        self.assertEqual(hit.num_computed_tokens, 40)
        self.assertEqual(hit.block_ids[1][:8], (0,) * 8)
        self.assertEqual(manager.get_block_ids("b")[1][:8], (0,) * 8)
        self.assertLen(alloc.new_block_ids[1], 1)


class DisaggregationTest(parameterized.TestCase):

    def test_decode_engine_reads_only_new_blocks(self):
        prompt = list(range(40))
        decode = KVCacheManager(20, BS)
        decode.add_request("warm", prompt[:BS * 2] + [5])
        _alloc(decode, "warm")
        decode.add_request("r", prompt)
        hit = decode.get_computed_blocks("r", max_hit_tokens=len(prompt))
        self.assertEqual(hit.num_computed_tokens, 32)
        alloc = decode.allocate_slots("r", len(prompt) - 32, hit, delay_caching=True)
        self.assertEqual(alloc.new_block_ids, ((4,),))  # Read only the prompt's tail block.
        self.assertFalse(alloc.reads_nothing)
        self.assertEqual(alloc.num_computed_tokens, 32)
        decode.cache_blocks("r")  # KV arrived.
        self.assertEqual(decode.num_computed_tokens("r"), 40)

    def test_full_hit_reads_nothing(self):
        prompt = list(range(48))
        decode = KVCacheManager(20, BS)
        decode.add_request("warm", prompt + [1])
        _alloc(decode, "warm")
        decode.add_request("r", prompt)
        hit = decode.get_computed_blocks("r", max_hit_tokens=len(prompt))
        alloc = decode.allocate_slots("r", 0, hit, delay_caching=True)
        self.assertTrue(alloc.reads_nothing)
        self.assertEqual(decode.get_block_ids("r"), ((1, 2, 3),))

    def test_delayed_caching(self):
        manager = KVCacheManager(10, BS)
        manager.add_request("a", COMMON + [1])
        _alloc(manager, "a", delay_caching=True)
        manager.add_request("b", COMMON + [1])
        self.assertEqual(manager.get_computed_blocks("b").num_computed_tokens, 0)
        manager.cache_blocks("a", 32)
        self.assertEqual(manager.get_computed_blocks("b").num_computed_tokens, 32)
        with self.assertRaises(BlockError):
            manager.cache_blocks("a", 100)


class EventsAndMetricsTest(parameterized.TestCase):

    def test_kv_cache_events(self):
        manager = KVCacheManager(4, BS, enable_events=True)
        tokens = list(range(2 * BS + 3))
        manager.add_request("0", tokens, lora_id=5)
        _alloc(manager, "0")
        (stored,) = manager.take_events()
        hashes = manager.get_block_hashes("0")
        self.assertEqual(stored, BlockStored(hashes, None, tuple(tokens[: 2 * BS]), BS,
                                             ((5,), (5,)), 5, 0))
        manager.append_tokens("0", [9] * 13)
        manager.allocate_slots("0", 13)
        (stored,) = manager.take_events()
        self.assertEqual(stored.parent_block_hash, hashes[1])
        self.assertEqual(stored.token_ids, tuple(tokens[2 * BS :] + [9] * 13))
        hashes = manager.get_block_hashes("0")
        manager.free("0")
        manager.add_request("1", [100] * (3 * BS))
        _alloc(manager, "1")
        events = manager.take_events()
        # One BlockRemoved per evicted block, tail first (the request freed its blocks in
        # reverse), then the new request's BlockStored.
        self.assertEqual(events[:3], [BlockRemoved((h,), 0) for h in reversed(hashes)])
        self.assertIsInstance(events[3], BlockStored)
        self.assertLen(events, 4)
        manager.free("1")
        self.assertTrue(manager.reset_prefix_cache())
        self.assertEqual(manager.take_events(), [AllBlocksCleared()])

    def test_metrics_window(self):
        manager = KVCacheManager(30, 4, metrics_window=2)
        manager.add_request("a", list(range(9)))
        _alloc(manager, "a")
        self.assertEqual(manager.hit_rate, 0.0)
        manager.add_request("b", list(range(9)))
        _alloc(manager, "b")
        self.assertAlmostEqual(manager.hit_rate, 8 / 18)
        manager.add_request("c", list(range(9)))
        _alloc(manager, "c")
        self.assertAlmostEqual(manager.hit_rate, 16 / 18)  # "a" left the window.
        self.assertEqual(manager.metrics.requests, 2)
        for rid in "abc":
            manager.free(rid)
        self.assertTrue(manager.reset_prefix_cache())
        self.assertEqual(manager.hit_rate, 0.0)

    def test_reset_refused_while_in_use(self):
        manager = KVCacheManager(8, 4)
        manager.add_request("a", list(range(9)))
        _alloc(manager, "a")
        self.assertFalse(manager.reset_prefix_cache())
        manager.free("a")
        self.assertTrue(manager.reset_prefix_cache())
        manager.add_request("b", list(range(9)))
        self.assertEqual(manager.get_computed_blocks("b").num_computed_tokens, 0)

    def test_caching_disabled(self):
        manager = KVCacheManager(10, BS, enable_caching=False)
        for rid in "ab":
            manager.add_request(rid, COMMON + [1])
            hit, alloc = _alloc(manager, rid)
            self.assertEqual(hit.num_computed_tokens, 0)
            self.assertLen(alloc.new_block_ids[0], 4)
        self.assertEqual(manager.pool.num_cached_blocks, 0)
        self.assertEqual(manager.get_block_hashes("a"), ())
        manager.free("a")
        self.assertEqual(manager.pool.free_block_ids()[-4:], [4, 3, 2, 1])

    def test_common_prefix_blocks(self):
        manager = KVCacheManager(20, 4)
        for rid in "ab":
            manager.add_request(rid, list(range(8)) + [ord(rid)] * 5)
            _alloc(manager, rid)
        self.assertEqual(manager.num_common_prefix_blocks("a", 2), (2,))


class ManagerErrorsTest(parameterized.TestCase):

    def test_errors(self):
        manager = KVCacheManager(8, 4, max_model_len=12)
        with self.assertRaises(UnknownRequestError):
            manager.free("nope")
        with self.assertRaises(UnknownRequestError):
            manager.allocate_slots("nope", 1)
        with self.assertRaisesRegex(BlockError, "at least one"):
            manager.add_request("e", [])
        with self.assertRaisesRegex(BlockError, "max_model_len"):
            manager.add_request("long", list(range(13)))
        manager.add_request("a", list(range(5)))
        with self.assertRaises(UnknownRequestError):
            manager.add_request("a", [1])
        with self.assertRaisesRegex(BlockError, "append tokens first"):
            manager.allocate_slots("a", 6)
        with self.assertRaises(BlockError):
            manager.allocate_slots("a", -1)
        manager.allocate_slots("a", 5)
        with self.assertRaisesRegex(BlockError, "max_model_len"):
            manager.append_tokens("a", list(range(8)))
        with self.assertRaises(TypeError):
            manager.append_tokens("a", ["x"])
        self.assertEqual(manager.num_tokens("a"), 5)
        with self.assertRaisesRegex(BlockError, "already has blocks"):
            manager.get_computed_blocks("a")
        manager.add_request("b", list(range(9)))
        hit_b = manager.get_computed_blocks("b")
        manager.add_request("c", list(range(9)))
        with self.assertRaisesRegex(BlockError, "passed for"):
            manager.allocate_slots("c", 1, hit_b)
        manager.free("a")
        with self.assertRaises(UnknownRequestError):
            manager.free("a")
        manager.pool.check_invariants()
        with self.assertRaises(ValueError):
            KVCacheManager(8, 0)
        with self.assertRaises(ValueError):
            KVCacheManager(8, 4, sliding_windows=(None, 0))
        with self.assertRaises(ValueError):
            KVCacheManager(8, 4, sliding_windows=())

    def test_stale_hit_detected(self):
        manager = KVCacheManager(4, 4)
        manager.add_request("a", list(range(9)))
        _alloc(manager, "a")
        manager.free("a")
        manager.add_request("b", list(range(9)))
        hit = manager.get_computed_blocks("b")
        self.assertEqual(hit.block_ids, ((1, 2),))
        manager.add_request("c", [50] * 12)
        _alloc(manager, "c", hit=False)  # Evicts every cached block.
        manager.free("c")
        with self.assertRaisesRegex(BlockError, "stale cache hit"):
            manager.allocate_slots("b", 1, hit)
        manager.pool.check_invariants()

    def test_hand_built_hit_is_validated(self):
        manager = KVCacheManager(8, 4)
        manager.add_request("a", list(range(9)))
        _alloc(manager, "a")
        manager.add_request("b", list(range(9)))
        epoch = manager.pool.cache_epoch
        with self.assertRaisesRegex(BlockError, "stale cache hit"):
            manager.allocate_slots("b", 1, CacheHit("b", ((2, 1),), 8, epoch))
        with self.assertRaisesRegex(BlockError, "null block"):
            manager.allocate_slots("b", 1, CacheHit("b", ((1, 0),), 8, epoch))
        with self.assertRaisesRegex(BlockError, "disagree"):
            manager.allocate_slots("b", 1, CacheHit("b", ((1, 2),), 4, epoch))
        alloc = manager.allocate_slots("b", 1, CacheHit("b", ((1, 2),), 8, epoch))
        self.assertEqual(manager.get_block_ids("b"), ((1, 2, 4),))
        self.assertEqual(alloc.new_block_ids, ((4,),))
        self.assertEqual(manager.pool.ref_count(1), 2)
        manager.pool.check_invariants()

    def test_numpy_prompt(self):
        manager = KVCacheManager(20, 4)
        prompt = np.arange(30, dtype=np.int32)
        manager.add_request("a", prompt)
        prompt[:] = 0  # The manager keeps its own copy.
        _alloc(manager, "a")
        manager.add_request("b", list(range(30)))
        self.assertEqual(manager.get_computed_blocks("b").num_computed_tokens, 28)



class AppendSlotsTest(parameterized.TestCase):
    """`append_slots` (one decode step for many requests) equals the per-request calls."""

    def _pair(self, num_blocks=64, block_size=4, **kwargs):
        managers = [KVCacheManager(num_blocks, block_size, **kwargs) for _ in range(2)]
        for manager in managers:
            for index in range(3):
                manager.add_request(f"r{index}", list(range(10 * index, 10 * index + 5 + index)),
                                    cache_salt="s" if index == 1 else None)
                manager.allocate_slots(f"r{index}", manager.num_tokens(f"r{index}"))
        return managers

    @parameterized.parameters(
        dict(events=False), dict(events=True), dict(hash_fn="sha256_cbor"),
        dict(hash_fn="xxh3_128"), dict(block_size=1), dict(caching=False))
    def test_matches_per_request_calls(self, events=False, hash_fn="sha256", block_size=4,
                                       caching=True):
        batched, single = self._pair(num_blocks=128, block_size=block_size,
                                     enable_events=events, hash_fn=hash_fn,
                                     enable_caching=caching)
        ids = ["r0", "r1", "r2"]
        for step in range(13):
            tokens = [100 * step + i for i in range(3)]
            new = batched.append_slots(ids, tokens)
            expected = []
            for request_id, token in zip(ids, tokens):
                single.append_tokens(request_id, [token])
                allocation = single.allocate_slots(request_id, 1)
                expected.append(allocation.new_block_ids[0][0]
                                if allocation.new_block_ids[0] else 0)
            self.assertEqual(new, expected)
            for request_id in ids:
                self.assertEqual(batched.get_block_ids(request_id),
                                 single.get_block_ids(request_id))
                self.assertEqual(batched.get_block_hashes(request_id),
                                 single.get_block_hashes(request_id))
                self.assertEqual(batched.num_computed_tokens(request_id),
                                 single.num_computed_tokens(request_id))
            self.assertEqual(batched.pool.num_cached_blocks, single.pool.num_cached_blocks)
            self.assertEqual(batched.take_events(), single.take_events())
            batched.pool.check_invariants()
        # The cache holds the decoded blocks: a new request with the same tokens hits them.
        for manager in (batched, single):
            tokens = list(range(5)) + [100 * s for s in range(13)]
            manager.add_request("probe", tokens)
            hit = (18 - 1) // block_size * block_size if caching else 0
            self.assertEqual(manager.get_computed_blocks("probe").num_computed_tokens, hit)
        # Mixing with the per-request calls keeps hashes right.
        batched.append_tokens("r0", [7, 7, 7])
        single.append_tokens("r0", [7, 7, 7])
        self.assertEqual(batched.get_block_hashes("r0"), single.get_block_hashes("r0"))

    def test_pool_exhausted_changes_nothing(self):
        manager = KVCacheManager(4, 4)
        manager.add_request("a", [1, 2, 3, 4])
        manager.add_request("b", [5, 6, 7, 8])
        manager.allocate_slots("a", 4)
        manager.allocate_slots("b", 4)
        manager.add_request("c", [1])
        manager.allocate_slots("c", 1)  # The last free block.
        self.assertIsNone(manager.append_slots(["a", "b"], [9, 9]))
        self.assertEqual(manager.num_tokens("a"), 4)
        self.assertEqual(manager.get_block_ids("a"), ((1,),))
        self.assertEqual(manager.append_slots(["c"], [2]), [0])

    def test_errors_change_nothing(self):
        manager = KVCacheManager(16, 4, max_model_len=6)
        manager.add_request("a", [1, 2, 3])
        manager.allocate_slots("a", 3)
        manager.add_request("b", [1, 2, 3, 4, 5])  # Not allocated: not decoding.
        manager.add_request("full", [1, 2, 3, 4, 5, 6])
        manager.allocate_slots("full", 6)
        cases = [
            (["a", "b"], [1, 2], BlockError, "not decoding"),
            (["a", "a"], [1, 2], BlockError, "twice"),
            (["a", "full"], [1, 2], BlockError, "max_model_len"),
            (["a", "nope"], [1, 2], UnknownRequestError, "nope"),
            (["a"], [1, 2], BlockError, "tokens"),
            (["a"], [1.5], TypeError, ""),
        ]
        for ids, tokens, error, message in cases:
            with self.assertRaisesRegex(error, message):
                manager.append_slots(ids, tokens)
            self.assertEqual(manager.num_tokens("a"), 3)
            self.assertEqual(manager.num_computed_tokens("a"), 3)
        hybrid = KVCacheManager(16, 4, sliding_windows=(None, 8))
        with self.assertRaisesRegex(BlockError, "full-attention"):
            hybrid.append_slots([], [])
        self.assertEqual(manager.append_slots([], []), [])
        self.assertEqual(manager.append_slots(["a"], np.array([4])), [0])
        (block,) = manager.append_slots(["a"], [5])
        self.assertEqual(manager.get_block_ids("a"), ((1, block),))


if __name__ == "__main__":
    absltest.main()
