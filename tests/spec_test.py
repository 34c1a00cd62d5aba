"""Tests of KVCacheSpec: validation, presets, shapes and head splitting."""

import subprocess
import sys

import ml_dtypes
import numpy as np
from absl.testing import absltest, parameterized

from jaxkv import LAYOUT_PRESETS, SUPPORTED_DTYPES, KVCacheSpec
from jaxkv._spec import canonical_dtype, heads_per_rank, validate_layout


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
