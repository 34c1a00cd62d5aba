"""Multi-controller engines (``jax.distributed``, real processes on localhost, gloo on CPU) on
both sides of a transfer, bit exact against the global cache."""

from __future__ import annotations

import os

os.environ.setdefault("UCX_TLS", "tcp,sm,self")

import time  # noqa: E402

from support import bits, platforms  # noqa: E402

platforms.force_cpu_devices()

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from absl.testing import absltest  # noqa: E402
from support import multicontroller as mt  # noqa: E402
from support import transfer as tt  # noqa: E402

from jaxkv import EngineConfig, KVCacheSpec  # noqa: E402
from jaxkv.transfer import nixl_available  # noqa: E402

NUM_BLOCKS, REMOTE_IDS, LOCAL_IDS = tt.NUM_BLOCKS, tt.REMOTE_IDS, tt.LOCAL_IDS
SPEC = dict(num_layers=4, num_kv_heads=4, head_dim=8, block_size=4, dtype="bfloat16",
            layout="KHTD")


@pytest.mark.skipif(not nixl_available(), reason="NIXL (nixl-cu13) is not installed")
class MultiControllerTest(tt.TransferTestBase):
    """Group A: 2 processes x 2 CPU devices (a 4-device global mesh); group B: 2 processes x
    1 device. Both are shared by the tests of the class."""

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.group_a = mt.Group(2, devices=2)
        cls.group_b = mt.Group(2, devices=1)

    @classmethod
    def tearDownClass(cls):
        cls.group_a.close()
        cls.group_b.close()
        super().tearDownClass()

    def _g(self, spec_kwargs=SPEC):
        spec = KVCacheSpec(**spec_kwargs)
        return tt.global_cache(spec, len(REMOTE_IDS) * spec.block_size, tt.G_SEED)

    def test_cache_over_a_global_mesh(self):
        # from_arrays, wrap, copy, gather and scatter over a 4-device mesh of 2 processes:
        # each process checks its own shards bit for bit (random bits, NaN payloads included).
        for layout in ("KHTD", "LKTHD"):
            answers = self.group_a.call("cache_ops", dict(SPEC, layout=layout, dtype="float32"))
            self.assertEqual([a["problems"] for a in answers], [[], []])
            self.assertEqual([a["tp_ranks"] for a in answers], [[0, 1], [2, 3]])
            self.assertEqual([a["processes"] for a in answers], [[0], [1]])

    def test_tp4_over_two_processes_to_tp1_and_tp2(self):
        group = self.group_a
        answers = group.call("producer", "p-tp4", SPEC, 4, 1, REMOTE_IDS)
        # Each process registered only its addressable shards, with their global TP ranks.
        (address0, ranks0, shards0), (address1, ranks1, shards1) = answers
        self.assertEqual(address0, address1)
        self.assertEqual((ranks0, ranks1), ((0, 1), (2, 3)))
        self.assertEqual({s[:3] for s in shards0}, {(0, 0, 1), (1, 1, 2)})
        self.assertEqual({s[:3] for s in shards1}, {(2, 2, 3), (3, 3, 4)})
        self.assertEqual({s[3] for s in shards0} | {s[3] + 10 for s in shards1}, {0, 11})
        spec = KVCacheSpec(**SPEC)
        g = self._g()
        generations: set[int] = set()
        for again, tp in ((False, 1), (False, 2), (True, 1)):
            request_id = f"tp4-to-tp{tp}" + ("-again" if again else "")
            # Process 0 (the scheduler) gets the block ids and broadcasts them.
            params = group.publish("p-tp4", request_id, REMOTE_IDS, 30.0)
            self.assertEqual([tuple(a) for a in params.addresses], [tuple(address0)])
            if again:  # the engine re-registered: a new generation, one in every process
                self.assertNotIn(params.generation, generations)
            generations.add(params.generation)
            engine, cache, config = self.consumer(spec.replace(layout="THD"), tp)
            meta = engine.add_peer(params.engine_id, params.addresses)
            self.assertEqual(([r.rank for r in meta.ranks], len(meta.agents)), ([0, 1, 2, 3], 2))
            self.assertEqual(meta.generation, params.generation)
            engine.start_read(params, LOCAL_IDS)
            finished, failed = self.wait(engine, [request_id])
            self.assertEqual((finished, failed), ([request_id], []))
            self.check_cache(engine.caches[0], config, g, LOCAL_IDS)
            freed, _ = group.wait_level("p-tp4", "freeable", request_id)
            self.assertEqual(freed, [request_id])
            if tp == 2:  # re-register (every process) before the third read
                (merged0, own0), (merged1, own1) = group.call("reregister", "p-tp4")
                self.assertEqual((merged0, own0, own1), (merged1, merged1, merged1))
        expected = ["tp4-to-tp1", "tp4-to-tp1-again", "tp4-to-tp2"]
        outcomes = group.call("outcomes", "p-tp4")
        for local, _, pinned in outcomes:
            self.assertEqual(sorted(local["freeable"]), expected)
            self.assertEqual(pinned, 0)
        self.assertEqual(sorted(outcomes[0][1]["published"]), expected)

    def test_pipeline_stages_in_different_processes(self):
        group = self.group_a
        answers = group.call("producer", "p-pp2", SPEC, 2, 2, REMOTE_IDS)
        self.assertEqual((answers[0][1], answers[1][1]), ((0, 1), (2, 3)))
        params = group.publish("p-pp2", "pp2", REMOTE_IDS, 30.0)
        spec = KVCacheSpec(**SPEC)
        engine, cache, config = self.consumer(spec.replace(layout="LKHTD"), 1)
        engine.start_read(params, LOCAL_IDS)
        finished, failed = self.wait(engine, ["pp2"])
        self.assertEqual((finished, failed), (["pp2"], []))
        self.check_cache(engine.caches[0], config, self._g(), LOCAL_IDS)
        freed, _ = group.wait_level("p-pp2", "freeable", "pp2")
        self.assertEqual(freed, ["pp2"])

    def test_publish_from_a_jitted_step_in_every_process(self):
        group = self.group_a
        # The request's blocks hold scrambled bytes until the jitted step writes them.
        group.call("producer", "p-jit", SPEC, 4, 1, REMOTE_IDS, True)
        params = group.publish("p-jit", "jit-1", REMOTE_IDS, 30.0, command="jit_publish")
        self.assertTrue(params.layerwise)
        # Every device's callback ran; each process announced its own ranks.
        self.assertEqual(group.call("statuses", "p-jit"), [[1, 1], [1, 1]])
        published, _ = group.wait_level("p-jit", "published", "jit-1")
        self.assertEqual(published, ["jit-1"])
        spec = KVCacheSpec(**SPEC)
        engine, cache, config = self.consumer(spec, 2)
        engine.start_read(params, LOCAL_IDS)
        finished, failed = self.wait(engine, ["jit-1"])
        self.assertEqual((finished, failed), (["jit-1"], []))
        self.check_cache(engine.caches[0], config, self._g(), LOCAL_IDS)
        freed, _ = group.wait_level("p-jit", "freeable", "jit-1")
        self.assertEqual(freed, ["jit-1"])

    def test_abort_in_one_producer_process_aborts_everywhere(self):
        group = self.group_a
        group.call("producer", "p-abort", SPEC, 4, 1, REMOTE_IDS)
        params = group.publish("p-abort", "ab-1", REMOTE_IDS, 30.0)
        group.call("abort", "p-abort", "ab-1", only=1)
        freed, _ = group.wait_level("p-abort", "freeable", "ab-1")
        self.assertEqual(freed, ["ab-1"])
        for local, _, pinned in group.call("outcomes", "p-abort"):
            self.assertEqual((local["freeable"], pinned), (["ab-1"], 0))
        engine, cache, config = self.consumer(KVCacheSpec(**SPEC), 1)
        engine.start_read(params, LOCAL_IDS)
        finished, failed = self.wait(engine, ["ab-1"])
        self.assertEqual((finished, [f.invalid_block_ids for f in failed]),
                         ([], [tuple(sorted(LOCAL_IDS))]))

    def test_a_read_failing_in_one_consumer_process_fails_everywhere(self):
        # The producer (this test's child process) does not poll for a while: the reads stay
        # unconfirmed. Consumer process 1 aborts its part: process 0 is aborted as well and
        # reports the read failed once both ended, with the invalid blocks.
        _, conn = self.start_producer(SPEC, 2, engine_kwargs=dict(progress_interval_s=None))
        self.ready(conn)
        self.call(conn, "register", REMOTE_IDS)
        params = self.call(conn, "pin", "r-fail", REMOTE_IDS, 30.0)
        conn.send(("pause", 6.0))
        group = self.group_b
        group.call("consumer", "c-fail", dict(SPEC, layout="THD"), 2)
        group.call("read", "c-fail", params, LOCAL_IDS, 30.0)
        group.call("abort", "c-fail", "r-fail", only=1)
        failed, level = group.wait_level("c-fail", "failed", "r-fail", timeout=20.0)
        self.assertEqual([f.invalid_block_ids for f in failed], [tuple(sorted(LOCAL_IDS))])
        self.assertIn("process 1: aborted", failed[0].reason)  # and process 0's reason
        self.assertEqual(level["finished"], [])
        for local, _, _ in group.call("outcomes", "c-fail"):
            self.assertEqual([f.request_id for f in local["failed"]], ["r-fail"])
        self.assertTrue(conn.poll(tt.WAIT_S))
        self.assertTrue(conn.recv())  # the producer polls again
        self.assert_freed(conn, "r-fail")

    def test_two_processes_to_two_processes(self):
        # Both sides multi-controller: TP 4 over group A (2 x 2 devices) -> TP 2 over group B
        # (2 x 1 device), KHTD -> THD.
        self.group_a.call("producer", "p-both", SPEC, 4, 1, REMOTE_IDS)
        params = self.group_a.publish("p-both", "both", REMOTE_IDS, 30.0)
        consumer_spec = dict(SPEC, layout="THD")
        self.group_b.call("consumer", "c-both", consumer_spec, 2)
        self.group_b.call("read", "c-both", params, LOCAL_IDS, 30.0)
        finished, level = self.group_b.wait_level("c-both", "finished", "both")
        self.assertEqual((finished, level["failed"]), (["both"], []))
        freed, _ = self.group_a.wait_level("p-both", "freeable", "both")
        self.assertEqual(freed, ["both"])
        self.check_group_cache(self.group_b, "c-both", consumer_spec, 2)

    def test_host_staging_on_both_sides(self):
        # The TPU path (NIXL cannot register TPU memory): each process mirrors its own shards
        # in host memory, stages its part out (producer) or in (consumer).
        staged = {"host_staging": True}
        self.group_a.call("producer", "p-staged", SPEC, 4, 1, REMOTE_IDS, False, staged)
        params = self.group_a.publish("p-staged", "staged", REMOTE_IDS, 30.0)
        consumer_spec = dict(SPEC, layout="THD")
        self.group_b.call("consumer", "c-staged", consumer_spec, 2, staged)
        self.group_b.call("read", "c-staged", params, LOCAL_IDS, 30.0)
        finished, level = self.group_b.wait_level("c-staged", "finished", "staged")
        self.assertEqual((finished, level["failed"]), (["staged"], []))
        freed, _ = self.group_a.wait_level("p-staged", "freeable", "staged")
        self.assertEqual(freed, ["staged"])
        self.check_group_cache(self.group_b, "c-staged", consumer_spec, 2)

    def test_consumer_waits_inside_a_jitted_step_in_every_process(self):
        # The producer does not poll for a while: the waits inside the consumer's step
        # really wait, each device for its own process's part.
        _, conn = self.start_producer(SPEC, 2, engine_kwargs=dict(progress_interval_s=None))
        self.ready(conn)
        self.call(conn, "register", REMOTE_IDS)
        params = self.call(conn, "pin", "in-jit", REMOTE_IDS, 30.0)
        conn.send(("pause", 1.0))
        group = self.group_b
        group.call("consumer", "c-jit", SPEC, 2)  # same layout: nothing to rewrite after
        answers = group.call("jit_wait", "c-jit", params, LOCAL_IDS, 30.0)
        self.assertEqual(answers, [([[LOCAL_IDS]], [1]), ([[LOCAL_IDS]], [1])])  # per device
        finished, _ = group.wait_level("c-jit", "finished", "in-jit")
        self.assertEqual(finished, ["in-jit"])
        self.assertTrue(conn.poll(tt.WAIT_S))
        self.assertTrue(conn.recv())
        self.assert_freed(conn, "in-jit")
        self.check_group_cache(group, "c-jit", SPEC, 2)

    def check_group_cache(self, group, name, spec_kwargs, tp):
        """Assembles a consumer group's global cache from its processes' shards; compares it
        with G (the request's blocks) and zeros (every other block)."""
        spec = KVCacheSpec(**spec_kwargs)
        config = EngineConfig(spec, tp)
        local_spec = config.local_spec(0)
        arrays = [np.zeros(local_spec.array_shape(NUM_BLOCKS, 1), local_spec.dtype)
                  for _ in range(local_spec.num_arrays)]
        for shards in group.call("shards", name):
            for index, where, data in shards:
                arrays[index][where] = data
        expected = tt.expected_arrays(config, 0, self._g(), LOCAL_IDS)
        others = np.setdiff1d(np.arange(NUM_BLOCKS), LOCAL_IDS)
        for index, (array, want) in enumerate(zip(arrays, expected)):
            got = bits.bits(array)
            np.testing.assert_array_equal(got[LOCAL_IDS], want, err_msg=f"array {index}")
            self.assertFalse(got[others].any(), f"array {index}: other blocks changed")

    def test_keyed_engine_of_two_processes(self):
        # A deployment key on every process: process 0 serves the merged metadata keyed, each
        # process's control connections are keyed; a keyless consumer is refused, naming it.
        group = self.group_a
        key = b"multi-controller-deployment-key!"
        group.call("producer", "p-keyed", SPEC, 4, 1, REMOTE_IDS, False, {"auth_key": key})
        params = group.publish("p-keyed", "keyed", REMOTE_IDS, 30.0)
        spec = KVCacheSpec(**SPEC)
        plain, _, _ = self.consumer(spec, 1)
        plain.start_read(params, LOCAL_IDS, read_id="plain-read")
        _, failed = self.wait(plain, ["plain-read"])
        self.assertRegex(failed[0].reason, "requires the deployment key")
        engine, cache, config = self.consumer(spec.replace(layout="THD"), 2, auth_key=key)
        engine.start_read(params, LOCAL_IDS)
        finished, failed = self.wait(engine, ["keyed"])
        self.assertEqual((finished, failed), (["keyed"], []))
        self.check_cache(cache, config, self._g(), LOCAL_IDS)
        freed, _ = group.wait_level("p-keyed", "freeable", "keyed")
        self.assertEqual(freed, ["keyed"])

    def test_one_process_to_two_processes(self):
        # The reverse direction: a TP 2 producer in this process, a TP 2 consumer engine of
        # two processes x one device; process 0 reports the read once both finished.
        _, conn = self.start_producer(SPEC, 2)
        self.ready(conn)
        self.call(conn, "register", REMOTE_IDS)
        params = self.call(conn, "pin", "to-mc", REMOTE_IDS, 30.0)
        group = self.group_b
        consumer_spec = dict(SPEC, layout="THD")
        group.call("consumer", "c-tp2", consumer_spec, 2)
        group.call("read", "c-tp2", params, LOCAL_IDS, 30.0)
        finished, level = group.wait_level("c-tp2", "finished", "to-mc")
        self.assertEqual((finished, level["failed"]), (["to-mc"], []))
        for local, _, _ in group.call("outcomes", "c-tp2"):
            self.assertEqual(local["finished"], ["to-mc"])
        self.assert_freed(conn, "to-mc")
        self.check_group_cache(group, "c-tp2", consumer_spec, 2)


@pytest.mark.skipif(not nixl_available(), reason="NIXL (nixl-cu13) is not installed")
class KilledProducerProcessTest(tt.TransferTestBase):
    def test_producer_process_killed_mid_transfer(self):
        group = mt.Group(2, devices=1)
        try:
            spec = KVCacheSpec(**SPEC)
            group.call("producer", "p-kill", SPEC, 2, 1, REMOTE_IDS)
            lease = 4.0
            params = group.publish("p-kill", "doomed", REMOTE_IDS, lease)
            # Another request nobody reads: the survivor frees it at its lease's expiry.
            group.publish("p-kill", "orphan", [0, 1], lease)
            orphan_published = time.monotonic()
            engine, cache, config = self.consumer(spec, 1, read_timeout_s=5.0)
            engine.add_peer(params.engine_id, params.addresses)  # both agents known
            group.kill(1)
            start = time.monotonic()
            engine.start_read(params, LOCAL_IDS, timeout_s=5.0)
            finished, failed = self.wait(engine, ["doomed"], timeout=30.0)
            elapsed = time.monotonic() - start
            self.assertEqual(finished, [])
            self.assertEqual([f.request_id for f in failed], ["doomed"])
            self.assertEqual(failed[0].invalid_block_ids, tuple(sorted(LOCAL_IDS)))
            self.assertLess(elapsed, 5.0 + 3.0)
            # The surviving producer process frees its part (at the lease's expiry at the
            # latest: the consumer's failure notice may free it earlier).
            deadline = time.monotonic() + lease + 10.0
            while True:
                local, _, pinned = group.call("outcomes", "p-kill", only=0)[0]
                if len(local["freeable"]) == 2 or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            orphan_freed = time.monotonic()
            self.assertEqual((sorted(local["freeable"]), pinned), (["doomed", "orphan"], 0))
            self.assertEqual(local["freeable"][-1], "orphan")
            self.assertGreater(orphan_freed - orphan_published, lease - 0.5)
        finally:
            group.close()


if __name__ == "__main__":
    absltest.main()
