"""Tests of PagedKVCache: allocation, head sharding over CPU devices, in-place ops, buffers."""

from support import bits, meshes, numpy_ops, platforms

platforms.force_cpu_devices()

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import absltest, parameterized

from jaxkv import LAYOUT_PRESETS, BufferMovedError, KVCacheSpec, PagedKVCache
from jaxkv._spec import SUPPORTED_DTYPES

COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter")


def _spec(layout: str, heads: int = 4, dtype: str = "bfloat16") -> KVCacheSpec:
    if layout == "TD":
        return KVCacheSpec.for_mla(num_layers=3, latent_dim=16, block_size=4, dtype=dtype)
    return KVCacheSpec(num_layers=3, num_kv_heads=heads, head_dim=8, block_size=4, dtype=dtype,
                       layout=layout)


# Explicit axes, as jax.make_mesh gives.
_tp_mesh = functools.partial(meshes.tp, explicit=True)


def _fill(cache: PagedKVCache, seed: int) -> tuple[PagedKVCache, list[np.ndarray]]:
    """A cache like `cache` holding random bits; returns it and the host copies."""
    rng = np.random.default_rng(seed)
    hosts = [bits.random_bits(rng, a.shape, a.dtype) for a in cache.arrays]
    mesh = cache.sharding.source_mesh
    return PagedKVCache.from_arrays(cache.spec, hosts, mesh=mesh), hosts


# Every layout x head count x TP size; the dtypes take turns (each appears in every layout),
# since the copies move bytes and the dtype only changes the element width.
_GRID = [
    dict(layout=layout, heads=heads, tp=tp,
         dtype=SUPPORTED_DTYPES[index % len(SUPPORTED_DTYPES)].name)
    for index, (layout, heads, tp) in enumerate(
        (layout, heads, tp)
        for layout in sorted(set(LAYOUT_PRESETS.values()))
        for heads in (1, 2, 4, 8)
        for tp in (1, 2, 4, 8)
    )
]


class AllocationTest(parameterized.TestCase):
    @parameterized.parameters(*sorted(set(LAYOUT_PRESETS.values())))
    def test_every_preset_allocates_zeroed_arrays(self, layout):
        spec = _spec(layout)
        cache = PagedKVCache.allocate(spec, num_blocks=6)
        self.assertLen(cache.arrays, spec.num_arrays)
        self.assertEqual(cache.array_keys, spec.array_keys())
        for array in cache.arrays:
            self.assertEqual(array.shape, (6, *spec.block_shape()))
            self.assertEqual(array.dtype, spec.dtype)
            self.assertFalse(np.any(bits.bits(array)))
        self.assertEqual(cache.nbytes, spec.cache_nbytes(6))

    @parameterized.parameters("float8_e5m2", "float8_e4m3fn", "bfloat16", "float16", "float32")
    def test_from_arrays_keeps_nan_payloads_on_sharded_caches(self, dtype):
        # Every bit pattern of the element width, NaN payloads included, on a head-sharded,
        # a head-replicated and an unsharded cache; the data comes from numpy and from a
        # device array (which jax 0.12's device_put would reshard with canonical NaNs).
        spec = _spec("KHTD", heads=4, dtype=dtype).replace(num_layers=1)
        width = np.dtype(spec.dtype).itemsize * 8
        count = int(np.prod(spec.array_shape(8)))
        patterns = (np.arange(count, dtype=np.uint64) * 0x9E3779B97F4A7C15 >> (64 - width))
        host = patterns.astype(f"u{width // 8}").view(spec.dtype).reshape(spec.array_shape(8))
        for tp in (1, 2, 8):
            for data in (host, jnp.asarray(host)):
                cache = PagedKVCache.from_arrays(spec, [data], mesh=_tp_mesh(tp))
                np.testing.assert_array_equal(bits.bits(cache.arrays[0]),
                                              bits.bits(host), err_msg=f"tp={tp}")
                dense = cache.gather_blocks(np.arange(8))
                cache = cache.scatter_blocks([jnp.asarray(np.asarray(dense[0]))], np.arange(8))
                np.testing.assert_array_equal(bits.bits(cache.arrays[0]),
                                              bits.bits(host), err_msg=f"tp={tp}")

    def test_array_lookup(self):
        cache = PagedKVCache.allocate(_spec("HTD"), num_blocks=2)
        self.assertIs(cache.array(layer=2, kv=1), cache.arrays[5])
        with self.assertRaisesRegex(KeyError, "no array for layer=3"):
            cache.array(layer=3, kv=0)

    def test_bad_arguments(self):
        with self.assertRaisesRegex(ValueError, "num_blocks"):
            PagedKVCache.allocate(_spec("KHTD"), num_blocks=0)
        with self.assertRaisesRegex(ValueError, "cannot be split evenly"):
            PagedKVCache.allocate(_spec("KHTD", heads=3), num_blocks=2, mesh=_tp_mesh(2))
        with self.assertRaisesRegex(ValueError, "not a multiple"):
            PagedKVCache.allocate(_spec("KHTD", heads=3), num_blocks=2, mesh=_tp_mesh(4))
        with self.assertRaisesRegex(ValueError, "TP axis 'tp'"):
            PagedKVCache.allocate(_spec("KHTD"), 2, mesh=jax.make_mesh((2,), ("x",),
                                                                       devices=jax.devices()[:2]))
        with self.assertRaisesRegex(ValueError, "needs 2 arrays"):
            PagedKVCache.from_arrays(_spec("KHTD", heads=1).replace(num_layers=2), [jnp.zeros(1)])


class HeadShardingTest(parameterized.TestCase):
    @parameterized.product(heads=[1, 2, 4, 8], tp=[1, 2, 4, 8], layout=["LKHTD", "KTHD"])
    def test_rank_holds_the_heads_of_semantics_section_2(self, heads, tp, layout):
        spec = _spec(layout, heads=heads, dtype="float32")
        cache = PagedKVCache.allocate(spec, num_blocks=2, mesh=_tp_mesh(tp))
        self.assertEqual(cache.tp_size, tp)
        # Give every head a distinct value so each shard reveals which heads it holds.
        head_axis = 1 + spec.layout.index("H")
        shape = [1] * (len(spec.layout) + 1)
        shape[head_axis] = heads
        coded = np.broadcast_to(np.arange(heads, dtype=np.float32).reshape(shape),
                                cache.arrays[0].shape)
        cache = PagedKVCache.from_arrays(spec, [coded] * len(cache.arrays), mesh=_tp_mesh(tp))
        rank_of = {d.id: r for r, d in enumerate(jax.devices()[:tp])}
        for shard in cache.arrays[0].addressable_shards:
            rank = rank_of[shard.device.id]
            if tp <= heads:
                expected = list(range(rank * heads // tp, (rank + 1) * heads // tp))
            else:
                expected = [rank // (tp // heads)]
            held = np.unique(np.asarray(shard.data)).astype(int).tolist()
            self.assertEqual(held, expected, f"rank {rank}")
            self.assertEqual(shard.data.shape[head_axis], spec.heads_per_rank(tp))
        buffers = [b for b in cache.shard_buffers() if b.array_index == 0]
        self.assertLen(buffers, tp)
        for buffer in buffers:
            rank = rank_of[buffer.device.id]
            first = rank * heads // tp if tp <= heads else rank // (tp // heads)
            self.assertEqual((buffer.head_start, buffer.head_stop),
                             (first, first + spec.heads_per_rank(tp)))
            self.assertEqual(buffer.nbytes, 2 * spec.block_nbytes(tp))
            self.assertEqual(buffer.memory_kind, "DRAM")

    def test_mla_is_replicated_on_every_rank(self):
        cache = PagedKVCache.allocate(_spec("TD"), num_blocks=3, mesh=_tp_mesh(4))
        cache, hosts = _fill(cache, 7)
        for array, host in zip(cache.arrays, hosts):
            self.assertLen(array.addressable_shards, 4)
            for shard in array.addressable_shards:
                np.testing.assert_array_equal(bits.bits(shard.data), bits.bits(host))

    def test_other_mesh_axes_replicate_the_cache(self):
        mesh = jax.make_mesh((2, 4), ("dp", "tp"))
        cache = PagedKVCache.allocate(_spec("KHTD", heads=8), num_blocks=2, mesh=mesh)
        shards = cache.arrays[0].addressable_shards
        self.assertLen(shards, 8)
        self.assertTrue(all(s.data.shape[2] == 2 for s in shards))


class ShardedOpsTest(parameterized.TestCase):
    @parameterized.product(
        layout=["LKHTD", "KHTD", "KTHD", "HTD", "THD", "TD"],
        heads_tp=[(4, 2), (2, 4), (8, 8)],
    )
    def test_ops_on_sharded_cache_are_exact_and_in_place(self, layout, heads_tp):
        heads, tp = heads_tp
        cache = PagedKVCache.allocate(_spec(layout, heads=heads), num_blocks=10, mesh=_tp_mesh(tp))
        cache, hosts = _fill(cache, 11)
        before = cache.shard_buffers()

        cache = cache.copy_blocks([0, 1, -1, 3], [5, 6, 7, -1])
        hosts = [numpy_ops.numpy_copy_blocks(h, [0, 1, -1, 3], [5, 6, 7, -1]) for h in hosts]
        rng = np.random.default_rng(3)
        dense = [bits.random_bits(rng, (3, *h.shape[1:]), h.dtype) for h in hosts]
        cache = cache.scatter_blocks([jnp.asarray(d) for d in dense], [9, -1, 2])
        hosts = [numpy_ops.numpy_scatter_blocks(h, d, [9, -1, 2]) for h, d in zip(hosts, dense)]
        gathered = cache.gather_blocks([9, 5, -1, 0])
        reused = cache.gather_blocks([0, 9, 5, -1],
                                     out=cache.gather_blocks([1, 2, 3, 4]))

        cache.verify_unmoved(before)
        for array, host in zip(cache.arrays, hosts):
            np.testing.assert_array_equal(bits.bits(array), bits.bits(host))
        for out, again, host in zip(gathered, reused, hosts):
            self.assertEqual(out.sharding.spec, cache.partition_spec())
            expected = numpy_ops.numpy_gather_blocks(host, [9, 5, -1, 0])
            np.testing.assert_array_equal(bits.bits(out), bits.bits(expected))
            expected = numpy_ops.numpy_gather_blocks(host, [0, 9, 5, -1])
            np.testing.assert_array_equal(bits.bits(again), bits.bits(expected))

    @parameterized.parameters(*_GRID)
    @pytest.mark.slow  # innermost, so that every generated case carries the mark
    def test_exhaustive_grid(self, layout, dtype, heads, tp):
        if layout == "TD" and heads != 1:
            self.skipTest("MLA has one head")
        cache = PagedKVCache.allocate(_spec(layout, heads=heads, dtype=dtype), num_blocks=6,
                                      mesh=_tp_mesh(tp))
        cache, hosts = _fill(cache, heads * 31 + tp)
        before = cache.shard_buffers()
        cache = cache.copy_blocks([0, -1, 2], [3, 4, 5])
        dense = cache.gather_blocks([5, 1])
        cache = cache.scatter_blocks(dense, [0, -1])
        cache.verify_unmoved(before)
        for array, out, host in zip(cache.arrays, dense, hosts):
            host = numpy_ops.numpy_copy_blocks(host, [0, -1, 2], [3, 4, 5])
            expected_dense = numpy_ops.numpy_gather_blocks(host, [5, 1])
            host = numpy_ops.numpy_scatter_blocks(host, expected_dense, [0, -1])
            np.testing.assert_array_equal(bits.bits(out), bits.bits(expected_dense))
            np.testing.assert_array_equal(bits.bits(array), bits.bits(host))

    @parameterized.parameters("copy", "gather", "gather_into", "scatter")
    def test_compiled_program_has_no_collectives(self, op):
        cache = PagedKVCache.allocate(_spec("LKHTD", heads=8), num_blocks=8, mesh=_tp_mesh(8))
        ids = jnp.array([1, 2], jnp.int32)
        if op == "copy":
            fn, args = (lambda c, i: c.copy_blocks(i, i + 4)), (cache, ids)
        elif op == "gather":
            fn, args = (lambda c, i: c.gather_blocks(i)), (cache, ids)
        elif op == "gather_into":
            blocks = cache.gather_blocks(ids)
            fn, args = (lambda c, i, o: c.gather_blocks(i, out=o)), (cache, ids, blocks)
        else:
            blocks = cache.gather_blocks(ids)
            fn, args = (lambda c, b, i: c.scatter_blocks(b, i)), (cache, blocks, ids)
        donate = {"copy": 0, "gather": (), "gather_into": 2, "scatter": 0}[op]
        text = jax.jit(fn, donate_argnums=donate).lower(*args).compile().as_text()
        target = "jaxkv_gather_blocks_into" if op == "gather_into" else f"jaxkv_{op}_blocks"
        self.assertIn(target, text)
        for collective in COLLECTIVES:
            self.assertNotIn(collective, text)

    def test_jitted_step_with_donated_cache_keeps_addresses(self):
        cache = PagedKVCache.allocate(_spec("KTHD", heads=4), num_blocks=8, mesh=_tp_mesh(4))
        cache, hosts = _fill(cache, 5)
        before = cache.shard_buffers()

        @jax.jit
        def step(c, src, dst):
            return c.copy_blocks(src, dst)

        donated = jax.jit(step, donate_argnums=0)
        for src, dst in [([0], [1]), ([2], [3]), ([4], [5])]:
            cache = donated(cache, jnp.array(src, jnp.int32), jnp.array(dst, jnp.int32))
            hosts = [numpy_ops.numpy_copy_blocks(h, src, dst) for h in hosts]
        cache.verify_unmoved(before)
        for array, host in zip(cache.arrays, hosts):
            np.testing.assert_array_equal(bits.bits(array), bits.bits(host))

    def test_update_without_donation_is_detected(self):
        cache = PagedKVCache.allocate(_spec("KHTD", heads=2), num_blocks=4, mesh=_tp_mesh(2))
        before = cache.shard_buffers()
        moved = jax.jit(lambda c: c.copy_blocks(jnp.array([0], jnp.int32),
                                                jnp.array([1], jnp.int32)))(cache)
        with self.assertRaisesRegex(BufferMovedError, "array 0 on .*: was 0x"):
            moved.verify_unmoved(before)

    def test_bad_ids_on_cache(self):
        cache = PagedKVCache.allocate(_spec("KHTD", heads=2), num_blocks=4, mesh=_tp_mesh(2))
        with self.assertRaisesRegex(IndexError, "out of range for a cache of 4 blocks"):
            cache.copy_blocks([0], [4])
        with self.assertRaisesRegex(ValueError, "duplicate id 1"):
            cache.scatter_blocks(cache.gather_blocks([0, 2]), [1, 1])
        with self.assertRaisesRegex(ValueError, "1 block arrays for a cache of 3 arrays"):
            cache.scatter_blocks(cache.gather_blocks([0])[:1], [1])
        with self.assertRaisesRegex(jax.errors.JaxRuntimeError, "INVALID_ARGUMENT"):
            jax.block_until_ready(
                jax.jit(lambda c, i: c.gather_blocks(i))(cache, jnp.array([7], jnp.int32)))

    def test_pytree_round_trip(self):
        cache = PagedKVCache.allocate(_spec("HTD", heads=2), num_blocks=2)
        leaves, treedef = jax.tree_util.tree_flatten(cache)
        self.assertLen(leaves, 6)
        rebuilt = jax.tree_util.tree_unflatten(treedef, leaves)
        self.assertEqual(rebuilt.spec, cache.spec)
        self.assertIn("layout='HTD'", repr(rebuilt))


class FrameworkCacheTest(parameterized.TestCase):
    """Caches as tpu-inference / sglang-jax allocate them: adopted zero-copy, TP over a tuple
    of mesh axes."""

    def _framework_arrays(self, spec, mesh, axes, num_blocks, seed):
        """Per-layer arrays allocated the way the framework does (a jitted computation with
        its sharding), holding random bits."""
        rng = np.random.default_rng(seed)
        shape = (num_blocks, *spec.global_block_shape(4))
        hosts = [bits.random_bits(rng, shape, spec.dtype) for _ in range(spec.num_arrays)]
        named = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, None, axes))
        make = jax.jit(jnp.copy, out_shardings=named)
        return [make(h) for h in hosts], hosts

    def test_wrap_adopts_tpu_inference_layers_zero_copy(self):
        spec = KVCacheSpec.for_tpu_inference(2, num_kv_heads=8, head_dim=64, page_size=4,
                                             dtype="bfloat16")
        mesh = meshes.mesh((2, 2), ("model", "expert"), explicit=True)
        arrays, hosts = self._framework_arrays(spec, mesh, ("model", "expert"), 6, 0)
        self.assertEqual(arrays[0].shape, (6, 4, 8, 2, 128))  # 16 combined heads / packing 2
        pointers = [[s.data.unsafe_buffer_pointer() for s in a.addressable_shards]
                    for a in arrays]
        cache = PagedKVCache.wrap(arrays, spec, mesh, tp_axis=("model", "expert"))
        self.assertEqual(cache.tp_size, 4)
        for adopted, given in zip(cache.arrays, arrays):
            self.assertIs(adopted, given)
        self.assertEqual([[b.address for b in cache.shard_buffers() if b.array_index == i]
                          for i in range(2)], pointers)
        self.assertEqual(sorted({(b.head_start, b.head_stop) for b in cache.shard_buffers()}),
                         [(0, 2), (2, 4), (4, 6), (6, 8)])
        before = cache.shard_buffers()
        cache = cache.copy_blocks([0, 1], [5, -1])
        cache.verify_unmoved(before)  # updated in place
        for array, host in zip(cache.arrays, hosts):
            expected = numpy_ops.numpy_copy_blocks(host, [0], [5])
            np.testing.assert_array_equal(bits.bits(array), bits.bits(expected))

    def test_wrap_refuses_what_it_would_have_to_copy(self):
        spec = KVCacheSpec.for_tpu_inference(1, num_kv_heads=4, head_dim=128, page_size=4,
                                             dtype="float32")
        mesh = meshes.mesh((2, 2), ("model", "expert"), explicit=True)
        arrays, _ = self._framework_arrays(spec, mesh, ("model", "expert"), 3, 1)
        with self.assertRaisesRegex(ValueError, "adopting it would copy"):
            PagedKVCache.wrap([jax.device_put(arrays[0], jax.sharding.NamedSharding(
                mesh, jax.sharding.PartitionSpec()))], spec, mesh, tp_axis=("model", "expert"))
        with self.assertRaisesRegex(ValueError, "needs 1 arrays, got 2"):
            PagedKVCache.wrap(arrays * 2, spec, mesh, tp_axis=("model", "expert"))
        with self.assertRaisesRegex(ValueError, "the spec needs"):
            PagedKVCache.wrap([arrays[0][:, :2]], spec, mesh, tp_axis=("model", "expert"))
        with self.assertRaisesRegex(ValueError, "do not include the TP axis"):
            PagedKVCache.wrap(arrays, spec, mesh, tp_axis=("model", "tp"))
        arrays[0].delete()
        with self.assertRaisesRegex(ValueError, "deleted"):
            PagedKVCache.wrap(arrays, spec, mesh, tp_axis=("model", "expert"))

    def test_wrap_one_device(self):
        spec = KVCacheSpec.for_tpu_inference_mla(1, latent_dim=64, page_size=8, dtype="bfloat16")
        layer = jax.jit(jnp.zeros, static_argnums=(0, 1))((5, *spec.block_shape()), spec.dtype)
        cache = PagedKVCache.wrap([layer], spec)
        self.assertIs(cache.arrays[0], layer)
        self.assertEqual(layer.shape, (5, 4, 2, 128))

    @parameterized.parameters("KHTD", "tpu_inference")
    def test_tuple_tp_axes_ops_are_exact_without_collectives(self, layout):
        if layout == "tpu_inference":
            spec = KVCacheSpec.for_tpu_inference(2, 4, 64, 4, dtype="float8_e4m3fn")
        else:
            spec = _spec(layout, heads=4)
        mesh = meshes.mesh((2, 2), ("model", "expert"), explicit=True)
        cache = PagedKVCache.allocate(spec, num_blocks=6, mesh=mesh, tp_axis=("model", "expert"))
        self.assertIn(("model", "expert"), tuple(cache.partition_spec()))
        rng = np.random.default_rng(3)
        hosts = [bits.random_bits(rng, a.shape, a.dtype) for a in cache.arrays]
        cache = PagedKVCache.from_arrays(spec, hosts, mesh=mesh, tp_axis=("model", "expert"))
        cache = cache.copy_blocks([1, 2], [4, 5])
        got = cache.gather_blocks([4, -1])
        for g, h in zip(got, hosts):
            expected = numpy_ops.numpy_copy_blocks(h, [1, 2], [4, 5])
            np.testing.assert_array_equal(bits.bits(g),
                                          bits.bits(numpy_ops.numpy_gather_blocks(
                                              expected, [4, -1])))
        text = jax.jit(lambda c, i: c.copy_blocks(i, i + 3), donate_argnums=0).lower(
            cache, jnp.array([0, 1], jnp.int32)).compile().as_text()
        for collective in COLLECTIVES:
            self.assertNotIn(collective, text)


class DataParallelTest(parameterized.TestCase):
    """A block axis split over a data-parallel mesh axis: ids come in one segment per shard and
    every op runs on the owning shard, without collectives."""

    def _cache(self, layout="KHTD", seed=0):
        mesh = meshes.mesh((2, 2), ("data", "tp"), explicit=True)
        spec = _spec(layout, heads=4)
        rng = np.random.default_rng(seed)
        shape = spec.array_shape(8)
        hosts = [bits.random_bits(rng, shape, spec.dtype) for _ in range(spec.num_arrays)]
        cache = PagedKVCache.from_arrays(spec, hosts, mesh=mesh, data_axis="data")
        return cache, hosts

    @parameterized.parameters("KHTD", "TD")
    def test_ops_route_to_the_owning_shard(self, layout):
        cache, hosts = self._cache(layout)
        self.assertEqual(cache.partition_spec()[0], "data")
        self.assertEqual(sorted({(b.block_start, b.block_stop) for b in cache.shard_buffers()}),
                         [(0, 4), (4, 8)])
        before = cache.shard_buffers()
        # Shard 0 owns blocks 0-3, shard 1 blocks 4-7; two ids per shard segment.
        cache = cache.copy_blocks([0, -1, 5, 6], [3, 2, 4, -1])
        cache.verify_unmoved(before)
        hosts = [numpy_ops.numpy_copy_blocks(h, [0, 5], [3, 4]) for h in hosts]
        got = cache.gather_blocks([3, -1, 7, 4])
        for g, h in zip(got, hosts):
            self.assertEqual(g.sharding.spec[0], "data")
            expected = numpy_ops.numpy_gather_blocks(h, [3, -1, 7, 4])
            np.testing.assert_array_equal(bits.bits(g), bits.bits(expected))
        cache = cache.scatter_blocks(got, [1, 2, -1, 6])
        for array, h in zip(cache.arrays, hosts):
            expected = numpy_ops.numpy_scatter_blocks(h, np.asarray(
                numpy_ops.numpy_gather_blocks(h, [3, -1, 7, 4])), [1, 2, -1, 6])
            np.testing.assert_array_equal(bits.bits(array), bits.bits(expected))

    def test_traced_ids_and_no_collectives(self):
        cache, hosts = self._cache()
        step = jax.jit(lambda c, s, d: c.copy_blocks(s, d), donate_argnums=0)
        src, dst = jnp.array([1, 2, 4, 7], jnp.int32), jnp.array([0, 3, 5, 6], jnp.int32)
        text = step.lower(cache, src, dst).compile().as_text()
        for collective in COLLECTIVES:
            self.assertNotIn(collective, text)
        cache = step(cache, src, dst)
        for array, h in zip(cache.arrays, hosts):
            expected = numpy_ops.numpy_copy_blocks(h, [1, 2, 4, 7], [0, 3, 5, 6])
            np.testing.assert_array_equal(bits.bits(array), bits.bits(expected))
        text = jax.jit(lambda c, i: c.gather_blocks(i)).lower(cache, src).compile().as_text()
        for collective in COLLECTIVES:
            self.assertNotIn(collective, text)

    def test_ids_in_the_wrong_segment_raise(self):
        cache, _ = self._cache()
        with self.assertRaisesRegex(ValueError, "ids\\[0\\] = 5 is in data shard 1"):
            cache.gather_blocks([5, 0])
        # Copy ids are global (one semantics with jaxkv.ops): a pair may sit anywhere, but
        # its two blocks must be in one shard.
        with self.assertRaisesRegex(ValueError, "pair 0 \\(0 -> 4\\) crosses data shards"):
            cache.copy_blocks([0, 5], [4, 6])
        with self.assertRaisesRegex(ValueError, "3 ids for a block axis split in 2 shards"):
            cache.gather_blocks([0, 1, 5])
        with self.assertRaisesRegex(ValueError, "cannot be split evenly over 2"):
            PagedKVCache.allocate(_spec("KHTD"), 7, mesh=cache.sharding.mesh, data_axis="data")
        with self.assertRaisesRegex(ValueError, "data_axis 'tp' must be a mesh axis other"):
            PagedKVCache.allocate(_spec("KHTD"), 8, mesh=cache.sharding.mesh, data_axis="tp")


if __name__ == "__main__":
    absltest.main()
