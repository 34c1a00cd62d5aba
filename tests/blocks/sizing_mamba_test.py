"""KV-cache sizing of hybrid attention + state-space (Mamba) models: vLLM 0.33's page alignment
(the attention block size raised until a page holds a Mamba state, the state padded to that
page), grouping with Mamba types, blocks per request, block counts, concurrency, the longest
length that fits, and the errors. The expected numbers are worked out by hand from the real
models' configs (tests/integrations/vllm_sizing_mamba_test.py checks the same rules against
vLLM's own functions)."""

import math

from absl.testing import absltest, parameterized

from jaxkv import KVCacheSpec
from jaxkv.blocks import (
    AttentionLayers,
    InsufficientMemoryError,
    estimate_max_model_len,
    plan_kv_cache,
)
from jaxkv.blocks._sizing import MambaLayers

GIB = 1 << 30
NEMOTRON_ATTENTION = (3, 10, 17, 24)


def _attn(num_layers, heads, head_dim, block_size=16, dtype="bfloat16", **kwargs):
    return KVCacheSpec(num_layers=num_layers, num_kv_heads=heads, head_dim=head_dim,
                       block_size=block_size, dtype=dtype, **kwargs)


def _mamba2_shapes(tp, heads=128, head_dim=64, state=128, groups=8, kernel=4):
    """vLLM's ``mamba2_state_shape`` (groups divisible by TP): conv (dim, kernel - 1), SSM."""
    conv_dim = heads * head_dim + 2 * groups * state
    return [(conv_dim // tp, kernel - 1), (heads // tp, head_dim, state)]


def nemotron_h(tp=1, block_size=16, num_speculative_blocks=0):
    """Nemotron-H-8B-like (its MLP layers left out, as they have no cache): 4 attention layers
    (8 KV heads of 128) among 24 Mamba2 layers (128 heads of 64, state 128, 8 groups, conv
    kernel 4), bf16 states."""
    attention_layers = NEMOTRON_ATTENTION
    mamba_layers = tuple(i for i in range(28) if i not in attention_layers)
    return [
        AttentionLayers(_attn(4, 8, 128, block_size), attention_layers),
        MambaLayers.from_shapes(_mamba2_shapes(tp), ["bfloat16"], mamba_layers,
                                num_speculative_blocks=num_speculative_blocks),
    ]


def jamba(ssm_dtype="bfloat16", block_size=16):
    """Jamba-v0.1-like: 32 layers, attention (8 KV heads of 128) at 4, 12, 20, 28, Mamba1
    elsewhere (d_inner 8192, state 16, conv kernel 4)."""
    attention_layers = (4, 12, 20, 28)
    mamba_layers = tuple(i for i in range(32) if i not in attention_layers)
    return [
        AttentionLayers(_attn(4, 8, 128, block_size), attention_layers),
        MambaLayers.from_shapes([(8192, 3), (8192, 16)], ["bfloat16", ssm_dtype],
                                mamba_layers),
    ]


def qwen3_next():
    """Qwen3-Next-80B-A3B-like: 48 layers, full attention (2 KV heads of 256) every 4th, Gated
    DeltaNet elsewhere (16 key heads, 32 value heads of 128, conv kernel 4), bf16 states."""
    attention_layers = tuple(range(3, 48, 4))
    gdn_layers = tuple(i for i in range(48) if i not in attention_layers)
    conv_dim = 2 * 16 * 128 + 32 * 128
    return [
        AttentionLayers(_attn(12, 2, 256), attention_layers),
        MambaLayers.from_shapes([(conv_dim, 3), (32, 128, 128)], ["bfloat16"], gdn_layers),
    ]


class AlignmentTest(parameterized.TestCase):
    """The attention block size and the padded page, as vLLM 0.33's
    ``Platform._align_hybrid_block_size`` sets them."""

    @parameterized.named_parameters(
        # state 61440 + 2097152 = 2158592 B; 4096 B per token: 16 * ceil(2158592 / 65536) = 528
        ("nemotron_h_tp1", lambda: nemotron_h(), 1, 2158592, 528, 528 * 4096),
        # per rank: 30720 + 1048576 B; 2048 B per token: 16 * ceil(1079296 / 32768) = 528
        ("nemotron_h_tp2", lambda: nemotron_h(tp=2), 2, 1079296, 528, 528 * 2048),
        # 49152 + 262144 = 311296 B: 16 * ceil(311296 / 65536) = 16 * 5 = 80
        ("jamba", lambda: jamba(), 1, 311296, 80, 80 * 4096),
        # fp32 SSM state: 49152 + 524288 = 573440 B: 16 * ceil(8.75) = 144
        ("jamba_fp32_ssm", lambda: jamba("float32"), 1, 573440, 144, 144 * 4096),
        # user block size 64: multiples of 64: 64 * ceil(311296 / 262144) = 128
        ("jamba_block_64", lambda: jamba(block_size=64), 1, 311296, 128, 128 * 4096),
        # 49152 + 1048576 = 1097728 B; 2048 B per token: 16 * ceil(33.5) = 544
        ("qwen3_next", qwen3_next, 1, 1097728, 544, 544 * 2048),
    )
    def test_real_configs(self, layers, tp, state_nbytes, block_size, page_nbytes):
        plan = plan_kv_cache(layers(), 8 * GIB, max_model_len=4096, tp_size=tp)
        self.assertEqual(plan.block_size, block_size)
        self.assertEqual(plan.page_nbytes, page_nbytes)
        attention = [g for g in plan.groups if not g.is_mamba]
        mamba = [g for g in plan.groups if g.is_mamba]
        self.assertEqual({g.block_size for g in attention}, {block_size})
        self.assertEqual({g.spec.page_nbytes_per_layer(tp) for g in plan.groups}, {page_nbytes})
        self.assertEqual({g.state_nbytes for g in mamba}, {state_nbytes})
        # The smallest such block: one alignment step less would not hold the state.
        self.assertGreaterEqual(page_nbytes, state_nbytes)
        step = max(16, layers()[0].spec.block_size)
        self.assertLess((block_size - step) * page_nbytes // block_size, state_nbytes)

    def test_block_already_large_enough_is_kept(self):
        # 4096 B per token x 128 tokens = 512 KiB >= a 311296-byte state: nothing to raise.
        plan = plan_kv_cache(jamba(block_size=128), GIB, max_model_len=4096)
        self.assertEqual((plan.block_size, plan.page_nbytes), (128, 128 * 4096))

    def test_kernel_alignment_and_mla(self):
        attn = _attn(1, 8, 128)
        state = MambaLayers(state_nbytes=100_000, layers=(1,))
        # 4096 B per token: 16 * ceil(100000 / 65536) = 32; with alignment 64: 64.
        self.assertEqual(plan_kv_cache([AttentionLayers(attn, (0,)), state], GIB,
                                       max_model_len=1024).block_size, 32)
        self.assertEqual(plan_kv_cache([AttentionLayers(attn, (0,)), state], GIB,
                                       max_model_len=1024,
                                       kernel_block_alignment=64).block_size, 64)
        # MLA (vLLM: TRTLLM/FlashInfer MLA kernels): blocks of a multiple of 128 tokens.
        mla = KVCacheSpec.for_mla(num_layers=1, latent_dim=576, block_size=16)
        plan = plan_kv_cache([AttentionLayers(mla, (0,)), state], GIB, max_model_len=1024)
        self.assertEqual(plan.block_size, 128)  # 128 * 1152 B >= 100000 B
        self.assertEqual(plan.page_nbytes, 128 * 576 * 2)

    def test_largest_state_sets_the_page_and_smaller_ones_are_padded(self):
        attn = _attn(2, 8, 128)
        small = MambaLayers(state_nbytes=50_000, layers=(1, 2))
        large = MambaLayers(state_nbytes=200_000, layers=(3, 4))
        plan = plan_kv_cache([AttentionLayers(attn, (0, 5)), small, large], GIB,
                             max_model_len=1024)
        self.assertEqual(plan.block_size, 16 * math.ceil(200_000 / 65536))  # 64
        self.assertEqual(plan.page_nbytes, 64 * 4096)
        self.assertEqual([(g.layers, g.state_nbytes) for g in plan.groups],
                         [((0, 5), None), ((1, 2), 50_000), ((3, 4), 200_000)])

    def test_sliding_window_next_to_mamba_gets_the_same_block(self):
        # Full attention and a sliding window of the same head size, and Mamba: one block.
        attn = _attn(1, 8, 128)
        plan = plan_kv_cache(
            [AttentionLayers(attn, (0,)), AttentionLayers(attn, (1,), sliding_window=512),
             MambaLayers(state_nbytes=300_000, layers=(2,))],
            GIB, max_model_len=4096, max_num_batched_tokens=256)
        self.assertEqual(plan.block_sizes, (80, 80, 1))
        self.assertEqual(plan.blocks_per_request,
                         math.ceil(4096 / 80) + math.ceil((511 + 256) / 80) + 1 + 1)

    def test_mamba_only_model(self):
        # Mamba2-2.7B-like: no attention, so no alignment: the page is the state.
        shapes = _mamba2_shapes(1, heads=80, head_dim=64, state=128, groups=1)
        layers = MambaLayers.from_shapes(shapes, ["bfloat16"], tuple(range(64)))
        nbytes = (80 * 64 + 2 * 128) * 3 * 2 + 80 * 64 * 128 * 2
        self.assertEqual(layers.state_nbytes, nbytes)
        plan = plan_kv_cache(layers, GIB, max_model_len=2048)
        self.assertEqual(plan.page_nbytes, nbytes)
        self.assertLen(plan.groups, 1)
        self.assertEqual(plan.num_blocks, GIB // nbytes // 64)
        self.assertEqual(plan.blocks_per_request, 1)
        self.assertEqual(plan.block_size, 1)


class GroupingAndCountsTest(parameterized.TestCase):

    def test_nemotron_h_by_hand(self):
        plan = plan_kv_cache(nemotron_h(), 10 * GIB, max_model_len=8192)
        # 4 attention, 24 Mamba layers: group size 4 (24 >= 1.5 x 4), Mamba split into 6
        # strided groups; types ordered by first layer (Mamba's layer 0 first).
        self.assertEqual(plan.group_size, 4)
        self.assertLen(plan.groups, 7)
        mamba_layers = nemotron_h()[1].layers
        self.assertEqual([g.layers for g in plan.groups[:6]],
                         [mamba_layers[i::6] for i in range(6)])
        self.assertEqual(plan.groups[6].layers, NEMOTRON_ATTENTION)
        self.assertEqual([g.is_mamba for g in plan.groups], [True] * 6 + [False])
        self.assertEqual(sum(g.num_padding_layers for g in plan.groups), 0)
        # A block costs 4 pages of 2162688 bytes: 10 GiB // 8650752 = 1241 blocks.
        self.assertEqual(plan.num_blocks, 1241)
        self.assertEqual(plan.cache_nbytes, 1241 * 8650752)
        self.assertLessEqual(plan.cache_nbytes, 10 * GIB)
        # A max-length request: ceil(8192 / 528) = 16 attention blocks + 6 state blocks.
        self.assertEqual(plan.blocks_per_request, 22)
        self.assertAlmostEqual(plan.max_concurrency, 1240 / 22)
        self.assertAlmostEqual(plan.concurrency(528), 1240 / 7)
        self.assertEqual([g.blocks_per_request(8192) for g in plan.groups], [1] * 6 + [16])
        self.assertEqual(sorted(x for b in plan.buffers for x in b.layers),
                         list(range(28)))
        # The longest length: 1240 usable - 6 state blocks = 1234 attention blocks of 528.
        self.assertEqual(estimate_max_model_len(nemotron_h(), 10 * GIB, upper=10**7),
                         1234 * 528)

    def test_speculative_blocks(self):
        plan = plan_kv_cache(nemotron_h(num_speculative_blocks=2), 10 * GIB, max_model_len=8192)
        self.assertEqual({g.num_speculative_blocks for g in plan.groups if g.is_mamba}, {2})
        self.assertEqual(plan.blocks_per_request, 16 + 6 * 3)
        self.assertAlmostEqual(plan.max_concurrency, 1240 / 34)
        self.assertEqual(estimate_max_model_len(nemotron_h(num_speculative_blocks=2), 10 * GIB,
                                                upper=10**7), (1240 - 18) * 528)

    def test_jamba_groups(self):
        plan = plan_kv_cache(jamba(), 4 * GIB, max_model_len=16384)
        # 4 attention, 28 Mamba: group size 4, 7 Mamba groups, attention last (layer 4 > 0).
        self.assertEqual(plan.group_size, 4)
        self.assertEqual([len(g.layers) for g in plan.groups], [4] * 8)
        self.assertEqual(plan.groups[7].layers, (4, 12, 20, 28))
        self.assertEqual(plan.num_blocks, 4 * GIB // (4 * 80 * 4096))
        self.assertEqual(plan.blocks_per_request, 7 + math.ceil(16384 / 80))

    def test_near_balanced_counts_use_the_larger(self):
        # vLLM 0.33: the larger count is the group size when under 1.5x the smaller one:
        # 8 attention + 11 Mamba layers -> groups of 11 (3 attention padding slots).
        attn = _attn(8, 8, 128)
        mamba = MambaLayers(state_nbytes=60_000, layers=tuple(range(8, 19)))
        plan = plan_kv_cache([AttentionLayers(attn, tuple(range(8))), mamba], GIB,
                             max_model_len=1024)
        self.assertEqual(plan.group_size, 11)
        self.assertEqual([(len(g.layers), g.num_padding_layers) for g in plan.groups],
                         [(8, 3), (11, 0)])

    def test_insufficient_memory_names_the_longest_length(self):
        # 8 blocks (7 usable) of 4 pages: 6 state blocks + 1 attention block of 528 tokens.
        memory = 8 * 4 * 2162688
        plan = plan_kv_cache(nemotron_h(), memory, max_model_len=528)
        self.assertEqual((plan.num_usable_blocks, plan.blocks_per_request), (7, 7))
        with self.assertRaisesRegex(
            InsufficientMemoryError,
            r"max_model_len=529 tokens needs 8 blocks .* only 7 usable blocks .* longest "
            r"max_model_len that fits is 528",
        ):
            plan_kv_cache(nemotron_h(), memory, max_model_len=529)
        # 6 usable blocks: the states alone fill them, no length fits.
        with self.assertRaises(InsufficientMemoryError) as caught:
            plan_kv_cache(nemotron_h(), 7 * 4 * 2162688, max_model_len=16)
        self.assertNotIn("longest", str(caught.exception))
        self.assertEqual(estimate_max_model_len(nemotron_h(), 7 * 4 * 2162688, upper=100), 0)

    def test_estimate_matches_brute_force(self):
        attn = _attn(2, 1, 8, block_size=4, dtype="float32")  # 64 B per token
        layers = [AttentionLayers(attn, (1, 3)),
                  AttentionLayers(attn.replace(num_layers=1), (4,), sliding_window=24),
                  MambaLayers(state_nbytes=900, layers=(0, 2), num_speculative_blocks=1)]
        for memory in (20_000, 60_000, 150_000):
            got = estimate_max_model_len(layers, memory, upper=1500)
            fits = [n for n in range(1, 1501) if _fits(layers, memory, n)]
            self.assertEqual(got, max(fits, default=0), memory)


def _fits(layers, memory, length):
    try:
        plan_kv_cache(layers, memory, max_model_len=length)
        return True
    except InsufficientMemoryError:
        return False


class ErrorsTest(parameterized.TestCase):

    @parameterized.parameters("align", "all")
    def test_other_cache_modes_are_refused(self, mode):
        layers = [AttentionLayers(_attn(1, 8, 128), (0,)),
                  MambaLayers(state_nbytes=1000, layers=(1,), cache_mode=mode)]
        with self.assertRaisesRegex(ValueError, rf"cache_mode='{mode}'.*'none' only"):
            plan_kv_cache(layers, GIB, max_model_len=1024)
        with self.assertRaisesRegex(ValueError, "'none' only"):
            estimate_max_model_len(layers, GIB, upper=1024)

    def test_unknown_cache_mode(self):
        with self.assertRaisesRegex(ValueError, "unknown mamba cache_mode 'fast'"):
            MambaLayers(state_nbytes=1000, layers=(1,), cache_mode="fast")

    def test_attention_block_sizes_must_agree_next_to_mamba(self):
        layers = [AttentionLayers(_attn(1, 8, 128, block_size=16), (0,)),
                  AttentionLayers(_attn(1, 8, 64, block_size=32), (1,), sliding_window=64),
                  MambaLayers(state_nbytes=1000, layers=(2,))]
        with self.assertRaisesRegex(ValueError, r"one block size .* got \[16, 32\]"):
            plan_kv_cache(layers, GIB, max_model_len=1024)

    def test_layer_in_attention_and_mamba(self):
        with self.assertRaisesRegex(ValueError, "layer 1 appears in two"):
            plan_kv_cache([AttentionLayers(_attn(2, 8, 128), (0, 1)),
                           MambaLayers(state_nbytes=1000, layers=(1, 2))],
                          GIB, max_model_len=1024)

    def test_invalid_fields(self):
        with self.assertRaisesRegex(ValueError, "state_nbytes must be a positive int"):
            MambaLayers(state_nbytes=0, layers=(0,))
        with self.assertRaisesRegex(ValueError, "at least one layer"):
            MambaLayers(state_nbytes=10, layers=())
        with self.assertRaisesRegex(ValueError, "repeated layer"):
            MambaLayers(state_nbytes=10, layers=(1, 1))
        with self.assertRaisesRegex(ValueError, "num_speculative_blocks"):
            MambaLayers(state_nbytes=10, layers=(1,), num_speculative_blocks=-1)
        with self.assertRaisesRegex(ValueError, "2 state shapes but 3 dtypes"):
            MambaLayers.from_shapes([(4, 3), (4, 8)], ["float32"] * 3, (0,))
        with self.assertRaisesRegex(ValueError, "no arrays"):
            MambaLayers.from_shapes([], ["float32"], (0,))
        with self.assertRaises(TypeError):
            plan_kv_cache([AttentionLayers(_attn(1, 8, 128)), "mamba"], GIB, max_model_len=16)

    def test_from_shapes_dtypes(self):
        # One dtype for all states, one per state, torch-style names.
        self.assertEqual(MambaLayers.from_shapes([(4, 3), (4, 8)], ["float32"], (0,))
                         .state_nbytes, (12 + 32) * 4)
        self.assertEqual(MambaLayers.from_shapes([(4, 3), (4, 8)],
                                                 ["torch.bfloat16", "torch.float32"], (0,))
                         .state_nbytes, 12 * 2 + 32 * 4)


class MambaManagerTest(absltest.TestCase):
    def test_manager_refuses_state_groups_by_name(self):
        from jaxkv.blocks import KVCacheManager, plan_kv_cache

        plan = plan_kv_cache(nemotron_h(), 1 << 30, max_model_len=4096)
        mamba = [i for i, g in enumerate(plan.groups) if g.is_mamba]
        self.assertTrue(mamba)
        with self.assertRaisesRegex(ValueError, f"groups {mamba} hold Mamba states".replace(
                "[", r"\[").replace("]", r"\]")):
            KVCacheManager.from_plan(plan)


if __name__ == "__main__":
    absltest.main()
