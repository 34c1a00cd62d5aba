"""split_for_peers / concat_from_peers and plan_peers (docs/data-movement.md sections 2 and 4).

Checked three ways: the plan against an independent re-derivation of TensorRT-LLM's
targetIRanks written from docs/data-movement.md; the custom calls against numpy references of the
split and concat formulas and against the jnp reference; and round trips split -> route -> concat
over every sender/receiver pair of engines, which must rebuild each receiver's slice of a global
cache (layers of its PP rank, heads of its TP rank, computed here from section 2) exactly.
"""

from support import bits, meshes, platforms

platforms.force_cpu_devices()

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import absltest, parameterized
from support.reshape import (
    DST_IDS,
    DTYPES,
    FAST,
    GRID,
    NUM_BLOCKS,
    SRC_IDS,
    Case,
    numpy_concat,
    numpy_split,
    round_trip,
    target_info,
)

from jaxkv import EngineConfig, KVCacheSpec, PagedKVCache, ops
from jaxkv.ops import reference

# ---------------------------------------------------------------------------------------------


class PlanTest(parameterized.TestCase):
    def test_worked_example_tp2_to_tp1_pp2(self):
        # docs/data-movement.md: sender TP=2 PP=1 -> receiver TP=1 PP=2, L=4, H=4, B=2.
        spec = KVCacheSpec(num_layers=4, num_kv_heads=4, head_dim=8, block_size=4)
        sender, receiver = EngineConfig(spec, 2), EngineConfig(spec, 1, pp_size=2)
        for s in range(2):
            plan = ops.plan_peers(sender, receiver, s)
            self.assertEqual(plan.target_ranks, (0, 1))
            self.assertEqual(plan.connection_buffers, (0, 1))  # buffer k -> receiver k
            self.assertEqual(plan.buffer_shapes(2), ((2, 2, 2, 2, 4, 8),) * 2)
            self.assertTrue(plan.sends)
        for g in range(2):
            plan = ops.plan_peers(receiver, sender, g)
            self.assertEqual(plan.kept_ranks, (0, 1))
            self.assertEqual(plan.buffer_heads, ((0, 2), (2, 4)))

    def test_worked_example_tp1_to_tp8(self):
        spec = KVCacheSpec(num_layers=2, num_kv_heads=4, head_dim=8, block_size=4)
        plan = ops.plan_peers(EngineConfig(spec, 1), EngineConfig(spec, 8), 0)
        self.assertEqual((plan.peer_dup, plan.num_buffers, plan.heads_per_buffer), (2, 4, 1))
        self.assertEqual(plan.connection_buffers, (0, 0, 1, 1, 2, 2, 3, 3))
        for r in range(8):  # each receiver keeps its one sender
            self.assertEqual(ops.plan_peers(EngineConfig(spec, 8), EngineConfig(spec, 1), r)
                             .kept_ranks, (0,))

    def test_mla_one_identical_buffer_per_peer_pp_rank(self):
        spec = KVCacheSpec.for_mla(num_layers=4, latent_dim=8, block_size=4, layout="LKHTD")
        plan = ops.plan_peers(EngineConfig(spec, 1), EngineConfig(spec, 4, pp_size=2), 0)
        self.assertEqual(plan.num_buffers, 2)
        self.assertEqual(plan.target_ranks, (0, 4, 1, 5, 2, 6, 3, 7))
        self.assertEqual(plan.connection_buffers, (0, 1) * 4)  # every TP rank gets its PP's
        # Senders with replicated MLA: only the first of each group sends.
        sends = [ops.plan_peers(EngineConfig(spec, 4), EngineConfig(spec, 1), r).sends
                 for r in range(4)]
        self.assertEqual(sends, [True, False, False, False])

    @parameterized.named_parameters(*[(c.name, c) for c in GRID])
    def test_matches_independent_derivation(self, case):
        sender, receiver = case.configs()
        for cfg_self, cfg_peer, sender_side in ((sender, receiver, True),
                                                (receiver, sender, False)):
            for rank in range(cfg_self.world_size):
                plan = ops.plan_peers(cfg_self, cfg_peer, rank)
                info = target_info(case, rank, sender_side)
                self.assertEqual(list(plan.target_ranks), info["iranks"])
                self.assertEqual(list(plan.peer_layers), info["peer_layers"])
                self.assertEqual((plan.dup, plan.peer_dup, plan.num_buffers,
                                  plan.heads_per_buffer, plan.sends),
                                 (info["dup"], info["peer_dup"], info["n_out"], info["hn"],
                                  info["sends"]))
                self.assertEqual(list(plan.connection_buffers), info["connection_buffer"])
                self.assertEqual(list(plan.kept_connections), info["kept"])

    @parameterized.named_parameters(
        ("head_dim", dict(head_dim=8), dict(head_dim=16), 1, 2, "head_dim 8 vs 16"),
        ("block_size", dict(block_size=4), dict(block_size=8), 1, 1, "block_size 4 vs 8"),
        ("dtype", dict(dtype="bfloat16"), dict(dtype="float16"), 2, 1, "dtype"),
        ("tp_not_power_of_two", dict(num_kv_heads=6), dict(num_kv_heads=6), 3, 6,
         "powers of two"),
    )
    def test_incompatible_engines(self, self_changes, peer_changes, self_tp, peer_tp, message):
        base = dict(num_layers=4, num_kv_heads=4, head_dim=8, block_size=4)
        self_cfg = EngineConfig(KVCacheSpec(**{**base, **self_changes}), self_tp)
        peer_cfg = EngineConfig(KVCacheSpec(**{**base, **peer_changes}), peer_tp)
        with self.assertRaisesRegex(ValueError, message):
            ops.plan_peers(self_cfg, peer_cfg, 0)

    def test_equal_tp_sizes_need_not_be_powers_of_two(self):
        spec = KVCacheSpec(num_layers=6, num_kv_heads=6, head_dim=8, block_size=4)
        plan = ops.plan_peers(EngineConfig(spec, 3), EngineConfig(spec, 3, pp_size=2), 1)
        self.assertEqual(plan.target_ranks, (1, 4))
        with self.assertRaisesRegex(ValueError, "outside an engine of 3 ranks"):
            ops.plan_peers(EngineConfig(spec, 3), EngineConfig(spec, 3), 3)


class NumpyRoundTripTest(parameterized.TestCase):
    """The plan routes the buffers of the section-4 formulas to the right receivers: numpy
    only, so the whole grid runs fast."""

    @parameterized.named_parameters(*[(c.name, c) for c in GRID])
    def test_round_trip(self, case):
        def split(local, sender, receiver, s):
            return numpy_split(local, SRC_IDS, target_info(case, s, True))

        def concat(initial, buffers, receiver, sender, r):
            return numpy_concat(initial, buffers, DST_IDS, target_info(case, r, False))

        for r, (result, expected) in round_trip(case, split, concat).items():
            bits.assert_bits(result, expected, f"receiver {r}")


class CustomCallRoundTripTest(parameterized.TestCase):
    def _run(self, case):
        def check_split(local, buffers, s):
            expected = numpy_split(local, SRC_IDS, target_info(case, s, True))
            self.assertLen(buffers, len(expected))
            sender, receiver = case.configs()
            jnp_buffers = reference.split_for_peers(jnp.asarray(local), SRC_IDS, sender,
                                                    receiver, s)
            for got, want, ref in zip(buffers, expected, jnp_buffers):
                bits.assert_bits(got, want, f"sender {s}")
                bits.assert_same_values(ref, want)

        def split(local, sender, receiver, s):
            return [np.asarray(b) for b in
                    ops.split_for_peers(jnp.asarray(local), SRC_IDS, sender, receiver, s)]

        def concat(initial, buffers, receiver, sender, r):
            cache = jnp.asarray(initial)
            address = cache.unsafe_buffer_pointer()
            out = ops.concat_from_peers(cache, [jnp.asarray(b) for b in buffers], DST_IDS,
                                        receiver, sender, r)
            self.assertEqual(out.unsafe_buffer_pointer(), address)
            jnp_out = reference.concat_from_peers(jnp.asarray(initial), buffers, DST_IDS,
                                                  receiver, sender, r)
            bits.assert_same_values(jnp_out, out)
            return out

        for r, (result, expected) in round_trip(case, split, concat, check_split).items():
            bits.assert_bits(result, expected, f"receiver {r}")

    @parameterized.named_parameters(*[(c.name, c) for c in GRID if c.name in FAST])
    def test_round_trip(self, case):
        self._run(case)

    @parameterized.named_parameters(*[(c.name, c) for c in GRID if c.name not in FAST])
    @pytest.mark.slow
    def test_round_trip_full_grid(self, case):
        self._run(case)

    @parameterized.parameters(*DTYPES)
    def test_every_dtype(self, dtype):
        self._run(Case("dtypes", 2, 4, heads=8, self_pp=2, peer_pp=1, layers=5, dtype=dtype))


class SplitConcatApiTest(parameterized.TestCase):
    def setUp(self):
        super().setUp()
        self.spec = KVCacheSpec(num_layers=4, num_kv_heads=4, head_dim=8, block_size=4,
                                dtype="float32")
        self.sender = EngineConfig(self.spec, 2)
        self.receiver = EngineConfig(self.spec, 1, pp_size=2)
        rng = np.random.default_rng(7)
        self.host = bits.random_bits(rng, (8, 4, 2, 2, 4, 8), np.float32)

    def test_split_into_reused_buffers_inside_jit(self):
        plan = ops.plan_peers(self.sender, self.receiver, 0)
        staging = [jnp.zeros(s, jnp.float32) for s in plan.buffer_shapes(4)]
        addresses = [b.unsafe_buffer_pointer() for b in staging]
        step = jax.jit(lambda c, i, o: ops.split_for_peers(c, i, self.sender, self.receiver, 0,
                                                           out=o), donate_argnums=2)
        cache = jnp.asarray(self.host)
        for ids in ([1, 2, 3, -1], [0, -1, 7, 7]):
            staging = step(cache, jnp.asarray(ids, jnp.int32), staging)
            self.assertEqual([b.unsafe_buffer_pointer() for b in staging], addresses)
            info = target_info(Case("x", 2, 1, peer_pp=2), 0, True)
            for got, want in zip(staging, numpy_split(self.host, ids, info)):
                bits.assert_bits(got, want)
        # Eagerly, the out buffers are donated too.
        again = ops.split_for_peers(cache, [5, 6, 0, 1], self.sender, self.receiver, 0,
                                    out=staging)
        self.assertEqual([b.unsafe_buffer_pointer() for b in again], addresses)
        self.assertTrue(all(b.is_deleted() for b in staging))

    def test_concat_inside_jit_with_donation(self):
        buffers = [jnp.ones((2, 2, 2, 2, 4, 8), jnp.float32),
                   jnp.full((2, 2, 2, 2, 4, 8), 2.0, jnp.float32)]
        cache = jnp.zeros((8, 2, 2, 4, 4, 8), jnp.float32)
        address = cache.unsafe_buffer_pointer()
        step = jax.jit(lambda c, b, i: ops.concat_from_peers(c, b, i, self.receiver, self.sender,
                                                             1), donate_argnums=0)
        out = step(cache, buffers, jnp.array([3, -1], jnp.int32))
        self.assertEqual(out.unsafe_buffer_pointer(), address)
        self.assertEqual(np.asarray(out[3, :, :, :2]).min(), 1.0)
        self.assertEqual(np.asarray(out[3, :, :, 2:]).max(), 2.0)
        self.assertEqual(float(jnp.abs(out).sum()), float(jnp.abs(out[3]).sum()))

    def test_bad_input(self):
        cache = jnp.asarray(self.host)
        good = [jnp.zeros((2, 2, 2, 2, 4, 8), jnp.float32)] * 2
        receiver_cache = jnp.zeros((8, 2, 2, 4, 4, 8), jnp.float32)
        nhd = EngineConfig(self.spec.replace(layout="LKTHD"), 2)
        cases = [
            (lambda: ops.split_for_peers(cache, [1], nhd, self.receiver, 0), ValueError,
             "cross-layer LKHTD"),
            (lambda: ops.split_for_peers(cache[:, :2], [1], self.sender, self.receiver, 0),
             ValueError, "holds blocks of \\(4, 2, 2, 4, 8\\)"),
            (lambda: ops.split_for_peers(cache.astype(jnp.bfloat16), [1], self.sender,
                                         self.receiver, 0), ValueError, "dtype"),
            (lambda: ops.split_for_peers(cache, [8], self.sender, self.receiver, 0), IndexError,
             "block_ids\\[0\\] = 8 is out of range"),
            (lambda: ops.split_for_peers(cache, [1], self.sender, self.receiver, 2), ValueError,
             "outside an engine of 2 ranks"),
            (lambda: ops.split_for_peers(cache, [1, 2], self.sender, self.receiver, 0,
                                         out=good[:1]),
             ValueError, "out has 1 buffers; the plan has 2"),
            (lambda: ops.split_for_peers(cache, [1], self.sender, self.receiver, 0, out=good),
             ValueError, "out\\[0\\] has shape"),
            (lambda: ops.split_for_peers(cache, [1], self.sender, "tp2", 0), TypeError,
             "EngineConfig"),
            (lambda: ops.concat_from_peers(receiver_cache, good[:1], [1, 2], self.receiver,
                                           self.sender, 0), ValueError,
             "got 1 buffers; rank 0 keeps 2 \\(from peer ranks \\[0, 1\\]\\)"),
            (lambda: ops.concat_from_peers(receiver_cache, good, [1], self.receiver, self.sender,
                                           0), ValueError, "buffers\\[0\\] has shape"),
            (lambda: ops.concat_from_peers(receiver_cache, good, [1, 1], self.receiver,
                                           self.sender, 0), ValueError, "duplicate id 1"),
            (lambda: ops.concat_from_peers(receiver_cache, good, [1, 9], self.receiver,
                                           self.sender, 0), IndexError, "out of range"),
        ]
        for call, error, message in cases:
            with self.assertRaisesRegex(error, message):
                call()
        self.assertFalse(cache.is_deleted() or receiver_cache.is_deleted())
        step = jax.jit(lambda c, b, i: ops.concat_from_peers(c, b, i, self.receiver, self.sender,
                                                             0))
        with self.assertRaisesRegex(jax.errors.JaxRuntimeError, "ids\\[1\\] = 8 is out of range"):
            jax.block_until_ready(step(receiver_cache, good, jnp.array([0, 8], jnp.int32)))
        self.assertFalse(np.any(np.asarray(receiver_cache)))


class ShardedTest(absltest.TestCase):
    """A head-sharded cache of a whole TP engine on 4 CPU devices: each device is one rank."""

    def test_split_and_concat_per_shard(self):
        spec = KVCacheSpec(num_layers=2, num_kv_heads=4, head_dim=8, block_size=4,
                           dtype="bfloat16")
        sender, receiver = EngineConfig(spec, 4), EngineConfig(spec, 2)
        mesh = meshes.tp(4, explicit=True)
        g = bits.random_bits(np.random.default_rng(8), spec.array_shape(NUM_BLOCKS),
                                   spec.dtype)
        cache = PagedKVCache.from_arrays(spec, [g], mesh=mesh).arrays[0]
        buffers = ops.split_for_peers(cache, SRC_IDS, sender, receiver, rank=0)
        self.assertLen(buffers, 1)
        self.assertEqual(buffers[0].sharding, cache.sharding)
        for shard in buffers[0].addressable_shards:
            rank = list(mesh.devices.flat).index(shard.device)
            info = target_info(Case("x", 4, 2, layers=2), rank, True)
            local = g[:, :, :, rank:rank + 1]
            bits.assert_bits(shard.data, numpy_split(local, SRC_IDS, info)[0])
        # The same buffers, concatenated into a sharded cache of an engine with the same TP
        # (each receiver rank keeps exactly its own sender).
        target = PagedKVCache.allocate(spec, NUM_BLOCKS, mesh=mesh).arrays[0]
        out = ops.concat_from_peers(target, buffers, DST_IDS, sender, sender, rank=0)
        expected = np.zeros_like(g)
        for s_id, d_id in zip(SRC_IDS, DST_IDS):
            if d_id >= 0 and s_id >= 0:
                expected[d_id] = g[s_id]
        bits.assert_bits(out, expected)

    def test_replicated_heads_inside_shard_map(self):
        # TP=8 over 2 heads: each head lives on 4 devices; split toward TP=1 under the
        # caller's shard_map and jit with traced ids.
        spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4,
                           dtype="float8_e5m2")
        sender, receiver = EngineConfig(spec, 8), EngineConfig(spec, 1)
        mesh = meshes.tp(8, explicit=True)
        g = bits.random_bits(np.random.default_rng(9), spec.array_shape(NUM_BLOCKS),
                                   spec.dtype)
        cache = PagedKVCache.from_arrays(spec, [g], mesh=mesh).arrays[0]
        pspec = cache.sharding.spec
        fn = jax.shard_map(lambda c, i: tuple(ops.split_for_peers(c, i, sender, receiver, 0)),
                           mesh=cache.sharding.mesh, in_specs=(pspec, jax.sharding.PartitionSpec()),
                           out_specs=(pspec,), check_vma=False)
        (buffer,) = jax.jit(fn)(cache, jnp.asarray(SRC_IDS))
        info = target_info(Case("x", 8, 1, heads=2, layers=2), 0, True)
        expected = np.concatenate([numpy_split(g[:, :, :, h:h + 1], SRC_IDS, info)[0]
                                   for h in range(2)], axis=3)
        bits.assert_bits(buffer, expected)


if __name__ == "__main__":
    absltest.main()
