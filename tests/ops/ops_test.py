"""Tests of jaxkv.ops on single arrays: custom calls against jnp and numpy references."""

from support import bits, numpy_ops, platforms

platforms.force_cpu_devices()

import hypothesis
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
from hypothesis import strategies as st

from jaxkv import ops
from jaxkv._spec import SUPPORTED_DTYPES
from jaxkv.ops import reference

DTYPES = [d.name for d in SUPPORTED_DTYPES]
# The second shape has 15-byte int8 blocks: no vector width divides it.
BLOCK_SHAPES = [(2, 3, 4, 8), (3, 5)]
NUM_BLOCKS = 12


def _cache(seed: int, dtype: str, block_shape=(2, 3, 4, 8), num_blocks: int = NUM_BLOCKS):
    rng = np.random.default_rng(seed)
    host = bits.random_bits(rng, (num_blocks, *block_shape), dtype)
    return host, jnp.asarray(host)


class CopyBlocksTest(parameterized.TestCase):
    @parameterized.product(dtype=DTYPES, block_shape=BLOCK_SHAPES)
    def test_matches_references(self, dtype, block_shape):
        host, cache = _cache(0, dtype, block_shape)
        src = np.array([0, 3, -1, 5, 7], np.int32)
        dst = np.array([1, 4, 9, -1, 11], np.int32)
        expected = numpy_ops.numpy_copy_blocks(host, src, dst)
        jnp_result = reference.copy_blocks(jnp.asarray(host), src, dst)
        result = ops.copy_blocks(cache, src, dst)
        np.testing.assert_array_equal(bits.bits(result), bits.bits(expected))
        bits.assert_same_values(jnp_result, expected)

    def test_in_place_keeps_buffer_address(self):
        _, cache = _cache(1, "float32")
        address = cache.unsafe_buffer_pointer()
        result = ops.copy_blocks(cache, [0, 1], [2, 3])
        self.assertEqual(result.unsafe_buffer_pointer(), address)
        self.assertTrue(cache.is_deleted())  # donated

    def test_inside_jit_with_traced_ids_and_donation(self):
        host, cache = _cache(2, "bfloat16")
        address = cache.unsafe_buffer_pointer()
        step = jax.jit(lambda c, s, d: ops.copy_blocks(c, s, d), donate_argnums=0)
        src, dst = jnp.array([2, 6], jnp.int32), jnp.array([8, 10], jnp.int32)
        result = step(cache, src, dst)
        self.assertEqual(result.unsafe_buffer_pointer(), address)
        expected = numpy_ops.numpy_copy_blocks(host, [2, 6], [8, 10])
        np.testing.assert_array_equal(bits.bits(result), bits.bits(expected))

    def test_empty_and_all_padding_ids_change_nothing(self):
        host, cache = _cache(3, "int8")
        cache = ops.copy_blocks(cache, np.zeros(0, np.int32), np.zeros(0, np.int32))
        cache = ops.copy_blocks(cache, [-1, -1], [-1, -5])
        np.testing.assert_array_equal(np.asarray(cache), host)

    def test_padding_to_buckets_reuses_compilation(self):
        _, cache = _cache(4, "float16")
        step = jax.jit(lambda c, s, d: ops.copy_blocks(c, s, d), donate_argnums=0)
        for pairs in ([(0, 1)], [(0, 1), (2, 3)], [(4, 5), (6, 7), (8, 9)]):
            src, dst = zip(*pairs)
            cache = step(cache, ops.pad_block_ids(src), ops.pad_block_ids(dst))
        self.assertEqual(step._cache_size(), 1)

    @parameterized.named_parameters(
        ("src_out_of_range", [12], [1], IndexError, "src_ids\\[0\\] = 12 is out of range"),
        ("dst_out_of_range", [1], [40], IndexError, "dst_ids\\[0\\] = 40 is out of range"),
        ("duplicate_dst", [1, 2], [3, 3], ValueError, "duplicate id 3 in dst_ids"),
        ("overlap", [1, 2], [2, 3], ValueError, "block 2 is both in src_ids and in dst_ids"),
        ("lengths", [1, 2], [3], ValueError, "same length"),
        ("not_integers", [1.5], [3.0], TypeError, "integers"),
        ("two_dimensional", [[1]], [[3]], ValueError, "one-dimensional"),
    )
    def test_bad_concrete_ids_raise_and_change_nothing(self, src, dst, error, message):
        host, cache = _cache(5, "float32")
        with self.assertRaisesRegex(error, message):
            ops.copy_blocks(cache, src, dst)
        self.assertFalse(cache.is_deleted())
        np.testing.assert_array_equal(bits.bits(cache), bits.bits(host))

    @parameterized.named_parameters(
        ("out_of_range", [1], [12], "dst_ids\\[0\\] = 12 is out of range"),
        ("huge", [2**31 - 1], [0], "src_ids\\[0\\] = 2147483647 is out of range"),
        ("duplicate_dst", [1, 2], [3, 3], "duplicate id 3 in dst_ids"),
        ("overlap", [1, 2], [2, 3], "block 2 is both in src_ids and in dst_ids"),
    )
    def test_bad_traced_ids_raise_from_the_handler(self, src, dst, message):
        host, cache = _cache(6, "float32")
        step = jax.jit(lambda c, s, d: ops.copy_blocks(c, s, d))  # no donation: keep `cache`
        with self.assertRaisesRegex(jax.errors.JaxRuntimeError, "INVALID_ARGUMENT: " + message):
            jax.block_until_ready(step(cache, jnp.array(src, jnp.int32), jnp.array(dst, jnp.int32)))
        np.testing.assert_array_equal(bits.bits(cache), bits.bits(host))

    def test_rejects_non_arrays_and_scalars(self):
        with self.assertRaisesRegex(TypeError, "jax.Array"):
            ops.copy_blocks(np.zeros((2, 2)), [0], [1])
        with self.assertRaisesRegex(ValueError, "blocks-first"):
            ops.copy_blocks(jnp.float32(1.0), [0], [1])

    @hypothesis.settings(deadline=None, max_examples=40, derandomize=True)
    @hypothesis.given(
        pairs=st.lists(st.tuples(st.integers(-3, NUM_BLOCKS - 1), st.integers(-3, NUM_BLOCKS - 1)),
                       max_size=NUM_BLOCKS),
        seed=st.integers(0, 2**16),
    )
    def test_random_valid_pairs_match_numpy(self, pairs, seed):
        # Keep only pairs that make a valid in-place copy: unique destinations, disjoint sets.
        used_dst, valid = set(), []
        sources = {s for s, _ in pairs if s >= 0}
        for s, d in pairs:
            if d >= 0 and (d in used_dst or d in sources):
                continue
            used_dst.add(d)
            valid.append((s, d))
        src = np.array([s for s, _ in valid], np.int32)
        dst = np.array([d for _, d in valid], np.int32)
        host, cache = _cache(seed, "bfloat16", (2, 4))
        result = ops.copy_blocks(cache, src, dst)
        expected = numpy_ops.numpy_copy_blocks(host, src, dst)
        np.testing.assert_array_equal(bits.bits(result), bits.bits(expected))


class GatherScatterTest(parameterized.TestCase):
    @parameterized.product(dtype=DTYPES, block_shape=BLOCK_SHAPES)
    def test_gather_matches_references(self, dtype, block_shape):
        host, cache = _cache(10, dtype, block_shape)
        ids = np.array([11, -1, 0, 0, 5], np.int32)  # repeats are fine for a gather
        expected = numpy_ops.numpy_gather_blocks(host, ids)
        result = ops.gather_blocks(cache, ids)
        self.assertEqual(result.shape, (5, *block_shape))
        np.testing.assert_array_equal(bits.bits(result), bits.bits(expected))
        jnp_result = reference.gather_blocks(cache, ids)
        bits.assert_same_values(jnp_result, expected)
        self.assertFalse(cache.is_deleted())  # a gather does not consume the cache

    @parameterized.product(dtype=DTYPES, block_shape=BLOCK_SHAPES)
    def test_scatter_matches_references(self, dtype, block_shape):
        host, cache = _cache(11, dtype, block_shape)
        rng = np.random.default_rng(12)
        blocks = bits.random_bits(rng, (4, *block_shape), dtype)
        ids = np.array([3, -1, 10, 0], np.int32)
        expected = numpy_ops.numpy_scatter_blocks(host, blocks, ids)
        jnp_result = reference.scatter_blocks(jnp.asarray(host), jnp.asarray(blocks), ids)
        address = cache.unsafe_buffer_pointer()
        result = ops.scatter_blocks(cache, jnp.asarray(blocks), ids)
        self.assertEqual(result.unsafe_buffer_pointer(), address)
        np.testing.assert_array_equal(bits.bits(result), bits.bits(expected))
        bits.assert_same_values(jnp_result, expected)

    def test_gather_then_scatter_round_trip_inside_jit(self):
        host, cache = _cache(13, "float8_e4m3fn")

        @jax.jit
        def move(c, src, dst):
            return ops.scatter_blocks(c, ops.gather_blocks(c, src), dst)

        result = move(cache, jnp.array([1, 2, 3], jnp.int32), jnp.array([7, 8, 9], jnp.int32))
        expected = numpy_ops.numpy_copy_blocks(host, [1, 2, 3], [7, 8, 9])
        np.testing.assert_array_equal(bits.bits(result), bits.bits(expected))

    @parameterized.parameters(*DTYPES)
    def test_gather_into_reuses_the_out_buffer(self, dtype):
        host, cache = _cache(16, dtype)
        out = jnp.asarray(bits.random_bits(np.random.default_rng(17), (4, 2, 3, 4, 8), dtype))
        address = out.unsafe_buffer_pointer()
        ids = np.array([7, -1, 3, 7], np.int32)
        result = ops.gather_blocks(cache, ids, out=out)
        self.assertEqual(result.unsafe_buffer_pointer(), address)
        self.assertTrue(out.is_deleted())
        expected = numpy_ops.numpy_gather_blocks(host, ids)  # the -1 row is zeroed, not kept
        np.testing.assert_array_equal(bits.bits(result), bits.bits(expected))
        step = jax.jit(lambda c, i, o: ops.gather_blocks(c, i, out=o), donate_argnums=2)
        again = step(cache, jnp.array([0, 1, 2, -1], jnp.int32), result)
        self.assertEqual(again.unsafe_buffer_pointer(), address)
        expected = numpy_ops.numpy_gather_blocks(host, [0, 1, 2, -1])
        np.testing.assert_array_equal(bits.bits(again), bits.bits(expected))
        with self.assertRaisesRegex(ValueError, "out has shape"):
            ops.gather_blocks(cache, [1, 2], out=again)

    def test_gather_bad_ids(self):
        _, cache = _cache(14, "float32")
        with self.assertRaisesRegex(IndexError, "ids\\[1\\] = 12 is out of range"):
            ops.gather_blocks(cache, [0, 12])
        with self.assertRaisesRegex(jax.errors.JaxRuntimeError, "out of range"):
            jax.block_until_ready(jax.jit(ops.gather_blocks)(cache, jnp.array([99], jnp.int32)))

    def test_scatter_bad_input(self):
        host, cache = _cache(15, "float32")
        good = jnp.zeros((2, 2, 3, 4, 8), jnp.float32)
        cases = [
            (good, [1, 1], ValueError, "duplicate id 1"),
            (good, [1, 12], IndexError, "out of range"),
            (good, [1], ValueError, "2 blocks for 1 ids"),
            (good.astype(jnp.bfloat16), [1, 2], ValueError, "dtype"),
            (jnp.zeros((2, 2, 3, 4, 4), jnp.float32), [1, 2], ValueError, "per-block shape"),
        ]
        for blocks, ids, error, message in cases:
            with self.assertRaisesRegex(error, message):
                ops.scatter_blocks(cache, blocks, ids)
        with self.assertRaisesRegex(jax.errors.JaxRuntimeError, "duplicate id 4 in ids"):
            step = jax.jit(ops.scatter_blocks)
            jax.block_until_ready(step(cache, good, jnp.array([4, 4], jnp.int32)))
        np.testing.assert_array_equal(bits.bits(cache), bits.bits(host))

    def test_vmap_over_a_stack_of_caches(self):
        host, _ = _cache(18, "float32", (3,), num_blocks=6)
        stack = np.stack([host, host[::-1].copy()])
        copy = jax.vmap(lambda c, s, d: ops.copy_blocks(c, s, d))
        src = jnp.array([[0, 1], [2, -1]], jnp.int32)
        dst = jnp.array([[4, 5], [3, 0]], jnp.int32)
        result = copy(jnp.asarray(stack), src, dst)
        for b in range(2):
            expected = numpy_ops.numpy_copy_blocks(stack[b], src[b], dst[b])
            np.testing.assert_array_equal(bits.bits(result[b]), bits.bits(expected))
        ids = jnp.array([[5], [-1]], jnp.int32)
        gathered = jax.vmap(ops.gather_blocks)(jnp.asarray(stack), ids)
        np.testing.assert_array_equal(bits.bits(gathered[0, 0]), bits.bits(stack[0, 5]))
        self.assertFalse(np.any(bits.bits(gathered[1])))

    def test_pad_block_ids(self):
        self.assertEqual(ops.pad_block_ids([1, 2, 3]).tolist(), [1, 2, 3] + [-1] * 5)
        self.assertEqual(len(ops.pad_block_ids(list(range(9)))), 16)
        self.assertEqual(ops.pad_block_ids([4], length=2).tolist(), [4, -1])
        with self.assertRaisesRegex(ValueError, "cannot pad"):
            ops.pad_block_ids([1, 2, 3], length=2)


if __name__ == "__main__":
    absltest.main()
