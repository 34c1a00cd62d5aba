"""Engine metadata wire format and the side channel (no NIXL needed)."""

from __future__ import annotations

import socket
import struct
import threading
import time

import msgspec
from absl.testing import absltest
from support import transfer as tt

from jaxkv import EngineConfig, KVCacheSpec
from jaxkv.transfer import HandshakeError, IncompatibleEngineError
from jaxkv.transfer._metadata import (
    MetadataError,
    check_compatible,
    decode_metadata,
    encode_metadata,
)
from jaxkv.transfer._side_channel import MetadataServer, fetch_metadata

SPEC = KVCacheSpec(4, 4, 8, 4, "bfloat16", layout="LKHTD")


def _meta(engine_id="prefill", generation=0, spec=SPEC, tp=2, pp=1):
    return tt.fake_metadata(engine_id, EngineConfig(spec, tp, pp), 32, generation)


class MetadataTest(absltest.TestCase):
    def test_round_trip(self):
        meta = _meta()
        payload = encode_metadata(meta)
        self.assertEqual(decode_metadata(payload), meta)
        self.assertEqual(decode_metadata(payload, expected_engine_id="prefill"), meta)
        self.assertLen(meta.compat_hash, 64)

    def test_wrong_engine_id(self):
        with self.assertRaisesRegex(MetadataError, "expected 'decode', the peer is 'prefill'"):
            decode_metadata(encode_metadata(_meta()), expected_engine_id="decode")

    def test_malformed(self):
        for payload in (
            b"",
            b"\x00garbage",
            msgspec.msgpack.encode({"engine_id": "x"}),
            msgspec.msgpack.encode([1, 2, 3]),
        ):
            with self.assertRaisesRegex(MetadataError, "malformed"):
                decode_metadata(payload)

    def test_schema_violations(self):
        raw = msgspec.to_builtins(_meta(), builtin_types=(bytes,))
        for field, value, pattern in [
            ("tp_size", 0, "tp_size"),
            ("engine_id", "", "engine_id"),
            ("block_size", "16", "block_size"),
            ("compat_hash", "zz", "compat_hash"),
            ("unknown_field", 1, "unknown_field"),
        ]:
            bad = dict(raw, **{field: value})
            with self.assertRaisesRegex(MetadataError, pattern):
                decode_metadata(msgspec.msgpack.encode(bad))

    def test_inconsistent_fields(self):
        raw = msgspec.to_builtins(_meta(), builtin_types=(bytes,))
        with self.assertRaisesRegex(MetadataError, "compat_hash"):
            decode_metadata(msgspec.msgpack.encode(dict(raw, head_dim=16)))
        with self.assertRaisesRegex(MetadataError, "protocol version 9"):
            decode_metadata(msgspec.msgpack.encode(dict(raw, version=9)))
        region = raw["ranks"][1]["regions"][0]
        region["block_len"] += 1
        with self.assertRaisesRegex(MetadataError, "rank 1 region 0: block_len"):
            decode_metadata(msgspec.msgpack.encode(raw))

    def test_oversized(self):
        with self.assertRaisesRegex(MetadataError, "above the 100 limit"):
            decode_metadata(encode_metadata(_meta()), max_bytes=100)

    def test_incompatible_names_fields(self):
        other = _meta("decode", spec=SPEC.replace(head_dim=16, dtype="float32"))
        with self.assertRaisesRegex(
            IncompatibleEngineError, r"head_dim: local 8, remote 16.*dtype: local 'bfloat16'"
        ):
            check_compatible(_meta(), other)
        check_compatible(_meta(), _meta("decode", spec=SPEC.replace(layout="THD"), tp=4, pp=2))


class PackedFieldsTest(absltest.TestCase):
    """The storage fields of tpu-inference's packed caches travel in the metadata and are
    validated against one another on decode."""

    PACKED = KVCacheSpec.for_tpu_inference(2, num_kv_heads=3, head_dim=96, page_size=8,
                                           dtype="float8_e4m3fn")

    def test_round_trip_carries_the_storage(self):
        meta = _meta(spec=self.PACKED, tp=3)
        decoded = decode_metadata(encode_metadata(meta))
        self.assertEqual(decoded, meta)
        self.assertEqual(
            (decoded.kv_interleaved, decoded.packing, decoded.packed_axis,
             decoded.head_dim_alignment, decoded.stored_head_dim, decoded.stored_layout),
            (True, 4, "H", 128, 128, "THhD"),
        )
        self.assertEqual(decoded.spec(), self.PACKED)
        self.assertTrue(decoded.padded)
        # each rank's region is its padded block: 1 head -> 2 combined in one 4-value word
        self.assertEqual(decoded.ranks[0].regions[0].block_len,
                         self.PACKED.block_nbytes(3))
        self.assertEqual(self.PACKED.block_shape(3), (8, 1, 4, 128))
        mla = KVCacheSpec.for_tpu_inference_mla(2, latent_dim=72, page_size=6)
        decoded = decode_metadata(encode_metadata(_meta(spec=mla, tp=2)))
        self.assertEqual((decoded.packed_axis, decoded.packing, decoded.stored_layout,
                          decoded.stored_head_dim), ("T", 2, "TtD", 128))
        self.assertEqual(decoded.spec(), mla)
        plain = decode_metadata(encode_metadata(_meta()))
        self.assertEqual((plain.kv_interleaved, plain.packing, plain.stored_layout,
                          plain.stored_head_dim, plain.padded), (False, None, "LKHTD", 8, False))

    def test_inconsistent_packed_description_names_the_field(self):
        raw = msgspec.to_builtins(_meta(spec=self.PACKED, tp=3), builtin_types=(bytes,))
        for changes, pattern in [
            (dict(stored_layout="THD"), "stored_layout 'THD'"),
            (dict(stored_head_dim=96), "stored_head_dim 96"),
            (dict(head_dim_alignment=256), "stored_head_dim 128 is not head_dim 96 aligned"),
            (dict(packing=2), "region 0: block_len"),  # the regions are 4-packed
            (dict(packing=3), "packing"),
            (dict(packing=0), "packing"),
            (dict(packed_axis="D"), "packed_axis"),
            (dict(packed_axis="T", stored_layout="TtHD"), "region 0: block_len"),
            (dict(kv_interleaved=False), "has 2 regions, its layout THD needs 4"),
            (dict(layout="KTHD"), "kv_interleaved"),
            (dict(head_dim_alignment=0), "head_dim_alignment"),
        ]:
            with self.subTest(changes=changes), self.assertRaisesRegex(MetadataError, pattern):
                decode_metadata(msgspec.msgpack.encode(dict(raw, **changes)))

    def test_packed_and_unpacked_engines_are_compatible(self):
        check_compatible(_meta(spec=self.PACKED, tp=3),
                         _meta("decode", spec=self.PACKED.replace(
                             layout="KHTD", kv_interleaved=False, packing=None,
                             head_dim_alignment=1), tp=1))


class TransportFieldTest(absltest.TestCase):
    def test_transport_must_match_and_is_validated(self):
        jax_meta = msgspec.structs.replace(_meta("decode"), transport="jax")
        self.assertEqual(_meta().transport, "nixl")
        self.assertEqual(decode_metadata(encode_metadata(jax_meta)).transport, "jax")
        with self.assertRaisesRegex(
            IncompatibleEngineError,
            r"transport: 'prefill' moves KV over 'nixl', 'decode' over 'jax'",
        ):
            check_compatible(jax_meta, _meta())
        check_compatible(jax_meta, msgspec.structs.replace(_meta(), transport="jax"))
        with self.assertRaises(MetadataError):  # a bounded identifier
            decode_metadata(
                encode_metadata(msgspec.structs.replace(_meta(), transport="NIXL; rm -rf"))
            )


class BlockHashingTest(absltest.TestCase):
    def test_compatibility(self):
        def meta(engine_id, hashing):
            return msgspec.structs.replace(_meta(engine_id), block_hashing=hashing)

        producer = meta("prefill", "sha256_cbor:seed=ab12")
        decoded = decode_metadata(encode_metadata(producer))
        self.assertEqual(decoded.block_hashing, "sha256_cbor:seed=ab12")
        with self.assertRaisesRegex(
            IncompatibleEngineError,
            r"block hashing differs: 'prefill' uses 'sha256_cbor:seed=ab12', 'decode' uses "
            r"'sha256:seed=ab12'",
        ):
            check_compatible(meta("decode", "sha256:seed=ab12"), producer)
        check_compatible(meta("decode", "sha256_cbor:seed=ab12"), producer)
        check_compatible(meta("decode", None), producer)  # undeclared on one side
        check_compatible(producer, meta("decode", None))
        with self.assertRaises(MetadataError):  # bounded like every string field
            decode_metadata(encode_metadata(meta("decode", "x" * 2000)))


class SideChannelTest(absltest.TestCase):
    def test_fetch(self):
        with MetadataServer() as server:
            server.publish(_meta())
            meta = fetch_metadata(server.address, expected_engine_id="prefill", timeout=2)
            self.assertEqual(meta.generation, 0)
            server.publish(_meta(generation=3))  # restart: a new generation is served
            self.assertEqual(fetch_metadata(server.address, timeout=2).generation, 3)

    def test_refused_payloads_are_not_retried(self):
        with MetadataServer() as server:
            server.publish(b"\x93garbage")
            start = time.monotonic()
            with self.assertRaisesRegex(HandshakeError, "metadata refused: malformed"):
                fetch_metadata(server.address, timeout=2, retries=5, backoff=1.0)
            self.assertLess(time.monotonic() - start, 1.0)
            server.publish(_meta())
            with self.assertRaisesRegex(HandshakeError, "wrong engine"):
                fetch_metadata(server.address, expected_engine_id="other", timeout=2)

    def test_nothing_listening(self):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        sock.close()
        start = time.monotonic()
        with self.assertRaisesRegex(HandshakeError, "after 3 attempts"):
            fetch_metadata(("127.0.0.1", port), timeout=0.5, retries=2, backoff=0.01)
        self.assertLess(time.monotonic() - start, 3)

    def test_silent_peer_times_out(self):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)  # accepts connections (kernel backlog) but never answers
        try:
            start = time.monotonic()
            with self.assertRaisesRegex(HandshakeError, "after 2 attempts"):
                fetch_metadata(sock.getsockname(), timeout=0.3, retries=1, backoff=0.01)
            self.assertLess(time.monotonic() - start, 2)
        finally:
            sock.close()

    def test_oversized_reply_refused_before_reading(self):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)

        def serve():
            conn, _ = sock.accept()
            with conn:
                conn.recv(8)
                conn.sendall(struct.pack("!4sQ", b"JKVM", 1 << 40))

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        try:
            with self.assertRaisesRegex(HandshakeError, "above the"):
                fetch_metadata(sock.getsockname(), timeout=2)
        finally:
            thread.join(timeout=5)
            sock.close()

    def test_server_survives_bad_clients(self):
        with MetadataServer(io_timeout=0.2) as server:
            server.publish(_meta())
            with socket.create_connection(server.address, timeout=1) as conn:
                conn.sendall(b"HELLO???")
            with socket.create_connection(server.address, timeout=1):
                pass  # connects and says nothing
            self.assertEqual(fetch_metadata(server.address, timeout=2).engine_id, "prefill")


    def test_silent_clients_do_not_delay_a_handshake(self):
        # 16 clients send 3 bytes and go quiet; their deadline (30 s) is far beyond the good
        # client's whole budget (5 s, no retry): a server that served them one at a time
        # would make it fail, and they must still be open (unanswered) once it succeeded.
        with MetadataServer(io_timeout=30.0) as server:
            server.publish(_meta())
            silent = [socket.create_connection(server.address, timeout=2) for _ in range(16)]
            try:
                for sock in silent:
                    sock.sendall(b"JKV")
                _wait_for(lambda: server.open_connections == 16)
                start = time.monotonic()
                meta = fetch_metadata(server.address, timeout=5, retries=0)
                elapsed = time.monotonic() - start
                self.assertEqual(meta.engine_id, "prefill")
                self.assertLess(elapsed, 5.0)
                # The good client's connection closes on the server's side just after the
                # client got its answer: wait for that, then exactly the 16 silent ones remain.
                _wait_for(lambda: server.open_connections == 16)
                self.assertEqual(server.open_connections, 16)
                for sock in silent:
                    sock.setblocking(False)
                    with self.assertRaises(BlockingIOError):  # neither answered nor closed
                        sock.recv(1)
                print(f"handshake beside 16 silent clients: {elapsed * 1e3:.1f} ms")
            finally:
                for sock in silent:
                    sock.close()

    def test_connection_deadline(self):
        with MetadataServer(io_timeout=0.3) as server:
            server.publish(_meta())
            with socket.create_connection(server.address, timeout=5) as sock:
                start = time.monotonic()
                sock.sendall(b"JK")
                self.assertEqual(sock.recv(1), b"")  # closed by the server, unanswered
                self.assertGreater(time.monotonic() - start, 0.2)
            _wait_for(lambda: server.open_connections == 0)
            self.assertGreaterEqual(server.dropped_connections, 1)

    def test_connection_cap_closes_the_oldest(self):
        with MetadataServer(io_timeout=30.0, max_connections=4) as server:
            server.publish(_meta())
            silent = [socket.create_connection(server.address, timeout=2) for _ in range(6)]
            try:
                _wait_for(lambda: server.dropped_connections >= 2)
                self.assertLessEqual(server.open_connections, 4)
                self.assertEqual(silent[0].recv(1), b"")  # the oldest was closed
                self.assertEqual(fetch_metadata(server.address, timeout=5).engine_id, "prefill")
            finally:
                for sock in silent:
                    sock.close()

    def test_garbage_and_oversized_requests_are_dropped(self):
        with MetadataServer(io_timeout=5.0) as server:
            server.publish(_meta())
            for garbage in (b"GARBAGE!", b"GARBAGE!" + b"x" * 100_000):
                with socket.create_connection(server.address, timeout=5) as sock:
                    sock.sendall(garbage)
                    try:
                        answer = sock.recv(16)
                    except ConnectionResetError:  # closed with unread bytes: a reset
                        answer = b""
                    self.assertEqual(answer, b"")  # closed without an answer
            _wait_for(lambda: server.open_connections == 0)
            self.assertEqual(server.requests_served, 0)
            self.assertEqual(fetch_metadata(server.address, timeout=2).engine_id, "prefill")


def _wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        time.sleep(0.005)


if __name__ == "__main__":
    absltest.main()
