"""Formatted reads over NIXL (`jaxkv.transfer._formatted`) between a producer process and this
process: bit exact over the heterogeneous grid, the path chosen and reported, chunking, pool
budgets, failures."""

from __future__ import annotations

import os

os.environ.setdefault("UCX_TLS", "tcp,sm,self")


from support import platforms  # noqa: E402

platforms.force_cpu_devices()

import pytest  # noqa: E402
from absl.testing import absltest, parameterized  # noqa: E402
from support import transfer as tt  # noqa: E402

from jaxkv import KVCacheSpec  # noqa: E402
from jaxkv.transfer import nixl_available  # noqa: E402

NUM_BLOCKS, REMOTE_IDS, LOCAL_IDS, G_SEED = tt.NUM_BLOCKS, tt.REMOTE_IDS, tt.LOCAL_IDS, tt.G_SEED
WAIT_S = tt.WAIT_S


@pytest.mark.skipif(not nixl_available(), reason="NIXL (nixl-cu13) is not installed")
class FormattedReadTest(tt.TransferTestBase):
    @parameterized.parameters(
        # (p_tp, d_tp, p_layout, d_layout, heads, ratio, dtype)
        (1, 1, "LKHTD", "LKHTD", 4, 1, "bfloat16"),
        (2, 1, "LKHTD", "KHTD", 4, 1, "bfloat16"),
        (1, 2, "HTD", "HTD", 4, 1, "float32"),
        (2, 4, "THD", "THD", 4, 1, "bfloat16"),
        (4, 2, "KTHD", "LKTHD", 4, 1, "float8_e4m3fn"),
        (2, 1, "KHTD", "KTHD", 4, 1, "bfloat16"),  # permuted after landing
        (2, 2, "KHTD", "KTHD", 4, 2, "bfloat16"),  # merged and permuted
        (1, 2, "HTD", "HTD", 1, 1, "float32"),  # one KV head, replicated on decode
        (2, 4, "THD", "KTHD", 8, 1, "float32"),
    )
    def test_formatted_read_is_bit_exact(self, p_tp, d_tp, p_layout, d_layout, heads, ratio,
                                         dtype):
        engine, _ = self.read_case(p_tp, d_tp, p_layout, d_layout, heads=heads, dtype=dtype,
                                   ratio=ratio)
        self.assertEqual(engine.stats.records[-1].path, "formatted")
        self.assertEqual(engine.stats.formatted_total, 1)

    @parameterized.parameters((1, 2, 1), (2, 1, 2))
    def test_mla(self, p_tp, d_tp, ratio):
        self.read_case(p_tp, d_tp, "LKTD", "LKTD", ratio=ratio, mla=True)

    def test_small_chunks_pipeline_through_small_pools(self):
        # 64-byte-ish chunks through pools that hold only a few at a time: every chunk waits
        # for a free slot on both sides, and the bytes still land exactly.
        engine, _ = self.read_case(2, 1, "HTD", "HTD", pool_bytes=4096, chunk_bytes=512)
        chunks = sum(len(f.chunks) for f in [])  # the read is gone: count from the producer
        del chunks
        self.assertEqual(engine.stats.records[-1].path, "formatted")

    def read_case(self, p_tp, d_tp, p_layout, d_layout, heads=4, dtype="bfloat16", ratio=1,
                  mla=False, pool_bytes=None, chunk_bytes=None, mode="always"):
        spec_kwargs = dict(num_layers=2, num_kv_heads=heads, head_dim=8, block_size=4,
                           dtype=dtype, layout=p_layout)
        if mla:
            spec_kwargs.update(num_kv_heads=1, kv_factor=1, mla=True)
        engine_kwargs = {} if pool_bytes is None else dict(format_pool_bytes=pool_bytes)
        _, conn = self.start_producer(spec_kwargs, p_tp, engine_kwargs=engine_kwargs)
        self.ready(conn)
        self.call(conn, "register", REMOTE_IDS)
        params = self.call(conn, "pin", "req-1", REMOTE_IDS, 30.0)
        spec_d = KVCacheSpec(**dict(spec_kwargs, layout=d_layout, block_size=4 * ratio))
        engine, cache, config = self.consumer(spec_d, d_tp, formatted_reads=mode,
                                              **engine_kwargs)
        if chunk_bytes is not None:
            engine.transport.chunk_bytes = chunk_bytes
        local_ids = LOCAL_IDS[: len(REMOTE_IDS) // ratio]
        engine.start_read(params, local_ids)
        finished, failed = self.wait(engine, ["req-1"])
        self.assertEqual((finished, [f.reason for f in failed]), (["req-1"], []))
        g = tt.global_cache(KVCacheSpec(**spec_kwargs), len(REMOTE_IDS) * 4, seed=G_SEED)
        self.check_cache(cache, config, g, local_ids)
        state = self.assert_freed(conn, "req-1")
        del state
        self.assertEqual(engine.transport.receive_pool.used_bytes, 0)
        return engine, cache


if __name__ == "__main__":
    absltest.main()
