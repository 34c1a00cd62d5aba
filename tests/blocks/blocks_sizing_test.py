"""KV-cache sizing: block counts, hybrid grouping and padding, concurrency, errors."""

import math

from absl.testing import absltest, parameterized

from jaxkv import KVCacheSpec
from jaxkv.blocks import (
    AttentionLayers,
    InsufficientMemoryError,
    KVCacheManager,
    estimate_max_model_len,
    num_blocks_for_memory,
    plan_kv_cache,
)
from jaxkv.blocks._sizing import blocks_per_request

GIB = 1 << 30


def _spec(num_layers, heads=8, head_dim=128, block_size=16, dtype="bfloat16"):
    return KVCacheSpec(num_layers=num_layers, num_kv_heads=heads, head_dim=head_dim,
                       block_size=block_size, dtype=dtype)


class UniformTest(parameterized.TestCase):

    def test_llama_like(self):
        spec = _spec(32)  # page per layer: 2 * 8 * 16 * 128 * 2 = 64 KiB
        self.assertEqual(spec.page_nbytes_per_layer(), 65536)
        plan = plan_kv_cache(spec, 10 * GIB, max_model_len=8192)
        self.assertEqual(plan.num_blocks, 10 * GIB // 65536 // 32)
        self.assertLen(plan.groups, 1)
        self.assertEqual(plan.groups[0].layers, tuple(range(32)))
        self.assertEqual(plan.groups[0].num_padding_layers, 0)
        self.assertLen(plan.buffers, 32)
        self.assertEqual(plan.buffers[5].layers, (5,))
        self.assertEqual(plan.buffers[0].nbytes, 65536 * plan.num_blocks)
        self.assertEqual(plan.cache_nbytes, 32 * 65536 * plan.num_blocks)
        self.assertLessEqual(plan.cache_nbytes, 10 * GIB)
        self.assertEqual(plan.blocks_per_request, 512)
        self.assertAlmostEqual(plan.max_concurrency, (plan.num_blocks - 1) / 512)
        self.assertAlmostEqual(plan.concurrency(4096), (plan.num_blocks - 1) / 256)

    @parameterized.parameters(1, 2, 4, 8, 16)
    def test_tensor_parallel_pages(self, tp_size):
        spec = _spec(4, heads=8)
        plan = plan_kv_cache(spec, GIB, max_model_len=1024, tp_size=tp_size)
        heads = max(1, 8 // tp_size)
        self.assertEqual(plan.page_nbytes, 2 * heads * 16 * 128 * 2)
        self.assertEqual(plan.num_blocks, GIB // plan.page_nbytes // 4)

    def test_mla(self):
        spec = KVCacheSpec.for_mla(num_layers=61, latent_dim=576, block_size=64)
        plan = plan_kv_cache(spec, 4 * GIB, max_model_len=16384, tp_size=8)
        self.assertEqual(plan.page_nbytes, 64 * 576 * 2)  # Replicated: TP does not split it.
        self.assertEqual(plan.num_blocks, 4 * GIB // (64 * 576 * 2) // 61)

    def test_num_blocks_for_memory(self):
        self.assertEqual(num_blocks_for_memory(10_000, 100, 3), 33)
        self.assertEqual(num_blocks_for_memory(-5, 100, 3), 0)
        with self.assertRaises(ValueError):
            num_blocks_for_memory(100, 0, 1)

    def test_override(self):
        plan = plan_kv_cache(_spec(2), GIB, max_model_len=64, num_blocks_override=10)
        self.assertEqual(plan.num_blocks, 10)
        with self.assertRaisesRegex(InsufficientMemoryError, "num_blocks_override=4"):
            plan_kv_cache(_spec(2), GIB, max_model_len=64, num_blocks_override=4)
        with self.assertRaises(ValueError):
            plan_kv_cache(_spec(2), GIB, max_model_len=64, num_blocks_override=1)


class InsufficientMemoryTest(parameterized.TestCase):

    def test_no_memory(self):
        with self.assertRaisesRegex(InsufficientMemoryError, "no memory"):
            plan_kv_cache(_spec(2), 0, max_model_len=64)

    def test_one_request_does_not_fit(self):
        spec = _spec(1, heads=1, head_dim=8, dtype="float32")  # 1 KiB pages.
        # 64 tokens need 4 blocks, plus the null block: 5 KiB.
        plan = plan_kv_cache(spec, 5 * 1024, max_model_len=64)
        self.assertEqual(plan.num_usable_blocks, 4)
        with self.assertRaisesRegex(
            InsufficientMemoryError,
            r"max_model_len=65 tokens needs 5 blocks .* only 4 usable blocks .* longest "
            r"max_model_len that fits is 64",
        ):
            plan_kv_cache(spec, 5 * 1024 + 1023, max_model_len=65)
        with self.assertRaisesRegex(InsufficientMemoryError, "Give the cache more memory"):
            plan_kv_cache(spec, 1024, max_model_len=64)

    def test_estimate_max_model_len_matches_brute_force(self):
        full = _spec(2, heads=1, head_dim=8, dtype="float32")
        local = full.replace(num_layers=4)
        attention = [AttentionLayers(full, (0, 3)),
                     AttentionLayers(local, (1, 2, 4, 5), sliding_window=40)]
        for memory in (3000, 20_000, 60_000, 200_000):
            got = estimate_max_model_len(attention, memory, upper=2000)
            fits = [n for n in range(1, 2001)
                    if self._fits(attention, memory, n)]
            self.assertEqual(got, max(fits, default=0), memory)

    @staticmethod
    def _fits(attention, memory, length):
        try:
            plan_kv_cache(attention, memory, max_model_len=length)
            return True
        except InsufficientMemoryError:
            return False


class HybridTest(parameterized.TestCase):

    def test_gemma_like_five_to_one(self):
        # 10 full + 52 sliding-window layers: group size 10, SW split into 6 strided groups.
        spec = _spec(1, heads=4, head_dim=64)
        full_layers = tuple(range(5, 62, 6))[:10]
        sw_layers = tuple(sorted(set(range(62)) - set(full_layers)))
        plan = plan_kv_cache(
            [AttentionLayers(spec.replace(num_layers=10), full_layers),
             AttentionLayers(spec.replace(num_layers=52), sw_layers, sliding_window=1024)],
            8 * GIB, max_model_len=32768, max_num_batched_tokens=2048)
        self.assertLen(plan.groups, 7)
        self.assertEqual(plan.group_size, 10)
        # Types are ordered by their first layer (layer 0 is sliding-window here).
        self.assertEqual(plan.groups[6].layers, full_layers)
        self.assertIsNone(plan.groups[6].sliding_window)
        sw_groups = plan.groups[:6]
        self.assertEqual({g.sliding_window for g in sw_groups}, {1024})
        self.assertEqual([len(g.layers) for g in sw_groups], [9, 9, 9, 9, 8, 8])
        self.assertEqual(sw_groups[0].layers, sw_layers[0::6])
        self.assertEqual(sw_groups[5].layers, sw_layers[5::6])
        self.assertEqual(sum(g.num_padding_layers for g in plan.groups), 8)
        self.assertEqual(plan.num_blocks, 8 * GIB // plan.page_nbytes // 10)
        self.assertEqual(sorted(x for b in plan.buffers for x in b.layers), list(range(62)))
        full_blocks = math.ceil(32768 / 16)
        sw_blocks = math.ceil(min(1023 + 2048, 32768) / 16) + 1
        self.assertEqual(plan.blocks_per_request, full_blocks + 6 * sw_blocks)

    def test_near_balanced_uses_the_larger_count(self):
        # gpt-oss-like 12 sliding + 13 full: pad to (13, 13), not (12, 24).
        spec = _spec(1, heads=8, head_dim=64)
        full = tuple(range(0, 25, 2))
        sliding = tuple(range(1, 25, 2))
        plan = plan_kv_cache(
            [AttentionLayers(spec.replace(num_layers=13), full),
             AttentionLayers(spec.replace(num_layers=12), sliding, sliding_window=128)],
            GIB, max_model_len=4096)
        self.assertEqual(plan.group_size, 13)
        self.assertEqual([len(g.layers) for g in plan.groups], [13, 12])
        self.assertEqual([g.num_padding_layers for g in plan.groups], [0, 1])
        self.assertLen(plan.buffers, 13)
        self.assertEqual(plan.buffers[12].layers, (24,))

    def test_pipeline_stage_balance(self):
        spec = _spec(1)
        plan = plan_kv_cache(
            [AttentionLayers(spec.replace(num_layers=2), (0, 3)),
             AttentionLayers(spec.replace(num_layers=4), (1, 2, 4, 5), sliding_window=64)],
            GIB, max_model_len=1024)
        self.assertEqual([g.layers for g in plan.groups], [(0, 3), (1, 4), (2, 5)])

    def test_same_type_entries_merge(self):
        spec = _spec(1)
        plan = plan_kv_cache(
            [AttentionLayers(spec.replace(num_layers=2), (0, 2)),
             AttentionLayers(spec.replace(num_layers=2), (1, 3))],
            GIB, max_model_len=1024)
        self.assertLen(plan.groups, 1)
        self.assertEqual(plan.groups[0].layers, (0, 1, 2, 3))

    def test_manager_from_hybrid_plan(self):
        spec = _spec(1, heads=1, head_dim=8, block_size=4, dtype="float32")
        plan = plan_kv_cache(
            [AttentionLayers(spec.replace(num_layers=1), (0,)),
             AttentionLayers(spec.replace(num_layers=1), (1,), sliding_window=8)],
            1 << 20, max_model_len=64)
        manager = KVCacheManager.from_plan(plan)
        self.assertEqual(manager.sliding_windows, (None, 8))
        self.assertEqual(manager.num_free_blocks, plan.num_blocks - 1)
        manager.add_request("r", list(range(64)))
        self.assertIsNotNone(manager.allocate_slots("r", 64))

    def test_errors(self):
        spec = _spec(2)
        with self.assertRaisesRegex(ValueError, "cannot unify page sizes"):
            plan_kv_cache([AttentionLayers(spec, (0, 1)),  # 64 KiB pages vs 48 KiB
                           AttentionLayers(_spec(2, heads=6), (2, 3), sliding_window=64)],
                          GIB, max_model_len=64)
        with self.assertRaisesRegex(ValueError, "appears in two"):
            plan_kv_cache([AttentionLayers(spec, (0, 1)),
                           AttentionLayers(spec, (1, 2), sliding_window=64)],
                          GIB, max_model_len=64)
        with self.assertRaises(ValueError):
            AttentionLayers(spec, (0,))
        with self.assertRaises(ValueError):
            AttentionLayers(spec, (0, 0))
        with self.assertRaises(ValueError):
            AttentionLayers(spec, sliding_window=0)
        with self.assertRaises(TypeError):
            AttentionLayers("spec")
        with self.assertRaises(ValueError):
            plan_kv_cache([], GIB, max_model_len=64)
        with self.assertRaises(ValueError):
            plan_kv_cache(spec, GIB, max_model_len=0)


class PageUnificationTest(parameterized.TestCase):
    """Different page sizes (vLLM's unify_kv_cache_spec_page_size) and disable_hybrid."""

    def _full_and_sliding(self, sw_head_dim=32, sw_window=128):
        full = _spec(2, heads=8, head_dim=64)  # 32 KiB pages at block size 16
        sliding = _spec(4, heads=8, head_dim=sw_head_dim)
        return [AttentionLayers(full, (0, 3)),
                AttentionLayers(sliding, (1, 2, 4, 5), sliding_window=sw_window)]

    def test_smaller_page_gets_larger_block(self):
        plan = plan_kv_cache(self._full_and_sliding(), GIB, max_model_len=4096)
        self.assertEqual(plan.page_nbytes, 2 * 8 * 16 * 64 * 2)
        self.assertEqual([g.layers for g in plan.groups], [(0, 3), (1, 4), (2, 5)])
        self.assertEqual(plan.block_sizes, (16, 32, 32))
        self.assertEqual([g.sliding_window for g in plan.groups], [None, 128, 128])
        for group in plan.groups:  # Every group's page is the largest page.
            self.assertEqual(group.spec.page_nbytes_per_layer(), plan.page_nbytes)
        self.assertEqual(plan.groups[1].spec.head_dim, 32)
        self.assertEqual(plan.num_blocks, GIB // plan.page_nbytes // 2)
        self.assertEqual(plan.blocks_per_request,
                         math.ceil(4096 / 16) + 2 * (math.ceil(min(127 + 4096, 4096) / 32) + 1))
        with self.assertRaisesRegex(ValueError, "one block size"):
            KVCacheManager.from_plan(plan)

    def test_ratio_four_and_tensor_parallel(self):
        layers = self._full_and_sliding(sw_head_dim=16)
        plan = plan_kv_cache(layers, GIB, max_model_len=1024, tp_size=2)
        self.assertEqual(plan.block_sizes, (16, 64, 64))
        self.assertEqual(plan.page_nbytes, 2 * 4 * 16 * 64 * 2)

    def test_uniform_pages_unchanged(self):
        layers = self._full_and_sliding(sw_head_dim=64)
        plan = plan_kv_cache(layers, GIB, max_model_len=1024)
        self.assertEqual(plan.block_sizes, (16, 16, 16))

    def test_estimate_uses_unified_plan(self):
        layers = self._full_and_sliding()
        budget = 64 * 32768 * 2  # 64 pages per buffer, 2 buffers
        fits = estimate_max_model_len(layers, budget, upper=100_000)
        self.assertGreater(fits, 0)
        plan_kv_cache(layers, budget, max_model_len=fits)
        with self.assertRaises(InsufficientMemoryError):
            plan_kv_cache(layers, budget, max_model_len=fits + 1)

    def test_disable_hybrid_folds_sliding_windows(self):
        spec = _spec(1, heads=4, head_dim=64)
        layers = [AttentionLayers(spec.replace(num_layers=2), (0, 3)),
                  AttentionLayers(spec.replace(num_layers=4), (1, 2, 4, 5), sliding_window=256)]
        hybrid = plan_kv_cache(layers, GIB, max_model_len=8192)
        folded = plan_kv_cache(layers, GIB, max_model_len=8192, disable_hybrid=True)
        self.assertLen(hybrid.groups, 3)
        self.assertEqual([(g.layers, g.sliding_window) for g in folded.groups],
                         [((0, 1, 2, 3, 4, 5), None)])
        self.assertEqual(folded.group_size, 6)
        self.assertEqual(folded.num_blocks, GIB // folded.page_nbytes // 6)
        self.assertEqual(folded.blocks_per_request, math.ceil(8192 / 16))
        manager = KVCacheManager.from_plan(folded)
        self.assertEqual(manager.sliding_windows, (None,))
        # Only sliding windows: nothing to fold.
        only = plan_kv_cache([AttentionLayers(spec.replace(num_layers=2), sliding_window=64)],
                             GIB, max_model_len=1024, disable_hybrid=True)
        self.assertEqual(only.groups[0].sliding_window, 64)
        self.assertEqual(estimate_max_model_len(layers, GIB, upper=10**6, disable_hybrid=True),
                         min(10**6, (folded.num_blocks - 1) * 16))

    def test_disable_hybrid_needs_equal_pages(self):
        with self.assertRaisesRegex(ValueError, "disable_hybrid needs every layer"):
            plan_kv_cache(self._full_and_sliding(), GIB, max_model_len=1024, disable_hybrid=True)


class BlocksPerRequestTest(parameterized.TestCase):

    @parameterized.parameters(
        (16, 1000, None, None, 63),
        (16, 1024, None, None, 64),
        (16, 32768, 4096, 2048, 385),
        (16, 100, 4096, 2048, 8),  # Window longer than the model: capped by max_model_len.
        (4, 8, 8, None, 3),
    )
    def test_values(self, block_size, max_len, window, step, expected):
        self.assertEqual(blocks_per_request(block_size, max_len, window, step), expected)


if __name__ == "__main__":
    absltest.main()
