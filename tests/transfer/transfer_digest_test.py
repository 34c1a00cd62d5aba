"""End-to-end integrity digests (`jaxkv.transfer._digest`, issue 35 part 2): real transfers
between a producer process and this process over NIXL and transport="jax"; corruption of the
producer's buffer after publication and on the wire path is caught (the read fails with
exactly the corrupted blocks invalid, the counter incremented) and, as a negative control,
goes unnoticed without digests; clean reads verify across TP, layouts and host staging; the
handshake refuses engines that disagree; the device reduction equals its numpy reference."""

from __future__ import annotations

import ctypes
import dataclasses
import os
import time

os.environ.setdefault("UCX_TLS", "tcp,sm,self")

from support import bits, meshes, platforms, processes  # noqa: E402

platforms.force_cpu_devices()

import jax  # noqa: E402
import msgspec  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import xxhash  # noqa: E402
from absl.testing import absltest, parameterized  # noqa: E402
from support import transfer as tt  # noqa: E402

from jaxkv import EngineConfig, KVCacheSpec, PagedKVCache  # noqa: E402
from jaxkv.transfer import nixl_available, prometheus_text  # noqa: E402
from jaxkv.transfer._digest import (  # noqa: E402
    DigestOptions,
    RankRegions,
    device_digests,
    landed_pieces,
    landing_map,
    plan_pieces,
    rank_regions,
    sample_positions,
    sample_seed,
    sum32_numpy,
    verify_landed,
)
from jaxkv.transfer._jax_transport import jax_transfer_available  # noqa: E402
from jaxkv.transfer._messages import Ack, decode_message, encode_message  # noqa: E402
from jaxkv.transfer._plan import plan_read  # noqa: E402

NUM_BLOCKS, REMOTE_IDS, LOCAL_IDS, G_SEED = tt.NUM_BLOCKS, tt.REMOTE_IDS, tt.LOCAL_IDS, tt.G_SEED
WAIT_S = 60.0
SPEC = dict(num_layers=2, num_kv_heads=4, head_dim=8, block_size=4, dtype="bfloat16")


def _flip(address: int) -> None:
    """Inverts one byte of host memory (a CPU buffer or a host mirror)."""
    byte = ctypes.c_uint8.from_address(address)
    byte.value ^= 0xFF


def _buffer_address(engine, array_index: int, device_index: int) -> int:
    """Base address where peers read (producer) / bytes land (consumer) for one array of one
    device: the host mirror with host staging, else the cache's own buffer."""
    entry = engine._registry.caches[0]  # noqa: SLF001 - the test corrupts registered memory
    device_id = jax.devices()[device_index].id
    if entry.mirror is not None:
        return entry.mirror.address(array_index, device_id)
    buffers = [b for b in entry.cache.shard_buffers()
               if b.array_index == array_index and b.device.id == device_id]
    return buffers[0].address


def _block_len(engine, array_index: int) -> int:
    entry = engine._registry.caches[0]  # noqa: SLF001
    buffer = next(b for b in entry.cache.shard_buffers() if b.array_index == array_index)
    return buffer.nbytes // entry.cache.num_blocks


def digest_producer_main(conn, spec_kwargs: dict, tp: int, engine_kwargs: dict) -> None:
    """A producer process holding REMOTE_IDS filled from G over `tp` CPU devices. Commands:
    ("pin", request_id, corruption) -> TransferParams: publishes REMOTE_IDS, then (corruption
    not None: (array index, block id, byte offset, device index)) inverts that byte of the
    memory peers read, before polling again (so before any consumer read it);
    ("reregister",) -> address: registers a new cache of the same contents, then inverts a
    byte of REMOTE_IDS[1] in every buffer of the replaced one (kept alive);
    ("state",) -> (pinned, freed, stats summary); ("exit",)."""
    processes.child_env(max(tp, 1))
    from jaxkv.transfer._engine import KVTransferEngine

    spec = KVCacheSpec(**spec_kwargs)
    config = EngineConfig(spec, tp)
    g = tt.global_cache(spec, len(REMOTE_IDS) * spec.block_size, seed=G_SEED)
    mesh = meshes.tp(tp)
    freed: list[str] = []
    replaced: list = []  # caches replaced by "reregister" (kept alive)
    with KVTransferEngine("prefill", config, **engine_kwargs) as engine:
        arrays = tt.global_arrays(config, 0, g, REMOTE_IDS, NUM_BLOCKS)
        engine.register_cache(PagedKVCache.from_arrays(spec, arrays, mesh=mesh))
        conn.send(("ready", engine.address))
        while True:
            if conn.poll(0.0005):
                command = conn.recv()
                if command[0] == "exit":
                    break
                if command[0] == "pin":
                    _, request_id, corruption = command
                    params = engine.publish_request(request_id, REMOTE_IDS, 30.0)
                    if corruption is not None:
                        array, block, offset, device = corruption
                        _flip(_buffer_address(engine, array, device)
                              + block * _block_len(engine, array) + offset)
                    conn.send(params)
                elif command[0] == "state":
                    conn.send((engine.num_pinned, list(freed), engine.stats.summary()))
                elif command[0] == "reregister":
                    # A new cache with the same contents in new buffers; the old one is kept
                    # alive and then changed, so that digests taken from it would not match.
                    old = engine.caches[0]
                    replaced.append(old)
                    arrays = tt.global_arrays(config, 0, g, REMOTE_IDS, NUM_BLOCKS)
                    engine.register_cache(PagedKVCache.from_arrays(spec, arrays, mesh=mesh))
                    for buffer in old.shard_buffers():
                        _flip(buffer.address + REMOTE_IDS[1] * (buffer.nbytes // NUM_BLOCKS) + 5)
                    conn.send(engine.address)
            freed.extend(engine.poll().freeable)


class _Base(tt.TransferTestBase):
    """Producers and consumer engines as in `TransferTestBase`, with a digest producer."""

    def producer(self, spec_kwargs, tp, **engine_kwargs):
        process, parent = processes.spawn(digest_producer_main, spec_kwargs, tp, engine_kwargs)
        self._children.append((process, parent))
        if not parent.poll(WAIT_S):
            raise TimeoutError("producer did not start")
        parent.recv()
        return parent

    @staticmethod
    def call(conn, *command):
        conn.send(command)
        if not conn.poll(WAIT_S):
            raise TimeoutError(f"producer did not answer {command[0]!r}")
        return conn.recv()

    def consumer(self, spec, tp, **kwargs):
        from jaxkv.transfer._engine import KVTransferEngine

        config = EngineConfig(spec, tp)
        engine = KVTransferEngine("decode", config, **kwargs)
        self._engines.append(engine)
        mesh = meshes.tp(tp)
        engine.register_cache(PagedKVCache.allocate(spec, NUM_BLOCKS, mesh=mesh))
        return engine, config

    @staticmethod
    def wait(engine, read_id="req-1"):
        finished, failed = [], []
        deadline = time.monotonic() + WAIT_S
        while not finished and not failed:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{read_id} neither finished nor failed")
            result = engine.poll()
            finished += result.finished
            failed += result.failed
        return finished, failed

    def read(self, spec_kwargs, p_tp=1, d_tp=1, d_layout=None, corruption=None, wire=None,
             digests="full", producer_digests=None, ratio=1, **kwargs):
        """Publishes REMOTE_IDS (corrupted as asked), reads them into LOCAL_IDS (``wire``:
        (array index, local block id, byte offset) inverted in the landed bytes once the
        transport reports them complete); returns (engine, config, finished, failed, g)."""
        transport = kwargs.get("transport", "nixl")
        staging = kwargs.pop("host_staging", None)
        conn = self.producer(spec_kwargs, p_tp, transport=transport,
                             digests=producer_digests or digests, host_staging=staging)
        params = self.call(conn, "pin", "req-1", corruption)
        spec_d = KVCacheSpec(**dict(spec_kwargs, layout=d_layout or spec_kwargs["layout"],
                                    block_size=spec_kwargs["block_size"] * ratio))
        engine, config = self.consumer(spec_d, d_tp, digests=digests, host_staging=staging,
                                       **kwargs)
        if wire is not None:
            self.corrupt_on_landing(engine, wire)
        engine.start_read(params, LOCAL_IDS[: len(REMOTE_IDS) // ratio])
        finished, failed = self.wait(engine)
        g = tt.global_cache(KVCacheSpec(**spec_kwargs), len(REMOTE_IDS) * 4, seed=G_SEED)
        return engine, config, finished, failed, g

    @staticmethod
    def corrupt_on_landing(engine, wire):
        """Inverts the landed byte ``wire`` = (array index, local block id, byte offset) of
        the engine's current cache once its transport first reports a fetch complete."""
        check = engine.transport.check
        flipped = []

        def corrupting_check(handle):
            state = check(handle)
            if state == "DONE" and not flipped:
                array, block, offset = wire
                _flip(_buffer_address(engine, array, 0) + block * _block_len(engine, array)
                      + offset)
                flipped.append(True)
            return state

        engine.transport.check = corrupting_check

    def landed(self, engine, config, g, ratio=1):
        """(got, want) per array: the uint views of the read's local blocks and G's."""
        ids = np.asarray(LOCAL_IDS[: len(REMOTE_IDS) // ratio])
        want = tt.expected_arrays(config, 0, g, ids)
        return [(bits.bits(np.asarray(a))[ids], w) for a, w in zip(engine.caches[0].arrays, want)]


TRANSPORTS = [("nixl",)] if nixl_available() else []
if jax_transfer_available():
    TRANSPORTS.append(("jax",))


@pytest.mark.skipif(not TRANSPORTS, reason="neither NIXL nor jax.experimental.transfer")
class DigestCorruptionTest(_Base):
    """Corruption after publication is caught with exactly its blocks invalid."""

    def _corrupt_case(self, transport, digests, staging=None):
        spec = dict(SPEC, layout="LKHTD")
        # One byte of REMOTE_IDS[2] (array 0, offset 37) on the producer, after publishing.
        engine, config, finished, failed, g = self.read(
            spec, corruption=(0, REMOTE_IDS[2], 37, 0), digests=digests,
            transport=transport, host_staging=staging)
        return engine, config, finished, failed, g

    @parameterized.parameters(*[t + (s,) for t in TRANSPORTS for s in (None, True)
                                if not (t[0] == "jax" and s)])
    def test_producer_buffer_corruption_fails_exactly_that_block(self, transport, staging):
        engine, config, finished, failed, g = self._corrupt_case(transport, "full", staging)
        self.assertEqual(finished, [])
        self.assertEqual(len(failed), 1)
        self.assertIn("integrity digest mismatch", failed[0].reason)
        self.assertIn("(0, 2)", failed[0].reason)  # producer rank 0, block position 2
        self.assertEqual(failed[0].invalid_block_ids, (LOCAL_IDS[2],))
        self.assertEqual(engine.stats.digest_mismatches, 1)
        self.assertEqual(engine.stats.digest_verified, len(REMOTE_IDS) - 1)
        self.assertEqual(engine.stats.failed_transfers, 1)
        text = prometheus_text(engine.stats, "decode")
        self.assertIn('jaxkv_transfer_failures_total{engine="decode",kind="digest_mismatches"}'
                      ' 1.0', text)
        self.assertIn('jaxkv_transfer_digest_verified_total{engine="decode"} 5.0', text)

    @parameterized.parameters(*TRANSPORTS)
    def test_without_digests_the_same_corruption_goes_unnoticed(self, transport):
        # Negative control: the corruption is real and lands; only digests notice it.
        engine, config, finished, failed, g = self._corrupt_case(transport, "off")
        self.assertEqual((finished, failed), (["req-1"], []))
        self.assertEqual(engine.stats.digest_mismatches, 0)
        (got, want), *others = self.landed(engine, config, g)
        rows = got.reshape(len(LOCAL_IDS), -1).view(np.uint8)
        expected = want.reshape(len(LOCAL_IDS), -1).view(np.uint8)
        diff = np.argwhere(rows != expected)
        self.assertEqual(diff.tolist(), [[2, 37]])  # exactly the flipped byte
        self.assertEqual(int(rows[2, 37]), int(expected[2, 37]) ^ 0xFF)
        for got_o, want_o in others:
            np.testing.assert_array_equal(got_o, want_o)

    @parameterized.parameters(*TRANSPORTS)
    def test_wire_corruption_fails_exactly_that_block(self, transport):
        spec = dict(SPEC, layout="LKHTD")
        engine, config, finished, failed, g = self.read(
            spec, wire=(0, LOCAL_IDS[4], 11), transport=transport)
        self.assertEqual(finished, [])
        self.assertEqual(len(failed), 1)
        self.assertIn("(0, 4)", failed[0].reason)
        self.assertEqual(failed[0].invalid_block_ids, (LOCAL_IDS[4],))
        self.assertEqual(engine.stats.digest_mismatches, 1)
        # The other blocks landed intact (a failed read names only what it must).
        for got, want in self.landed(engine, config, g):
            mask = np.arange(len(LOCAL_IDS)) != 4
            np.testing.assert_array_equal(got[mask], want[mask])

    @parameterized.parameters(*TRANSPORTS)
    def test_wire_corruption_unnoticed_without_digests(self, transport):
        spec = dict(SPEC, layout="LKHTD")
        engine, config, finished, failed, g = self.read(
            spec, wire=(0, LOCAL_IDS[4], 11), transport=transport, digests="off")
        self.assertEqual((finished, failed), (["req-1"], []))
        (got, want), *_ = self.landed(engine, config, g)
        diff = np.argwhere(got.reshape(len(LOCAL_IDS), -1).view(np.uint8)
                           != want.reshape(len(LOCAL_IDS), -1).view(np.uint8))
        self.assertEqual(diff.tolist(), [[4, 11]])

    @parameterized.parameters(*TRANSPORTS)
    def test_sampled_checks_the_sampled_blocks_only(self, transport):
        spec = dict(SPEC, layout="LKHTD")
        # sampled:1 digests the last block only: its corruption is caught ...
        engine, _, finished, failed, _ = self.read(
            spec, corruption=(0, REMOTE_IDS[-1], 3, 0), digests="sampled:1",
            transport=transport)
        self.assertEqual([f.invalid_block_ids for f in failed], [(LOCAL_IDS[len(REMOTE_IDS) - 1],)])
        self.assertEqual(engine.stats.digest_mismatches, 1)
        self.assertEqual(engine.stats.digest_verified, 0)

    @parameterized.parameters(*[t + (d,) for t in TRANSPORTS for d in ("full", "sampled:1")])
    def test_partial_prefix_hit_verifies_the_tail(self, transport, digests):
        # The consumer already holds the first two blocks and reads the last four: the
        # request's positions 2..5 are the read's 0..3, on both sides of the comparison
        # (sampled:1 digests the request's last block: the read's position 3).
        spec = dict(SPEC, layout="LKHTD")
        conn = self.producer(spec, 1, transport=transport, digests=digests)
        engine, _ = self.consumer(KVCacheSpec(**spec), 1, transport=transport, digests=digests)
        position = 4 if digests == "full" else len(REMOTE_IDS) - 1
        params = self.call(conn, "pin", "req-1", (0, REMOTE_IDS[position], 9, 0))
        tail = LOCAL_IDS[2: len(REMOTE_IDS)]
        engine.start_read(params, tail)
        finished, failed = self.wait(engine)
        self.assertEqual(finished, [])
        self.assertIn(f"(0, {position}) landed with other bytes", failed[0].reason)
        self.assertEqual(failed[0].invalid_block_ids, (tail[position - 2],))
        self.assertEqual((engine.stats.digest_mismatches, engine.stats.digest_verified),
                         (1, 3 if digests == "full" else 0))

    @parameterized.parameters(*TRANSPORTS)
    def test_sampled_positions_drawn_differently_fail_the_read(self, transport):
        # A consumer that samples other positions than its producer (another jaxkv version)
        # would verify nothing and report success: the read fails, naming the blocks.
        from unittest import mock

        from jaxkv.transfer import _consumer

        spec = dict(SPEC, layout="LKHTD")
        conn = self.producer(spec, 1, transport=transport, digests="sampled:2")
        engine, _ = self.consumer(KVCacheSpec(**spec), 1, transport=transport,
                                  digests="sampled:2")
        params = self.call(conn, "pin", "req-1", None)
        last_only = np.array([len(REMOTE_IDS) - 1], np.int64)
        with mock.patch.object(_consumer, "sample_positions", return_value=last_only):
            engine.start_read(params, LOCAL_IDS[: len(REMOTE_IDS)])
        finished, failed = self.wait(engine)
        self.assertEqual(finished, [])
        self.assertIn("that this process did not sample", failed[0].reason)
        self.assertEqual(engine.stats.digest_mismatches, 0)

    @parameterized.parameters(*TRANSPORTS)
    def test_sampled_misses_unsampled_blocks(self, transport):
        # ... that of block 0 is not (the price of sampling; documented).
        spec = dict(SPEC, layout="LKHTD")
        engine, _, finished, failed, _ = self.read(
            spec, corruption=(0, REMOTE_IDS[0], 3, 0), digests="sampled:1", transport=transport)
        self.assertEqual((finished, failed), (["req-1"], []))
        self.assertEqual((engine.stats.digest_mismatches, engine.stats.digest_verified), (0, 1))


@pytest.mark.skipif(not TRANSPORTS, reason="neither NIXL nor jax.experimental.transfer")
class DigestCleanReadTest(_Base):
    """Uncorrupted reads verify every producer block image, whatever the geometry."""

    @parameterized.parameters(
        # (transport, p_tp, d_tp, p_layout, d_layout, ratio, staging)
        ("nixl", 1, 1, "LKHTD", "LKHTD", 1, None),
        ("nixl", 2, 1, "HTD", "HTD", 1, None),  # one consumer rank reads two producer ranks
        ("nixl", 1, 2, "HTD", "HTD", 1, None),  # two local ranks tile one producer block
        ("nixl", 2, 1, "KHTD", "KTHD", 1, None),  # landed in the sender's order, permuted
        ("nixl", 1, 1, "HTD", "HTD", 2, None),  # block-size ratio 2 (merged)
        ("nixl", 2, 2, "LKHTD", "LKHTD", 1, True),  # host staging on both sides
        ("jax", 1, 1, "LKHTD", "LKHTD", 1, None),
        ("jax", 2, 1, "HTD", "HTD", 1, None),
    )
    def test_clean_read_verifies(self, transport, p_tp, d_tp, p_layout, d_layout, ratio,
                                 staging):
        if (transport,) not in TRANSPORTS:
            self.skipTest(f"{transport} is not available")
        spec = dict(SPEC, layout=p_layout)
        engine, config, finished, failed, g = self.read(
            spec, p_tp, d_tp, d_layout, transport=transport, ratio=ratio, host_staging=staging)
        self.assertEqual((finished, [f.reason for f in failed]), (["req-1"], []))
        self.assertEqual(engine.stats.digest_mismatches, 0)
        self.assertEqual(engine.stats.digest_verified, len(REMOTE_IDS) * p_tp)
        for got, want in self.landed(engine, config, g, ratio):
            np.testing.assert_array_equal(got, want)

    @parameterized.parameters(*TRANSPORTS)
    def test_handshake_refuses_differing_modes(self, transport):
        spec = dict(SPEC, layout="LKHTD")
        engine, _, finished, failed, _ = self.read(
            spec, transport=transport, digests="off", producer_digests="full")
        self.assertEqual(finished, [])
        self.assertIn("IncompatibleEngineError", failed[0].reason)
        self.assertIn("digests: 'prefill' declares 'full', 'decode' 'off'", failed[0].reason)
        self.assertEqual(engine.stats.failed_handshakes, 1)

    @pytest.mark.skipif(not nixl_available(), reason="NIXL is not available")
    def test_reregistered_caches_are_digested_where_they_are_now(self):
        # The per-geometry landing maps and the cached region views must follow a
        # re-registration on either side: the producer's replaced buffer is changed after
        # it is replaced (digested from it, block 1 would mismatch), the consumer's replaced
        # buffer still holds the first read's clean bytes (digested from it, the corrupted
        # landing would verify).
        spec_kwargs = dict(SPEC, layout="LKHTD")
        spec = KVCacheSpec(**spec_kwargs)
        conn = self.producer(spec_kwargs, 1, transport="nixl", digests="full")
        engine, config = self.consumer(spec, 1, transport="nixl", digests="full")
        ids = LOCAL_IDS[: len(REMOTE_IDS)]
        engine.start_read(self.call(conn, "pin", "req-1", None), ids)
        self.assertEqual(self.wait(engine, "req-1"), (["req-1"], []))
        self.assertEqual(engine.stats.digest_verified, len(REMOTE_IDS))
        self.call(conn, "reregister")
        replaced = engine.caches[0]  # kept alive: a stale view would read valid memory
        engine.register_cache(PagedKVCache.allocate(spec, NUM_BLOCKS, mesh=meshes.tp(1)))
        self.corrupt_on_landing(engine, (0, LOCAL_IDS[4], 11))
        engine.start_read(self.call(conn, "pin", "req-2", None), ids, read_id="req-2")
        finished, failed = self.wait(engine, "req-2")
        self.assertEqual(finished, [])
        self.assertEqual(len(failed), 1)
        self.assertIn("integrity digest mismatch: producer (rank, block position) (0, 4) landed",
                      failed[0].reason)
        self.assertEqual(failed[0].invalid_block_ids, (LOCAL_IDS[4],))
        self.assertEqual(engine.stats.digest_mismatches, 1)  # not block 1: the new buffer's
        self.assertEqual(engine.stats.digest_verified, 2 * len(REMOTE_IDS) - 1)
        g = tt.global_cache(spec, len(REMOTE_IDS) * spec.block_size, seed=G_SEED)
        (got, want), = self.landed(engine, config, g)
        mask = np.arange(len(ids)) != 4
        np.testing.assert_array_equal(got[mask], want[mask])  # landed in the new cache
        self.assertIsNot(engine.caches[0], replaced)


class LandingMapTest(parameterized.TestCase):
    """The per-geometry landing maps equal the mapping through the read's own plans, and are
    never handed to the planners of other metadata."""

    def plans(self, p_tp, d_tp, p_layout, d_layout, ratio, hit=0, seed=0, meta_p=None,
              meta_d=None):
        spec = KVCacheSpec(**dict(SPEC, layout=p_layout))
        meta_p = meta_p or tt.fake_metadata("p", EngineConfig(spec, p_tp), 64)
        spec_d = spec.replace(layout=d_layout, block_size=spec.block_size * ratio)
        meta_d = meta_d or tt.fake_metadata("d", EngineConfig(spec_d, d_tp), 64)
        rng = np.random.default_rng(seed)
        # a run of consecutive ids on both sides (merged descriptors), then scattered ones
        remote = np.concatenate([np.arange(10, 22), rng.permutation(np.arange(30, 64))[:9]])
        n_local = -(-len(remote) // ratio) - hit
        run = n_local // 2
        local = np.concatenate([np.arange(40, 40 + run),
                                rng.permutation(np.arange(0, 40))[: n_local - run]])
        plans = [plan_read(meta_d, rank, meta_p, local, remote) for rank in range(d_tp)]
        return plans, meta_d, meta_p

    @parameterized.parameters(
        # (p_tp, d_tp, p_layout, d_layout, ratio, hit)
        (1, 1, "LKHTD", "LKHTD", 1, 0),
        (1, 1, "HTD", "HTD", 1, 2),  # a partial prefix hit: the read is the request's tail
        (2, 1, "HTD", "HTD", 1, 0),  # one consumer rank reads two producer ranks
        (1, 2, "HTD", "HTD", 1, 0),  # two local ranks tile one producer image
        (2, 1, "KHTD", "KTHD", 1, 0),  # landed in the sender's order, permuted later
        (1, 1, "HTD", "HTD", 2, 0),  # block-size ratio 2 (staged sub-blocks)
        (1, 1, "HTD", "HTD", 2, 1),
        (4, 2, "THD", "THD", 2, 0),
        (2, 4, "LKHTD", "LKHTD", 1, 1),
    )
    def test_map_equals_the_plans_mapping(self, p_tp, d_tp, p_layout, d_layout, ratio, hit):
        plans, meta_d, meta_p = self.plans(p_tp, d_tp, p_layout, d_layout, ratio, hit)
        remote_ids = plans[0].remote_block_ids
        want = plan_pieces(plans, meta_d, meta_p, remote_ids)
        self.assertLen(want.groups, len(remote_ids) * p_tp)  # every image of every rank
        got = landed_pieces(plans, meta_d, meta_p, remote_ids)
        self.assertIn(landing_map([p.planner for p in plans]).planners[0], [plans[0].planner])
        self.assertEqual(list(got.groups.items()), list(want.groups.items()))  # exact, ordered
        self.assertEqual((got.image_len, got.local_block_len),
                         (want.image_len, want.local_block_len))
        positions = [1, 8, len(remote_ids) - 1]
        sub = landed_pieces(plans, meta_d, meta_p, remote_ids, np.asarray(positions))
        self.assertEqual(sub.groups, {k: v for k, v in want.groups.items() if k[1] in positions})
        # The digests over the same (random) local bytes: the covers and blocks the map
        # resolved once per geometry give what resolving each group gives.
        rng = np.random.default_rng(3)
        regions = {}
        for plan in plans:
            info = meta_d.rank_info(plan.local_rank).regions
            size = info[0].block_len * info[0].num_blocks
            buffers = [rng.integers(0, 256, size, dtype=np.uint8) for _ in info]
            regions[plan.local_rank] = RankRegions(
                tuple(b.ctypes.data for b in buffers), ("DRAM",) * len(info),
                (size,) * len(info), tuple(memoryview(b) for b in buffers),
                info[0].block_len, tuple(range(len(info))), 0)
        algorithms = {rank: "xxh3" for rank in range(p_tp)}
        self.assertIsNotNone(got.resolved)
        fast = verify_landed(got, algorithms, regions, {})
        self.assertEqual(fast, verify_landed(want, algorithms, regions, {}))
        self.assertTrue(all(d.verifiable and d.values for d in fast.values()))
        self.assertEqual(verify_landed(sub, algorithms, regions, {}),
                         {k: v for k, v in fast.items() if k[1] in positions})

    def test_maps_are_per_planners(self):
        plans, meta_d, meta_p = self.plans(1, 1, "HTD", "HTD", 1)
        planners = [p.planner for p in plans]
        first = landing_map(planners)
        self.assertIs(landing_map(planners), first)  # cached
        # Another producer geometry read by the same consumer (the same metadata object): its
        # own map, equal to its own plans' mapping (a map keyed by the consumer's side alone
        # would be the first one, which maps one producer rank).
        spec2 = KVCacheSpec(**dict(SPEC, layout="HTD"))
        other, _, meta_2 = self.plans(2, 1, "HTD", "HTD", 1, meta_d=meta_d,
                                      meta_p=tt.fake_metadata("p2", EngineConfig(spec2, 2), 64))
        ids = other[0].remote_block_ids
        self.assertIsNot(landing_map([p.planner for p in other]), first)
        self.assertEqual(landed_pieces(other, meta_d, meta_2, ids).groups,
                         plan_pieces(other, meta_d, meta_2, ids).groups)
        # The producer re-registered (new metadata object and generation): new planners, a
        # new map, which holds exactly those planners.
        again = tt.fake_metadata("p", EngineConfig(KVCacheSpec(**dict(SPEC, layout="HTD")), 1),
                                 64, generation=1)
        moved, _, _ = self.plans(1, 1, "HTD", "HTD", 1, meta_p=again, meta_d=meta_d)
        fresh = landing_map([p.planner for p in moved])
        self.assertIsNot(fresh, first)
        self.assertIs(fresh.planners[0], moved[0].planner)
        # plans without a planner are mapped through their copies
        bare = [dataclasses.replace(p, planner=None, expanded=p.copies) for p in plans]
        self.assertEqual(landed_pieces(bare, meta_d, meta_p, ids).groups,
                         plan_pieces(plans, meta_d, meta_p, ids).groups)

    def test_region_views_follow_the_entry(self):
        from jaxkv.transfer._registry import Registered
        from jaxkv.transfer._staging import HostMirror

        spec = KVCacheSpec(**dict(SPEC, layout="HTD"))
        device = jax.devices()[0]

        def cache(seed):
            rng = np.random.default_rng(seed)
            arrays = [bits.random_bits(rng, spec.array_shape(8), spec.dtype)
                      for _ in spec.array_keys()]
            return PagedKVCache.from_arrays(spec, [jax.device_put(a, device) for a in arrays])

        def contents(c):
            return [np.asarray(a).reshape(-1).view(np.uint8).tobytes() for a in c.arrays]

        first_cache = cache(1)
        entry = Registered(first_cache, first_cache.shard_buffers(), (0,), None, 0, 2,
                           rank_devices={0: device.id})
        first = rank_regions(entry, 0)
        self.assertIs(rank_regions(entry, 0), first)  # cached
        self.assertEqual([bytes(v) for v in first.views], contents(first_cache))
        # an update that moved the buffers (the JAX transport adopts them): new views
        second_cache = cache(2)
        entry.cache, entry.buffers = second_cache, second_cache.shard_buffers()
        second = rank_regions(entry, 0)
        self.assertEqual([bytes(v) for v in second.views], contents(second_cache))
        self.assertNotEqual(second.bases, first.bases)
        # host staging: the mirror's buffers, and a new mirror's
        for _ in range(2):
            entry.mirror = HostMirror(second_cache)
            staged = rank_regions(entry, 0)
            self.assertEqual(staged.bases, tuple(entry.mirror.address(i, device.id)
                                                 for i in range(len(spec.array_keys()))))
        self.assertIsNot(rank_regions(entry, 0), second)


class DigestUnitTest(parameterized.TestCase):
    def test_options(self):
        self.assertFalse(DigestOptions.parse("off").enabled)
        self.assertEqual(DigestOptions.parse("sampled:3").wire, "sampled:3")
        for bad in ("on", "sampled:0", "sampled:", "sampled:x", "Full"):
            with self.assertRaises(ValueError):
                DigestOptions.parse(bad)
        with self.assertRaisesRegex(ValueError, "digests must be"):
            from jaxkv.transfer._engine import KVTransferEngine

            KVTransferEngine("x", EngineConfig(KVCacheSpec(**dict(SPEC, layout="HTD")), 1),
                             digests="yes")

    def test_sample_positions(self):
        positions = sample_positions(100, DigestOptions("sampled", 4), seed=0)
        self.assertEqual(len(positions), 4)
        self.assertEqual(positions[-1], 99)
        self.assertEqual(len(set(positions.tolist())), 4)
        self.assertEqual(sample_positions(3, DigestOptions("sampled", 4)).tolist(), [0, 1, 2])
        # both sides derive the same positions from the same seed; other seeds, others
        seed = sample_seed("req-1", 3)
        self.assertEqual(sample_positions(64, DigestOptions("sampled", 8), seed).tolist(),
                         sample_positions(64, DigestOptions("sampled", 8), seed).tolist())
        draws = {tuple(sample_positions(64, DigestOptions("sampled", 4), s).tolist())
                 for s in range(200)}
        self.assertGreater(len(draws), 150)
        # every position but the last is drawn about equally often (Floyd's sampling)
        counts = np.zeros(63)
        for s in range(3000):
            counts[sample_positions(64, DigestOptions("sampled", 4), s)[:-1]] += 1
        self.assertEqual(counts.sum(), 3 * 3000)
        self.assertGreater(counts.min(), 0.6 * counts.mean())
        self.assertLess(counts.max(), 1.4 * counts.mean())

    def test_ack_carries_digests(self):
        values = np.array([1, 2**64 - 1], np.uint64)
        ack = Ack("r", 0, 1, True, 3, digest_algorithm="xxh3", digest_positions=[0, 5],
                  digests=values.astype("<u8").tobytes())
        back = decode_message(encode_message(ack))
        self.assertEqual(back, ack)
        self.assertEqual(np.frombuffer(back.digests, "<u8").tolist(), values.tolist())
        with self.assertRaises(ValueError):
            decode_message(msgspec.msgpack.encode({"type": "ack"}))

    @parameterized.parameters("bfloat16", "float32", "int8")
    def test_device_reduction_matches_numpy_reference(self, dtype):
        rng = np.random.default_rng(1)
        shape = (6, 2, 4, 8)  # [blocks, ...] per region
        regions = [jax.numpy.asarray(rng.integers(0, 120, size=shape).astype(dtype))
                   for _ in range(3)]
        ids = np.array([[5, 5, 5], [0, 1, 2], [3, 3, 3]])
        got = device_digests(regions, ids)
        host = [np.asarray(r).reshape(shape[0], -1).view(np.uint8) for r in regions]
        for row, value in zip(ids, got):
            image = np.concatenate([host[k][b] for k, b in enumerate(row)])
            h1, h2 = sum32_numpy(image)
            self.assertEqual(int(value), (h2 << 32) | h1)
            # pieces add up: two halves at their word offsets give the same sums
            half = len(image) // 2
            a1, a2 = sum32_numpy(image[:half])
            b1, b2 = sum32_numpy(image[half:], half // 4)
            self.assertEqual(((a1 + b1) & 0xFFFFFFFF, (a2 + b2) & 0xFFFFFFFF), (h1, h2))
        # one changed byte changes the digest
        flipped = [np.asarray(r).copy() for r in regions]
        flipped[1][1].reshape(-1).view(np.uint8)[7] ^= 1  # region 1, block 1: in row [0, 1, 2]
        again = device_digests([jax.numpy.asarray(f) for f in flipped], ids[1:2])
        self.assertNotEqual(int(again[0]), int(got[1]))

    def test_xxh3_streams_like_the_concatenation(self):
        data = np.random.default_rng(2).integers(0, 256, 1000, dtype=np.uint8)
        h = xxhash.xxh3_64()
        for piece in np.split(data, [3, 500, 501]):
            h.update(piece.data)
        self.assertEqual(h.intdigest(), xxhash.xxh3_64_intdigest(data.tobytes()))


if __name__ == "__main__":
    absltest.main()
