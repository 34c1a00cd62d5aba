"""Real transfers over NIXL that complete the transfer layer's test grid: TP 4 -> 1, KV heads
2 (replicated on either side), bf16 and fp32 through the post-processing rewrites, PP 2 on both
sides at once with different layer splits, and a decode engine whose TP ranks are separate
processes aggregated with `WorkerAggregator`."""

from __future__ import annotations

import os

os.environ.setdefault("UCX_TLS", "tcp,sm,self")

import time  # noqa: E402

from support import meshes, platforms, processes  # noqa: E402

platforms.force_cpu_devices()

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import transfer_e2e_test as e2e  # noqa: E402
from absl.testing import absltest, parameterized  # noqa: E402
from support import transfer as tt  # noqa: E402

from jaxkv import EngineConfig, KVCacheSpec  # noqa: E402
from jaxkv.transfer import TransferStats, nixl_available
from jaxkv.transfer._stats import WorkerAggregator

REMOTE_IDS, LOCAL_IDS, WAIT_S = tt.REMOTE_IDS, tt.LOCAL_IDS, tt.WAIT_S


def consumer_rank_main(conn, spec_kwargs: dict, tp: int, tp_rank: int, num_blocks: int) -> None:
    """One decode TP rank in its own process: ("read", params, local_ids) -> (finished ids,
    failed ids, the rank's arrays as bytes, its transfer records)."""
    processes.child_env(1)

    from jaxkv import PagedKVCache
    from jaxkv.transfer import TransferEngine

    spec = KVCacheSpec(**spec_kwargs)
    config = EngineConfig(spec, tp)
    rank_spec = spec.replace(num_kv_heads=config.heads_per_rank)
    mesh = meshes.tp(1)
    with TransferEngine("decode", config) as engine:
        cache = PagedKVCache.allocate(rank_spec, num_blocks, mesh=mesh)
        engine.register_cache(cache, tp_rank=tp_rank)
        conn.send(("ready", engine.address))
        while True:
            if not conn.poll(WAIT_S):
                return
            command = conn.recv()
            if command[0] == "exit":
                return
            _, params, local_ids = command
            engine.start_read(params, local_ids)
            finished, failed = [], []
            deadline = time.monotonic() + WAIT_S
            while not (finished or failed) and time.monotonic() < deadline:
                result = engine.poll()
                finished += result.finished
                failed += [f.request_id for f in result.failed]
            arrays = [np.asarray(a).tobytes() for a in engine.caches[0].arrays]
            conn.send((finished, failed, arrays, list(engine.stats.records)))


@pytest.mark.skipif(not nixl_available(), reason="NIXL (nixl-cu13) is not installed")
class TransferGridTest(tt.TransferTestBase):
    read_case = e2e.TransferE2ETest.read_case

    @parameterized.parameters(
        # (p_tp, d_tp, p_layout, d_layout, heads, dtype)
        (4, 1, "HTD", "HTD", 4, "bfloat16"),
        (4, 1, "LKTHD", "KHTD", 8, "float32"),  # NHD -> HND, two heads per read
        (1, 4, "KHTD", "KHTD", 2, "float32"),  # decode TP > heads: replicated on decode
        (4, 2, "THD", "THD", 2, "bfloat16"),  # prefill TP > heads: replicated on prefill
    )
    def test_read_grid(self, p_tp, d_tp, p_layout, d_layout, heads, dtype):
        self.read_case(p_tp, d_tp, p_layout, d_layout, heads=heads, dtype=dtype)

    @parameterized.parameters(
        # (p_tp, d_tp, p_layout, d_layout, ratio, dtype): the rewrites on every element width
        (2, 1, "KHTD", "KTHD", 1, "float32"),
        (1, 2, "HTD", "HTD", 2, "float32"),
        (2, 2, "KTHD", "KHTD", 2, "float32"),
        (1, 1, "THD", "HTD", 2, "bfloat16"),
    )
    def test_post_processing_dtypes(self, p_tp, d_tp, p_layout, d_layout, ratio, dtype):
        engine, _ = self.read_case(p_tp, d_tp, p_layout, d_layout, ratio=ratio, dtype=dtype)
        self.assertGreater(engine.stats.records[-1].post_s, 0.0)

    def test_pipeline_parallel_both_sides(self):
        # prefill PP=2 (layers 2 + 1) x TP 2 -> decode PP=2 (layers 1 + 2) x TP 1
        spec_kwargs = dict(
            num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32",
            layout="LKHTD",
        )
        conns = [self.start_producer(spec_kwargs, 2, pp_rank=r, pp=2)[1] for r in range(2)]
        addresses = [self.ready(c)[1] for c in conns]
        for c in conns:
            self.call(c, "register", REMOTE_IDS)
        params = [self.call(c, "pin", "req-pp2", REMOTE_IDS, 30.0) for c in conns]
        merged = e2e._with_addresses(params[0], addresses)  # noqa: SLF001 - shared test helper
        spec = KVCacheSpec(**spec_kwargs)
        decode = EngineConfig(spec, 1, 2, layers_per_pp=(1, 2))
        from jaxkv import PagedKVCache
        from jaxkv.transfer import TransferEngine

        consumers = []
        for pp_rank in range(2):
            engine = TransferEngine("decode", decode)
            self._engines.append(engine)
            cache = PagedKVCache.allocate(
                decode.local_spec(pp_rank), tt.NUM_BLOCKS, mesh=meshes.tp(1)
            )
            engine.register_cache(cache, pp_rank=pp_rank)
            consumers.append((engine, pp_rank))
        for engine, _ in consumers:
            engine.start_read(merged, LOCAL_IDS)
        g = tt.global_cache(spec, len(REMOTE_IDS) * 4, seed=tt.G_SEED)
        for engine, pp_rank in consumers:
            self.assertEqual(self.wait(engine, ["req-pp2"]), (["req-pp2"], []))
            self.check_cache(engine.caches[0], decode, g, LOCAL_IDS, pp_rank=pp_rank)
        # decode PP rank 1 holds layers 1-2: layer 1 from prefill PP rank 0, layer 2 from rank 1
        self.assertEqual(consumers[1][0].stats.records[-1].bytes,
                         decode.local_spec(1).cache_nbytes(len(LOCAL_IDS)))
        for c in conns:
            self.assert_freed(c, "req-pp2")

    def test_decode_rank_per_process_aggregated(self):
        # prefill TP 1 (this test's producer process) -> decode TP 2, one process per rank
        spec_kwargs = dict(
            num_layers=2, num_kv_heads=4, head_dim=8, block_size=4, dtype="bfloat16",
            layout="KHTD",
        )
        _, conn = self.start_producer(spec_kwargs, 1)
        self.ready(conn)
        self.call(conn, "register", REMOTE_IDS)
        params = self.call(conn, "pin", "req-dr", REMOTE_IDS, 30.0)
        workers = []
        for rank in range(2):
            process, parent = processes.spawn(
                consumer_rank_main, spec_kwargs, 2, rank, tt.NUM_BLOCKS)
            self._children.append((process, parent))
            workers.append(parent)
        for w in workers:
            self.ready(w)
        for w in workers:
            w.send(("read", params, LOCAL_IDS))
        aggregator, stats, done = WorkerAggregator(num_workers=2), TransferStats(), []
        spec = KVCacheSpec(**spec_kwargs)
        config = EngineConfig(spec, 2)
        g = tt.global_cache(spec, len(REMOTE_IDS) * 4, seed=tt.G_SEED)
        expected = tt.NumpyEngine(config, tt.NUM_BLOCKS)
        ids = np.asarray(LOCAL_IDS)
        for rank, w in enumerate(workers):
            self.assertTrue(w.poll(WAIT_S), f"decode rank {rank} did not answer")
            finished, failed, arrays, records = w.recv()
            self.assertEqual((finished, failed), (["req-dr"], []))
            done += aggregator.report(rank, finished)
            self.assertEqual(done, [] if rank == 0 else ["req-dr"])
            for record in records:
                stats.add(record)
            want = expected.slice_of(rank, g, 0, len(ids))
            rank_spec = spec.replace(num_kv_heads=config.heads_per_rank)
            for index, (raw, blocks) in enumerate(zip(arrays, want)):
                got = np.frombuffer(raw, np.uint8).reshape(tt.NUM_BLOCKS, -1)
                self.assertEqual(got.shape[1], rank_spec.block_nbytes())
                np.testing.assert_array_equal(
                    got[ids], blocks.reshape(len(ids), -1).view(np.uint8),
                    err_msg=f"rank {rank} array {index}")
                others = np.setdiff1d(np.arange(tt.NUM_BLOCKS), ids)
                self.assertFalse(got[others].any(), f"rank {rank}: other blocks changed")
        self.assertEqual(aggregator.pending, 0)
        summary = stats.summary()
        self.assertEqual(summary["transfers"], 2)
        self.assertEqual(summary["bytes_total"], spec.cache_nbytes(len(ids)))
        self.assert_freed(conn, "req-dr")  # freed only after both decode processes confirmed


if __name__ == "__main__":
    absltest.main()
