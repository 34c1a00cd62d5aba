"""Registration of a cache whose TP axis is a tuple of mesh axes (one NIXL agent, no peer)."""

from __future__ import annotations

import os

os.environ.setdefault("UCX_TLS", "tcp,sm,self")

from support import platforms

platforms.force_cpu_devices()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from absl.testing import absltest  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

from jaxkv import EngineConfig, KVCacheSpec, PagedKVCache  # noqa: E402
from jaxkv.transfer import TransferEngine, nixl_available  # noqa: E402


@pytest.mark.skipif(not nixl_available(), reason="NIXL (nixl-cu13) is not installed")
class TupleTpAxisTest(absltest.TestCase):
    def test_ranks_follow_the_product_of_the_tp_axes(self):
        # TP 4 over ("model", "expert") on a 2x2 mesh: rank r holds head r, and the regions
        # the engine publishes for rank r are the buffers of the device holding head r.
        devices = np.array(jax.devices()[:4]).reshape(2, 2)
        mesh = Mesh(devices, ("model", "expert"))
        spec = KVCacheSpec(num_layers=2, num_kv_heads=4, head_dim=8, block_size=4,
                           dtype="float32")
        cache = PagedKVCache.allocate(spec, 8, mesh=mesh, tp_axis=("model", "expert"))
        config = EngineConfig(spec, 4)
        with TransferEngine("tuple-tp", config) as engine:
            engine.register_cache(cache)
            ranks = {r.rank: r for r in engine.metadata.ranks}
        self.assertEqual(sorted(ranks), [0, 1, 2, 3])
        by_address = {b.address: b for b in cache.shard_buffers()}
        for rank, info in ranks.items():
            self.assertTrue(info.regions)
            for region in info.regions:
                buffer = by_address[region.base_address]
                self.assertEqual((buffer.head_start, buffer.head_stop), (rank, rank + 1))
                self.assertEqual((region.head_start, region.head_stop), (rank, rank + 1))


if __name__ == "__main__":
    absltest.main()
