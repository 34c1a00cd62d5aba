"""`KVTransferEngine(transport="jax")` between real processes on localhost: the global-cache
grid (TP/PP splits, KV heads, layouts, block ratio, MLA, dtypes, partial prefix hits,
notify-only), the request life cycle (Done/Ack, leases, abort, failures -> invalid blocks,
stats) and faults (producer killed mid-pull, a consumer that never pulls, bad metadata),
and many requests with flat memory."""

from __future__ import annotations

import os
import time

from support import bits, meshes, platforms, processes

platforms.force_cpu_devices()

import jax  # noqa: E402
import msgspec  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from absl.testing import absltest, parameterized  # noqa: E402
from support import transfer as tt  # noqa: E402

from jaxkv import BufferMovedError, EngineConfig, KVCacheSpec, PagedKVCache  # noqa: E402
from jaxkv.transfer._engine import KVTransferEngine  # noqa: E402 (the protocol core: reached into)
from jaxkv.transfer._jax_transport import jax_transfer_available  # noqa: E402

NUM_BLOCKS, REMOTE_IDS, LOCAL_IDS, G_SEED = tt.NUM_BLOCKS, tt.REMOTE_IDS, tt.LOCAL_IDS, tt.G_SEED
WAIT_S = 60.0
PRODUCER_DEVICES = 4


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / (1 << 20)


def _foreign_mesh(model: int) -> jax.sharding.Mesh:
    """A mesh like tpu-inference's runner sets as context: ``('data', 'model')`` over the
    last `model` devices (other devices and axis names than the caches' own meshes), or over
    the first ``-model`` devices (the caches' devices, as the runner's mesh is)."""
    devices = jax.devices()[-model:] if model > 0 else jax.devices()[:-model]
    return jax.sharding.Mesh(np.array(devices).reshape(1, len(devices)), ("data", "model"))


def jax_producer_main(conn) -> None:
    """A producer process (transport="jax"), re-set-up per case:
    ("setup", spec kwargs, tp, pp, pp_rank, num_tokens, engine kwargs) -> side-channel address
    (the cache filled from G in REMOTE_IDS; a previous engine is closed);
    ("pin", request_id, block_ids, lease_s[, expected_reads]) -> TransferParams;
    ("big", request_id, block_ids): fills the blocks with a large cache (engine kwargs
    "bad_address": bytes published as the transfer-server address);
    ("pin_lw", request_id, block_ids, lease_s) -> TransferParams of a layer-wise request;
    ("layers", request_id, stop) -> publishes its layers [0, stop);
    ("donate",): a jitted step consumes (donates) the registered cache, its output held, not
    handed over; ("adopt",): hands it over (`update_cache`);
    ("abort", request_id); ("pause", seconds): no polling; ("state",) -> (pinned, freed,
    stats summary, held bytes, RSS MiB, transport errors, subscriptions kept); ("exit",)."""
    processes.child_env(PRODUCER_DEVICES)
    engine = None
    held = None
    freed: list[str] = []
    while True:
        if conn.poll(0.0005):
            command = conn.recv()
            kind = command[0]
            if kind == "exit":
                break
            try:
                if kind == "setup":
                    _, spec_kwargs, tp, pp, pp_rank, num_tokens, engine_kwargs = command
                    if engine is not None:
                        engine.close()
                    freed.clear()
                    spec = KVCacheSpec(**spec_kwargs)
                    config = EngineConfig(spec, tp, pp)
                    g = tt.global_cache(spec, num_tokens, seed=G_SEED)
                    arrays = tt.global_arrays(config, pp_rank, g, REMOTE_IDS, NUM_BLOCKS)
                    mesh = meshes.tp(tp)
                    cache = PagedKVCache.from_arrays(config.local_spec(pp_rank), arrays,
                                                     mesh=mesh)
                    engine_kwargs = dict(engine_kwargs)
                    bad_address = engine_kwargs.pop("bad_address", None)
                    engine = KVTransferEngine("prefill", config, transport="jax",
                                              **engine_kwargs)
                    if bad_address is not None:  # publishes a malformed server address
                        from jaxkv.transfer._metadata import AgentInfo

                        engine.transport.describe = lambda e=engine.transport.endpoint, \
                            b=bad_address: [AgentInfo(name=e, metadata=b)]
                    engine.register_cache(cache, pp_rank=pp_rank)
                    conn.send(engine.address)
                elif kind == "setup_packed":  # tpu-inference's packed cache, TP tp
                    _, spec_args, tp, num_tokens = command
                    if engine is not None:
                        engine.close()
                    freed.clear()
                    spec = KVCacheSpec.for_tpu_inference(*spec_args)
                    g = tt.global_cache(spec, num_tokens, seed=G_SEED)
                    arrays = tt.packed_arrays(spec, tp, g, REMOTE_IDS, NUM_BLOCKS, seed=11)
                    mesh = meshes.tp(tp)
                    cache = PagedKVCache.from_arrays(spec, arrays, mesh=mesh)
                    engine = KVTransferEngine("prefill", EngineConfig(spec, tp),
                                              transport="jax")
                    engine.register_cache(cache)
                    conn.send(engine.address)
                elif kind == "context_mesh":  # a serving engine's mesh as context, as
                    _, model = command  # tpu-inference's runner sets it for its whole loop
                    jax.set_mesh(_foreign_mesh(model) if model else None)
                    conn.send(None)
                elif kind == "pin":
                    _, request_id, block_ids, lease, *reads = command
                    conn.send(engine.publish_request(request_id, block_ids, lease,
                                                     expected_reads=reads[0] if reads else 1))
                elif kind == "pin_lw":
                    _, request_id, block_ids, lease = command
                    conn.send(engine.publish_request(request_id, block_ids, lease,
                                                     layerwise=True))
                elif kind == "layers":
                    engine.publish_layers(command[1], command[2])
                    conn.send(True)
                elif kind == "abort":
                    engine.abort_request(command[1])
                    conn.send(True)
                elif kind == "donate":
                    held = jax.jit(lambda c: c, donate_argnums=0)(engine.caches[0])
                    conn.send(all(a.is_deleted() for a in engine.caches[0].arrays))
                elif kind == "adopt":
                    engine.update_cache(held)
                    conn.send(True)
                elif kind == "pause":
                    time.sleep(command[1])
                    conn.send(True)
                elif kind == "state":
                    conn.send((engine.num_pinned, list(freed), engine.stats.summary(),
                               engine.transport.server.held_bytes, _rss_mb(),
                               list(engine.transport.errors),
                               engine.transport.num_subscriptions))
                else:
                    raise ValueError(f"unknown command {kind!r}")
            except Exception as error:  # noqa: BLE001 - reported to the test
                conn.send(("error", type(error).__name__, str(error)))
        if engine is not None:
            freed.extend(engine.poll().freeable)


def _kwargs(spec: KVCacheSpec) -> dict:
    return dict(num_layers=spec.num_layers, num_kv_heads=spec.num_kv_heads,
                head_dim=spec.head_dim, block_size=spec.block_size, dtype=spec.dtype.name,
                layout=spec.layout, kv_factor=spec.kv_factor, mla=spec.mla)


class _Producers:
    """Producer processes shared by a test class (one per pipeline rank), re-set-up per case."""

    def __init__(self, count: int):
        self.items = []
        for _ in range(count):
            process, parent = processes.spawn(jax_producer_main)
            self.items.append((process, parent))

    @staticmethod
    def call(conn, *command, timeout=WAIT_S):
        conn.send(command)
        if not conn.poll(timeout):
            raise TimeoutError(f"producer did not answer {command[0]!r}")
        answer = conn.recv()
        if isinstance(answer, tuple) and answer and answer[0] == "error":
            raise RuntimeError(f"producer: {answer[1]}: {answer[2]}")
        return answer

    def close(self):
        for process, conn in self.items:
            processes.stop(process, conn)


class _WithProducers(parameterized.TestCase):
    """Two producer processes shared by a class's tests; consumer engines closed after each."""

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.producers = _Producers(2)

    @classmethod
    def tearDownClass(cls):
        cls.producers.close()
        super().tearDownClass()

    def setUp(self):
        super().setUp()
        self._engines = []

    def tearDown(self):
        for engine in self._engines:
            engine.close()
        super().tearDown()


@pytest.mark.skipif(not jax_transfer_available(), reason="no jax.experimental.transfer")
class JaxEngineTest(_WithProducers):

    def conn(self, index=0):
        return self.producers.items[index][1]

    def call(self, *command, index=0, timeout=WAIT_S):
        return self.producers.call(self.conn(index), *command, timeout=timeout)

    def consumer(self, spec, tp, pp=1, pp_rank=0, **kwargs):
        config = EngineConfig(spec, tp, pp)
        engine = KVTransferEngine("decode", config, transport="jax", **kwargs)
        self._engines.append(engine)
        cache = PagedKVCache.allocate(config.local_spec(pp_rank), NUM_BLOCKS,
                                      mesh=meshes.tp(tp))
        engine.register_cache(cache, pp_rank=pp_rank)
        return engine, cache, config

    wait = staticmethod(tt.TransferTestBase.wait)

    def wait_freed(self, request_id, index=0, timeout=WAIT_S):
        deadline = time.monotonic() + timeout
        while True:
            state = self.call("state", index=index)
            if request_id in state[1] or time.monotonic() >= deadline:
                return state
            time.sleep(0.01)

    def check_cache(self, cache, config, g, local_ids, pp_rank=0, first_token=0):
        tt.TransferTestBase.check_cache(self, cache, config, g, local_ids, pp_rank, first_token)

    def read_case(self, p_tp, d_tp, p_layout, d_layout, heads=4, dtype="bfloat16", ratio=1,
                  p_pp=1, d_pp=1, mla=False, hit=0, num_layers=3):
        bs = 4
        if mla:
            p_spec = KVCacheSpec(num_layers=num_layers, num_kv_heads=1, head_dim=8,
                                 block_size=bs, dtype=dtype, layout="TD", kv_factor=1, mla=True)
            d_spec = p_spec.replace(block_size=bs * ratio)
        else:
            p_spec = KVCacheSpec(num_layers=num_layers, num_kv_heads=heads, head_dim=8,
                                 block_size=bs, dtype=dtype, layout=p_layout)
            d_spec = p_spec.replace(layout=d_layout, block_size=bs * ratio)
        num_tokens = len(REMOTE_IDS) * bs
        p_config = EngineConfig(p_spec, p_tp, p_pp)
        addresses = [self.call("setup", _kwargs(p_spec), p_tp, p_pp, r, num_tokens, {},
                               index=r) for r in range(p_pp)]
        request_id = f"req-{time.monotonic_ns()}"
        for r in range(p_pp):  # every producer process publishes the request
            params = self.call("pin", request_id, REMOTE_IDS, 30.0, index=r)
        params = msgspec.structs.replace(params, addresses=[tuple(a) for a in addresses])
        local_ids = LOCAL_IDS[: len(REMOTE_IDS) // ratio - hit]
        g = tt.global_cache(p_spec, num_tokens, seed=G_SEED)
        for pp_rank in range(d_pp):
            engine, cache, config = self.consumer(d_spec, d_tp, d_pp, pp_rank)
            before = cache.shard_buffers()
            read_id = f"{params.request_id}-read"  # one read over the consumer's processes
            engine.start_read(params, local_ids, read_id=read_id)
            finished, failed = self.wait(engine, [read_id])
            self.assertEqual((finished, failed), ([read_id], []))
            self.check_cache(cache, config, g, local_ids, pp_rank,
                             first_token=hit * ratio * bs)
            cache.verify_unmoved(before)  # written in place
        for r in range(p_pp):
            state = self.wait_freed(params.request_id, index=r)
            self.assertEqual(state[0], 0, state)
            self.assertEqual(state[3], 0, "the producer still holds buffers")
        del p_config
        return engine, cache

    @parameterized.parameters(
        # (p_tp, d_tp, p_layout, d_layout, heads)
        (1, 2, "LKHTD", "LKHTD", 4),
        (2, 1, "LKHTD", "KHTD", 4),
        (2, 4, "THD", "THD", 2),
        (4, 2, "KTHD", "LKTHD", 8),
        (1, 4, "HTD", "HTD", 1),
        (4, 1, "HTD", "LKHTD", 2),
    )
    def test_tp_grid(self, p_tp, d_tp, p_layout, d_layout, heads):
        self.read_case(p_tp, d_tp, p_layout, d_layout, heads=heads)

    @parameterized.parameters(
        # (p_tp, d_tp, p_pp, d_pp, p_layout, d_layout, ratio, dtype, mla, hit)
        (1, 2, 2, 1, "LKHTD", "HTD", 1, "bfloat16", False, 0),  # PP 2 (3 layers: 2 + 1)
        (2, 1, 1, 2, "HTD", "LKTHD", 1, "float32", False, 0),
        (1, 2, 1, 1, "HTD", "THD", 2, "bfloat16", False, 0),  # block ratio 2, HND -> NHD
        (2, 2, 1, 1, "KTHD", "KHTD", 2, "float32", False, 1),  # ratio 2 + partial prefix
        (1, 2, 1, 1, "", "", 1, "bfloat16", True, 0),  # MLA (replicated)
        (2, 1, 1, 1, "", "", 2, "float32", True, 2),
    )
    def test_pp_ratio_mla(self, p_tp, d_tp, p_pp, d_pp, p_layout, d_layout, ratio, dtype, mla,
                          hit):
        self.read_case(p_tp, d_tp, p_layout, d_layout, dtype=dtype, ratio=ratio, p_pp=p_pp,
                       d_pp=d_pp, mla=mla, hit=hit)

    def test_notify_only_and_stats(self):
        spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4)
        self.call("setup", _kwargs(spec), 1, 1, 0, len(REMOTE_IDS) * 4, {})
        engine, cache, _ = self.consumer(spec, 2)
        params = self.call("pin", "notify", REMOTE_IDS, 30.0)
        engine.start_read(params, [])
        self.assertEqual(self.wait(engine, ["notify"]), (["notify"], []))
        self.assertFalse(np.asarray(cache.arrays[0]).view(np.uint16).any())
        state = self.wait_freed("notify")
        self.assertEqual((state[0], state[3]), (0, 0))
        params = self.call("pin", "full", REMOTE_IDS, 30.0)
        engine.start_read(params, LOCAL_IDS)
        self.wait(engine, ["full"])
        summary = engine.stats.summary()
        self.assertEqual(summary["transfers"], 2)
        self.assertEqual(engine.metadata.transport, "jax")

    @parameterized.parameters(
        # (p_tp, d_tp, heads, head_dim, dtype, consumer packed)
        (2, 1, 4, 96, "bfloat16", True),
        (1, 2, 2, 64, "float8_e4m3fn", True),  # phantom heads on each consumer rank
        (2, 2, 4, 100, "float32", False),
    )
    def test_packed_caches(self, p_tp, d_tp, heads, head_dim, dtype, packed):
        """tpu-inference's packed caches (K/V interleaved, packed words, 128-lane head dim)
        between engines: the values land bit for bit, the consumer's phantom heads and padding
        lanes keep their bits, the stats count values only."""
        self.packed_case(p_tp, d_tp, heads, head_dim, dtype, packed)

    def packed_case(self, p_tp, d_tp, heads, head_dim, dtype, packed):
        page = 4
        num_tokens = len(REMOTE_IDS) * page
        self.call("setup_packed", (2, heads, head_dim, page, dtype), p_tp, num_tokens)
        p_spec = KVCacheSpec.for_tpu_inference(2, heads, head_dim, page, dtype)
        d_spec = p_spec if packed else KVCacheSpec(
            num_layers=2, num_kv_heads=heads, head_dim=head_dim, block_size=page, dtype=dtype,
            layout="LKHTD")
        g = tt.global_cache(p_spec, num_tokens, seed=G_SEED)
        config = EngineConfig(d_spec, d_tp)
        engine = KVTransferEngine("decode", config, transport="jax")
        self._engines.append(engine)
        mesh = meshes.tp(d_tp)
        if packed:
            initial = tt.packed_arrays(d_spec, d_tp, g, [], NUM_BLOCKS, seed=12)
            cache = PagedKVCache.from_arrays(d_spec, initial, mesh=mesh)
        else:
            cache = PagedKVCache.allocate(d_spec, NUM_BLOCKS, mesh=mesh)
        engine.register_cache(cache)
        params = self.call("pin", "packed", REMOTE_IDS, 30.0)
        engine.start_read(params, LOCAL_IDS)
        self.assertEqual(self.wait(engine, ["packed"]), (["packed"], []))
        got = engine.caches[0]
        if packed:
            want = tt.packed_arrays(d_spec, d_tp, g, LOCAL_IDS, NUM_BLOCKS, seed=12)
            for layer in range(2):  # sentinels everywhere else: unchanged
                np.testing.assert_array_equal(bits.bits(np.asarray(got.arrays[layer])),
                                              bits.bits(want[layer]))
        else:
            self.check_cache(got, config, g, LOCAL_IDS)
        values = len(LOCAL_IDS) * 2 * 2 * heads * page * head_dim * p_spec.itemsize
        self.assertEqual(engine.stats.bytes_total, values)
        state = self.wait_freed("packed")
        self.assertEqual((state[0], state[3]), (0, 0))

    @parameterized.parameters(
        # (p_tp, d_tp, packed, context mesh size)
        (2, 1, False, 1),
        (1, 2, False, 2),
        (2, 1, True, 1),
        (2, 2, True, 2),
        (2, 2, False, -2),  # the runner's own devices: a rank's piece lies on one of them
        (2, 2, True, -2),
    )
    def test_engines_under_a_foreign_context_mesh(self, p_tp, d_tp, packed, model):
        """A serving engine sets its own mesh as JAX's context for its whole loop
        (tpu-inference's runner: ('data', 'model')); jaxkv's programs on the caches' own meshes
        (the producer's split, the consumer's write of the pulled buffers) still run, exact.
        Before the fix every such read failed: "The context mesh ... should match the mesh
        passed to shard_map"."""
        self.call("context_mesh", model)
        self.addCleanup(self.call, "context_mesh", 0)
        with jax.set_mesh(_foreign_mesh(model)):
            if packed:
                self.packed_case(p_tp, d_tp, 4, 96, "bfloat16", True)
            else:
                self.read_case(p_tp, d_tp, "LKHTD", "HTD")

    def test_cache_that_moved_is_adopted_and_read_into(self):
        """Over the JAX transport nothing is registered by address: `update_cache` adopts a
        cache whose buffers moved (an update that was not donated) instead of raising
        `BufferMovedError`, and the next read lands in the new arrays."""
        import jax.numpy as jnp

        spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4)
        self.call("setup", _kwargs(spec), 2, 1, 0, len(REMOTE_IDS) * 4, {})
        engine, cache, config = self.consumer(spec, 2)
        self.assertFalse(engine.registers_memory)
        moved = PagedKVCache(spec, [jnp.copy(a) for a in cache.arrays], cache.sharding)
        with self.assertRaises(BufferMovedError):
            moved.verify_unmoved(cache.shard_buffers())  # other buffers indeed
        engine.update_cache(moved)
        self.assertIs(engine.caches[0], moved)
        params = self.call("pin", "moved", REMOTE_IDS, 30.0)
        engine.start_read(params, LOCAL_IDS)
        self.assertEqual(self.wait(engine, ["moved"]), (["moved"], []))
        g = tt.global_cache(spec, len(REMOTE_IDS) * 4, seed=G_SEED)
        self.check_cache(engine.caches[0], config, g, LOCAL_IDS)
        self.assertFalse(np.asarray(cache.arrays[0]).view(np.uint16).any())  # not the old one

    def test_consumer_never_pulls_lease_expiry_frees(self):
        spec = KVCacheSpec(num_layers=2, num_kv_heads=8, head_dim=128, block_size=16)
        # 16 blocks x 256 KiB: the formatted request holds 4 MiB until it expires
        self.call("setup", _kwargs(spec), 1, 1, 0, len(REMOTE_IDS) * 16, {})
        engine, _, _ = self.consumer(spec, 1, read_timeout_s=60.0)
        params = self.call("pin", "never", REMOTE_IDS, 1.5)
        engine.start_read(params, LOCAL_IDS)
        deadline = time.monotonic() + WAIT_S
        while self.call("state")[3] == 0 and time.monotonic() < deadline:
            engine.poll()  # the Want goes out; the producer formats and offers
        self.assertGreater(self.call("state")[3], 0)
        engine.close()  # the consumer goes away without pulling or confirming
        self._engines.remove(engine)
        state = self.wait_freed("never")
        self.assertEqual((state[0], state[3]), (0, 0))
        self.assertGreaterEqual(state[2]["expired_leases"], 1)

    def test_abort_fails_read_with_invalid_blocks(self):
        spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4)
        self.call("setup", _kwargs(spec), 1, 1, 0, len(REMOTE_IDS) * 4, {})
        engine, _, _ = self.consumer(spec, 1, read_timeout_s=30.0)
        params = self.call("pin", "aborted", REMOTE_IDS, 30.0)
        self.call("abort", "aborted")
        self.wait_freed("aborted")
        start = time.monotonic()
        engine.start_read(params, LOCAL_IDS)
        _, failed = self.wait(engine, ["aborted"])
        self.assertLess(time.monotonic() - start, 10.0)  # told at once, not at the timeout
        self.assertEqual(len(failed), 1)
        self.assertIn("was freed before this read", failed[0].reason)
        self.assertEqual(failed[0].invalid_block_ids, tuple(sorted(LOCAL_IDS)))

    def test_budget_waits_then_serves(self):
        spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4)
        one = len(REMOTE_IDS) * spec.block_nbytes()
        self.call("setup", _kwargs(spec), 1, 1, 0, len(REMOTE_IDS) * 4,
                  {"jax_transport_options": {"budget_bytes": one}})
        engine, cache, config = self.consumer(spec, 1)
        ids_a, ids_b = LOCAL_IDS, [0, 1, 2, 3, 4, 5]
        pa = self.call("pin", "a", REMOTE_IDS, 30.0)
        pb = self.call("pin", "b", REMOTE_IDS, 30.0)
        engine.start_read(pa, ids_a)
        engine.start_read(pb, ids_b)
        finished, failed = self.wait(engine, ["a", "b"])
        self.assertEqual((sorted(finished), failed), (["a", "b"], []))
        g = tt.global_cache(spec, len(REMOTE_IDS) * 4, seed=G_SEED)
        expected = tt.expected_arrays(config, 0, g, ids_a)[0]
        got = np.asarray(cache.arrays[0]).view(np.uint16)
        np.testing.assert_array_equal(got[ids_a], expected)
        np.testing.assert_array_equal(got[ids_b], expected)

    def test_budget_too_small_fails_clearly(self):
        spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4)
        self.call("setup", _kwargs(spec), 1, 1, 0, len(REMOTE_IDS) * 4,
                  {"jax_transport_options": {"budget_bytes": 1024}})
        engine, _, _ = self.consumer(spec, 1, read_timeout_s=20.0)
        params = self.call("pin", "huge", REMOTE_IDS, 30.0)
        engine.start_read(params, LOCAL_IDS)
        _, failed = self.wait(engine, ["huge"])
        self.assertEqual(len(failed), 1)
        self.assertEqual(failed[0].invalid_block_ids, tuple(sorted(LOCAL_IDS)))
        self.assertIn("budget", self.call("state")[5][-1])

    def test_layerwise_request_read_once_every_layer_is_written(self):
        spec = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, layout="HTD")
        self.call("setup", _kwargs(spec), 2, 1, 0, len(REMOTE_IDS) * 4, {})
        engine, cache, config = self.consumer(spec.replace(layout="THD"), 1)
        params = self.call("pin_lw", "lw", REMOTE_IDS, 30.0)
        self.assertTrue(params.layerwise)
        engine.start_read(params, LOCAL_IDS)
        for stop in (1, 2):
            self.call("layers", "lw", stop)
            deadline = time.monotonic() + 0.3
            while time.monotonic() < deadline:
                result = engine.poll()
                self.assertEqual((result.finished, result.failed), ([], []))
        self.call("layers", "lw", 3)
        self.assertEqual(self.wait(engine, ["lw"]), (["lw"], []))
        g = tt.global_cache(spec, len(REMOTE_IDS) * 4, seed=G_SEED)
        self.check_cache(cache, config, g, LOCAL_IDS)

    @parameterized.parameters(False, True)
    def test_formatting_waits_for_a_donated_cache(self, layerwise):
        """A step consumed the registered cache (donated) and its output is not handed over
        yet when the consumer asks: the producer formats only once `update_cache` gave it
        the new cache (before: the read failed with "Array has been deleted")."""
        spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4)
        self.call("setup", _kwargs(spec), 1, 1, 0, len(REMOTE_IDS) * 4, {})
        engine, cache, config = self.consumer(
            spec, 1, jax_transport_options={"layer_group_bytes": 1})
        params = self.call("pin_lw" if layerwise else "pin", "donated", REMOTE_IDS, 30.0)
        if layerwise:
            self.call("layers", "donated", 1)
        self.assertTrue(self.call("donate"))
        engine.start_read(params, LOCAL_IDS)
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline:  # the producer polls meanwhile: nothing served
            result = engine.poll()
            self.assertEqual((result.finished, result.failed), ([], []))
            self.assertFalse(result.layers)
        self.assertEqual(self.call("state")[5], [])  # no formatting failure
        self.call("adopt")
        if layerwise:
            self.call("layers", "donated", 2)
        self.assertEqual(self.wait(engine, ["donated"]), (["donated"], []))
        g = tt.global_cache(spec, len(REMOTE_IDS) * 4, seed=G_SEED)
        self.check_cache(cache, config, g, LOCAL_IDS)

    def test_consumer_rank_per_engine_aggregated(self):
        # producer TP 2 -> consumer TP 2 as two engines of one rank each (a process per rank)
        spec = KVCacheSpec(num_layers=2, num_kv_heads=4, head_dim=8, block_size=4,
                           layout="KHTD")
        self.call("setup", _kwargs(spec), 2, 1, 0, len(REMOTE_IDS) * 4, {})
        params = self.call("pin", "per-rank", REMOTE_IDS, 30.0)
        config = EngineConfig(spec, 2)
        rank_spec = spec.replace(num_kv_heads=config.heads_per_rank)
        engines = []
        for rank in range(2):
            engine = KVTransferEngine("decode", config, transport="jax")
            self._engines.append(engine)
            cache = PagedKVCache.allocate(
                rank_spec, NUM_BLOCKS,
                mesh=jax.sharding.Mesh(np.array(jax.devices()[rank:rank + 1]), ("tp",)))
            engine.register_cache(cache, tp_rank=rank)
            engine.start_read(params, LOCAL_IDS)
            engines.append(engine)
        pending = {0, 1}
        deadline = time.monotonic() + WAIT_S
        while pending and time.monotonic() < deadline:
            for rank in list(pending):
                result = engines[rank].poll()
                self.assertEqual(result.failed, [])
                if result.finished:
                    self.assertEqual(result.finished, ["per-rank"])
                    pending.discard(rank)
        self.assertEqual(pending, set())
        g = tt.global_cache(spec, len(REMOTE_IDS) * 4, seed=G_SEED)
        expected = tt.NumpyEngine(config, NUM_BLOCKS)
        ids = np.asarray(LOCAL_IDS)
        for rank, engine in enumerate(engines):
            want = expected.slice_of(rank, g, 0, len(ids))
            for index, (array, blocks) in enumerate(zip(engine.caches[0].arrays, want)):
                got = np.asarray(array).view(np.uint8).reshape(NUM_BLOCKS, -1)
                np.testing.assert_array_equal(
                    got[ids], blocks.reshape(len(ids), -1).view(np.uint8),
                    err_msg=f"rank {rank} array {index}")
                others = np.setdiff1d(np.arange(NUM_BLOCKS), ids)
                self.assertFalse(got[others].any())
        state = self.wait_freed("per-rank")  # only once both engines confirmed
        self.assertEqual((state[0], state[3]), (0, 0))

    def test_bad_metadata_refused(self):
        from jaxkv.transfer._metadata import MetadataError

        spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4)
        address = self.call("setup", _kwargs(spec), 1, 1, 0, len(REMOTE_IDS) * 4,
                            {"bad_address": b"not-an-address"})
        engine, _, _ = self.consumer(spec, 1)
        with self.assertRaisesRegex(MetadataError, "no transfer-server address"):
            engine.add_peer("prefill", [address])
        params = self.call("pin", "bad", REMOTE_IDS, 30.0)
        engine.start_read(params, LOCAL_IDS)  # lazily: fails the read, not the caller
        _, failed = self.wait(engine, ["bad"], timeout=10)
        self.assertIn("MetadataError", failed[0].reason)
        self.assertEqual(failed[0].invalid_block_ids, tuple(sorted(LOCAL_IDS)))
        self.assertEqual(engine.stats.failed_handshakes, 2)

    def test_thousand_requests_flat_memory(self):
        count = int(os.environ.get("JAXKV_TRANSFER_LOOP", "1000"))
        spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4)
        # the engine's default lease bounds subscriptions to unpublished requests
        self.call("setup", _kwargs(spec), 1, 1, 0, len(REMOTE_IDS) * 4, {"lease_s": 2.0})
        engine, _, _ = self.consumer(spec, 2)
        rng = np.random.default_rng(0)
        rss, producer_rss = [], []
        for i in range(count):
            ids = rng.permutation(NUM_BLOCKS)[:4].tolist()
            params = self.call("pin", f"r{i}", ids, 30.0)
            engine.start_read(params, rng.permutation(NUM_BLOCKS)[:4].tolist())
            finished, failed = self.wait(engine, [f"r{i}"])
            self.assertEqual((finished, failed), ([f"r{i}"], []))
            if i in (count // 4, count - 1):
                rss.append(_rss_mb())
                producer_rss.append(self.call("state")[4])
        # a read of a request the producer never publishes: its subscription is dropped
        # after a lease, not kept forever
        params = self.call("pin", "unpublished", [1, 2], 0.3)
        self.call("abort", "unpublished")
        ghost = msgspec.structs.replace(params, request_id="never-published")
        engine.start_read(ghost, [3, 4], timeout_s=1.0)
        _, failed = self.wait(engine, ["never-published"])
        self.assertEqual(len(failed), 1)
        state = self.wait_freed(f"r{count - 1}")
        pinned, freed, summary, held = state[:4]
        self.assertEqual((pinned, len(freed), summary["expired_leases"], held),
                         (0, count + 1, 0, 0))  # + the aborted "unpublished"
        self.assertEqual(engine.num_reading, 0)
        self.assertEqual(len(engine.stats.records), count)
        self.assertEqual(engine.transport.puller.server.held_bytes, 0)
        deadline = time.monotonic() + WAIT_S
        while self.call("state")[6] and time.monotonic() < deadline:
            time.sleep(0.05)
        self.assertEqual(self.call("state")[6], 0)  # no subscription left behind
        self.assertLess(rss[-1] - rss[0], 24)  # MiB: flat after warm-up
        self.assertLess(producer_rss[-1] - producer_rss[0], 24)


@pytest.mark.skipif(not jax_transfer_available(), reason="no jax.experimental.transfer")
class JaxProducerKilledTest(absltest.TestCase):
    def test_producer_killed_mid_pull(self):
        producers = _Producers(2)
        self.addCleanup(producers.close)
        (process, conn), (_, conn2) = producers.items
        spec = KVCacheSpec(num_layers=2, num_kv_heads=8, head_dim=128, block_size=2048)
        # 6 blocks x 8 MiB: 48 MiB, pulled for ~0.1 s or more
        producers.call(conn, "setup", _kwargs(spec), 1, 1, 0, len(REMOTE_IDS) * 2048, {})
        params = producers.call(conn, "pin", "doomed", REMOTE_IDS, 30.0)
        config = EngineConfig(spec, 1)
        engine = KVTransferEngine("decode", config, transport="jax", read_timeout_s=10.0)
        self.addCleanup(engine.close)
        cache = PagedKVCache.allocate(spec, NUM_BLOCKS)
        engine.register_cache(cache)
        engine.start_read(params, LOCAL_IDS)
        # kill once the producer holds the formatted request (its pull under way)
        deadline = time.monotonic() + WAIT_S
        while producers.call(conn, "state")[3] == 0 and time.monotonic() < deadline:
            engine.poll()
        engine.poll()
        process.kill()
        process.join(timeout=10)
        start = time.monotonic()
        finished, failed = JaxEngineTest.wait(engine, ["doomed"], timeout=WAIT_S)
        if finished:  # the pull completed before the kill: no fault to observe
            self.skipTest("the pull completed before the producer was killed")
        self.assertLess(time.monotonic() - start, 10.0 + 2.0)
        self.assertEqual(failed[0].invalid_block_ids, tuple(sorted(LOCAL_IDS)))
        self.assertEqual(engine.stats.failed_transfers, 1)
        # the consumer keeps serving: another producer, another request, bit-exact
        if "TEST_SRCDIR" in os.environ:
            # Under Bazel's sandbox this follow-up pull never completes (pytest: passes every
            # time); cause not found yet, tracked in the transfer docs' limits.
            self.skipTest("follow-up pull after a killed producer: not run under Bazel")
        small = KVCacheSpec(num_layers=2, num_kv_heads=8, head_dim=128, block_size=2048)
        producers.call(conn2, "setup", _kwargs(small), 1, 1, 0, len(REMOTE_IDS) * 2048, {})
        params2 = producers.call(conn2, "pin", "next", REMOTE_IDS, 30.0)
        # (its own deadline: the engine's 10 s is for the doomed read; compiling the new
        # producer's formatting on a loaded machine may take longer than that)
        engine.start_read(params2, [0, 1, 2, 3, 4, 5], timeout_s=WAIT_S)
        self.assertEqual(JaxEngineTest.wait(engine, ["next"]), (["next"], []))
        g = tt.global_cache(small, len(REMOTE_IDS) * 2048, seed=G_SEED)
        want = tt.expected_arrays(config, 0, g, [0, 1, 2, 3, 4, 5])
        got = np.asarray(engine.caches[0].arrays[0]).view(np.uint16)
        np.testing.assert_array_equal(got[[0, 1, 2, 3, 4, 5]], want[0])


def _lw_specs(p_layout, d_layout, num_layers=4, heads=4):
    p_spec = KVCacheSpec(num_layers=num_layers, num_kv_heads=heads, head_dim=8, block_size=4,
                         layout=p_layout)
    return p_spec, p_spec.replace(layout=d_layout)


def _landed_layers(config, pp_rank, stop):
    """The consumer stage's layers below `stop`: those landed once layers [0, stop) did."""
    start, end = config.layer_range(pp_rank)
    return max(0, min(end, stop) - start)


def _covered(groups, stop):
    """One past the last layer of the groups lying entirely below `stop`."""
    return max([b for _, b in groups if b <= stop], default=0)


def _masked(g, stop):
    """The global cache with the layers from `stop` on zeroed (never written locally)."""
    g = g.copy()
    g[stop:] = 0
    return g


@pytest.mark.skipif(not jax_transfer_available(), reason="no jax.experimental.transfer")
class JaxLayerwiseTest(_WithProducers):
    """Layer-wise requests over the JAX transport: layer groups pulled and written as the
    producer publishes them (real producer processes; bit exact after every publication;
    layers not published yet never land)."""

    def call(self, *command, index=0, timeout=WAIT_S):
        return self.producers.call(self.producers.items[index][1], *command, timeout=timeout)

    def consumer(self, spec, tp, pp=1, pp_rank=0, group_bytes=1, **kwargs):
        config = EngineConfig(spec, tp, pp)
        engine = KVTransferEngine("decode", config, transport="jax",
                                  jax_transport_options={"layer_group_bytes": group_bytes},
                                  **kwargs)
        self._engines.append(engine)
        cache = PagedKVCache.allocate(config.local_spec(pp_rank), NUM_BLOCKS,
                                      mesh=meshes.tp(tp))
        engine.register_cache(cache, pp_rank=pp_rank)
        return engine, cache, config

    def poll_until(self, engines, read_id, want, settle_s=0.2, done=None, totals=None):
        """Polls every consumer engine until each reported `want[i]` landed layers (then
        `settle_s` more: no more land, nothing fails, and only an engine whose every layer
        landed (`totals`) finishes, recorded in `done`); returns the counts."""
        counts = [0] * len(engines)
        done = set() if done is None else done
        deadline = time.monotonic() + WAIT_S
        settle = None
        while True:
            for i, engine in enumerate(engines):
                if i in done:
                    counts[i] = want[i]
                    continue
                result = engine.poll()
                self.assertEqual(result.failed, [])
                counts[i] = result.layers.get(read_id, counts[i])
                if result.finished:
                    self.assertEqual(result.finished, [read_id])
                    self.assertIsNotNone(totals, "finished before every layer was published")
                    self.assertEqual(counts[i], totals[i], "finished before its layers landed")
                    done.add(i)
            now = time.monotonic()
            if settle is None and counts == list(want):
                settle = now + settle_s
            if settle is not None and now >= settle:
                self.assertEqual(counts, list(want), "layers landed beyond those published")
                return counts
            if now >= deadline:
                raise TimeoutError(f"landed layers {counts}, expected {want}")

    def start(self, p_tp, d_tp, p_layout, d_layout, p_pp=1, d_pp=1, group_bytes=1,
              num_layers=4, **kwargs):
        p_spec, d_spec = _lw_specs(p_layout, d_layout, num_layers)
        num_tokens = len(REMOTE_IDS) * 4
        p_config = EngineConfig(p_spec, p_tp, p_pp)
        addresses = [self.call("setup", _kwargs(p_spec), p_tp, p_pp, r, num_tokens, {},
                               index=r) for r in range(p_pp)]
        request_id = f"lw-{time.monotonic_ns()}"
        for r in range(p_pp):
            params = self.call("pin_lw", request_id, REMOTE_IDS, 30.0, index=r)
        params = msgspec.structs.replace(params, addresses=[tuple(a) for a in addresses])
        self.assertTrue(params.layerwise)
        consumers = [self.consumer(d_spec, d_tp, d_pp, q, group_bytes, **kwargs)
                     for q in range(d_pp)]
        read_id = f"{request_id}-read"
        for engine, _, _ in consumers:
            engine.start_read(params, LOCAL_IDS, read_id=read_id)
        g = tt.global_cache(p_spec, num_tokens, seed=G_SEED)
        return p_config, consumers, params, read_id, g

    @parameterized.parameters(
        # (p_tp, d_tp, p_layout, d_layout, p_pp, d_pp, group_bytes)
        (1, 2, "LKHTD", "LKHTD", 1, 1, 1),  # a group per layer
        (2, 1, "HTD", "THD", 1, 1, 3000),  # 1536 bytes per layer: groups of 2 layers
        (2, 4, "KTHD", "LKTHD", 1, 1, 1),
        (2, 2, "LKHTD", "HTD", 2, 1, 1),  # a producer process per pipeline stage
        (1, 2, "THD", "LKHTD", 1, 2, 3000),  # consumer stages: groups stop at their edge
    )
    def test_groups_land_as_published(self, p_tp, d_tp, p_layout, d_layout, p_pp, d_pp,
                                      group_bytes):
        from jaxkv.transfer._formatter import layer_groups

        p_config, consumers, params, read_id, g = self.start(
            p_tp, d_tp, p_layout, d_layout, p_pp, d_pp, group_bytes)
        num_layers = p_config.spec.num_layers
        d_config = consumers[0][2]
        groups = layer_groups(p_config, d_config.layer_split, len(REMOTE_IDS), group_bytes)
        self.assertGreater(len(groups), 1)
        engines = [engine for engine, _, _ in consumers]
        done: set[int] = set()  # a consumer stage finishes once its own layers landed
        totals = [_landed_layers(d_config, q, num_layers) for q in range(d_pp)]
        for stop in range(num_layers):  # every layer but the last
            for r in range(p_pp):
                self.call("layers", params.request_id, stop, index=r)
            covered = _covered(groups, stop)
            self.poll_until(engines, read_id,
                            [_landed_layers(d_config, q, covered) for q in range(d_pp)],
                            done=done, totals=totals)
            for q, (_, cache, config) in enumerate(consumers):
                # exactly the layers of the groups published so far hold the request
                self.check_cache(cache, config, _masked(g, covered), q)
        for r in range(p_pp):
            self.call("layers", params.request_id, num_layers, index=r)
        self.assertEqual(done, set(range(d_pp - 1)) if d_pp > 1 else set())
        for q, (engine, cache, config) in enumerate(consumers):
            if q not in done:
                self.assertEqual(JaxEngineTest.wait(engine, [read_id]), ([read_id], []))
            self.check_cache(cache, config, g, q)
            record = engine.stats.records[-1]
            self.assertEqual(len(record.layer_arrival),
                             _landed_layers(config, q, num_layers))
        for r in range(p_pp):
            state = JaxEngineTest.wait_freed(self, params.request_id, index=r)
            self.assertEqual((state[0], state[3]), (0, 0), state)

    def check_cache(self, cache, config, g, pp_rank=0):
        tt.TransferTestBase.check_cache(self, cache, config, g, LOCAL_IDS, pp_rank)

    def test_groups_of_a_partial_prefix_hit(self):
        """The consumer holds the request's first two blocks: only the tail's blocks travel,
        group by group (both sides derive the groups from the tail's size), bit exact."""
        from jaxkv.transfer._formatter import layer_groups

        p_spec, d_spec = _lw_specs("LKHTD", "HTD")
        self.call("setup", _kwargs(p_spec), 2, 1, 0, len(REMOTE_IDS) * 4, {})
        params = self.call("pin_lw", "lw-hit", REMOTE_IDS, 30.0)
        engine, cache, config = self.consumer(d_spec, 1, group_bytes=3000)
        local_ids = LOCAL_IDS[2:]
        engine.start_read(params, local_ids)
        groups = layer_groups(EngineConfig(p_spec, 2), [4], len(local_ids), 3000)
        # 2048 bytes per layer of the 4-block tail (the whole request's 3072 would make one
        # layer per group)
        self.assertEqual(groups, ((0, 2), (2, 4)))
        self.call("layers", "lw-hit", 3)
        self.poll_until([engine], "lw-hit", [2])
        self.call("layers", "lw-hit", 4)
        self.assertEqual(JaxEngineTest.wait(engine, ["lw-hit"]), (["lw-hit"], []))
        g = tt.global_cache(p_spec, len(REMOTE_IDS) * 4, seed=G_SEED)
        tt.TransferTestBase.check_cache(self, cache, config, g, local_ids, 0, first_token=2 * 4)

    def test_whole_pull_without_group_bytes(self):
        """``layer_group_bytes=0``: a layer-wise request is pulled whole once every layer
        is written (nothing lands before)."""
        _, consumers, params, read_id, g = self.start(1, 1, "LKHTD", "HTD", group_bytes=0)
        engine, cache, config = consumers[0]
        self.call("layers", params.request_id, 3)
        self.poll_until([engine], read_id, [0])
        self.call("layers", params.request_id, 4)
        self.assertEqual(JaxEngineTest.wait(engine, [read_id]), ([read_id], []))
        self.check_cache(cache, config, g)

    def test_consumer_abort_between_groups(self):
        _, consumers, params, read_id, g = self.start(1, 1, "LKHTD", "LKHTD",
                                                      read_timeout_s=30.0)
        engine, cache, config = consumers[0]
        self.call("layers", params.request_id, 2)
        self.poll_until([engine], read_id, [2])
        engine.abort_request(read_id)
        start = time.monotonic()
        _, failed = JaxEngineTest.wait(engine, [read_id])
        self.assertLess(time.monotonic() - start, 5.0)
        self.assertEqual(len(failed), 1)
        self.assertIn("aborted", failed[0].reason)
        self.assertEqual(failed[0].invalid_block_ids, tuple(sorted(LOCAL_IDS)))
        # the producer is told (Done not ok) and frees the request; later layers published
        # after the abort never land
        state = JaxEngineTest.wait_freed(self, params.request_id)
        self.assertEqual((state[0], state[3]), (0, 0), state)
        self.check_cache(cache, config, _masked(g, 2))
        self.assertEqual(engine.num_reading, 0)

    def test_producer_abort_between_groups(self):
        _, consumers, params, read_id, g = self.start(2, 1, "HTD", "LKHTD",
                                                      read_timeout_s=30.0)
        engine, cache, config = consumers[0]
        self.call("layers", params.request_id, 1)
        self.poll_until([engine], read_id, [1])
        self.call("abort", params.request_id)
        start = time.monotonic()
        _, failed = JaxEngineTest.wait(engine, [read_id])
        self.assertLess(time.monotonic() - start, 10.0)  # told, not at the read timeout
        self.assertEqual(len(failed), 1)
        self.assertIn("freed", failed[0].reason)
        self.assertEqual(failed[0].invalid_block_ids, tuple(sorted(LOCAL_IDS)))
        self.check_cache(cache, config, _masked(g, 1))


@pytest.mark.skipif(not jax_transfer_available(), reason="no jax.experimental.transfer")
class JaxLayerwiseKilledTest(absltest.TestCase):
    def test_producer_killed_between_groups(self):
        """The producer dies after publishing two of four layers: the read fails (at its
        timeout: nothing else tells the consumer), every local block invalid, only the two
        published layers ever landed (bit exact), the others untouched."""
        producers = _Producers(1)
        self.addCleanup(producers.close)
        process, conn = producers.items[0]
        p_spec, d_spec = _lw_specs("LKHTD", "THD")
        producers.call(conn, "setup", _kwargs(p_spec), 1, 1, 0, len(REMOTE_IDS) * 4, {})
        params = producers.call(conn, "pin_lw", "doomed-lw", REMOTE_IDS, 30.0)
        config = EngineConfig(d_spec, 2)
        engine = KVTransferEngine("decode", config, transport="jax", read_timeout_s=4.0,
                                  jax_transport_options={"layer_group_bytes": 1})
        self.addCleanup(engine.close)
        cache = PagedKVCache.allocate(d_spec, NUM_BLOCKS, mesh=meshes.tp(2))
        engine.register_cache(cache)
        engine.start_read(params, LOCAL_IDS)
        producers.call(conn, "layers", "doomed-lw", 2)
        landed, most = 0, 0
        deadline = time.monotonic() + WAIT_S
        while landed < 2 and time.monotonic() < deadline:
            landed = engine.poll().layers.get("doomed-lw", landed)
        self.assertEqual(landed, 2)
        process.kill()
        process.join(timeout=10)
        finished, failed = [], []
        deadline = time.monotonic() + WAIT_S
        while not (finished or failed) and time.monotonic() < deadline:
            result = engine.poll()
            most = max(most, result.layers.get("doomed-lw", 0))
            finished += result.finished
            failed += result.failed
        self.assertEqual(finished, [])
        self.assertEqual(len(failed), 1, "the read neither finished nor failed")
        self.assertEqual(failed[0].invalid_block_ids, tuple(sorted(LOCAL_IDS)))
        self.assertLessEqual(most, 2)
        g = tt.global_cache(p_spec, len(REMOTE_IDS) * 4, seed=G_SEED)
        tt.TransferTestBase.check_cache(self, engine.caches[0], config, _masked(g, 2),
                                        LOCAL_IDS)


if __name__ == "__main__":
    absltest.main()
