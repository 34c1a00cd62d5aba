"""Real transfers over NIXL (UCX, CPU memory) between a producer process and this process."""

from __future__ import annotations

import os

os.environ.setdefault("UCX_TLS", "tcp,sm,self")

import multiprocessing  # noqa: E402
import time  # noqa: E402

import kv_testing  # noqa: E402

kv_testing.force_cpu_devices()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import transfer_testing as tt  # noqa: E402
from absl.testing import absltest, parameterized  # noqa: E402

from jaxkv import EngineConfig, KVCacheSpec, PagedKVCache  # noqa: E402
from jaxkv.transfer import KVTransferEngine, nixl_available  # noqa: E402

NUM_BLOCKS = 16
REMOTE_IDS = [3, 4, 5, 9, 10, 2]
LOCAL_IDS = [7, 8, 9, 12, 13, 14]
G_SEED = 11
WAIT_S = 60.0


def _mesh(tp):
    return jax.sharding.Mesh(np.array(jax.devices()[:tp]), ("tp",))


@pytest.mark.skipif(not nixl_available(), reason="NIXL (nixl-cu13) is not installed")
class TransferTestBase(parameterized.TestCase):

    def setUp(self):
        super().setUp()
        self._children = []
        self._engines = []

    def tearDown(self):
        for engine in self._engines:
            engine.close()
        for process, conn in self._children:
            try:
                conn.send(("exit",))
            except (OSError, BrokenPipeError):
                pass
            process.join(timeout=10)
            if process.is_alive():
                process.terminate()
                process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join(timeout=5)
            conn.close()
        super().tearDown()

    def start_producer(self, spec_kwargs, tp, pp_rank=0, pp=1, engine_kwargs=None):
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe()
        process = ctx.Process(
            target=tt.producer_main,
            args=(child, spec_kwargs, tp, pp_rank, pp, NUM_BLOCKS, G_SEED,
                  len(REMOTE_IDS) * spec_kwargs["block_size"], engine_kwargs or {}),
            daemon=True)
        process.start()
        child.close()
        self._children.append((process, parent))
        return process, parent

    @staticmethod
    def call(conn, *command, timeout=WAIT_S):
        conn.send(command)
        if not conn.poll(timeout):
            raise TimeoutError(f"producer did not answer {command[0]!r}")
        return conn.recv()

    @staticmethod
    def ready(conn):
        if not conn.poll(WAIT_S):
            raise TimeoutError("producer did not start")
        return conn.recv()

    def consumer(self, spec, tp, pp=1, pp_rank=0, **kwargs):
        config = EngineConfig(spec, tp, pp)
        engine = KVTransferEngine("decode", config, **kwargs)
        self._engines.append(engine)
        cache = PagedKVCache.allocate(config.local_spec(pp_rank), NUM_BLOCKS, mesh=_mesh(tp))
        engine.register_cache(cache, pp_rank=pp_rank)
        return engine, cache, config

    @staticmethod
    def wait(engine, request_ids, timeout=WAIT_S):
        finished, failed = [], []
        deadline = time.monotonic() + timeout
        pending = set(request_ids)
        while pending and time.monotonic() < deadline:
            result = engine.poll()
            finished += result.finished
            failed += result.failed
            pending -= set(result.finished) | {f.request_id for f in result.failed}
        if pending:
            raise TimeoutError(f"requests {sorted(pending)} neither finished nor failed")
        return finished, failed

    def check_cache(self, cache, config, g, local_ids, pp_rank=0, first_token=0):
        expected = tt.expected_arrays(config, pp_rank, g, local_ids, first_token)
        ids = np.asarray(local_ids)
        others = np.setdiff1d(np.arange(NUM_BLOCKS), ids)
        for index, (array, want) in enumerate(zip(cache.arrays, expected)):
            got = kv_testing.bits(np.asarray(array))
            np.testing.assert_array_equal(got[ids], want, err_msg=f"array {index}")
            self.assertFalse(got[others].any(), f"array {index}: other blocks changed")


class TransferE2ETest(TransferTestBase):

    @parameterized.parameters(
        (1, 1, "LKHTD", "LKHTD"),
        (1, 2, "HTD", "HTD"),
        (2, 1, "LKHTD", "KHTD"),
        (2, 4, "THD", "THD"),
        (4, 2, "KTHD", "LKTHD"),
        (1, 4, "HTD", "HTD"),
    )
    def test_read_tp(self, p_tp, d_tp, p_layout, d_layout, heads=4, dtype="bfloat16"):
        spec_kwargs = dict(num_layers=2, num_kv_heads=heads, head_dim=8, block_size=4,
                           dtype=dtype, layout=p_layout)
        _, conn = self.start_producer(spec_kwargs, p_tp)
        self.ready(conn)
        self.call(conn, "register", REMOTE_IDS)
        params = self.call(conn, "pin", "req-1", REMOTE_IDS, 30.0)
        spec_d = KVCacheSpec(**dict(spec_kwargs, layout=d_layout))
        engine, cache, config = self.consumer(spec_d, d_tp)
        engine.start_read(params, LOCAL_IDS)
        finished, failed = self.wait(engine, ["req-1"])
        self.assertEqual((finished, failed), (["req-1"], []))
        g = tt.global_cache(KVCacheSpec(**spec_kwargs), len(REMOTE_IDS) * 4, seed=G_SEED)
        self.check_cache(cache, config, g, LOCAL_IDS)
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            pinned, freed, _, _ = self.call(conn, "state")
            if freed:
                break
        self.assertEqual((pinned, freed), (0, ["req-1"]))
        record = engine.stats.records[-1]
        self.assertEqual(record.bytes, spec_d.cache_nbytes(len(LOCAL_IDS)) // 1)

    def test_pipeline_parallel_producer(self):
        spec_kwargs = dict(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4,
                           dtype="float32", layout="LKHTD")
        conns = [self.start_producer(spec_kwargs, 2, pp_rank=r, pp=2)[1] for r in range(2)]
        addresses = [self.ready(c)[1] for c in conns]
        for c in conns:
            self.call(c, "register", REMOTE_IDS)
        params = [self.call(c, "pin", "req-pp", REMOTE_IDS, 30.0) for c in conns]
        params = params[0].__class__(**{**{f: getattr(params[0], f)
                                           for f in params[0].__struct_fields__},
                                        "addresses": addresses, "generation": -1})
        spec = KVCacheSpec(**spec_kwargs)
        engine, cache, config = self.consumer(spec, 1)
        engine.start_read(params, LOCAL_IDS)
        finished, failed = self.wait(engine, ["req-pp"])
        self.assertEqual((finished, failed), (["req-pp"], []))
        g = tt.global_cache(spec, len(REMOTE_IDS) * 4, seed=G_SEED)
        self.check_cache(cache, config, g, LOCAL_IDS)


if __name__ == "__main__":
    absltest.main()
