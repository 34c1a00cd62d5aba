"""Host staging: every real-transfer case of transfer_e2e_test, through registered host mirrors.

The same `read_case` grid (TP pairs, layouts, post-processing, KV heads, MLA, PP on either
side, TP ranks as processes) runs with ``host_staging=True`` on both engines: NIXL moves the
host mirrors, the producer stages device -> mirror with the gather custom call and the
consumer mirror -> device with the scatter custom call. The bytes must be exactly those of
the direct mode (the same expectation from G, bit for bit; no other block changed).
"""

from __future__ import annotations

import os

os.environ.setdefault("UCX_TLS", "tcp,sm,self")

from support import bits, meshes, platforms  # noqa: E402

platforms.force_cpu_devices()

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import transfer_e2e_test as e2e  # noqa: E402  (module only: its class is not collected twice)
from absl.testing import absltest, parameterized  # noqa: E402

from jaxkv import KVCacheSpec, PagedKVCache, ops  # noqa: E402
from jaxkv.transfer import nixl_available
from jaxkv.transfer._staging import HostMirror


@pytest.mark.skipif(not nixl_available(), reason="NIXL (nixl-cu13) is not installed")
class TransferStagingTest(e2e.TransferE2ETest):
    """Both sides staged (every inherited case), plus one side staged and the other direct."""

    producer_staging = True
    consumer_staging = True

    def start_producer(self, spec_kwargs, tp, pp_rank=0, pp=1, engine_kwargs=None, **kwargs):
        engine_kwargs = dict(engine_kwargs or {}, host_staging=self.producer_staging)
        return super().start_producer(spec_kwargs, tp, pp_rank, pp, engine_kwargs, **kwargs)

    def consumer(self, spec, tp, pp=1, pp_rank=0, **kwargs):
        engine, cache, config = super().consumer(
            spec, tp, pp, pp_rank, host_staging=self.consumer_staging, **kwargs
        )
        device = {b.address for b in cache.shard_buffers()}
        published = {r.base_address for info in engine.metadata.ranks for r in info.regions}
        if self.consumer_staging:  # NIXL sees only the mirror
            self.assertFalse(device & published)
        else:
            self.assertEqual(device, published)
        return engine, cache, config

    @parameterized.parameters(
        # (producer staged, consumer staged, p_tp, d_tp, p_layout, d_layout, ratio)
        (True, False, 2, 1, "LKHTD", "KHTD", 1),
        (False, True, 1, 2, "THD", "HTD", 1),
        (True, False, 1, 1, "LKTHD", "LKHTD", 2),
    )
    def test_one_side_staged(self, p_staged, d_staged, p_tp, d_tp, p_layout, d_layout, ratio):
        self.producer_staging, self.consumer_staging = p_staged, d_staged
        self.read_case(p_tp, d_tp, p_layout, d_layout, ratio=ratio)


class HostMirrorTest(parameterized.TestCase):
    """The mirror's own copies, without NIXL: device -> mirror -> device round trips."""

    @parameterized.parameters(("LKHTD", 2), ("KTHD", 2), ("HTD", 1), ("LKTD", 1))
    def test_round_trip_and_layers(self, layout, tp):
        mla = "H" not in layout
        spec = KVCacheSpec(
            num_layers=3, num_kv_heads=1 if mla else 2, head_dim=4, block_size=2,
            dtype="bfloat16", layout=layout, kv_factor=1 if mla else 2, mla=mla,
        )
        mesh = meshes.tp(tp)
        rng = np.random.default_rng(0)
        shape = spec.array_shape(8)
        arrays = [rng.integers(0, 1 << 16, size=shape, dtype=np.uint16) for _ in spec.array_keys()]
        cache = PagedKVCache.from_arrays(spec, [a.view(spec.dtype) for a in arrays], mesh=mesh)
        mirror = HostMirror(cache)
        self.assertEqual(mirror.nbytes(), sum(b.nbytes for b in cache.shard_buffers()))
        # layer-wise staging: layers [0, 1) first, then the rest
        mirror.stage_out(cache, [5, 1], layers=(0, 1))
        mirror.stage_out(cache, [5, 1], layers=(1, 3))
        target = PagedKVCache.allocate(spec, 8, mesh=mesh)
        target = mirror.stage_in(target, [5, 1])
        for want, got in zip(arrays, target.arrays):
            got = bits.bits(np.asarray(got))
            np.testing.assert_array_equal(got[[5, 1]], want[[5, 1]])
            self.assertFalse(got[[0, 2, 3, 4, 6, 7]].any())

    def test_layer_subset_only(self):
        spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=4, block_size=2,
                           dtype="float32", layout="LKHTD")
        arrays = [np.arange(np.prod(spec.array_shape(4)), dtype=np.uint32).reshape(
            spec.array_shape(4)) + 1]
        cache = PagedKVCache.from_arrays(spec, [arrays[0].view(np.float32)])
        mirror = HostMirror(cache)
        mirror.stage_out(cache, [2], layers=(1, 2))
        rows = next(iter(mirror.buffers.values())).view(np.uint32).reshape(4, 2, -1)
        np.testing.assert_array_equal(rows[2, 1], arrays[0][2, 1].reshape(-1))
        self.assertFalse(rows[2, 0].any())  # layer 0 not staged yet
        self.assertFalse(rows[[0, 1, 3]].any())


class HostMirrorRowsTest(parameterized.TestCase):
    """`HostMirror.write_rows`: rows a jitted step's layer announcement received on the host
    (global arrays, one layer) land in the mirror exactly where `stage_out` copies them."""

    @staticmethod
    def cache_of(layout, tp, seed=0):
        mla = "H" not in layout
        spec = KVCacheSpec(
            num_layers=3, num_kv_heads=1 if mla else 2, head_dim=4, block_size=2,
            dtype="bfloat16", layout=layout, kv_factor=1 if mla else 2, mla=mla,
        )
        rng = np.random.default_rng(seed)
        shape = spec.array_shape(8)
        arrays = [rng.integers(1, 1 << 16, size=shape, dtype=np.uint16)
                  for _ in spec.array_keys()]
        cache = PagedKVCache.from_arrays(spec, [a.view(spec.dtype) for a in arrays],
                                         mesh=meshes.tp(tp))
        return spec, cache, arrays

    @staticmethod
    def layer_rows(spec, arrays, ids, layers):
        """What `publish_layer_in_jit` hands the callback: per array the rows of `layers`."""
        safe = np.maximum(np.asarray(ids), 0)
        rows = []
        for (layer, _), array in zip(spec.array_keys(), arrays):
            if layer is None:
                axis = 1 + spec.layout.index("L")
                index = tuple(slice(*layers) if a == axis else slice(None)
                              for a in range(1, array.ndim))
                rows.append(array[safe][(slice(None),) + index])
            else:
                rows.append(array[safe] if layers[0] <= layer < layers[1] else None)
        return rows

    @parameterized.parameters(("LKHTD", 2), ("KTHD", 2), ("HTD", 1), ("LKTD", 1))
    def test_rows_equal_the_device_copy(self, layout, tp):
        spec, cache, arrays = self.cache_of(layout, tp)
        staged, written = HostMirror(cache), HostMirror(cache)
        self.assertTrue(written.writes_rows)
        ids = [5, -1, 1]  # -1: a padding row, skipped
        for layers in ((0, 1), (1, 3)):  # one layer, then two at once
            staged.stage_out(cache, [5, 1], layers=layers)
            written.write_rows(ids, self.layer_rows(spec, arrays, ids, layers), layers)
            for key, want in staged.buffers.items():
                np.testing.assert_array_equal(written.buffers[key], want, err_msg=str(key))
        for key, buffer in written.buffers.items():  # every other block untouched
            rows = buffer.reshape(8, -1)
            self.assertFalse(rows[[0, 2, 3, 4, 6, 7]].any(), str(key))
            self.assertTrue(rows[[1, 5]].any(axis=1).all(), str(key))

    def test_refused_rows_write_nothing(self):
        spec, cache, arrays = self.cache_of("KHTD", 2)
        mirror = HostMirror(cache)
        good = self.layer_rows(spec, arrays, [3], (1, 3))  # arrays 1 and 2 (one per layer)
        self.assertEqual([r is None for r in good], [True, False, False])
        bad_shape = [None, good[1], good[2][:, :1]]  # array 1 is fine: still nothing written
        wide = [r if r is None else r.astype(np.uint32) for r in good]
        for rows, ids, what in ((bad_shape, [3], "expected unsigned"),
                                (wide, [3], "expected unsigned"),
                                (good, [8], "outside"),
                                (good[:-1], [3], "arrays of rows")):
            with self.assertRaisesRegex(ValueError, what):
                mirror.write_rows(ids, rows, (1, 3))
        self.assertFalse(any(b.any() for b in mirror.buffers.values()))


class HostMirrorWithoutCustomCallsTest(parameterized.TestCase):
    """The mirror copies with the Pallas kernels (interpret mode here) or the jnp reference,
    directly or through pinned host memory: exact bytes, and no custom call built."""

    @parameterized.parameters(*[(impl, kind) for impl in ("reference", "pallas")
                                for kind in (None, "pinned_host")])
    def test_stage_out_and_in(self, impl, memory_kind):
        from unittest import mock

        import jax.numpy as jnp

        from jaxkv.ops import _block_ops

        def refuse(*args, **kwargs):
            raise AssertionError("a custom call was built")

        self.enter_context(mock.patch.object(_block_ops, "_ffi_call", refuse))
        spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4,
                           dtype="bfloat16", layout="LKHTD")
        mesh = meshes.tp(2, explicit=True)
        host = bits.random_bits(np.random.default_rng(1), spec.array_shape(8), spec.dtype)
        with ops.implementation(impl):
            cache = PagedKVCache.from_arrays(spec, [jnp.asarray(host)], mesh=mesh)
            mirror = HostMirror(cache, memory_kind=memory_kind)
            mirror.stage_out(cache, [3, 5, 0])
            for b in cache.shard_buffers():   # the mirror holds the staged blocks' bytes
                staged = mirror.buffers[(b.array_index, b.device.id)].reshape(8, -1)
                shard = next(s for s in cache.arrays[0].addressable_shards
                             if s.device == b.device)
                local = np.asarray(shard.data).reshape(8, -1).view(np.uint8)
                np.testing.assert_array_equal(staged[[3, 5, 0]], local[[3, 5, 0]])
                self.assertFalse(staged[[1, 2, 4, 6, 7]].any())
            target = PagedKVCache.from_arrays(spec, [jnp.zeros(spec.array_shape(8), spec.dtype)],
                                              mesh=mesh)
            received = HostMirror(target, memory_kind=memory_kind)
            for key, buffer in mirror.buffers.items():
                received.buffers[key][:] = buffer
            target = received.stage_in(target, [5, 3])
        expected = np.zeros_like(host)
        expected[[3, 5]] = host[[3, 5]]
        np.testing.assert_array_equal(bits.bits(np.asarray(target.arrays[0])),
                                      bits.bits(expected))

    def test_unknown_memory_kind(self):
        spec = KVCacheSpec(1, 1, 8, 4, "float32", layout="THD")
        cache = PagedKVCache.allocate(spec, num_blocks=2)
        with self.assertRaisesRegex(ValueError, "memory_kind must be None or 'pinned_host'"):
            HostMirror(cache, memory_kind="device")


if __name__ == "__main__":
    absltest.main()
