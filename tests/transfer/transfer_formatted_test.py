"""Formatted reads over NIXL (`jaxkv.transfer._formatted`) between a producer process and this
process: bit exact over the heterogeneous grid, the path chosen and reported, chunking, pool
budgets, failures."""

from __future__ import annotations

import os

os.environ.setdefault("UCX_TLS", "tcp,sm,self")


import time  # noqa: E402
from unittest import mock  # noqa: E402

from support import platforms  # noqa: E402

platforms.force_cpu_devices()

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from absl.testing import absltest, parameterized  # noqa: E402
from support import transfer as tt  # noqa: E402

from jaxkv import KVCacheSpec  # noqa: E402
from jaxkv.transfer import nixl_available  # noqa: E402

NUM_BLOCKS, REMOTE_IDS, LOCAL_IDS, G_SEED = tt.NUM_BLOCKS, tt.REMOTE_IDS, tt.LOCAL_IDS, tt.G_SEED
WAIT_S = tt.WAIT_S
# the small cache of the failure and lifecycle tests
SMALL_HTD = dict(num_layers=2, num_kv_heads=4, head_dim=8, block_size=4, dtype="bfloat16",
                 layout="HTD")


class _Registrar:
    """Records what a pool registers (the pool's only use of its agent)."""

    def __init__(self):
        self.regions = []

    def register(self, regions):
        self.regions += regions

    def deregister(self, regions):
        for region in regions:
            self.regions.remove(region)


class _Agent(_Registrar):
    """What a `FormattedFetch` uses of a `NixlAgent`: READs that complete at once."""

    def __init__(self):
        super().__init__()
        self.reads, self.released = [], []

    def read(self, local, remote, remote_name, *memory, notif=b""):
        self.reads.append((local, remote))
        return len(self.reads)

    def state(self, handle):
        return "DONE"

    def release(self, handle):
        self.released.append(handle)
        return True


class _Scatter:
    """A background scatter the test finishes (`RowCopy`'s interface)."""

    def __init__(self, finished=False):
        self.finished, self.waited = finished, []

    def done(self):
        return self.finished

    def wait(self, timeout_s):
        self.waited.append(timeout_s)
        return self.finished


def _fragmented_case(p_tp, d_tp, layout, packed, seed):
    """(producer metadata, consumer metadata, local ids, remote ids): 20 random blocks of a
    64-block pool on both sides, tpu-inference's packed cache (head_dim 96) or a 4-layer
    cache of `layout`."""
    from jaxkv import EngineConfig

    spec = (KVCacheSpec.for_tpu_inference(4, 8, 96, 16, "bfloat16") if packed
            else KVCacheSpec(4, 8, 32, 16, "bfloat16", layout=layout))
    meta_p = tt.fake_metadata("prefill", EngineConfig(spec, p_tp), 64)
    meta_d = tt.fake_metadata("decode", EngineConfig(spec, d_tp), 64)
    rng = np.random.default_rng(seed)
    remote, local = rng.permutation(64)[:20], rng.permutation(64)[:20]
    return meta_p, meta_d, local, remote


class FormattedPiecesTest(parameterized.TestCase):
    def test_pool_slots_are_first_fit_aligned_and_merge_when_freed(self):
        from jaxkv.transfer._formatted import HostPool

        agent = _Registrar()
        pool = HostPool(agent, 1024)
        self.assertEqual(agent.regions, [(pool.address, 1024, 0, "DRAM")])
        a, b, c = pool.alloc(100), pool.alloc(64), pool.alloc(1)
        self.assertEqual((a, b, c), (0, 128, 192))
        self.assertIsNone(pool.alloc(1024))
        pool.free(b)
        self.assertEqual(pool.alloc(64), 128)  # the freed slot, first fit
        pool.free(a), pool.free(128), pool.free(c), pool.free(c)  # a second free is ignored
        self.assertEqual((pool.used_bytes, pool.alloc(1024)), (0, 0))
        pool.close()
        self.assertEqual(agent.regions, [])

    def test_chunks_cut_rows_without_reordering_bytes(self):
        from jaxkv.transfer._formatted import chunk_bounds, wire_offsets

        rows = np.zeros((3, 9), np.int64)
        rows[:, 5], rows[:, 6], rows[:, 7], rows[:, 8] = 100, 1, 100, 100  # len, count, strides
        rows[1, 6] = 7  # a strided row of 7 chunks
        rows[2, 5] = 1000  # a chunk longer than a wire chunk
        split, bounds = chunk_bounds(rows, 300)
        chunks = [split[a:b] for a, b in bounds]
        self.assertTrue(all(wire_offsets(c[:, 5], c[:, 6])[1] <= 300 for c in chunks))
        every = np.concatenate(chunks)
        # the same byte ranges in the same order: remote starts of each chunk, in order
        def starts(r):
            return [int(x[2] + k * x[7] + j) for x in r for k in range(x[6])
                    for j in range(0, x[5], 1)]
        self.assertEqual(starts(every), starts(rows))

    @parameterized.parameters(
        # (p_tp, d_tp, layout, packed): fragmented ids, every form a real plan makes
        (8, 4, "HTD", False), (2, 1, "LKHTD", False), (1, 2, "KTHD", False), (2, 1, None, True))
    def test_template_form_names_the_same_ranges(self, p_tp, d_tp, layout, packed):
        # a fragmented request's rows as per-block templates: the producer's expansion of
        # every chunk equals the explicit ranges, chunk by chunk
        from jaxkv.transfer._formatted import (
            chunk_bounds,
            expand_templates,
            remote_half,
            template_form,
        )
        from jaxkv.transfer._plan import plan_read

        meta_p, meta_d, local, remote = _fragmented_case(p_tp, d_tp, layout, packed, seed=0)
        plan = plan_read(meta_d, 0, meta_p, local, remote)
        for rr in plan.read_ranks:
            lens = np.array([r.block_len for r in meta_p.rank_info(rr).regions])
            rows, bounds = chunk_bounds(plan.copies_for(rr), 4096)
            templates = template_form(rows, plan.remote_block_ids, lens)
            self.assertIsNotNone(templates)
            self.assertLess(templates.size, rows.size // 10)  # far smaller than the rows
            self.assertGreater(len(bounds), 1)
            for first, stop in bounds:
                got = expand_templates(templates, lens, plan.remote_block_ids, first,
                                       stop - first)
                self.assertEqual(got.astype("<i8").tobytes(), remote_half(rows[first:stop]))
        # contiguous ids: rows merged over runs have no template form; where they did not
        # merge, the form (if any) still names the same ranges
        plan = plan_read(meta_d, 0, meta_p, np.arange(20), np.arange(20) + 3)
        for rr in plan.read_ranks:
            rows = plan.copies_for(rr)
            lens = np.array([r.block_len for r in meta_p.rank_info(rr).regions])
            templates = template_form(rows, plan.remote_block_ids, lens)
            if len(rows) % 20:
                self.assertIsNone(templates)
            elif templates is not None:
                got = expand_templates(templates, lens, plan.remote_block_ids, 0, len(rows))
                self.assertEqual(got.astype("<i8").tobytes(), remote_half(rows))
        with self.assertRaisesRegex(ValueError, "outside"):
            expand_templates(np.zeros((2, 5), np.int64), lens, np.arange(3), 5, 2)

    @parameterized.product(
        geometry=[(8, 4, "HTD", False), (2, 1, "LKHTD", False), (1, 2, "KTHD", False),
                  (2, 1, None, True), (4, 8, "HTD", False)],
        chunk_bytes=[512, 4096, 100_000, 1 << 30],
    )
    def test_block_share_cut_equals_the_rows_cut(self, geometry, chunk_bytes):
        # a fragmented share cut from its templates (no rows built) gives the chunks and
        # templates the explicit rows give, and each chunk's rows are those rows
        from jaxkv.transfer._formatted import (
            block_share_chunks,
            chunk_bounds,
            template_form,
            wire_offsets,
        )
        from jaxkv.transfer._plan import plan_read

        p_tp, d_tp, layout, packed = geometry
        meta_p, meta_d, local, remote = _fragmented_case(p_tp, d_tp, layout, packed, seed=1)
        for rank in range(d_tp):
            plan = plan_read(meta_d, rank, meta_p, local, remote)
            for rr in plan.read_ranks:
                lens = [r.block_len for r in meta_p.rank_info(rr).regions]
                share = plan.block_share(rr)
                cut = block_share_chunks(share, chunk_bytes, lens)
                rows = plan.copies_for(rr)
                if int((rows[:, 5] * rows[:, 6]).max()) > chunk_bytes:
                    self.assertIsNone(cut)  # rows would be split: the explicit path
                    continue
                chunks, templates = cut
                split, bounds = chunk_bounds(rows, chunk_bytes)
                self.assertEqual([(a, b) for a, b, _ in chunks], bounds)
                self.assertEqual([n for _, _, n in chunks],
                                 [wire_offsets(split[a:b, 5], split[a:b, 6])[1]
                                  for a, b in bounds])
                np.testing.assert_array_equal(
                    templates, template_form(rows, plan.remote_block_ids, np.array(lens)))
                for a, b, _ in chunks:
                    np.testing.assert_array_equal(share.rows(a, b), rows[a:b])
        # a remote block length its region does not have: no per-block description
        self.assertIsNone(block_share_chunks(share, 1 << 30, [lens[0] + 1] * len(lens)))

    def test_copy_rows_checks_every_row_before_copying(self):
        from jaxkv.transfer._formatted import gather_rows

        src = np.arange(256, dtype=np.uint8)
        dst = np.zeros(64, np.uint8)
        regions = [(src.ctypes.data, 256)]
        gather_rows(np.array([[0, 10, 4, 3, 100]]), regions, dst.ctypes.data, 64)
        np.testing.assert_array_equal(dst[:12], [10, 11, 12, 13, 110, 111, 112, 113, 210, 211,
                                                 212, 213])
        dst[:] = 0
        bad = np.array([[0, 0, 8, 1, 0], [0, 250, 8, 1, 0]])  # the second reaches past 256
        with self.assertRaisesRegex(IndexError, "row 1 reaches outside"):
            gather_rows(bad, regions, dst.ctypes.data, 64)
        self.assertFalse(dst.any())  # not even the first row moved
        with self.assertRaisesRegex(IndexError, "the buffer holds 4"):
            gather_rows(np.array([[0, 0, 8, 1, 0]]), regions, dst.ctypes.data, 4)
        with self.assertRaisesRegex(IndexError, "outside"):
            gather_rows(np.array([[1, 0, 8, 1, 0]]), regions, dst.ctypes.data, 64)  # region 1

    @parameterized.parameters(False, True)
    def test_copy_rows_moves_exactly_the_rows(self, background):
        # Rows of every kind the engine copies: short and long, strided, unaligned, from two
        # regions into two; 3 MiB in all, so the large-copy code (streaming stores, prefetch
        # of the chunks ahead) runs. Checked byte for byte against numpy, gaps untouched.
        from jaxkv import _ffi_cpu

        rng = np.random.default_rng(7)
        sources = [rng.integers(0, 256, 3 << 20, dtype=np.uint8) for _ in range(2)]
        targets = [np.zeros(5 << 20, np.uint8) for _ in range(2)]
        expected = [t.copy() for t in targets]
        rows, cursor = [], [int(rng.integers(0, 64)), 0]
        for i in range(600):
            length = int(rng.choice([1, 7, 16, 64, 100, 192, 4096, 12_288]))
            count = int(rng.integers(1, 4))
            s_stride = length + int(rng.integers(0, 3)) * 64
            d_stride = length + int(rng.integers(0, 2)) * 32
            src, dst = i % 2, (i // 2) % 2
            s_off = int(rng.integers(0, len(sources[src]) - s_stride * count))
            d_off = cursor[dst] + int(rng.integers(0, 40))  # unaligned, never overlapping
            if d_off + d_stride * count > len(targets[dst]):
                break
            cursor[dst] = d_off + d_stride * count
            rows.append([src, s_off, dst, d_off, length, count, s_stride, d_stride])
            for c in range(count):
                expected[dst][d_off + c * d_stride:d_off + c * d_stride + length] = \
                    sources[src][s_off + c * s_stride:s_off + c * s_stride + length]
        self.assertGreater(sum(r[4] * r[5] for r in rows), 2 << 20)
        args = (np.array([a.ctypes.data for a in sources], np.uint64),
                np.array([a.nbytes for a in sources], np.int64),
                np.array([a.ctypes.data for a in targets], np.uint64),
                np.array([a.nbytes for a in targets], np.int64), np.array(rows, np.int64))
        if background:
            copy = _ffi_cpu.RowCopy(*args)
            self.assertTrue(copy.wait(WAIT_S))
            self.assertTrue(copy.done())
        else:
            _ffi_cpu.copy_rows(*args)
        for got, want in zip(targets, expected):
            np.testing.assert_array_equal(got, want)

    def test_background_copy_checks_rows_before_it_starts(self):
        from jaxkv import _ffi_cpu

        src, dst = np.arange(256, dtype=np.uint8), np.zeros(64, np.uint8)
        args = (np.array([src.ctypes.data], np.uint64), np.array([256], np.int64),
                np.array([dst.ctypes.data], np.uint64), np.array([64], np.int64))
        with self.assertRaisesRegex(IndexError, "row 1 reaches outside"):
            _ffi_cpu.RowCopy(*args, np.array([[0, 0, 0, 0, 8, 1, 8, 8],
                                              [0, 0, 0, 60, 8, 1, 8, 8]], np.int64))
        self.assertFalse(dst.any())

    def _one_chunk_fetch(self, regions_current=lambda: True):
        """(fetch, pool, agent, destination): a fetch of one 64-byte chunk, answered by its
        producer and READ (the fake agent's READs complete at once), its bytes in the slot."""
        from jaxkv.transfer._formatted import FormattedFetch, HostPool

        agent = _Agent()
        pool = HostPool(agent, 1024)
        destination = np.zeros(64, np.uint8)
        rows = np.array([[0, 0, 0, 0, 0, 64, 1, 64, 64]], np.int64)  # COPY_COLUMNS
        fetch = FormattedFetch(agent, pool, "producer", 0, 0, rows,
                               [(destination.ctypes.data, 64)], 64, lambda *a: True,
                               lambda chunk: b"", regions_current)
        slot = fetch.chunks[0].slot
        pool.buffer[slot:slot + 64] = np.arange(64, dtype=np.uint8) + 1
        fetch.on_formatted(0, address=4096, nbytes=64, error="")
        self.assertEqual(fetch.chunks[0].state, "reading")
        self.addCleanup(pool.close)
        return fetch, pool, agent, destination

    def test_background_scatter_finishes_before_the_chunk_counts(self):
        from jaxkv.transfer import _formatted

        self.enter_context(mock.patch.object(_formatted, "BACKGROUND_SCATTER_BYTES", 0))
        fetch, pool, agent, destination = self._one_chunk_fetch()
        states = [fetch.check()]
        deadline = time.monotonic() + WAIT_S
        while states[-1] == "PROC" and time.monotonic() < deadline:
            states.append(fetch.check())
        self.assertEqual(states[-1], "DONE")
        np.testing.assert_array_equal(destination, np.arange(64, dtype=np.uint8) + 1)
        self.assertEqual((pool.used_bytes, agent.released), (0, [1]))

    def test_cache_reregistered_while_scattering_fails_the_fetch(self):
        from jaxkv.transfer import _formatted

        scatter = _Scatter()
        self.enter_context(mock.patch.object(_formatted, "BACKGROUND_SCATTER_BYTES", 0))
        self.enter_context(mock.patch.object(_formatted, "scatter_rows",
                                             lambda *a, background: scatter))
        current = [True]
        fetch, pool, _, _ = self._one_chunk_fetch(lambda: current[0])
        self.assertEqual(fetch.check(), "PROC")
        self.assertEqual(fetch.chunks[0].state, "scattering")
        current[0] = False  # the local cache re-registered while the chunk is copied
        self.assertEqual(fetch.check(), "PROC")  # nothing decided while it copies
        scatter.finished = True
        self.assertEqual(fetch.check(), "ERR")
        self.assertRegex(fetch.error, "re-registered during the read")

    @parameterized.parameters(True, False)
    def test_release_waits_for_a_scatter_under_way(self, finishes):
        # a read released (failed, aborted) while a chunk is copied: the copy is waited for;
        # one that does not finish keeps its receive slot (never reused while written)
        from jaxkv.transfer import _formatted

        scatter = _Scatter(finished=False)
        self.enter_context(mock.patch.object(_formatted, "BACKGROUND_SCATTER_BYTES", 0))
        self.enter_context(mock.patch.object(_formatted, "scatter_rows",
                                             lambda *a, background: scatter))
        fetch, pool, _, _ = self._one_chunk_fetch()
        self.assertEqual(fetch.check(), "PROC")
        scatter.finished = finishes
        self.assertEqual(fetch.release(scatter_timeout_s=0.5), finishes)
        self.assertEqual(scatter.waited, [0.5])
        self.assertEqual(pool.used_bytes, 0 if finishes else 64)

    def test_costs_pick_the_cheaper_path_and_calibrate(self):
        from jaxkv.transfer._formatted import PathCosts

        costs = PathCosts()
        nbytes = 64 << 20
        # 350k value rows (packed head_dim 96): formatted; 64 whole-block runs: direct
        self.assertLess(costs.formatted_s(2, nbytes), costs.direct_s(350_000, nbytes))
        self.assertGreater(costs.formatted_s(2, nbytes), costs.direct_s(64, nbytes))
        before = costs.descriptor_s
        costs.observe_direct(100_000, nbytes, 1.0)  # much slower descriptors than assumed
        self.assertGreater(costs.descriptor_s, before)
        # a formatted read slower than assumed moves the line: 4,096 descriptors stay direct
        self.assertLess(costs.formatted_s(2, nbytes), costs.direct_s(4096, nbytes))
        for _ in range(12):  # each observation weighs half: converges to what it measures
            costs.observe_formatted(2, nbytes, 0.5)
        self.assertGreater(costs.formatted_s(2, nbytes), costs.direct_s(4096, nbytes))
        self.assertAlmostEqual(costs.formatted_bps, nbytes / 0.499, delta=0.02 * nbytes / 0.5)


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

    @parameterized.parameters("full", "sampled:2")
    def test_digests_verify_formatted_reads(self, digests):
        # the bytes land where a direct read puts them: the producer's digests verify them
        engine, _ = self.read_case(2, 1, "KHTD", "KTHD", digests=digests)
        self.assertEqual(engine.stats.records[-1].path, "formatted")
        self.assertGreater(engine.stats.digest_verified, 0)
        self.assertEqual(engine.stats.digest_mismatches, 0)

    @parameterized.parameters(
        # (p_tp, d_tp, p_layout, d_layout, chunk_bytes)
        (2, 1, "HTD", "HTD", None), (1, 2, "LKHTD", "LKHTD", 256), (4, 2, "KTHD", "KHTD", 64),
        (2, 4, "THD", "THD", None))
    def test_fragmented_ids_read_from_per_block_templates(self, p_tp, d_tp, p_layout,
                                                          d_layout, chunk_bytes):
        # no two ids consecutive on both sides: every share is cut, described and scattered
        # from its per-block templates (no rows built); the bytes land as a direct read's
        from jaxkv.transfer import _formatted

        scrambled = [14, 7, 12, 9, 13, 8]  # against REMOTE_IDS [3, 4, 5, 9, 10, 2]
        cuts = []

        def recording(*args, **kwargs):
            cuts.append(_cut(*args, **kwargs))
            return cuts[-1]

        _cut = _formatted.block_share_chunks
        self.enter_context(mock.patch.object(_formatted, "block_share_chunks", recording))
        engine, _ = self.read_case(p_tp, d_tp, p_layout, d_layout, chunk_bytes=chunk_bytes,
                                   local_ids=scrambled)
        self.assertEqual(engine.stats.records[-1].path, "formatted")
        self.assertTrue(cuts and all(c is not None for c in cuts), cuts)
        if chunk_bytes is not None:  # several chunks per share, each naming its templates
            self.assertGreater(max(len(c[0]) for c in cuts), 1)

    @parameterized.parameters(
        # (p_tp, d_tp, p_layout, d_layout, ratio, scrambled local ids)
        (2, 1, "HTD", "HTD", 1, False), (2, 2, "KHTD", "KTHD", 2, False),
        (4, 2, "KTHD", "KHTD", 1, True))
    def test_chunks_scattered_in_the_background_land_exactly(self, p_tp, d_tp, p_layout,
                                                             d_layout, ratio, scrambled):
        # every chunk scattered on its own thread (`RowCopy`) while this one polls: the read
        # is reported only once each landed, the bytes as a direct read's
        from jaxkv.transfer import _formatted

        backgrounds = []

        def recording(*args, background=False):
            backgrounds.append(background)
            return _scatter(*args, background=background)

        _scatter = _formatted.scatter_rows
        self.enter_context(mock.patch.object(_formatted, "scatter_rows", recording))
        self.enter_context(mock.patch.object(_formatted, "BACKGROUND_SCATTER_BYTES", 0))
        engine, _ = self.read_case(p_tp, d_tp, p_layout, d_layout, ratio=ratio, chunk_bytes=256,
                                   local_ids=[14, 7, 12, 9, 13, 8][:6 // ratio] if scrambled
                                   else None)
        self.assertEqual(engine.stats.records[-1].path, "formatted")
        self.assertGreater(len(backgrounds), 1)
        self.assertTrue(all(backgrounds), backgrounds)

    @parameterized.parameters((1, 2, 1), (2, 1, 2))
    def test_mla(self, p_tp, d_tp, ratio):
        self.read_case(p_tp, d_tp, "LKTD", "LKTD", ratio=ratio, mla=True)

    def test_small_chunks_pipeline_through_small_pools(self):
        # 256-byte chunks through 2 KiB pools: most chunks wait for a free slot on both
        # sides (the producer's freed by the READ's notification), the bytes still land.
        engine, _ = self.read_case(2, 1, "HTD", "HTD", pool_bytes=2048, chunk_bytes=256)
        record = engine.stats.records[-1]
        self.assertEqual(record.path, "formatted")
        self.assertGreater(record.bytes, 2 * 2048)  # more than both pools hold at once

    @parameterized.parameters((1e-3, "formatted"), (1e-12, "direct"))
    def test_auto_picks_by_cost(self, descriptor_s, path):
        # "auto" compares the two estimates: with a per-descriptor cost this high (or low)
        # the same read goes formatted (or direct); both land the same bytes.
        from jaxkv.transfer import _consumer
        from jaxkv.transfer._formatted import PathCosts

        self.enter_context(mock.patch.object(_consumer, "MIN_FORMATTED_BYTES", 0))
        costs = PathCosts(descriptor_s=descriptor_s)
        engine, _ = self.read_case(2, 1, "HTD", "HTD", mode="auto",
                                   before_read=lambda e: e.consumer.costs.update(prefill=costs))
        self.assertEqual(engine.stats.records[-1].path, path)
        self.assertIs(engine.consumer.costs["prefill"], costs)

    def test_small_reads_stay_direct_in_auto_mode(self):
        engine, _ = self.read_case(2, 1, "HTD", "HTD", mode="auto")
        self.assertEqual(engine.stats.records[-1].path, "direct")
        self.assertEqual(engine.stats.formatted_total, 0)

    def test_chunk_larger_than_the_send_pool_fails_clearly(self):
        # the producer's pool cannot hold one chunk: its answer names the pool, the read
        # fails with every local block invalid, the consumer's slots are all returned
        spec_kwargs = SMALL_HTD
        _, conn = self.start_producer(spec_kwargs, 1, engine_kwargs=dict(format_pool_bytes=256))
        self.ready(conn)
        self.call(conn, "register", REMOTE_IDS)
        params = self.call(conn, "pin", "req-1", REMOTE_IDS, 30.0)
        engine, cache, _ = self.consumer(KVCacheSpec(**spec_kwargs), 1,
                                         formatted_reads="always")
        engine.start_read(params, LOCAL_IDS)
        finished, failed = self.wait(engine, ["req-1"])
        self.assertEqual(finished, [])
        self.assertRegex(failed[0].reason, "exceeds the 256-byte send pool")
        self.assertEqual(sorted(failed[0].invalid_block_ids), sorted(LOCAL_IDS))
        self.assertEqual(engine.transport.receive_pool.used_bytes, 0)
        self.assertFalse(np.asarray(cache.arrays[0]).view(np.uint16).any())  # nothing landed
        self.assertEqual(self.call(conn, "pool"), 0)  # nothing gathered, nothing held

    def test_gathering_waits_for_a_donated_cache(self):
        # a step consumed the producer's registered cache and has not handed its output over:
        # nothing is gathered from memory the cache may no longer own until update_cache
        spec_kwargs = SMALL_HTD
        _, conn = self.start_producer(spec_kwargs, 1)
        self.ready(conn)
        self.call(conn, "register", REMOTE_IDS)
        params = self.call(conn, "pin", "req-1", REMOTE_IDS, 30.0)
        self.assertTrue(self.call(conn, "donate"))
        engine, cache, config = self.consumer(KVCacheSpec(**spec_kwargs), 1,
                                              formatted_reads="always")
        engine.start_read(params, LOCAL_IDS)
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline:  # the producer polls meanwhile: nothing gathered
            result = engine.poll()
            self.assertEqual((result.finished, result.failed), ([], []))
        self.assertEqual(self.call(conn, "pool"), 0)
        self.call(conn, "adopt")
        self.assertEqual(self.wait(engine, ["req-1"]), (["req-1"], []))
        g = tt.global_cache(KVCacheSpec(**spec_kwargs), len(REMOTE_IDS) * 4, seed=G_SEED)
        self.check_cache(cache, config, g, LOCAL_IDS)

    def test_producer_killed_mid_read_fails_the_read(self):
        # a producer that serves one chunk at a time (4 KiB pool, slow polls) dies after the
        # read started: the read fails by its deadline with every block invalid, and every
        # receive slot is returned
        spec_kwargs = SMALL_HTD
        process, conn = self.start_producer(spec_kwargs, 1,
                                            engine_kwargs=dict(format_pool_bytes=1024))
        self.ready(conn)
        self.call(conn, "register", REMOTE_IDS)
        params = self.call(conn, "pin", "req-1", REMOTE_IDS, 30.0)
        self.call(conn, "slow", 0.2)
        engine, _, _ = self.consumer(KVCacheSpec(**spec_kwargs), 1, formatted_reads="always",
                                     format_pool_bytes=1024, read_timeout_s=3.0)
        engine.transport.chunk_bytes = 256
        engine.start_read(params, LOCAL_IDS)
        deadline = time.monotonic() + WAIT_S
        while (time.monotonic() < deadline and not any(
                c.state == "done" for f in engine.consumer.reading["req-1"].formatted
                for c in f.chunks)):
            engine.poll()
        process.kill()
        finished, failed = self.wait(engine, ["req-1"])
        self.assertEqual(finished, [])
        self.assertEqual(sorted(failed[0].invalid_block_ids), sorted(LOCAL_IDS))
        self.assertEqual(engine.transport.receive_pool.used_bytes, 0)

    def test_read_planned_before_producer_reregistered_fails_as_stale(self):
        # the consumer planned against the producer's old regions: the producer refuses to
        # gather (its answer says stale), the read fails with every block invalid
        spec_kwargs = SMALL_HTD
        _, conn = self.start_producer(spec_kwargs, 1)
        self.ready(conn)
        address = self.call(conn, "register", REMOTE_IDS)
        engine, _, _ = self.consumer(KVCacheSpec(**spec_kwargs), 1, formatted_reads="always")
        engine.add_peer("prefill", [address])
        old = self.call(conn, "pin", "req-a", REMOTE_IDS, 30.0)
        self.call(conn, "register", REMOTE_IDS)  # new buffers, a new generation
        engine.start_read(old, LOCAL_IDS)
        finished, failed = self.wait(engine, ["req-a"])
        self.assertEqual(finished, [])
        self.assertRegex(failed[0].reason, "stale")
        self.assertEqual(sorted(failed[0].invalid_block_ids), sorted(LOCAL_IDS))
        self.assertEqual(self.call(conn, "pool"), 0)

    def test_local_cache_reregistered_mid_read_is_not_written(self):
        # the consumer's cache is replaced while a chunk is on its way: the chunk is not
        # scattered into the old buffers, the read fails
        spec_kwargs = SMALL_HTD
        _, conn = self.start_producer(spec_kwargs, 1)
        self.ready(conn)
        self.call(conn, "register", REMOTE_IDS)
        params = self.call(conn, "pin", "req-1", REMOTE_IDS, 30.0)
        spec = KVCacheSpec(**spec_kwargs)
        # no background progress: nothing moves here before the poll after re-registering
        engine, old_cache, config = self.consumer(spec, 1, formatted_reads="always",
                                                  progress_interval_s=None)
        engine.start_read(params, LOCAL_IDS)
        from jaxkv import PagedKVCache

        new_cache = PagedKVCache.allocate(config.local_spec(0), NUM_BLOCKS)
        engine.register_cache(new_cache)  # replaces the registration: a new generation
        finished, failed = self.wait(engine, ["req-1"])
        self.assertEqual(finished, [])
        self.assertRegex(failed[0].reason, "local cache was re-registered")
        for cache in (old_cache, new_cache):
            self.assertFalse(np.asarray(cache.arrays[0]).view(np.uint16).any())

    def read_case(self, p_tp, d_tp, p_layout, d_layout, heads=4, dtype="bfloat16", ratio=1,
                  mla=False, pool_bytes=None, chunk_bytes=None, mode="always",
                  before_read=None, digests="off", local_ids=None):
        spec_kwargs = dict(num_layers=2, num_kv_heads=heads, head_dim=8, block_size=4,
                           dtype=dtype, layout=p_layout)
        if mla:
            spec_kwargs.update(num_kv_heads=1, kv_factor=1, mla=True)
        engine_kwargs = {} if pool_bytes is None else dict(format_pool_bytes=pool_bytes)
        engine_kwargs["digests"] = digests
        _, conn = self.start_producer(spec_kwargs, p_tp, engine_kwargs=engine_kwargs)
        self.ready(conn)
        self.call(conn, "register", REMOTE_IDS)
        params = self.call(conn, "pin", "req-1", REMOTE_IDS, 30.0)
        spec_d = KVCacheSpec(**dict(spec_kwargs, layout=d_layout, block_size=4 * ratio))
        engine, cache, config = self.consumer(spec_d, d_tp, formatted_reads=mode,
                                              **engine_kwargs)
        if chunk_bytes is not None:
            engine.transport.chunk_bytes = chunk_bytes
        if before_read is not None:
            before_read(engine)
        if local_ids is None:
            local_ids = LOCAL_IDS[: len(REMOTE_IDS) // ratio]
        engine.start_read(params, local_ids)
        finished, failed = self.wait(engine, ["req-1"])
        self.assertEqual((finished, [f.reason for f in failed]), (["req-1"], []))
        g = tt.global_cache(KVCacheSpec(**spec_kwargs), len(REMOTE_IDS) * 4, seed=G_SEED)
        self.check_cache(cache, config, g, local_ids)
        self.assert_freed(conn, "req-1")
        self.assertEqual(engine.transport.receive_pool.used_bytes, 0)
        self.assertEqual(self.call(conn, "pool"), 0)  # every send slot released
        return engine, cache


if __name__ == "__main__":
    absltest.main()
