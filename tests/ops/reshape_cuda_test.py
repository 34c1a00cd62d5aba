"""The reshaping CUDA handlers on a real GPU: exact against the numpy references of
reshape_ops_test / reshape_peers_test, in place, both the shared-memory and the staged path.

Skipped where JAX sees no GPU; fails under JAXKV_EXPECT_GPU=1 when JAX sees none.
"""

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
from support import bits, platforms
from support import reshape as ref

from jaxkv import ops
from jaxkv._spec import SUPPORTED_DTYPES


def _on_gpu(host):
    return jax.device_put(host, platforms.gpus()[0])


@absltest.skipIf(not platforms.gpus(), "no GPU visible to JAX")
class ReshapeCudaTest(parameterized.TestCase):
    @parameterized.product(
        dtype=[d.name for d in SUPPORTED_DTYPES],
        case=[("HTD", "THD", 1, {}), ("LKHTD", "LKTHD", 1, {}), ("HTD", "THD", 4, {"T": 16}),
              # 2 MiB blocks: larger than shared memory, so the staged two-launch path runs.
              ("LKHTD", "LKTHD", 2, {"L": 8, "K": 2, "H": 8, "T": 32, "D": 128}),
              ("HTD", "THD", 1, {"H": 3, "T": 5, "D": 1})],
    )
    def test_permute_and_merge(self, dtype, case):
        src, dst, ratio, sizes = case
        rng = np.random.default_rng(0)
        host = bits.random_bits(rng, (12, *ref.block_shape(dst, sizes)), dtype)
        cache = _on_gpu(host)
        address = cache.unsafe_buffer_pointer()
        ids = np.array([7, -1, 2, 11, 0], np.int32)
        result = ops.merge_blocks(cache, ids, ratio, src, dst)
        self.assertEqual(result.unsafe_buffer_pointer(), address)
        expected = ref.numpy_merge(host, ids, ratio, src, dst)
        np.testing.assert_array_equal(bits.bits(result), bits.bits(expected))

    @parameterized.product(layout=["LKHTD", "THD", "TD"], num_tokens=[3, 0])
    def test_prefix(self, layout, num_tokens):
        rng = np.random.default_rng(1)
        src = bits.random_bits(rng, (6, *ref.block_shape(layout)), "bfloat16")
        dst = bits.random_bits(rng, (6, *ref.block_shape(layout)), "bfloat16")
        step = jax.jit(lambda s, d, i, j, n: ops.copy_block_prefix(s, d, i, j, n, layout),
                       donate_argnums=1)
        result = step(_on_gpu(src), _on_gpu(dst), jnp.array([0, 4, -1]), jnp.array([3, 5, 1]),
                      jnp.int32(num_tokens))
        expected = ref.numpy_prefix(src, dst, [0, 4, -1], [3, 5, 1], num_tokens, layout)
        np.testing.assert_array_equal(bits.bits(result), bits.bits(expected))

    @parameterized.parameters("tp2to4_h8", "pp2to4_l7__tp2to4_h2", "mla_tp1to4", "tp8to1_h2")
    def test_split_concat_round_trip(self, name):
        case = next(c for c in ref.GRID if c.name == name)

        def split(local, sender, receiver, s):
            return [np.asarray(b) for b in ops.split_for_peers(
                _on_gpu(local), ref.SRC_IDS, sender, receiver, s)]

        def concat(initial, buffers, receiver, sender, r):
            return ops.concat_from_peers(_on_gpu(initial), [_on_gpu(b) for b in buffers],
                                         ref.DST_IDS, receiver, sender, r)

        for r, (result, expected) in ref.round_trip(case, split, concat).items():
            np.testing.assert_array_equal(bits.bits(result), bits.bits(expected),
                                          err_msg=f"receiver {r}")

    def test_traced_bad_ids_are_refused_on_the_device(self):
        from jaxkv import _ffi_cuda

        host = bits.random_bits(np.random.default_rng(2), (8, 4, 8, 16), "float16")
        cache = _on_gpu(host)
        platforms.take_cuda_id_errors(platforms.gpus()[0])
        step = jax.jit(lambda c, i: ops.permute_blocks(c, i, "HTD", "THD"))
        result = jax.block_until_ready(step(cache, jnp.array([8], jnp.int32)))
        self.assertEqual(platforms.take_cuda_id_errors(platforms.gpus()[0]),
                         _ffi_cuda.ID_OUT_OF_RANGE)
        np.testing.assert_array_equal(bits.bits(result), bits.bits(host))


if __name__ == "__main__":
    absltest.main()
