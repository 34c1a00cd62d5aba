"""Tests of EngineConfig: ranks, layer splits and head ranges (docs/data-movement.md
sections 2, 4)."""

from absl.testing import absltest, parameterized

from jaxkv import EngineConfig, KVCacheSpec
from jaxkv._parallel import default_layer_split


def _spec(layers=4, heads=4, mla=False):
    if mla:
        return KVCacheSpec.for_mla(num_layers=layers, latent_dim=16, block_size=4)
    return KVCacheSpec(num_layers=layers, num_kv_heads=heads, head_dim=8, block_size=4)


class EngineConfigTest(parameterized.TestCase):
    @parameterized.parameters(
        (4, 1, (4,)), (4, 2, (2, 2)), (5, 2, (3, 2)), (10, 4, (3, 3, 2, 2)), (3, 3, (1, 1, 1)),
    )
    def test_default_layer_split(self, layers, pp, expected):
        self.assertEqual(default_layer_split(layers, pp), expected)
        self.assertEqual(EngineConfig(_spec(layers), 1, pp).layers_per_pp, expected)

    def test_ranks_and_coordinates(self):
        cfg = EngineConfig(_spec(), tp_size=2, pp_size=2)
        self.assertEqual(cfg.world_size, 4)
        for rank in range(4):
            tp_rank, pp_rank = cfg.coordinates(rank)
            self.assertEqual(cfg.rank(tp_rank, pp_rank), rank)
            self.assertEqual(rank, pp_rank * 2 + tp_rank)
        with self.assertRaisesRegex(ValueError, "outside an engine of 4 ranks"):
            cfg.coordinates(4)
        with self.assertRaisesRegex(ValueError, "outside tp_size=2"):
            cfg.rank(2, 0)

    def test_layer_ranges_and_owners(self):
        cfg = EngineConfig(_spec(layers=7), tp_size=1, pp_size=3)
        self.assertEqual([cfg.layer_range(r) for r in range(3)], [(0, 3), (3, 5), (5, 7)])
        self.assertEqual([cfg.layer_owner(l) for l in range(7)], [0, 0, 0, 1, 1, 2, 2])
        self.assertEqual(cfg.local_spec(1).num_layers, 2)
        self.assertEqual(cfg.local_block_shape(0), (3, 2, 4, 4, 8))
        custom = EngineConfig(_spec(layers=7), tp_size=1, pp_size=2, layers_per_pp=[5, 2])
        self.assertEqual(custom.layer_range(1), (5, 7))

    @parameterized.parameters(
        # heads, tp, expected head range of each TP rank
        (8, 2, [(0, 4), (4, 8)]),
        (4, 4, [(0, 1), (1, 2), (2, 3), (3, 4)]),
        (2, 4, [(0, 1), (0, 1), (1, 2), (1, 2)]),
        (1, 8, [(0, 1)] * 8),
        (2, 8, [(0, 1)] * 4 + [(1, 2)] * 4),
    )
    def test_head_ranges(self, heads, tp, expected):
        cfg = EngineConfig(_spec(heads=heads), tp_size=tp)
        self.assertEqual([cfg.head_range(r) for r in range(tp)], expected)

    def test_mla_is_replicated(self):
        cfg = EngineConfig(_spec(mla=True), tp_size=4)
        self.assertEqual({cfg.head_range(r) for r in range(4)}, {(0, 1)})
        self.assertEqual(cfg.local_block_shape(), (4, 16))

    @parameterized.named_parameters(
        ("tp_zero", dict(tp_size=0), "tp_size must be a positive integer"),
        ("pp_bool", dict(tp_size=1, pp_size=True), "pp_size must be a positive integer"),
        ("heads", dict(tp_size=3), "cannot be split evenly"),
        ("too_many_pp", dict(tp_size=1, pp_size=5), "cannot be split over 5"),
        ("split_sum", dict(tp_size=1, pp_size=2, layers_per_pp=[1, 2]), "sums to 3"),
        ("split_len", dict(tp_size=1, pp_size=2, layers_per_pp=[4]), ">= 1 layer to each of 2"),
        ("split_zero", dict(tp_size=1, pp_size=2, layers_per_pp=[4, 0]), ">= 1 layer"),
    )
    def test_invalid(self, kwargs, message):
        with self.assertRaisesRegex(ValueError, message):
            EngineConfig(_spec(), **kwargs)


if __name__ == "__main__":
    absltest.main()
