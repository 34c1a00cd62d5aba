"""The JAX transport's split/concat formatter, in one process: a request's blocks split by
the producer's ranks and concatenated by the consumer's, bit for bit, over the grid of TP/PP
splits, KV heads, layouts, block ratios, MLA, dtypes and partial prefix hits."""

from __future__ import annotations

import doctest
import types

from support import bits, meshes, platforms

platforms.force_cpu_devices()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl.testing import absltest, parameterized  # noqa: E402
from support import transfer as tt  # noqa: E402

import jaxkv  # noqa: E402
from jaxkv import EngineConfig, KVCacheSpec, PagedKVCache  # noqa: E402
from jaxkv.transfer import _formatter as fmt  # noqa: E402


def _specs(heads, p_layout, c_layout, ratio, mla, dtype, num_layers=5, block_size=4):
    if mla:
        spec = KVCacheSpec(num_layers=num_layers, num_kv_heads=1, head_dim=8,
                           block_size=block_size, dtype=dtype, layout="TD", kv_factor=1, mla=True)
        return spec, spec.replace(block_size=block_size * ratio)
    spec = KVCacheSpec(num_layers=num_layers, num_kv_heads=heads, head_dim=8,
                       block_size=block_size, dtype=dtype, layout=p_layout)
    return spec, spec.replace(layout=c_layout, block_size=block_size * ratio)


def move(p_cfg, c_cfg, remote_ids, local_ids, g, num_blocks=tt.NUM_BLOCKS):
    """Formats a request from every producer pipeline rank and writes it into fresh consumer
    caches (one per consumer pipeline rank); returns them."""
    devices = jax.devices()
    tail = fmt.remote_tail(c_cfg, p_cfg, len(local_ids), remote_ids)
    wire = {}
    for pp in range(p_cfg.pp_size):
        arrays = tt.global_arrays(p_cfg, pp, g, remote_ids, num_blocks)
        mesh = jax.sharding.Mesh(np.array(devices[: p_cfg.tp_size]), ("tp",))
        cache = PagedKVCache.from_arrays(p_cfg.local_spec(pp), arrays, mesh=mesh)
        wire.update(fmt.split_request(cache, p_cfg, c_cfg, tail,
                                      fmt.rank_devices(cache, p_cfg, pp)))
    caches = []
    for pp in range(c_cfg.pp_size):
        mesh = jax.sharding.Mesh(np.array(devices[-c_cfg.tp_size:]), ("tp",))
        cache = PagedKVCache.allocate(c_cfg.local_spec(pp), num_blocks, mesh=mesh)
        ranks = fmt.rank_devices(cache, c_cfg, pp)
        pulled = {
            rank: [jax.device_put(wire[(route.producer_rank, rank)], device)
                   for route in fmt.receive_routes(c_cfg, p_cfg, rank, len(tail))]
            for rank, device in ranks.items()
        }
        caches.append(fmt.concat_request(cache, c_cfg, p_cfg, local_ids, len(tail), pulled,
                                         ranks))
    return caches, tail


def _tpu_spec(heads, head_dim, page, dtype, layout):
    """tpu-inference's packed cache (layout "tpu") or an unpacked one of the same model."""
    if layout == "tpu":
        return KVCacheSpec.for_tpu_inference(2, heads, head_dim, page, dtype)
    return KVCacheSpec(num_layers=2, num_kv_heads=heads, head_dim=head_dim, block_size=page,
                       dtype=dtype, layout=layout)


def _cache(spec, tp, arrays):
    mesh = meshes.tp(tp)
    return PagedKVCache.from_arrays(spec, arrays, mesh=mesh)


def move_packed(p_cfg, c_cfg, remote_ids, local_ids, g, num_blocks=tt.NUM_BLOCKS):
    """`move` for caches that may be packed: producer and (packed) consumer caches hold
    random sentinel bits outside the request; returns the consumer cache, its initial
    arrays and the producer blocks read."""
    tail = fmt.remote_tail(c_cfg, p_cfg, len(local_ids), remote_ids)
    p_spec, c_spec = p_cfg.spec, c_cfg.spec
    if p_spec.packing is not None:
        arrays = tt.packed_arrays(p_spec, p_cfg.tp_size, g, remote_ids, num_blocks, seed=11)
    else:
        arrays = tt.global_arrays(p_cfg, 0, g, remote_ids, num_blocks)
    producer = _cache(p_spec, p_cfg.tp_size, arrays)
    wire = fmt.split_request(producer, p_cfg, c_cfg, tail, fmt.rank_devices(producer, p_cfg))
    if c_spec.packing is not None:
        initial = tt.packed_arrays(c_spec, c_cfg.tp_size, g, [], num_blocks, seed=12)
    else:
        initial = [np.zeros(c_spec.array_shape(num_blocks), c_spec.dtype)
                   for _ in range(c_spec.num_arrays)]
    consumer = _cache(c_spec, c_cfg.tp_size, initial)
    ranks = fmt.rank_devices(consumer, c_cfg)
    pulled = {rank: [jax.device_put(wire[(route.producer_rank, rank)], device)
                     for route in fmt.receive_routes(c_cfg, p_cfg, rank, len(tail))]
              for rank, device in ranks.items()}
    consumer = fmt.concat_request(consumer, c_cfg, p_cfg, local_ids, len(tail), pulled, ranks)
    return consumer, initial, tail, wire


class PackedFormatterTest(parameterized.TestCase):
    """tpu-inference's packed caches (K/V interleaved, heads packed into words, head dim
    padded to 128 lanes) moved as values: bit exact, phantom heads and padding lanes of the
    consumer left untouched, none of them on the wire."""

    @parameterized.parameters(
        # (p_tp, c_tp, p_layout, c_layout, heads, head_dim, dtype, ratio, hit)
        (2, 1, "tpu", "tpu", 4, 96, "bfloat16", 1, 0),
        (1, 2, "tpu", "tpu", 4, 96, "bfloat16", 1, 0),
        (2, 2, "tpu", "tpu", 2, 128, "bfloat16", 2, 0),
        (1, 2, "tpu", "tpu", 2, 64, "float8_e4m3fn", 1, 0),  # phantom heads on each rank
        (2, 1, "tpu", "tpu", 2, 80, "float8_e4m3fn", 1, 1),  # ... on the producer's
        (2, 1, "tpu", "LKHTD", 4, 100, "float32", 1, 0),
        (1, 2, "HTD", "tpu", 4, 100, "float32", 2, 1),
        (2, 2, "THD", "tpu", 2, 96, "bfloat16", 1, 0),
    )
    def test_packed_grid(self, p_tp, c_tp, p_layout, c_layout, heads, head_dim, dtype, ratio,
                         hit):
        page = 4
        p_spec = _tpu_spec(heads, head_dim, page, dtype, p_layout)
        c_spec = _tpu_spec(heads, head_dim, page * ratio, dtype, c_layout)
        p_cfg, c_cfg = EngineConfig(p_spec, p_tp), EngineConfig(c_spec, c_tp)
        remote_ids = tt.REMOTE_IDS[:5] if ratio > 1 else tt.REMOTE_IDS
        local_ids = tt.LOCAL_IDS[: -(-len(remote_ids) // ratio) - hit]
        g = tt.global_cache(p_spec, len(remote_ids) * page, seed=tt.G_SEED)
        consumer, initial, tail, wire = move_packed(p_cfg, c_cfg, remote_ids, local_ids, g)
        first_token = (len(remote_ids) - len(tail)) * page
        # only values travel: n blocks x layers x K/V x heads x page x real head dim
        sent = sum(int(np.prod(b.shape)) for b in wire.values())
        self.assertEqual(sent, len(tail) * 2 * 2 * heads * page * head_dim
                         * c_spec.head_replication(c_tp))
        if c_spec.packing is not None:
            expected = [bits.bits(a) for a in initial]
            ids = np.asarray(local_ids)
            # sender blocks missing from a merged last block arrive as zeros (whole blocks
            # are written, as for unpacked caches)
            moved = g[:, :, :, first_token:]
            room = len(local_ids) * c_spec.block_size - moved.shape[3]
            moved = np.pad(moved, [(0, 0)] * 3 + [(0, room), (0, 0)])
            written = tt.packed_arrays(c_spec, c_tp, moved, local_ids, tt.NUM_BLOCKS, seed=12)
            mask = np.broadcast_to(
                np.concatenate([c_spec.payload_mask(c_tp)] * c_tp, axis=1)
                if c_tp > 1 else c_spec.payload_mask(c_tp),
                (len(ids), *c_spec.global_block_shape(c_tp)))
            for layer, (e, w) in enumerate(zip(expected, written)):
                blocks = e[ids]
                blocks[mask] = bits.bits(w)[ids][mask]
                e[ids] = blocks
                np.testing.assert_array_equal(bits.bits(np.asarray(consumer.arrays[layer])), e,
                                              err_msg=f"layer {layer}")
        else:
            FormatterTest.check(self, [consumer], c_cfg, g, local_ids, first_token)

    @parameterized.parameters(
        # (p_tp, c_tp, p_layout, c_layout, heads, head_dim, dtype)
        (2, 1, "tpu", "tpu", 4, 96, "bfloat16"),
        (1, 2, "tpu", "tpu", 2, 64, "float8_e4m3fn"),
        (2, 2, "THD", "tpu", 2, 96, "bfloat16"),
        (2, 1, "tpu", "LKHTD", 4, 100, "float32"),
    )
    def test_packed_layer_groups(self, p_tp, c_tp, p_layout, c_layout, heads, head_dim, dtype):
        """Layer groups of packed caches (one layer per group): after the first group only
        layer 0's arrays changed; after the last, the consumer holds exactly what the whole
        move writes (padding lanes and phantom heads kept)."""
        page = 4
        p_spec = _tpu_spec(heads, head_dim, page, dtype, p_layout)
        c_spec = _tpu_spec(heads, head_dim, page, dtype, c_layout)
        p_cfg, c_cfg = EngineConfig(p_spec, p_tp), EngineConfig(c_spec, c_tp)
        remote_ids, local_ids = tt.REMOTE_IDS, tt.LOCAL_IDS
        g = tt.global_cache(p_spec, len(remote_ids) * page, seed=tt.G_SEED)
        whole, initial, tail, _ = move_packed(p_cfg, c_cfg, remote_ids, local_ids, g)
        if p_spec.packing is not None:
            arrays = tt.packed_arrays(p_spec, p_tp, g, remote_ids, tt.NUM_BLOCKS, seed=11)
        else:
            arrays = tt.global_arrays(p_cfg, 0, g, remote_ids, tt.NUM_BLOCKS)
        producer = _cache(p_spec, p_tp, arrays)
        consumer = _cache(c_spec, c_tp, initial)
        ranks = fmt.rank_devices(consumer, c_cfg)
        groups = fmt.layer_groups(p_cfg, c_cfg.layer_split, len(tail), 0)
        self.assertEqual(groups, ((0, 1), (1, 2)))
        for index, layers in enumerate(groups):
            wire = fmt.split_layers(producer, p_cfg, c_cfg, tail,
                                    fmt.rank_devices(producer, p_cfg), layers)
            pulled = {rank: [jax.device_put(wire[(r.producer_rank, rank)], device)
                             for r in fmt.receive_layer_routes(c_cfg, p_cfg, rank, len(tail),
                                                               layers)]
                      for rank, device in ranks.items()}
            consumer = fmt.concat_layers(consumer, c_cfg, p_cfg, local_ids, len(tail), pulled,
                                         ranks, layers)
            if index == 0 and "L" not in c_spec.layout:  # layer 1's arrays untouched
                for key, got, first in zip(c_spec.array_keys(), consumer.arrays, initial):
                    if key[0] == 1:
                        np.testing.assert_array_equal(bits.bits(np.asarray(got)),
                                                      bits.bits(np.asarray(first)))
        for got, want in zip(consumer.arrays, whole.arrays):
            np.testing.assert_array_equal(bits.bits(np.asarray(got)),
                                          bits.bits(np.asarray(want)))

    def test_unpack_pack_round_trip_keeps_sentinels(self):
        """`pack_into_blocks(old, unpack_blocks(x))` of other blocks' values changes exactly
        the payload entries; every phantom head and padding lane of `old` survives."""
        spec = KVCacheSpec.for_tpu_inference(1, 2, 72, 4, dtype="float8_e4m3fn")
        rng = np.random.default_rng(3)
        shape = (3, *spec.block_shape(2))
        x = rng.integers(0, 256, size=shape, dtype=np.uint8)
        old = rng.integers(0, 256, size=shape, dtype=np.uint8)
        values = fmt.unpack_blocks(jnp.asarray(x), spec, 2)
        self.assertEqual(values.shape, (3, *fmt.values_spec(spec).block_shape(2)))
        new = np.asarray(fmt.pack_into_blocks(jnp.asarray(old), values, spec, 2))
        mask = np.broadcast_to(spec.payload_mask(2), shape)
        np.testing.assert_array_equal(new[mask], x[mask])
        np.testing.assert_array_equal(new[~mask], old[~mask])
        self.assertEqual(int(mask.sum()) // 3, 2 * 1 * 4 * 72)  # K/V x 1 head x page x dim


class StepMemoryGuardTest(absltest.TestCase):
    """When the JAX transport reads a running step's memory, and what happens when that
    step turns out not to have written the cache in place."""

    def setUp(self):
        super().setUp()
        from jaxkv.transfer import jax_transfer_available
        from jaxkv.transfer._jax_transport import JaxTransport

        if not jax_transfer_available():
            self.skipTest("this jax has no jax.experimental.transfer")
        spec = KVCacheSpec(num_layers=4, num_kv_heads=2, head_dim=8, block_size=4,
                           dtype="float32", layout="KHTD")
        mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("tp",))
        self.cache = PagedKVCache.allocate(spec, tt.NUM_BLOCKS, mesh=mesh)
        self.entry = types.SimpleNamespace(cache=self.cache, buffers=self.cache.shard_buffers(),
                                           layer_start=0, layer_stop=4, in_place=True)
        self.registry = types.SimpleNamespace(caches=[self.entry], versions=(1,),
                                              config=EngineConfig(spec, 2))
        self.transport = JaxTransport("p")
        self.addCleanup(self.transport.close)
        self.transport.attach(self.registry)

    def test_reads_step_memory_only_with_a_device_outside_the_mesh(self):
        self.assertTrue(self.transport.reads_step_memory(self.cache))
        self.assertNotIn(self.transport.format_device(self.cache), jax.devices()[:2])
        one = PagedKVCache.allocate(self.cache.spec, tt.NUM_BLOCKS,
                                    mesh=jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",)))
        self.assertFalse(self.transport.reads_step_memory(one))  # one device: rows instead
        all_devices = PagedKVCache.allocate(
            self.cache.spec.replace(num_kv_heads=len(jax.devices())), tt.NUM_BLOCKS,
            mesh=jax.sharding.Mesh(np.array(jax.devices()), ("tp",)))
        self.assertFalse(self.transport.reads_step_memory(all_devices))  # nowhere to format

    def test_step_memory_needs_an_in_place_step_and_leaves_the_last_group(self):
        t = self.transport
        t._step_versions["r"] = (1,)
        self.assertIsNotNone(t._step_memory("r", (0, 2)))
        self.assertIsNone(t._step_memory("r", (2, 4)))  # the last layer: the step's output
        self.entry.layer_stop = 2  # a pipeline stage of layers [0, 2): its last layer too
        self.assertIsNone(t._step_memory("r", (0, 2)))
        self.entry.layer_stop = 4
        self.registry.versions = (2,)  # another step's output was handed over since
        self.assertIsNone(t._step_memory("r", (0, 2)))
        self.registry.versions = (1,)
        self.entry.in_place = False  # no step was seen writing the cache in place yet
        self.assertIsNone(t._step_memory("r", (0, 2)))

    def test_a_subscription_waiting_for_layers_is_not_served(self):
        # The engine polls `serve` every few milliseconds while a step announces layers: a
        # layer-wise subscription is ready only once its next group's layers are published.
        from jaxkv.transfer._jax_transport import _Want

        t = self.transport
        want = _Want(types.SimpleNamespace(layer_group_bytes=1), groups=((0, 2), (2, 4)))
        t._wants["r"] = {("c", "r", 0): want}
        for stop, offered, ready in ((1, 0, False), (2, 0, True), (2, 1, False),
                                     (3, 1, False), (4, 1, True)):
            t._published["r"] = ((1, 2), 30.0, stop)
            want.offered = offered
            self.assertEqual(t._ready("r"), ready, (stop, offered))

    def test_a_step_that_moved_the_cache_fails_the_read(self):
        t = self.transport
        t._step_versions["r"] = (1,)
        t._step_memory("r", (0, 2))
        t._check_in_place("r")  # unmoved: nothing to say
        self.entry.buffers = PagedKVCache.allocate(
            self.cache.spec, tt.NUM_BLOCKS, mesh=self.cache.sharding.mesh).shard_buffers()
        with self.assertRaisesRegex(fmt.FormatError, "did not update the cache in place"):
            t._check_in_place("r")


class FormatterTest(parameterized.TestCase):
    def check(self, caches, c_cfg, g, local_ids, first_token):
        ids = np.asarray(local_ids)
        others = np.setdiff1d(np.arange(tt.NUM_BLOCKS), ids)
        for pp, cache in enumerate(caches):
            expected = tt.expected_arrays(c_cfg, pp, g, local_ids, first_token)
            for index, (array, want) in enumerate(zip(cache.arrays, expected)):
                got = bits.bits(np.asarray(array))
                np.testing.assert_array_equal(got[ids], want, err_msg=f"pp {pp} array {index}")
                self.assertFalse(got[others].any(), f"pp {pp} array {index}: other blocks")

    @parameterized.parameters(
        # (p_tp, c_tp, p_layout, c_layout, heads, ratio, p_pp, c_pp, mla, dtype, hit)
        (1, 2, "LKHTD", "LKHTD", 4, 1, 1, 1, False, "bfloat16", 0),
        (2, 1, "LKHTD", "LKHTD", 4, 1, 1, 1, False, "float32", 0),
        (2, 4, "LKHTD", "LKHTD", 4, 1, 1, 1, False, "bfloat16", 0),
        (4, 2, "KTHD", "LKTHD", 4, 1, 1, 1, False, "bfloat16", 0),
        (1, 4, "HTD", "HTD", 1, 1, 1, 1, False, "bfloat16", 0),
        (4, 1, "HTD", "LKHTD", 2, 1, 1, 1, False, "float32", 0),
        (2, 4, "THD", "KTHD", 8, 1, 1, 1, False, "bfloat16", 0),
        (4, 2, "LKHTD", "HTD", 1, 1, 1, 1, False, "bfloat16", 0),
        (1, 2, "HTD", "HTD", 4, 2, 1, 1, False, "bfloat16", 0),
        (2, 2, "KHTD", "KTHD", 4, 2, 1, 1, False, "bfloat16", 0),
        (1, 1, "LKTHD", "LKHTD", 4, 2, 1, 1, False, "float32", 1),
        (2, 1, "LKHTD", "LKHTD", 4, 1, 2, 1, False, "bfloat16", 0),
        (1, 2, "LKHTD", "HTD", 4, 1, 1, 2, False, "bfloat16", 2),
        (2, 2, "THD", "LKHTD", 2, 1, 2, 2, False, "float32", 0),
        (1, 2, "", "", 1, 1, 1, 1, True, "bfloat16", 0),
        (2, 1, "", "", 1, 2, 1, 2, True, "float32", 1),
    )
    def test_grid(self, p_tp, c_tp, p_layout, c_layout, heads, ratio, p_pp, c_pp, mla, dtype,
                  hit):
        p_spec, c_spec = _specs(heads, p_layout, c_layout, ratio, mla, dtype)
        p_cfg, c_cfg = EngineConfig(p_spec, p_tp, p_pp), EngineConfig(c_spec, c_tp, c_pp)
        remote_ids = tt.REMOTE_IDS[:5] if ratio > 1 else tt.REMOTE_IDS  # odd: a padded tail
        local_ids = tt.LOCAL_IDS[: -(-len(remote_ids) // ratio) - hit]
        g = tt.global_cache(p_spec, len(remote_ids) * p_spec.block_size, seed=tt.G_SEED)
        caches, tail = move(p_cfg, c_cfg, remote_ids, local_ids, g)
        first_token = (len(remote_ids) - len(tail)) * p_spec.block_size
        self.check(caches, c_cfg, g, local_ids, first_token)

    @parameterized.parameters(
        # (p_tp, c_tp, p_layout, c_layout, heads, ratio, p_pp, c_pp, mla, hit, min_bytes)
        (1, 2, "LKHTD", "LKHTD", 4, 1, 1, 1, False, 0, 0),
        (2, 1, "LKHTD", "HTD", 4, 1, 1, 1, False, 0, 1),
        (4, 2, "KTHD", "LKTHD", 4, 1, 1, 1, False, 0, 0),
        (2, 4, "THD", "KTHD", 8, 2, 1, 1, False, 1, 0),
        (2, 1, "LKHTD", "LKHTD", 4, 1, 2, 1, False, 0, 1 << 20),
        (1, 2, "LKHTD", "HTD", 4, 1, 1, 2, False, 2, 0),
        (2, 2, "THD", "LKHTD", 2, 1, 2, 2, False, 0, 0),
        (2, 1, "", "", 1, 2, 1, 2, True, 1, 0),
    )
    def test_layer_groups(self, p_tp, c_tp, p_layout, c_layout, heads, ratio, p_pp, c_pp, mla,
                          hit, min_bytes):
        """Layer groups moved one by one (`split_layers` / `concat_layers`): after each group
        exactly the layers moved so far hold the request's bytes, the later layers and the
        other blocks stay untouched; the last group leaves what the whole move leaves."""
        p_spec, c_spec = _specs(heads, p_layout, c_layout, ratio, mla, "bfloat16")
        p_cfg, c_cfg = EngineConfig(p_spec, p_tp, p_pp), EngineConfig(c_spec, c_tp, c_pp)
        remote_ids = tt.REMOTE_IDS[:5] if ratio > 1 else tt.REMOTE_IDS
        local_ids = tt.LOCAL_IDS[: -(-len(remote_ids) // ratio) - hit]
        g = tt.global_cache(p_spec, len(remote_ids) * p_spec.block_size, seed=tt.G_SEED)
        tail = fmt.remote_tail(c_cfg, p_cfg, len(local_ids), remote_ids)
        first_token = (len(remote_ids) - len(tail)) * p_spec.block_size
        groups = fmt.layer_groups(p_cfg, c_cfg.layer_split, len(tail), min_bytes)
        self.assertEqual(groups[0][0], 0)
        self.assertEqual(groups[-1][1], p_spec.num_layers)
        if min_bytes == 0:
            self.assertEqual(len(groups), p_spec.num_layers)
        devices = jax.devices()
        producers = []
        for pp in range(p_cfg.pp_size):
            mesh = jax.sharding.Mesh(np.array(devices[: p_cfg.tp_size]), ("tp",))
            producers.append(PagedKVCache.from_arrays(
                p_cfg.local_spec(pp), tt.global_arrays(p_cfg, pp, g, remote_ids, tt.NUM_BLOCKS),
                mesh=mesh))
        mesh = jax.sharding.Mesh(np.array(devices[-c_cfg.tp_size:]), ("tp",))
        caches = [PagedKVCache.allocate(c_cfg.local_spec(pp), tt.NUM_BLOCKS, mesh=mesh)
                  for pp in range(c_cfg.pp_size)]
        for a, b in groups:
            p_stage = p_cfg.layer_owner(a)
            producer = producers[p_stage]
            wire = fmt.split_layers(producer, p_cfg, c_cfg, tail,
                                    fmt.rank_devices(producer, p_cfg, p_stage), (a, b))
            q_stage = c_cfg.layer_owner(a)
            ranks = fmt.rank_devices(caches[q_stage], c_cfg, q_stage)
            pulled = {}
            for rank, device in ranks.items():
                routes = fmt.receive_layer_routes(c_cfg, p_cfg, rank, len(tail), (a, b))
                self.assertTrue(routes)
                for route in routes:
                    self.assertEqual(route.shape[1], b - a)  # only the group's layers travel
                pulled[rank] = [jax.device_put(wire[(r.producer_rank, rank)], device)
                                for r in routes]
            self.assertEqual(len(wire), sum(len(v) for v in pulled.values()))
            before = caches[q_stage].shard_buffers()
            caches[q_stage] = fmt.concat_layers(caches[q_stage], c_cfg, p_cfg, local_ids,
                                                len(tail), pulled, ranks, (a, b))
            if c_spec.layout.startswith("L") or "L" not in c_spec.layout:
                caches[q_stage].verify_unmoved(before)  # written in place
            moved = g.copy()
            moved[b:] = 0  # layers not moved yet: untouched (zeros)
            self.check(caches, c_cfg, moved, local_ids, first_token)
        with self.assertRaisesRegex(fmt.FormatError, "span pipeline stages"):
            if p_pp > 1 or c_pp > 1:
                fmt.split_layers(producers[0], p_cfg, c_cfg, tail,
                                 fmt.rank_devices(producers[0], p_cfg, 0), (0, 5))
            else:
                raise fmt.FormatError("span pipeline stages")

    @parameterized.parameters(
        # (p_tp, p_layout, c_layout, heads, p_pp, mla, dtype, hit)
        (2, "LKHTD", "HTD", 4, 1, False, "bfloat16", 0),
        (2, "KHTD", "LKHTD", 4, 1, False, "float32", 1),
        (2, "HTD", "KTHD", 2, 2, False, "bfloat16", 0),
        (4, "LKTHD", "THD", 4, 1, False, "float16", 2),
        (2, "KTHD", "LKHTD", 4, 2, False, "float32", 0),
        (2, "", "", 1, 1, True, "bfloat16", 1),
    )
    def test_layer_groups_from_shard_memory(self, p_tp, p_layout, c_layout, heads, p_pp, mla,
                                            dtype, hit):
        """A layer group gathered from the producer shards' memory (`gather_layer_rows`,
        what the JAX transport reads while a step writes the cache in place) and formatted on
        a device outside the producer's mesh is the group `split_layers` formats from the
        cache, bit for bit, on that device."""
        from jaxkv.transfer._jax_transport import gather_layer_rows

        p_spec, c_spec = _specs(heads, p_layout, c_layout, 1, mla, dtype)
        p_cfg, c_cfg = EngineConfig(p_spec, p_tp, p_pp), EngineConfig(c_spec, 1, 1)
        local_ids = tt.LOCAL_IDS[: len(tt.REMOTE_IDS) - hit]
        g = tt.global_cache(p_spec, len(tt.REMOTE_IDS) * p_spec.block_size, seed=tt.G_SEED)
        tail = fmt.remote_tail(c_cfg, p_cfg, len(local_ids), tt.REMOTE_IDS)
        devices = jax.devices()
        outside = devices[-1]
        mesh = jax.sharding.Mesh(np.array(devices[:p_tp]), ("tp",))
        for pp in range(p_pp):
            producer = PagedKVCache.from_arrays(
                p_cfg.local_spec(pp), tt.global_arrays(p_cfg, pp, g, tt.REMOTE_IDS,
                                                       tt.NUM_BLOCKS), mesh=mesh)
            entry = types.SimpleNamespace(cache=producer, layer_start=p_cfg.layer_range(pp)[0])
            ranks = fmt.rank_devices(producer, p_cfg, pp)
            l0, l1 = p_cfg.layer_range(pp)
            for a in range(l0, l1, 2):
                layers = (a, min(a + 2, l1))
                want = fmt.split_layers(producer, p_cfg, c_cfg, tail, ranks, layers)
                rows = gather_layer_rows(entry, producer.shard_buffers(), tail, layers)
                got = fmt.split_layers(producer, p_cfg, c_cfg, tail, ranks, layers,
                                       rows=rows, place=outside)
                self.assertEqual(sorted(got), sorted(want))
                for key, buffer in got.items():
                    self.assertEqual(buffer.devices(), {outside})
                    np.testing.assert_array_equal(bits.bits(np.asarray(buffer)),
                                                  bits.bits(np.asarray(want[key])),
                                                  err_msg=f"{key}, layers {layers}")

    @parameterized.parameters(False, True)
    def test_one_program_with_or_without_pooled_buffers(self, packed):
        # The JAX transport formats into its pool's buffers (`staging`) when it has them and
        # into fresh ones otherwise: the same program either way (compiled once per
        # geometry, by the first request, not again by the first that finds pooled buffers),
        # and the same bytes as formatting without a pool, whatever the buffers held. Also
        # for tpu-inference's packed cache (its values extracted in the same program).
        from support import compiles

        if packed:
            p_spec = _tpu_spec(4, 96, 4, "bfloat16", "tpu")
            c_spec = _tpu_spec(4, 96, 4, "bfloat16", "LKHTD")
        else:
            p_spec, c_spec = _specs(4, "KHTD", "THD", 1, False, "bfloat16", num_layers=3)
        p_cfg, c_cfg = EngineConfig(p_spec, 2), EngineConfig(c_spec, 1)
        g = tt.global_cache(p_spec, len(tt.REMOTE_IDS) * p_spec.block_size, seed=tt.G_SEED)
        arrays = (tt.packed_arrays(p_spec, 2, g, tt.REMOTE_IDS, tt.NUM_BLOCKS, seed=11)
                  if packed else tt.global_arrays(p_cfg, 0, g, tt.REMOTE_IDS, tt.NUM_BLOCKS))
        cache = _cache(p_spec, 2, arrays)
        ranks = fmt.rank_devices(cache, p_cfg, 0)
        want = fmt.split_request(cache, p_cfg, c_cfg, tt.REMOTE_IDS, ranks)

        def pooled(device, shapes):  # buffers full of garbage, as a pool hands them back
            return [jax.device_put(np.full(shape, 7, dtype), device) for shape, dtype in shapes]

        with compiles.recorded() as compiled:
            for staging, name in ((lambda device, shapes: None, "fresh"), (pooled, "pooled")):
                before = len(compiled)
                got = fmt.split_request(cache, p_cfg, c_cfg, tt.REMOTE_IDS, ranks,
                                        staging=staging)
                self.assertEqual(sorted(got), sorted(want))
                for key in want:
                    np.testing.assert_array_equal(bits.bits(np.asarray(got[key])),
                                                  bits.bits(np.asarray(want[key])),
                                                  err_msg=f"{name} {key}")
                if name == "pooled":  # the fresh buffers' program served it: nothing compiled
                    self.assertEqual(compiled[before:], [])
        self.assertIn("Compiling jit(_gather_split)", compiled)  # by the first staged request

    def test_nan_payloads_survive(self):
        # random bits hold NaNs with payloads; XLA's float moves may canonicalize them
        spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4,
                           dtype="bfloat16", layout="HTD")
        cfg = EngineConfig(spec, 1)
        g = tt.global_cache(spec, 6 * 4, seed=5)
        width = g.view(np.uint16)
        width[0, 0, 0, 0, :4] = [0x7FC1, 0xFFC3, 0x7F81, 0xFF80 | 0x7F]  # NaNs, payloads
        caches, _ = move(cfg, EngineConfig(spec.replace(layout="THD"), 1), tt.REMOTE_IDS,
                         tt.LOCAL_IDS, g)
        self.check(caches, EngineConfig(spec.replace(layout="THD"), 1), g, tt.LOCAL_IDS, 0)

    def test_refusals(self):
        spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4)
        with self.assertRaisesRegex(fmt.FormatError, "not a multiple"):
            fmt.send_routes(EngineConfig(spec, 1), EngineConfig(spec.replace(block_size=6), 1),
                            0, 3)
        with self.assertRaisesRegex(fmt.FormatError, "head_dim"):
            fmt.receive_routes(EngineConfig(spec, 1), EngineConfig(spec.replace(head_dim=4), 1),
                               0, 3)
        with self.assertRaisesRegex(fmt.FormatError, "fill only"):
            fmt.remote_tail(EngineConfig(spec, 1), EngineConfig(spec, 1), 4, [1, 2, 3])
        mla = KVCacheSpec.for_tpu_inference_mla(2, 576, 16)
        with self.assertRaisesRegex(fmt.FormatError, "packed on the head axis only"):
            fmt.check_formattable(mla)
        # a buffer of the wrong shape is refused before anything is written
        cfg = EngineConfig(spec, 1)
        cache = PagedKVCache.allocate(spec, 8)
        ranks = fmt.rank_devices(cache, cfg)
        with self.assertRaisesRegex(fmt.FormatError, "expected"):
            fmt.concat_request(cache, cfg, cfg, [1, 2], 2, {0: [jnp.zeros((2, 2, 2, 2, 4, 4))]},
                               ranks)
        with self.assertRaisesRegex(fmt.FormatError, "0 buffers"):
            fmt.concat_request(cache, cfg, cfg, [1, 2], 2, {}, ranks)

    @parameterized.parameters("jaxkv.transfer._formatter", "jaxkv.transfer._jax_transport")
    def test_docstring_examples(self, module_name):
        import importlib

        module = importlib.import_module(module_name)
        globs = {"jax": jax, "jnp": jnp, "np": np, "jaxkv": jaxkv, "KVCacheSpec": KVCacheSpec,
                 "EngineConfig": EngineConfig}
        result = doctest.testmod(module, extraglobs=globs, optionflags=doctest.ELLIPSIS,
                                 verbose=False)
        self.assertGreater(result.attempted, 0)
        self.assertEqual(result.failed, 0)


if __name__ == "__main__":
    absltest.main()
