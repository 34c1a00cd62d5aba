"""permute_blocks, merge_blocks and copy_block_prefix: custom calls against jnp references and
against numpy references written from docs/data-movement.md sections 1, 3 and 5."""

from support import bits, meshes, numpy_ops, platforms

platforms.force_cpu_devices()

import doctest
import importlib
import itertools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import absltest, parameterized
from jax.sharding import PartitionSpec
from support.reshape import SIZES, numpy_merge, numpy_prefix
from support.reshape import block_shape as _shape

import jaxkv
from jaxkv import LAYOUT_PRESETS, KVCacheSpec, PagedKVCache, ops
from jaxkv._spec import SUPPORTED_DTYPES
from jaxkv.ops import reference

DTYPES = [d.name for d in SUPPORTED_DTYPES]
LAYOUTS = sorted(set(LAYOUT_PRESETS.values()))
NUM_BLOCKS = 10
IDS = np.array([7, -1, 2, 9, 0], np.int32)


def _dtype(index: int) -> str:
    return DTYPES[index % len(DTYPES)]


def _cache(seed, layout, dtype, num_blocks=NUM_BLOCKS, sizes=None):
    rng = np.random.default_rng(seed)
    host = bits.random_bits(rng, (num_blocks, *_shape(layout, sizes)), dtype)
    return host, jnp.asarray(host)


# Every ordered pair of distinct layouts with the same axes (the presets and their transposes).
_PERMUTATIONS = sorted(
    (src, dst)
    for dst in LAYOUTS
    for src in {"".join(p) for p in itertools.permutations(dst[:-1])} | {dst[:-1]}
    for src in [src + "D"]
    if src != dst
)


class WorkedExamplesTest(absltest.TestCase):
    """docs/data-movement.md section 3, literally: H=2, T=4, n=2, D=1; aT / bT = head 0 / 1 at
    token T."""

    def setUp(self):
        super().setUp()
        # a0..a3 = 0..3, b0..b3 = 10..13; received bytes [a0 a1 b0 b1 | a2 a3 b2 b3]
        self.received = np.array([0, 1, 10, 11, 2, 3, 12, 13], np.float32)

    def test_block_size_fix(self):
        cache = jnp.asarray(self.received.reshape(1, 2, 4, 1))  # receiver HTD, T=4
        out = ops.merge_blocks(cache, [0], 2, "HTD", "HTD")
        self.assertEqual(np.asarray(out).ravel().tolist(), [0, 1, 2, 3, 10, 11, 12, 13])

    def test_block_size_and_layout(self):
        cache = jnp.asarray(self.received.reshape(1, 4, 2, 1))  # receiver THD, T=4
        out = ops.merge_blocks(cache, [0], 2, "HTD", "THD")
        self.assertEqual(np.asarray(out).ravel().tolist(), [0, 10, 1, 11, 2, 12, 3, 13])

    def test_layout_only(self):
        cache = jnp.asarray(np.array([0, 1, 10, 11], np.float32).reshape(1, 2, 2, 1))
        out = ops.permute_blocks(cache, [0], "HTD", "THD")
        self.assertEqual(np.asarray(out).ravel().tolist(), [0, 10, 1, 11])

    def test_partial_copy(self):
        src = jnp.asarray(np.arange(2 * 2 * 4 * 1, dtype=np.float32).reshape(2, 2, 4, 1))
        dst = jnp.full((2, 2, 4, 1), -1.0)
        out = ops.copy_block_prefix(src, dst, [1], [0], 3, "HTD")
        self.assertEqual(np.asarray(out[0]).ravel().tolist(),
                         [8, 9, 10, -1, 12, 13, 14, -1])
        self.assertTrue(bool((out[1] == -1).all()))


class PermuteBlocksTest(parameterized.TestCase):
    @parameterized.parameters(*[(s, d, i) for i, (s, d) in enumerate(_PERMUTATIONS)])
    def test_every_layout_pair(self, src_layout, dst_layout, index):
        dtype = _dtype(index)
        host, cache = _cache(index, dst_layout, dtype)
        expected = numpy_merge(host, IDS, 1, src_layout, dst_layout)
        jnp_result = reference.permute_blocks(jnp.asarray(host), IDS, src_layout, dst_layout)
        address = cache.unsafe_buffer_pointer()
        result = ops.permute_blocks(cache, IDS, src_layout, dst_layout)
        self.assertEqual(result.unsafe_buffer_pointer(), address)
        bits.assert_bits(result, expected)
        bits.assert_same_values(jnp_result, expected)

    @parameterized.parameters(*DTYPES)
    def test_every_dtype_on_a_trtllm_cache(self, dtype):
        host, cache = _cache(1, "LKTHD", dtype)
        result = ops.permute_blocks(cache, IDS, "trtllm", "cross_layer_nhd")
        bits.assert_bits(result, numpy_merge(host, IDS, 1, "LKHTD", "LKTHD"))

    def test_presets_and_round_trip(self):
        host, cache = _cache(2, "THD", "bfloat16")
        cache = ops.permute_blocks(cache, IDS, "hnd", "vllm_flash_attn")
        # Reading the result as HTD and permuting back restores the original bytes.
        cache = ops.permute_blocks(cache.reshape(host.shape[0], *_shape("HTD")), IDS, "THD", "HTD")
        bits.assert_bits(np.asarray(cache).reshape(host.shape), host)

    def test_odd_sizes_and_one_byte_runs(self):
        # int8 with D=1: runs of one byte, 15-byte blocks; no vector width divides anything.
        sizes = {"H": 3, "T": 5, "D": 1}
        host, cache = _cache(3, "THD", "int8", sizes=sizes)
        result = ops.permute_blocks(cache, IDS, "HTD", "THD")
        bits.assert_bits(result, numpy_merge(host, IDS, 1, "HTD", "THD"))

    def test_identical_layouts_and_no_ids_change_nothing(self):
        host, cache = _cache(4, "KHTD", "float16")
        cache = ops.permute_blocks(cache, IDS, "KHTD", "flashinfer_hnd")
        cache = ops.permute_blocks(cache, np.zeros(0, np.int32), "KTHD", "KHTD")
        cache = ops.permute_blocks(cache, [-1, -3], "KTHD", "KHTD")
        bits.assert_bits(cache, host)

    def test_large_blocks_use_threads(self):
        # 128 blocks of 128 KiB: above the engine's threading threshold.
        sizes = {"L": 2, "K": 2, "H": 8, "T": 16, "D": 128}
        host, cache = _cache(5, "LKTHD", "bfloat16", num_blocks=160, sizes=sizes)
        ids = np.random.default_rng(6).permutation(160)[:128].astype(np.int32)
        result = ops.permute_blocks(cache, ids, "LKHTD", "LKTHD")
        bits.assert_bits(result, numpy_merge(host, ids, 1, "LKHTD", "LKTHD"))

    def test_inside_jit_with_donation_and_traced_ids(self):
        host, cache = _cache(7, "KTHD", "float32")
        address = cache.unsafe_buffer_pointer()
        step = jax.jit(lambda c, i: ops.permute_blocks(c, i, "KHTD", "KTHD"), donate_argnums=0)
        result = step(cache, jnp.asarray(ops.pad_block_ids([3, 5])))
        self.assertEqual(result.unsafe_buffer_pointer(), address)
        bits.assert_bits(result, numpy_merge(host, [3, 5], 1, "KHTD", "KTHD"))
        result = step(result, jnp.asarray(ops.pad_block_ids([1, 2, 4])))
        self.assertEqual(step._cache_size(), 1)

    @parameterized.named_parameters(
        ("different_axes", "LHTD", "KTHD", [1], ValueError, "different axes"),
        ("axis_count", "HTD", "KTHD", [1], ValueError, "has 3 axes; the cache blocks have 4"),
        ("unknown_letter", "KHXD", "KTHD", [1], ValueError, "unknown axis letters"),
        ("duplicate_ids", "KHTD", "KTHD", [1, 1], ValueError, "duplicate id 1 in ids"),
        ("out_of_range", "KHTD", "KTHD", [10], IndexError, "ids\\[0\\] = 10 is out of range"),
    )
    def test_bad_input_raises_and_changes_nothing(self, src, dst, ids, error, message):
        host, cache = _cache(8, "KTHD", "float32")
        with self.assertRaisesRegex(error, message):
            ops.permute_blocks(cache, ids, src, dst)
        self.assertFalse(cache.is_deleted())
        bits.assert_bits(cache, host)

    @parameterized.named_parameters(
        ("out_of_range", [3, 10], "ids\\[1\\] = 10 is out of range"),
        ("duplicate", [4, 4], "duplicate id 4 in ids"),
    )
    def test_bad_traced_ids_raise_from_the_handler(self, ids, message):
        host, cache = _cache(9, "KTHD", "float32")
        step = jax.jit(lambda c, i: ops.permute_blocks(c, i, "KHTD", "KTHD"))
        with self.assertRaisesRegex(jax.errors.JaxRuntimeError, "INVALID_ARGUMENT: " + message):
            jax.block_until_ready(step(cache, jnp.array(ids, jnp.int32)))
        bits.assert_bits(cache, host)


class MergeBlocksTest(parameterized.TestCase):
    # Every layout as the receiver's, merged from the same layout and from each of its
    # transposes, ratios 2 and 4; dtypes take turns.
    _GRID = [
        dict(src=src, dst=dst, ratio=ratio, dtype=_dtype(i))
        for i, (src, dst, ratio) in enumerate(
            (src, dst, ratio)
            for dst in LAYOUTS
            for src in sorted({"".join(p) + "D" for p in itertools.permutations(dst[:-1])})
            for ratio in (2, 4)
        )
    ]

    @parameterized.parameters(*[g for g in _GRID if g["src"] in (g["dst"], "HTD", "LKHTD", "KHTD")])
    def test_matches_references(self, src, dst, ratio, dtype):
        self._check(src, dst, ratio, dtype)

    @parameterized.parameters(
        *[g for g in _GRID if g["src"] not in (g["dst"], "HTD", "LKHTD", "KHTD")])
    @pytest.mark.slow
    def test_matches_references_every_permutation(self, src, dst, ratio, dtype):
        self._check(src, dst, ratio, dtype)

    def _check(self, src, dst, ratio, dtype):
        host, cache = _cache(zlib.crc32(f"{src}{dst}{ratio}".encode()), dst, dtype)
        expected = numpy_merge(host, IDS, ratio, src, dst)
        jnp_result = reference.merge_blocks(jnp.asarray(host), IDS, ratio, src, dst)
        address = cache.unsafe_buffer_pointer()
        result = ops.merge_blocks(cache, IDS, ratio, src, dst)
        self.assertEqual(result.unsafe_buffer_pointer(), address)
        bits.assert_bits(result, expected)
        bits.assert_same_values(jnp_result, expected)

    @parameterized.parameters(*DTYPES)
    def test_every_dtype(self, dtype):
        host, cache = _cache(11, "THD", dtype, sizes={"T": 16})
        result = ops.merge_blocks(cache, IDS, 4, "HTD", "THD")
        bits.assert_bits(result, numpy_merge(host, IDS, 4, "HTD", "THD"))

    def test_ratio_equal_to_block_size(self):
        host, cache = _cache(12, "HTD", "bfloat16")
        result = ops.merge_blocks(cache, IDS, SIZES["T"], "HTD", "HTD")
        bits.assert_bits(result, numpy_merge(host, IDS, SIZES["T"], "HTD", "HTD"))

    def test_receiver_side_id_expansion(self):
        # docs/data-movement.md section 3: a receiver block b holds remote blocks b*r .. b*r + r-1.
        # Model the transfer with numpy: sender blocks (HTD, n tokens) land back to back in receiver
        # blocks, then merge_blocks rebuilds token order.
        ratio, n = 2, 4
        rng = np.random.default_rng(13)
        sender = bits.random_bits(rng, (8, 2, n, 8), "bfloat16")  # [blocks, H, n, D]
        local_ids = np.array([1, 3], np.int32)
        mapped = (local_ids[:, None] * ratio + np.arange(ratio)).ravel()
        receiver = np.zeros((4, 2, ratio * n, 8), sender.dtype)
        for i, b in enumerate(local_ids):
            receiver[b] = sender[mapped[i * ratio:(i + 1) * ratio]].reshape(receiver[b].shape)
        result = ops.merge_blocks(jnp.asarray(receiver), local_ids, ratio, "HTD", "HTD")
        for i, b in enumerate(local_ids):
            expected = np.concatenate(list(sender[mapped[i * ratio:(i + 1) * ratio]]), axis=1)
            bits.assert_bits(result[b], expected)

    @parameterized.named_parameters(
        ("not_dividing", 3, "ratio 3 does not divide the block size 8"),
        ("zero", 0, "positive integer"),
        ("float", 2.0, "positive integer"),
    )
    def test_bad_ratio(self, ratio, message):
        _, cache = _cache(14, "HTD", "float32")
        with self.assertRaisesRegex(ValueError, message):
            ops.merge_blocks(cache, [1], ratio, "HTD", "HTD")
        self.assertFalse(cache.is_deleted())


class CopyBlockPrefixTest(parameterized.TestCase):
    @parameterized.product(layout=LAYOUTS, num_tokens=[3, 1, 7, 0, 8, -2, 100])
    def test_matches_references(self, layout, num_tokens):
        dtype = _dtype(LAYOUTS.index(layout) + num_tokens)
        src_host, src = _cache(20, layout, dtype)
        dst_host, dst = _cache(21, layout, dtype)
        src_ids, dst_ids = np.array([0, 4, -1, 9]), np.array([3, 5, 6, -1])
        expected = numpy_prefix(src_host, dst_host, src_ids, dst_ids, num_tokens, layout)
        jnp_result = reference.copy_block_prefix(src, jnp.asarray(dst_host), src_ids, dst_ids,
                                                 num_tokens, layout)
        address = dst.unsafe_buffer_pointer()
        result = ops.copy_block_prefix(src, dst, src_ids, dst_ids, num_tokens, layout)
        self.assertEqual(result.unsafe_buffer_pointer(), address)
        self.assertFalse(src.is_deleted())
        bits.assert_bits(result, expected)
        bits.assert_same_values(jnp_result, expected)

    @parameterized.parameters(*DTYPES)
    def test_within_one_cache(self, dtype):
        host, cache = _cache(22, "LKHTD", dtype)
        address = cache.unsafe_buffer_pointer()
        result = ops.copy_block_prefix(cache, cache, [1, 2], [7, 8], 5, "trtllm")
        self.assertEqual(result.unsafe_buffer_pointer(), address)
        bits.assert_bits(result, numpy_prefix(host, host, [1, 2], [7, 8], 5, "LKHTD"))

    def test_traced_token_count_does_not_recompile(self):
        src_host, src = _cache(23, "KTHD", "float16")
        dst_host, dst = _cache(24, "KTHD", "float16")
        step = jax.jit(lambda s, d, i, j, n: ops.copy_block_prefix(s, d, i, j, n, "KTHD"),
                       donate_argnums=1)
        expected = dst_host
        for n in (2, 5, 0):
            ids = jnp.array([n, n + 1], jnp.int32)
            dst = step(src, dst, ids, ids + 3, jnp.int32(n))
            expected = numpy_prefix(src_host, expected, [n, n + 1], [n + 3, n + 4], n, "KTHD")
            bits.assert_bits(dst, expected)
        self.assertEqual(step._cache_size(), 1)

    def test_bad_input(self):
        _, src = _cache(25, "HTD", "float32")
        host, dst = _cache(26, "HTD", "float32")
        cases = [
            (src, [1], [2], 2, "THD D", ValueError, "unknown axis letters"),
            (src.astype(jnp.bfloat16), [1], [2], 2, "HTD", ValueError, "differ from"),
            (src, [1, 2], [2], 2, "HTD", ValueError, "same length"),
            (src, [1], [10], 2, "HTD", IndexError, "dst_ids\\[0\\] = 10 is out of range"),
            (src, [1, 2], [3, 3], 2, "HTD", ValueError, "duplicate id 3 in dst_ids"),
            (src, [1], [2], 2.5, "HTD", TypeError, "num_tokens must be an integer"),
            (dst, [1], [1], 2, "HTD", ValueError, "block 1 is both in src_ids and in dst_ids"),
        ]
        for source, src_ids, dst_ids, n, layout, error, message in cases:
            with self.assertRaisesRegex(error, message):
                ops.copy_block_prefix(source, dst, src_ids, dst_ids, n, layout)
        self.assertFalse(dst.is_deleted())
        bits.assert_bits(dst, host)
        step = jax.jit(lambda s, d, i, j: ops.copy_block_prefix(s, d, i, j, 1, "HTD"))
        with self.assertRaisesRegex(jax.errors.JaxRuntimeError, "src_ids\\[0\\] = 99"):
            jax.block_until_ready(step(src, dst, jnp.array([99]), jnp.array([0])))
        bits.assert_bits(dst, host)


class LargeRequestTest(parameterized.TestCase):
    """Requests of >= 16 MiB take the CPU engine's streaming-store path (and its fallback when
    a run is not 16-byte aligned)."""

    @parameterized.parameters(("bfloat16", 128, 5), ("int8", 3, 7))
    def test_streaming_copies(self, dtype, head_dim, num_tokens):
        sizes = {"L": 4, "K": 2, "H": 8, "T": 16, "D": head_dim}
        block = int(np.prod(_shape("LKHTD", sizes))) * np.dtype(dtype).itemsize
        count = max(8, (40 << 20) // block)
        src_host, src = _cache(40, "LKHTD", dtype, num_blocks=count, sizes=sizes)
        dst_host, dst = _cache(41, "LKHTD", dtype, num_blocks=count, sizes=sizes)
        ids = np.random.default_rng(42).permutation(count).astype(np.int32)
        ids[::7] = -1
        result = ops.copy_block_prefix(src, dst, ids, ids[::-1].copy(), num_tokens, "LKHTD")
        bits.assert_bits(result, numpy_prefix(src_host, dst_host, ids, ids[::-1], num_tokens,
                                          "LKHTD"))
        half = count // 2
        copy_src = np.arange(half, dtype=np.int32)
        copy_dst = (half + np.random.default_rng(43).permutation(half)).astype(np.int32)
        result = ops.copy_blocks(result, copy_src, copy_dst)
        expected = numpy_ops.numpy_copy_blocks(
            numpy_prefix(src_host, dst_host, ids, ids[::-1], num_tokens, "LKHTD"),
            copy_src, copy_dst)
        bits.assert_bits(result, expected)

    def test_streaming_split_and_concat(self):
        spec = KVCacheSpec(num_layers=4, num_kv_heads=8, head_dim=128, block_size=16,
                           dtype="float16")
        one, two = jaxkv.EngineConfig(spec, 1), jaxkv.EngineConfig(spec, 2)
        host, cache = _cache(44, "LKHTD", "float16", num_blocks=96,
                             sizes={"L": 4, "K": 2, "H": 8, "T": 16, "D": 128})
        ids = np.random.default_rng(45).permutation(96)[:80].astype(np.int32)
        buffers = ops.split_for_peers(cache, ids, one, two, 0)
        bits.assert_bits(buffers[0], host[ids][:, :, :, :4])
        bits.assert_bits(buffers[1], host[ids][:, :, :, 4:])
        target = jnp.zeros_like(cache)
        rebuilt = ops.concat_from_peers(target, buffers, ids[::-1].copy(), one, two, 0)
        expected = np.zeros_like(host)
        expected[ids[::-1]] = host[ids]
        bits.assert_bits(rebuilt, expected)


class ShardedTest(parameterized.TestCase):
    """A head-sharded cache: each device rewrites its own shard's bytes."""

    def _sharded(self, seed, layout, heads, tp, dtype="bfloat16"):
        spec = KVCacheSpec(num_layers=2, num_kv_heads=heads, head_dim=8, block_size=8,
                           dtype=dtype, layout=layout)
        mesh = meshes.tp(tp, explicit=True)
        rng = np.random.default_rng(seed)
        hosts = [bits.random_bits(rng, spec.array_shape(NUM_BLOCKS), spec.dtype)
                 for _ in range(spec.num_arrays)]
        cache = PagedKVCache.from_arrays(spec, hosts, mesh=mesh)
        return spec, hosts[0], cache.arrays[0]

    @parameterized.parameters((4, 4), (2, 8), (8, 2))
    def test_permute_and_merge_per_shard(self, heads, tp):
        spec, host, array = self._sharded(30, "KTHD", heads, tp)
        address = [s.data.unsafe_buffer_pointer() for s in array.addressable_shards]
        result = ops.merge_blocks(array, IDS, 2, "KHTD", "KTHD")
        self.assertEqual([s.data.unsafe_buffer_pointer() for s in result.addressable_shards],
                         address)
        self.assertEqual(result.sharding, array.sharding)
        h_axis = 1 + "KTHD".index("H")
        per_rank = spec.heads_per_rank(tp)
        for shard in result.addressable_shards:
            heads_slice = shard.index[h_axis]
            local = host[(slice(None),) * h_axis + (heads_slice,)]
            self.assertEqual(local.shape[h_axis], per_rank)
            bits.assert_bits(shard.data, numpy_merge(local, IDS, 2, "KHTD", "KTHD"))

    def test_prefix_between_sharded_caches_and_inside_shard_map(self):
        spec, src_host, src = self._sharded(31, "LKHTD", 4, 4)
        _, dst_host, dst = self._sharded(32, "LKHTD", 4, 4)
        result = ops.copy_block_prefix(src, dst, [1, 2], [3, 4], 5, "LKHTD")
        expected = numpy_prefix(src_host, dst_host, [1, 2], [3, 4], 5, "LKHTD")
        bits.assert_bits(result, expected)
        # The same op inside the caller's shard_map + jit with traced ids.
        mesh = src.sharding.mesh
        pspec = src.sharding.spec
        local = jax.shard_map(
            lambda s, d, i, j: ops.copy_block_prefix(s, d, i, j, 2, "LKHTD"), mesh=mesh,
            in_specs=(pspec, pspec, PartitionSpec(), PartitionSpec()), out_specs=pspec,
            check_vma=False)
        again = jax.jit(local, donate_argnums=1)(src, result, jnp.array([5]), jnp.array([6]))
        bits.assert_bits(again, numpy_prefix(src_host, expected, [5], [6], 2, "LKHTD"))

    def test_replicated_mla_cache(self):
        spec = KVCacheSpec.for_mla(num_layers=2, latent_dim=16, block_size=8, dtype="float8_e5m2")
        mesh = meshes.tp(4, explicit=True)
        rng = np.random.default_rng(33)
        hosts = [bits.random_bits(rng, spec.array_shape(NUM_BLOCKS), spec.dtype)
                 for _ in range(spec.num_arrays)]
        cache = PagedKVCache.from_arrays(spec, hosts, mesh=mesh)
        result = ops.merge_blocks(cache.arrays[0], IDS, 4, "TD", "TD")
        expected = numpy_merge(hosts[0], IDS, 4, "TD", "TD")
        for shard in result.addressable_shards:
            bits.assert_bits(shard.data, expected)


class DocstringTest(parameterized.TestCase):
    @parameterized.parameters("jaxkv.ops._reshape_ops", "jaxkv.ops._peer_ops",
                              "jaxkv.ops.reference", "jaxkv._parallel")
    def test_examples(self, module_name):
        module = importlib.import_module(module_name)
        globs = {"jax": jax, "jnp": jnp, "np": np, "KVCacheSpec": KVCacheSpec,
                 "EngineConfig": jaxkv.EngineConfig}
        result = doctest.testmod(module, extraglobs=globs, verbose=False)
        self.assertGreater(result.attempted, 0)
        self.assertEqual(result.failed, 0)


if __name__ == "__main__":
    absltest.main()
