"""Memory-order derivation for adopting strided (torch) KV caches, on plain shapes and strides
(`jaxkv.integrations._torch`; no torch needed): the views vLLM 0.33's KV cache layouts make."""

import itertools
import subprocess
import sys

import numpy as np
from absl.testing import absltest, parameterized

from jaxkv.integrations._torch import physical_order, plan_adoption

B, H, N, K, D, L = 10, 4, 16, 2, 8, 3


def strided(logical_shape, memory_order):
    """Strides (elements) of a view of logical `logical_shape` over a row-major buffer whose
    axes are `memory_order` (logical axis indices, outermost first)."""
    strides = [0] * len(logical_shape)
    step = 1
    for axis in reversed(memory_order):
        strides[axis] = step
        step *= logical_shape[axis]
    return tuple(strides)


class PhysicalOrderTest(parameterized.TestCase):
    def test_every_permutation_is_recovered(self):
        shape = (B, H, N, K, D)
        for order in itertools.permutations(range(5)):
            self.assertEqual(physical_order(shape, strided(shape, order)), order)

    def test_unit_axis_sorts_inside_an_axis_of_equal_stride(self):
        # [B, H, N, C] with one head, stored B N H C: N and H have the same stride
        shape = (B, 1, N, D)
        self.assertEqual(physical_order(shape, strided(shape, (0, 2, 1, 3))), (0, 2, 1, 3))

    def test_length_mismatch(self):
        with self.assertRaisesRegex(ValueError, "differ in length"):
            physical_order((2, 3), (3,))


class PlanAdoptionTest(parameterized.TestCase):
    @parameterized.named_parameters(
        # vLLM 0.33: [B, H, N, K, D] per layer, as its KVCacheLayouts store it
        ("lbnhc", "BHTKD", (0, 2, 1, 3, 4), "", "THKD"),
        ("lbhnc", "BHTKD", (0, 1, 2, 3, 4), "", "HTKD"),
        ("fused_nhd", "BHTD", (0, 2, 1, 3), "", "THD"),
        # cross-layer, the layers stacked: [L, B, H, N, D]
        ("blnhc", "LBHTD", (1, 0, 3, 2, 4), "", "LTHD"),
        ("bhlnc", "LBHTD", (1, 2, 0, 3, 4), "", "HLTD"),
        ("lbhnc_stacked", "LBHTD", (0, 1, 2, 3, 4), "L", "HTD"),
        # older backends: K/V before the blocks (FlashAttention), after them (FlashInfer)
        ("flash_attn_nhd", "KBTHD", (0, 1, 2, 3, 4), "K", "THD"),
        ("flash_attn_hnd", "KBTHD", (0, 1, 3, 2, 4), "K", "HTD"),
        ("flashinfer_hnd", "BKTHD", (0, 1, 3, 2, 4), "", "KHTD"),
        ("mla", "BTD", (0, 1, 2), "", "TD"),
    )
    def test_layouts(self, letters, memory, split, layout):
        sizes = dict(B=B, H=H, T=N, K=K, D=D, L=L)
        shape = tuple(sizes[c] for c in letters)
        plan = plan_adoption(letters, shape, strided(shape, memory))
        self.assertEqual((plan.split, plan.layout), (split, layout))
        self.assertEqual(plan.order, memory)
        # permuting by the plan gives a row-major array over the same elements
        buffer = np.arange(int(np.prod(shape)))
        view = np.lib.stride_tricks.as_strided(
            buffer, shape, [s * buffer.itemsize for s in strided(shape, memory)])
        permuted = view.transpose(plan.order)
        np.testing.assert_array_equal(permuted.reshape(-1), buffer)

    def test_unit_head_before_blocks_moves_inside(self):
        # one head stored outermost (vLLM LHBNC at one head per rank) holds no memory
        shape = (B, 1, N, D)
        plan = plan_adoption("BHTD", shape, strided(shape, (1, 0, 2, 3)))
        self.assertEqual((plan.split, plan.layout), ("", "HTD"))

    @parameterized.named_parameters(
        ("gap_between_blocks", (2 * H * N * D, N * D, D, 1), "not dense"),
        ("overlap", (H * N * D, 0, D, 1), "not dense"),
        ("padded_head_dim", (H * N * 2 * D, N * 2 * D, 2 * D, 1), "not dense"),
    )
    def test_not_dense(self, strides, message):
        with self.assertRaisesRegex(ValueError, "layer 'x': .*" + message):
            plan_adoption("BHTD", (B, H, N, D), strides, "layer 'x'")

    def test_heads_outside_blocks_refused(self):
        shape = (B, H, N, D)
        with self.assertRaisesRegex(ValueError, r"\['H'\] are stored outside the blocks"):
            plan_adoption("BHTD", shape, strided(shape, (1, 0, 2, 3)))

    def test_head_dim_not_innermost_refused(self):
        shape = (B, H, N, D)
        with self.assertRaisesRegex(ValueError, "head dim is not innermost"):
            plan_adoption("BHTD", shape, strided(shape, (0, 3, 1, 2)))

    def test_bad_letters(self):
        with self.assertRaisesRegex(ValueError, "do not fit"):
            plan_adoption("BHT", (B, H, N, D), (1, 1, 1, 1))

    def test_docstring_examples(self):
        import doctest

        import jaxkv.integrations._torch as module

        result = doctest.testmod(module, verbose=False)
        self.assertGreater(result.attempted, 0)
        self.assertEqual(result.failed, 0)

    def test_module_imports_without_torch(self):
        code = ("import sys, jaxkv.integrations._torch as t; "
                "assert 'torch' not in sys.modules; "
                "assert not t.is_torch_caches({'a': 1})")
        subprocess.run([sys.executable, "-c", code], check=True)


if __name__ == "__main__":
    absltest.main()
