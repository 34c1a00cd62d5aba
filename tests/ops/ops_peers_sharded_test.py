"""split_for_peers / concat_from_peers on sharded caches: the block axis over a data axis
(global ids, rows in one segment per data shard), the heads over a TP axis (a tuple of mesh
axes too), replicated, and an array holding several TP ranks' heads per shard. Values are
compared bit for bit with the per-rank numpy references of `jaxkv.ops.reference`, for the
custom calls, the jnp reference and the Pallas kernels (interpret mode); the compiled HLO of
the caller's jit holds no collective."""

from support import bits, meshes, platforms

platforms.force_cpu_devices()

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxkv import EngineConfig, KVCacheSpec, ops
from jaxkv.ops import reference

COLLECTIVES = ("all-gather", "all-to-all", "collective-permute", "all-reduce", "reduce-scatter")
SPEC = KVCacheSpec(num_layers=2, num_kv_heads=4, head_dim=8, block_size=4, dtype="float32",
                   layout="LKHTD")
NUM_BLOCKS = 8
# Whole engine's array: [blocks, L, K, H, T, D] with every head of the stage.
SHAPE = (NUM_BLOCKS, 2, 2, 4, 4, 8)
PEERS = {"tp4": EngineConfig(SPEC, 4), "tp1_pp2": EngineConfig(SPEC, 1, pp_size=2),
         "tp2": EngineConfig(SPEC, 2)}
# name: (mesh shape, axis names, partition spec, this engine's TP size, peer).
CASES = {
    # tpu-inference's sharding: blocks over "data", heads over "model" (one rank per shard).
    "data_model": ((2, 4), ("data", "model"), P("data", None, None, "model"), 4, "tp1_pp2"),
    # heads over a tuple of mesh axes.
    "data_model_expert": ((2, 2, 2), ("data", "model", "expert"),
                          P("data", None, None, ("model", "expert")), 4, "tp2"),
    # the same on 4 devices (Pallas's interpret mode waits for every device of the mesh at a
    # barrier, one thread each: fewer devices keep it clear of thread starvation).
    "data_model_expert_4": ((2, 1, 2), ("data", "model", "expert"),
                            P("data", None, None, ("model", "expert")), 2, "tp4"),
    # two heads per rank, each rank's buffers hold one head: other head counts per shard.
    "data_model_tp2": ((2, 2), ("data", "model"), P("data", None, None, "model"), 2, "tp4"),
    # four ranks' heads over two shards: each shard holds two whole ranks.
    "two_ranks_per_shard": ((2, 2), ("data", "model"), P("data", None, None, "model"), 4,
                            "tp1_pp2"),
    # blocks over 4 data shards, heads unsharded: every shard holds both TP ranks' heads.
    "data_only": ((4,), ("data",), P("data"), 2, "tp4"),
    "heads_only": ((4,), ("model",), P(None, None, None, "model"), 4, "tp1_pp2"),
    "replicated": ((2, 2), ("data", "model"), P(), 1, "tp2"),
}
SPLIT_IDS = np.array([1, -1, 0, 3, 6, 4, -1, 7], np.int32)
CONCAT_IDS = np.array([2, 0, -1, 3, 5, -1, 7, 4], np.int32)


def _data_shards(sharding):
    entry = (tuple(sharding.spec) or (None,))[0]
    axes = () if entry is None else entry if isinstance(entry, tuple) else (entry,)
    return int(np.prod([sharding.mesh.shape[a] for a in axes]))


def _owned(ids, shards):
    """The data-parallel rule: row i (segment i // (n / S)) keeps its id if that shard owns
    the block, else the row is padding."""
    per, segment = NUM_BLOCKS // shards, len(ids) // shards
    return np.array([b if b >= 0 and b // per == i // segment else -1
                     for i, b in enumerate(ids)], np.int32)


def _ranks(cfg):
    return cfg.tp_size, SHAPE[3] // cfg.tp_size  # ranks in the array, heads per rank


def want_split(host, ids, me, peer, shards):
    """Each TP rank's reference split of its heads, side by side on the head axis."""
    ranks, heads = _ranks(me)
    host_bits = bits.bits(host)  # the jnp reference on unsigned views: NaN payloads kept
    parts = [reference.split_for_peers(jnp.asarray(host_bits[:, :, :, r * heads:(r + 1) * heads]),
                                       jnp.asarray(_owned(ids, shards)), me, peer, 0)
             for r in range(ranks)]
    return [np.concatenate([np.asarray(p[k]) for p in parts], axis=3)
            for k in range(len(parts[0]))]


def want_concat(host, buffers, ids, me, peer, shards):
    ranks, heads = _ranks(me)
    host_bits = bits.bits(host)
    out = []
    for r in range(ranks):
        mine = [bits.bits(b)[:, :, :, r * (b.shape[3] // ranks):
                                   (r + 1) * (b.shape[3] // ranks)] for b in buffers]
        out.append(np.asarray(reference.concat_from_peers(
            jnp.asarray(host_bits[:, :, :, r * heads:(r + 1) * heads]),
            [jnp.asarray(b) for b in mine],
            jnp.asarray(_owned(ids, shards)), me, peer, 0)))
    return np.concatenate(out, axis=3)


class ShardedPeerOpsTest(parameterized.TestCase):
    def _setup(self, name, seed=0):
        shape, names, spec, tp, peer = CASES[name]
        sharding = NamedSharding(meshes.mesh(shape, names), spec)
        me, peer_cfg = EngineConfig(SPEC, tp), PEERS[peer]
        rng = np.random.default_rng(seed)
        host = bits.random_bits(rng, SHAPE, np.float32)
        shapes = ops.plan_peers(me, peer_cfg, 0).buffer_shapes(len(CONCAT_IDS))
        buffers = [bits.random_bits(rng, (*s[:3], s[3] * tp, *s[4:]), np.float32)
                   for s in shapes]
        return sharding, me, peer_cfg, host, buffers

    def _assert(self, got, want, sharding, what):
        self.assertEqual(tuple(got.sharding.spec) + (None,) * (6 - len(got.sharding.spec)),
                         tuple(sharding.spec) + (None,) * (6 - len(sharding.spec)), what)
        np.testing.assert_array_equal(bits.bits(got), bits.bits(want),
                                      err_msg=what)

    @parameterized.parameters(*[(name, impl) for name in CASES
                                for impl in ("ffi", "reference")
                                if impl == "ffi" or name in ("data_model_expert", "data_only")])
    def test_in_jit_without_collectives(self, name, impl):
        sharding, me, peer, host, buffers = self._setup(name)
        shards = _data_shards(sharding)
        with ops.implementation(impl):
            def step(cache, target, ids, parts, targets):
                split = ops.split_for_peers(cache, ids, me, peer, 0, validate_ids=False)
                # `me` receiving from `peer`: the buffers `peer` would send to rank 0's stage.
                merged = ops.concat_from_peers(target, parts, targets, me, peer, 0,
                                               validate_ids=False)
                return split, merged

            count = ops.plan_peers(me, peer, 0).num_buffers
            compiled = jax.jit(step, donate_argnums=1,
                               out_shardings=([sharding] * count, sharding)).lower(
                jax.device_put(host, sharding), jax.device_put(host, sharding), SPLIT_IDS,
                [jax.device_put(b, sharding) for b in buffers], CONCAT_IDS).compile()
            hlo = compiled.as_text()
            self.assertEqual([c for c in COLLECTIVES if c in hlo], [], "collectives in the HLO")
            split, merged = compiled(jax.device_put(host, sharding),
                                     jax.device_put(host, sharding), SPLIT_IDS,
                                     [jax.device_put(b, sharding) for b in buffers], CONCAT_IDS)
        for k, (got, want) in enumerate(zip(split, want_split(host, SPLIT_IDS, me, peer,
                                                               shards))):
            self._assert(got, want, sharding, f"split buffer {k}")
        self._assert(merged, want_concat(host, buffers, CONCAT_IDS, me, peer, shards), sharding,
                     "concat")

    @parameterized.parameters(*[(name, impl) for name in CASES
                                for impl in ("ffi", "reference", "pallas")
                                if impl == "ffi" or name in ("data_model_expert_4", "data_only")])
    def test_eager(self, name, impl):
        sharding, me, peer, host, buffers = self._setup(name, seed=1)
        shards = _data_shards(sharding)
        ids = _owned(SPLIT_IDS, shards)  # concrete ids: every id in its shard's segment
        targets = _owned(CONCAT_IDS, shards)
        with ops.implementation(impl):
            split = ops.split_for_peers(jax.device_put(host, sharding), ids, me, peer, 0)
            merged = ops.concat_from_peers(jax.device_put(host, sharding),
                                           [jax.device_put(b, sharding) for b in buffers],
                                           targets, me, peer, 0)
        for k, (got, want) in enumerate(zip(split, want_split(host, ids, me, peer, shards))):
            self._assert(got, want, sharding, f"split buffer {k}")
        self._assert(merged, want_concat(host, buffers, targets, me, peer, shards), sharding,
                     "concat")

    def test_split_into_reused_buffers(self):
        # `out=`: staging buffers sharded like the cache, donated and written in place, in the
        # caller's jit (no collective) and eagerly.
        sharding, me, peer, host, _ = self._setup("data_model_tp2", seed=3)
        shapes = ops.plan_peers(me, peer, 0).buffer_shapes(len(SPLIT_IDS))
        staging = [jax.device_put(np.zeros((*s[:3], s[3] * 2, *s[4:]), np.float32), sharding)
                   for s in shapes]
        addresses = [[x.data.unsafe_buffer_pointer() for x in b.addressable_shards]
                     for b in staging]
        step = jax.jit(lambda c, i, o: ops.split_for_peers(c, i, me, peer, 0, out=o,
                                                           validate_ids=False),
                       donate_argnums=2)
        cache = jax.device_put(host, sharding)
        compiled = step.lower(cache, SPLIT_IDS, staging).compile()
        self.assertEqual([c for c in COLLECTIVES if c in compiled.as_text()], [])
        staging = compiled(cache, SPLIT_IDS, staging)
        for k, (got, want) in enumerate(zip(staging, want_split(host, SPLIT_IDS, me, peer, 2))):
            self._assert(got, want, sharding, f"buffer {k}")
            self.assertEqual([x.data.unsafe_buffer_pointer() for x in got.addressable_shards],
                             addresses[k])
        ids = np.array([3, 2, -1, 0, -1, -1, 5, 4], np.int32)
        again = ops.split_for_peers(cache, ids, me, peer, 0, out=staging)
        for k, (got, want) in enumerate(zip(again, want_split(host, ids, me, peer, 2))):
            self._assert(got, want, sharding, f"eager buffer {k}")
        self.assertTrue(all(b.is_deleted() for b in staging))

    def test_pallas_under_shard_map_in_jit(self):
        # Pallas's interpret mode runs without a sharding rule: inside the caller's shard_map
        # each device runs its rank's kernels, still without a collective.
        sharding, me, peer, host, _ = self._setup("data_model_tp2")
        spec = sharding.spec
        with ops.implementation("pallas"):
            count = ops.plan_peers(me, peer, 0).num_buffers
            body = jax.shard_map(
                lambda c, i: tuple(ops.split_for_peers(c, i, me, peer, 0, validate_ids=False)),
                mesh=sharding.mesh, in_specs=(spec, P("data")), out_specs=(spec,) * count,
                check_vma=False)
            # Inside shard_map the ids are the caller's: each shard's segment, local ids.
            per, segment = NUM_BLOCKS // 2, len(SPLIT_IDS) // 2
            local = np.array([b - (i // segment) * per if b >= 0 else -1
                              for i, b in enumerate(SPLIT_IDS)], np.int32)
            compiled = jax.jit(body).lower(jax.device_put(host, sharding), local).compile()
            self.assertEqual([c for c in COLLECTIVES if c in compiled.as_text()], [])
            split = compiled(jax.device_put(host, sharding), local)
        want = []
        for s in range(2):
            rows = slice(s * segment, (s + 1) * segment)
            want.append(want_split(host[s * per:(s + 1) * per], local[rows], me, peer, 1))
        for k, got in enumerate(split):
            np.testing.assert_array_equal(bits.bits(got),
                                          np.concatenate([w[k] for w in want]).view(np.uint32))

    def test_bad_ids_and_shardings_are_refused(self):
        sharding, me, peer, host, buffers = self._setup("data_model")
        cache = jax.device_put(host, sharding)
        parts = [jax.device_put(b, sharding) for b in buffers]
        with self.assertRaisesRegex(IndexError, r"block_ids\[1\] = 8 is out of range"):
            ops.split_for_peers(cache, [0, 8], me, peer, 0)
        with self.assertRaisesRegex(ValueError, "3 block_ids for a block axis split in 2"):
            ops.split_for_peers(cache, [0, 1, 2], me, peer, 0)
        with self.assertRaisesRegex(ValueError, r"block_ids\[0\] = 5 is in segment 0 but block "
                                    "5 belongs to data shard 1"):
            ops.split_for_peers(cache, [5, -1], me, peer, 0)
        with self.assertRaisesRegex(ValueError, r"block_ids\[5\] = 2 is in segment 1"):
            ops.concat_from_peers(cache, parts, [0, 1, 3, -1, 4, 2, 6, 7], me, peer, 0)
        with self.assertRaisesRegex(ValueError, "duplicate id 4"):
            ops.concat_from_peers(cache, parts, [0, 1, 2, 3, 4, 4, 6, 7], me, peer, 0)
        self.assertFalse(cache.is_deleted())
        step = jax.jit(lambda c, i: ops.split_for_peers(c, i, me, peer, 0))
        with self.assertRaisesRegex(Exception, "3 ids for a block axis split in 2 shards"):
            step.lower(cache, jnp.zeros(3, jnp.int32)).compile()
        # A shard holding part of one rank's heads, or a sharded token axis.
        finer = NamedSharding(sharding.mesh, P("data", None, None, "model"))
        tp1 = EngineConfig(SPEC, 1)
        with self.assertRaisesRegex(ValueError, r"cache blocks are \(2, 2, 1, 4, 8\) per shard"):
            ops.split_for_peers(jax.device_put(host, finer), [0, 4], tp1, peer, 0)
        with self.assertRaisesRegex(Exception, "whole units of 4"):
            jax.jit(lambda c, i: ops.split_for_peers(c, i, tp1, peer, 0)).lower(
                jax.device_put(host, finer), jnp.zeros(2, jnp.int32)).compile()
        tokens = NamedSharding(sharding.mesh, P("data", None, None, None, "model"))
        with self.assertRaisesRegex(Exception, "axis 4 of the cache is sharded.*whole tokens"):
            jax.jit(lambda c, i: ops.split_for_peers(c, i, tp1, peer, 0)).lower(
                jax.device_put(host, tokens), jnp.zeros(2, jnp.int32)).compile()

    def test_explicit_mesh(self):
        # jax.make_mesh's Explicit axes: eagerly the ops run per shard; inside jit too, as a
        # shard_map over the shardings in the types.
        _, me, peer, host, buffers = self._setup("data_model_tp2", seed=2)
        sharding = NamedSharding(jax.make_mesh((2, 2), ("data", "model")),
                                 P("data", None, None, "model"))
        ids = _owned(SPLIT_IDS, 2)
        split = ops.split_for_peers(jax.device_put(host, sharding), ids, me, peer, 0)
        for k, (got, want) in enumerate(zip(split, want_split(host, ids, me, peer, 2))):
            self._assert(got, want, sharding, f"split buffer {k}")
        targets = _owned(CONCAT_IDS, 2)
        merged = ops.concat_from_peers(jax.device_put(host, sharding),
                                       [jax.device_put(b, sharding) for b in buffers], targets,
                                       me, peer, 0)
        self._assert(merged, want_concat(host, buffers, targets, me, peer, 2), sharding, "concat")
        # inside jit: a shard_map over the types' shardings, no collective
        step = jax.jit(lambda c, i: ops.split_for_peers(c, i, me, peer, 0))
        compiled = step.lower(jax.device_put(host, sharding), ids).compile()
        self.assertEqual([c for c in COLLECTIVES if c in compiled.as_text()], [])
        split = step(jax.device_put(host, sharding), ids)
        for k, (got, want) in enumerate(zip(split, want_split(host, ids, me, peer, 2))):
            self._assert(got, want, sharding, f"jit split buffer {k}")
        concat = jax.jit(lambda c, bs, t: ops.concat_from_peers(c, bs, t, me, peer, 0))
        compiled = concat.lower(jax.device_put(host, sharding),
                                [jax.device_put(b, sharding) for b in buffers],
                                targets).compile()
        self.assertEqual([c for c in COLLECTIVES if c in compiled.as_text()], [])
        merged = concat(jax.device_put(host, sharding),
                        [jax.device_put(b, sharding) for b in buffers], targets)
        self._assert(merged, want_concat(host, buffers, targets, me, peer, 2), sharding,
                     "jit concat")

    def test_traced_ids_on_one_device(self):
        # The whole engine's array on one device (4 TP ranks side by side): padding rows are
        # zero, and a bad traced id raises from the handler.
        _, me, peer, host, _ = self._setup("data_model")
        step = jax.jit(lambda c, i: ops.split_for_peers(c, i, me, peer, 0))
        got = step(jnp.asarray(host), SPLIT_IDS)
        for k, want in enumerate(want_split(host, SPLIT_IDS, me, peer, 1)):
            np.testing.assert_array_equal(bits.bits(got[k]), want, err_msg=f"buffer {k}")
        with self.assertRaisesRegex(jax.errors.JaxRuntimeError, "out of range"):
            jax.block_until_ready(step(jnp.asarray(host), np.array([0, 9], np.int32)))

    def test_packed_layouts_are_refused(self):
        for kwargs in (dict(packing=2, packed_axis="H"), dict(head_dim_alignment=16)):
            spec = SPEC.replace(dtype="bfloat16", **kwargs)
            me = EngineConfig(spec, 1)
            cache = jnp.zeros((2, *me.local_block_shape()), jnp.bfloat16)
            with self.assertRaisesRegex(ValueError, "Packed or padded TPU layouts are not "
                                        "supported by split/concat"):
                ops.split_for_peers(cache, [0], me, EngineConfig(spec, 2), 0)
            with self.assertRaisesRegex(ValueError, "Packed or padded"):
                ops.concat_from_peers(cache, [], [0], me, EngineConfig(spec, 2), 0)


if __name__ == "__main__":
    absltest.main()
