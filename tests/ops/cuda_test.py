"""The CUDA handlers on a real GPU: exact against numpy, in place, ids checked on the device or
skipped. More paths: cuda_paths_test.py.

Skipped where JAX sees no GPU; fails under JAXKV_EXPECT_GPU=1 when JAX sees none.
"""

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
from support import bits, numpy_ops, platforms

from jaxkv import KVCacheSpec, PagedKVCache, ops
from jaxkv._spec import SUPPORTED_DTYPES


@absltest.skipIf(not platforms.gpus(), "no GPU visible to JAX")
class CudaOpsTest(parameterized.TestCase):
    def _cache(self, seed, dtype, block_shape=(2, 4, 16, 64), num_blocks=64):
        rng = np.random.default_rng(seed)
        host = bits.random_bits(rng, (num_blocks, *block_shape), dtype)
        return host, jax.device_put(host, platforms.gpus()[0])

    @parameterized.product(dtype=[d.name for d in SUPPORTED_DTYPES],
                           block_shape=[(2, 4, 16, 64), (3, 5), (7,)])
    def test_ops_match_numpy(self, dtype, block_shape):
        host, cache = self._cache(0, dtype, block_shape)
        address = cache.unsafe_buffer_pointer()
        src, dst = [0, 5, -1, 9, 33], [1, 60, 7, -1, 2]
        cache = ops.copy_blocks(cache, src, dst)
        host = numpy_ops.numpy_copy_blocks(host, src, dst)
        gathered = ops.gather_blocks(cache, [60, -1, 2, 2])
        blocks = bits.random_bits(np.random.default_rng(1), (3, *block_shape), dtype)
        on_gpu = jax.device_put(blocks, platforms.gpus()[0])
        cache = ops.scatter_blocks(cache, on_gpu, [11, -1, 63])
        self.assertEqual(cache.unsafe_buffer_pointer(), address)
        np.testing.assert_array_equal(
            bits.bits(gathered),
            bits.bits(numpy_ops.numpy_gather_blocks(host, [60, -1, 2, 2])))
        host = numpy_ops.numpy_scatter_blocks(host, blocks, [11, -1, 63])
        np.testing.assert_array_equal(bits.bits(cache), bits.bits(host))

    @parameterized.parameters("int4", "uint4", "int2", "float4_e2m1fn")
    def test_packed_sub_byte_caches(self, name):
        # XLA packs these on the GPU too: blocks are sized in bits (64 elements = 32 or 16 bytes).
        import ml_dtypes

        dtype = np.dtype(getattr(ml_dtypes, name))
        codes = np.arange(16, dtype=np.uint8).view(dtype) if name.startswith("float") else None
        rng = np.random.default_rng(4)
        if codes is None:
            info = ml_dtypes.iinfo(dtype)
            host = rng.integers(int(info.min), int(info.max) + 1, size=(8, 64)).astype(dtype)
        else:
            host = rng.choice(codes, size=(8, 64))
        cache = jax.device_put(host, platforms.gpus()[0])
        gathered = ops.gather_blocks(cache, [3, -1, 7])
        want = numpy_ops.numpy_gather_blocks(host, [3, -1, 7])
        np.testing.assert_array_equal(np.asarray(gathered).view(np.uint8), want.view(np.uint8))
        copied = ops.copy_blocks(cache, [1, 2], [5, 6])
        want = numpy_ops.numpy_copy_blocks(host, [1, 2], [5, 6])
        np.testing.assert_array_equal(np.asarray(copied).view(np.uint8), want.view(np.uint8))

    def test_traced_bad_ids_are_refused_on_the_device(self):
        # No custom call waits for the GPU: the device check makes the op write nothing and
        # records the failure, read back here (docs/backends.md, ids on CUDA).
        from jaxkv import _ffi_cuda

        host, cache = self._cache(2, "bfloat16")
        platforms.take_cuda_id_errors(platforms.gpus()[0])
        step = jax.jit(lambda c, s, d: ops.copy_blocks(c, s, d))
        result = jax.block_until_ready(step(cache, jnp.array([0]), jnp.array([64])))
        self.assertEqual(platforms.take_cuda_id_errors(platforms.gpus()[0]),
                         _ffi_cuda.ID_OUT_OF_RANGE)
        np.testing.assert_array_equal(bits.bits(result), bits.bits(host))

    def test_check_id_errors_raises_what_the_device_refused(self):
        # The loud end of the device checks: ops.check_id_errors raises the recorded failure
        # once, and clears it.
        host, cache = self._cache(2, "bfloat16")
        gpu = platforms.gpus()[0]
        platforms.take_cuda_id_errors(gpu)
        ops.check_id_errors()  # nothing recorded
        step = jax.jit(lambda c, s, d: ops.copy_blocks(c, s, d))
        jax.block_until_ready(step(cache, jnp.array([0, 1]), jnp.array([5, 5])))
        with self.assertRaisesRegex(jax.errors.JaxRuntimeError,
                                    rf"{gpu}: a written block listed twice"):
            ops.check_id_errors([gpu])
        ops.check_id_errors()
        # Eager calls check concrete ids in Python, naming the id, and record nothing.
        with self.assertRaisesRegex(IndexError, r"dst_ids\[0\] = 64"):
            ops.copy_blocks(cache, jnp.array([0]), jnp.array([64]))
        self.assertEqual(platforms.take_cuda_id_errors(gpu), 0)

    def test_out_of_range_ids_are_skipped_without_validation(self):
        host, cache = self._cache(3, "float16")
        step = jax.jit(lambda c, s, d: ops.copy_blocks(c, s, d, validate_ids=False),
                       donate_argnums=0)
        result = step(cache, jnp.array([0, 1, 2**31 - 1], jnp.int32),
                      jnp.array([64, 5, 6], jnp.int32))
        expected = numpy_ops.numpy_copy_blocks(host, [1], [5])
        np.testing.assert_array_equal(bits.bits(result), bits.bits(expected))

    def test_paged_cache_on_gpu(self):
        mesh = jax.make_mesh((1,), ("tp",), devices=platforms.gpus()[:1])
        spec = KVCacheSpec(4, 8, 128, 16, "bfloat16", "KHTD")
        cache = PagedKVCache.allocate(spec, 32, mesh=mesh)
        before = cache.shard_buffers()
        self.assertEqual(before[0].memory_kind, "VRAM")
        blocks = tuple(jnp.ones((2, *a.shape[1:]), a.dtype) for a in cache.arrays)
        cache = cache.scatter_blocks(blocks, [3, 4]).copy_blocks([3], [9])
        cache.verify_unmoved(before)
        out = cache.gather_blocks([9, 0])
        self.assertTrue(all(bool((o[0] == 1).all()) and bool((o[1] == 0).all()) for o in out))


def _read_pool(array):
    """A pinned-host pool array's bytes, read through a device copy: `np.asarray` of a host
    array keeps a zero-copy view of its buffer, and JAX refuses to donate a buffer so viewed
    ("Donation requested for buffer with external reference")."""
    device_memory = jax.sharding.SingleDeviceSharding(platforms.gpus()[0], memory_kind="device")
    return np.asarray(jax.device_put(array, device_memory))


@absltest.skipIf(not platforms.gpus(), "no GPU visible to JAX")
class PinnedHostOffloadTest(parameterized.TestCase):
    """The host tier on a GPU with its default pool, in pinned host memory: the row-sized
    dynamic slices / updates of the pool compile (no host compute) and move exact bytes, NaN
    payloads included, with skipped pairs anywhere; eagerly and inside a jit."""

    @parameterized.parameters("float8_e5m2", "bfloat16", "float32")
    def test_round_trip(self, dtype):
        from jaxkv.offload import HostPool, offload_blocks, onboard_blocks

        spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16,
                           dtype=dtype, layout="KTHD")
        rng = np.random.default_rng(12)
        hosts = [bits.random_bits(rng, spec.array_shape(8), dtype)
                 for _ in range(spec.num_arrays)]
        gpu = platforms.gpus()[0]
        cache = PagedKVCache.from_arrays(spec, [jax.device_put(h, gpu) for h in hosts])
        pool = HostPool.allocate(cache, 4)
        self.assertEqual(pool.arrays[0].sharding.memory_kind, "pinned_host")
        pool = offload_blocks(cache, pool, [5, -1, 7, 3, 4, 0], [2, 1, -1, 3, -1, 0])
        for array, host in zip(pool.arrays, hosts):
            np.testing.assert_array_equal(bits.bits(_read_pool(array)[[2, 3, 0]]),
                                          bits.bits(host[[5, 3, 0]]))
        zeros = [jnp.zeros(spec.array_shape(8), dtype, device=gpu)
                 for _ in range(spec.num_arrays)]
        target = onboard_blocks(pool, PagedKVCache.from_arrays(spec, zeros), [3, -1, 2, 0],
                                [1, 4, -1, 7])
        for array, host in zip(target.arrays, hosts):
            np.testing.assert_array_equal(bits.bits(np.asarray(array)[[1, 7]]),
                                          bits.bits(host[[3, 0]]))

        def round_trip(cache, pool, ids, slots, back):
            pool = offload_blocks(cache, pool, ids, slots)
            return onboard_blocks(pool, cache, slots, back), pool

        cache, pool = jax.jit(round_trip, donate_argnums=(0, 1))(
            cache, pool, jnp.array([6, 1]), jnp.array([1, 0]), jnp.array([2, 4]))
        self.assertEqual(pool.arrays[0].sharding.memory_kind, "pinned_host")
        for array, host in zip(cache.arrays, hosts):
            np.testing.assert_array_equal(bits.bits(np.asarray(array)[[2, 4]]),
                                          bits.bits(host[[6, 1]]))


if __name__ == "__main__":
    absltest.main()
