"""Tests of KVCacheSpec: validation, presets, shapes and head splitting."""

import subprocess
import sys

import ml_dtypes
import numpy as np
from absl.testing import absltest, parameterized

from jaxkv import CACHE_PRESETS, LAYOUT_PRESETS, KVCacheSpec
from jaxkv._spec import (
    SUPPORTED_DTYPES,
    canonical_dtype,
    dtype_packing,
    heads_per_rank,
    validate_layout,
)


class LayoutTest(parameterized.TestCase):
    @parameterized.parameters(*LAYOUT_PRESETS.items())
    def test_presets_resolve_to_valid_layouts(self, name, layout):
        self.assertEqual(validate_layout(name), layout)
        self.assertEqual(validate_layout(layout), layout)

    @parameterized.named_parameters(
        ("unknown_letter", "KHXD", "unknown axis letters \\['X'\\]"),
        ("repeated", "KHHTD", "repeats axis letters \\['H'\\]"),
        ("no_tokens", "KHD", "lacks the 'T' axis"),
        ("no_head_dim", "KHT", "lacks the 'D' axis"),
        ("d_not_last", "KHDT", "must end with 'D'"),
        ("empty", "", "non-empty string"),
    )
    def test_bad_layouts(self, layout, message):
        with self.assertRaisesRegex(ValueError, message):
            validate_layout(layout)


class SpecTest(parameterized.TestCase):
    def test_block_shapes_and_arrays_per_layout(self):
        base = dict(num_layers=3, num_kv_heads=8, head_dim=16, block_size=4, dtype="bf16")
        cases = {
            "LKHTD": ((3, 2, 8, 4, 16), [(None, None)]),
            "LKTHD": ((3, 2, 4, 8, 16), [(None, None)]),
            "KHTD": ((2, 8, 4, 16), [(0, None), (1, None), (2, None)]),
            "KTHD": ((2, 4, 8, 16), [(0, None), (1, None), (2, None)]),
            "HTD": ((8, 4, 16), [(l, k) for l in range(3) for k in range(2)]),
            "THD": ((4, 8, 16), [(l, k) for l in range(3) for k in range(2)]),
        }
        for layout, (shape, keys) in cases.items():
            spec = KVCacheSpec(layout=layout, **base)
            self.assertEqual(spec.block_shape(), shape, layout)
            self.assertEqual(list(spec.array_keys()), keys, layout)
            per_layer_bytes = 2 * 8 * 4 * 16 * 2
            self.assertEqual(spec.page_nbytes_per_layer(), per_layer_bytes)
            self.assertEqual(spec.page_nbytes(), 3 * per_layer_bytes)
            total = sum(int(np.prod(spec.array_shape(5))) for _ in spec.array_keys()) * 2
            self.assertEqual(total, spec.cache_nbytes(5), layout)

    def test_tensor_parallel_shapes(self):
        spec = KVCacheSpec(2, 8, 16, 4, "float32", "LKHTD")
        self.assertEqual(spec.block_shape(tp_size=4), (2, 2, 2, 4, 16))
        self.assertEqual(spec.block_shape(tp_size=16), (2, 2, 1, 4, 16))
        self.assertEqual(spec.head_replication(16), 2)
        self.assertEqual(spec.page_nbytes(tp_size=2), spec.page_nbytes() // 2)

    def test_mla(self):
        spec = KVCacheSpec.for_mla(num_layers=4, latent_dim=576, block_size=64)
        self.assertEqual((spec.kv_factor, spec.num_kv_heads, spec.mla), (1, 1, True))
        self.assertEqual(spec.block_shape(tp_size=8), (64, 576))
        self.assertEqual(spec.heads_per_rank(8), 1)
        self.assertEqual(spec.head_replication(8), 8)
        self.assertEqual(spec.array_keys(), tuple((l, 0) for l in range(4)))
        with self.assertRaisesRegex(ValueError, "MLA cache has kv_factor=1"):
            KVCacheSpec(1, 2, 8, 4, mla=True, kv_factor=1, layout="HTD")

    @parameterized.parameters(
        ((8, 1), 8), ((8, 2), 4), ((8, 8), 1), ((2, 8), 1), ((1, 4), 1), ((4, 4), 1),
    )
    def test_heads_per_rank(self, heads_tp, expected):
        self.assertEqual(heads_per_rank(*heads_tp), expected)

    def test_heads_per_rank_errors(self):
        with self.assertRaisesRegex(ValueError, "split evenly"):
            heads_per_rank(6, 4)
        with self.assertRaisesRegex(ValueError, "not a multiple"):
            heads_per_rank(3, 4)
        with self.assertRaisesRegex(ValueError, "tp_size >= 1"):
            heads_per_rank(3, 0)

    @parameterized.named_parameters(
        ("zero_layers", dict(num_layers=0), "num_layers must be a positive integer"),
        ("float_heads", dict(num_kv_heads=2.0), "num_kv_heads must be a positive integer"),
        ("bool_block", dict(block_size=True), "block_size must be a positive integer"),
        ("dtype", dict(dtype="float64"), "unsupported KV-cache dtype float64"),
        ("unknown_dtype", dict(dtype="bogus"), "unknown dtype"),
        ("kv_factor", dict(kv_factor=3), "kv_factor must be 1 or 2"),
        ("no_heads_axis", dict(layout="TD"), "has no 'H' axis but the model has 4 KV heads"),
        ("layout", dict(layout="HTDX"), "unknown axis letters"),
    )
    def test_invalid_fields(self, changes, message):
        fields = dict(num_layers=2, num_kv_heads=4, head_dim=8, block_size=4)
        fields.update(changes)
        with self.assertRaisesRegex(ValueError, message):
            KVCacheSpec(**fields)

    def test_dtypes_and_aliases(self):
        self.assertLen(SUPPORTED_DTYPES, 6)
        for alias, dtype in [("bf16", ml_dtypes.bfloat16), ("fp8", ml_dtypes.float8_e4m3fn),
                             ("fp8_e5m2", ml_dtypes.float8_e5m2), ("int8", np.int8),
                             (np.float16, np.float16), ("float32", np.float32)]:
            self.assertEqual(canonical_dtype(alias), np.dtype(dtype))

    def test_specs_are_hashable_values(self):
        a = KVCacheSpec(2, 4, 8, 4, "bf16", "flashinfer_hnd")
        b = KVCacheSpec(2, 4, 8, 4, ml_dtypes.bfloat16, "KHTD")
        self.assertEqual(a, b)
        self.assertEqual(hash(a), hash(b))
        self.assertEqual(a.replace(block_size=8).block_size, 8)


def _align(x, a):
    return -(-x // a) * a


class FrameworkCacheTest(parameterized.TestCase):
    """tpu-inference / sglang-jax caches, built from the frameworks' own shape formulas."""

    @parameterized.product(
        dtype=[d.name for d in SUPPORTED_DTYPES], heads=[1, 2, 3, 8], head_dim=[64, 100, 128],
        tp=[1, 2],
    )
    def test_tpu_inference_shapes_follow_the_formula(self, dtype, heads, head_dim, tp):
        if heads % tp:
            return
        spec = KVCacheSpec.for_tpu_inference(4, heads, head_dim, page_size=16, dtype=dtype)
        packing = 32 // (np.dtype(dtype).itemsize * 8)
        per_rank = heads // tp
        local = (16, _align(2 * per_rank, packing) // packing, packing, _align(head_dim, 128))
        self.assertEqual(spec.block_shape(tp), local)
        self.assertEqual(spec.global_block_shape(tp), (16, local[1] * tp, *local[2:]))
        self.assertEqual(spec.num_arrays, 4)  # one array per layer, K and V inside
        self.assertEqual(spec.array_keys(), tuple((layer, None) for layer in range(4)))
        # Values only: 2 * heads * tokens * head_dim; storage is the padded block.
        self.assertEqual(spec.payload_nbytes(tp), 2 * per_rank * 16 * head_dim * spec.itemsize)
        self.assertEqual(spec.block_nbytes(tp), int(np.prod(local)) * spec.itemsize)
        self.assertEqual(spec.page_nbytes_per_layer(tp), spec.block_nbytes(tp))

    def test_interleaved_heads_and_phantoms(self):
        # 3 KV heads in fp8 (packing 4): combined heads K0 V0 K1 | V1 K2 V2 [phantom, phantom].
        spec = KVCacheSpec.for_tpu_inference(1, 3, 100, page_size=2, dtype="float8_e4m3fn")
        self.assertEqual(spec.block_shape(), (2, 2, 4, 128))
        self.assertEqual(spec.block_axes(), ("T", "H", "h", "D"))
        self.assertEqual([spec.combined_head(h, kv) for h in range(3) for kv in range(2)],
                         [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1)])
        mask = spec.payload_mask()
        expected = np.zeros((2, 2, 4, 128), bool)
        expected[:, 0, :, :100] = True
        expected[:, 1, :2, :100] = True
        np.testing.assert_array_equal(mask, expected)
        # The runs cover exactly the mask's bytes, never a padding byte.
        covered = np.zeros(mask.size * spec.itemsize, bool)
        for offset, length in spec.payload_runs():
            self.assertFalse(covered[offset:offset + length].any())
            covered[offset:offset + length] = True
        np.testing.assert_array_equal(covered, np.repeat(mask.reshape(-1), spec.itemsize))
        self.assertEqual(spec.payload_nbytes(), 2 * 3 * 2 * 100)

    def test_unpadded_specs_are_one_run(self):
        spec = KVCacheSpec(2, 4, 8, 4, "bf16", "LKHTD")
        self.assertFalse(spec.padded)
        self.assertEqual(spec.payload_runs(), ((0, spec.block_nbytes()),))
        self.assertEqual(spec.block_axes(), tuple("LKHTD"))

    @parameterized.parameters("bfloat16", "float8_e4m3fn", "float32")
    def test_mla_shape_follows_the_formula(self, dtype):
        spec = KVCacheSpec.for_tpu_inference_mla(3, latent_dim=512 + 64, page_size=60,
                                                 dtype=dtype)
        packing = dtype_packing(dtype)
        self.assertEqual(spec.block_shape(), (_align(60, packing) // packing, packing, 640))
        self.assertEqual(spec.block_shape(tp_size=4), spec.block_shape())  # replicated
        self.assertEqual(spec.num_arrays, 3)
        self.assertEqual(spec.payload_nbytes(), 60 * 576 * spec.itemsize)
        wide = KVCacheSpec.for_tpu_inference_mla(1, 640, page_size=128, dtype="bfloat16",
                                                 packing=2)
        self.assertEqual(wide.block_shape(), (64, 2, 640))
        f32 = KVCacheSpec.for_tpu_inference(1, 2, 128, 16, dtype="float32")
        self.assertEqual(f32.block_shape(), (16, 4, 1, 128))  # the packing axis stays
        self.assertEqual(f32.payload_runs(), ((0, f32.block_nbytes()),))

    def test_presets_by_framework_name(self):
        self.assertEqual(set(CACHE_PRESETS), {"tpu_inference", "sglang_jax", "tpu_inference_mla"})
        a = CACHE_PRESETS["sglang_jax"](2, 8, 128, 16, "bfloat16")
        self.assertEqual(a, CACHE_PRESETS["tpu_inference"](2, 8, 128, 16, "bfloat16"))
        self.assertEqual(a.block_shape(), (16, 8, 2, 128))

    @parameterized.named_parameters(
        ("interleaved_with_k", dict(layout="KTHD", kv_interleaved=True), "kv_interleaved"),
        ("interleaved_mla", dict(layout="THD", kv_interleaved=True, kv_factor=1), "kv_factor=2"),
        ("packing_3", dict(layout="THD", packing=3), "packing must be None, 1, 2 or 4"),
        ("packing_too_wide", dict(layout="THD", packing=2, dtype="float32"), "32-bit word"),
        ("packed_axis", dict(layout="THD", packing=2, packed_axis="L"), "packed_axis"),
        ("packed_missing", dict(layout="TD", packing=2, num_kv_heads=1), "packed_axis"),
        ("alignment", dict(layout="THD", head_dim_alignment=0), "head_dim_alignment"),
    )
    def test_bad_fields(self, changes, message):
        fields = dict(num_layers=1, num_kv_heads=2, head_dim=8, block_size=4, dtype="bf16")
        with self.assertRaisesRegex(ValueError, message):
            KVCacheSpec(**{**fields, **changes})


class ImportTest(absltest.TestCase):
    def test_import_needs_neither_nixl_nor_jax_backend(self):
        code = (
            "import sys, jaxkv; from jaxkv import KVCacheSpec; KVCacheSpec(1, 1, 8, 4);"
            "assert 'nixl' not in sys.modules and 'nixl._api' not in sys.modules;"
            "assert 'jax' not in sys.modules, 'jax imported eagerly';"
            "jaxkv.PagedKVCache; assert 'jax' in sys.modules"
        )
        subprocess.run([sys.executable, "-c", code], check=True)


if __name__ == "__main__":
    absltest.main()
