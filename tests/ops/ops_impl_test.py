"""The op suite under every implementation: XLA FFI custom calls, Pallas TPU kernels (TPU
interpret mode here, on CPU) and the jnp reference, each checked bit for bit against
independent numpy references (every dtype, layouts, ratios, padding and out-of-range ids,
TP/PP peer pairs). Shapes are small: interpret mode is slow."""

from support import bits, meshes, numpy_ops, platforms

platforms.force_cpu_devices()

import os
import subprocess
import sys
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import absltest, parameterized
from jax.experimental.pallas import tpu as pltpu
from support.reshape import DST_IDS, FAST, GRID, SRC_IDS, numpy_merge, numpy_prefix, round_trip

from jaxkv import LAYOUT_PRESETS, EngineConfig, KVCacheSpec, PagedKVCache, ops
from jaxkv._spec import SUPPORTED_DTYPES
from jaxkv.ops import _pallas

IMPLS = ("ffi", "pallas", "reference")
DTYPES = [d.name for d in SUPPORTED_DTYPES]
NUM_BLOCKS = 10


def _random(seed, shape, dtype):
    return bits.random_bits(np.random.default_rng(seed), shape, dtype)


class _ImplTest(parameterized.TestCase):
    impl = "auto"

    def setUp(self):
        super().setUp()
        self.enter_context(ops.implementation(self.impl))


class _BlockOps:
    """The op suite; mixed into one TestCase per implementation."""

    def test_copy_every_dtype(self):
        src = np.array([0, 3, -1, 5, 7, 2], np.int32)
        dst = np.array([1, 4, 9, -1, 8, 6], np.int32)
        for i, dtype in enumerate(DTYPES):
            host = _random(i, (NUM_BLOCKS, 2, 8, 16), dtype)
            result = ops.copy_blocks(jnp.asarray(host), src, dst)
            bits.assert_bits(result, numpy_ops.numpy_copy_blocks(host, src, dst), dtype)

    def test_gather_scatter_every_dtype(self):
        ids = np.array([7, -1, 2, 9, 0], np.int32)
        for i, dtype in enumerate(DTYPES):
            host = _random(i, (NUM_BLOCKS, 3, 5), dtype)
            bits.assert_bits(ops.gather_blocks(jnp.asarray(host), ids),
                         numpy_ops.numpy_gather_blocks(host, ids), dtype)
            blocks = _random(i + 50, (len(ids), 3, 5), dtype)
            result = ops.scatter_blocks(jnp.asarray(host), jnp.asarray(blocks), ids)
            bits.assert_bits(result, numpy_ops.numpy_scatter_blocks(host, blocks, ids), dtype)

    def test_gather_into_overwrites_every_row(self):
        host = _random(3, (NUM_BLOCKS, 4, 128), "bfloat16")
        ids = np.array([4, -1, 1], np.int32)
        out = jnp.asarray(_random(4, (3, 4, 128), "bfloat16"))
        result = ops.gather_blocks(jnp.asarray(host), ids, out=out)
        bits.assert_bits(result, numpy_ops.numpy_gather_blocks(host, ids))

    def test_traced_ids_inside_jit(self):
        host = _random(5, (NUM_BLOCKS, 2, 4, 8), "float32")
        step = jax.jit(lambda c, s, d: ops.copy_blocks(c, s, d), donate_argnums=0)
        src, dst = jnp.array([2, 6, -1], jnp.int32), jnp.array([8, 1, 3], jnp.int32)
        result = step(jnp.asarray(host), src, dst)
        bits.assert_bits(result, numpy_ops.numpy_copy_blocks(host, [2, 6, -1], [8, 1, 3]))

    def test_vmap_over_a_stack_of_caches(self):
        # The custom calls' sequential vmap loses bfloat16 NaN payloads on CPU (XLA's loop
        # around the call): a known gap of the ffi path, so it is checked with float32.
        dtype = "float32" if self.impl == "ffi" else "bfloat16"
        host = _random(9, (2, NUM_BLOCKS, 4, 128), dtype)
        src = jnp.array([[0, 1], [2, -1]], jnp.int32)
        dst = jnp.array([[4, 5], [3, 0]], jnp.int32)
        result = jax.vmap(lambda c, s, d: ops.copy_blocks(c, s, d))(jnp.asarray(host), src, dst)
        for b in range(2):
            bits.assert_bits(result[b], numpy_ops.numpy_copy_blocks(host[b], src[b], dst[b]))
        ids = jnp.array([7, -1], jnp.int32)
        gathered = jax.vmap(lambda c: ops.gather_blocks(c, ids))(jnp.asarray(host))
        for b in range(2):
            bits.assert_bits(gathered[b], numpy_ops.numpy_gather_blocks(host[b], [7, -1]))

    def test_bad_traced_ids_raise(self):
        # Every implementation checks traced ids before moving a byte (the custom calls in
        # their handlers, Pallas and the reference through a host check).
        host = _random(10, (NUM_BLOCKS, 2, 8), "float32")
        cases = [
            (lambda c, a, b: ops.copy_blocks(c, a, b), [1, 2], [12, 3], "dst_ids\\[0\\] = 12"),
            (lambda c, a, b: ops.copy_blocks(c, a, b), [1, 2], [4, 4], "duplicate id 4"),
            (lambda c, a, b: ops.copy_blocks(c, a, b), [1, 2], [2, 3], "both in src_ids"),
            (lambda c, a, b: ops.scatter_blocks(c, c[:2], b), [0, 0], [5, 5], "duplicate id 5"),
            (lambda c, a, b: ops.gather_blocks(c, a), [3, 10], [0, 0], "ids\\[1\\] = 10"),
        ]
        for fn, a, b, message in cases:
            cache = jnp.asarray(host)
            with self.assertRaisesRegex(jax.errors.JaxRuntimeError, message):
                jax.block_until_ready(jax.jit(fn)(cache, jnp.array(a), jnp.array(b)))

    def test_permute_and_merge(self):
        cases = [("HTD", "THD", 1), ("THD", "HTD", 2), ("KHTD", "KTHD", 4), ("LKTHD", "LKHTD", 2),
                 ("HTKD", "KTHD", 2), ("TD", "TD", 4)]
        ids = np.array([7, -1, 2, 0], np.int32)
        for i, (src, dst, ratio) in enumerate(cases):
            dtype = DTYPES[i % len(DTYPES)]
            sizes = {"L": 2, "K": 2, "H": 3, "T": 8, "D": 8}
            host = _random(i, (NUM_BLOCKS, *(sizes[a] for a in dst)), dtype)
            result = ops.merge_blocks(jnp.asarray(host), ids, ratio, src, dst)
            bits.assert_bits(result, numpy_merge(host, ids, ratio, src, dst),
                             f"{src}->{dst} {ratio}")

    def test_prefix_copy(self):
        for i, (layout, count) in enumerate([("HTD", 3), ("THD", 0), ("KTHD", 7)]):
            dtype = DTYPES[(i + 1) % len(DTYPES)]
            shape = {"HTD": (2, 8, 16), "THD": (8, 2, 16), "KTHD": (2, 8, 2, 16)}[layout]
            src = _random(i, (NUM_BLOCKS, *shape), dtype)
            dst = _random(i + 9, (6, *shape), dtype)
            src_ids, dst_ids = np.array([1, 7, -1, 3]), np.array([5, 0, 2, -1])
            result = ops.copy_block_prefix(jnp.asarray(src), jnp.asarray(dst), src_ids, dst_ids,
                                           count, layout)
            bits.assert_bits(result, numpy_prefix(src, dst, src_ids, dst_ids, count, layout),
                             layout)
            cache = jnp.asarray(src)
            result = ops.copy_block_prefix(cache, cache, [1, 2], [4, 9], jnp.int32(count), layout)
            bits.assert_bits(result, numpy_prefix(src, src, [1, 2], [4, 9], count, layout))

    def test_split_concat_round_trips(self):
        def split(local, sender, receiver, s):
            return [np.asarray(b) for b in
                    ops.split_for_peers(jnp.asarray(local), SRC_IDS, sender, receiver, s)]

        def concat(initial, buffers, receiver, sender, r):
            return ops.concat_from_peers(jnp.asarray(initial), [jnp.asarray(b) for b in buffers],
                                         DST_IDS, receiver, sender, r)

        for case in [c for c in GRID if c.name in FAST][:4]:
            for r, (result, expected) in round_trip(case, split, concat).items():
                bits.assert_bits(result, expected, f"{case.name} receiver {r}")

    def test_cache_methods_on_a_sharded_cache(self):
        mesh = meshes.tp(2, explicit=True)
        spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4,
                           dtype="bfloat16", layout="KHTD")
        host = [_random(k, spec.array_shape(6), spec.dtype) for k in range(spec.num_arrays)]
        cache = PagedKVCache.from_arrays(spec, [jnp.asarray(h) for h in host], mesh=mesh)
        cache = cache.copy_blocks([0, 1], [4, -1])
        got = cache.gather_blocks([4, -1, 2])
        for g, h in zip(got, host):
            expected = numpy_ops.numpy_copy_blocks(h, [0, 1], [4, -1])
            bits.assert_bits(g, numpy_ops.numpy_gather_blocks(expected, [4, -1, 2]))

    def test_cache_methods_on_a_data_parallel_cache(self):
        mesh = meshes.mesh((2, 2), ("data", "tp"), explicit=True)
        spec = KVCacheSpec.for_tpu_inference(1, 2, 64, 4, dtype="bfloat16")
        host = _random(7, (8, *spec.global_block_shape(2)), spec.dtype)
        cache = PagedKVCache.from_arrays(spec, [jnp.asarray(host)], mesh=mesh, data_axis="data")
        cache = cache.copy_blocks([0, 1, 5, -1], [2, 3, 7, 6])  # shard 0: 0-3, shard 1: 4-7
        expected = numpy_ops.numpy_copy_blocks(host, [0, 1, 5], [2, 3, 7])
        bits.assert_bits(cache.arrays[0], expected)
        (got,) = cache.gather_blocks([3, -1, 7, 4])
        bits.assert_bits(got, numpy_ops.numpy_gather_blocks(expected, [3, -1, 7, 4]))
        if self.impl == "pallas" and jax.default_backend() != "tpu":
            # Interpret mode runs without a sharding rule (its host callbacks cannot be
            # partitioned), so a jit over a sharded cache is for the compiled kernels only.
            return
        text = jax.jit(lambda c, i: c.copy_blocks(i, i + 2), donate_argnums=0).lower(
            cache, jnp.array([0, 1, 4, 5], jnp.int32)).compile().as_text()
        for collective in ("all-gather", "all-reduce", "all-to-all", "collective-permute",
                           "reduce-scatter"):
            self.assertNotIn(collective, text)


class FfiOpsTest(_BlockOps, _ImplTest):
    impl = "ffi"


class PallasOpsTest(_BlockOps, _ImplTest):
    impl = "pallas"

    def test_out_of_range_traced_ids_are_skipped(self):
        # With validate_ids=False traced ids are not checked on the host; the kernels skip ids
        # >= num_blocks, so no DMA leaves the buffer.
        host = _random(8, (NUM_BLOCKS, 2, 8), "float32")
        step = jax.jit(lambda c, s, d: ops.copy_blocks(c, s, d, validate_ids=False))
        result = step(jnp.asarray(host), jnp.array([1, 50]), jnp.array([60, 2]))
        bits.assert_bits(result, host)
        gather = jax.jit(lambda c, i: ops.gather_blocks(c, i, validate_ids=False))(
            jnp.asarray(host), jnp.array([3, 99]))
        bits.assert_bits(gather, numpy_ops.numpy_gather_blocks(host, [3, -1]))

    @pytest.mark.slow
    def test_every_preset_layout_reversed_and_merged(self):
        sizes = {"L": 2, "K": 2, "H": 3, "T": 8, "D": 16}
        ids = np.array([5, -1, 0], np.int32)
        for i, dst in enumerate(sorted(set(LAYOUT_PRESETS.values()))):
            src = dst[-2::-1] + "D"  # the major axes reversed
            for ratio in (1, 4):
                dtype = DTYPES[(i + ratio) % len(DTYPES)]
                host = _random(i, (NUM_BLOCKS, *(sizes[a] for a in dst)), dtype)
                result = ops.merge_blocks(jnp.asarray(host), ids, ratio, src, dst)
                bits.assert_bits(result, numpy_merge(host, ids, ratio, src, dst),
                             f"{src}->{dst} ratio {ratio} {dtype}")

    def test_updates_are_aliased_in_place(self):
        cache = jnp.zeros((NUM_BLOCKS, 8, 128), jnp.float32)
        hlo = jax.jit(lambda c: ops.copy_blocks(c, jnp.array([0]), jnp.array([1])),
                      donate_argnums=0).lower(cache).as_text()
        self.assertRegex(hlo, r"tensor<10x8x128xf32> \{tf.aliasing_output = \d+ : i32\}")


class ReferenceOpsTest(_BlockOps, _ImplTest):
    impl = "reference"


class PallasRaceTest(absltest.TestCase):
    """The kernels under the interpreter's race detector, DMAs executed eagerly (as soon as
    started, so in-flight DMAs really overlap): exact, and no two DMAs or accesses race."""

    def setUp(self):
        super().setUp()
        try:
            from jax._src.pallas.mosaic.interpret import interpret_pallas_call
        except ImportError:  # the detector's state is private to jax
            self.skipTest("this jax keeps the race detector's state elsewhere")
        self.state = interpret_pallas_call
        self.params = pltpu.InterpretParams(detect_races=True, dma_execution_mode="eager")

    def _races(self, fn, *args):
        try:
            result = jax.block_until_ready(jax.jit(fn)(*args))
        except jax.errors.JaxRuntimeError as error:
            # Newer jax raises from the detector at once instead of only recording the race.
            if "RACE DETECTED" not in str(error):
                raise
            return None, True
        races = self.state.races
        found = bool(races is not None and races.races_found)
        if races is not None:
            races.races_found = False
        return result, found

    def test_no_races(self):
        host = _random(0, (12, 8, 128), "bfloat16")
        cache = jnp.asarray(host)
        p = self.params
        src, dst = [0, 1, 2, 5, 6, 7, 9, -1], [10, 11, 4, 3, 8, -1, 1, 2]
        cases = {
            "copy": (lambda c: _pallas.copy_blocks(c, jnp.array(src), jnp.array(dst),
                                                   interpret=p),
                     numpy_ops.numpy_copy_blocks(host, src, dst)),
            "gather": (lambda c: _pallas.gather_blocks(c, jnp.array(src), interpret=p),
                       numpy_ops.numpy_gather_blocks(host, src)),
            "scatter": (lambda c: _pallas.scatter_blocks(c, c[:8], jnp.array(dst), interpret=p),
                        numpy_ops.numpy_scatter_blocks(host, host[:8], dst)),
            "merge": (lambda c: _pallas.rearrange_blocks(
                c.reshape(12, 4, 2, 128), jnp.array([0, 3, -1, 5, 7, 2]), src_layout="HTD",
                dst_layout="THD", ratio=2, interpret=p).reshape(12, 8, 128),
                      numpy_merge(host.reshape(12, 4, 2, 128), [0, 3, -1, 5, 7, 2], 2, "HTD",
                                  "THD").reshape(12, 8, 128)),
            # A packed rewrite zeroing padding: 8 combined heads, 6 valid; 100 valid lanes.
            "packed merge": (lambda c: _pallas.rearrange_blocks(
                c.reshape(12, 2, 4, 128), jnp.array([0, 3, -1, 5, 7, 2]), src_layout="HTD",
                dst_layout="THD", ratio=2, interpret=p, payload=("H", 3, 100)).reshape(
                    12, 8, 128),
                             _packed_expected(host)),
            "prefix": (lambda c: _pallas.copy_block_prefix_in_place(
                c, jnp.array([0, 1, 2]), jnp.array([5, 6, -1]), jnp.int32(5), layout="TD",
                interpret=p),
                       numpy_prefix(host, host, [0, 1, 2], [5, 6, -1], 5, "TD")),
        }
        # Split into two head halves of an LKHTD block, then concat them back elsewhere.
        big_host = _random(2, (6, 2, 2, 4, 4, 128), "float8_e4m3fn")
        starts = (0, 0, 0, 0, 0, 0, 0, 2, 0, 0)
        halves = ((2, 2, 2, 4, 128),) * 2
        ids = [4, -1, 1]
        split_expected = [numpy_ops.numpy_gather_blocks(big_host, ids)[:, :, :, h:h + 2]
                          for h in (0, 2)]
        parts, found = self._races(lambda c: _pallas.split_blocks(
            c, jnp.array(ids), box_starts=starts, shapes=halves, interpret=p),
            jnp.asarray(big_host))
        for part, want in zip(parts, split_expected):
            bits.assert_bits(part, want, "split")
        self.assertFalse(found, "split: the race detector reported a race")
        concat_expected = big_host.copy()
        concat_expected[[0, 5]] = big_host[[4, 1]]
        result, found = self._races(lambda c, a, b: _pallas.concat_blocks(
            c, jnp.array([0, -1, 5]), a, b, box_starts=starts, interpret=p),
            jnp.asarray(big_host), *parts)
        bits.assert_bits(result, concat_expected, "concat")
        self.assertFalse(found, "concat: the race detector reported a race")
        for name, (fn, expected) in cases.items():
            result, found = self._races(fn, cache)
            bits.assert_bits(result, expected, name)
            self.assertFalse(found, f"{name}: the race detector reported a race")

    def test_the_detector_sees_a_racing_copy(self):
        # Control: a copy whose block 1 is both read and written by DMAs in flight together.
        cache = jnp.asarray(_random(1, (4, 8, 128), "float32"))
        fn = lambda c: _pallas.copy_blocks(c, jnp.array([0, 1]), jnp.array([1, 2]),  # noqa: E731
                                           interpret=self.params)
        _, found = self._races(fn, cache)
        self.assertTrue(found)


def _packed_expected(host):
    blocks = host.reshape(12, 2, 4, 128)
    out = numpy_merge(blocks, [0, 3, -1, 5, 7, 2], 2, "HTD", "THD")
    for b in (0, 3, 5, 7, 2):
        out[b][:, 3:] = 0
        out[b][..., 100:] = 0
    return out.reshape(12, 8, 128)


class LargeBlockTest(absltest.TestCase):
    def test_blocks_beyond_vmem_take_the_xla_path_on_tpu(self):
        # Compiled (not interpreted), a block that does not fit the VMEM budget is rewritten by
        # XLA instead: no Pallas call at all, so this runs here with interpret=False.
        host = _random(3, (NUM_BLOCKS, 2, 8, 16), "float8_e5m2")
        ids = np.array([3, -1, 11, 0], np.int32)  # 11: out of range, skipped
        with mock.patch.object(_pallas, "_REARRANGE_VMEM_BYTES", 64):
            fn = jax.jit(lambda c, i: _pallas.rearrange_blocks(
                c, i, src_layout="THD", dst_layout="HTD", ratio=2, interpret=False))
            self.assertNotIn("tpu_custom_call", fn.lower(jnp.asarray(host), ids).as_text())
            result = fn(jnp.asarray(host), ids)
        bits.assert_bits(result, numpy_merge(host, [3, -1, -1, 0], 2, "THD", "HTD"))
        with mock.patch.object(_pallas, "_REARRANGE_VMEM_BYTES", 64):  # with padding zeroed
            fn = jax.jit(lambda c, i: _pallas.rearrange_blocks(
                c, i, src_layout="THD", dst_layout="HTD", ratio=2, interpret=False,
                payload=("H", 1, 12)))
            self.assertNotIn("tpu_custom_call", fn.lower(jnp.asarray(host), ids).as_text())
            result = fn(jnp.asarray(host), ids)
        expected = numpy_merge(host, [3, -1, -1, 0], 2, "THD", "HTD")
        for b in (3, 0):
            expected[b][1:] = 0
            expected[b][..., 12:] = 0
        bits.assert_bits(result, expected)


class RowRunsTest(parameterized.TestCase):
    @parameterized.parameters(("HTD", "THD", 1), ("THD", "THD", 2), ("LKTHD", "LKHTD", 4))
    def test_runs_cover_every_row_once(self, src, dst, ratio):
        sizes = {"L": 2, "K": 2, "H": 3, "T": 8, "D": 1}
        shape = tuple(sizes[a] for a in dst)
        run, radices, strides, stride = _pallas.row_runs(shape, src, dst, ratio)
        rows = int(np.prod(shape[:-1]))
        sources = []
        for r in range(rows // run):
            digits, rest = [], r
            for size in reversed(radices):
                digits.append(rest % size)
                rest //= size
            start = sum(d * s for d, s in zip(digits, reversed(strides)))
            sources += [start + k * stride for k in range(run)]
        block = np.arange(rows).reshape(1, *shape)
        expected = numpy_merge(block, [0], ratio, src, dst).reshape(-1)
        np.testing.assert_array_equal(np.asarray(sources), expected)


class SwitchTest(absltest.TestCase):
    def test_docstring_examples(self):
        import doctest

        import jaxkv
        from jaxkv.ops import _dispatch

        result = doctest.testmod(_dispatch, extraglobs={"jnp": jnp, "jaxkv": jaxkv})
        self.assertGreater(result.attempted, 0)
        self.assertEqual(result.failed, 0)

    def test_context_and_environment(self):
        self.assertEqual(ops.current_implementation(), "auto")
        with ops.implementation("pallas"):
            self.assertEqual(ops.current_implementation(), "pallas")
            with ops.implementation("reference"):
                self.assertEqual(ops.current_implementation(), "reference")
            self.assertEqual(ops.current_implementation(), "pallas")
        with mock.patch.dict(os.environ, {"JAXKV_OPS_IMPL": "reference"}):
            self.assertEqual(ops.current_implementation(), "reference")
        with mock.patch.dict(os.environ, {"JAXKV_OPS_IMPL": "cuda"}):
            self.assertRaisesRegex(ValueError, "JAXKV_OPS_IMPL must be one of",
                                   ops.current_implementation)
        with self.assertRaisesRegex(ValueError, "implementation must be one of"):
            ops.implementation("tpu").__enter__()

    def test_the_switch_changes_what_is_lowered(self):
        cache = jnp.zeros((4, 8, 128), jnp.float32)

        def lowered():
            return jax.jit(lambda c: ops.copy_blocks(c, jnp.array([0]), jnp.array([1]))).lower(
                cache).as_text()

        self.assertIn("jaxkv_copy_blocks", lowered())  # auto on cpu: the custom call
        with ops.implementation("reference"):
            text = lowered()
            self.assertNotIn("jaxkv_copy_blocks", text)
            self.assertIn("stablehlo.scatter", text)
        with ops.implementation("pallas"):
            self.assertNotIn("jaxkv_copy_blocks", lowered())

    def test_the_environment_variable_changes_what_is_lowered(self):
        # JAXKV_OPS_IMPL set when the process starts (how CI or a user forces one), in a
        # fresh process: what each op lowers to, and a wrong name refused by the op.
        script = (
            "import jax, jax.numpy as jnp\n"
            "from jaxkv import ops\n"
            "c = jnp.arange(8.0).reshape(4, 2)\n"
            "f = jax.jit(lambda c: ops.copy_blocks(c, jnp.array([0]), jnp.array([1]),\n"
            "                                      validate_ids=False))\n"
            "text = f.lower(c).as_text()\n"
            "print(ops.current_implementation(), 'jaxkv_copy_blocks' in text,\n"
            "      'callback' in text, f(c)[1].tolist())\n"
        )
        # The custom call; jnp (no callback); Pallas's interpret mode (host callbacks).
        runs = {"ffi": "ffi True False [0.0, 1.0]",
                "reference": "reference False False [0.0, 1.0]",
                "pallas": "pallas False True [0.0, 1.0]"}
        for name, want in runs.items():
            env = dict(os.environ, JAXKV_OPS_IMPL=name, JAX_PLATFORMS="cpu")
            done = subprocess.run([sys.executable, "-P", "-c", script], env=env,
                                  capture_output=True, text=True, timeout=120)
            self.assertEqual(done.returncode, 0, done.stderr[-2000:])
            self.assertEqual(done.stdout.strip().splitlines()[-1], want, name)
        env = dict(os.environ, JAXKV_OPS_IMPL="tpu", JAX_PLATFORMS="cpu")
        done = subprocess.run([sys.executable, "-P", "-c", script], env=env,
                              capture_output=True, text=True, timeout=120)
        self.assertNotEqual(done.returncode, 0)
        self.assertIn("JAXKV_OPS_IMPL must be one of", done.stderr)

    def test_pallas_lowers_for_tpu(self):
        # Lowering for a TPU from this CPU-only machine with the Pallas implementation gives
        # Mosaic custom calls, never the CPU custom call. This runs Pallas's TPU lowering of
        # every kernel (Mosaic's own compile needs a TPU). validate_ids=False: the host check
        # of traced ids is a host callback, which only lowers for the backend it runs on.
        s = jax.ShapeDtypeStruct
        cache, ids = s((16, 4, 8, 128), jnp.bfloat16), s((4,), jnp.int32)
        rows = s((4, 4, 8, 128), jnp.bfloat16)
        spec = KVCacheSpec(num_layers=4, num_kv_heads=4, head_dim=128, block_size=16,
                           dtype="bfloat16")
        sender, receiver = EngineConfig(spec, 1), EngineConfig(spec, 2)
        big = s((8, 4, 2, 4, 16, 128), jnp.bfloat16)
        part = s((4, 4, 2, 2, 16, 128), jnp.bfloat16)
        off = dict(validate_ids=False)
        programs = {
            "copy": (lambda c, a, b: ops.copy_blocks(c, a, b, **off), (cache, ids, ids)),
            "gather": (lambda c, a: ops.gather_blocks(c, a, **off), (cache, ids)),
            "gather_into": (lambda c, a, o: ops.gather_blocks(c, a, out=o, **off),
                            (cache, ids, rows)),
            "scatter": (lambda c, b, a: ops.scatter_blocks(c, b, a, **off), (cache, rows, ids)),
            "prefix": (lambda c, d, a, b: ops.copy_block_prefix(c, d, a, b, 3, "HTD", **off),
                       (cache, cache, ids, ids)),
            "split": (lambda c, a: ops.split_for_peers(c, a, sender, receiver, 0, **off),
                      (big, ids)),
            "permute": (lambda c, a: ops.permute_blocks(c, a, "HTD", "THD", **off),
                        (s((16, 8, 16, 128), jnp.float8_e4m3fn), ids)),
            "merge": (lambda c, a: ops.merge_blocks(c, a, 2, "LKTHD", "LKHTD", **off),
                      (big, ids)),
            "concat": (lambda c, a, x: ops.concat_from_peers(c, [x], a, receiver, sender, 0,
                                                              **off),
                       (s((8, 4, 2, 2, 16, 128), jnp.bfloat16), ids, part)),
        }
        for name, (fn, args) in programs.items():
            # Traced as on a TPU backend: the implementation is picked when tracing.
            with ops.implementation("pallas"), mock.patch.object(jax, "default_backend",
                                                                 return_value="tpu"):
                traced = jax.jit(fn).trace(*args)
            text = traced.lower(lowering_platforms=("tpu",)).as_text()
            self.assertIn("tpu_custom_call", text, name)
            self.assertNotIn("jaxkv_", text, name)

if __name__ == "__main__":
    absltest.main()


class AutoOnGpusTest(absltest.TestCase):
    """"auto" runs the custom calls on a GPU only where they exist: the CUDA module built and
    registered and an NVIDIA GPU (a build without nvcc or a ROCm GPU also report "gpu");
    elsewhere the jnp reference, said once in the log."""

    def tearDown(self):
        from jaxkv.ops import _dispatch

        _dispatch.custom_calls_run_on.cache_clear()
        super().tearDown()

    def test_gpu_without_custom_calls_takes_the_reference(self):
        import contextlib

        from jaxkv import _ffi
        from jaxkv.ops import _dispatch

        class Device:
            def __init__(self, version):
                self.client = type("Client", (), {"platform_version": version})()

        for registered, version, want in ((("cpu",), "cuda 12080", False),
                                         (("cpu", "CUDA"), "rocm 6.2.41133", False),
                                         (("cpu", "CUDA"), "cuda 12080", True)):
            _dispatch.custom_calls_run_on.cache_clear()
            with mock.patch.object(_ffi, "registered_platforms", return_value=registered), \
                    mock.patch.object(_dispatch.jax, "devices", return_value=[Device(version)]):
                logs = (self.assertLogs("jaxkv.ops", "WARNING") if not want
                        else contextlib.nullcontext())
                with logs:
                    self.assertEqual(_dispatch.custom_calls_run_on("gpu"), want)

    def test_lowering_on_such_a_gpu_has_no_custom_call(self):
        from jaxkv import _ffi
        from jaxkv.ops import _dispatch

        cache = jnp.arange(4 * 2 * 3, dtype=jnp.float32).reshape(4, 2, 3)
        ids = jnp.asarray([1], jnp.int32), jnp.asarray([2], jnp.int32)

        def lowered():
            return jax.jit(lambda c, s, d: ops.copy_blocks(c, s, d)).lower(cache, *ids).as_text()

        self.assertIn("jaxkv_copy_blocks", lowered())  # CPU: the custom call
        with mock.patch.object(_ffi, "registered_platforms", return_value=("cpu",)), \
                mock.patch.object(_dispatch.jax, "default_backend", return_value="gpu"), \
                self.assertLogs("jaxkv.ops", "WARNING"):
            _dispatch.custom_calls_run_on.cache_clear()
            # A process's backend never changes, so JAX may reuse the op's trace (jax 0.12
            # caches custom_partitioning's): clear it as `implementation()` does.
            jax.clear_caches()
            self.addCleanup(jax.clear_caches)  # no later test may reuse the reference trace
            self.addCleanup(_dispatch.custom_calls_run_on.cache_clear)
            self.assertNotIn("jaxkv_copy_blocks", lowered())
