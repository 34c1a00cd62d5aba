"""Offload ordering: copies that target the same slots, submitted without waiting, produce the
result of running them in order (randomised, with file I/O delayed at random on several worker
threads); device ids and host slots are never confused; every wait has a timeout."""

from support import bits, platforms

platforms.force_cpu_devices()

import concurrent.futures
import random
import threading
import time

import numpy as np
import pytest
from absl.testing import absltest, parameterized
from support import offload as ot  # noqa: E402

from jaxkv.offload import FileTier, OffloadManager
from jaxkv.offload._ordering import SlotOrdering
from jaxkv.offload._types import OffloadTimeoutError, SlotKey, Tier, UnknownSlotError


class _DelayedIO:
    """Wraps a file tier's payload I/O with random delays (reorders the workers' progress)."""

    def __init__(self, inner, seed):
        self._inner = inner
        self._random = random.Random(seed)
        self._lock = threading.Lock()
        self.name = inner.name

    def _pause(self):
        with self._lock:
            delay = self._random.random() * 0.004
        time.sleep(delay)

    def forget(self, fd):
        self._inner.forget(fd)

    def write_many(self, *args):
        self._pause()
        return self._inner.write_many(*args)

    def read_many(self, *args):
        self._pause()
        return self._inner.read_many(*args)


class _BlockedIO:
    """Payload I/O that waits for an event first (a file copy that is still running)."""

    def __init__(self, inner, event):
        self._inner, self._event, self.name = inner, event, inner.name

    def forget(self, fd):
        self._inner.forget(fd)

    def write_many(self, *args):
        self._event.wait(30)
        return self._inner.write_many(*args)

    def read_many(self, *args):
        self._event.wait(30)
        return self._inner.read_many(*args)


class RandomisedOrderTest(parameterized.TestCase):

    def _run(self, seed, num_ops):
        rng = np.random.default_rng(seed)
        spec = ot.spec_for("KHTD", "bfloat16")
        cache, device = ot.filled_cache(spec, 8, seed=seed)
        tier = FileTier(self.create_tempdir().full_path, spec=spec, model_id="m",
                        capacity_bytes=1 << 22, num_workers=3, durable=False, backend="files")
        tier._io = _DelayedIO(tier._io, seed)
        offloader = OffloadManager(cache, 4, file_tier=tier, timeout_s=60)
        host = [np.zeros((4, *a.shape[1:]), a.dtype) for a in device]
        valid = np.zeros(4, bool)
        disk = {}
        futures = []
        counter = 0
        for _ in range(num_ops):
            kind = rng.choice(["offload", "onboard", "write", "read"])
            k = int(rng.integers(1, 4))
            if kind == "offload":
                ids = rng.choice(8, k, replace=False)
                slots = rng.choice(4, k, replace=False)
                offloader.offload(cache, ids, slots)
                for array, h in zip(device, host):
                    h[slots] = array[ids]
                valid[slots] = True
            elif kind == "onboard" and valid.any():
                slots = rng.choice(np.flatnonzero(valid), min(k, int(valid.sum())), replace=False)
                ids = rng.choice(8, len(slots), replace=False)
                num_tokens = [None, 1, 3][int(rng.integers(3))]
                cache = offloader.onboard(cache, slots, ids, num_tokens=num_tokens)
                for array, h in zip(device, host):
                    for slot, block in zip(slots, ids):
                        ot.prefix_copy(array[block], h[slot].copy(), num_tokens, spec)
            elif kind == "write" and valid.any():
                slots = rng.choice(np.flatnonzero(valid), min(k, int(valid.sum())), replace=False)
                hashes = []
                for slot in slots:
                    counter += 1
                    hashes.append(b"h%d" % counter)
                    disk[hashes[-1]] = [h[slot].copy() for h in host]
                futures.append(offloader.write_file(slots, hashes))
            elif kind == "read":
                known = list(disk)
                hashes = [known[int(rng.integers(len(known)))] if known and rng.random() < 0.85
                          else b"never-written" for _ in range(k)]
                slots = rng.choice(4, k, replace=False)
                futures.append(offloader.read_file(hashes, slots))
                for block_hash, slot in zip(hashes, slots):
                    if block_hash in disk:
                        for h, saved in zip(host, disk[block_hash]):
                            h[slot] = saved
                        valid[slot] = True
                    else:
                        valid[slot] = False
        offloader.wait(timeout=60)
        concurrent.futures.wait(futures, timeout=60)
        for array, expected in zip(cache.arrays, device):
            bits.assert_bits(array, expected, f"device, seed {seed}")
        for array, expected in zip(offloader.pool.arrays, host):
            bits.assert_bits(np.asarray(array)[valid], expected[valid], f"host, seed {seed}")
        for slot in range(4):
            self.assertEqual(offloader.slot_valid(slot), bool(valid[slot]))
        out = np.zeros(tier.payload_nbytes, np.uint8)
        for block_hash, arrays in disk.items():
            self.assertEqual(tier.read_async([(block_hash, out)]).result(30), [True])
            expected = np.concatenate([a.reshape(-1).view(np.uint8) for a in arrays])
            np.testing.assert_array_equal(out, expected, err_msg=f"disk, seed {seed}")
        offloader.close()

    @parameterized.parameters(0, 1, 2)
    def test_concurrent_sequences_equal_sequential(self, seed):
        self._run(seed, num_ops=40)

    @parameterized.parameters(*range(3, 15))
    @pytest.mark.slow  # innermost, so that every generated case carries the mark
    def test_concurrent_sequences_equal_sequential_more_seeds(self, seed):
        self._run(seed, num_ops=80)


class SlotKeyTest(parameterized.TestCase):

    def test_dependencies_follow_reads_and_writes(self):
        order = SlotOrdering()
        ops = [concurrent.futures.Future() for _ in range(5)]
        host, device = SlotKey(Tier.HOST, 3), SlotKey(Tier.DEVICE, 3)
        self.assertEqual(order.claim([], [host], ops[0]), [])                 # write host 3
        self.assertEqual(order.claim([device], [], ops[1]), [])               # another tier
        self.assertEqual(order.claim([host], [], ops[2]), [ops[0]])           # read after write
        self.assertCountEqual(order.claim([], [host], ops[3]), [ops[0], ops[2]])  # WAW + WAR
        ops[3].set_result(None)
        self.assertEqual(order.claim([host], [], ops[4]), [])                 # writer done
        # ops 0 and 2 were superseded by op 3, which waits for them (pending() is transitive).
        self.assertCountEqual(order.pending(), [ops[1], ops[4]])

    def test_finished_copies_of_many_keys_are_pruned(self):
        # A file tier keys copies by block hash: the tables must not keep every hash ever moved.
        order = SlotOrdering()
        pending = concurrent.futures.Future()
        order.claim([], [SlotKey(Tier.DISK, b"kept")], pending)
        for i in range(20_000):
            op = concurrent.futures.Future()
            order.claim([SlotKey(Tier.DISK, b"r%d" % i)], [SlotKey(Tier.HOST, i % 7)], op)
            op.set_result(None)
        self.assertLess(len(order._writer) + len(order._readers), 2 * 4096 + 16)
        # The unfinished copy survives pruning and is still a dependency.
        self.assertEqual(order.claim([SlotKey(Tier.DISK, b"kept")], [],
                                     concurrent.futures.Future()), [pending])

    def test_pending_file_read_blocks_only_its_own_slot(self):
        spec = ot.spec_for("THD", "float32")
        cache, hosts = ot.filled_cache(spec, 8, seed=1)
        tier = FileTier(self.create_tempdir().full_path, spec=spec, model_id="m",
                        capacity_bytes=1 << 20, backend="files", durable=False)
        offloader = OffloadManager(cache, 4, file_tier=tier, timeout_s=0.3)
        offloader.offload(cache, [2], [2])
        offloader.write_file([2], [b"two"]).result(10)
        release = threading.Event()
        tier._io = _BlockedIO(tier._io, release)
        read = offloader.read_file([b"two"], [2])          # host slot 2: still running
        # Device block 2 and host slot 0 are other (tier, slot) keys: no wait.
        offloader.offload(cache, [2], [0])
        cache = offloader.onboard(cache, [0], [6])
        with self.assertRaises(OffloadTimeoutError):       # host slot 2: bounded wait
            offloader.onboard(cache, [2], [5])
        with self.assertRaises(OffloadTimeoutError):       # a write into slot 2 waits too
            offloader.offload(cache, [1], [2])
        release.set()
        self.assertEqual(read.result(10), [True])
        cache = offloader.onboard(cache, [2], [5])
        offloader.wait(10)
        for array, host in zip(cache.arrays, hosts):
            bits.assert_bits(np.asarray(array)[[5, 6]], host[[2, 2]])
        offloader.close()

    def test_failed_read_makes_the_slot_unknown(self):
        spec = ot.spec_for("THD", "float32")
        cache, _ = ot.filled_cache(spec, 4, seed=1)
        tier = FileTier(self.create_tempdir().full_path, spec=spec, model_id="m",
                        capacity_bytes=1 << 20, backend="files")
        offloader = OffloadManager(cache, 2, file_tier=tier)
        offloader.offload(cache, [1], [0])
        self.assertEqual(offloader.read_file([b"missing"], [0]).result(10), [False])
        with self.assertRaisesRegex(UnknownSlotError, "host slot 0 holds no block"):
            offloader.onboard(cache, [0], [3])
        offloader.close()


if __name__ == "__main__":
    absltest.main()
