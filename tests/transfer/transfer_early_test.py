"""What serving frameworks need of the transfer layer, over real NIXL: scheduler-side transfer
params, reads that reach a producer before its workers pinned the request (a scheduler hands
the params out before its worker's next step publishes them), and several consumer requests
reading one producer request (reads keyed by the consumer's own request id)."""

from __future__ import annotations

import os

os.environ.setdefault("UCX_TLS", "tcp,sm,self")

import doctest  # noqa: E402
import time  # noqa: E402

from support import bits, platforms  # noqa: E402

platforms.force_cpu_devices()

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from absl.testing import absltest  # noqa: E402
from support import transfer as e2e  # noqa: E402

from jaxkv import KVCacheSpec  # noqa: E402
from jaxkv.transfer import _engine, make_transfer_params, nixl_available  # noqa: E402

SPEC_KWARGS = dict(
    num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32", layout="LKHTD"
)
SPEC = KVCacheSpec(**SPEC_KWARGS)


class MakeTransferParamsTest(absltest.TestCase):
    def test_docstring_example(self):
        finder = doctest.DocTestFinder()
        runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
        (test,) = finder.find(make_transfer_params, "make_transfer_params", globs=vars(_engine))
        self.assertGreater(len(test.examples), 0)
        self.assertEqual(runner.run(test).failed, 0)

    def test_equals_what_publish_request_returns(self):
        params = make_transfer_params(
            "prefill", [("127.0.0.1", 5600), ("127.0.0.1", 5601)], "r", [3, 4], 12.0,
            generation=7, layerwise=True,
        )
        self.assertEqual(
            params,
            _engine.TransferParams(
                "prefill", [("127.0.0.1", 5600), ("127.0.0.1", 5601)], "r", [3, 4], 12.0, 7, True
            ),
        )

    def test_bad_input_is_named(self):
        cases = [
            (dict(engine_id=""), "engine_id"),
            (dict(request_id=""), "request_id"),
            (dict(addresses=[("h", 0)]), "outside"),
            (dict(addresses=[("h", "80")]), "not an int"),
            (dict(addresses=["h"]), "pairs"),
            (dict(block_ids=[1, -2]), "block_ids"),
            (dict(lease_s=0.0), "lease_s"),
            (dict(num_tokens=9), "go together"),
            (dict(num_tokens=9, block_size=4), "need 3 blocks"),
        ]
        base = dict(engine_id="p", addresses=("h", 1), request_id="r", block_ids=[1, 2])
        for change, message in cases:
            with self.subTest(change=change), self.assertRaisesRegex(ValueError, message):
                make_transfer_params(**{**base, **change})


@pytest.mark.skipif(not nixl_available(), reason="NIXL (nixl-cu13) is not installed")
class EarlyReadTest(e2e.TransferTestBase):
    def producer(self, **engine_kwargs):
        process, conn = self.start_producer(SPEC_KWARGS, 1, engine_kwargs=engine_kwargs)
        address = self.ready(conn)[1]
        self.call(conn, "register", e2e.REMOTE_IDS)
        return process, conn, address

    def poll_for(self, engine, seconds):
        """Polls the consumer for `seconds`; returns what finished or failed meanwhile."""
        deadline = time.monotonic() + seconds
        over = []
        while time.monotonic() < deadline:
            result = engine.poll()
            over += result.finished + [f.request_id for f in result.failed]
            time.sleep(0.005)
        return over

    def test_read_before_publish_is_confirmed_once_published(self):
        _, conn, address = self.producer(early_read_grace_s=20.0)
        params = make_transfer_params("prefill", address, "early", e2e.REMOTE_IDS, 30.0)
        engine, cache, config = self.consumer(SPEC, 1, read_timeout_s=30.0)
        engine.start_read(params, e2e.LOCAL_IDS)
        # The READ (and its Done) reach the producer before it pins the request.
        self.assertEqual(self.poll_for(engine, 0.5), [])
        self.assertEqual(self.call(conn, "state")[0], 0)  # nothing pinned yet
        self.call(conn, "pin", "early", e2e.REMOTE_IDS, 30.0)
        finished, failed = self.wait(engine, ["early"])
        self.assertEqual((finished, [f.reason for f in failed]), (["early"], []))
        g = e2e.global_cache(SPEC, len(e2e.REMOTE_IDS) * SPEC.block_size, seed=e2e.G_SEED)
        self.check_cache(cache, config, g, e2e.LOCAL_IDS)
        self.assert_freed(conn, "early")  # every consumer rank confirmed: freed at once
        del cache

    def test_read_never_published_fails_after_the_grace_window(self):
        _, conn, address = self.producer(early_read_grace_s=0.4)
        params = make_transfer_params("prefill", address, "never", e2e.REMOTE_IDS, 30.0)
        engine, _, _ = self.consumer(SPEC, 1, read_timeout_s=30.0)
        start = time.monotonic()
        engine.start_read(params, e2e.LOCAL_IDS)
        finished, failed = self.wait(engine, ["never"])
        elapsed = time.monotonic() - start
        self.assertEqual(finished, [])
        self.assertIn("did not publish the request", failed[0].reason)
        self.assertEqual(failed[0].invalid_block_ids, tuple(sorted(e2e.LOCAL_IDS)))
        self.assertGreaterEqual(elapsed, 0.4)  # held for the window, not refused at once
        self.assertLess(elapsed, 25.0)  # not left to the consumer's read timeout
        # Published after the window: the producer holds no stale confirmation; the lease runs.
        self.call(conn, "pin", "never", e2e.REMOTE_IDS, 0.3)
        self.assert_freed(conn, "never")
        self.assertEqual(self.call(conn, "state")[2]["expired_leases"], 1)

    def test_host_staging_refuses_early_reads_at_once(self):
        # The mirror holds the request's bytes only once published: an early read got stale
        # bytes and must not be confirmed, however long the window.
        _, _, address = self.producer(early_read_grace_s=20.0, host_staging=True)
        params = make_transfer_params("prefill", address, "staged", e2e.REMOTE_IDS, 30.0)
        engine, _, _ = self.consumer(SPEC, 1, read_timeout_s=30.0)
        start = time.monotonic()
        engine.start_read(params, e2e.LOCAL_IDS)
        finished, failed = self.wait(engine, ["staged"])
        self.assertEqual(finished, [])
        self.assertIn("did not publish the request", failed[0].reason)
        self.assertLess(time.monotonic() - start, 15.0)

    def test_grace_zero_refuses_at_once(self):
        _, _, address = self.producer(early_read_grace_s=0.0)
        params = make_transfer_params("prefill", address, "now", e2e.REMOTE_IDS, 30.0)
        engine, _, _ = self.consumer(SPEC, 1, read_timeout_s=30.0)
        engine.start_read(params, e2e.LOCAL_IDS)
        finished, failed = self.wait(engine, ["now"])
        self.assertEqual(finished, [])
        self.assertIn("did not publish the request", failed[0].reason)


@pytest.mark.skipif(not nixl_available(), reason="NIXL (nixl-cu13) is not installed")
class ReadIdTest(e2e.TransferTestBase):
    OTHER_IDS = [0, 1, 2, 3, 4, 5]

    def producer(self):
        process, conn = self.start_producer(SPEC_KWARGS, 1)
        address = self.ready(conn)[1]
        self.call(conn, "register", e2e.REMOTE_IDS)
        return process, conn, address

    def check_both(self, cache, config):
        g = e2e.global_cache(SPEC, len(e2e.REMOTE_IDS) * SPEC.block_size, seed=e2e.G_SEED)
        for ids in (e2e.LOCAL_IDS, self.OTHER_IDS):
            want = e2e.expected_arrays(config, 0, g, ids)
            for index, (array, expected) in enumerate(zip(cache.arrays, want)):
                got = bits.bits(np.asarray(array))
                np.testing.assert_array_equal(got[np.asarray(ids)], expected, f"array {index}")

    def test_two_consumer_requests_read_one_producer_request(self):
        _, conn, _ = self.producer()
        params = self.call(conn, "pin", "shared", e2e.REMOTE_IDS, 30.0, 2)
        engine, cache, config = self.consumer(SPEC, 1)
        engine.start_read(params, e2e.LOCAL_IDS, read_id="decode-a")
        engine.start_read(params, self.OTHER_IDS, read_id="decode-b")
        with self.assertRaisesRegex(ValueError, "already in flight"):
            engine.start_read(params, [15], read_id="decode-a")
        finished, failed = self.wait(engine, ["decode-a", "decode-b"])
        self.assertEqual((sorted(finished), failed), (["decode-a", "decode-b"], []))
        self.check_both(cache, config)
        state = self.assert_freed(conn, "shared")  # once, after both confirmed
        self.assertEqual(state[2]["expired_leases"], 0)

    def test_producer_waits_for_every_expected_read(self):
        _, conn, _ = self.producer()
        params = self.call(conn, "pin", "shared", e2e.REMOTE_IDS, 30.0, 2)
        engine, _, _ = self.consumer(SPEC, 1)
        engine.start_read(params, e2e.LOCAL_IDS, read_id="decode-a")
        self.assertEqual(self.wait(engine, ["decode-a"]), (["decode-a"], []))
        time.sleep(0.3)
        self.assertEqual(self.call(conn, "state")[:2], (1, []))  # still pinned for the other
        engine.start_read(params, self.OTHER_IDS, read_id="decode-b")
        self.assertEqual(self.wait(engine, ["decode-b"]), (["decode-b"], []))
        self.assert_freed(conn, "shared")

    def test_abort_by_read_id_stops_only_that_read(self):
        _, conn, _ = self.producer()
        params = self.call(conn, "pin", "shared", e2e.REMOTE_IDS, 30.0, 2)
        engine, _, _ = self.consumer(SPEC, 1, progress_interval_s=None)
        engine.start_read(params, e2e.LOCAL_IDS, read_id="decode-a")
        engine.start_read(params, self.OTHER_IDS, read_id="decode-b")
        engine.abort_request("decode-a")
        finished, failed = self.wait(engine, ["decode-a", "decode-b"])
        self.assertEqual(finished, ["decode-b"])
        self.assertEqual([(f.request_id, f.reason) for f in failed], [("decode-a", "aborted")])
        self.assertEqual(failed[0].invalid_block_ids, tuple(sorted(e2e.LOCAL_IDS)))
        self.assert_freed(conn, "shared")  # the aborted read notified the producer too


if __name__ == "__main__":
    absltest.main()
