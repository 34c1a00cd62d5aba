"""Raw ops inside the caller's own jit on a sharded cache: local per shard (no collective in
the compiled HLO), the result keeps the cache's sharding, values exact. A sharded block axis
(data parallelism): each shard handles the global ids it owns, dense rows in segments, against
a numpy model of that rule (peer split/concat: ops_peers_sharded_test.py)."""

from support import bits, meshes, numpy_ops, platforms

platforms.force_cpu_devices()

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxkv import ops
from jaxkv.ops import reference

COLLECTIVES = ("all-gather", "all-to-all", "collective-permute", "all-reduce", "reduce-scatter")
# [blocks, K, H, T, D], layout "KHTD".
SHAPE = (8, 2, 8, 4, 8)
MESHES = {"1d": ((4,), ("tp",)), "2d": ((2, 4), ("dp", "tp")), "2d_auto": ((4, 2), ("tp", "dp"))}
CASES = [
    ("1d", P(None, None, "tp")),
    ("1d", P(None, None, None, "tp")),  # tokens
    ("2d", P(None, "dp", "tp")),
    ("2d", P(None, None, ("dp", "tp"))),
    ("2d", P(None, None, "tp", None, "dp")),
    ("2d_auto", P(None, "dp", "tp")),
]


def _mesh(name):
    shape, axes = MESHES[name]
    # "_auto": a plain Mesh (Auto axes, shardings unknown while tracing); else Explicit axes
    return meshes.mesh(shape, axes, explicit=not name.endswith("_auto"))


def _spec(sharding, ndim):
    spec = tuple(sharding.spec)
    return spec + (None,) * (ndim - len(spec))


def _per_shard(host, sharding, fn):
    """`fn` applied to every shard's local piece of `host` (how a sharded cache is rewritten:
    each rank holds and post-processes its own bytes)."""
    out = np.empty_like(host)
    for index in sharding.devices_indices_map(host.shape).values():
        out[index] = np.asarray(fn(host[index]))
    return out


class ShardedInJitTest(parameterized.TestCase):
    def _check(self, fn, args, donate, expected, sharding):
        step = jax.jit(fn, donate_argnums=donate)
        compiled = step.lower(*args).compile()
        hlo = compiled.as_text()
        found = [c for c in COLLECTIVES if c in hlo]
        self.assertEqual(found, [], f"collectives in the compiled HLO: {found}")
        out = compiled(*args)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        wants = expected if isinstance(expected, (tuple, list)) else (expected,)
        for got, want in zip(outs, wants):
            self.assertEqual(_spec(got.sharding, got.ndim), _spec(sharding, got.ndim))
            np.testing.assert_array_equal(np.asarray(got).view(np.uint32),
                                          np.asarray(want).view(np.uint32))

    def _cache(self, seed, sharding):
        host = bits.random_bits(np.random.default_rng(seed), SHAPE, np.float32)
        return host, jax.device_put(host, sharding)

    @parameterized.parameters(*CASES)
    def test_block_ops(self, mesh_name, spec):
        sharding = NamedSharding(_mesh(mesh_name), spec)
        src, dst = jnp.asarray([0, 3, -1], jnp.int32), jnp.asarray([5, 6, 7], jnp.int32)
        host, cache = self._cache(0, sharding)
        self._check(lambda c, s, d: ops.copy_blocks(c, s, d), (cache, src, dst), 0,
                    numpy_ops.numpy_copy_blocks(host, [0, 3, -1], [5, 6, 7]), sharding)
        host, cache = self._cache(1, sharding)
        self._check(lambda c, i: ops.gather_blocks(c, i), (cache, src), (),
                    numpy_ops.numpy_gather_blocks(host, [0, 3, -1]), sharding)
        out = jax.device_put(np.zeros((3, *SHAPE[1:]), np.float32), sharding)
        self._check(lambda c, i, o: ops.gather_blocks(c, i, out=o), (cache, src, out), 2,
                    numpy_ops.numpy_gather_blocks(host, [0, 3, -1]), sharding)
        blocks_host = bits.random_bits(np.random.default_rng(2), (3, *SHAPE[1:]),
                                             np.float32)
        blocks = jax.device_put(blocks_host, sharding)
        host, cache = self._cache(3, sharding)
        self._check(lambda c, b, i: ops.scatter_blocks(c, b, i), (cache, blocks, dst), 0,
                    numpy_ops.numpy_scatter_blocks(host, blocks_host, [5, 6, 7]), sharding)

    @parameterized.parameters(*CASES)
    def test_eager_calls_on_the_same_shardings(self, mesh_name, spec):
        sharding = NamedSharding(_mesh(mesh_name), spec)
        host, cache = self._cache(8, sharding)
        out = ops.copy_blocks(cache, [0, 3], [5, 6])
        self.assertEqual(_spec(out.sharding, out.ndim), _spec(sharding, out.ndim))
        np.testing.assert_array_equal(np.asarray(out).view(np.uint32),
                                      numpy_ops.numpy_copy_blocks(host, [0, 3], [5, 6])
                                      .view(np.uint32))
        gathered = ops.gather_blocks(out, [6, -1])
        self.assertEqual(_spec(gathered.sharding, gathered.ndim), _spec(sharding, gathered.ndim))
        np.testing.assert_array_equal(np.asarray(gathered).view(np.uint32),
                                      numpy_ops.numpy_gather_blocks(np.asarray(out), [6, -1])
                                      .view(np.uint32))

    @parameterized.parameters(("1d", P(None, None, "tp"), 1), ("2d", P(None, "dp", "tp"), 2),
                              ("2d_auto", P(None, "dp", "tp"), 8))
    def test_eager_calls_under_a_foreign_context_mesh(self, mesh_name, spec, model):
        # A serving engine's own mesh as context (tpu-inference's runner sets ('data', 'model')
        # for its whole loop): eager ops on a cache sharded over another mesh still run on the
        # cache's mesh, exact (before: "The context mesh ... should match the mesh passed to
        # shard_map").
        sharding = NamedSharding(_mesh(mesh_name), spec)
        host, cache = self._cache(8, sharding)
        devices = np.array(jax.devices()[-model:]).reshape(1, model)
        with jax.set_mesh(jax.sharding.Mesh(devices, ("data", "model"))):
            out = ops.copy_blocks(cache, [0, 3], [5, 6])
            gathered = ops.gather_blocks(out, [6, -1])
            permuted = ops.permute_blocks(out, [5], "KHTD", "KTHD")
        want = numpy_ops.numpy_copy_blocks(host, [0, 3], [5, 6])
        self.assertEqual(_spec(permuted.sharding, permuted.ndim), _spec(sharding, out.ndim))
        np.testing.assert_array_equal(np.asarray(gathered).view(np.uint32),
                                      numpy_ops.numpy_gather_blocks(want, [6, -1])
                                      .view(np.uint32))
        want = _per_shard(want, sharding, lambda block: reference.permute_blocks(
            jnp.asarray(block), jnp.asarray([5], jnp.int32), "KHTD", "KTHD"))
        np.testing.assert_array_equal(np.asarray(permuted).view(np.uint32),
                                      want.view(np.uint32))

    @parameterized.parameters(*CASES)
    def test_permute_and_merge_rewrite_each_shard(self, mesh_name, spec):
        sharding = NamedSharding(_mesh(mesh_name), spec)
        ids = jnp.asarray([1, -1, 4], jnp.int32)
        host = np.arange(np.prod(SHAPE), dtype=np.float32).reshape(SHAPE)
        for fn in (lambda c, i: ops.permute_blocks(c, i, "KTHD", "KHTD"),
                   lambda c, i: ops.merge_blocks(c, i, 2, "KHTD", "KHTD")):
            ref = fn.__code__.co_names[-1]
            if ref == "merge_blocks" and _spec(sharding, len(SHAPE))[3] is not None:
                with self.assertRaisesRegex(Exception, "merge_blocks: axis 3 of the cache"):
                    jax.jit(fn).lower(jax.device_put(host, sharding), ids).compile()
                continue
            want = _per_shard(host, sharding, lambda block, ref=ref: getattr(reference, ref)(
                jnp.asarray(block), ids, *(("KTHD", "KHTD") if ref == "permute_blocks"
                                           else (2, "KHTD", "KHTD"))))
            self._check(fn, (jax.device_put(host, sharding), ids), 0, want, sharding)

    @parameterized.parameters(*CASES)
    def test_prefix_copies(self, mesh_name, spec):
        sharding = NamedSharding(_mesh(mesh_name), spec)
        host = np.arange(np.prod(SHAPE), dtype=np.float32).reshape(SHAPE)
        src, dst = jnp.asarray([0, 2], jnp.int32), jnp.asarray([6, 7], jnp.int32)
        if _spec(sharding, len(SHAPE))[3] is not None:  # the token axis
            cache = jax.device_put(host, sharding)
            step = jax.jit(lambda c, s, d: ops.copy_block_prefix(c, c, s, d, 3, "KHTD"))
            with self.assertRaisesRegex(Exception, "copy_block_prefix: axis 3 of the cache"):
                step.lower(cache, src, dst).compile()
            with self.assertRaisesRegex(ValueError, "copy_block_prefix: axis 3 of the cache"):
                ops.copy_block_prefix(cache, cache, src, dst, 3, "KHTD")
            return
        other = jax.device_put(host + 1000, sharding)
        cache = jax.device_put(host, sharding)
        want = reference.copy_block_prefix(jnp.asarray(host + 1000), jnp.asarray(host), src, dst,
                                           3, "KHTD")
        self._check(
            lambda a, b, s, d, n: ops.copy_block_prefix(a, b, s, d, n, "KHTD"),
            (other, cache, src, dst, jnp.int32(3)), 1, want, sharding,
        )
        cache = jax.device_put(host, sharding)
        want = reference.copy_block_prefix(jnp.asarray(host), jnp.asarray(host), src, dst, 3,
                                           "KHTD")
        self._check(lambda c, s, d: ops.copy_block_prefix(c, c, s, d, 3, "KHTD"),
                    (cache, src, dst), 0, want, sharding)

    def test_donated_sharded_cache_is_updated_in_place(self):
        sharding = NamedSharding(_mesh("2d"), P(None, "dp", "tp"))
        host, cache = self._cache(7, sharding)
        before = [s.data.unsafe_buffer_pointer() for s in cache.addressable_shards]
        step = jax.jit(lambda c, s, d: ops.copy_blocks(c, s, d), donate_argnums=0)
        out = step(cache, jnp.asarray([1], jnp.int32), jnp.asarray([2], jnp.int32))
        self.assertEqual([s.data.unsafe_buffer_pointer() for s in out.addressable_shards], before)
        np.testing.assert_array_equal(np.asarray(out), numpy_ops.numpy_copy_blocks(host, [1], [2]))

    def test_one_device_and_shard_map_still_call_the_handler_directly(self):
        host = bits.random_bits(np.random.default_rng(5), SHAPE, np.float32)
        got = jax.jit(lambda c: ops.copy_blocks(c, [1], [2]), donate_argnums=0)(jnp.asarray(host))
        np.testing.assert_array_equal(np.asarray(got), numpy_ops.numpy_copy_blocks(host, [1], [2]))
        mesh = _mesh("1d")
        spec = P(None, None, "tp")
        body = jax.shard_map(lambda c, s, d: ops.copy_blocks(c, s, d), mesh=mesh,
                             in_specs=(spec, P(), P()), out_specs=spec)
        cache = jax.device_put(host, NamedSharding(mesh, spec))
        step = jax.jit(body, donate_argnums=0)
        src, dst = jnp.asarray([1], jnp.int32), jnp.asarray([2], jnp.int32)
        self.assertNotIn("CustomSPMDPartitioning", step.lower(cache, src, dst).as_text())
        np.testing.assert_array_equal(np.asarray(step(cache, src, dst)),
                                      numpy_ops.numpy_copy_blocks(host, [1], [2]))


# Block-sharded (data-parallel) caches: (mesh shape, axis names, partition spec).
DP_CASES = [
    ((4,), ("dp",), P("dp")),
    ((2, 2), ("dp", "tp"), P("dp", None, "tp")),
    ((2, 2), ("dp", "tp"), P(("dp", "tp"))),
    ((2, 2), ("tp", "dp"), P("dp", "tp")),
]


def _shards(sharding):
    spec = _spec(sharding, len(SHAPE))[0]
    axes = spec if isinstance(spec, tuple) else (spec,)
    return int(np.prod([sharding.mesh.shape[a] for a in axes]))


def dp_copy(host, src, dst, shards):
    """The data-parallel rule: a pair is copied by the shard owning both blocks."""
    per = host.shape[0] // shards
    out = host.copy()
    for s, d in zip(src, dst):
        if 0 <= s < host.shape[0] and 0 <= d < host.shape[0] and s // per == d // per:
            out[d] = host[s]
    return out


def dp_gather(host, ids, shards):
    """Row i (in shard i // segment's segment) is its block if that shard owns it, else 0."""
    per, segment = host.shape[0] // shards, len(ids) // shards
    out = np.zeros((len(ids), *host.shape[1:]), host.dtype)
    for i, b in enumerate(ids):
        if 0 <= b < host.shape[0] and b // per == i // segment:
            out[i] = host[b]
    return out


def dp_scatter(host, blocks, ids, shards):
    per, segment = host.shape[0] // shards, len(ids) // shards
    out = host.copy()
    for i, b in enumerate(ids):
        if 0 <= b < host.shape[0] and b // per == i // segment:
            out[b] = blocks[i]
    return out


class DataParallelTest(parameterized.TestCase):
    """Ops with global ids on a cache whose block axis is sharded."""

    def _compiled(self, fn, args, donate, out_sharding):
        step = jax.jit(fn, donate_argnums=donate, out_shardings=out_sharding)
        compiled = step.lower(*args).compile()
        found = [c for c in COLLECTIVES if c in compiled.as_text()]
        self.assertEqual(found, [], f"collectives in the compiled HLO: {found}")
        return compiled(*args)

    def _assert(self, got, want, sharding, msg=""):
        self.assertEqual(_spec(got.sharding, got.ndim), _spec(sharding, got.ndim), msg)
        np.testing.assert_array_equal(np.asarray(got).view(np.uint32),
                                      np.asarray(want).view(np.uint32), err_msg=msg)

    @parameterized.parameters(*[(c, impl) for c in DP_CASES for impl in ("auto", "reference")])
    def test_ops_in_jit_route_ids_to_their_shard(self, case, impl):
        shape, names, spec = case
        sharding = NamedSharding(meshes.mesh(shape, names), spec)
        shards = _shards(sharding)
        rng = np.random.default_rng(len(names) + shards)
        host = bits.random_bits(rng, SHAPE, np.float32)
        # Global ids: pairs inside one shard, across shards, padding and out of range.
        src = np.array([0, 4, 2, -1, 9], np.int32)
        dst = np.array([1, 5, 6, 3, 7], np.int32)
        ids = np.array([1, 0, 3, 2, 5, -1, 7, 12], np.int32)
        blocks = bits.random_bits(rng, (8, *SHAPE[1:]), np.float32)
        with ops.implementation(impl):
            got = self._compiled(lambda c, s, d: ops.copy_blocks(c, s, d, validate_ids=False),
                                 (jax.device_put(host, sharding), src, dst), 0, sharding)
            self._assert(got, dp_copy(host, src, dst, shards), sharding, "copy")
            got = self._compiled(lambda c, i: ops.gather_blocks(c, i, validate_ids=False),
                                 (jax.device_put(host, sharding), ids), (), sharding)
            self._assert(got, dp_gather(host, ids, shards), sharding, "gather")
            out = jax.device_put(np.zeros((8, *SHAPE[1:]), np.float32), sharding)
            got = self._compiled(
                lambda c, i, o: ops.gather_blocks(c, i, out=o, validate_ids=False),
                (jax.device_put(host, sharding), ids, out), 2, sharding)
            self._assert(got, dp_gather(host, ids, shards), sharding, "gather into")
            for dense in (sharding, NamedSharding(sharding.mesh, P())):  # sharded or replicated
                got = self._compiled(
                    lambda c, b, i: ops.scatter_blocks(c, b, i, validate_ids=False),
                    (jax.device_put(host, sharding), jax.device_put(blocks, dense),
                     np.array([1, 0, 2, 3, 5, -1, 6, 12], np.int32)), 0, sharding)
                self._assert(got, dp_scatter(host, blocks, [1, 0, 2, 3, 5, -1, 6, 12], shards),
                             sharding, "scatter")
            if _spec(sharding, len(SHAPE))[2] is None:  # H unsharded: a whole-block rewrite
                rewrite = np.array([6, 1, -1, 3], np.int32)
                got = self._compiled(
                    lambda c, i: ops.permute_blocks(c, i, "KTHD", "KHTD", validate_ids=False),
                    (jax.device_put(host, sharding), rewrite), 0, sharding)
                self._assert(got, reference.permute_blocks(jnp.asarray(host), rewrite, "KTHD",
                                                           "KHTD"), sharding, "permute")
            got = self._compiled(
                lambda c, s, d: ops.copy_block_prefix(c, c, s, d, 3, "KHTD",
                                                      validate_ids=False),
                (jax.device_put(host, sharding), np.array([0, 5, 2], np.int32),
                 np.array([1, 4, 7], np.int32)), 0, sharding)
            per = SHAPE[0] // shards
            pairs = [(s, d) for s, d in ((0, 1), (5, 4), (2, 7)) if s // per == d // per]
            want = reference.copy_block_prefix(
                jnp.asarray(host), jnp.asarray(host), np.array([p[0] for p in pairs] or [-1]),
                np.array([p[1] for p in pairs] or [-1]), 3, "KHTD")
            self._assert(got, want, sharding, "prefix")

    @parameterized.parameters("auto", "reference", "pallas")
    def test_eager_calls(self, impl):
        sharding = NamedSharding(meshes.mesh((4,), ("dp",)), P("dp"))
        host = bits.random_bits(np.random.default_rng(3), SHAPE, np.float32)
        ids = np.array([1, 0, 3, 2, 5, -1, 7, 6], np.int32)
        with ops.implementation(impl):
            got = ops.copy_blocks(jax.device_put(host, sharding), [0, 4, 6], [1, 5, 7])
            self._assert(got, dp_copy(host, [0, 4, 6], [1, 5, 7], 4), sharding, "copy")
            got = ops.gather_blocks(jax.device_put(host, sharding), ids)
            self._assert(got, dp_gather(host, ids, 4), sharding, "gather")
            blocks = bits.random_bits(np.random.default_rng(4), (8, *SHAPE[1:]),
                                            np.float32)
            got = ops.scatter_blocks(jax.device_put(host, sharding), jnp.asarray(blocks), ids)
            self._assert(got, dp_scatter(host, blocks, ids, 4), sharding, "scatter")
            got = ops.merge_blocks(jax.device_put(host, sharding), [6, 1, -1], 2, "KHTD", "KHTD")
            self._assert(got, reference.merge_blocks(jnp.asarray(host), np.array([6, 1, -1]), 2,
                                                     "KHTD", "KHTD"), sharding, "merge")

    def test_explicit_mesh(self):
        # Explicit meshes (jax.make_mesh's default), 1-D and 2-D (blocks over "dp", heads over
        # "tp"): inside jit every op runs per shard (a shard_map over the types' shardings)
        # with no collective, for the custom calls and the jnp reference; eagerly too.
        ids = np.array([1, 0, 3, 2, 5, -1, 7, 6], np.int32)
        host = bits.random_bits(np.random.default_rng(6), SHAPE, np.float32)
        blocks = bits.random_bits(np.random.default_rng(7), (8, *SHAPE[1:]), np.float32)
        ops_and_wants = {
            "gather": (lambda c: ops.gather_blocks(c, ids, validate_ids=False),
                       dp_gather(host, ids, 4)),
            "copy": (lambda c: ops.copy_blocks(c, [0, 4, 6], [1, 5, 7], validate_ids=False),
                     dp_copy(host, [0, 4, 6], [1, 5, 7], 4)),
            "scatter": (lambda c: ops.scatter_blocks(c, jnp.asarray(blocks), ids,
                                                     validate_ids=False),
                        dp_scatter(host, blocks, ids, 4)),
        }
        for shape, names, spec in (((4,), ("dp",), P("dp")),
                                   ((4, 2), ("dp", "tp"), P("dp", None, "tp"))):
            sharding = NamedSharding(jax.make_mesh(shape, names), spec)
            for impl in ("ffi", "reference"):
                with ops.implementation(impl):
                    for name, (op, want) in ops_and_wants.items():
                        msg = f"{impl} {spec} {name}"
                        step = jax.jit(op)
                        compiled = step.lower(jax.device_put(host, sharding)).compile()
                        self.assertEqual(
                            [c for c in COLLECTIVES if c in compiled.as_text()], [], msg)
                        self._assert(step(jax.device_put(host, sharding)), want, sharding, msg)
                        self._assert(op(jax.device_put(host, sharding)), want, sharding,
                                     msg + " eagerly")

    def test_concrete_pairs_across_shards_and_uneven_segments_are_refused(self):
        sharding = NamedSharding(meshes.mesh((4,), ("dp",)), P("dp"))
        cache = jax.device_put(np.zeros(SHAPE, np.float32), sharding)
        with self.assertRaisesRegex(ValueError, r"pair 1 \(2 -> 5\) crosses data shards"):
            ops.copy_blocks(cache, [0, 2], [1, 5])
        with self.assertRaisesRegex(ValueError, "3 ids for a block axis split in 4 shards"):
            ops.gather_blocks(cache, [0, 2, 4])
        step = jax.jit(lambda c, i: ops.gather_blocks(c, i))
        with self.assertRaisesRegex(Exception, "3 ids for a block axis split in 4 shards"):
            step.lower(cache, jnp.zeros(3, jnp.int32)).compile()


if __name__ == "__main__":
    absltest.main()
