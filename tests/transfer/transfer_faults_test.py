"""Request life cycle and faults over real NIXL: leases, aborts, dead peers, refused input,
and a long loop without leaks."""

from __future__ import annotations

import os

os.environ.setdefault("UCX_TLS", "tcp,sm,self")

import ctypes  # noqa: E402
import resource  # noqa: E402
import time  # noqa: E402

from support import bits, platforms  # noqa: E402

platforms.force_cpu_devices()

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from absl.testing import absltest  # noqa: E402
from support import transfer as e2e  # noqa: E402
from support import transfer as tt  # noqa: E402

from jaxkv import KVCacheSpec  # noqa: E402
from jaxkv.transfer import HandshakeError, IncompatibleEngineError, nixl_available  # noqa: E402

SPEC_KWARGS = dict(
    num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32", layout="LKHTD"
)
SPEC = KVCacheSpec(**SPEC_KWARGS)


@pytest.mark.skipif(not nixl_available(), reason="NIXL (nixl-cu13) is not installed")
class FaultTest(e2e.TransferTestBase):
    def producer(self, **engine_kwargs):
        process, conn = self.start_producer(SPEC_KWARGS, 1, engine_kwargs=engine_kwargs)
        address = self.ready(conn)[1]
        self.call(conn, "register", e2e.REMOTE_IDS)
        return process, conn, address

    def wait_freed(self, conn, timeout=e2e.WAIT_S):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for engine in self._engines:  # engines poll continuously in a server
                engine.poll()
            state = self.call(conn, "state")
            if state[1]:
                return state
            time.sleep(0.01)
        raise TimeoutError("nothing freed")

    def test_consumer_that_never_notifies_is_freed_at_lease_expiry(self):
        _, conn, _ = self.producer()
        start = time.monotonic()
        self.call(conn, "pin", "lonely", e2e.REMOTE_IDS, 0.3)
        pinned, freed, summary, _ = self.wait_freed(conn)
        self.assertGreaterEqual(time.monotonic() - start, 0.3)
        self.assertEqual((pinned, freed, summary["expired_leases"]), (0, ["lonely"], 1))

    def test_read_confirmed_after_lease_expiry_is_a_failure(self):
        # no background progress: a paused producer answers nothing
        _, conn, _ = self.producer(progress_interval_s=None)
        params = self.call(conn, "pin", "late", e2e.REMOTE_IDS, 0.3)
        engine, cache, _ = self.consumer(SPEC, 1, read_timeout_s=10.0)
        engine.add_peer("prefill", params.addresses)
        conn.send(("pause", 0.8))  # the producer does not poll: no acks, lease runs out
        engine.start_read(params, e2e.LOCAL_IDS)
        finished, failed = self.wait(engine, ["late"])
        self.assertTrue(conn.poll(10) and conn.recv())
        self.assertEqual(finished, [])
        self.assertIn("released the blocks", failed[0].reason)
        self.assertEqual(failed[0].invalid_block_ids, tuple(sorted(e2e.LOCAL_IDS)))
        del cache

    def test_heartbeats_keep_a_slow_read_alive(self):
        _, conn, _ = self.producer()
        params = self.call(conn, "pin", "slow", e2e.REMOTE_IDS, 0.6)
        engine, _, _ = self.consumer(SPEC, 1, progress_interval_s=None)  # only we confirm
        engine.start_read(params, e2e.LOCAL_IDS)
        # Heartbeats every lease/3 while we wait well past the lease before confirming.
        deadline = time.monotonic() + 1.5
        state = engine._reading["slow"]  # noqa: SLF001 - hold the confirmation back
        while time.monotonic() < deadline:
            engine._heartbeat(state, time.monotonic())  # noqa: SLF001
            engine.agent.notifications()  # progress the worker (no acks are due yet)
            time.sleep(0.1)
        finished, failed = self.wait(engine, ["slow"])
        self.assertEqual((finished, failed), (["slow"], []))

    def test_producer_killed(self):
        process, conn, _ = self.producer()
        params = self.call(conn, "pin", "doomed", e2e.REMOTE_IDS, 30.0)
        engine, _, _ = self.consumer(SPEC, 1, read_timeout_s=1.5)
        engine.add_peer("prefill", params.addresses)
        conn.send(("pause", 5.0))
        engine.start_read(params, e2e.LOCAL_IDS)
        process.kill()
        start = time.monotonic()
        finished, failed = self.wait(engine, ["doomed"], timeout=10)
        self.assertLess(time.monotonic() - start, 3.0)
        self.assertEqual(finished, [])
        self.assertEqual(failed[0].invalid_block_ids, tuple(sorted(e2e.LOCAL_IDS)))
        self.assertEqual(engine.stats.failed_transfers, 1)
        # The consumer keeps serving: another producer, another request.
        _, conn2, _ = self.producer()
        params2 = self.call(conn2, "pin", "next", e2e.REMOTE_IDS, 30.0)
        engine.start_read(params2, [0, 1, 2, 3, 4, 5])
        finished, failed = self.wait(engine, ["next"])
        self.assertEqual((finished, failed), (["next"], []))

    def test_producer_killed_mid_transfer(self):
        # An 80 MiB read (10 blocks of 8 MiB). UCX over tcp only: the bytes flow only while
        # both sides progress, so they land block by block during this process's polls. The
        # producer is killed right after a poll that left some blocks landed and the last not,
        # i.e. truly mid-transfer (at most a few MiB of socket buffers are still on the way).
        old_tls = os.environ.get("UCX_TLS")
        os.environ["UCX_TLS"] = "tcp"  # read by the agents created below and the children
        self.addCleanup(_restore_env, "UCX_TLS", old_tls)
        big = dict(SPEC_KWARGS, head_dim=128, block_size=2048)
        spec = KVCacheSpec(**big)
        ids = list(range(10))
        process, conn = self.start_producer(big, 1, num_tokens=len(ids) * 2048)
        self.ready(conn)
        self.call(conn, "register", ids)
        params = self.call(conn, "pin", "huge", ids, 30.0)
        engine, cache, config = self.consumer(spec, 1, read_timeout_s=3.0,
                                              progress_interval_s=None)
        engine.add_peer("prefill", params.addresses)
        local = [i + 6 for i in ids]
        regions = engine.metadata.rank_info(0).regions
        self.assertEqual(spec.cache_nbytes(len(ids)), 80 << 20)

        def landed(block):  # the block's last bytes in the last region are no longer zero
            r = regions[-1]
            tail = ctypes.string_at(r.base_address + (block + 1) * r.block_len - 256, 256)
            return tail != bytes(256)

        self.assertFalse(any(landed(b) for b in local))
        engine.start_read(params, local)
        deadline = time.monotonic() + 10
        arrived = 0
        while time.monotonic() < deadline:
            result = engine.poll()
            self.assertEqual((result.finished, result.failed), ([], []))
            arrived = sum(landed(b) for b in local)
            if arrived:
                break
        self.assertFalse(landed(local[-1]), "the read completed before the kill")
        process.kill()
        process.join(timeout=10)
        start = time.monotonic()
        finished, failed = self.wait(engine, ["huge"], timeout=10)
        self.assertLess(time.monotonic() - start, 3.0 + 1.5)  # within read_timeout_s
        self.assertGreaterEqual(arrived, 1)
        self.assertEqual(finished, [])
        self.assertEqual(failed[0].invalid_block_ids, tuple(local))
        self.assertFalse(landed(local[-1]))  # never completed
        self.assertEqual(engine.stats.failed_transfers, 1)
        self.assertEqual(engine.num_reading, 0)
        # The consumer keeps serving: a new producer, a new request, bit-exact.
        _, conn2 = self.start_producer(big, 1, num_tokens=2 * 2048)
        self.ready(conn2)
        self.call(conn2, "register", [3, 4])
        params2 = self.call(conn2, "pin", "after", [3, 4], 30.0)
        engine.start_read(params2, [0, 1])
        self.assertEqual(self.wait(engine, ["after"]), (["after"], []))
        g = tt.global_cache(spec, 2 * 2048, seed=e2e.G_SEED)
        want = tt.expected_arrays(config, 0, g, [0, 1])
        for index, (array, expected) in enumerate(zip(cache.arrays, want)):
            got = bits.bits(np.asarray(array))
            np.testing.assert_array_equal(got[[0, 1]], expected, err_msg=f"array {index}")

    def test_remote_ids_out_of_range_refused_before_posting(self):
        _, conn, _ = self.producer()
        params = self.call(conn, "pin", "bad", [3, 4, e2e.NUM_BLOCKS], 30.0)
        engine, _, _ = self.consumer(SPEC, 1)
        engine.start_read(params, [1, 2, 3])
        self.assertEqual(engine._reading["bad"].handles, [])  # noqa: SLF001 - nothing posted
        finished, failed = self.wait(engine, ["bad"], timeout=5)
        self.assertEqual(finished, [])
        self.assertIn("outside the 16 blocks registered by remote rank 0", failed[0].reason)
        self.assertEqual(failed[0].invalid_block_ids, (1, 2, 3))
        _, freed, _, _ = self.wait_freed(conn)  # the failed consumer notified: freed early
        self.assertEqual(freed, ["bad"])

    def test_abort_on_producer(self):
        _, conn, _ = self.producer()
        params = self.call(conn, "pin", "gone", e2e.REMOTE_IDS, 30.0)
        self.call(conn, "abort", "gone")
        _, freed, summary, _ = self.wait_freed(conn)
        self.assertEqual((freed, summary["expired_leases"]), (["gone"], 0))
        engine, _, _ = self.consumer(SPEC, 1)
        engine.start_read(params, e2e.LOCAL_IDS)
        finished, failed = self.wait(engine, ["gone"])
        self.assertEqual(finished, [])
        self.assertIn("released", failed[0].reason)

    def test_abort_on_consumer(self):
        _, conn, _ = self.producer()
        params = self.call(conn, "pin", "stop", e2e.REMOTE_IDS, 30.0)
        engine, _, _ = self.consumer(SPEC, 1)
        engine.start_read(params, e2e.LOCAL_IDS)
        engine.abort_request("stop")
        finished, failed = self.wait(engine, ["stop"])
        self.assertEqual((finished, failed[0].reason), ([], "aborted"))
        self.assertEqual(self.wait_freed(conn)[1], ["stop"])

    def test_handshake_refusals(self):
        _, conn, address = self.producer()
        engine, _, _ = self.consumer(SPEC.replace(head_dim=16), 1)
        with self.assertRaisesRegex(IncompatibleEngineError, "head_dim: local 16, remote 8"):
            engine.add_peer("prefill", [address])
        with self.assertRaisesRegex(HandshakeError, "wrong engine"):
            engine.add_peer("someone-else", [address])
        self.assertEqual(engine.agent.remote_agents, frozenset())  # nothing loaded
        self.assertEqual(engine.stats.failed_handshakes, 2)
        params = self.call(conn, "pin", "r", e2e.REMOTE_IDS, 30.0)
        engine.start_read(params, e2e.LOCAL_IDS)  # lazily: fails the request, not the caller
        _, failed = self.wait(engine, ["r"], timeout=5)
        self.assertIn("IncompatibleEngineError", failed[0].reason)

    def test_block_hashing_must_agree_when_both_declare_it(self):
        _, _, address = self.producer(block_hashing="sha256_cbor:seed=ab12")
        engine, _, _ = self.consumer(SPEC, 1, block_hashing="sha256:seed=ab12")
        self.assertEqual(engine.metadata.block_hashing, "sha256:seed=ab12")
        with self.assertRaisesRegex(
            IncompatibleEngineError,
            "block hashing differs: 'prefill' uses 'sha256_cbor:seed=ab12', 'decode' uses "
            "'sha256:seed=ab12'; prefix hits and KV events would never match",
        ):
            engine.add_peer("prefill", [address])
        same, _, _ = self.consumer(SPEC, 1, block_hashing="sha256_cbor:seed=ab12")
        self.assertEqual(same.add_peer("prefill", [address]).block_hashing,
                         "sha256_cbor:seed=ab12")
        undeclared, _, _ = self.consumer(SPEC, 1)  # one side silent: nothing to compare
        undeclared.add_peer("prefill", [address])

    def test_partial_prefix_and_notify_only(self):
        _, conn, _ = self.producer()
        params = self.call(conn, "pin", "tail", e2e.REMOTE_IDS, 30.0)
        engine, cache, config = self.consumer(SPEC, 1)
        engine.start_read(params, [12, 13])  # 4 blocks held locally: read the last 2
        self.assertEqual(self.wait(engine, ["tail"])[0], ["tail"])
        g = tt.global_cache(SPEC, len(e2e.REMOTE_IDS) * 4, seed=e2e.G_SEED)
        self.check_cache(cache, config, g, [12, 13], first_token=4 * 4)
        params = self.call(conn, "pin", "all-hit", e2e.REMOTE_IDS, 30.0)
        engine.start_read(params, [])  # notify only
        self.assertEqual(self.wait(engine, ["all-hit"])[0], ["all-hit"])
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and len(self.call(conn, "state")[1]) < 2:
            time.sleep(0.01)
        self.assertEqual(sorted(self.call(conn, "state")[1]), ["all-hit", "tail"])

    def test_thousand_requests_no_leaks(self):
        self._loop(int(os.environ.get("JAXKV_TRANSFER_LOOP", "1000")))

    def _loop(self, count):
        _, conn, _ = self.producer()
        engine, _, _ = self.consumer(SPEC, 1)
        registrations = engine.agent.num_registrations
        rss = []
        rng = np.random.default_rng(0)
        for i in range(count):
            ids = rng.permutation(e2e.NUM_BLOCKS)[:4].tolist()
            params = self.call(conn, "pin", f"r{i}", ids, 30.0)
            engine.start_read(params, rng.permutation(e2e.NUM_BLOCKS)[:4].tolist())
            finished, failed = self.wait(engine, [f"r{i}"])
            self.assertEqual((finished, failed), ([f"r{i}"], []))
            if i in (count // 4, count - 1):
                rss.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            pinned, freed, summary, producer_regs = self.call(conn, "state")
            if len(freed) == count:
                break
        self.assertEqual((pinned, len(freed), summary["expired_leases"]), (0, count, 0))
        self.assertEqual(engine.num_reading, 0)
        self.assertEqual(engine.agent.num_registrations, registrations)
        self.assertEqual(len(engine.agent.remote_agents), 1)
        self.assertEqual(len(engine.stats.records), count)
        self.assertLess(rss[-1] - rss[0], 20 * 1024)  # KiB: flat after warm-up
        del producer_regs


def _restore_env(name, value):
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


if __name__ == "__main__":
    absltest.main()
