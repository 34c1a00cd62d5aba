"""The file tier's native I/O (jaxkv._file_io): the striped CRC-32C payload checksum against an
independent bitwise reference, and batched block-file reads (short files, bad fds, many regions,
several threads)."""

import errno
import os
import tempfile

import numpy as np
from absl.testing import absltest, parameterized
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxkv import _file_io


def _crc32c_reference(data: bytes) -> int:
    """CRC-32C, bit by bit (RFC 3720 B.4): reflected polynomial 0x82F63B78."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def _checksum_reference(payload: bytes) -> bytes:
    """Four stripes of ceil(n / 4) bytes rounded up to 64, each CRC-32C'd, big-endian."""
    stripe = (len(payload) + 3) // 4
    stripe = (stripe + 63) // 64 * 64
    return b"".join(_crc32c_reference(payload[k * stripe:(k + 1) * stripe]).to_bytes(4, "big")
                    for k in range(4))


def _regions(array: np.ndarray, cuts) -> list[tuple[int, int]]:
    """Regions covering `array` in order, cut at the sorted offsets `cuts` (empty ones kept)."""
    bounds = [0, *sorted(cuts), array.nbytes]
    return [(array.ctypes.data + a, b - a) for a, b in zip(bounds, bounds[1:])]


class ChecksumTest(parameterized.TestCase):

    def test_known_answer(self):
        data = np.frombuffer(b"123456789", np.uint8).copy()
        for software in (False, True):
            got = _file_io.checksum([(data.ctypes.data, 9)], software=software)
            # RFC 3720's check value in the first stripe; the other three are empty (CRC 0).
            self.assertEqual(got.hex(), "e3069283" + "00000000" * 3)

    def test_stripe_bytes(self):
        self.assertEqual(_file_io.stripe_bytes(0), 0)
        self.assertEqual(_file_io.stripe_bytes(9), 64)
        self.assertEqual(_file_io.stripe_bytes(256), 64)
        self.assertEqual(_file_io.stripe_bytes(257), 128)
        self.assertEqual(_file_io.stripe_bytes(512 << 10), 128 << 10)

    @settings(max_examples=60, deadline=None)
    @given(data=st.binary(min_size=0, max_size=1500),
           cut_fractions=st.lists(st.floats(0, 1), max_size=6),
           software=st.booleans())
    def test_matches_reference_for_any_regions(self, data, cut_fractions, software):
        array = np.frombuffer(data, np.uint8).copy() if data else np.zeros(0, np.uint8)
        cuts = [int(f * len(data)) for f in cut_fractions]
        got = _file_io.checksum(_regions(array, cuts), software=software)
        self.assertEqual(got, _checksum_reference(data))

    @parameterized.parameters(1, 7, 64, 4096, 1 << 20, (1 << 20) + 13)
    def test_hardware_and_software_agree(self, nbytes):
        array = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
        whole = [(array.ctypes.data, nbytes)]
        expected = _file_io.checksum(whole, software=True)
        self.assertEqual(_file_io.checksum(whole), expected)
        cuts = np.random.default_rng(1).integers(0, nbytes + 1, 5).tolist()
        self.assertEqual(_file_io.checksum(_regions(array, cuts)), expected)

    def test_detects_any_single_bit_flip(self):
        array = np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8)
        regions = [(array.ctypes.data, array.nbytes)]
        clean = _file_io.checksum(regions)
        for position in range(0, array.nbytes * 8, 97):
            array[position // 8] ^= 1 << (position % 8)
            self.assertNotEqual(_file_io.checksum(regions), clean, position)
            array[position // 8] ^= 1 << (position % 8)
        self.assertEqual(_file_io.checksum(regions), clean)

    def test_bad_regions_are_refused(self):
        with self.assertRaisesRegex(ValueError, "nbytes >= 0"):
            _file_io.checksum([(4096, -1)])
        with self.assertRaisesRegex(ValueError, "non-null"):
            _file_io.checksum([(0, 16)])


class ReadBlocksTest(parameterized.TestCase):

    def setUp(self):
        super().setUp()
        self.directory = self.create_tempdir().full_path
        self.rng = np.random.default_rng(0)

    def _file(self, name: str, content: bytes) -> int:
        path = os.path.join(self.directory, name)
        with open(path, "wb") as handle:
            handle.write(content)
        fd = os.open(path, os.O_RDONLY)
        self.addCleanup(os.close, fd)
        return fd

    @parameterized.parameters(1, 2, 8)
    def test_reads_headers_and_payloads_exactly(self, threads):
        header_bytes, payload_bytes, count = 64, 3000, 5
        contents = [self.rng.integers(0, 256, header_bytes + payload_bytes, dtype=np.uint8)
                    for _ in range(count)]
        fds = [self._file(f"b{i}", c.tobytes()) for i, c in enumerate(contents)]
        heads = [bytearray(header_bytes) for _ in range(count)]
        outs = [np.zeros(payload_bytes, np.uint8) for _ in range(count)]
        # Each payload lands in three regions of its output (the middle one empty).
        regions = [_regions(out, [1000, 1000]) for out in outs]
        got = _file_io.read_blocks(fds, heads, regions, threads)
        for content, head, out, (nbytes, checksum) in zip(contents, heads, outs, got):
            self.assertEqual(nbytes, header_bytes + payload_bytes)
            self.assertEqual(bytes(head), content[:header_bytes].tobytes())
            np.testing.assert_array_equal(out, content[header_bytes:])
            self.assertEqual(checksum, _file_io.checksum([(out.ctypes.data, out.nbytes)]))

    def test_short_file_reports_bytes_read_and_no_checksum(self):
        fd = self._file("short", bytes(range(100)))
        head, out = bytearray(64), np.zeros(100, np.uint8)
        [(nbytes, checksum)] = _file_io.read_blocks(
            [fd], [head], [[(out.ctypes.data, out.nbytes)]])
        self.assertEqual(nbytes, 100)
        self.assertIsNone(checksum)
        np.testing.assert_array_equal(out[:36], np.arange(64, 100, dtype=np.uint8))

    def test_more_regions_than_one_preadv_takes(self):
        payload = self.rng.integers(0, 256, 64 * 3000, dtype=np.uint8)
        fd = self._file("many", payload.tobytes())
        out = np.zeros_like(payload)
        regions = [(out.ctypes.data + 64 * i, 64) for i in range(3000)]  # > IOV_MAX (1024).
        [(nbytes, checksum)] = _file_io.read_blocks([fd], [bytearray(0)], [regions])
        self.assertEqual(nbytes, payload.nbytes)
        np.testing.assert_array_equal(out, payload)
        self.assertEqual(checksum, _file_io.checksum([(payload.ctypes.data, payload.nbytes)]))

    def test_bad_fd_raises_oserror(self):
        out = np.zeros(16, np.uint8)
        fd, path = tempfile.mkstemp(dir=self.directory)
        os.close(fd)
        with self.assertRaises(OSError) as raised:
            _file_io.read_blocks([fd], [bytearray(8)], [[(out.ctypes.data, 16)]])
        self.assertEqual(raised.exception.errno, errno.EBADF)
        del path

    def test_bad_arguments(self):
        out = np.zeros(16, np.uint8)
        with self.assertRaisesRegex(ValueError, "same length"):
            _file_io.read_blocks([0, 1], [bytearray(8)], [[(out.ctypes.data, 16)]])
        with self.assertRaises(BufferError):  # A read-only header buffer.
            _file_io.read_blocks([0], [b"12345678"], [[(out.ctypes.data, 16)]])
        with self.assertRaisesRegex(ValueError, "nbytes >= 0"):
            _file_io.read_blocks([0], [bytearray(8)], [[(out.ctypes.data, -16)]])


if __name__ == "__main__":
    absltest.main()
