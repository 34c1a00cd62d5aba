"""Real transfers over NIXL (UCX, CPU memory) between a producer process and this process."""

from __future__ import annotations

import os

os.environ.setdefault("UCX_TLS", "tcp,sm,self")

import time  # noqa: E402

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
class TransferE2ETest(tt.TransferTestBase):
    @parameterized.parameters(
        (1, 1, "LKHTD", "LKHTD"),
        (1, 2, "HTD", "HTD"),
        (2, 1, "LKHTD", "KHTD"),
        (2, 4, "THD", "THD"),
        (4, 2, "KTHD", "LKTHD"),
        (1, 4, "HTD", "HTD"),
    )
    def test_read_tp(self, p_tp, d_tp, p_layout, d_layout, heads=4, dtype="bfloat16"):
        self.read_case(p_tp, d_tp, p_layout, d_layout, heads=heads, dtype=dtype)

    @parameterized.parameters(
        # (p_tp, d_tp, p_layout, d_layout, ratio, kind): HND <-> NHD, block-size ratio 2
        (2, 1, "KHTD", "KTHD", 1, "permute"),
        (1, 1, "THD", "HTD", 1, "permute"),
        (1, 2, "HTD", "HTD", 2, "merge"),
        (2, 2, "KHTD", "KTHD", 2, "merge_permute"),
        (1, 1, "LKTHD", "LKHTD", 2, "merge_permute"),
    )
    def test_post_processing(self, p_tp, d_tp, p_layout, d_layout, ratio, kind):
        engine, cache = self.read_case(p_tp, d_tp, p_layout, d_layout, ratio=ratio)
        record = engine.stats.records[-1]
        self.assertGreater(record.post_s, 0.0)
        self.assertGreater(engine.stats.summary()["post_ms_mean"], 0.0)
        engine.check_registrations(cache)  # rewritten in place: registrations still valid
        self.assertIs(engine.caches[0], cache)

    @parameterized.parameters(
        # (p_tp, d_tp, p_layout, d_layout, heads): KV heads 1 (replicated on decode) and 8
        (1, 2, "HTD", "HTD", 1),
        (2, 4, "THD", "KTHD", 8),
    )
    def test_kv_heads(self, p_tp, d_tp, p_layout, d_layout, heads):
        self.read_case(p_tp, d_tp, p_layout, d_layout, heads=heads, dtype="float32")

    @parameterized.parameters((1, 2, 1), (2, 1, 2))
    def test_mla(self, p_tp, d_tp, ratio):
        # MLA: one read per decode rank (replicas on the producer), block-size ratio 2 merged
        self.read_case(p_tp, d_tp, "LKTD", "LKTD", ratio=ratio, mla=True)

    @parameterized.parameters(
        # (consumer control, producer control, Done riding on the READ)
        ("nixl", "tcp", True),
        ("tcp", "nixl", False),
        ("tcp", "tcp", True),  # Done over the NIXL notification, Ack over TCP
    )
    def test_control_channels(self, control, producer_control, attach):
        engine, _ = self.read_case(
            2, 1, "HTD", "HTD", control=control, producer_control=producer_control,
            attach=attach,
        )
        self.assertEqual(engine.control.name, control)
        # The messages went where asked: a persistent TCP connection to the producer's side
        # channel only with control="tcp".
        tcp = engine._channels["tcp"]  # noqa: SLF001
        self.assertEqual(tcp.open_connections, 1 if control == "tcp" else 0)

    def test_unknown_transport_or_control_is_refused(self):
        from jaxkv import EngineConfig
        from jaxkv.transfer._engine import KVTransferEngine  # the core: tests reach into it

        config = EngineConfig(KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=8,
                                          block_size=4), 1)
        with KVTransferEngine("x", config, transport="jax") as engine:  # transfer_jax_*_test
            self.assertEqual(engine.transport.name, "jax")
        with self.assertRaisesRegex(ValueError, "control='nixl' needs the NIXL transport"):
            KVTransferEngine("x", config, transport="jax", control="nixl")
        with self.assertRaisesRegex(ValueError, "transport must be one of"):
            KVTransferEngine("x", config, transport="ucx")
        with self.assertRaisesRegex(ValueError, "control must be one of"):
            KVTransferEngine("x", config, control="udp")

    def read_case(self, p_tp, d_tp, p_layout, d_layout, heads=4, dtype="bfloat16", ratio=1,
                  mla=False, control="auto", producer_control="auto", attach=None):
        spec_kwargs = dict(
            num_layers=2, num_kv_heads=heads, head_dim=8, block_size=4, dtype=dtype, layout=p_layout
        )
        if mla:
            spec_kwargs.update(num_kv_heads=1, kv_factor=1, mla=True)
        _, conn = self.start_producer(
            spec_kwargs, p_tp, engine_kwargs=dict(control=producer_control)
        )
        self.ready(conn)
        self.call(conn, "register", REMOTE_IDS)
        params = self.call(conn, "pin", "req-1", REMOTE_IDS, 30.0)
        spec_d = KVCacheSpec(**dict(spec_kwargs, layout=d_layout, block_size=4 * ratio))
        engine, cache, config = self.consumer(spec_d, d_tp, control=control)
        if attach is not None:
            engine._attach_done = attach  # noqa: SLF001 - both ways of sending Done
        local_ids = LOCAL_IDS[: len(REMOTE_IDS) // ratio]
        engine.start_read(params, local_ids)
        deadline = time.monotonic() + WAIT_S
        finished, failed, applied = [], [], {}
        while "req-1" not in finished and not failed and time.monotonic() < deadline:
            result = engine.poll()
            finished += result.finished
            failed += result.failed
            applied.update(result.post_applied)
        self.assertEqual((finished, failed), (["req-1"], []))
        if ratio > 1 or ("H" in p_layout and p_layout[-3:] != d_layout[-3:] and heads > 1):
            self.assertTrue(applied.get("req-1"), "post-processing expected")
        else:
            self.assertNotIn("req-1", applied)
        g = tt.global_cache(KVCacheSpec(**spec_kwargs), len(REMOTE_IDS) * 4, seed=G_SEED)
        self.check_cache(cache, config, g, local_ids)
        self.assert_freed(conn, "req-1")
        record = engine.stats.records[-1]
        replicas = max(1, d_tp // spec_d.num_kv_heads)  # each decode replica reads its copy
        self.assertEqual(record.bytes, spec_d.cache_nbytes(len(local_ids)) * replicas)
        # equal block sizes: every READ picks its rows from prepared descriptor lists
        if ratio == 1:
            self.assertGreater(engine.agent.prepped_reads, 0)
            self.assertEqual(engine.agent.prepped_reads, engine.agent.num_prepped)
        else:
            self.assertEqual(engine.agent.prepped_reads, 0)
        return engine, cache

    @parameterized.parameters("never", "always")  # direct, formatted (few large READs)
    def test_pipeline_parallel_producer(self, formatted):
        spec_kwargs = dict(
            num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32", layout="LKHTD"
        )
        conns = [self.start_producer(spec_kwargs, 2, pp_rank=r, pp=2)[1] for r in range(2)]
        addresses = [self.ready(c)[1] for c in conns]
        for c in conns:
            self.call(c, "register", REMOTE_IDS)
        params = [self.call(c, "pin", "req-pp", REMOTE_IDS, 30.0) for c in conns]
        params = params[0].__class__(
            **{
                **{f: getattr(params[0], f) for f in params[0].__struct_fields__},
                "addresses": addresses,
                "generation": -1,
            }
        )
        spec = KVCacheSpec(**spec_kwargs)
        engine, cache, config = self.consumer(spec, 1, formatted_reads=formatted)
        engine.start_read(params, LOCAL_IDS)
        finished, failed = self.wait(engine, ["req-pp"])
        self.assertEqual((finished, failed), (["req-pp"], []))
        self.assertEqual(engine.stats.records[-1].path,
                         "formatted" if formatted == "always" else "direct")
        g = tt.global_cache(spec, len(REMOTE_IDS) * 4, seed=G_SEED)
        self.check_cache(cache, config, g, LOCAL_IDS)

    @parameterized.parameters(
        # producer TP=2 as one process per rank -> decode in this process
        (1, "KHTD", "KHTD", "never"),
        (2, "THD", "HTD", "never"),  # two CPU devices here; NHD -> HND permuted after the read
        (2, "THD", "HTD", "always"),  # formatted: each producer process gathers its rank's
    )
    def test_tp_rank_per_process(self, d_tp, p_layout, d_layout, formatted):
        spec_kwargs = dict(
            num_layers=2, num_kv_heads=4, head_dim=8, block_size=4, dtype="bfloat16",
            layout=p_layout,
        )
        conns = [self.start_producer(spec_kwargs, 2, tp_rank=r)[1] for r in range(2)]
        addresses = [self.ready(c)[1] for c in conns]
        for c in conns:
            self.call(c, "register", REMOTE_IDS)
        params = [self.call(c, "pin", "req-tpr", REMOTE_IDS, 30.0) for c in conns]
        self.assertEqual([p.addresses for p in params], [[a] for a in addresses])
        merged = _with_addresses(params[0], addresses)
        spec = KVCacheSpec(**dict(spec_kwargs, layout=d_layout))
        engine, cache, config = self.consumer(spec, d_tp, formatted_reads=formatted)
        meta = engine.add_peer("prefill", addresses)  # one agent per producer rank
        self.assertEqual(meta.world_size, 2)
        self.assertEqual(len({info.agent_name for info in meta.ranks}), 2)
        engine.start_read(merged, LOCAL_IDS)
        self.assertEqual(self.wait(engine, ["req-tpr"]), (["req-tpr"], []))
        g = tt.global_cache(KVCacheSpec(**spec_kwargs), len(REMOTE_IDS) * 4, seed=G_SEED)
        self.check_cache(cache, config, g, LOCAL_IDS)
        engine.check_registrations(cache)
        for c in conns:  # each producer rank frees once every decode rank confirmed
            self.assert_freed(c, "req-tpr")
        record = engine.stats.records[-1]
        self.assertEqual(record.bytes, spec.cache_nbytes(len(LOCAL_IDS)))

    @parameterized.parameters("never", "always")
    def test_pipeline_parallel_consumer(self, formatted):
        # decode PP=2 (3 layers: 2 + 1), one engine object per pipeline rank, TP 2 -> 1
        spec_kwargs = dict(
            num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32", layout="KHTD"
        )
        _, conn = self.start_producer(spec_kwargs, 2)
        self.ready(conn)
        self.call(conn, "register", REMOTE_IDS)
        params = self.call(conn, "pin", "req-dpp", REMOTE_IDS, 30.0)
        spec = KVCacheSpec(**dict(spec_kwargs, layout="KTHD"))
        consumers = [self.consumer(spec, 1, pp=2, pp_rank=r, formatted_reads=formatted)
                     for r in range(2)]
        for engine, _, _ in consumers:
            engine.start_read(params, LOCAL_IDS)
        for engine, _, _ in consumers:
            self.assertEqual(self.wait(engine, ["req-dpp"]), (["req-dpp"], []))
        g = tt.global_cache(KVCacheSpec(**spec_kwargs), len(REMOTE_IDS) * 4, seed=G_SEED)
        for r, (_, cache, config) in enumerate(consumers):
            self.check_cache(cache, config, g, LOCAL_IDS, pp_rank=r)
        self.assert_freed(conn, "req-dpp")


def _with_addresses(params, addresses):
    """The params of one producer process, naming every process of the engine (what a router
    hands to the consumer); generation -1: whatever the processes publish now."""
    fields = {f: getattr(params, f) for f in params.__struct_fields__}
    return params.__class__(**{**fields, "addresses": list(addresses), "generation": -1})


if __name__ == "__main__":
    absltest.main()
