"""OffloadManager with the block manager: evicted blocks are offloaded instead of dropped, a
prefix lookup consults device, then host, then disk and reports each block's tier, and a hit
comes back bit-exact; bad input raises clear errors; the package's API and examples."""

from support import bits, platforms

platforms.force_cpu_devices()

import doctest
import importlib
import logging

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
from support import offload as ot  # noqa: E402

import jaxkv
from jaxkv import offload
from jaxkv.blocks import KVCacheManager
from jaxkv.blocks._pool import BlockPool
from jaxkv.offload import FileTier, HostPool, OffloadManager
from jaxkv.offload._types import HostPoolFullError, UnknownSlotError

_SPEC = ot.spec_for("THD", "float32")


def _write_blocks(cache, block_ids, seed):
    """Pretends a compute step wrote new KV into `block_ids`; returns the cache and the data."""
    rng = np.random.default_rng(seed)
    dense = [bits.random_bits(rng, (len(block_ids), *a.shape[1:]), a.dtype)
             for a in cache.arrays]
    return cache.scatter_blocks([jnp.asarray(d) for d in dense], block_ids), dense


class BlockManagerIntegrationTest(parameterized.TestCase):

    def test_evicted_blocks_come_back_from_host_and_disk(self):
        block_size = _SPEC.block_size
        cache, _ = ot.filled_cache(_SPEC, 6, seed=0)
        tier = FileTier(self.create_tempdir().full_path, spec=_SPEC, model_id="m",
                        capacity_bytes=1 << 20, backend="files")
        offloader = OffloadManager(cache, 2, file_tier=tier)
        manager = KVCacheManager(num_blocks=6, block_size=block_size)
        manager.set_eviction_hook(offloader.on_evict)

        prompt_a = list(range(100, 117))                       # 4 full blocks + 1 token
        manager.add_request("a", prompt_a)
        blocks_a = manager.allocate_slots("a", 17).new_block_ids[0]
        cache, kv_a = _write_blocks(cache, blocks_a, seed=1)
        manager.free("a")

        manager.add_request("b", list(range(500, 517)))
        blocks_b = manager.allocate_slots("b", 17).new_block_ids[0]   # evicts a's blocks
        self.assertEqual(offloader.num_pending_evictions, 4)
        self.assertEqual(offloader.flush_evictions(cache), 4)         # before b's compute
        cache, _ = _write_blocks(cache, blocks_b, seed=2)             # overwrites a's bytes
        manager.free("b")

        manager.add_request("c", prompt_a)
        hit = manager.get_computed_blocks_tiered("c", offloader.lower_tiers())
        # 2 host slots: the 2 most recently evicted blocks of a are on the host, all on disk.
        self.assertEqual(hit.num_hit_tokens, 16)
        self.assertEqual(hit.num_device_blocks, 0)
        self.assertCountEqual(hit.tiers, ("host", "host", "disk", "disk"))
        self.assertEqual(hit.tiers, tuple(
            "host" if offloader.host_slot_of(h) is not None else "disk"
            for h in hit.block_hashes))
        alloc = manager.allocate_slots("c", 17, hit.device_hit, delay_caching=True)
        offloader.flush_evictions(cache)                              # b's evicted blocks
        cache, loaded = offloader.load_hit(cache, hit, alloc.new_block_ids[0])
        self.assertEqual(loaded, 4)
        targets = list(alloc.new_block_ids[0][:4])
        for array, expected in zip(cache.arrays, kv_a):
            bits.assert_bits(np.asarray(array)[targets], expected[:4])
        manager.cache_blocks("c", 16)
        manager.free("c")

        manager.add_request("d", prompt_a)                          # now on the device
        again = manager.get_computed_blocks_tiered("d", offloader.lower_tiers())
        self.assertEqual(again.tiers, ("device",) * 4)
        self.assertEqual(again.device_hit.block_ids[0], tuple(targets))
        offloader.close()

    def test_lookup_order_is_device_then_host_then_disk(self):
        pool = BlockPool(8)
        _ = pool.cache_blocks(pool.allocate(2), [b"a", b"c"])
        host = {b"b", b"c"}.__contains__
        disk = {b"b", b"c", b"d"}.__contains__
        found = pool.find_longest_tiered_hit([b"a", b"b", b"c", b"d", b"e", b"a"],
                                             [("host", host), ("disk", disk)])
        self.assertEqual([t.tier for t in found], ["device", "host", "device", "disk"])
        self.assertEqual([t.block_id for t in found], [1, None, 2, None])

    def test_device_block_after_a_lower_block_is_copied(self):
        cache, hosts = ot.filled_cache(_SPEC, 8, seed=3)
        offloader = OffloadManager(cache, 2)
        manager = KVCacheManager(num_blocks=8, block_size=_SPEC.block_size)
        manager.set_eviction_hook(offloader.on_evict)
        manager.add_request("a", list(range(9)))
        blocks = manager.allocate_slots("a", 9).new_block_ids[0]      # blocks 1, 2, 3
        manager.free("a")
        manager.pool.evict([blocks[0]])                               # block 0 invalid on device
        offloader.offload(cache, [blocks[0]], [0])
        manager.add_request("b", list(range(9)))
        hashes = manager.get_block_hashes("b")
        offloader._remember(0, hashes[0])                             # host holds block 0
        hit = manager.get_computed_blocks_tiered("b", offloader.lower_tiers())
        self.assertEqual(hit.tiers, ("host", "device"))
        alloc = manager.allocate_slots("b", 9, hit.device_hit)
        new = alloc.new_block_ids[0]
        cache, loaded = offloader.load_hit(cache, hit, new)
        self.assertEqual(loaded, 2)
        for array, host in zip(cache.arrays, hosts):
            bits.assert_bits(np.asarray(array)[list(new[:2])], host[[blocks[0], blocks[1]]])
        offloader.close()

    def test_hook_errors_are_logged_and_the_pool_stays_consistent(self):
        pool = BlockPool(3)
        pool.set_eviction_hook(lambda blocks: 1 / 0)
        blocks = pool.allocate(2)
        pool.cache_blocks(blocks, [b"x", b"y"])
        pool.free(blocks)
        with self.assertLogs(level=logging.ERROR):
            self.assertLen(pool.allocate(2), 2)
        pool.check_invariants()
        self.assertIsNone(pool.get_cached_block(b"x"))
        with self.assertRaises(TypeError):
            pool.set_eviction_hook(42)


class BadInputTest(parameterized.TestCase):

    def setUp(self):
        super().setUp()
        self.cache, _ = ot.filled_cache(_SPEC, 4, seed=5)
        self.offloader = OffloadManager(self.cache, 2)

    def test_unknown_and_out_of_range_slots(self):
        with self.assertRaisesRegex(UnknownSlotError, "host slot 1 holds no block"):
            self.offloader.onboard(self.cache, [1], [0])
        with self.assertRaisesRegex(IndexError, "host_slots"):
            self.offloader.offload(self.cache, [0], [2])
        with self.assertRaisesRegex(IndexError, "host_slots"):
            self.offloader.onboard(self.cache, [5], [0])
        with self.assertRaisesRegex(IndexError, "device_ids"):
            self.offloader.offload(self.cache, [4], [0])
        with self.assertRaisesRegex(ValueError, "duplicate"):
            self.offloader.offload(self.cache, [0, 1], [1, 1])
        with self.assertRaisesRegex(ValueError, "same length"):
            self.offloader.offload(self.cache, [0, 1], [1])
        with self.assertRaisesRegex(TypeError, "num_tokens"):
            self.offloader.onboard(self.cache, [0], [0], num_tokens=1.5)
        with self.assertRaisesRegex(ValueError, "no file tier"):
            self.offloader.write_file([0], [b"h"])

    def test_full_host_pool(self):
        with self.assertRaisesRegex(HostPoolFullError, "need 3 host slots"):
            self.offloader._claim_slots(3, set())

    def test_file_tier_for_another_spec_or_tp(self):
        tier = FileTier(self.create_tempdir().full_path, spec=_SPEC, model_id="m",
                        capacity_bytes=1 << 20, tp_size=2, backend="files")
        with self.assertRaisesRegex(ValueError, "at TP 2"):
            OffloadManager(self.cache, 2, file_tier=tier)
        tier.close()
        other, _ = ot.filled_cache(ot.spec_for("THD", "float16"), 4, seed=1)
        with self.assertRaisesRegex(ValueError, "pool holds blocks"):
            self.offloader.offload(other, [0], [0])

    def test_write_of_an_unwritten_slot_is_refused(self):
        tier = FileTier(self.create_tempdir().full_path, spec=_SPEC, model_id="m",
                        capacity_bytes=1 << 20, backend="files")
        offloader = OffloadManager(self.cache, 2, file_tier=tier)
        with self.assertRaisesRegex(UnknownSlotError, "host slot 0"):
            offloader.write_file([0], [b"h"])
        with self.assertRaisesRegex(IndexError, "out of range"):
            offloader.read_file([b"h"], [2])
        with self.assertRaisesRegex(ValueError, "2 host slots for 1"):
            offloader.read_file([b"h"], [0, 1])
        offloader.close()


class ApiTest(parameterized.TestCase):

    def test_lazy_submodule_and_exports(self):
        self.assertIs(jaxkv.offload, offload)
        public = {n for n in vars(offload) if not n.startswith("_")}
        public -= {n for n in public if type(getattr(offload, n)).__name__ == "module"}
        self.assertEqual(sorted(offload.__all__), sorted(public))

    @parameterized.parameters("_host", "_file", "_manager", "_ordering")
    def test_docstring_examples(self, name):
        module = importlib.import_module(f"jaxkv.offload.{name}")
        globs = {"jax": jax, "jnp": jnp, "np": np, "KVCacheSpec": jaxkv.KVCacheSpec,
                 "PagedKVCache": jaxkv.PagedKVCache, "HostPool": HostPool}
        result = doctest.testmod(module, extraglobs=globs, optionflags=doctest.ELLIPSIS)
        self.assertGreater(result.attempted, 0)
        self.assertEqual(result.failed, 0)


if __name__ == "__main__":
    absltest.main()
