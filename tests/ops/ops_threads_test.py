"""The CPU engine's thread pool under concurrent callers: several Python threads running large
(multi-threaded) jitted ops at once, each on its own cache, all exact."""

from support import bits, platforms

platforms.force_cpu_devices()

import concurrent.futures

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest

from jaxkv import ops


class ConcurrentCallersTest(absltest.TestCase):
    def test_concurrent_large_ops_share_the_pool(self):
        # 24 blocks of 512 KiB: every call moves >= 4 MiB, so each one is split across the pool.
        rng = np.random.default_rng(0)
        hosts = [bits.random_bits(rng, (24, 128 << 10), np.float32) for _ in range(4)]
        src, dst = np.arange(0, 12, dtype=np.int32), np.arange(12, 24, dtype=np.int32)
        copy = jax.jit(lambda c, s, d: ops.copy_blocks(c, s, d), donate_argnums=0)
        gather = jax.jit(ops.gather_blocks)

        def work(i):
            cache = jnp.asarray(hosts[i])
            for _ in range(5):
                gathered = np.asarray(gather(cache, jnp.asarray(dst[::-1].copy())))
                np.testing.assert_array_equal(gathered.view(np.uint32),
                                              np.asarray(cache)[dst[::-1]].view(np.uint32))
                cache = copy(cache, jnp.asarray(src), jnp.asarray(dst))
            want = hosts[i].copy()
            want[dst] = hosts[i][src]
            np.testing.assert_array_equal(np.asarray(cache).view(np.uint32), want.view(np.uint32))
            return i

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            self.assertEqual(sorted(pool.map(work, range(4))), [0, 1, 2, 3])


if __name__ == "__main__":
    absltest.main()
