"""The ops lower for CUDA on a machine without a GPU: custom-call targets, aliasing, attributes.

This is the CPU-only check that the CUDA path is wired (the CUDA handlers themselves run in
cuda_test.py where a GPU exists).
"""

from support import meshes, platforms

platforms.force_cpu_devices()

import re

import jax
import jax.numpy as jnp
from absl.testing import absltest, parameterized

from jaxkv import KVCacheSpec, PagedKVCache, ops


def _lower_for_cuda(fn, *args, donate=True) -> str:
    jitted = jax.jit(fn, donate_argnums=0 if donate else ())
    return jitted.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


class CudaLoweringTest(parameterized.TestCase):
    def setUp(self):
        super().setUp()
        self.cache = jax.ShapeDtypeStruct((16, 2, 4, 4, 8), jnp.bfloat16)
        self.ids = jax.ShapeDtypeStruct((4,), jnp.int32)

    def _custom_call(self, text: str, target: str) -> str:
        lines = [l for l in text.splitlines() if f'@{target}' in l or f'"{target}"' in l]
        self.assertLen(lines, 1, text)
        return lines[0]

    def test_copy_is_an_aliased_custom_call(self):
        text = _lower_for_cuda(lambda c, s, d: ops.copy_blocks(c, s, d),
                               self.cache, self.ids, self.ids)
        call = self._custom_call(text, "jaxkv_copy_blocks")
        # Typed-FFI attributes travel in mhlo.backend_config as a dictionary (API version 4).
        self.assertIn("mhlo.backend_config = {validate_ids = true}", call)
        self.assertIn("output_operand_aliases", call)
        self.assertRegex(call, r"operand_index = 0")
        self.assertRegex(call, r"validate_ids = true")
        self.assertIn("tf.aliasing_output = 0", text)  # the donated cache

    def test_gather_is_not_aliased(self):
        text = _lower_for_cuda(lambda c, i: ops.gather_blocks(c, i), self.cache, self.ids,
                               donate=False)
        call = self._custom_call(text, "jaxkv_gather_blocks")
        self.assertNotIn("output_operand_aliases", call)
        self.assertRegex(text, r"tensor<4x2x4x4x8xbf16>")

    def test_scatter_and_validate_flag(self):
        blocks = jax.ShapeDtypeStruct((4, 2, 4, 4, 8), jnp.bfloat16)
        text = _lower_for_cuda(
            lambda c, b, i: ops.scatter_blocks(c, b, i, validate_ids=False),
            self.cache, blocks, self.ids)
        call = self._custom_call(text, "jaxkv_scatter_blocks")
        self.assertIn("output_operand_aliases", call)
        self.assertRegex(call, r"validate_ids = false")

    def test_sharded_cache_lowers_through_shard_map(self):
        mesh = meshes.tp(4, explicit=True)
        spec = KVCacheSpec(2, 4, 8, 4, "bfloat16", "KHTD")
        cache = PagedKVCache.allocate(spec, 8, mesh=mesh)
        text = _lower_for_cuda(lambda c, i: c.copy_blocks(i, i + 4), cache,
                               jnp.arange(2, dtype=jnp.int32))
        self.assertLen(re.findall(r"custom_call @jaxkv_copy_blocks", text), 2)  # per layer
        # Each call sees one device's shard: 1 of the 4 heads, inside a manual computation.
        self.assertRegex(text, r"custom_call @jaxkv_copy_blocks\(%\w+, %\w+, %\w+\) .*"
                               r"\(tensor<8x2x1x4x8xbf16>, tensor<2xi32>, tensor<2xi32>\)")
        self.assertRegex(text, r"manual_computation|shard_map|Sharding = \{manual\}")
        self.assertNotIn("all_gather", text)


if __name__ == "__main__":
    absltest.main()
