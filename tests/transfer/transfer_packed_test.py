"""Reads of tpu-inference's packed caches (K/V interleaved on the head axis, sub-32-bit values
packed per word with phantom heads, head dim padded to 128 lanes) over NIXL: only values
move, bit for bit, between engines of other TP sizes, block sizes and storage (packed <->
plain), and the consumer's padding is never written. Planner-level cases simulate the
descriptors between byte buffers; the real ones read between engines in two processes."""

from __future__ import annotations

import os

os.environ.setdefault("UCX_TLS", "tcp,sm,self")

import itertools  # noqa: E402
import time  # noqa: E402

from support import bits, meshes, platforms, processes  # noqa: E402

platforms.force_cpu_devices()

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from absl.testing import absltest, parameterized  # noqa: E402
from support import packed as pt  # noqa: E402
from support import transfer as tt  # noqa: E402

from jaxkv import EngineConfig, KVCacheSpec  # noqa: E402
from jaxkv.transfer import nixl_available
from jaxkv.transfer._plan import PlanError, plan_read

NUM_BLOCKS = 10
REMOTE_IDS = [3, 4, 5, 9, 2, 0]  # a run of consecutive ids and breaks
LOCAL_IDS = [6, 7, 8, 1, 0, 5]
LAYERS = 2


def packed(heads, head_dim, page, dtype, **changes):
    return KVCacheSpec.for_tpu_inference(LAYERS, heads, head_dim, page, dtype).replace(**changes)


def plain(heads, head_dim, page, dtype, layout):
    return KVCacheSpec(LAYERS, heads, head_dim, page, dtype, layout=layout)


def plan_case(test, spec_p, spec_d, p_tp, d_tp, p_pp=1, d_pp=1, hit=0, layers=None):
    """Plans every consumer rank's read of the request and simulates its descriptors (and,
    with equal block sizes, the rows a poster picks from the prepared tables); the
    consumer's buffers (sentinel bytes) must then equal the reference exactly: the values
    in the request's blocks, the sentinel everywhere else (padding, other blocks).
    `layers`: only those global layers are read (a layer-wise read)."""
    cfg_p, cfg_d = EngineConfig(spec_p, p_tp, p_pp), EngineConfig(spec_d, d_tp, d_pp)
    meta_p = tt.fake_metadata("prefill", cfg_p, NUM_BLOCKS)
    meta_d = tt.fake_metadata("decode", cfg_d, NUM_BLOCKS)
    ratio = spec_d.block_size // spec_p.block_size
    g = pt.g_cache(spec_p, len(REMOTE_IDS) * spec_p.block_size, seed=5)
    prefill = pt.PackedNumpyEngine(cfg_p, NUM_BLOCKS, ("random", 1))
    prefill.write_request(g, REMOTE_IDS)
    decode = pt.PackedNumpyEngine(cfg_d, NUM_BLOCKS, pt.SENTINEL)
    prepped = pt.PackedNumpyEngine(cfg_d, NUM_BLOCKS, pt.SENTINEL)
    n_local = -(-len(REMOTE_IDS) // ratio) - hit
    local_ids = LOCAL_IDS[:n_local]
    plans = []
    for rank in range(cfg_d.world_size):
        plan = plan_read(meta_d, rank, meta_p, local_ids, REMOTE_IDS, layers=layers)
        test.assertEqual(plan.post, ())  # every row read into its final place
        tt.apply_plan(plan, decode, prefill)
        if ratio == 1:  # the same reads, as rows of the prepared descriptor tables
            for rr in plan.read_ranks:
                local_rows, remote_rows = plan.planner.block_table(rr)
                li, ri = plan.planner.prepped_indices(plan, rr)
                tt.apply_rows(local_rows[li], remote_rows[ri], prepped, prefill)
        want = pt.rank_arrays(cfg_d, rank, NUM_BLOCKS, pt.SENTINEL)
        masks = pt.fill_rank(cfg_d, rank, g, want, local_ids, hit * spec_d.block_size,
                             layers=layers)
        for region, expected in enumerate(want):
            np.testing.assert_array_equal(decode.arrays[rank][region], expected,
                                          err_msg=f"rank {rank} region {region}")
            if ratio == 1:
                np.testing.assert_array_equal(prepped.arrays[rank][region], expected,
                                              err_msg=f"prepped rank {rank} region {region}")
        payload = sum(int(m.sum()) for m in masks) * spec_d.itemsize
        test.assertEqual(plan.num_bytes, payload * len(local_ids), f"rank {rank}")
        plans.append(plan)
    return plans


TP_PAIRS = [(1, 1), (2, 1), (1, 2), (2, 4), (4, 2)]


class PackedPlanTest(parameterized.TestCase):
    @parameterized.product(
        tp=TP_PAIRS, dtype=["bfloat16", "float32", "float8_e4m3fn"], head_dim=[96, 128],
        ratio=[1, 2],
    )
    def test_packed_to_packed(self, tp, dtype, head_dim, ratio):
        spec_p = packed(4, head_dim, 4, dtype)
        plan_case(self, spec_p, spec_p.replace(block_size=4 * ratio), *tp)

    @parameterized.product(
        tp=TP_PAIRS, dtype=["bfloat16", "float32", "float8_e5m2"],
        layout=["THD", "HTD", "KTHD", "LKHTD"], ratio=[1, 2],
    )
    def test_packed_and_plain_both_ways(self, tp, dtype, layout, ratio):
        spec_p = packed(4, 96, 4, dtype)
        other = plain(4, 96, 4 * ratio, dtype, layout)
        plan_case(self, spec_p, other, *tp)
        plan_case(self, other.replace(block_size=4), spec_p.replace(block_size=4 * ratio), *tp)

    @parameterized.parameters(itertools.product(TP_PAIRS, ["HLTD", "LTHD", "THLD"]))
    def test_other_stored_layouts(self, tp, layout):
        # packed storage with the layer axis inside the block, anywhere (the slab planner
        # for plain caches needs L and K outside H and T; value rows do not)
        spec_p = packed(4, 96, 4, "float8_e4m3fn")
        other = KVCacheSpec(LAYERS, 4, 96, 4, "float8_e4m3fn", layout=layout,
                            kv_interleaved=True, packing=4, head_dim_alignment=32)
        plan_case(self, spec_p, other, *tp)
        plan_case(self, other, spec_p, *tp)

    @parameterized.parameters(itertools.product([(1, 1), (3, 1), (1, 3), (3, 3)], [1, 2]))
    def test_phantom_heads(self, tp, ratio):
        # 3 heads: 6 combined K/V heads in 2 words of 4 fp8 values (2 phantoms); one head
        # per rank at TP 3: 2 combined heads in one word (2 phantoms per rank).
        spec_p = packed(3, 40, 4, "float8_e4m3fn")
        plan_case(self, spec_p, spec_p.replace(block_size=4 * ratio), *tp)
        plan_case(self, spec_p, plain(3, 40, 4, "float8_e4m3fn", "KHTD"), *tp)

    @parameterized.parameters((2, 4), (4, 2), (1, 8), (8, 1))
    def test_replicated_heads(self, p_tp, d_tp):
        spec = packed(2, 64, 4, "bfloat16")
        plan_case(self, spec, spec, p_tp, d_tp)
        plan_case(self, spec, plain(2, 64, 4, "bfloat16", "HTD"), p_tp, d_tp)

    @parameterized.parameters(itertools.product([(1, 2), (2, 1)], [(1, 2), (2, 1), (2, 2)]))
    def test_pipeline_parallel_and_prefix_hit(self, tp, pp):
        spec_p = packed(4, 96, 4, "bfloat16", num_layers=3)
        spec_d = spec_p.replace(block_size=8)
        plan_case(self, spec_p, spec_d, *tp, p_pp=pp[0], d_pp=pp[1])
        plan_case(self, spec_p, spec_d, *tp, p_pp=pp[0], d_pp=pp[1], hit=1)

    @parameterized.parameters(((1, 2),), ((0, 1),), ((2, 3),))
    def test_layerwise(self, layers):
        # a layer-wise read: only these global layers (of 3) are written, on every PP rank
        spec_p = packed(4, 96, 4, "float8_e4m3fn", num_layers=3)
        plan_case(self, spec_p, spec_p, 2, 1, p_pp=3, d_pp=2, layers=layers)
        plan_case(self, spec_p, plain(4, 96, 4, "float8_e4m3fn", "LKHTD").replace(num_layers=3),
                  1, 2, d_pp=2, layers=layers)

    @parameterized.product(tp=[(1, 1), (1, 2), (2, 1)], dtype=["bfloat16", "float8_e4m3fn",
                                                                  "float32"], ratio=[1, 2])
    def test_mla(self, tp, dtype, ratio):
        # tokens packed: page 6 of fp8 is 2 words of 4 (2 phantom tokens per page)
        mla = KVCacheSpec.for_tpu_inference_mla(LAYERS, latent_dim=72, page_size=6, dtype=dtype)
        plan_case(self, mla, mla.replace(block_size=6 * ratio), *tp)
        other = KVCacheSpec.for_mla(LAYERS, 72, 6 * ratio, dtype=dtype, layout="LKTD")
        plan_case(self, mla, other, *tp)
        plan_case(self, other.replace(block_size=6), mla.replace(block_size=6 * ratio), *tp)
        plans = plan_case(self, mla, mla, *tp)
        self.assertLen(plans[0].read_ranks, 1)  # replicated: one remote rank read

    @parameterized.product(tp=TP_PAIRS, dtype=["bfloat16", "float32", "float8_e4m3fn"])
    def test_unpadded_runs_coalesce_like_word_columns(self, tp, dtype):
        # head_dim 128: no padding lanes, whole words of heads per rank. The descriptors are
        # exactly those of the byte-identical "word column" view (one THD "head" per word
        # column, K and V together) that the tpu-inference connector registered before.
        spec = packed(8, 128, 16, dtype)
        packing = spec.packing

        def view(tp_size):
            return KVCacheSpec(LAYERS, 2 * 8 // packing, packing * 128, 16, dtype,
                               layout="THD", kv_factor=1)

        ids = np.arange(20, 36)
        local = np.concatenate([np.arange(0, 8), np.arange(40, 48)])
        for p_tp, d_tp in (tp, tp[::-1]):
            real = plan_read(tt.fake_metadata("d", EngineConfig(spec, d_tp), 64), 0,
                             tt.fake_metadata("p", EngineConfig(spec, p_tp), 64), local, ids)
            word = plan_read(tt.fake_metadata("d", EngineConfig(view(d_tp), d_tp), 64), 0,
                             tt.fake_metadata("p", EngineConfig(view(p_tp), p_tp), 64), local,
                             ids)
            np.testing.assert_array_equal(real.copies, word.copies)

    def test_padded_rows_read_between_padding(self):
        # head_dim 96 of 128 lanes, same TP: one strided descriptor per layer and run of
        # blocks, 96 of every 128 lanes; never the padding.
        spec = packed(4, 96, 4, "bfloat16")
        meta = tt.fake_metadata("p", EngineConfig(spec, 1), NUM_BLOCKS)
        plan = plan_read(tt.fake_metadata("d", EngineConfig(spec, 1), NUM_BLOCKS), 0, meta,
                         [1, 2, 3], [5, 6, 7])
        self.assertEqual(plan.num_descriptors, LAYERS)
        row = plan.copies[0]
        self.assertEqual((row[5], row[6], row[7], row[8]), (96 * 2, 3 * 4 * 8, 256, 256))

    def test_unplannable_block_sizes_refused(self):
        spec = packed(4, 96, 4, "bfloat16")
        meta_p = tt.fake_metadata("p", EngineConfig(spec, 1), NUM_BLOCKS)
        meta_d = tt.fake_metadata("d", EngineConfig(spec.replace(block_size=6), 1), NUM_BLOCKS)
        with self.assertRaisesRegex(PlanError, "block size 6 is not a multiple of the remote 4"):
            plan_read(meta_d, 0, meta_p, [1], [1], check=False)


class PackedMirrorTest(absltest.TestCase):
    """Host mirrors of packed caches (no NIXL needed)."""

    def test_layerwise_stage_out_selects_the_stored_layer_axis(self):
        # The packed head axis is stored as two axes before L: a layer-wise copy into the
        # mirror must select L among the stored axes (H, h, L, T, D), not the layout letters.
        from jaxkv import PagedKVCache
        from jaxkv.transfer._staging import HostMirror

        spec = KVCacheSpec(2, 2, 8, 4, "bfloat16", layout="HLTD", kv_interleaved=True,
                           packing=2, head_dim_alignment=16)
        self.assertEqual(spec.block_axes(), ("H", "h", "L", "T", "D"))
        host = bits.random_bits(np.random.default_rng(0), spec.array_shape(6),
                                      spec.dtype)
        cache = PagedKVCache.from_arrays(spec, [host])
        mirror = HostMirror(cache)
        mirror.stage_out(cache, [1, 4], layers=(1, 2))
        got = next(iter(mirror.buffers.values())).view(np.uint16).reshape(6, *spec.block_shape())
        want = np.zeros_like(got)
        want[[1, 4], :, :, 1] = bits.bits(host)[[1, 4], :, :, 1]
        np.testing.assert_array_equal(got, want)


class PackedJitTest(absltest.TestCase):
    def test_written_token_depends_on_every_head_shard(self):
        # Tokens packed before the head axis (stored T, t, H, D): the token must read the
        # stored H axis (every TP shard), not the layout's third letter.

        from jaxkv import PagedKVCache
        from jaxkv.transfer._jit import written_token

        spec = KVCacheSpec(1, 2, 8, 4, "bfloat16", layout="THD", packing=2, packed_axis="T")
        self.assertEqual(spec.block_axes(), ("T", "t", "H", "D"))
        mesh = meshes.tp(2)
        host = np.zeros(spec.array_shape(4, tp_size=1), spec.dtype)
        zero = PagedKVCache.from_arrays(spec, [host, host], mesh=mesh)
        host = host.copy()
        host[0, 0, 0, 1, 0] = 1  # head 1: the second TP shard
        one = PagedKVCache.from_arrays(spec, [host, host], mesh=mesh)
        self.assertNotEqual(int(written_token(zero)), int(written_token(one)))


# -- real engines: producers in one child process, consumers here ------------------------------

REAL_REMOTE = [3, 4, 5, 9, 2, 0]
REAL_LOCAL = [6, 7, 8, 1, 0, 5]
G_SEED = 13
WAIT_S = 60.0


_READ_CASES = (
    # (name, producer spec, producer TP, consumer spec, consumer TP)
    ("bf16_tp2_to_tp1", packed(4, 96, 4, "bfloat16"), 2, packed(4, 96, 4, "bfloat16"), 1),
    ("bf16_tp2_to_tp4_ratio2", packed(4, 96, 4, "bfloat16"), 2,
     packed(4, 96, 8, "bfloat16"), 4),
    # fp8: one head per consumer rank = 2 combined heads in a word of 4 (2 phantoms)
    ("fp8_tp1_to_tp4", packed(4, 96, 4, "float8_e4m3fn"), 1,
     packed(4, 96, 4, "float8_e4m3fn"), 4),
    ("fp32_packed_to_nhd", packed(4, 96, 4, "float32"), 2, plain(4, 96, 4, "float32", "THD"),
     1),
    ("bf16_hnd_to_packed_ratio2", plain(4, 96, 4, "bfloat16", "KHTD"), 2,
     packed(4, 96, 8, "bfloat16"), 1),
    ("fp8_packed_to_hnd_tp4", packed(4, 128, 4, "float8_e4m3fn"), 4,
     plain(4, 128, 4, "float8_e4m3fn", "HTD"), 2),
    # MLA: fp8 tokens packed 4 per word, page 6 -> 2 phantom tokens per page
    ("mla_fp8_to_plain", KVCacheSpec.for_tpu_inference_mla(LAYERS, 72, 6, "float8_e4m3fn"),
     1, KVCacheSpec.for_mla(LAYERS, 72, 6, "float8_e4m3fn", layout="LKTD"), 2),
    ("mla_plain_to_bf16_ratio2", KVCacheSpec.for_mla(LAYERS, 72, 6, "bfloat16"), 2,
     KVCacheSpec.for_tpu_inference_mla(LAYERS, 72, 12, "bfloat16"), 1),
)


@pytest.mark.skipif(not nixl_available(), reason="NIXL (nixl-cu13) is not installed")
class PackedTransferTest(parameterized.TestCase):
    """Reads over NIXL between real engines: the producers live in one child process (4
    CPU devices) shared by every case, each consumer in this process."""

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.process, cls.conn = processes.spawn(pt.producer_main, 4)
        if not cls.conn.poll(WAIT_S):
            raise TimeoutError("producer process did not start")
        assert cls.conn.recv() == "ready"

    @classmethod
    def tearDownClass(cls):
        processes.stop(cls.process, cls.conn)
        super().tearDownClass()

    def call(self, *command):
        self.conn.send(command)
        if not self.conn.poll(WAIT_S):
            raise TimeoutError(f"producer did not answer {command[0]!r}")
        return self.conn.recv()

    def read(self, name, spec_p, p_tp, spec_d, d_tp, **engine_kwargs):
        """Producer `spec_p` over `p_tp` ranks -> consumer `spec_d` over `d_tp` ranks (its
        cache all sentinel bytes); checks every shard of the consumer bit for bit."""

        from jaxkv.transfer import TransferEngine

        num_tokens = len(REAL_REMOTE) * spec_p.block_size
        self.call("engine", name, spec_p, p_tp, G_SEED, num_tokens, NUM_BLOCKS, REAL_REMOTE,
                  engine_kwargs)
        self.addCleanup(self.call, "close", name)
        params = self.call("pin", name, "req", REAL_REMOTE, 30.0)
        config = EngineConfig(spec_d, d_tp)
        mesh = meshes.tp(d_tp)
        cache = pt.make_cache(config, NUM_BLOCKS, pt.SENTINEL, mesh=mesh)
        engine = TransferEngine(f"decode-{name}", config, **engine_kwargs)
        self.addCleanup(engine.close)
        engine.register_cache(cache)
        ratio = spec_d.block_size // spec_p.block_size
        local_ids = REAL_LOCAL[: len(REAL_REMOTE) // ratio]
        engine.start_read(params, local_ids)
        finished, failed, applied = [], [], {}
        deadline = time.monotonic() + WAIT_S
        while not finished and not failed and time.monotonic() < deadline:
            result = engine.poll()
            finished += result.finished
            failed += result.failed
            applied.update(result.post_applied)
        self.assertEqual((finished, failed), (["req"], []))
        self.assertNotIn("req", applied)  # every row read into place: nothing rewritten
        g = pt.g_cache(spec_p, num_tokens, G_SEED)
        devices = {d.id: tp for tp, d in enumerate(mesh.devices.reshape(-1))}
        payload = 0
        for index, array in enumerate(cache.arrays):
            for shard in array.addressable_shards:
                rank = devices[shard.device.id]
                want = pt.expected_rank_arrays(config, rank, NUM_BLOCKS, pt.SENTINEL, g,
                                               local_ids)[index]
                got = bits.bits(np.asarray(shard.data))
                np.testing.assert_array_equal(got, want, err_msg=f"array {index} rank {rank}")
            payload += sum(spec_d.payload_nbytes(d_tp) for _ in range(d_tp))
        self.assertEqual(engine.stats.records[-1].bytes, payload * len(local_ids))
        engine.check_registrations(cache)
        deadline = time.monotonic() + WAIT_S
        while self.call("state", name)[1] != ["req"] and time.monotonic() < deadline:
            time.sleep(0.01)
        self.assertEqual(self.call("state", name), (0, ["req"]))
        return engine

    @parameterized.named_parameters(*_READ_CASES)
    def test_read(self, spec_p, p_tp, spec_d, d_tp):
        self.read(self._testMethodName.replace("test_read_", ""), spec_p, p_tp, spec_d, d_tp)

    @parameterized.named_parameters(*_READ_CASES)
    def test_formatted_read(self, spec_p, p_tp, spec_d, d_tp):
        # the same reads gathered by the producer and scattered here (few large READs
        # instead of one chunk per value row): the same bytes land
        engine = self.read(self._testMethodName.replace("test_formatted_read_", "fmt-"),
                           spec_p, p_tp, spec_d, d_tp, formatted_reads="always")
        self.assertEqual(engine.stats_of().records[-1].path, "formatted")

    def test_host_staged(self):
        # both engines read / serve through pinned host mirrors (as on TPU): the mirror holds
        # the padded blocks, the rows land in the cache's own padded blocks
        self.read("staged", packed(4, 96, 4, "bfloat16"), 2, packed(4, 96, 4, "bfloat16"), 4,
                  host_staging=True)

    def test_host_staged_formatted(self):
        # formatted reads gather from the producer's mirror and scatter into the consumer's
        engine = self.read("staged-fmt", packed(4, 96, 4, "bfloat16"), 2,
                           packed(4, 96, 4, "bfloat16"), 4, host_staging=True,
                           formatted_reads="always")
        self.assertEqual(engine.stats_of().records[-1].path, "formatted")


if __name__ == "__main__":
    absltest.main()
