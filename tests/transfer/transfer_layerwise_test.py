"""Layer-wise publishing: the consumer reads each layer as the producer announces it.

The producer process holds the request's later layers scrambled until it "computes" them
(writes the right bytes, then `publish_layers`); the test drives it step by step, so the
ordering is explicit: layer 0 must have arrived at the consumer (observed through
`PollResult.layers`) before the producer is told to write and publish the last layer. Then
the per-layer timestamps of both sides are compared and the cache is checked bit for bit
(a read of a layer before its announcement would have fetched scrambled bytes).
"""

from __future__ import annotations

import os

os.environ.setdefault("UCX_TLS", "tcp,sm,self")

import time  # noqa: E402

from support import platforms  # noqa: E402

platforms.force_cpu_devices()

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from absl.testing import absltest, parameterized  # noqa: E402
from support import transfer as tt  # noqa: E402

from jaxkv import KVCacheSpec  # noqa: E402
from jaxkv.transfer import nixl_available  # noqa: E402
from jaxkv.transfer._plan import plan_read  # noqa: E402

REMOTE_IDS, LOCAL_IDS, G_SEED, WAIT_S = tt.REMOTE_IDS, tt.LOCAL_IDS, tt.G_SEED, tt.WAIT_S
NUM_LAYERS = 3


@pytest.mark.skipif(not nixl_available(), reason="NIXL (nixl-cu13) is not installed")
class TransferLayerwiseTest(tt.TransferTestBase):
    def poll_until(self, engine, predicate, what):
        deadline = time.monotonic() + WAIT_S
        seen = tt_result()
        while time.monotonic() < deadline:
            result = engine.poll()
            seen.finished += result.finished
            seen.failed += result.failed
            seen.layers.update(result.layers)
            if predicate(seen):
                return seen
        raise TimeoutError(f"timed out waiting for {what}")

    @parameterized.parameters(
        # (p_tp, d_tp, p_layout, d_layout, staging): cross-layer blocks (one region, per-layer
        # byte ranges), per-layer arrays with a layout change (permuted after the last layer),
        # host staging on both sides (the mirror gets each layer's bytes when published); the
        # control messages (Want, Ready, Done, Ack) over TCP (the default) or NIXL
        (1, 1, "LKHTD", "LKHTD", False),
        (2, 1, "KHTD", "KTHD", False),
        (1, 2, "LKTHD", "LKTHD", True),
        (2, 1, "KHTD", "KTHD", False, "nixl"),
        # formatted reads: each announced layer gathered by the producer, read in one chunk
        (2, 1, "KHTD", "KTHD", False, "auto", "always"),
        (1, 2, "LKTHD", "LKTHD", True, "auto", "always"),
        # fragmented ids (no run on both sides): each layer's share from per-block templates
        (2, 1, "KHTD", "KTHD", False, "auto", "always", [14, 7, 12, 9, 13, 8]),
    )
    def test_layers_arrive_as_published(self, p_tp, d_tp, p_layout, d_layout, staging,
                                        control="auto", formatted="never", local_ids=None):
        local_ids = LOCAL_IDS if local_ids is None else local_ids
        spec_kwargs = dict(num_layers=NUM_LAYERS, num_kv_heads=4, head_dim=8, block_size=4,
                           dtype="bfloat16", layout=p_layout)
        _, conn = self.start_producer(spec_kwargs, p_tp, engine_kwargs={"host_staging": staging})
        self.ready(conn)
        self.call(conn, "register", REMOTE_IDS, 1)  # layers >= 1 not written yet
        params = self.call(conn, "pin_lw", "req-lw", REMOTE_IDS, 30.0)
        self.assertTrue(params.layerwise)
        self.call(conn, "layers", "req-lw", 1)  # layer 0 computed and published
        spec = KVCacheSpec(**dict(spec_kwargs, layout=d_layout))
        engine, cache, config = self.consumer(spec, d_tp, host_staging=staging, control=control,
                                              formatted_reads=formatted)
        engine.start_read(params, local_ids)

        seen = self.poll_until(engine, lambda s: s.layers.get("req-lw", 0) >= 1, "layer 0")
        self.assertEqual(seen.layers["req-lw"], 1)
        self.assertEqual((seen.finished, seen.failed), ([], []))
        g = tt.global_cache(KVCacheSpec(**spec_kwargs), len(REMOTE_IDS) * 4, seed=G_SEED)
        if p_layout != d_layout and not staging:
            # a layout change of per-layer arrays: layer 0 is rewritten as soon as it landed,
            # its array exact before the producer computed the next layer
            self.check_cache(engine.caches[0], config, g, local_ids, arrays=[0])
        self.call(conn, "layers", "req-lw", 2)
        seen = self.poll_until(engine, lambda s: s.layers.get("req-lw", 0) >= 2, "layer 1")
        self.assertEqual((seen.finished, seen.failed), ([], []))  # not before every layer
        self.call(conn, "layers", "req-lw", NUM_LAYERS)
        seen = self.poll_until(engine, lambda s: s.finished or s.failed, "the request")
        self.assertEqual((seen.finished, seen.failed), (["req-lw"], []))
        self.check_cache(engine.caches[0], config, g, local_ids)
        record = engine.stats.records[-1]
        self.assertEqual(record.path, "formatted" if formatted == "always" else "direct")
        arrival = dict(record.layer_arrival)
        self.assertEqual(sorted(arrival), list(range(NUM_LAYERS)))
        (publication,) = self.call(conn, "publications")
        published = dict(publication.layers)  # layer_stop -> wall time
        self.assertEqual(sorted(published), [1, 2, NUM_LAYERS])
        # the consumer's first layer arrived before the producer published its last one
        self.assertLess(arrival[0], published[NUM_LAYERS])
        for layer in range(NUM_LAYERS):  # and no layer arrived before it was published
            self.assertGreaterEqual(arrival[layer], published[layer + 1])
        if staging:
            self.assertGreater(publication.staged_s, 0.0)
        self.assertEqual(record.bytes, spec.cache_nbytes(len(LOCAL_IDS)))
        self.assert_freed(conn, "req-lw")

    def test_digests_verify_a_layerwise_read_with_a_layout_change(self):
        # Digests are taken over the bytes as they landed: with digests on, the layers are
        # rewritten once every layer landed (not one by one), and verify.
        spec_kwargs = dict(num_layers=NUM_LAYERS, num_kv_heads=4, head_dim=8, block_size=4,
                           dtype="bfloat16", layout="KHTD")
        _, conn = self.start_producer(spec_kwargs, 2, engine_kwargs={"digests": "full"})
        self.ready(conn)
        self.call(conn, "register", REMOTE_IDS, 1)
        params = self.call(conn, "pin_lw", "req-d", REMOTE_IDS, 30.0)
        self.call(conn, "layers", "req-d", 1)
        spec = KVCacheSpec(**dict(spec_kwargs, layout="KTHD"))
        engine, _, config = self.consumer(spec, 1, digests="full")
        engine.start_read(params, LOCAL_IDS)
        self.poll_until(engine, lambda s: s.layers.get("req-d", 0) >= 1, "layer 0")
        self.call(conn, "layers", "req-d", NUM_LAYERS)
        seen = self.poll_until(engine, lambda s: s.finished or s.failed, "the request")
        self.assertEqual((seen.finished, [f.reason for f in seen.failed]), (["req-d"], []))
        g = tt.global_cache(KVCacheSpec(**spec_kwargs), len(REMOTE_IDS) * 4, seed=G_SEED)
        self.check_cache(engine.caches[0], config, g, LOCAL_IDS)
        self.assertGreater(engine.stats.digest_verified, 0)
        self.assertEqual(engine.stats.digest_mismatches, 0)

    def test_subscribed_late_gets_current_layers(self):
        # The consumer starts after two of three layers were published: it reads both at
        # once (the producer answers the subscription with its current state), then the last.
        spec_kwargs = dict(num_layers=NUM_LAYERS, num_kv_heads=2, head_dim=8, block_size=4,
                           dtype="float32", layout="KHTD")
        _, conn = self.start_producer(spec_kwargs, 1)
        self.ready(conn)
        self.call(conn, "register", REMOTE_IDS, 0)
        params = self.call(conn, "pin_lw", "req-late", REMOTE_IDS, 30.0)
        self.call(conn, "layers", "req-late", 2)
        spec = KVCacheSpec(**spec_kwargs)
        engine, _, config = self.consumer(spec, 1)
        engine.start_read(params, LOCAL_IDS)
        seen = self.poll_until(engine, lambda s: s.layers.get("req-late", 0) >= 2, "2 layers")
        self.assertEqual(seen.finished, [])
        self.call(conn, "layers", "req-late", NUM_LAYERS)
        seen = self.poll_until(engine, lambda s: s.finished or s.failed, "the request")
        self.assertEqual((seen.finished, seen.failed), (["req-late"], []))
        g = tt.global_cache(spec, len(REMOTE_IDS) * 4, seed=G_SEED)
        self.check_cache(engine.caches[0], config, g, LOCAL_IDS)


class LayerPlanTest(parameterized.TestCase):
    """Per-layer plans are a partition of the whole request's bytes."""

    @parameterized.parameters(("LKHTD", 2, 1), ("KTHD", 1, 2), ("HTD", 2, 4))
    def test_layer_plans_cover_the_request(self, layout, p_tp, d_tp):
        from jaxkv import EngineConfig

        spec = KVCacheSpec(num_layers=4, num_kv_heads=4, head_dim=8, block_size=4,
                           dtype="bfloat16", layout=layout)
        local = tt.fake_metadata("decode", EngineConfig(spec, d_tp), 16)
        remote = tt.fake_metadata("prefill", EngineConfig(spec, p_tp), 16)
        for rank in range(d_tp):
            whole = plan_read(local, rank, remote, LOCAL_IDS, REMOTE_IDS)
            parts = [plan_read(local, rank, remote, LOCAL_IDS, REMOTE_IDS, layers=(i, i + 1))
                     for i in range(4)]
            self.assertEqual(sum(p.num_bytes for p in parts), whole.num_bytes)
            a, b = tt.NumpyEngine(EngineConfig(spec, d_tp), 16), tt.NumpyEngine(
                EngineConfig(spec, d_tp), 16)
            src = tt.NumpyEngine(EngineConfig(spec, p_tp), 16, seed=5)
            tt.apply_plan(whole, a, src)
            for part in parts:
                tt.apply_plan(part, b, src)
            for x, y in zip(a.buffers[rank], b.buffers[rank]):
                np.testing.assert_array_equal(x, y)


def tt_result():
    from jaxkv.transfer import PollResult

    return PollResult()


if __name__ == "__main__":
    absltest.main()
