"""Ids and sizes at the edges: ids and token counts wider than int32 (concrete and traced),
numpy integers wherever Python ints are taken, huge box attributes in the raw calls."""

from support import bits, numpy_ops, platforms

platforms.force_cpu_devices()

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

from jaxkv import ops
from jaxkv.ops import reference
from jaxkv.ops._peer_ops import _concat_local, _split_local

INT32_MAX = 2**31 - 1


def _cache(seed=0, shape=(6, 2, 4, 8)):
    host = bits.random_bits(np.random.default_rng(seed), shape, np.float32)
    return host, jnp.asarray(host)


class WideIdsTest(parameterized.TestCase):
    def setUp(self):
        super().setUp()
        self.enter_context(jax.enable_x64(True))

    @parameterized.parameters(
        (np.uint32, 2**32 - 1), (np.int64, 2**32 + 1), (np.uint64, 2**63 + 2), (np.int64, -(2**40)),
    )
    def test_concrete_jax_ids_are_range_checked(self, dtype, value):
        host, cache = _cache()
        ids = jnp.asarray(np.array([0, value], dtype))
        with self.assertRaisesRegex(ValueError, "do not fit in int32"):
            ops.gather_blocks(cache, ids)
        with self.assertRaisesRegex(ValueError, "do not fit in int32"):
            ops.copy_blocks(cache, ids, jnp.asarray(np.array([2, 3], dtype)))
        np.testing.assert_array_equal(np.asarray(cache), host)

    @parameterized.parameters((np.uint32, 2**32 - 1), (np.int64, 2**32 + 1),
                              (np.uint64, 2**64 - 1), (np.int64, 2**31))
    def test_traced_wide_ids_are_reported_never_wrapped(self, dtype, value):
        host, cache = _cache()
        ids = jnp.asarray(np.array([1, value], dtype))
        with self.assertRaisesRegex(jax.errors.JaxRuntimeError,
                                    f"ids\\[1\\] = {INT32_MAX} is out of range"):
            jax.jit(ops.gather_blocks)(cache, ids).block_until_ready()
        with self.assertRaisesRegex(jax.errors.JaxRuntimeError, "out of range"):
            jax.jit(lambda c, s, d: ops.copy_blocks(c, s, d))(
                cache, jnp.asarray(np.array([0, 0], dtype)), ids).block_until_ready()

    def test_traced_wide_negative_ids_stay_padding(self):
        host, cache = _cache()
        ids = jnp.asarray(np.array([2, -(2**40)], np.int64))
        got = jax.jit(ops.gather_blocks)(cache, ids)
        want = numpy_ops.numpy_gather_blocks(host, [2, -1])
        np.testing.assert_array_equal(np.asarray(got), want)

    def test_traced_small_unsigned_ids_work(self):
        host, cache = _cache()
        got = jax.jit(ops.gather_blocks)(cache, jnp.asarray([5, 1], jnp.uint8))
        np.testing.assert_array_equal(np.asarray(got), host[[5, 1]])

    @parameterized.parameters((np.int64, 2**32 + 2), (np.uint32, 2**32 - 1), (np.uint64, 2**64 - 2))
    def test_traced_wide_token_counts_copy_whole_blocks(self, dtype, value):
        # Any count past the block size copies whole blocks; a wrapped 2**32 + 2 would copy 2.
        host, cache = _cache(1)
        other, _ = _cache(2)
        src, dst = jnp.asarray([0], jnp.int32), jnp.asarray([3], jnp.int32)
        step = jax.jit(lambda a, b, n: ops.copy_block_prefix(a, b, src, dst, n, "HTD"))
        got = step(jnp.asarray(other), cache, jnp.asarray(np.array(value, dtype)))
        want = host.copy()
        want[3] = other[0]
        np.testing.assert_array_equal(np.asarray(got), want)

    def test_huge_python_and_numpy_token_counts(self):
        for value in (2**70, np.uint64(2**64 - 1), np.int64(2**40)):
            host, cache = _cache(3)
            got = ops.copy_block_prefix(cache, cache, [0], [4], value, "HTD")
            want = host.copy()
            want[4] = host[0]
            np.testing.assert_array_equal(np.asarray(got), want)


class NumpyIntegersTest(absltest.TestCase):
    def test_numpy_integers_are_accepted_like_python_ints(self):
        host = np.arange(2 * 2 * 4 * 2, dtype=np.float32).reshape(2, 2, 4, 2)
        ids = jnp.asarray([1], jnp.int32)
        for ratio in (np.int64(2), np.int32(2), np.uint8(2)):
            got = ops.merge_blocks(jnp.asarray(host), [np.int64(1)], ratio, "HTD", "HTD")
            want = reference.merge_blocks(jnp.asarray(host), ids, 2, "HTD", "HTD")
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        got = ops.copy_block_prefix(jnp.asarray(host), jnp.asarray(host), [np.int16(0)],
                                    [np.int64(1)], np.int64(2), "HTD")
        want = reference.copy_block_prefix(jnp.asarray(host), jnp.asarray(host),
                                           jnp.asarray([0]), jnp.asarray([1]), 2, "HTD")
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        self.assertEqual(ops.pad_block_ids([1], np.int64(4)).tolist(), [1, -1, -1, -1])
        for bad in (True, 0, np.int64(-1), 1.0):
            with self.assertRaisesRegex(ValueError, "positive integer"):
                ops.merge_blocks(jnp.asarray(host), [1], bad, "HTD", "HTD")


class HugeBoxAttributesTest(absltest.TestCase):
    def test_box_starts_near_int64_max_are_refused(self):
        # starts + sizes would overflow int64 in a naive box check (UBSan: signed overflow).
        cache = jnp.zeros((4, 2, 8), jnp.float32)
        ids = jnp.asarray([0], jnp.int32)
        for start in (2**63 - 1, 2**63 - 4, -(2**63)):
            split = jax.jit(lambda c, i, s=start: _split_local(
                c, i, box_starts=(0, s), shapes=((2, 4),), validate_ids=True))
            with self.assertRaisesRegex(jax.errors.JaxRuntimeError, "starts at"):
                jax.block_until_ready(split(cache, ids))
            concat = jax.jit(lambda c, i, b, s=start: _concat_local(
                c, i, b, box_starts=(0, s), validate_ids=True))
            with self.assertRaisesRegex(jax.errors.JaxRuntimeError, "starts at"):
                jax.block_until_ready(concat(cache, ids, jnp.ones((1, 2, 4), jnp.float32)))


class CheckIdErrorsTest(absltest.TestCase):
    """`ops.check_id_errors` reads the CUDA custom calls' per-device id records and raises
    naming the device and the failures; elsewhere it has nothing to read. The CUDA module is
    faked here (tests/cuda_test.py runs it on a GPU)."""

    class _Gpu:
        platform = "gpu"

        def __init__(self, ordinal):
            self.local_hardware_id = ordinal

        def __str__(self):
            return f"cuda:{self.local_hardware_id}"

    def _fake_cuda(self, records):
        """A stand-in for jaxkv._ffi_cuda whose records are `records` (ordinal -> bits)."""
        import sys
        import types
        from unittest import mock

        from jaxkv.ops import _dispatch

        module = types.SimpleNamespace(ID_OUT_OF_RANGE=1, ID_REPEATED=2, ID_SHARED=4,
                                       taken=[])

        def take(ordinal):
            module.taken.append(ordinal)
            bits, records[ordinal] = records.get(ordinal, 0), 0
            return bits

        module.take_id_errors = take
        self.enter_context(mock.patch.dict(sys.modules, {"jaxkv._ffi_cuda": module}))
        self.enter_context(mock.patch.object(_dispatch, "custom_calls_run_on",
                                             return_value=True))
        return module

    def test_cpu_has_nothing_to_check(self):
        ops.check_id_errors()
        ops.check_id_errors(jax.devices())

    def test_recorded_failures_raise_naming_device_and_kind(self):
        records = {0: 0, 1: 1 | 4}
        module = self._fake_cuda(records)
        gpus = [self._Gpu(0), self._Gpu(1)]
        with self.assertRaisesRegex(jax.errors.JaxRuntimeError,
                                    r"cuda:1: an id out of range .*; a block both read and "
                                    r"written.*wrote no cache block") as raised:
            ops.check_id_errors(gpus + jax.devices())  # CPU devices are skipped
        self.assertNotIn("cuda:0", str(raised.exception))
        self.assertEqual(module.taken, [0, 1])
        ops.check_id_errors(gpus)  # cleared by the check that raised

    def test_every_device_is_cleared_before_raising(self):
        records = {0: 2, 1: 2}
        self._fake_cuda(records)
        with self.assertRaisesRegex(jax.errors.JaxRuntimeError,
                                    "cuda:0: a written block listed twice, cuda:1: a written"):
            ops.check_id_errors([self._Gpu(0), self._Gpu(1)])
        self.assertEqual(records, {0: 0, 1: 0})

    def test_gpus_without_the_custom_calls_are_skipped(self):
        from unittest import mock

        from jaxkv.ops import _dispatch

        module = self._fake_cuda({0: 1})
        with mock.patch.object(_dispatch, "custom_calls_run_on", return_value=False):
            ops.check_id_errors([self._Gpu(0)])  # e.g. ROCm: the reference raised already
        self.assertEqual(module.taken, [])


if __name__ == "__main__":
    absltest.main()
