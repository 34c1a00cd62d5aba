"""The JAX transport between two real processes on localhost: a producer process formats a
request with the split formatter and offers it on its `PullServer`; this process pulls it with
`Puller` and concatenates it into its cache. Exact bytes, the pending-pull budget, leases that
expire and free the producer's buffers, a producer killed mid-pull."""

from __future__ import annotations

import os
import time

from support import bits, meshes, platforms, processes

platforms.force_cpu_devices()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from absl.testing import absltest, parameterized  # noqa: E402
from support import transfer as tt  # noqa: E402

from jaxkv import EngineConfig, KVCacheSpec, PagedKVCache  # noqa: E402
from jaxkv.transfer import _formatter as fmt  # noqa: E402
from jaxkv.transfer._jax_transport import (  # noqa: E402
    Puller,
    PullServer,
    PullTimeoutError,
    jax_transfer_available,
    pull_uuid,
)

WAIT_S = 60.0
PRODUCER_DEVICES = 4


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / (1 << 20)


def producer_main(conn) -> None:
    """A producer process: ("setup", spec kwargs, tp, pp, pp_rank, budget) -> its server's
    address (cache filled from G in REMOTE_IDS); ("offer", key, generation, consumer spec
    kwargs, consumer tp, consumer pp, block_ids, lease_s, request_id) -> bytes held or
    ("error", class name, message); ("big", request_id, uuid, nbytes, lease_s) -> offers one
    fresh buffer; ("release", request_id) -> bytes; ("expire",) -> expired request ids;
    ("state",) -> (held bytes, offers, RSS MiB, pooled bytes); ("exit",). Requests are split
    into the server's pooled buffers when it has some of the right shapes."""
    processes.child_env(PRODUCER_DEVICES)
    import jax.numpy as jnp

    server = None
    while True:
        if not conn.poll(0.001):
            continue
        command = conn.recv()
        kind = command[0]
        try:
            if kind == "exit":
                break
            if kind == "setup":
                _, spec_kwargs, tp, pp, pp_rank, budget = command
                p_cfg = EngineConfig(KVCacheSpec(**spec_kwargs), tp, pp)
                g = tt.global_cache(p_cfg.spec, len(tt.REMOTE_IDS) * p_cfg.spec.block_size,
                                    seed=tt.G_SEED)
                arrays = tt.global_arrays(p_cfg, pp_rank, g, tt.REMOTE_IDS, tt.NUM_BLOCKS)
                mesh = meshes.tp(tp)
                cache = PagedKVCache.from_arrays(p_cfg.local_spec(pp_rank), arrays, mesh=mesh)
                ranks = fmt.rank_devices(cache, p_cfg, pp_rank)
                if server is not None:
                    server.close()
                server = PullServer(budget_bytes=budget)
                conn.send(server.address)
            elif kind == "offer":
                _, key, gen, c_kwargs, c_tp, c_pp, block_ids, lease_s, request_id = command
                c_cfg = EngineConfig(KVCacheSpec(**c_kwargs), c_tp, c_pp)
                need = sum(int(np.prod(r.shape)) * p_cfg.spec.itemsize
                           for rank in ranks
                           for r in fmt.send_routes(p_cfg, c_cfg, rank, len(block_ids)))
                server.check_budget(request_id, need)  # refuse before formatting anything
                buffers = fmt.split_request(cache, p_cfg, c_cfg, block_ids, ranks,
                                            staging=server.take)
                items = [(pull_uuid(key, gen, p, c), [b]) for (p, c), b in buffers.items()]
                conn.send(server.offer_many(request_id, items, lease_s))
            elif kind == "big":
                _, request_id, uuid, nbytes, lease_s = command
                big = jnp.full((nbytes,), 7, jnp.uint8).block_until_ready()
                conn.send(server.offer(request_id, uuid, [big], lease_s))
                del big
            elif kind == "release":
                conn.send(server.release(command[1]))
            elif kind == "expire":
                conn.send(server.expire())
            elif kind == "state":
                conn.send((server.held_bytes, server.num_offers, _rss_mb(), server.pooled_bytes))
            else:
                raise ValueError(f"unknown command {kind!r}")
        except Exception as error:  # noqa: BLE001 - reported to the test
            conn.send(("error", type(error).__name__, str(error)))


@pytest.mark.skipif(not jax_transfer_available(), reason="no jax.experimental.transfer")
class JaxPullTest(parameterized.TestCase):
    """One producer process for the whole class (re-set-up per case)."""

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.process, cls.conn = processes.spawn(producer_main)
        cls.puller = Puller()

    @classmethod
    def tearDownClass(cls):
        processes.stop(cls.process, cls.conn, close=False)
        cls.puller.server.close()
        super().tearDownClass()

    def call(self, *command, timeout=WAIT_S):
        self.conn.send(command)
        if not self.conn.poll(timeout):
            raise TimeoutError(f"producer did not answer {command[0]!r}")
        return self.conn.recv()

    def pull_request(self, address, key, gen, p_cfg, c_cfg, local_ids, tail, timeout_s=WAIT_S):
        """Pulls every route of a request into fresh consumer caches (one per pipeline
        rank); returns them."""
        caches = []
        for pp in range(c_cfg.pp_size):
            mesh = meshes.tp(c_cfg.tp_size)
            cache = PagedKVCache.allocate(c_cfg.local_spec(pp), tt.NUM_BLOCKS, mesh=mesh)
            ranks = fmt.rank_devices(cache, c_cfg, pp)
            pending = {
                rank: [
                    self.puller.pull(address, pull_uuid(key, gen, r.producer_rank, rank),
                                     [(r.shape, c_cfg.spec.dtype)], device, timeout_s)
                    for r in fmt.receive_routes(c_cfg, p_cfg, rank, len(tail))
                ]
                for rank, device in ranks.items()
            }
            pulled = {rank: [p.wait(timeout_s)[0] for p in pulls]
                      for rank, pulls in pending.items()}
            caches.append(fmt.concat_request(cache, c_cfg, p_cfg, local_ids, len(tail), pulled,
                                             ranks))
        return caches

    @parameterized.parameters(
        # (p_tp, c_tp, p_layout, c_layout, heads, ratio, dtype)
        (1, 2, "LKHTD", "LKHTD", 4, 1, "bfloat16"),
        (2, 1, "HTD", "THD", 4, 1, "float32"),
        (2, 4, "THD", "KTHD", 8, 2, "bfloat16"),
        (4, 2, "LKHTD", "HTD", 1, 1, "bfloat16"),
    )
    def test_exact_bytes(self, p_tp, c_tp, p_layout, c_layout, heads, ratio, dtype):
        p_spec = KVCacheSpec(num_layers=3, num_kv_heads=heads, head_dim=8, block_size=4,
                             dtype=dtype, layout=p_layout)
        c_spec = p_spec.replace(layout=c_layout, block_size=4 * ratio)
        p_cfg, c_cfg = EngineConfig(p_spec, p_tp), EngineConfig(c_spec, c_tp)
        address = self.call("setup", _kwargs(p_spec), p_tp, 1, 0, None)
        local_ids = tt.LOCAL_IDS[: len(tt.REMOTE_IDS) // ratio]
        tail = fmt.remote_tail(c_cfg, p_cfg, len(local_ids), tt.REMOTE_IDS)
        g = tt.global_cache(p_spec, len(tt.REMOTE_IDS) * 4, seed=tt.G_SEED)
        expected = tt.expected_arrays(c_cfg, 0, g, local_ids)
        ids = np.asarray(local_ids)
        for round_ in range(2):  # the second round splits into the first one's buffers
            key = f"prefill/req-{p_tp}{c_tp}/read-{round_}"
            held = self.call("offer", key, 3, _kwargs(c_spec), c_tp, 1, tail.tolist(), 30.0,
                             "req")
            self.assertIsInstance(held, int, held)
            if round_:
                self.assertEqual(self.call("state")[3], 0, "pooled buffers were not reused")
            caches = self.pull_request(address, key, 3, p_cfg, c_cfg, local_ids, tail)
            for index, (array, want) in enumerate(zip(caches[0].arrays, expected)):
                got = bits.bits(np.asarray(array))
                np.testing.assert_array_equal(got[ids], want, err_msg=f"array {index}")
                others = np.setdiff1d(np.arange(tt.NUM_BLOCKS), ids)
                self.assertFalse(got[others].any())
            self.assertEqual(self.call("release", "req"), held)
            held_now, offers, _, pooled = self.call("state")
            self.assertEqual((held_now, offers, pooled), (0, 0, held))

    def test_budget_refuses_and_frees(self):
        spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4)
        cfg = EngineConfig(spec, 1)
        one = len(tt.REMOTE_IDS) * spec.block_nbytes()
        self.call("setup", _kwargs(spec), 1, 1, 0, one + one // 2)
        first = self.call("offer", "k/a", 0, _kwargs(spec), 1, 1, tt.REMOTE_IDS, 30.0, "a")
        self.assertEqual(first, one)
        refused = self.call("offer", "k/b", 0, _kwargs(spec), 1, 1, tt.REMOTE_IDS, 30.0, "b")
        self.assertEqual(refused[:2], ("error", "PullBudgetError"))
        self.assertIn("budget", refused[2])
        self.assertEqual(self.call("state")[:2], (one, 1))  # the refused request holds nothing
        # once the first request's pull is confirmed, the second fits
        address = self.call("setup", _kwargs(spec), 1, 1, 0, one + one // 2)
        self.call("offer", "k/a", 0, _kwargs(spec), 1, 1, tt.REMOTE_IDS, 30.0, "a")
        self.pull_request(address, "k/a", 0, cfg, cfg, tt.LOCAL_IDS, np.array(tt.REMOTE_IDS))
        self.assertEqual(self.call("release", "a"), one)
        self.assertEqual(
            self.call("offer", "k/b", 0, _kwargs(spec), 1, 1, tt.REMOTE_IDS, 30.0, "b"), one)
        self.call("release", "b")

    def test_lease_expiry_frees_buffers(self):
        spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4)
        address = self.call("setup", _kwargs(spec), 1, 1, 0, None)
        nbytes = 64 << 20
        uuid = pull_uuid("k/never", 0, 0, 0)
        rss_before = self.call("state")[2]
        self.assertEqual(self.call("big", "never", uuid, nbytes, 1.0), nbytes)
        held, offers, rss_offered, _ = self.call("state")
        self.assertEqual((held, offers), (nbytes, 1))
        self.assertGreater(rss_offered - rss_before, 0.75 * nbytes / (1 << 20))
        time.sleep(1.5)
        self.assertEqual(self.call("expire"), ["never"])
        held, offers, rss_expired, _ = self.call("state")
        self.assertEqual((held, offers), (0, 0))
        # the transfer server dropped its reference too: the memory went back
        self.assertLess(rss_expired, rss_offered - 0.75 * nbytes / (1 << 20))
        # a consumer that comes too late gets a clear failure, not a hang
        pull = self.puller.pull(address, uuid, [((nbytes,), np.uint8)], jax.devices()[0], 1.0)
        with self.assertRaisesRegex(PullTimeoutError, "did not complete in time"):
            pull.wait(WAIT_S)
        self.assertEqual(pull.status(), "ERR")

    def test_never_offered_times_out_and_connection_recovers(self):
        spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4)
        cfg = EngineConfig(spec, 1)
        address = self.call("setup", _kwargs(spec), 1, 1, 0, None)
        pull = self.puller.pull(address, pull_uuid("k/ghost", 0, 0, 0), [((4,), np.float32)],
                                jax.devices()[0], 0.5)
        with self.assertRaises(PullTimeoutError):
            pull.wait(WAIT_S)
        # the poisoned connection was dropped; the next pull reconnects and works
        self.call("offer", "k/ok", 0, _kwargs(spec), 1, 1, tt.REMOTE_IDS, 30.0, "ok")
        self.pull_request(address, "k/ok", 0, cfg, cfg, tt.LOCAL_IDS, np.array(tt.REMOTE_IDS))
        self.call("release", "ok")


@pytest.mark.skipif(not jax_transfer_available(), reason="no jax.experimental.transfer")
class ProducerKilledTest(absltest.TestCase):
    def test_producer_killed_mid_pull(self):
        process, conn = processes.spawn(producer_main)
        try:
            spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4)
            conn.send(("setup", _kwargs(spec), 1, 1, 0, None))
            self.assertTrue(conn.poll(WAIT_S))
            address = conn.recv()
            puller = Puller()
            nbytes = 256 << 20  # long enough to be cut off
            uuid = pull_uuid("k/killed", 0, 0, 0)
            conn.send(("big", "killed", uuid, nbytes, 30.0))
            self.assertTrue(conn.poll(WAIT_S))
            conn.recv()
            pull = puller.pull(address, uuid, [((nbytes,), np.uint8)], jax.devices()[0], 20.0)
            time.sleep(0.05)
            process.kill()
            process.join(timeout=10)
            deadline = time.monotonic() + WAIT_S
            state = pull.status()
            while state == "PROC" and time.monotonic() < deadline:
                time.sleep(0.01)
                state = pull.status()
            # either the pull failed, or it had already completed intact before the kill
            if state == "DONE":
                np.testing.assert_array_equal(np.asarray(pull.arrays[0])[:: 1 << 20], 7)
            else:
                self.assertEqual(state, "ERR")
                self.assertIn(address, pull.error)
            puller.server.close()
        finally:
            if process.is_alive():
                process.kill()
            process.join(timeout=5)
            conn.close()


def _kwargs(spec: KVCacheSpec) -> dict:
    return dict(num_layers=spec.num_layers, num_kv_heads=spec.num_kv_heads,
                head_dim=spec.head_dim, block_size=spec.block_size, dtype=spec.dtype.name,
                layout=spec.layout, kv_factor=spec.kv_factor, mla=spec.mla)


if __name__ == "__main__":
    absltest.main()
