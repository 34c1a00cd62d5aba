"""Every path of the CUDA engine on a real GPU, bit for bit against the jnp reference
(`ops.implementation("reference")` on the same GPU): the shared-memory rewrite with and
without the opt-in, the one-pass large-unit rewrite, the staged rewrite with several units
per block and several chunks, 8-byte vector moves, `gather_blocks(out=)`, in-place prefix
copies and prefix counts outside 1..T-1, permute's own target, the device id checks,
misaligned base pointers and caches sharded over several GPUs.

Skipped where JAX sees no GPU; fails at import under JAXKV_EXPECT_GPU=1 when JAX sees none.
"""

import ctypes

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from support import bits, numpy_ops, platforms
from support import reshape as ref

from jaxkv import ops

GPUS = platforms.gpus()


def _on_gpu(host, device=None):
    return jax.device_put(host, device or GPUS[0])


def _host(result):
    return [np.asarray(r) for r in (result if isinstance(result, (list, tuple)) else [result])]


def _against_reference(test, run):
    """`run()` (which puts its operands on the GPU itself, fresh each time: eager ops consume
    their caches) under the custom calls and under the jnp reference, compared bit for bit."""
    got = _host(run())
    with ops.implementation("reference"):
        want = _host(run())
    test.assertEqual(len(got), len(want))
    for g, w in zip(got, want):
        np.testing.assert_array_equal(bits.bits(g), bits.bits(w))


# A DLPack producer for byte views of a JAX array at any offset, so that a custom call gets a
# base pointer that is not 16-byte aligned (as an adopted torch tensor view can give it).
class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p)]


# JAX calls the deleter when the imported array dies (it must not be null); the view owns
# nothing that needs freeing.
_no_op_deleter = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(lambda managed: None)

_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


class ByteView:
    """uint8 `shape` bytes of `base` (a ready, single-device JAX array) from byte `offset`,
    exported through DLPack without a copy. It owns the DLPack struct that an imported array
    reads until it is destroyed, so every view is kept for the life of the process."""

    _alive: list = []

    def __init__(self, base: jax.Array, offset: int, shape: tuple[int, ...]):
        assert offset + int(np.prod(shape)) <= base.nbytes
        self._base = jax.block_until_ready(base)
        device = base.devices().pop()
        self._device = (2, device.local_hardware_id) if device.platform == "gpu" else (1, 0)
        self._shape = (ctypes.c_int64 * len(shape))(*shape)
        self._managed = _DLManagedTensor()
        tensor = self._managed.dl_tensor
        tensor.data = base.unsafe_buffer_pointer() + offset
        tensor.device = _DLDevice(*self._device)
        tensor.ndim = len(shape)
        tensor.dtype = _DLDataType(1, 8, 1)  # kDLUInt, 8 bits
        tensor.shape = self._shape
        # strides NULL (compact), byte_offset 0.
        self._managed.deleter = ctypes.cast(_no_op_deleter, ctypes.c_void_p)
        ByteView._alive.append(self)

    def __dlpack_device__(self):
        return self._device

    def __dlpack__(self, **kwargs):
        del kwargs  # stream: the base array is ready; no version negotiation
        return _capsule_new(ctypes.addressof(self._managed), b"dltensor", None)


@absltest.skipIf(not GPUS, "no GPU visible to JAX")
class CudaPathsTest(parameterized.TestCase):
    def setUp(self):
        super().setUp()
        platforms.take_cuda_id_errors(GPUS[0])  # nothing left over from another test

    # -- layout rewrites: the three CUDA paths ------------------------------------------------

    @parameterized.named_parameters(
        # unit = the (H, T, D) slab of each (L, K): units_per_block = L * K.
        ("opt_in_52k_units", "LKHTD", "LKTHD", {"L": 2, "K": 2, "H": 13, "T": 64, "D": 32},
         "bfloat16"),
        ("opt_in_64k_units", "LKHTD", "LKTHD", {"L": 2, "K": 2, "H": 4, "T": 64, "D": 128},
         "bfloat16"),
        # 252-byte runs: 4-byte moves.
        ("opt_in_71k_units_4_byte_moves", "HTD", "THD", {"H": 9, "T": 32, "D": 63}, "float32"),
        # 128 KiB (a TensorRT-LLM H8 x T64 x D128 bf16 unit): one pass with 1024 threads where
        # the opt-in allows it (sm_80, sm_90), else the staged path; identical bytes either way.
        ("one_pass_128k_units", "HTD", "THD", {"H": 8, "T": 64, "D": 128}, "bfloat16"),
    )
    def test_shared_memory_rewrite(self, src, dst, sizes, dtype):
        host = bits.random_bits(np.random.default_rng(0), (8, *ref.block_shape(dst, sizes)),
                                      dtype)
        ids = np.array([3, -1, 0, 6], np.int32)
        _against_reference(self, lambda: ops.permute_blocks(_on_gpu(host), ids, src, dst))

    @parameterized.parameters(1, 2)
    def test_staged_rewrite_several_units_and_chunks(self, ratio):
        # 256 KiB units (above every opt-in limit), 16 per 4 MiB block; 10 ids with scratch
        # for at most 8 blocks (16 MiB) take two chunks or more.
        sizes = {"L": 8, "K": 2, "H": 8, "T": 128, "D": 128}
        host = bits.random_bits(np.random.default_rng(1),
                                      (12, *ref.block_shape("LKHTD", sizes)), "bfloat16")
        ids = np.array([11, 0, 5, -1, 2, 9, 7, 1, 10, 4], np.int32)
        _against_reference(
            self, lambda: ops.merge_blocks(_on_gpu(host), ids, ratio, "LKHTD", "LKTHD"))

    @parameterized.product(dtype=["bfloat16", "float32", "int8"], traced=[False, True])
    def test_permute_target(self, dtype, traced):
        host = bits.random_bits(np.random.default_rng(2),
                                      (10, *ref.block_shape("THD")), dtype)
        ids = np.array([9, 2, -1, 4], np.int32)

        def run():
            if traced:
                step = jax.jit(lambda c, i: ops.permute_blocks(c, i, "HTD", "THD"),
                               donate_argnums=0)
                return step(_on_gpu(host), jnp.asarray(ids))
            return ops.permute_blocks(_on_gpu(host), ids, "HTD", "THD")

        _against_reference(self, run)

    # -- block moves --------------------------------------------------------------------------

    @parameterized.parameters(((6,), "float32"), ((3, 2), "float32"), ((4, 6), "int8"))
    def test_eight_byte_vectors(self, block_shape, dtype):
        # 24-byte blocks: the widest move dividing every address and length is 8 bytes.
        rng = np.random.default_rng(3)
        host = bits.random_bits(rng, (16, *block_shape), dtype)
        blocks = bits.random_bits(rng, (3, *block_shape), dtype)
        _against_reference(self, lambda: ops.copy_blocks(_on_gpu(host), [0, 5, -1], [7, 2, 3]))
        _against_reference(self, lambda: ops.gather_blocks(_on_gpu(host), [15, -1, 4]))
        _against_reference(
            self, lambda: ops.scatter_blocks(_on_gpu(host), _on_gpu(blocks), [1, -1, 14]))

    def test_eight_byte_prefix_rows(self):
        # layout "TD" with D = 2 float32: 8-byte rows.
        rng = np.random.default_rng(4)
        src = bits.random_bits(rng, (6, 8, 2), "float32")
        dst = bits.random_bits(rng, (6, 8, 2), "float32")
        _against_reference(self, lambda: ops.copy_block_prefix(
            _on_gpu(src), _on_gpu(dst), [0, 4, -1], [3, 5, 1], 3, "TD"))

    @parameterized.parameters(False, True)
    def test_gather_into_out(self, traced):
        rng = np.random.default_rng(5)
        host = bits.random_bits(rng, (12, 2, 4, 16, 64), "bfloat16")
        stale = bits.random_bits(rng, (4, 2, 4, 16, 64), "bfloat16")
        ids = np.array([11, -1, 3, 3], np.int32)

        def run():
            out = _on_gpu(stale)
            if traced:
                step = jax.jit(lambda c, i, o: ops.gather_blocks(c, i, out=o), donate_argnums=2)
                return step(_on_gpu(host), jnp.asarray(ids), out)
            return ops.gather_blocks(_on_gpu(host), ids, out=out)

        _against_reference(self, run)

    @parameterized.product(layout=["LKHTD", "THD", "TD"], num_tokens=[8, 13, -4, 0, 3, 7],
                           in_place=[False, True])
    def test_prefix_counts(self, layout, num_tokens, in_place):
        # T = 8: counts >= T and <= 0 copy whole blocks, 1..7 copy that many token rows.
        rng = np.random.default_rng(6)
        src = bits.random_bits(rng, (8, *ref.block_shape(layout)), "bfloat16")
        dst = bits.random_bits(rng, (8, *ref.block_shape(layout)), "bfloat16")
        src_ids, dst_ids = jnp.array([0, 4, -1]), jnp.array([3, 5, 1])

        def run():
            n = jnp.int32(num_tokens)
            if in_place:
                step = jax.jit(lambda c, i, j, n: ops.copy_block_prefix(c, c, i, j, n, layout),
                               donate_argnums=0)
                return step(_on_gpu(dst), src_ids, dst_ids, n)
            step = jax.jit(lambda s, d, i, j, n: ops.copy_block_prefix(s, d, i, j, n, layout),
                           donate_argnums=1)
            return step(_on_gpu(src), _on_gpu(dst), src_ids, dst_ids, n)

        _against_reference(self, run)

    # -- device id checks ---------------------------------------------------------------------

    def _id_bits(self):
        from jaxkv import _ffi_cuda

        return {"range": _ffi_cuda.ID_OUT_OF_RANGE, "repeated": _ffi_cuda.ID_REPEATED,
                "shared": _ffi_cuda.ID_SHARED}

    @parameterized.named_parameters(
        ("copy_out_of_range", "copy", [0, 1], [2, 64], "range"),
        ("copy_repeated_dst", "copy", [0, 1], [5, 5], "repeated"),
        ("copy_src_is_dst", "copy", [1, 2], [2, 3], "shared"),
        ("scatter_repeated", "scatter", None, [7, -1, 7], "repeated"),
        ("gather_out_of_range", "gather", None, [3, 64], "range"),
        ("permute_repeated", "permute", None, [4, 2, 4], "repeated"),
        ("prefix_in_place_src_is_dst", "prefix", [6, 1], [1, 9], "shared"),
        ("prefix_repeated_dst", "prefix", [6, 2], [9, 9], "repeated"),
    )
    def test_bad_traced_ids_write_nothing_and_are_recorded(self, op, src, dst, kind):
        host = bits.random_bits(np.random.default_rng(7), (64, 4, 8, 16), "float16")
        rows = bits.random_bits(np.random.default_rng(8), (3, 4, 8, 16), "float16")
        a, b = jnp.array(src if src is not None else [0], jnp.int32), jnp.array(dst, jnp.int32)
        steps = {
            "copy": lambda c, a, b: ops.copy_blocks(c, a, b),
            "scatter": lambda c, a, b: ops.scatter_blocks(c, jnp.asarray(rows), b),
            "gather": lambda c, a, b: ops.gather_blocks(c, b),
            "permute": lambda c, a, b: ops.permute_blocks(c, b, "HTD", "THD"),
            "prefix": lambda c, a, b: ops.copy_block_prefix(c, c, a, b, jnp.int32(3), "HTD"),
        }
        cache = _on_gpu(host)
        # Not donated: the op updates XLA's copy of the cache, which must come back unchanged.
        result = jax.block_until_ready(jax.jit(steps[op])(cache, a, b))
        self.assertEqual(platforms.take_cuda_id_errors(GPUS[0]), self._id_bits()[kind])
        # A refused gather's fresh output comes out zero.
        unchanged = np.zeros_like(host[:len(b)]) if op == "gather" else host
        np.testing.assert_array_equal(bits.bits(result), bits.bits(unchanged))
        # The record is cleared, and the next op with good ids runs and records nothing.
        good = jax.jit(steps[op])(cache, jnp.array([0] * len(a), jnp.int32),
                                  jnp.array([10 + i for i in range(len(b))], jnp.int32))
        jax.block_until_ready(good)
        self.assertEqual(platforms.take_cuda_id_errors(GPUS[0]), 0)

    def test_unvalidated_ids_are_not_checked(self):
        host = bits.random_bits(np.random.default_rng(9), (16, 64), "int8")
        step = jax.jit(lambda c, s, d: ops.copy_blocks(c, s, d, validate_ids=False))
        result = step(_on_gpu(host), jnp.array([0, 3], jnp.int32), jnp.array([16, 4], jnp.int32))
        expected = numpy_ops.numpy_copy_blocks(host, [3], [4])
        np.testing.assert_array_equal(bits.bits(result), bits.bits(expected))
        self.assertEqual(platforms.take_cuda_id_errors(GPUS[0]), 0)

    # -- misaligned base pointers ---------------------------------------------------------------

    @parameterized.parameters(1, 2, 4, 8)
    def test_misaligned_views(self, offset):
        # A [16, 24]-byte view starting `offset` bytes into a buffer: the vector width follows
        # the base pointer (offset 8: 8-byte moves, 1: byte moves). Read-only operands keep the
        # view's pointer (donating it would copy a foreign buffer into an aligned one).
        raw = bits.random_bits(np.random.default_rng(10), (16 * 24 + 64,), "uint8")
        base = _on_gpu(raw)
        cache = jax.dlpack.from_dlpack(ByteView(base, offset, (16, 24)))
        if cache.unsafe_buffer_pointer() != base.unsafe_buffer_pointer() + offset:
            self.skipTest("JAX copied the misaligned DLPack view: no misaligned pointer can "
                          "reach a custom call through it")
        try:
            _against_reference(self, lambda: ops.gather_blocks(cache, [15, -1, 2, 7]))
        except jax.errors.JaxRuntimeError as error:
            # XLA's GPU runtime (jax 0.11 on an H200) refuses program parameters that are not
            # 16-byte aligned before anything runs: loud, and no custom call sees the pointer.
            self.assertIn("must be a multiple of", str(error))
            np.testing.assert_array_equal(np.asarray(base), raw)
            self.skipTest(f"XLA refuses misaligned parameters on this GPU runtime: {error}")
        rows = jax.dlpack.from_dlpack(ByteView(base, offset, (3, 24)))
        dense = bits.random_bits(np.random.default_rng(11), (3, 24), "uint8")
        _against_reference(self, lambda: ops.scatter_blocks(_on_gpu(dense), rows, [2, -1, 0]))
        # The views were only read.
        np.testing.assert_array_equal(np.asarray(cache),
                                      raw[offset:offset + 16 * 24].reshape(16, 24))

    # -- several GPUs -------------------------------------------------------------------------

    @absltest.skipIf(len(GPUS) < 2, "needs two GPUs")
    def test_sharded_over_gpus(self):
        mesh = Mesh(np.array(GPUS[:2]), ("x",))
        rng = np.random.default_rng(12)
        # Heads sharded (each GPU moves its half of every block), then blocks sharded (data
        # parallelism: global ids, each GPU keeps the ones it owns).
        host = bits.random_bits(rng, (8, 8, 64, 128), "bfloat16")
        for spec in (PartitionSpec(None, "x"), PartitionSpec("x")):
            sharding = NamedSharding(mesh, spec)
            _against_reference(self, lambda s=sharding: ops.copy_blocks(
                jax.device_put(host, s), [0, 5], [3, 6]))
            _against_reference(self, lambda s=sharding: ops.gather_blocks(
                jax.device_put(host, s), [2, -1, 7, 4]))
        # A permute with 64 KiB units on both GPUs: each device's shared-memory opt-in.
        blocks = bits.random_bits(rng, (8, 64, 4, 128), "bfloat16")
        by_blocks = NamedSharding(mesh, PartitionSpec("x"))
        _against_reference(self, lambda: ops.permute_blocks(
            jax.device_put(blocks, by_blocks), [1, 6, -1, 3], "HTD", "THD"))
        self.assertEqual(platforms.take_cuda_id_errors(GPUS[0]), 0)
        self.assertEqual(platforms.take_cuda_id_errors(GPUS[1]), 0)


if __name__ == "__main__":
    absltest.main()
