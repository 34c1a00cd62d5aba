"""Permute and merge of packed caches (tpu-inference / sglang-jax blocks
``[page_size, align(2H, p) // p, p, align(D, 128)]``, K/V interleaved, phantom heads, padded
head dim) under every implementation, bit for bit against an independent numpy reference: the
stored axes transposed by name, then the spec's padding zeroed. The Pallas kernels run in TPU
interpret mode here (no TPU was available)."""

from support import bits, meshes, platforms

platforms.force_cpu_devices()

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxkv import KVCacheSpec, ops
from jaxkv._spec import SUPPORTED_DTYPES
from jaxkv.ops import _pallas

# Every dtype the Pallas kernels move: the cache dtypes and the other 8-, 16- and 32-bit ones.
DTYPES = [d.name for d in SUPPORTED_DTYPES] + ["uint8", "int16", "uint16", "int32", "uint32"]
NUM_PAGES = 6
IDS = np.array([4, -1, 1, 5], np.int32)


def _align(value, multiple):
    return -(-value // multiple) * multiple


def tpu_inference_shape(pages, page_size, heads, head_dim, dtype):
    """tpu-inference's per-layer cache shape, from its formula."""
    packing = 32 // (8 * np.dtype(dtype).itemsize)
    return (pages, page_size, _align(2 * heads, packing) // packing, packing,
            _align(head_dim, 128))


def stored_mask(shape, heads, head_dim):
    """Payload mask of a ``[T, words, packing, D]`` block (independent of the library)."""
    _, words, packing, lanes = shape
    combined = np.arange(words)[:, None] * packing + np.arange(packing)[None, :]
    return ((combined < 2 * heads)[None, :, :, None]
            & (np.arange(lanes) < head_dim)[None, None, None, :]).repeat(shape[0], axis=0)


def numpy_rewrite(host, ids, ratio, src, dst, mask=None):
    """Each listed block's bytes read as ``[ratio, *src axes (T / ratio tokens)]`` and written
    in `dst` order (token ``j * n + t`` from token ``t`` of sub-block ``j``); padding zeroed."""
    out = host.copy()
    sizes = dict(zip(dst, host.shape[1:]))
    sizes["T"] //= ratio
    names = ["R", *src]
    order = [x for a in dst for x in (("R", "T") if a == "T" else (a,))]
    for b in ids:
        if not 0 <= b < host.shape[0]:
            continue
        block = host[b].reshape([ratio] + [sizes[a] for a in src])
        block = block.transpose([names.index(x) for x in order]).reshape(host.shape[1:])
        out[b] = block if mask is None else np.where(mask, block, np.zeros((), block.dtype))
    return out


def _host(seed, shape, dtype):
    return bits.random_bits(np.random.default_rng(seed), shape, dtype)


class PackedRewriteTest(parameterized.TestCase):
    @parameterized.parameters("reference", "pallas", "auto")
    def test_merge_and_permute_every_dtype(self, impl):
        with ops.implementation(impl):
            for i, dtype in enumerate(DTYPES):
                heads, head_dim = 3, 64  # 6 combined K/V heads: phantom ones where p = 4
                shape = tpu_inference_shape(NUM_PAGES, 4, heads, head_dim, dtype)
                mask = stored_mask(shape[1:], heads, head_dim)
                host = _host(i, shape, dtype)
                got = ops.merge_blocks(jnp.asarray(host), IDS, 2, "HhTD", "THhD",
                                       packed_size=2 * heads, head_dim=head_dim)
                bits.assert_bits(got, numpy_rewrite(host, IDS, 2, "HhTD", "THhD", mask),
                             f"{impl} merge {dtype}")
                # Head-major storage back to tpu-inference's token-major blocks.
                host = _host(100 + i, shape, dtype)
                got = ops.permute_blocks(jnp.asarray(host), IDS, "HhTD", "THhD",
                                         packed_size=2 * heads, head_dim=head_dim)
                bits.assert_bits(got, numpy_rewrite(host, IDS, 1, "HhTD", "THhD", mask),
                             f"{impl} permute {dtype}")

    @parameterized.parameters(*SUPPORTED_DTYPES)
    def test_spec_shapes_and_masks(self, dtype):
        # The spec describes the formula's shape, and its mask is the padding zeroed.
        spec = KVCacheSpec.for_tpu_inference(1, num_kv_heads=3, head_dim=64, page_size=4,
                                             dtype=dtype)
        shape = tpu_inference_shape(NUM_PAGES, 4, 3, 64, dtype)
        self.assertEqual(spec.array_shape(NUM_PAGES), shape)
        self.assertEqual(spec.stored_layout, "THhD")
        np.testing.assert_array_equal(spec.payload_mask(), stored_mask(shape[1:], 3, 64))
        host = _host(7, shape, dtype)
        with ops.implementation("pallas"):
            got = ops.permute_blocks(jnp.asarray(host), IDS, "THhD", spec.stored_layout,
                                     packed_size=spec.axis_sizes()["H"],
                                     head_dim=spec.head_dim)
        bits.assert_bits(got, numpy_rewrite(host, IDS, 1, "THhD", "THhD", spec.payload_mask()))

    def test_to_head_major_storage(self):
        # THhD -> HhTD: the mask is over the head-major block.
        shape = tpu_inference_shape(NUM_PAGES, 8, 1, 100, "float8_e4m3fn")   # 2 of 4 valid
        mask = stored_mask(shape[1:], 1, 100).transpose(1, 2, 0, 3)
        host = _host(3, shape, "float8_e4m3fn")
        cache_shape = (NUM_PAGES, shape[2], shape[3], shape[1], shape[4])
        for impl in ("reference", "pallas"):
            with ops.implementation(impl):
                got = ops.permute_blocks(jnp.asarray(host.reshape(cache_shape)), IDS, "THhD",
                                         "HhTD", packed_size=2, head_dim=100)
            bits.assert_bits(got, numpy_rewrite(host.reshape(cache_shape), IDS, 1, "THhD", "HhTD",
                                            mask), impl)

    def test_unpadded_packed_layouts_take_the_custom_calls(self):
        # No padding named: the packed pair is one axis, and the custom calls do it.
        shape = tpu_inference_shape(NUM_PAGES, 4, 2, 128, "bfloat16")
        host = _host(4, shape, "bfloat16")
        for impl in ("ffi", "pallas", "reference"):
            with ops.implementation(impl):
                got = ops.merge_blocks(jnp.asarray(host), IDS, 4, "HhTD", "THhD")
            bits.assert_bits(got, numpy_rewrite(host, IDS, 4, "HhTD", "THhD"), impl)

    def test_padding_is_refused_by_the_forced_custom_calls(self):
        host = jnp.zeros(tpu_inference_shape(NUM_PAGES, 4, 3, 64, "bfloat16"), jnp.bfloat16)
        with ops.implementation("ffi"), self.assertRaisesRegex(NotImplementedError,
                                                               "padding of a packed layout"):
            ops.permute_blocks(host, IDS, "HhTD", "THhD", packed_size=6)

    def test_packed_tokens_of_an_mla_cache(self):
        spec = KVCacheSpec.for_tpu_inference_mla(1, latent_dim=72, page_size=6,
                                                 dtype="bfloat16")   # 3 words of 2 tokens
        self.assertEqual(spec.stored_layout, "TtD")
        host = _host(5, spec.array_shape(NUM_PAGES), "bfloat16")
        mask = spec.payload_mask()
        for impl in ("reference", "pallas", "auto"):
            with ops.implementation(impl):
                got = ops.permute_blocks(jnp.asarray(host), IDS, "TtD", "TtD", packed_size=5,
                                         head_dim=72)
            phantom = mask.copy()
            phantom[2, 1] = False   # token 5 of 6 is phantom here
            bits.assert_bits(got, numpy_rewrite(host, IDS, 1, "TtD", "TtD", phantom), impl)
        with self.assertRaisesRegex(ValueError, "phantom tokens"):
            ops.merge_blocks(jnp.asarray(host), IDS, 2, "TtD", "TtD", packed_size=5)

    def test_jit_with_traced_and_out_of_range_ids(self):
        shape = tpu_inference_shape(NUM_PAGES, 4, 3, 64, "float8_e5m2")
        host = _host(6, shape, "float8_e5m2")
        ids = np.array([2, 9, -1, 0], np.int32)   # 9: out of range, skipped
        mask = stored_mask(shape[1:], 3, 64)
        for impl in ("reference", "pallas", "auto"):
            with ops.implementation(impl):
                step = jax.jit(lambda c, i: ops.merge_blocks(
                    c, i, 2, "HhTD", "THhD", packed_size=6, head_dim=64, validate_ids=False),
                    donate_argnums=0)
                got = step(jnp.asarray(host), jnp.asarray(ids))
            bits.assert_bits(got, numpy_rewrite(host, ids, 2, "HhTD", "THhD", mask), impl)

    def test_each_tp_shard_pads_its_own_heads(self):
        # Eagerly on a cache sharded over the word axis, each rank rewrites (and pads) its own
        # heads: packed_size counts one rank's combined heads.
        mesh = meshes.tp(2, explicit=True)
        local = tpu_inference_shape(NUM_PAGES, 4, 3, 64, "float8_e4m3fn")
        shape = (*local[:2], 2 * local[2], *local[3:])
        host = _host(8, shape, "float8_e4m3fn")
        mask = stored_mask(local[1:], 3, 64)
        want = np.concatenate([numpy_rewrite(np.ascontiguousarray(host[:, :, s * 2:(s + 1) * 2]),
                                             IDS, 2, "HhTD", "THhD", mask) for s in range(2)],
                              axis=2)
        for impl in ("auto", "pallas"):
            with ops.implementation(impl):
                cache = jax.device_put(host, NamedSharding(mesh, P(None, None, "tp")))
                got = ops.merge_blocks(cache, IDS, 2, "HhTD", "THhD", packed_size=6,
                                       head_dim=64)
            bits.assert_bits(got, want, impl)

    @parameterized.parameters(
        ("HhTD", "THD", "pack different axes"),
        ("hHTD", "THhD", "must follow its axis"),
        ("HhTtD", "THhtD", "more than one packed axis"),
    )
    def test_bad_layouts(self, src, dst, message):
        cache = jnp.zeros((2, 4, 2, 2, 128), jnp.bfloat16)
        with self.assertRaisesRegex(ValueError, message):
            ops.permute_blocks(cache, [0], src, dst)

    def test_bad_padding(self):
        cache = jnp.zeros((2, 4, 2, 2, 128), jnp.bfloat16)
        with self.assertRaisesRegex(ValueError, r"packed_size must be an integer in \[1, 4\]"):
            ops.permute_blocks(cache, [0], "HhTD", "THhD", packed_size=5)
        with self.assertRaisesRegex(ValueError, "head_dim must be"):
            ops.permute_blocks(cache, [0], "HhTD", "THhD", head_dim=0)
        with self.assertRaisesRegex(ValueError, "packed_size needs a packed layout"):
            ops.permute_blocks(jnp.zeros((2, 4, 4, 128)), [0], "HTD", "THD", packed_size=3)

    @parameterized.parameters("bfloat16", "float8_e4m3fn", "float32", "int8")
    def test_pallas_lowers_for_tpu(self, dtype):
        # Pallas's TPU (Mosaic) lowering of the packed rewrite, run from this CPU machine
        # (Mosaic's own compile needs a TPU): a Mosaic custom call, never the CPU one.
        from unittest import mock

        shape = tpu_inference_shape(16, 16, 3, 64, dtype)
        args = (jax.ShapeDtypeStruct(shape, dtype), jax.ShapeDtypeStruct((4,), jnp.int32))
        for fn in (lambda c, i: ops.merge_blocks(c, i, 2, "HhTD", "THhD", packed_size=6,
                                                 head_dim=64, validate_ids=False),
                   lambda c, i: ops.permute_blocks(c, i, "HhTD", "THhD", packed_size=6,
                                                   head_dim=64, validate_ids=False)):
            with ops.implementation("pallas"), mock.patch.object(jax, "default_backend",
                                                                 return_value="tpu"):
                traced = jax.jit(fn).trace(*args)
            text = traced.lower(lowering_platforms=("tpu",)).as_text()
            self.assertIn("tpu_custom_call", text)
            self.assertNotIn("jaxkv_", text)


class PhantomRowsTest(parameterized.TestCase):
    @parameterized.parameters(("THD", "H", (4, 8, 128), 6), ("HTD", "H", (8, 4, 128), 5),
                              ("TD", "T", (6, 128), 5), ("LTHD", "H", (2, 3, 4, 128), 1))
    def test_rows_are_exactly_the_phantom_ones(self, layout, axis, shape, valid):
        rows = set()
        for start, count, stride in _pallas.phantom_rows(shape, layout, axis, valid):
            rows.update(start + k * stride for k in range(count))
        index = np.indices(shape[:-1])[layout.index(axis)].reshape(-1)
        self.assertEqual(rows, set(np.flatnonzero(index >= valid).tolist()))


if __name__ == "__main__":
    absltest.main()
