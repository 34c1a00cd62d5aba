"""The file tier: atomic publish (a crash between write and rename leaves no visible block),
checksums (a corrupted file is a miss, quarantined, never loaded), restart in a second process,
LRU size budget, other models' blocks never loaded, bad input."""

from support import bits, platforms

platforms.force_cpu_devices()

import os
import subprocess
import sys
import textwrap

import msgspec
import numpy as np
from absl.testing import absltest, parameterized
from support import offload as ot  # noqa: E402

from jaxkv.offload import FileTier, OffloadManager, _file
from jaxkv.offload._file import TierFuture
from jaxkv.offload._types import IncompatibleTierError, OffloadTimeoutError, UnknownSlotError
from jaxkv.transfer import nixl_available

_TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SPEC = ot.spec_for("LKHTD", "bfloat16")


def _run_child(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Runs `code` in a fresh interpreter (the installed jaxkv, not the source tree)."""
    prelude = f"import sys; sys.path.insert(0, {_TESTS!r})\n"
    return subprocess.run([sys.executable, "-P", "-c", prelude + textwrap.dedent(code)],
                          capture_output=True, text=True, timeout=timeout)


def _tier(directory, **kwargs) -> FileTier:
    options = dict(spec=_SPEC, model_id="model-a", capacity_bytes=1 << 20, backend="files")
    options.update(kwargs)
    return FileTier(directory, **options)


def _block(seed: int, tier: FileTier) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, tier.payload_nbytes, dtype=np.uint8)


class CrashAndCorruptionTest(parameterized.TestCase):

    def test_crash_between_write_and_rename_leaves_no_visible_block(self):
        root = self.create_tempdir().full_path
        result = _run_child(f"""
            import os
            import numpy as np
            from support import offload as ot
            from jaxkv.offload import FileTier, _file
            tier = FileTier({root!r}, spec=ot.spec_for("LKHTD", "bfloat16"), model_id="model-a",
                            capacity_bytes=1 << 20, backend="files")
            block = np.full(tier.payload_nbytes, 7, np.uint8)
            assert tier.put(b"good", block)
            _file._publish = lambda tmp, final: os._exit(3)   # the process dies before rename
            tier.put(b"torn", block)
        """)
        self.assertEqual(result.returncode, 3, result.stderr)
        subdirs = os.listdir(root)
        self.assertLen(subdirs, 1)
        blocks = os.path.join(root, subdirs[0], "blocks")
        tmp = os.path.join(root, subdirs[0], "tmp")
        self.assertEqual(os.listdir(blocks), [b"good".hex() + ".kvb"])
        self.assertTrue(any(name.startswith(b"torn".hex()) for name in os.listdir(tmp)),
                        "the child wrote the torn block's temporary file")
        tier = _tier(root)                      # a restart: leftovers removed, torn block absent
        self.assertTrue(tier.contains(b"good"))
        self.assertFalse(tier.contains(b"torn"))
        self.assertEqual([n for n in os.listdir(tmp) if n.startswith(b"torn".hex())], [])
        out = np.zeros(tier.payload_nbytes, np.uint8)
        self.assertEqual(tier.read_async([(b"torn", out)]).result(30), [False])
        self.assertEqual(tier.read_async([(b"good", out)]).result(30), [True])
        np.testing.assert_array_equal(out, np.full(tier.payload_nbytes, 7, np.uint8))
        tier.close()

    def test_failed_publish_in_process_leaves_nothing(self):
        tier = _tier(self.create_tempdir().full_path)

        def fail(tmp, final):
            raise OSError("simulated failure before rename")

        original, _file._publish = _file._publish, fail
        try:
            with self.assertRaisesRegex(OSError, "simulated"):
                tier.put(b"h", _block(0, tier))
        finally:
            _file._publish = original
        self.assertFalse(tier.contains(b"h"))
        self.assertEqual(os.listdir(tier._tmp), [])
        self.assertEqual(os.listdir(tier._blocks), [])
        tier.close()

    @parameterized.parameters(
        dict(where="payload", backend="files"), dict(where="payload", backend="nixl"),
        dict(where="header", backend="files"), dict(where="truncate", backend="files"))
    def test_corrupted_file_is_a_miss_and_never_loaded(self, where, backend):
        if backend == "nixl" and not nixl_available():
            self.skipTest("NIXL is not installed")
        spec = _SPEC
        cache, hosts = ot.filled_cache(spec, 4, seed=11)
        tier = _tier(self.create_tempdir().full_path, backend=backend)
        offloader = OffloadManager(cache, 2, file_tier=tier)
        offloader.offload(cache, [1, 2], [0, 1])
        self.assertEqual(offloader.write_file([0, 1], [b"b1", b"b2"]).result(10), [True, True])
        path = tier.path_of(b"b1")
        with open(path, "r+b") as handle:
            if where == "payload":
                handle.seek(_file._HEADER_BYTES + 100)
                byte = handle.read(1)
                handle.seek(_file._HEADER_BYTES + 100)
                handle.write(bytes([byte[0] ^ 0x01]))          # one flipped bit
            elif where == "header":
                handle.write(b"NOTJAXKV")
            else:
                handle.truncate(_file._HEADER_BYTES + 10)
        offloader.offload(cache, [3, 0], [0, 1])                # other bytes in both slots
        with self.assertLogs("jaxkv.offload", level="WARNING") as logs:
            result = offloader.read_file([b"b1", b"b2"], [0, 1]).result(10)
        self.assertEqual(result, [False, True])
        self.assertIn("quarantined, treated as a miss", logs.output[0])
        self.assertFalse(tier.contains(b"b1"))
        self.assertFalse(os.path.exists(path))
        self.assertLen(os.listdir(tier._quarantine), 1)
        self.assertEqual(tier.stats.corrupt, 1)
        with self.assertRaises(UnknownSlotError):              # the corrupt bytes never load
            offloader.onboard(cache, [0], [3])
        cache = offloader.onboard(cache, [1], [3])
        for array, host in zip(cache.arrays, hosts):
            bits.assert_bits(np.asarray(array)[3], host[2])
        offloader.close()

    @parameterized.parameters("other_block", "checksum_field", "reordered_fields")
    def test_every_header_field_is_checked(self, change):
        # Reads compare the header bytes with the ones a write of the block writes; any other
        # header is decoded and checked field by field: it still loads when it is valid.
        tier = _tier(self.create_tempdir().full_path)
        block = _block(3, tier)
        self.assertTrue(tier.put(b"h1", block))
        self.assertTrue(tier.put(b"h2", _block(4, tier)))
        with open(tier.path_of(b"h1"), "rb") as handle:
            data = bytearray(handle.read())
        length = int.from_bytes(data[8:12], "little")
        header = msgspec.msgpack.decode(data[12:12 + length])
        if change == "other_block":                            # a valid file of block h1
            target = b"h2"
        else:
            target = b"h1"
            if change == "checksum_field":
                header["checksum"] = header["checksum"][::-1]
            else:
                header = dict(reversed(list(header.items())))
        encoded = msgspec.msgpack.encode(header)
        data[8:_file._HEADER_BYTES] = (len(encoded).to_bytes(4, "little") + encoded).ljust(
            _file._HEADER_BYTES - 8, b"\0")
        with open(tier.path_of(target), "r+b") as handle:
            handle.write(data)
        out = np.zeros_like(block)
        (loaded,) = tier.read_async([(target, out)]).result(30)
        self.assertEqual(loaded, change == "reordered_fields")
        self.assertEqual(tier.stats.corrupt, 0 if loaded else 1)
        if loaded:
            np.testing.assert_array_equal(out, block)
        tier.close()

    def test_other_models_blocks_are_never_loaded(self):
        root = self.create_tempdir().full_path
        a = _tier(root, model_id="model-a")
        b = _tier(root, model_id="model-b")                    # same geometry, other weights
        c = _tier(root, model_id="model-a", spec=_SPEC.replace(dtype="float16"))
        self.assertNotEqual(a.directory, b.directory)
        self.assertTrue(a.put(b"h", _block(1, a)))
        self.assertFalse(b.contains(b"h"))
        self.assertFalse(c.contains(b"h"))
        # A file copied into another model's directory fails the header check: a miss.
        os.link(a.path_of(b"h"), b.path_of(b"h"))
        b2 = _tier(root, model_id="model-b")
        self.assertTrue(b2.contains(b"h"))
        out = np.zeros(b2.payload_nbytes, np.uint8)
        self.assertEqual(b2.read_async([(b"h", out)]).result(30), [False])
        self.assertEqual(b2.stats.corrupt, 1)
        for tier in (a, b, c, b2):
            tier.close()

    def test_manifest_of_another_tier_is_refused(self):
        root = self.create_tempdir().full_path
        tier = _tier(root)
        tier.close()
        manifest = os.path.join(tier.directory, "manifest.msgpack")
        other = _tier(self.create_tempdir().full_path, model_id="other")
        other.close()
        os.replace(os.path.join(other.directory, "manifest.msgpack"), manifest)
        with self.assertRaises(IncompatibleTierError):
            _tier(root)

    def test_unreadable_manifest_falls_back_to_the_files(self):
        root = self.create_tempdir().full_path
        tier = _tier(root)
        tier.put(b"x", _block(2, tier))
        tier.close()
        with open(os.path.join(tier.directory, "manifest.msgpack"), "wb") as handle:
            handle.write(b"\x00garbage")
        with self.assertLogs("jaxkv.offload", level="WARNING") as logs:  # the package's logger
            again = _tier(root)
        self.assertIn("ignoring unreadable manifest", logs.output[0])
        self.assertTrue(again.contains(b"x"))
        again.close()


class RestartTest(parameterized.TestCase):

    def test_second_process_finds_the_blocks_of_the_first(self):
        root = self.create_tempdir().full_path
        result = _run_child(f"""
            from support import offload as ot
            from jaxkv.offload import FileTier, OffloadManager
            spec = ot.spec_for("LKHTD", "bfloat16")
            cache, _ = ot.filled_cache(spec, 8, seed=21)
            tier = FileTier({root!r}, spec=spec, model_id="model-a", capacity_bytes=1 << 20)
            offloader = OffloadManager(cache, 4, file_tier=tier)
            offloader.offload(cache, [3, 5, 6], [0, 1, 2])
            assert offloader.write_file([0, 1, 2], [b"p0", b"p1", b"p2"]).result(30) == [True] * 3
            offloader.close()
            print("backend", tier.backend)
        """)
        self.assertEqual(result.returncode, 0, result.stderr)
        tier = FileTier(root, spec=_SPEC, model_id="model-a", capacity_bytes=1 << 20)
        self.assertEqual(sorted(tier.block_hashes()), [b"p0", b"p1", b"p2"])
        _, hosts = ot.filled_cache(_SPEC, 8, seed=21)          # what the first process held
        cache, _ = ot.filled_cache(_SPEC, 8, seed=22)
        offloader = OffloadManager(cache, 4, file_tier=tier)
        self.assertEqual(offloader.read_file([b"p2", b"p0", b"p1"], [0, 1, 2]).result(30),
                         [True] * 3)
        cache = offloader.onboard(cache, [0, 1, 2], [1, 2, 3])
        for array, host in zip(cache.arrays, hosts):
            bits.assert_bits(np.asarray(array)[[1, 2, 3]], host[[6, 3, 5]])
        offloader.close()


class BudgetAndInputTest(parameterized.TestCase):

    def test_lru_eviction_keeps_the_budget(self):
        directory = self.create_tempdir().full_path
        probe = _tier(directory)
        capacity = 3 * probe.file_nbytes
        probe.close()
        tier = _tier(directory, capacity_bytes=capacity)
        blocks = {bytes([i]): _block(i, tier) for i in range(1, 6)}
        for key in (b"\x01", b"\x02", b"\x03"):
            tier.put(key, blocks[key])
        out = np.zeros(tier.payload_nbytes, np.uint8)
        self.assertEqual(tier.read_async([(b"\x01", out)]).result(30), [True])  # 1: most recent
        tier.put(b"\x04", blocks[b"\x04"])                     # evicts 2 (least recent)
        tier.put(b"\x05", blocks[b"\x05"])                     # evicts 3
        self.assertEqual(tier.block_hashes(), [b"\x01", b"\x04", b"\x05"])
        self.assertLessEqual(tier.bytes_used, capacity)
        self.assertEqual(tier.stats.evictions, 2)
        self.assertLen(os.listdir(tier._blocks), 3)
        for key in (b"\x01", b"\x04", b"\x05"):
            self.assertEqual(tier.read_async([(key, out)]).result(30), [True])
            np.testing.assert_array_equal(out, blocks[key])
        tier.close()
        smaller = _tier(directory, capacity_bytes=2 * tier.file_nbytes)   # reopened smaller
        self.assertEqual(smaller.block_hashes(), [b"\x04", b"\x05"])
        smaller.close()

    def test_full_budget_with_every_block_being_read_rejects_the_write(self):
        directory = self.create_tempdir().full_path
        probe = _tier(directory)
        tier = _tier(directory, capacity_bytes=probe.file_nbytes)
        probe.close()
        tier.put(b"a", _block(1, tier))
        tier._readers[b"a"] += 1                                # a read in progress
        self.assertFalse(tier.put(b"b", _block(2, tier)))
        self.assertEqual(tier.stats.rejected_writes, 1)
        tier._readers[b"a"] -= 1
        self.assertTrue(tier.put(b"b", _block(2, tier)))      # now a is evicted
        self.assertEqual(tier.block_hashes(), [b"b"])
        tier.close()

    def test_bad_input(self):
        missing = os.path.join(self.create_tempdir().full_path, "no", "such", "dir")
        with self.assertRaisesRegex(FileNotFoundError, "does not exist"):
            _tier(missing)
        tier = _tier(missing, create=True)
        self.assertTrue(os.path.isdir(tier.directory))
        with self.assertRaisesRegex(ValueError, "smaller than one block"):
            _tier(missing, capacity_bytes=100)
        with self.assertRaisesRegex(ValueError, "model_id"):
            _tier(missing, model_id="")
        with self.assertRaisesRegex(ValueError, "backend"):
            _tier(missing, backend="s3")
        with self.assertRaisesRegex(ValueError, "a block has"):
            tier.put(b"h", np.zeros(10, np.uint8))
        with self.assertRaisesRegex(ValueError, "non-empty bytes"):
            tier.put("h", _block(0, tier))
        tier.close()
        with self.assertRaisesRegex(RuntimeError, "closed"):
            tier.put(b"h", _block(0, tier))


class ReuseAndBatchTest(parameterized.TestCase):
    """Evicted files reused in place, the LRU of open files, batched reads, a waiting caller
    running queued I/O."""

    @parameterized.product(backend=["files", "nixl"], max_open_files=[0, 1, 256],
                           durable=[False, True])
    def test_evicted_files_are_reused_and_every_block_reads_back(self, backend, max_open_files,
                                                                 durable):
        if backend == "nixl" and not nixl_available():
            self.skipTest("NIXL is not installed")
        directory = self.create_tempdir().full_path
        probe = _tier(directory)
        capacity = 3 * probe.file_nbytes
        probe.close()
        tier = _tier(directory, capacity_bytes=capacity, backend=backend,
                     max_open_files=max_open_files, durable=durable)
        blocks = [_block(100 + i, tier) for i in range(9)]
        for start in (0, 3, 6):                                 # batches of 3 evict 3 each
            items = [(b"k%d" % i, [(blocks[i].ctypes.data, blocks[i].nbytes)])
                     for i in range(start, start + 3)]
            self.assertEqual(tier.write_async(items, keepalive=blocks).result(30), [True] * 3)
            outs = [np.zeros_like(blocks[0]) for _ in range(3)]
            reads = [(b"k%d" % i, [(out.ctypes.data, out.nbytes)])
                     for i, out in zip(range(start, start + 3), outs)]
            self.assertEqual(tier.read_async(reads, keepalive=outs).result(30), [True] * 3)
            for i, out in zip(range(start, start + 3), outs):
                np.testing.assert_array_equal(out, blocks[i])
        self.assertEqual(tier.block_hashes(), [b"k6", b"k7", b"k8"])
        self.assertEqual(tier.stats.evictions, 6)
        self.assertEqual(sorted(os.listdir(tier._blocks)),
                         sorted(h.hex() + ".kvb" for h in (b"k6", b"k7", b"k8")))
        self.assertEqual(os.listdir(tier._tmp), [])
        self.assertLessEqual(len(tier._fds), max_open_files)
        tier.close()
        again = _tier(directory, capacity_bytes=capacity)      # a restart reads them too
        out = np.zeros_like(blocks[0])
        for i in (6, 7, 8):
            self.assertEqual(again.read_async([(b"k%d" % i, out)]).result(30), [True])
            np.testing.assert_array_equal(out, blocks[i])
        again.close()

    @parameterized.parameters("files", "nixl")
    def test_batch_with_missing_and_corrupt_blocks(self, backend):
        if backend == "nixl" and not nixl_available():
            self.skipTest("NIXL is not installed")
        tier = _tier(self.create_tempdir().full_path, backend=backend)
        blocks = [_block(200 + i, tier) for i in range(6)]
        for i, block in enumerate(blocks):
            self.assertTrue(tier.put(b"b%d" % i, block))
        with open(tier.path_of(b"b2"), "r+b") as handle:        # the cached fd sees it
            handle.seek(_file._HEADER_BYTES + 7)
            handle.write(b"\xff\x00")
        names = [b"b0", b"b1", b"b2", b"nope", b"b4", b"b5"]
        outs = [np.zeros_like(blocks[0]) for _ in names]
        items = [(h, [(o.ctypes.data, o.nbytes)]) for h, o in zip(names, outs)]
        self.assertEqual(tier.read_async(items, keepalive=outs).result(30),
                         [True, True, False, False, True, True])
        for i in (0, 1, 4, 5):
            np.testing.assert_array_equal(outs[i], blocks[i])
        self.assertEqual(tier.stats.corrupt, 1)
        self.assertFalse(tier.contains(b"b2"))
        self.assertNotIn(b"b2", tier._fds)
        tier.close()

    def test_waiting_caller_runs_a_queued_operation(self):
        import concurrent.futures
        import threading

        tier = _tier(self.create_tempdir().full_path, num_workers=1)
        gate = concurrent.futures.Future()
        block = _block(7, tier)
        out = np.zeros_like(block)
        blocked = tier.read_async([(b"x", [(out.ctypes.data, out.nbytes)])], after=[gate])
        threads = []
        original = tier._write_batch

        def spy(*args):
            threads.append(threading.current_thread())
            return original(*args)

        tier._write_batch = spy
        write = tier.write_async([(b"x", [(block.ctypes.data, block.nbytes)])])
        self.assertEqual(write.result(10), [True])            # the one worker is busy
        self.assertEqual(threads, [threading.current_thread()])
        self.assertFalse(blocked.done())
        gate.set_result(None)
        self.assertEqual(blocked.result(10), [True])
        np.testing.assert_array_equal(out, block)
        tier.close()

    def test_read_file_now_runs_here_in_order(self):
        import threading

        cache, hosts = ot.filled_cache(_SPEC, 6, seed=31)
        tier = _tier(self.create_tempdir().full_path, num_workers=1)
        offloader = OffloadManager(cache, 3, file_tier=tier)
        offloader.offload(cache, [4, 1], [0, 1])
        # The only worker is held by an earlier read; the write queued behind it must still
        # land before the synchronous read of its block, which then runs on this thread.
        gate_open = threading.Event()
        tier._executor.submit(gate_open.wait, 10)
        write = offloader.write_file([0, 1], [b"k4", b"k1"])
        threads = []
        original = tier._read_batch

        def spy(*args):
            threads.append(threading.current_thread())
            return original(*args)

        tier._read_batch = spy
        threading.Timer(0.2, gate_open.set).start()
        self.assertEqual(offloader.read_file_now([b"k1", b"missing", b"k4"], [2, 0, 1]),
                         [True, False, True])
        self.assertEqual(write.result(10), [True, True])
        self.assertEqual(threads, [threading.current_thread()])
        self.assertFalse(offloader.slot_valid(0))               # a miss holds no block
        with self.assertRaises(UnknownSlotError):
            offloader.onboard(cache, [0], [5])
        cache = offloader.onboard(cache, [2, 1], [0, 5])
        for array, host in zip(cache.arrays, hosts):
            bits.assert_bits(np.asarray(array)[[0, 5]], host[[1, 4]])
        offloader.close()
        with self.assertRaisesRegex(RuntimeError, "closed"):
            offloader.read_file_now([b"k1"], [2])
        with self.assertRaisesRegex(RuntimeError, "closed"):
            offloader.read_file([b"k1"], [2])
        self.assertFalse(offloader.slot_valid(2))
        offloader.wait(timeout=1)           # the refused reads hold up no later copy of slot 2

    def test_onboard_waits_for_a_read_file_now_on_another_thread(self):
        import threading
        import time

        cache, hosts = ot.filled_cache(_SPEC, 6, seed=33)
        tier = _tier(self.create_tempdir().full_path)
        offloader = OffloadManager(cache, 2, file_tier=tier)
        offloader.offload(cache, [2], [0])
        self.assertEqual(offloader.write_file([0], [b"k2"]).result(10), [True])
        offloader.offload(cache, [5], [0])                      # slot 0 now holds block 5
        offloader.wait()
        started, original = threading.Event(), tier._read_batch

        def slow(*args):
            started.set()
            time.sleep(0.3)
            return original(*args)

        tier._read_batch = slow
        reader = threading.Thread(target=offloader.read_file_now, args=([b"k2"], [0]))
        reader.start()
        self.assertTrue(started.wait(10))
        cache = offloader.onboard(cache, [0], [1])              # must see the file's bytes
        reader.join(10)
        for array, host in zip(cache.arrays, hosts):
            bits.assert_bits(np.asarray(array)[1], host[2])
        offloader.close()


class ReadPathTest(parameterized.TestCase):
    """`read_async` is the one read path: numpy or region destinations, replicas, queued or
    inline, every read checked; the old read methods are deprecated aliases of it."""

    def _stored(self, count=3, **kwargs):
        tier = _tier(self.create_tempdir().full_path, **kwargs)
        blocks = [_block(300 + i, tier) for i in range(count)]
        for i, block in enumerate(blocks):
            self.assertTrue(tier.put(b"r%d" % i, block))
        return tier, blocks

    def test_numpy_and_region_destinations_and_replicas(self):
        tier, blocks = self._stored()
        out = np.zeros_like(blocks[0])
        half = tier.payload_nbytes // 2
        parts = [np.zeros(half, np.uint8), np.zeros(tier.payload_nbytes - half, np.uint8)]
        copies = [np.zeros(half, np.uint8), np.zeros(tier.payload_nbytes - half, np.uint8)]
        regions = [(p.ctypes.data, p.nbytes) for p in parts]
        replica = [(c.ctypes.data, c.nbytes) for c in copies]
        items = [(b"r0", out), (b"r1", regions), (b"gone", np.zeros_like(out))]
        future = tier.read_async(items, replicas=[[], [replica], []],
                                 keepalive=(parts, copies))
        self.assertEqual(future.result(30), [True, True, False])
        np.testing.assert_array_equal(out, blocks[0])
        np.testing.assert_array_equal(np.concatenate(parts), blocks[1])
        np.testing.assert_array_equal(np.concatenate(copies), blocks[1])   # the replica
        self.assertEqual((tier.stats.reads, tier.stats.hits, tier.stats.misses), (3, 2, 1))
        tier.close()

    @parameterized.parameters(False, True)
    def test_every_read_is_checked(self, inline):
        tier, blocks = self._stored(1)
        out = np.zeros(2 * tier.payload_nbytes, np.uint8)
        with self.assertRaisesRegex(ValueError, f"hold {tier.payload_nbytes - 1} bytes, a "
                                                f"block has {tier.payload_nbytes}"):
            tier.read_async([(b"r0", [(out.ctypes.data, tier.payload_nbytes - 1)])],
                            inline=inline)
        with self.assertRaisesRegex(ValueError, "writeable C-contiguous"):
            tier.read_async([(b"r0", out[::2])], inline=inline)            # strided
        readonly = np.zeros_like(blocks[0])
        readonly.flags.writeable = False
        with self.assertRaisesRegex(ValueError, "writeable C-contiguous"):
            tier.read_async([(b"r0", readonly)], inline=inline)
        self.assertEqual(tier.stats.reads, 0)                               # nothing was read
        # The checksum is verified on both paths: a flipped payload byte is a miss.
        with open(tier.path_of(b"r0"), "r+b") as handle:
            handle.seek(_file._HEADER_BYTES + 3)
            byte = handle.read(1)
            handle.seek(_file._HEADER_BYTES + 3)
            handle.write(bytes([byte[0] ^ 0x80]))
        with self.assertLogs("jaxkv.offload", level="WARNING"):
            got = tier.read_async([(b"r0", np.zeros_like(blocks[0]))], inline=inline)
            self.assertEqual(got.result(30), [False])
        self.assertEqual(tier.stats.corrupt, 1)
        self.assertFalse(tier.contains(b"r0"))
        tier.close()
        with self.assertRaisesRegex(RuntimeError, "closed"):
            tier.read_async([(b"r0", np.zeros_like(blocks[0]))], inline=inline)

    def test_inline_runs_on_the_calling_thread_and_keeps_the_deadline(self):
        import concurrent.futures
        import threading

        tier, blocks = self._stored(2, num_workers=1)
        tier.timeout_s = 0.3                                   # for the read that times out
        threads = []
        original = tier._read_batch

        def spy(*args):
            threads.append(threading.current_thread())
            return original(*args)

        tier._read_batch = spy
        gate_open = threading.Event()
        tier._executor.submit(gate_open.wait, 10)              # the only worker is busy
        out = np.zeros_like(blocks[1])
        future = tier.read_async([(b"r1", out)], inline=True)
        self.assertTrue(future.done())                         # ran before returning
        self.assertEqual(future.result(0), [True])
        self.assertEqual(threads, [threading.current_thread()])
        np.testing.assert_array_equal(out, blocks[1])
        # `after` is waited for on this thread, up to the tier's timeout; the error comes
        # through the (done) future and nothing is read.
        never = concurrent.futures.Future()
        late = tier.read_async([(b"r0", out)], after=[never], inline=True)
        self.assertTrue(late.done())
        with self.assertRaisesRegex(OffloadTimeoutError, "file tier I/O"):
            late.result(0)
        self.assertLen(threads, 1)
        gate_open.set()
        tier.close()

    def test_old_read_names_are_deprecated_aliases(self):
        import concurrent.futures

        tier, blocks = self._stored(2)
        out = np.zeros_like(blocks[0])
        with self.assertWarnsRegex(DeprecationWarning, r"FileTier\.get is deprecated.*"
                                                       r"read_async"):
            self.assertTrue(tier.get(b"r0", out))
        np.testing.assert_array_equal(out, blocks[0])
        with self.assertWarns(DeprecationWarning):
            self.assertFalse(tier.get(b"nope", out))
        with self.assertWarns(DeprecationWarning), self.assertRaisesRegex(
                ValueError, "writeable C-contiguous"):
            tier.get(b"r0", np.zeros(2 * tier.payload_nbytes, np.uint8)[::2])
        regions = [(out.ctypes.data, out.nbytes)]
        future = TierFuture()
        with self.assertWarnsRegex(DeprecationWarning, "queue_checked_read is deprecated"):
            self.assertIsNone(tier.queue_checked_read([(b"r1", regions, [])], [], future))
        self.assertEqual(future.result(30), [True])
        np.testing.assert_array_equal(out, blocks[1])
        with self.assertWarnsRegex(DeprecationWarning, "read_checked_now is deprecated"):
            self.assertEqual(tier.read_checked_now([(b"r0", regions, []), (b"x", regions, [])],
                                                   []), [True, False])
        never = concurrent.futures.Future()
        tier.timeout_s = 0.2
        with self.assertWarns(DeprecationWarning), self.assertRaises(OffloadTimeoutError):
            tier.read_checked_now([(b"r0", regions, [])], [never])
        tier.close()
        with self.assertWarns(DeprecationWarning), self.assertRaisesRegex(RuntimeError,
                                                                          "closed"):
            tier.read_checked_now([(b"r0", regions, [])], [])


if __name__ == "__main__":
    absltest.main()
