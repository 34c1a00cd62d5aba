"""A producer that re-registers its cache: peers never read the old regions as good data."""

from __future__ import annotations

import os

os.environ.setdefault("UCX_TLS", "tcp,sm,self")

from support import platforms  # noqa: E402

platforms.force_cpu_devices()

import pytest  # noqa: E402
from absl.testing import absltest  # noqa: E402
from support import transfer as tt  # noqa: E402

from jaxkv import KVCacheSpec  # noqa: E402
from jaxkv.transfer import nixl_available  # noqa: E402

REMOTE_IDS, LOCAL_IDS = tt.REMOTE_IDS, tt.LOCAL_IDS
OTHER_IDS = [11, 12, 13, 14, 15, 0]  # where the re-registered cache holds the request
SPEC = dict(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32",
            layout="KHTD")


@pytest.mark.skipif(not nixl_available(), reason="NIXL (nixl-cu13) is not installed")
class ReregisterTest(tt.TransferTestBase):
    def setUp(self):
        super().setUp()
        _, self.conn = self.start_producer(SPEC, 1)
        self.ready(self.conn)
        self.spec = KVCacheSpec(**SPEC)
        self.g = tt.global_cache(self.spec, len(REMOTE_IDS) * 4, seed=tt.G_SEED)

    def read(self, engine, params, request_id):
        engine.start_read(params, LOCAL_IDS)
        return self.wait(engine, [request_id])

    def test_second_request_after_reregistration_is_bit_exact(self):
        self.call(self.conn, "register", REMOTE_IDS)
        engine, cache, config = self.consumer(self.spec, 1)
        params = self.call(self.conn, "pin", "req-1", REMOTE_IDS, 30.0)
        self.assertEqual(self.read(engine, params, "req-1"), (["req-1"], []))
        self.check_cache(cache, config, self.g, LOCAL_IDS)
        # posted from descriptor lists prepared for this generation of the producer
        self.assertEqual((engine.agent.prepped_reads, engine.agent.num_prepped), (1, 1))
        registrations = self.assert_freed(self.conn, "req-1")[3]
        # New buffers; the request's tokens now live in other blocks (the old buffers'
        # OTHER_IDS blocks hold random bytes: a stale read cannot pass the check).
        self.call(self.conn, "register", OTHER_IDS)
        params2 = self.call(self.conn, "pin", "req-2", OTHER_IDS, 30.0)
        self.assertNotEqual(params2.generation, params.generation)
        self.assertEqual(self.read(engine, params2, "req-2"), (["req-2"], []))
        self.check_cache(cache, config, self.g, LOCAL_IDS)
        # new lists for the new generation; the old generation's were released with the
        # re-handshake (not reused: the bytes above come from the new buffers)
        self.assertEqual((engine.agent.prepped_reads, engine.agent.num_prepped), (2, 1))
        state = self.call(self.conn, "state")
        self.assertEqual(state[3], registrations)  # the old buffers were deregistered

    def test_read_planned_before_reregistration_fails_cleanly(self):
        address = self.call(self.conn, "register", REMOTE_IDS)
        engine, cache, config = self.consumer(self.spec, 1)
        engine.add_peer("prefill", [address])
        old = self.call(self.conn, "pin", "req-a", REMOTE_IDS, 30.0)
        self.call(self.conn, "register", OTHER_IDS)  # after the consumer fetched the metadata
        # Params of an older generation (what a router may still hold): the consumer's cached
        # metadata agrees with them, so it reads the regions it knows.
        finished, failed = self.read(engine, old, "req-a")
        self.assertEqual(finished, [])
        self.assertEqual(len(failed), 1)
        self.assertEqual(failed[0].invalid_block_ids, tuple(sorted(LOCAL_IDS)))
        # The next read (params naming no generation) fetches the metadata again.
        fresh = self.call(self.conn, "pin", "req-b", OTHER_IDS, 30.0)
        fresh = fresh.__class__(
            **{**{f: getattr(fresh, f) for f in fresh.__struct_fields__}, "generation": -1}
        )
        self.assertEqual(self.read(engine, fresh, "req-b"), (["req-b"], []))
        self.check_cache(cache, config, self.g, LOCAL_IDS)


if __name__ == "__main__":
    absltest.main()
