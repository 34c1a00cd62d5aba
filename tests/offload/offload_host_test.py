"""Offload tiers: bit-exact round trips device -> host -> file -> host -> device for every dtype
and layout, partial onboarding, jit, sharded caches, pinned host memory."""

from support import bits, meshes, platforms

platforms.force_cpu_devices()

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import absltest, parameterized
from support import offload as ot  # noqa: E402

from jaxkv import ops as jaxkv_ops
from jaxkv._spec import SUPPORTED_DTYPES
from jaxkv.offload import FileTier, HostPool, OffloadManager, offload_blocks, onboard_blocks
from jaxkv.transfer import nixl_available

_DTYPES = [d.name for d in SUPPORTED_DTYPES]
# Every layout once (dtypes take turns, file backends alternate) runs by default; the full
# layout x dtype grid is slow.
_SAMPLE = [dict(layout=layout, dtype=_DTYPES[i % len(_DTYPES)]) for i, layout in
           enumerate(ot.LAYOUTS)]
_GRID = [dict(layout=layout, dtype=dtype) for layout in ot.LAYOUTS for dtype in _DTYPES]


class RoundTripTest(parameterized.TestCase):

    def _round_trip(self, layout, dtype, tp=1, backend="files", memory_kind="auto"):
        spec = ot.spec_for(layout, dtype)
        mesh = meshes.tp(tp, explicit=True)
        cache, hosts = ot.filled_cache(spec, 8, seed=len(layout) * 7 + len(dtype), mesh=mesh)
        tier = FileTier(self.create_tempdir().full_path, spec=spec, model_id="test-model",
                        capacity_bytes=1 << 20, tp_size=cache.tp_size, backend=backend)
        offloader = OffloadManager(cache, 4, file_tier=tier, memory_kind=memory_kind)
        hashes = [b"block-1", b"block-5", b"block-2"]
        offloader.offload(cache, [1, 5, 2], [0, 3, 1])
        written = offloader.write_file([0, 3, 1], hashes)
        offloader.offload(cache, [7, 6, 4], [0, 3, 1])          # the slots get other blocks
        read = offloader.read_file([hashes[2], hashes[0], hashes[1]], [2, 0, 1])
        target, targets = ot.filled_cache(spec, 8, seed=99, mesh=mesh)
        target = offloader.onboard(target, [0, 1, 2, 3], [6, 7, 0, 3])
        offloader.wait()
        self.assertEqual(written.result(), [True] * 3)
        self.assertEqual(read.result(), [True] * 3)
        for array, host, before in zip(target.arrays, hosts, targets):
            expected = before.copy()
            expected[[6, 7, 0, 3]] = host[[1, 5, 2, 6]]
            bits.assert_bits(array, expected, f"{layout} {dtype} tp={tp}")
        offloader.close()

    @parameterized.parameters(*_SAMPLE)
    def test_round_trip_every_layout(self, layout, dtype):
        backend = "nixl" if nixl_available() and layout in ("LKHTD", "THD", "TD") else "files"
        self._round_trip(layout, dtype, backend=backend)

    @parameterized.parameters(*_GRID)
    @pytest.mark.slow  # innermost, so that every generated case carries the mark
    def test_round_trip_grid(self, layout, dtype):
        self._round_trip(layout, dtype)

    @parameterized.parameters(
        dict(layout="KHTD", tp=2), dict(layout="HTD", tp=4), dict(layout="LKHTD", tp=8),
        dict(layout="TD", tp=2))
    def test_round_trip_sharded(self, layout, tp):
        # tp=4 and 8 over 2 heads replicate heads; MLA is replicated on every rank.
        self._round_trip(layout, "bfloat16", tp=tp)

    def test_round_trip_pinned_host_pool(self):
        # The staging path used for pinned host memory (GPU) also runs on CPU.
        self._round_trip("THD", "float8_e5m2", tp=2, memory_kind="pinned_host")

    @parameterized.parameters("nixl", "files")
    def test_both_file_backends(self, backend):
        if backend == "nixl" and not nixl_available():
            self.skipTest("NIXL is not installed")
        self._round_trip("KTHD", "float16", backend=backend)


class PartialOnboardTest(parameterized.TestCase):

    @parameterized.parameters(
        dict(layout="LKHTD", num_tokens=1), dict(layout="KTHD", num_tokens=3),
        dict(layout="THD", num_tokens=2), dict(layout="TD", num_tokens=1),
        dict(layout="HTD", num_tokens=0), dict(layout="LKTHD", num_tokens=4),
        dict(layout="KHTD", num_tokens=-1))
    def test_copies_exactly_the_first_tokens(self, layout, num_tokens):
        spec = ot.spec_for(layout, "bfloat16")
        cache, hosts = ot.filled_cache(spec, 6, seed=3)
        offloader = OffloadManager(cache, 3)
        offloader.offload(cache, [4, 1], [2, 0])
        target, before = ot.filled_cache(spec, 6, seed=4)
        target = offloader.onboard(target, [2, 0], [0, 5], num_tokens=num_tokens)
        for array, host, old in zip(target.arrays, hosts, before):
            expected = old.copy()
            ot.prefix_copy(expected[0], host[4], num_tokens, spec)
            ot.prefix_copy(expected[5], host[1], num_tokens, spec)
            bits.assert_bits(array, expected, f"{layout} n={num_tokens}")
            if 0 < num_tokens < spec.block_size:  # The tail really stayed.
                self.assertFalse(np.array_equal(bits.bits(np.asarray(array)[0]),
                                                bits.bits(host[4])))


class FunctionalApiTest(parameterized.TestCase):

    def test_inside_jit_with_traced_ids_and_tokens(self):
        spec = ot.spec_for("KHTD", "float32")
        cache, hosts = ot.filled_cache(spec, 8, seed=5, mesh=meshes.tp(2, explicit=True))
        pool = HostPool.allocate(cache, 4)
        before = [s.data.unsafe_buffer_pointer() for s in pool.arrays[0].addressable_shards]

        @jax.jit
        def round_trip(cache, pool, ids, slots, back, num_tokens):
            pool = offload_blocks(cache, pool, ids, slots)
            cache = onboard_blocks(pool, cache, slots, back, num_tokens)
            return cache, pool

        step = jax.jit(round_trip, donate_argnums=(0, 1))
        cache, pool = step(cache, pool, jnp.array([3, 1, -1]), jnp.array([0, 2, 1]),
                           jnp.array([6, 7, 5]), jnp.int32(2))
        after = [s.data.unsafe_buffer_pointer() for s in pool.arrays[0].addressable_shards]
        self.assertEqual(before, after)  # donated: the pool stayed in place
        expected = hosts[0].copy()
        ot.prefix_copy(expected[6], hosts[0][3], 2, spec)
        ot.prefix_copy(expected[7], hosts[0][1], 2, spec)
        ot.prefix_copy(expected[5], np.zeros_like(expected[5]), 2, spec)  # slot 1: never filled
        bits.assert_bits(cache.arrays[0], expected)
        bits.assert_bits(np.asarray(pool.arrays[0])[[0, 2]], hosts[0][[3, 1]])

    def test_pool_for_another_cache_is_refused(self):
        cache, _ = ot.filled_cache(ot.spec_for("THD", "float32"), 4, seed=1)
        other, _ = ot.filled_cache(ot.spec_for("THD", "float16"), 4, seed=1)
        pool = HostPool.allocate(other, 2)
        with self.assertRaisesRegex(ValueError, "pool holds blocks"):
            offload_blocks(cache, pool, [0], [0])
        with self.assertRaisesRegex(ValueError, "num_slots"):
            HostPool.allocate(cache, 0)
        with self.assertRaisesRegex(ValueError, "memory_kind"):
            HostPool.allocate(cache, 2, memory_kind="unpinned")


class WithoutCustomCallsTest(parameterized.TestCase):
    """The host tier with the Pallas kernels (interpret mode here) or the jnp reference, pools
    in pinned host memory or the default memory: exact bytes, and no custom call built."""

    def _no_custom_calls(self):
        def refuse(*args, **kwargs):
            raise AssertionError("a custom call was built")

        from unittest import mock

        from jaxkv.ops import _block_ops, _reshape_ops

        self.enter_context(mock.patch.object(_block_ops, "_ffi_call", refuse))
        self.enter_context(mock.patch.object(_reshape_ops, "_ffi_call", refuse))

    @parameterized.parameters(*[(impl, kind) for impl in ("reference", "pallas")
                                for kind in (None, "pinned_host")])
    def test_round_trip(self, impl, memory_kind):
        self._no_custom_calls()
        with jaxkv_ops.implementation(impl):
            RoundTripTest._round_trip(self, "KTHD", "bfloat16", tp=2, memory_kind=memory_kind)

    @parameterized.parameters("reference", "pallas")
    def test_partial_onboard_from_a_pinned_pool(self, impl):
        self._no_custom_calls()
        spec = ot.spec_for("THD", "float8_e4m3fn")
        with jaxkv_ops.implementation(impl):
            cache, hosts = ot.filled_cache(spec, 6, seed=11)
            pool = HostPool.allocate(cache, 3, memory_kind="pinned_host")
            self.assertEqual(pool.arrays[0].sharding.memory_kind, "pinned_host")
            pool = offload_blocks(cache, pool, [4, 1, -1], [2, 0, 1])
            bits.assert_bits(np.asarray(pool.arrays[0])[[2, 0]], hosts[0][[4, 1]])
            bits.assert_bits(np.asarray(pool.arrays[0])[1], np.zeros_like(hosts[0][0]))
            target, before = ot.filled_cache(spec, 6, seed=12)
            target = onboard_blocks(pool, target, [2, 0], [0, 5], num_tokens=3)
        for array, host, old in zip(target.arrays, hosts, before):
            expected = old.copy()
            ot.prefix_copy(expected[0], host[4], 3, spec)
            ot.prefix_copy(expected[5], host[1], 3, spec)
            bits.assert_bits(array, expected, impl)

    def test_reference_inside_jit_with_a_pinned_pool(self):
        self._no_custom_calls()
        spec = ot.spec_for("KHTD", "float32")
        with jaxkv_ops.implementation("reference"):
            cache, hosts = ot.filled_cache(spec, 8, seed=5, mesh=meshes.tp(2, explicit=True))
            pool = HostPool.allocate(cache, 4, memory_kind="pinned_host")

            def round_trip(cache, pool, ids, slots, back):
                pool = offload_blocks(cache, pool, ids, slots)
                return onboard_blocks(pool, cache, slots, back), pool

            cache, pool = jax.jit(round_trip, donate_argnums=(0, 1))(
                cache, pool, jnp.array([3, 1]), jnp.array([0, 2]), jnp.array([6, 7]))
        self.assertEqual(pool.arrays[0].sharding.memory_kind, "pinned_host")
        expected = hosts[0].copy()
        expected[[6, 7]] = hosts[0][[3, 1]]
        bits.assert_bits(cache.arrays[0], expected)


class PinnedPoolProgramTest(parameterized.TestCase):
    """A pinned-host pool is touched only by copies between memory kinds and row-sized dynamic
    slices / updates, the patterns XLA's GPU host offloader turns into DMAs: no scatter or
    gather runs on it (XLA has crashed on host compute for such a scatter, openxla/xla#34565).
    The CPU runs the same programs, byte for byte, including skipped pairs anywhere in the
    lists."""

    def _ops(self, direction, *args):
        from jaxkv.offload import _host

        program = _host._programs(direction, "pinned_host", True, False)
        text = program.lower(*args).as_text()
        return {op for op in ("scatter", "gather", "dynamic_update_slice", "dynamic_slice")
                if f"stablehlo.{op} " in text or f"stablehlo.{op}\"" in text
                or f"stablehlo.{op}(" in text}

    def test_no_scatter_or_gather_on_the_pool(self):
        spec = ot.spec_for("KTHD", "bfloat16")
        cache, _ = ot.filled_cache(spec, 8, seed=1, mesh=meshes.tp(2, explicit=True))
        pool = HostPool.allocate(cache, 4, memory_kind="pinned_host")
        ids, slots = np.array([3, -1, 1, 0], np.int32), np.array([0, 2, -1, 1], np.int32)
        offload = self._ops("offload", cache, pool, ids, slots)
        self.assertNotIn("scatter", offload)  # the gathers: the device's (ids, staged rows)
        self.assertIn("dynamic_update_slice", offload)
        onboard = self._ops("onboard", pool, cache, slots, ids, np.int32(0))
        self.assertFalse({"scatter", "gather"} & onboard, onboard)
        self.assertIn("dynamic_slice", onboard)

    @parameterized.parameters("float8_e5m2", "bfloat16", "int8")
    def test_skipped_pairs_anywhere_leave_their_slots(self, dtype):
        spec = ot.spec_for("THD", dtype)
        cache, hosts = ot.filled_cache(spec, 8, seed=2)
        pool = HostPool.allocate(cache, 4, memory_kind="pinned_host")
        pool = offload_blocks(cache, pool, [2, 6, 4, 1], [0, 1, 2, 3])
        before = [np.asarray(a) for a in pool.arrays]
        # Skipped pairs before, between and after the real ones, slot 0 written last.
        pool = offload_blocks(cache, pool, [5, -1, 7, 3, 4, 0], [2, 1, -1, 3, -1, 0])
        for array, host, old in zip(pool.arrays, hosts, before):
            expected = old.copy()
            expected[[2, 3, 0]] = host[[5, 3, 0]]
            bits.assert_bits(array, expected, dtype)
        target, old_target = ot.filled_cache(spec, 8, seed=3)
        target = onboard_blocks(pool, target, [3, -1, 2, 0], [1, 4, -1, 7])
        for array, host, old in zip(target.arrays, hosts, old_target):
            expected = old.copy()
            expected[[1, 7]] = host[[3, 0]]
            bits.assert_bits(array, expected, dtype)


class PackedCacheTest(parameterized.TestCase):
    """The host tier on the caches of TPU frameworks (packed heads or tokens, padding)."""

    @parameterized.parameters(*[(preset, impl) for preset in ("tpu_inference", "fp8", "mla")
                                for impl in ("auto", "reference", "pallas")])
    def test_partial_round_trip(self, preset, impl):
        from jaxkv import KVCacheSpec

        spec = {
            "tpu_inference": lambda: KVCacheSpec.for_tpu_inference(2, 3, 64, 4, "bfloat16"),
            "fp8": lambda: KVCacheSpec.for_tpu_inference(1, 3, 64, 4, "float8_e4m3fn"),
            "mla": lambda: KVCacheSpec.for_tpu_inference_mla(2, 72, 6, "bfloat16"),
        }[preset]()
        pair = 1 + spec.block_axes().index(spec.packed_axis)
        t_axis = spec.block_axes().index("T")

        def by_token(x):  # the packed pair as one axis: tokens (MLA) or combined heads
            x = np.asarray(x)
            return x.reshape(*x.shape[:pair], -1, *x.shape[pair + 2:])

        for memory_kind in (None, "pinned_host"):
            with jaxkv_ops.implementation(impl):
                cache, hosts = ot.filled_cache(spec, 6, seed=13)
                pool = HostPool.allocate(cache, 3, memory_kind=memory_kind)
                pool = offload_blocks(cache, pool, [4, 1], [2, 0])
                target, before = ot.filled_cache(spec, 6, seed=14)
                target = onboard_blocks(pool, target, [2, 0], [0, 5], num_tokens=3)
            for array, host, old in zip(target.arrays, hosts, before):
                expected = by_token(old).copy()
                for dst, src in ((0, 4), (5, 1)):
                    index = [slice(None)] * (expected.ndim - 1)
                    index[t_axis] = slice(0, 3)   # the first 3 tokens, packed or not
                    expected[dst][tuple(index)] = by_token(host)[src][tuple(index)]
                bits.assert_bits(by_token(array), expected, f"{preset} {memory_kind}")


if __name__ == "__main__":
    absltest.main()
