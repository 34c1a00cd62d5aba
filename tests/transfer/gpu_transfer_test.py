"""Real transfers between GPU caches: a producer process and this process sharing one GPU, over
NIXL (each cache registered as VRAM or, with host staging, through a pinned-host mirror) and
over the JAX transport; bit exact, with post-processing (layout and block-size changes) run by
the CUDA custom calls.

Skipped where JAX sees no GPU or NIXL is missing; fails at import under JAXKV_EXPECT_GPU=1 when
JAX sees no GPU. `scripts/test.sh` runs it in its GPU process (JAX_PLATFORMS=cuda,cpu).
"""

from __future__ import annotations

import os

from support import platforms

GPUS = platforms.gpus()
if GPUS:  # before NIXL loads (here and in the spawned producer, which inherits them)
    # UCX moves VRAM with its CUDA transports (cuda_ipc between two processes on one GPU); the
    # CPU transfer tests restrict UCX to tcp,sm,self, which cannot.
    os.environ.setdefault("UCX_TLS", "tcp,sm,self,cuda_copy,cuda_ipc")
    # The producer process shares the GPU: it must not take 75% of its memory up front.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

from absl.testing import absltest, parameterized  # noqa: E402
from support import transfer as tt  # noqa: E402

from jaxkv import KVCacheSpec  # noqa: E402
from jaxkv.transfer import nixl_available  # noqa: E402

REMOTE_IDS, LOCAL_IDS, G_SEED, WAIT_S = tt.REMOTE_IDS, tt.LOCAL_IDS, tt.G_SEED, tt.WAIT_S


# (absltest's skips: pytest's marks do not apply where the module runs under absltest, Bazel)
@absltest.skipIf(not GPUS, "no GPU visible to JAX")
@absltest.skipIf(not nixl_available(), "NIXL (nixl-cu13) is not installed")
class GpuTransferTest(tt.TransferTestBase):
    def _read(self, p_layout, d_layout, ratio=1, staging=False, dtype="bfloat16",
              transport="nixl"):
        spec_kwargs = dict(num_layers=2, num_kv_heads=4, head_dim=64, block_size=4, dtype=dtype,
                           layout=p_layout)
        options = (dict(host_staging=staging) if transport == "nixl"
                   else dict(transport=transport))
        _, conn = self.start_producer(spec_kwargs, 1, engine_kwargs=options)
        self.ready(conn)
        self.call(conn, "register", REMOTE_IDS)
        params = self.call(conn, "pin", "req-1", REMOTE_IDS, 30.0)
        spec_d = KVCacheSpec(**dict(spec_kwargs, layout=d_layout, block_size=4 * ratio))
        engine, cache, config = self.consumer(spec_d, 1, **options)
        self.assertEqual(cache.arrays[0].devices(), {GPUS[0]})
        local_ids = LOCAL_IDS[: len(REMOTE_IDS) // ratio]
        engine.start_read(params, local_ids)
        finished, failed = self.wait(engine, ["req-1"])
        self.assertEqual((finished, failed), (["req-1"], []))
        g = tt.global_cache(KVCacheSpec(**spec_kwargs), len(REMOTE_IDS) * 4, seed=G_SEED)
        self.check_cache(engine.caches[0], config, g, local_ids)
        if transport == "nixl":  # (the producer's state reports its NIXL agent)
            self.assert_freed(conn, "req-1")
        return engine

    def test_vram_to_vram_read_is_bit_exact(self):
        engine = self._read("LKHTD", "LKHTD")
        self.assertEqual(engine.stats.records[-1].bytes,
                         engine.caches[0].spec.cache_nbytes(len(REMOTE_IDS)))

    @parameterized.parameters(("HTD", "THD", 1), ("HTD", "HTD", 2), ("KHTD", "LKTHD", 2))
    def test_post_processing_on_the_gpu(self, p_layout, d_layout, ratio):
        # layout and block-size changes are rewritten in place by the CUDA custom calls
        self._read(p_layout, d_layout, ratio)

    @parameterized.parameters("bfloat16", "float8_e4m3fn", "float32")
    def test_host_staged_read_through_pinned_host_mirrors(self, dtype):
        self._read("LKHTD", "LKHTD", staging=True, dtype=dtype)

    @parameterized.parameters(("LKHTD", "LKHTD", 1), ("HTD", "THD", 2))
    def test_jax_transport_pull_between_gpu_caches(self, p_layout, d_layout, ratio):
        # jax.experimental.transfer between the two processes' GPU caches (not yet run on a
        # GPU: added after the first GPU run)
        self._read(p_layout, d_layout, ratio, transport="jax")


if __name__ == "__main__":
    absltest.main()
