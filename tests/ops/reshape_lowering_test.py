"""The reshaping ops lower for CUDA on a machine without a GPU: custom-call targets, aliasing,
attributes (the CUDA handlers themselves run in reshape_cuda_test.py where a GPU exists)."""

from support import meshes, platforms

platforms.force_cpu_devices()

import re
from unittest import mock

import jax
import jax.numpy as jnp
from absl.testing import absltest
from jax.sharding import PartitionSpec as P

from jaxkv import EngineConfig, KVCacheSpec, PagedKVCache, ops


def _lower_for_cuda(fn, *args, donate=(0,)) -> str:
    jitted = jax.jit(fn, donate_argnums=donate)
    return jitted.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


class ReshapeLoweringTest(absltest.TestCase):
    def setUp(self):
        super().setUp()
        self.cache = jax.ShapeDtypeStruct((16, 2, 4, 8, 8), jnp.bfloat16)  # KTHD
        self.ids = jax.ShapeDtypeStruct((4,), jnp.int32)

    def _call(self, text: str, target: str) -> str:
        lines = [l for l in text.splitlines() if f"@{target}" in l or f'"{target}"' in l]
        self.assertLen(lines, 1, text)
        return lines[0]

    def test_permute_is_aliased_with_layout_attributes(self):
        text = _lower_for_cuda(lambda c, i: ops.permute_blocks(c, i, "KHTD", "KTHD"),
                               jax.ShapeDtypeStruct((16, 2, 8, 4, 8), jnp.bfloat16), self.ids)
        call = self._call(text, "jaxkv_permute_blocks")
        self.assertIn("output_operand_aliases", call)
        self.assertRegex(call, r'src_layout = "KHTD"')
        self.assertRegex(call, r'dst_layout = "KTHD"')
        self.assertRegex(call, r"ratio = 1 : i64")
        self.assertRegex(call, r"validate_ids = true")
        self.assertIn("tf.aliasing_output = 0", text)
        # The second result is the staging scratch: at least one block of bytes.
        self.assertRegex(call, r"tensor<\d+xui8>")

    def test_merge_carries_the_ratio(self):
        text = _lower_for_cuda(
            lambda c, i: ops.merge_blocks(c, i, 4, "HTD", "THD", validate_ids=False),
            jax.ShapeDtypeStruct((16, 16, 4, 8), jnp.float8_e4m3fn), self.ids)
        call = self._call(text, "jaxkv_merge_blocks")
        self.assertIn("output_operand_aliases", call)
        self.assertRegex(call, r"ratio = 4 : i64")
        self.assertRegex(call, r"validate_ids = false")

    def test_prefix_aliases_the_destination(self):
        text = _lower_for_cuda(
            lambda s, d, i, j, n: ops.copy_block_prefix(s, d, i, j, n, "KTHD"),
            self.cache, self.cache, self.ids, self.ids, jax.ShapeDtypeStruct((), jnp.int32),
            donate=(1,))
        call = self._call(text, "jaxkv_copy_block_prefix")
        self.assertRegex(call, r"operand_index = 1")
        self.assertRegex(call, r'layout = "KTHD"')
        self.assertIn("tensor<i32>", call)  # the token count is an operand, not an attribute
        text = _lower_for_cuda(
            lambda c, i, j: ops.copy_block_prefix(c, c, i, j, 3, "KTHD"),
            self.cache, self.ids, self.ids)
        call = self._call(text, "jaxkv_copy_block_prefix_in_place")
        self.assertRegex(call, r"operand_index = 0")

    def test_split_and_concat(self):
        spec = KVCacheSpec(num_layers=4, num_kv_heads=4, head_dim=8, block_size=4)
        sender, receiver = EngineConfig(spec, 1), EngineConfig(spec, 2, pp_size=2)
        cache = jax.ShapeDtypeStruct((16, 4, 2, 4, 4, 8), jnp.bfloat16)
        text = _lower_for_cuda(lambda c, i: ops.split_for_peers(c, i, sender, receiver, 0),
                               cache, self.ids, donate=())
        call = self._call(text, "jaxkv_split_blocks")
        self.assertNotIn("output_operand_aliases", call)
        self.assertEqual(len(re.findall(r"tensor<4x2x2x2x4x8xbf16>", call)), 4)  # 4 results
        self.assertIn("box_starts = dense<[0, 0, 0, 0, 0, 2, 0, 0, 0, 0, "
                      "0, 0, 2, 0, 0, 2, 0, 2, 0, 0]> : tensor<20xi64>", call)
        buffers = [jax.ShapeDtypeStruct((4, 2, 2, 2, 4, 8), jnp.bfloat16)] * 4
        text = _lower_for_cuda(
            lambda c, b, i: ops.concat_from_peers(c, b, i, sender, receiver, 0),
            cache, buffers, self.ids)
        call = self._call(text, "jaxkv_concat_blocks")
        self.assertIn("output_operand_aliases", call)
        text = _lower_for_cuda(
            lambda c, i, o: ops.split_for_peers(c, i, sender, receiver, 0, out=o),
            cache, self.ids, buffers, donate=(2,))
        call = self._call(text, "jaxkv_split_blocks")
        self.assertEqual(len(re.findall(r"operand_index = \d+", call)), 4)

    def test_sharded_cache_lowers_through_shard_map(self):
        mesh = meshes.tp(4, explicit=True)
        spec = KVCacheSpec(2, 4, 8, 4, "bfloat16", "KTHD")
        array = PagedKVCache.allocate(spec, 8, mesh=mesh).arrays[0]
        pspec = array.sharding.spec
        per_shard = jax.shard_map(lambda a, i: ops.permute_blocks(a, i, "KHTD", "KTHD"),
                                  mesh=array.sharding.mesh, in_specs=(pspec, P()),
                                  out_specs=pspec, check_vma=False)
        text = _lower_for_cuda(per_shard, array, jnp.arange(2, dtype=jnp.int32))
        self.assertRegex(text, r"custom_call @jaxkv_permute_blocks\(%\w+, %\w+\) .*"
                               r"\(tensor<8x2x4x1x8xbf16>, tensor<2xi32>\)")
        self.assertNotIn("all_gather", text)


class CudaScratchTest(absltest.TestCase):
    """Traced on a GPU backend, permute/merge get the scratch the CUDA path needs: none when a
    staging unit fits the 48 KiB of shared memory every GPU grants, else blocks up to 16 MiB
    (no CPU-thread minimum of 8 blocks). Traced on CPU, the CPU sizing is unchanged."""

    def _scratch_bytes(self, fn, cache, ids, backend: str) -> int:
        from jaxkv.ops import _reshape_ops

        # The backend is mocked where the op reads it; JAX may reuse an op's trace across
        # backends (it never changes in a real process), so the caches are cleared around it.
        jax.clear_caches()
        self.addCleanup(jax.clear_caches)
        with mock.patch.object(_reshape_ops.jax, "default_backend", return_value=backend), \
                ops.implementation("ffi"):
            text = jax.jit(fn, donate_argnums=0).trace(cache, ids).lower().as_text()
        calls = [l for l in text.splitlines() if "stablehlo.custom_call" in l]
        self.assertLen(calls, 1, text)
        # The results: the cache, then the scratch as a byte vector.
        (size,) = re.findall(r"tensor<(\d+)xui8>", calls[0].split("->")[-1])
        return int(size)

    def test_small_units_get_no_scratch_on_a_gpu(self):
        cache = jax.ShapeDtypeStruct((16, 2, 8, 4, 8), jnp.bfloat16)  # 1 KiB blocks
        ids = jax.ShapeDtypeStruct((12,), jnp.int32)
        fn = lambda c, i: ops.permute_blocks(c, i, "KHTD", "KTHD")  # noqa: E731
        self.assertEqual(self._scratch_bytes(fn, cache, ids, "cpu"), 12 * 1024)
        self.assertEqual(self._scratch_bytes(fn, cache, ids, "gpu"), 0)
        self.assertEqual(self._scratch_bytes(fn, cache, ids, "cuda"), 0)

    def test_large_units_get_up_to_16_mib_on_a_gpu(self):
        # H8 x T256 x D1024 bf16: 4 MiB units, one per block; 16 ids.
        cache = jax.ShapeDtypeStruct((20, 256, 8, 1024), jnp.bfloat16)
        ids = jax.ShapeDtypeStruct((16,), jnp.int32)
        fn = lambda c, i: ops.permute_blocks(c, i, "HTD", "THD")  # noqa: E731
        self.assertEqual(self._scratch_bytes(fn, cache, ids, "cpu"), 8 * (4 << 20))
        self.assertEqual(self._scratch_bytes(fn, cache, ids, "gpu"), 4 * (4 << 20))
        merge = lambda c, i: ops.merge_blocks(c, i, 2, "HTD", "THD")  # noqa: E731
        self.assertEqual(self._scratch_bytes(merge, cache, ids, "gpu"), 4 * (4 << 20))

    def test_sizing(self):
        from jaxkv.ops._reshape_ops import _scratch_blocks

        def cuda(shape, src, dst, ratio=1, ids=4, bits=16):
            return _scratch_blocks(shape, bits, src, dst, ratio, ids, cuda=True)

        # KHTD -> KTHD: the K axis is shared, units of H x T x D (48 KiB: shared memory).
        self.assertEqual(cuda((2, 8, 24, 128), "KHTD", "KTHD"), 0)
        self.assertEqual(cuda((2, 8, 32, 128), "KHTD", "KTHD"), 4)  # 64 KiB units
        # A merge has no shared axes: the whole 96 KiB block is the unit.
        self.assertEqual(cuda((2, 8, 24, 128), "KHTD", "KTHD", ratio=2), 4)
        # TensorRT-LLM's permute unit (128 KiB) and one block at least, however large.
        self.assertEqual(cuda((8, 64, 128), "HTD", "THD", ids=1000), 128)
        self.assertEqual(cuda((64, 64, 1024), "HTD", "THD", ids=3, bits=32), 1)
        # int4: bits, not bytes.
        self.assertEqual(cuda((2, 8, 48, 128), "KHTD", "KTHD", bits=4), 0)
        # CPU: at least 8 blocks (threads) when that many ids come, at most the ids.
        self.assertEqual(_scratch_blocks((8, 64, 128), 16, "HTD", "THD", 1, 1000, cuda=False),
                         128)
        self.assertEqual(_scratch_blocks((64, 64, 1024), 32, "HTD", "THD", 1, 30, cuda=False),
                         8)
        self.assertEqual(_scratch_blocks((4,), 8, "T", "T", 1, 0, cuda=False), 1)


if __name__ == "__main__":
    absltest.main()
