"""Cache groups (a full-attention and a sliding-window cache with their own block ids per
request) moved between two processes, and the layout advice."""

from __future__ import annotations

import os

os.environ.setdefault("UCX_TLS", "tcp,sm,self")

import time  # noqa: E402

from support import bits, meshes, platforms, processes  # noqa: E402

platforms.force_cpu_devices()

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from absl.testing import absltest, parameterized  # noqa: E402
from support import transfer as tt  # noqa: E402

from jaxkv import EngineConfig, KVCacheSpec, PagedKVCache  # noqa: E402
from jaxkv.transfer import (  # noqa: E402
    JaxDistributed,
    TransferEngine,
    nixl_available,
    recommend_layout,
)

NUM_BLOCKS, WAIT_S, G_SEED = tt.NUM_BLOCKS, tt.WAIT_S, tt.G_SEED
GROUPS = {  # group -> producer spec; the decode side may change layout
    "full": dict(num_layers=2, num_kv_heads=4, head_dim=8, block_size=4, dtype="bfloat16",
                 layout="LKHTD"),
    "swa": dict(num_layers=1, num_kv_heads=4, head_dim=8, block_size=4, dtype="bfloat16",
                layout="KHTD"),
}
REMOTE = {"full": [3, 4, 5, 9, 10, 2], "swa": [11, 12]}
LOCAL = {"full": [7, 8, 9, 12, 13, 14], "swa": [1, 2]}


@pytest.mark.skipif(not nixl_available(), reason="NIXL (nixl-cu13) is not installed")
class TransferGroupsTest(tt.TransferTestBase):
    @parameterized.parameters(
        (1, 1, {"full": "LKHTD", "swa": "KHTD"}),
        (2, 1, {"full": "LKHTD", "swa": "KTHD"}),  # the swa group permuted after its read
    )
    def test_two_groups_different_ids(self, p_tp, d_tp, d_layouts):
        process, parent = processes.spawn(tt.groups_producer_main, GROUPS, p_tp, NUM_BLOCKS, REMOTE)
        self._children.append((process, parent))
        self.ready(parent)
        params = self.call(parent, "pin", "req-g", 30.0)
        self.assertEqual({g: p.block_ids for g, p in params.groups.items()}, REMOTE)
        mesh = meshes.tp(d_tp)
        specs = {g: KVCacheSpec(**dict(kw, layout=d_layouts[g])) for g, kw in GROUPS.items()}
        configs = {g: EngineConfig(s, d_tp) for g, s in specs.items()}
        engine = TransferEngine("decode", configs)
        self.addCleanup(engine.close)
        for g, s in specs.items():
            engine.register_cache(PagedKVCache.allocate(s, NUM_BLOCKS, mesh=mesh), group=g)
        engine.start_read(params, LOCAL)
        finished, failed = [], []
        deadline = time.monotonic() + WAIT_S
        while not (finished or failed) and time.monotonic() < deadline:
            result = engine.poll()
            finished += result.finished
            failed += result.failed
        self.assertEqual((finished, failed), (["req-g"], []))
        for i, g in enumerate(GROUPS):
            spec = KVCacheSpec(**GROUPS[g])
            ref = tt.global_cache(spec, len(REMOTE[g]) * 4, seed=G_SEED + i)
            self.check_cache(engine.caches_of(g)[0], configs[g], ref, LOCAL[g])
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            freed = self.call(parent, "state")
            if freed:
                break
        self.assertEqual(freed, ["req-g"])  # freed once, when every group was confirmed

    def test_two_reads_of_one_grouped_request(self):
        process, parent = processes.spawn(tt.groups_producer_main, GROUPS, 1, NUM_BLOCKS, REMOTE)
        self._children.append((process, parent))
        self.ready(parent)
        params = self.call(parent, "pin", "req-g", 30.0, 2)
        mesh = meshes.tp(1)
        specs = {g: KVCacheSpec(**kw) for g, kw in GROUPS.items()}
        configs = {g: EngineConfig(s, 1) for g, s in specs.items()}
        engine = TransferEngine("decode", configs)
        self.addCleanup(engine.close)
        for g, s in specs.items():
            engine.register_cache(PagedKVCache.allocate(s, NUM_BLOCKS, mesh=mesh), group=g)
        used = {b for ids in LOCAL.values() for b in ids}
        spare = [b for b in range(NUM_BLOCKS) if b not in used]
        other = {g: spare[: len(ids)] for g, ids in LOCAL.items()}
        engine.start_read(params, LOCAL, read_id="a")
        engine.start_read(params, other, read_id="b")
        with self.assertRaisesRegex(ValueError, "already in flight"):
            engine.start_read(params, other, read_id="b")
        finished, failed = [], []
        deadline = time.monotonic() + WAIT_S
        while len(finished) + len(failed) < 2 and time.monotonic() < deadline:
            result = engine.poll()
            finished += result.finished
            failed += result.failed
        self.assertEqual((sorted(finished), failed), (["a", "b"], []))
        for i, g in enumerate(GROUPS):
            spec = KVCacheSpec(**GROUPS[g])
            ref = tt.global_cache(spec, len(REMOTE[g]) * 4, seed=G_SEED + i)
            for ids in (LOCAL[g], other[g]):
                want = tt.expected_arrays(configs[g], 0, ref, ids)
                for array, expected in zip(engine.caches_of(g)[0].arrays, want):
                    got = bits.bits(array)
                    np.testing.assert_array_equal(got[np.asarray(ids)], expected)
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            freed = self.call(parent, "state")
            if freed:
                break
        self.assertEqual(freed, ["req-g"])  # freed once, after both reads in every group

    def test_groups_must_match(self):
        spec = KVCacheSpec(**GROUPS["full"])
        engine = TransferEngine("decode", {"full": EngineConfig(spec, 1)})
        self.addCleanup(engine.close)
        with self.assertRaisesRegex(ValueError, "groups"):
            engine.publish_request("r", {"full": [1], "swa": [2]})
        with self.assertRaisesRegex(KeyError, "no cache group 'swa'"):
            engine.register_cache(None, group="swa")


@pytest.mark.skipif(not nixl_available(), reason="NIXL (nixl-cu13) is not installed")
class GroupedEngineBookkeepingTest(absltest.TestCase):
    """One process: per-group options, aborts, a group failing to start, `group_of`."""

    def engine(self, name="e", **kwargs):
        specs = {g: KVCacheSpec(**kw) for g, kw in GROUPS.items()}
        engine = TransferEngine(name, {g: EngineConfig(s, 1) for g, s in specs.items()},
                                       **kwargs)
        self.addCleanup(engine.close)
        caches = {g: PagedKVCache.allocate(s, NUM_BLOCKS) for g, s in specs.items()}
        for g, cache in caches.items():
            engine.register_cache(cache, group=g)
        return engine, caches

    def test_group_options_override_the_common_ones(self):
        engine, _ = self.engine(group_options={"swa": {"lease_s": 1.5}}, lease_s=9.0)
        self.assertEqual((engine.config_of("full"), engine.config_of("swa")),
                         tuple(EngineConfig(KVCacheSpec(**GROUPS[g]), 1) for g in GROUPS))
        lease = {g: params.lease_s for g, params in
                 engine.publish_request("r", {"full": [1], "swa": [2]}).groups.items()}
        self.assertEqual(lease, {"full": 9.0, "swa": 1.5})
        self.assertNotEqual(engine.addresses["full"], engine.addresses["swa"])
        with self.assertRaisesRegex(ValueError, "coordinator.*one cache group"):
            TransferEngine("x", {g: EngineConfig(KVCacheSpec(**kw), 1) for g, kw in GROUPS.items()},
                           coordinator=JaxDistributed())
        with self.assertRaisesRegex(ValueError, r"unknown groups \['mamba'\]"):
            TransferEngine("x", {"full": EngineConfig(KVCacheSpec(**GROUPS["full"]), 1)},
                                  group_options={"mamba": {}})

    def test_producer_abort_frees_once_every_group_released(self):
        engine, _ = self.engine()
        engine.publish_request("r", {"full": [1, 2], "swa": [3]})
        self.assertEqual(engine.num_pinned, 1)
        engine.abort_request("r")
        freed = []
        deadline = time.monotonic() + WAIT_S
        while not freed and time.monotonic() < deadline:
            freed += engine.poll().freeable
        self.assertEqual(freed, ["r"])
        self.assertEqual(engine.num_pinned, 0)

    def test_a_group_failing_to_start_fails_the_read_with_every_groups_blocks(self):
        producer, _ = self.engine("p")
        params = producer.publish_request("r", {"full": [1, 2], "swa": [3]})
        consumer, _ = self.engine("d")

        def refuse(*args, **kwargs):
            raise RuntimeError("transport refused the post")

        # the swa group's protocol core refuses to post
        consumer._cores["swa"].start_read = refuse
        consumer.start_read(params, {"full": [5, 6], "swa": [7]}, read_id="c")
        failed = []
        deadline = time.monotonic() + WAIT_S
        while not failed and time.monotonic() < deadline:
            result = consumer.poll()
            self.assertEqual(result.finished, [])
            failed += result.failed
        (failure,) = failed
        self.assertEqual(failure.request_id, "c")
        self.assertIn("group 'swa': starting the read failed: transport refused",
                      failure.reason)
        self.assertEqual(failure.invalid_by_group, {"full": (5, 6), "swa": (7,)})
        self.assertEqual(failure.invalid_block_ids, (5, 6, 7))
        self.assertEqual(consumer.num_reading, 0)

    def test_group_of_finds_equal_shaped_caches_by_their_buffers(self):
        spec = KVCacheSpec(**GROUPS["full"])
        engine = TransferEngine(
            "e", {"a": EngineConfig(spec, 1), "b": EngineConfig(spec, 1)})
        self.addCleanup(engine.close)
        caches = {g: PagedKVCache.allocate(spec, NUM_BLOCKS) for g in ("a", "b")}
        for g, cache in caches.items():
            engine.register_cache(cache, group=g)
        blocks = [np.ones((1, *a.shape[1:]), a.dtype) for a in caches["b"].arrays]
        updated = caches["b"].scatter_blocks(blocks, np.asarray([3], np.int32))  # in place
        self.assertEqual(engine.group_of(updated), "b")
        engine.update_cache(updated)  # the group found by its buffers
        self.assertIs(engine.caches_of("b")[0], updated)
        with self.assertRaisesRegex(ValueError, "no group registered"):
            engine.group_of(PagedKVCache.allocate(spec, NUM_BLOCKS))


class RecommendLayoutTest(parameterized.TestCase):
    @parameterized.parameters(
        # (self layout, self tp, [(peer layout, peer tp)], layout, post-processing left)
        ("LKTHD", 2, [("LKTHD", 4)], "LKHTD", True),  # hetero TP: HND; the NHD peer permutes
        ("KTHD", 2, [("KHTD", 1)], "KHTD", False),  # hetero TP, HND peer: HND, nothing left
        ("THD", 2, [("THD", 2)], "THD", False),  # homogeneous, peers NHD: keep NHD
        ("LKHTD", 2, [("LKTHD", 2)], "LKTHD", False),  # homogeneous: follow the peers
        ("HTD", 2, [("HTD", 2), ("THD", 2)], "HTD", True),  # peers disagree: HND
    )
    def test_advice(self, layout, tp, peers, want, post):
        spec = KVCacheSpec(num_layers=2, num_kv_heads=8, head_dim=8, block_size=4,
                           layout=layout)
        advice = recommend_layout(
            EngineConfig(spec, tp),
            [EngineConfig(spec.replace(layout=pl), ptp) for pl, ptp in peers],
        )
        self.assertEqual((advice.layout, advice.post_processing), (want, post))
        self.assertTrue(advice.reason)

    def test_advice_avoids_post_processing_in_the_plan(self):
        # the recommended layout really plans without post-processing (hetero TP, HND peer)
        from jaxkv.transfer._plan import plan_read

        spec = KVCacheSpec(num_layers=2, num_kv_heads=4, head_dim=8, block_size=4,
                           layout="KHTD")
        prefill = EngineConfig(spec, 1)
        decode = EngineConfig(spec.replace(layout="KTHD"), 2)
        advice = recommend_layout(decode, [prefill])
        remote = tt.fake_metadata("p", prefill, 16)
        before = tt.fake_metadata("d", decode, 16)
        after = tt.fake_metadata("d", EngineConfig(spec.replace(layout=advice.layout), 2), 16)
        self.assertTrue(plan_read(before, 0, remote, [1, 2], [3, 4]).post)
        self.assertFalse(plan_read(after, 0, remote, [1, 2], [3, 4]).post)

    def test_mla(self):
        spec = KVCacheSpec.for_mla(num_layers=2, latent_dim=16, block_size=4)
        advice = recommend_layout(EngineConfig(spec, 2), [EngineConfig(spec, 1)])
        self.assertEqual(advice.layout, spec.layout)
        self.assertFalse(advice.post_processing)


if __name__ == "__main__":
    absltest.main()
