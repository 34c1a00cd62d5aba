"""Every element type JAX has through every custom call, sub-byte (packed) types included.

XLA packs sub-byte types in device buffers (two int4 per byte): the handlers must size blocks
in bits, refuse blocks that are not whole bytes, and never read or write past a buffer.
"""

from support import bits, numpy_ops, platforms

platforms.force_cpu_devices()

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from absl.testing import absltest, parameterized

from jaxkv import ops
from jaxkv.ops import reference
from jaxkv.ops._peer_ops import _concat_local, _split_local

BYTE_DTYPES = [
    "bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
    "float16", "bfloat16", "float32", "float64", "complex64", "complex128",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3b11fnuz", "float8_e4m3fnuz", "float8_e5m2fnuz",
    "float8_e3m4", "float8_e4m3", "float8_e8m0fnu",
]
SUB_BYTE_DTYPES = ["int4", "uint4", "int2", "uint2", "float4_e2m1fn"]
ALL_DTYPES = BYTE_DTYPES + SUB_BYTE_DTYPES
# XLA has no device representation for the float6 types (not even a device_put), and StableHLO
# custom calls take no 1-bit integers.
UNSUPPORTED_DTYPES = ["float6_e2m3fn", "float6_e3m2fn", "int1", "uint1"]


def _dtype(name: str) -> np.dtype:
    return np.dtype(getattr(ml_dtypes, name, None) or name)


def _bits(name: str) -> int:
    return int(jax.dtypes.itemsize_bits(_dtype(name)))


def _values(rng: np.random.Generator, shape, name: str) -> np.ndarray:
    """Random values of `name`: random bit patterns for byte types (NaN payloads included),
    every code of a sub-byte type."""
    dtype = _dtype(name)
    if name == "bool":
        return rng.integers(0, 2, size=shape).astype(bool)
    if name in SUB_BYTE_DTYPES:
        if name.startswith("float"):
            codes = np.arange(16, dtype=np.uint8).view(dtype)
            return rng.choice(codes, size=shape)
        info = ml_dtypes.iinfo(dtype)
        return rng.integers(int(info.min), int(info.max) + 1, size=shape).astype(dtype)
    return bits.random_bits(rng, shape, dtype)


def _without_nan(values: np.ndarray) -> np.ndarray:
    """`values` with NaNs zeroed: the jnp references go through XLA ops, which may canonicalise
    NaN payloads (the custom calls are compared bit for bit against numpy elsewhere)."""
    if values.dtype.kind in "biuc" or values.dtype == bool:
        return values
    zero = np.zeros((), values.dtype)
    with np.errstate(over="ignore"):
        return np.where(np.isnan(values.astype(np.float32)), zero, values)


def _device(host: np.ndarray) -> jax.Array:
    array = jax.device_put(host)
    assert array.dtype == host.dtype, (array.dtype, host.dtype)
    return array


def _same(actual, expected) -> None:
    """Bit for bit (the unpacked values of sub-byte types)."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    np.testing.assert_array_equal(np.ascontiguousarray(actual).view(np.uint8),
                                  np.ascontiguousarray(expected).view(np.uint8))


class EveryDtypeTest(parameterized.TestCase):
    def setUp(self):
        super().setUp()
        # 64-bit types exist only with x64 enabled.
        self.enter_context(jax.enable_x64(True))

    @parameterized.parameters(*ALL_DTYPES)
    def test_copy_gather_scatter_match_numpy(self, name):
        rng = np.random.default_rng(0)
        # 16 elements per block: a whole number of bytes for every width.
        host = _values(rng, (6, 2, 8), name)
        copied = ops.copy_blocks(_device(host), [0, 5, -1], [3, 1, 2])
        _same(copied, numpy_ops.numpy_copy_blocks(host, [0, 5, -1], [3, 1, 2]))
        cache = _device(host)
        _same(ops.gather_blocks(cache, [3, -1, 0, 5]),
              numpy_ops.numpy_gather_blocks(host, [3, -1, 0, 5]))
        out = _device(_values(rng, (2, 2, 8), name))
        _same(ops.gather_blocks(cache, [5, 1], out=out), host[[5, 1]])
        blocks = _values(rng, (2, 2, 8), name)
        scattered = ops.scatter_blocks(_device(host), _device(blocks), [4, -1])
        _same(scattered, numpy_ops.numpy_scatter_blocks(host, blocks, [4, -1]))

    @parameterized.parameters(*SUB_BYTE_DTYPES)
    def test_big_sub_byte_gather_stays_in_bounds(self, name):
        # A multi-MiB gather takes the threaded, streaming path of the CPU engine.
        rng = np.random.default_rng(1)
        host = _values(rng, (3, (2 << 20) * 8 // _bits(name)), name)  # 2 MiB blocks
        _same(ops.gather_blocks(_device(host), [2, 0]), host[[2, 0]])

    def test_the_reported_int4_gather(self):
        # Two packed 16 MiB int4 blocks: one block crossed the streaming-store threshold and,
        # sized at a byte per element, read 16 MiB past the buffer.
        cache = jnp.ones((2, 32 << 20), jnp.int4).at[1].set(-3)
        out = ops.gather_blocks(cache, [1])
        self.assertEqual(out.shape, (1, 32 << 20))
        self.assertTrue(bool(jnp.all(out == -3)))
        self.assertTrue(bool(jnp.all(ops.copy_blocks(cache, [1], [0]) == -3)))

    @parameterized.parameters(*ALL_DTYPES)
    def test_reshaping_ops_match_the_references(self, name):
        rng = np.random.default_rng(2)
        host = _without_nan(_values(rng, (5, 2, 4, 8), name))  # [blocks, H, T, D]
        ids = jnp.asarray([3, -1, 1], jnp.int32)
        _same(ops.permute_blocks(_device(host), ids, "HTD", "THD"),
              reference.permute_blocks(_device(host), ids, "HTD", "THD"))
        _same(ops.merge_blocks(_device(host), ids, 2, "THD", "HTD"),
              reference.merge_blocks(_device(host), ids, 2, "THD", "HTD"))
        src = jnp.asarray([0, 4], jnp.int32)
        dst = jnp.asarray([2, 1], jnp.int32)
        other = _without_nan(_values(rng, (5, 2, 4, 8), name))
        _same(ops.copy_block_prefix(_device(other), _device(host), src, dst, 3, "HTD"),
              reference.copy_block_prefix(_device(other), _device(host), src, dst, 3, "HTD"))
        cache = _device(host)
        _same(ops.copy_block_prefix(cache, cache, src, dst, 3, "HTD"),
              reference.copy_block_prefix(_device(host), _device(host), src, dst, 3, "HTD"))

    @parameterized.parameters(*ALL_DTYPES)
    def test_split_and_concat_boxes(self, name):
        # The raw per-shard calls: the public split/concat take the dtypes of a KVCacheSpec.
        rng = np.random.default_rng(3)
        host = _values(rng, (4, 2, 2, 16), name)
        ids = jnp.asarray([2, -1, 0], jnp.int32)
        box_starts = (0, 0, 0, 1, 0, 0)
        shapes = ((1, 2, 16), (1, 2, 16))
        split = jax.jit(lambda c, i: _split_local(c, i, box_starts=box_starts, shapes=shapes,
                                                  validate_ids=True))
        first, second = split(_device(host), ids)
        expected = np.zeros((3, 2, 2, 16), host.dtype)
        expected[0], expected[2] = host[2], host[0]
        _same(first, expected[:, :1])
        _same(second, expected[:, 1:])
        concat = jax.jit(lambda c, i, a, b: _concat_local(c, i, a, b, box_starts=box_starts,
                                                          validate_ids=True))
        target = _values(rng, (4, 2, 2, 16), name)
        result = concat(_device(target), jnp.asarray([1, -1, 3], jnp.int32), first, second)
        want = target.copy()
        want[1], want[3] = expected[0], expected[2]
        _same(result, want)


class SubByteRefusalTest(parameterized.TestCase):
    @parameterized.parameters("int4", "uint4", "int2", "uint2", "float4_e2m1fn")
    def test_blocks_that_are_not_whole_bytes_are_refused(self, name):
        cache = jnp.zeros((4, 3), _dtype(name))  # 3 elements of 4 or 2 bits
        with self.assertRaisesRegex(ValueError, "not a whole number of bytes"):
            ops.gather_blocks(cache, [1])
        with self.assertRaisesRegex(ValueError, "not a whole number of bytes"):
            ops.copy_blocks(cache, [0], [1])
        # The handlers refuse them too (a raw call, past the Python checks).
        from jaxkv.ops._block_ops import _gather_local

        with self.assertRaisesRegex(jax.errors.JaxRuntimeError, "not a whole number of bytes"):
            jax.jit(lambda c: _gather_local(c, jnp.asarray([1], jnp.int32),
                                            validate_ids=True))(cache).block_until_ready()

    def test_runs_that_split_a_byte_are_refused_by_the_handler(self):
        # HTD -> THD with D = 1: every run is a single int4, half a byte.
        cache = jnp.zeros((2, 2, 4, 1), jnp.int4)
        with self.assertRaisesRegex(jax.errors.JaxRuntimeError, "not whole bytes"):
            ops.permute_blocks(cache, [0], "HTD", "THD").block_until_ready()

    def test_unpacked_int4_rows_work_when_runs_are_whole_bytes(self):
        host = (np.arange(2 * 2 * 4 * 2) % 16 - 8).astype(ml_dtypes.int4).reshape(2, 2, 4, 2)
        got = ops.permute_blocks(jnp.asarray(host), [1], "HTD", "THD")
        want = reference.permute_blocks(jnp.asarray(host), jnp.asarray([1]), "HTD", "THD")
        _same(got, want)

    @parameterized.parameters(*UNSUPPORTED_DTYPES)
    def test_types_xla_cannot_hold_are_refused(self, name):
        cache = jax.ShapeDtypeStruct((4, 8), _dtype(name))
        with self.assertRaisesRegex(TypeError, "cannot take"):
            jax.eval_shape(lambda c: ops.gather_blocks(c, jnp.asarray([0], jnp.int32)), cache)


if __name__ == "__main__":
    absltest.main()
