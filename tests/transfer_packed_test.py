"""Reads of tpu-inference's packed caches (K/V interleaved on the head axis, sub-32-bit values
packed per word with phantom heads, head dim padded to 128 lanes) over NIXL: only values
move, bit for bit, between engines of other TP sizes, block sizes and storage (packed <->
plain), and the consumer's padding is never written. Planner-level cases simulate the
descriptors between byte buffers; the real ones read between engines in two processes."""

from __future__ import annotations

import itertools

import numpy as np
import packed_testing as pt
import transfer_testing as tt
from absl.testing import absltest, parameterized

from jaxkv import EngineConfig, KVCacheSpec
from jaxkv.transfer import plan_read

NUM_BLOCKS = 10
REMOTE_IDS = [3, 4, 5, 9, 2, 0]  # a run of consecutive ids and breaks
LOCAL_IDS = [6, 7, 8, 1, 0, 5]
LAYERS = 2


def packed(heads, head_dim, page, dtype, **changes):
    return KVCacheSpec.for_tpu_inference(LAYERS, heads, head_dim, page, dtype).replace(**changes)


def plain(heads, head_dim, page, dtype, layout):
    return KVCacheSpec(LAYERS, heads, head_dim, page, dtype, layout=layout)


def plan_case(test, spec_p, spec_d, p_tp, d_tp, p_pp=1, d_pp=1, hit=0):
    """Plans every consumer rank's read of the request and simulates its descriptors; the
    consumer's buffers (sentinel bytes) must then equal the reference exactly: the values
    in the request's blocks, the sentinel everywhere else (padding, other blocks)."""
    cfg_p, cfg_d = EngineConfig(spec_p, p_tp, p_pp), EngineConfig(spec_d, d_tp, d_pp)
    meta_p = tt.fake_metadata("prefill", cfg_p, NUM_BLOCKS)
    meta_d = tt.fake_metadata("decode", cfg_d, NUM_BLOCKS)
    ratio = spec_d.block_size // spec_p.block_size
    g = pt.g_cache(spec_p, len(REMOTE_IDS) * spec_p.block_size, seed=5)
    prefill = pt.PackedNumpyEngine(cfg_p, NUM_BLOCKS, ("random", 1))
    prefill.write_request(g, REMOTE_IDS)
    decode = pt.PackedNumpyEngine(cfg_d, NUM_BLOCKS, pt.SENTINEL)
    expected = pt.PackedNumpyEngine(cfg_d, NUM_BLOCKS, pt.SENTINEL)
    n_local = -(-len(REMOTE_IDS) // ratio) - hit
    local_ids = LOCAL_IDS[:n_local]
    masks = expected.write_request(g, local_ids, first_token=hit * spec_d.block_size)
    plans = []
    for rank in range(cfg_d.world_size):
        plan = plan_read(meta_d, rank, meta_p, local_ids, REMOTE_IDS)
        test.assertEqual(plan.post, ())  # every row read into its final place
        tt.apply_plan(plan, decode, prefill)
        for region, (got, want) in enumerate(zip(decode.arrays[rank], expected.arrays[rank])):
            np.testing.assert_array_equal(got, want, err_msg=f"rank {rank} region {region}")
        payload = sum(int(m.sum()) for m in masks[rank]) * spec_d.itemsize
        test.assertEqual(plan.num_bytes, payload * len(local_ids), f"rank {rank}")
        plans.append(plan)
    return plans


TP_PAIRS = [(1, 1), (2, 1), (1, 2), (2, 4), (4, 2)]


class PackedPlanTest(parameterized.TestCase):
    @parameterized.product(
        tp=TP_PAIRS, dtype=["bfloat16", "float32", "float8_e4m3fn"], head_dim=[96, 128],
        ratio=[1, 2],
    )
    def test_packed_to_packed(self, tp, dtype, head_dim, ratio):
        spec_p = packed(4, head_dim, 4, dtype)
        plan_case(self, spec_p, spec_p.replace(block_size=4 * ratio), *tp)

    @parameterized.product(
        tp=TP_PAIRS, dtype=["bfloat16", "float32", "float8_e5m2"],
        layout=["THD", "HTD", "KTHD", "LKHTD"], ratio=[1, 2],
    )
    def test_packed_and_plain_both_ways(self, tp, dtype, layout, ratio):
        spec_p = packed(4, 96, 4, dtype)
        other = plain(4, 96, 4 * ratio, dtype, layout)
        plan_case(self, spec_p, other, *tp)
        plan_case(self, other.replace(block_size=4), spec_p.replace(block_size=4 * ratio), *tp)

    @parameterized.parameters(itertools.product([(1, 1), (3, 1), (1, 3), (3, 3)], [1, 2]))
    def test_phantom_heads(self, tp, ratio):
        # 3 heads: 6 combined K/V heads in 2 words of 4 fp8 values (2 phantoms); one head
        # per rank at TP 3: 2 combined heads in one word (2 phantoms per rank).
        spec_p = packed(3, 40, 4, "float8_e4m3fn")
        plan_case(self, spec_p, spec_p.replace(block_size=4 * ratio), *tp)
        plan_case(self, spec_p, plain(3, 40, 4, "float8_e4m3fn", "KHTD"), *tp)

    @parameterized.parameters((2, 4), (4, 2), (1, 8), (8, 1))
    def test_replicated_heads(self, p_tp, d_tp):
        spec = packed(2, 64, 4, "bfloat16")
        plan_case(self, spec, spec, p_tp, d_tp)
        plan_case(self, spec, plain(2, 64, 4, "bfloat16", "HTD"), p_tp, d_tp)

    @parameterized.parameters(itertools.product([(1, 2), (2, 1)], [(1, 2), (2, 1), (2, 2)]))
    def test_pipeline_parallel_and_prefix_hit(self, tp, pp):
        spec_p = packed(4, 96, 4, "bfloat16", num_layers=3)
        spec_d = spec_p.replace(block_size=8)
        plan_case(self, spec_p, spec_d, *tp, p_pp=pp[0], d_pp=pp[1])
        plan_case(self, spec_p, spec_d, *tp, p_pp=pp[0], d_pp=pp[1], hit=1)

    @parameterized.product(tp=[(1, 1), (1, 2), (2, 1)], dtype=["bfloat16", "float8_e4m3fn",
                                                                  "float32"], ratio=[1, 2])
    def test_mla(self, tp, dtype, ratio):
        # tokens packed: page 6 of fp8 is 2 words of 4 (2 phantom tokens per page)
        mla = KVCacheSpec.for_tpu_inference_mla(LAYERS, latent_dim=72, page_size=6, dtype=dtype)
        plan_case(self, mla, mla.replace(block_size=6 * ratio), *tp)
        other = KVCacheSpec.for_mla(LAYERS, 72, 6 * ratio, dtype=dtype, layout="LKTD")
        plan_case(self, mla, other, *tp)
        plan_case(self, other.replace(block_size=6), mla.replace(block_size=6 * ratio), *tp)
        plans = plan_case(self, mla, mla, *tp)
        self.assertLen(plans[0].read_ranks, 1)  # replicated: one remote rank read


if __name__ == "__main__":
    absltest.main()
