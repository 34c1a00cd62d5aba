"""Post-processing of received blocks on a JAX cache (jaxkv.transfer.apply_post_processing).

The plan's byte copies are simulated in numpy (as in transfer_plan_test), the resulting
per-rank buffers become a (sharded) `PagedKVCache`, and the steps run with the real custom
calls; the result must equal G's slice bit for bit in the received blocks, every other block
must be unchanged, and the buffers must not move. No NIXL needed.
"""

from __future__ import annotations

from support import bits, meshes, platforms

platforms.force_cpu_devices()

import numpy as np  # noqa: E402
from absl.testing import absltest, parameterized  # noqa: E402
from support import transfer as tt  # noqa: E402

from jaxkv import EngineConfig, KVCacheSpec, PagedKVCache  # noqa: E402
from jaxkv.transfer._plan import plan_read
from jaxkv.transfer._post import apply_post_processing, group_post_steps

NUM_BLOCKS = 16
REMOTE_IDS = [3, 4, 5, 9, 10, 2]
LOCAL_IDS = [7, 8, 9, 12, 13, 14]


def _global_array(config: EngineConfig, buffers: list[np.ndarray], region: int) -> np.ndarray:
    """Assembles one region's per-TP-rank byte buffers into the global array (heads on the
    layout's H axis)."""
    spec = config.spec
    width = np.dtype(f"u{spec.itemsize}")
    shape_rank = config.local_spec(0).replace(num_kv_heads=config.heads_per_rank)
    parts = [
        buffers[rank][region].view(width).reshape(shape_rank.array_shape(NUM_BLOCKS))
        for rank in range(config.tp_size)
    ]
    if "H" not in spec.layout or config.tp_size == 1:
        return parts[0]
    return np.concatenate(parts, axis=1 + spec.layout.index("H"))


def run_case(test, p_tp, d_tp, p_layout, d_layout, ratio, heads=4, mla=False, dtype="bfloat16"):
    if mla:
        spec_p = KVCacheSpec.for_mla(2, 8, 4, dtype=dtype, layout=p_layout)
    else:
        spec_p = KVCacheSpec(2, heads, 8, 4, dtype=dtype, layout=p_layout)
    spec_d = spec_p.replace(block_size=4 * ratio, layout=d_layout)
    cfg_p, cfg_d = EngineConfig(spec_p, p_tp), EngineConfig(spec_d, d_tp)
    meta_p = tt.fake_metadata("prefill", cfg_p, NUM_BLOCKS)
    meta_d = tt.fake_metadata("decode", cfg_d, NUM_BLOCKS)
    g = tt.global_cache(spec_p, len(REMOTE_IDS) * 4, seed=7)
    prefill = tt.NumpyEngine(cfg_p, NUM_BLOCKS, seed=1)
    prefill.write_request(g, REMOTE_IDS)
    received = tt.NumpyEngine(cfg_d, NUM_BLOCKS, seed=2)
    local_ids = LOCAL_IDS[: len(REMOTE_IDS) // ratio]
    plans = [
        plan_read(meta_d, rank, meta_p, local_ids, REMOTE_IDS) for rank in range(cfg_d.world_size)
    ]
    for plan in plans:  # the bytes as NIXL leaves them: copies only
        tt.apply_plan(_no_post(plan), received, prefill)
    steps = [s for p in plans for s in p.post]
    test.assertTrue(steps, "the case must need post-processing")
    arrays = [_global_array(cfg_d, received.buffers, r) for r in range(spec_d.num_arrays)]
    before = [a.copy() for a in arrays]
    mesh = meshes.tp(d_tp)
    cache = PagedKVCache.from_arrays(
        spec_d, [a.view(spec_d.dtype) for a in arrays], mesh=mesh
    )
    registered = cache.shard_buffers()
    cache = apply_post_processing(cache, steps)
    cache.verify_unmoved(registered)  # in place: NIXL registrations stay valid
    expected = tt.expected_arrays(cfg_d, 0, g, local_ids)
    ids = np.asarray(local_ids)
    others = np.setdiff1d(np.arange(NUM_BLOCKS), ids)
    for index, array in enumerate(cache.arrays):
        got = bits.bits(np.asarray(array))
        np.testing.assert_array_equal(got[ids], expected[index], err_msg=f"array {index}")
        np.testing.assert_array_equal(got[others], before[index][others], f"array {index}")
    return steps


def _no_post(plan):
    import dataclasses

    return dataclasses.replace(plan, post=())


class PostProcessTest(parameterized.TestCase):
    @parameterized.parameters(
        # (p_tp, d_tp, p_layout, d_layout, ratio, kind)
        (2, 1, "HTD", "THD", 1, "permute"),
        (1, 2, "KHTD", "KTHD", 1, "permute"),
        (1, 1, "LKTHD", "LKHTD", 1, "permute"),
        (1, 1, "LKHTD", "LKHTD", 2, "merge"),
        (2, 1, "KTHD", "KTHD", 2, "merge"),  # (THD -> THD needs none: tokens outermost)
        (1, 2, "KHTD", "KTHD", 2, "merge_permute"),
        (2, 2, "THD", "LKHTD", 2, "merge_permute"),
        (4, 2, "KTHD", "KHTD", 2, "merge_permute"),
    )
    def test_cases(self, p_tp, d_tp, p_layout, d_layout, ratio, kind):
        steps = run_case(self, p_tp, d_tp, p_layout, d_layout, ratio)
        self.assertEqual({s.kind for s in steps}, {kind})

    def test_mla_ratio_2(self):
        steps = run_case(self, 1, 1, "LKTD", "LKTD", 2, mla=True)
        self.assertEqual({s.kind for s in steps}, {"merge"})

    def test_fp32_and_one_head(self):
        run_case(self, 1, 1, "HTD", "THD", 2, heads=1, dtype="float32")

    def test_disagreeing_steps_refused(self):
        spec = KVCacheSpec(1, 2, 8, 8, dtype="float32", layout="KTHD")
        cfg = EngineConfig(spec, 1)
        meta_d = tt.fake_metadata("decode", cfg, NUM_BLOCKS)
        meta_p = tt.fake_metadata("prefill", EngineConfig(spec.replace(block_size=4), 1),
                                  NUM_BLOCKS)
        a = plan_read(meta_d, 0, meta_p, [1], [1, 2]).post
        b = plan_read(meta_d, 0, meta_p, [2], [1, 2]).post
        with self.assertRaisesRegex(ValueError, "different post-processing"):
            group_post_steps([*a, *b])


if __name__ == "__main__":
    absltest.main()
