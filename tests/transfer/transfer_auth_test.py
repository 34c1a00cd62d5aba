"""The authenticated control plane (a deployment key): keyed engines in real processes read
from each other over both transports; a client without the key, with another key, replaying a
recorded handshake, sending garbage after a valid one, or forging another consumer's Done,
abort or a producer's Ack gets nothing and changes nothing."""

from __future__ import annotations

import logging
import os
import socket
import struct
import time

os.environ.setdefault("UCX_TLS", "tcp,sm,self")

from support import meshes, platforms, processes  # noqa: E402

platforms.force_cpu_devices()

import numpy as np  # noqa: E402
from absl.testing import absltest, parameterized  # noqa: E402
from support import transfer as tt  # noqa: E402

from jaxkv import EngineConfig, KVCacheSpec, PagedKVCache  # noqa: E402
from jaxkv.transfer import HandshakeError, load_auth_key
from jaxkv.transfer import _auth as auth  # noqa: E402
from jaxkv.transfer._control import TcpControlChannel  # noqa: E402
from jaxkv.transfer._jax_transport import jax_transfer_available  # noqa: E402
from jaxkv.transfer._messages import Ack, Done, Heartbeat, Hello, encode_message  # noqa: E402
from jaxkv.transfer._metadata import PROTOCOL_VERSION  # noqa: E402
from jaxkv.transfer._side_channel import CONTROL_MAGIC, MAGIC, MetadataServer, fetch_metadata  # noqa: E402

KEY = b"deployment-key-0123456789abcdef"
OTHER_KEY = b"another-deployment-key-987654321"
WAIT_S = 60.0
SPEC = dict(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32",
            layout="LKHTD")


def producer_main(conn, transport: str, engine_kwargs: dict) -> None:
    """A keyed producer (TP 1) whose cache holds G in `tt.REMOTE_IDS`; commands:
    ("pin", request_id, lease_s) -> TransferParams; ("pause", s): no polling;
    ("state",) -> (pinned, freed, refused messages, refused connections, log lines);
    ("exit",)."""
    processes.child_env(1)

    from jaxkv.transfer._engine import KVTransferEngine  # the core: tests reach into it

    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    logging.getLogger("jaxkv.transfer").addHandler(Collect())
    spec = KVCacheSpec(**SPEC)
    config = EngineConfig(spec, 1)
    g = tt.global_cache(spec, len(tt.REMOTE_IDS) * spec.block_size, seed=tt.G_SEED)
    arrays = tt.global_arrays(config, 0, g, tt.REMOTE_IDS, tt.NUM_BLOCKS)
    mesh = meshes.tp(1)
    freed: list[str] = []
    with KVTransferEngine("prefill", config, transport=transport, **engine_kwargs) as engine:
        engine.register_cache(PagedKVCache.from_arrays(spec, arrays, mesh=mesh))
        conn.send(("ready", engine.address))
        while True:
            if conn.poll(0.0005):
                command = conn.recv()
                if command[0] == "exit":
                    break
                if command[0] == "pin":
                    conn.send(engine.publish_request(command[1], tt.REMOTE_IDS, command[2]))
                elif command[0] == "pause":
                    time.sleep(command[1])
                    conn.send(True)
                elif command[0] == "state":
                    conn.send((engine.num_pinned, list(freed), engine.stats.refused_messages,
                               engine.server.refused_connections, list(lines)))
            freed.extend(engine.poll().freeable)


def _recv_all(sock: socket.socket, timeout: float = 5.0) -> bytes:
    """Everything the peer sends until it closes (bounded by `timeout`)."""
    sock.settimeout(timeout)
    out = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(1 << 16)
        except (ConnectionResetError, TimeoutError):
            break
        if not chunk:
            break
        out += chunk
    return out


class _Recorder:
    """A keyed control client by hand: what it sends is kept (to replay it)."""

    def __init__(self, address, key: bytes, identity: str, purpose=auth.PURPOSE_CONTROL):
        self.sock = socket.create_connection(address, timeout=5)
        self.sent = b""
        nonce = auth.new_nonce()
        self.send(auth.client_hello(purpose, PROTOCOL_VERSION, nonce, identity))
        deadline = time.monotonic() + 5
        magic = auth._recv_exact(self.sock, 4, deadline)
        assert magic == auth.AUTH_MAGIC, magic
        server_nonce = auth._recv_exact(self.sock, 32, deadline)
        k = auth.DeploymentKey(key)
        transcript = k.transcript(purpose, nonce, server_nonce, identity)
        self.send(k.client_proof(transcript))
        assert auth._recv_exact(self.sock, 36, deadline)[:4] == auth.ACCEPTED
        self.session = k.session(transcript, server=False, peer_identity="")

    def send(self, data: bytes) -> None:
        self.sent += data
        self.sock.sendall(data)

    def message(self, message) -> None:
        payload = encode_message(message)
        self.send(struct.pack("!I", len(payload)) + payload + self.session.seal(payload))

    def close(self):
        self.sock.close()


class KeyLoadingTest(absltest.TestCase):
    def test_argument_file_and_environment(self):
        path = self.create_tempfile(content="file-key-0123456789abcdef\n").full_path
        self.assertEqual(load_auth_key(path=path), b"file-key-0123456789abcdef")
        with absltest.mock.patch.dict(os.environ, {"JAXKV_AUTH_KEY_FILE": path}):
            self.assertEqual(load_auth_key(), b"file-key-0123456789abcdef")
        with absltest.mock.patch.dict(os.environ, {"JAXKV_AUTH_KEY": "env-key-0123456789ab"}):
            os.environ.pop("JAXKV_AUTH_KEY_FILE", None)
            self.assertEqual(load_auth_key(), b"env-key-0123456789ab")
            self.assertEqual(load_auth_key(KEY), KEY)  # the argument first
        with self.assertRaisesRegex(ValueError, "at least 16 bytes"):
            load_auth_key(b"short")

    def test_non_loopback_without_key_is_refused(self):
        from jaxkv.transfer._engine import KVTransferEngine  # the core: tests reach into it

        config = EngineConfig(KVCacheSpec(**SPEC), 1)
        with self.assertRaisesRegex(ValueError, "without a deployment key.*READ every"):
            KVTransferEngine("e", config, host="0.0.0.0", transport="jax")
        self.assertIn("<hidden>", repr(auth.DeploymentKey(KEY)))

    def test_session_refuses_replayed_and_reordered_messages(self):
        k = auth.DeploymentKey(KEY)
        t = k.transcript(auth.PURPOSE_CONTROL, b"a" * 32, b"b" * 32, "decode")
        client, server = k.session(t, False, ""), k.session(t, True, "decode")
        first, second = client.seal(b"one"), client.seal(b"two")
        with self.assertRaisesRegex(auth.AuthError, "MAC"):
            server.check(b"two", second)  # reordered
        server.check(b"one", first)
        with self.assertRaisesRegex(auth.AuthError, "MAC"):
            server.check(b"one", first)  # replayed
        server.check(b"two", second)
        other = auth.DeploymentKey(OTHER_KEY).session(t, True, "decode")
        with self.assertRaisesRegex(auth.AuthError, "MAC"):
            other.check(b"one", first)


class SideChannelTest(absltest.TestCase):
    """The keyed side channel in this process (the engine tests below use real processes)."""

    def setUp(self):
        super().setUp()
        self.channel = TcpControlChannel(key=auth.DeploymentKey(KEY), identity="prefill")
        self.server = MetadataServer(key=auth.DeploymentKey(KEY), on_control=self.channel.adopt,
                                     io_timeout=1.0, max_connections=4)
        self.server.publish(b"secret-metadata")
        for closable in (self.channel, self.server):
            self.addCleanup(closable.close)

    def test_unauthenticated_client_gets_nothing_and_is_closed(self):
        for magic in (MAGIC, CONTROL_MAGIC):
            with socket.create_connection(self.server.address, timeout=5) as sock:
                sock.sendall(magic + struct.pack("!I", PROTOCOL_VERSION))
                got = _recv_all(sock)
            self.assertEqual(got, auth.REFUSAL.pack(auth.REFUSED, auth.AUTH_REQUIRED))
        with self.assertRaisesRegex(HandshakeError, "requires the deployment key"):
            fetch_metadata(self.server.address, retries=0)
        # A silent client is closed at the deadline; the cap still evicts the oldest.
        socks = [socket.create_connection(self.server.address, timeout=5) for _ in range(6)]
        try:
            deadline = time.monotonic() + 5
            while self.server.open_connections and time.monotonic() < deadline:
                time.sleep(0.05)
            self.assertEqual(self.server.open_connections, 0)
        finally:
            for sock in socks:
                sock.close()
        self.assertEqual(self.server.requests_served, 0)

    def test_wrong_key_is_refused_naming_the_mismatch(self):
        with self.assertRaisesRegex(HandshakeError, "auth key mismatch"):
            fetch_metadata(self.server.address, retries=3, key=auth.DeploymentKey(OTHER_KEY),
                           identity="mallory")
        with self.assertRaisesRegex(HandshakeError, "has no deployment key"):
            plain = MetadataServer()
            self.addCleanup(plain.close)
            plain.publish(b"x")
            fetch_metadata(plain.address, retries=0, key=auth.DeploymentKey(KEY), identity="d")
        other = TcpControlChannel(key=auth.DeploymentKey(OTHER_KEY), identity="mallory")
        self.addCleanup(other.close)
        with self.assertRaisesRegex(ConnectionError, "auth key mismatch"):
            other.connect(self.server.address, "p", "p")
        self.assertGreaterEqual(self.server.refused_connections, 2)
        self.assertEqual(self.server.requests_served, 0)
        self.assertEqual(self.channel.receive(), [])

    def test_keyed_fetch_and_messages_both_ways(self):
        key = auth.DeploymentKey(KEY)
        consumer = TcpControlChannel(key=key, identity="decode")
        self.addCleanup(consumer.close)
        target = consumer.connect(self.server.address, "p", "p")
        for payload in (b"one", b"two" * 1000):
            self.assertTrue(consumer.send(target, payload))
        got = tt.receive_messages(self.channel, 2)
        self.assertEqual([p for _, p in got], [b"one", b"two" * 1000])
        sender = got[0][0]
        self.assertEqual(self.channel.identity(sender), "decode")
        self.assertTrue(self.channel.send(self.channel.accept("a", sender, b""), b"back"))
        self.assertEqual([p for _, p in tt.receive_messages(consumer, 1)], [b"back"])

    def test_replayed_handshake_and_garbage_after_a_valid_one(self):
        recorder = _Recorder(self.server.address, KEY, "decode")
        recorder.message(Heartbeat("r", "decode"))
        self.assertEqual(len(tt.receive_messages(self.channel, 1)), 1)
        recorded = recorder.sent
        recorder.close()
        # The same bytes on a new connection: the server's nonce is new, the proof is not.
        with socket.create_connection(self.server.address, timeout=5) as sock:
            sock.sendall(recorded)
            got = _recv_all(sock)
        self.assertEqual(got[:4], auth.AUTH_MAGIC)  # a fresh challenge, then the refusal
        self.assertEqual(got[36:], auth.REFUSAL.pack(auth.REFUSED, auth.KEY_MISMATCH))
        # A valid handshake, then garbage, a replayed frame: closed, nothing delivered.
        for tail in (os.urandom(64), None):
            recorder = _Recorder(self.server.address, KEY, "decode")
            payload = encode_message(Heartbeat("r", "decode"))
            frame = struct.pack("!I", len(payload)) + payload + recorder.session.seal(payload)
            recorder.send(frame)
            recorder.send(tail if tail is not None else frame)  # garbage or the frame again
            recorder.sock.settimeout(5)
            self.assertEqual(_recv_all(recorder.sock), b"")  # closed by the channel
            recorder.close()
            # the first only
            self.assertEqual(len(tt.receive_messages(self.channel, 2, timeout=0.5)), 1)


class KeyedEngineTest(tt.TransferTestBase):
    """A keyed producer process and consumer engines in this process."""

    def start_producer(self, transport, **engine_kwargs):
        process, parent = processes.spawn(producer_main, transport, engine_kwargs)
        self._children.append((process, parent))
        return parent, tt.TransferTestBase.ready(parent)[1]

    def consumer(self, transport, engine_id="decode", **kwargs):
        from jaxkv.transfer._engine import KVTransferEngine  # the core: tests reach into it

        config = EngineConfig(KVCacheSpec(**SPEC), 1)
        engine = KVTransferEngine(engine_id, config, transport=transport, **kwargs)
        self._engines.append(engine)
        cache = PagedKVCache.allocate(config.spec, tt.NUM_BLOCKS, mesh=meshes.tp(1))
        engine.register_cache(cache)
        return engine, cache, config

    def check_read(self, engine, cache, config, params, read_id):
        engine.start_read(params, tt.LOCAL_IDS, read_id=read_id)
        finished, failed = tt.TransferTestBase.wait(engine, [read_id])
        self.assertEqual((finished, failed), ([read_id], []))
        g = tt.global_cache(config.spec, len(tt.REMOTE_IDS) * config.spec.block_size,
                            seed=tt.G_SEED)
        tt.TransferTestBase.check_cache(self, cache, config, g, tt.LOCAL_IDS)

    def wait_freed(self, conn, request_id):
        deadline = time.monotonic() + WAIT_S
        state = tt.TransferTestBase.call(conn, "state")
        while request_id not in state[1] and time.monotonic() < deadline:
            time.sleep(0.02)
            state = tt.TransferTestBase.call(conn, "state")
        self.assertIn(request_id, state[1])
        return state

    @parameterized.parameters("jax", "nixl")
    def test_keyed_peers_read_bit_exact(self, transport):
        if transport == "nixl" and not _nixl():
            self.skipTest("NIXL is not installed")
        if transport == "jax" and not jax_transfer_available():
            self.skipTest("no jax.experimental.transfer")
        conn, _ = self.start_producer(transport, auth_key=KEY)
        engine, cache, config = self.consumer(transport, auth_key=KEY)
        params = tt.TransferTestBase.call(conn, "pin", "req-1", 30.0)
        self.check_read(engine, cache, config, params, "read-1")
        state = self.wait_freed(conn, "req-1")
        self.assertEqual((state[0], state[2], state[3]), (0, 0, 0))

    @parameterized.parameters((None, "requires the deployment key"),
                              (OTHER_KEY, "auth key mismatch"))
    def test_key_mismatch_fails_fast_on_both_sides(self, consumer_key, words):
        if not jax_transfer_available():
            self.skipTest("no jax.experimental.transfer")
        conn, _ = self.start_producer("jax", auth_key=KEY)
        engine, cache, _ = self.consumer("jax", auth_key=consumer_key, handshake_retries=5)
        params = tt.TransferTestBase.call(conn, "pin", "req-2", 30.0)
        t0 = time.monotonic()
        engine.start_read(params, tt.LOCAL_IDS, read_id="read-2")
        _, failed = tt.TransferTestBase.wait(engine, ["read-2"], timeout=WAIT_S)
        self.assertLess(time.monotonic() - t0, 3.0)  # not retried, no read timeout
        self.assertEqual(len(failed), 1)
        self.assertRegex(failed[0].reason, words)
        self.assertFalse(np.asarray(cache.arrays[0]).any())  # nothing read
        pinned, freed, _, refused, lines = tt.TransferTestBase.call(conn, "state")
        self.assertEqual((pinned, freed), (1, []))
        self.assertGreaterEqual(refused, 1)
        self.assertTrue(any("auth key mismatch" in line for line in lines), lines)

    def test_forged_done_abort_and_ack_change_nothing(self):
        if not jax_transfer_available():
            self.skipTest("no jax.experimental.transfer")
        conn, address = self.start_producer("jax", auth_key=KEY)
        engine, cache, config = self.consumer("jax", auth_key=KEY)
        params = tt.TransferTestBase.call(conn, "pin", "req-3", 30.0)
        # The victim's read waits on the producer, which stops polling for a while.
        conn.send(("pause", 2.0))
        engine.start_read(params, tt.LOCAL_IDS, read_id="victim-read")
        victim_agent = engine.transport.endpoint
        # A keyed member of the deployment ("mallory") forges the victim's messages to the
        # producer: Done (ok and not ok: an abort) and heartbeats under the victim's engine
        # id and agent, on its own connection (introduced as itself, then as the victim).
        forger = _Recorder(tuple(address), KEY, "mallory")
        forger.message(Hello("mallory", 0, "mallory/1/1", b""))
        forger.message(Hello("decode", 0, victim_agent, b""))  # refused: not its identity
        for ok in (True, False):
            for agent in (victim_agent, "mallory/1/1"):
                forger.message(Done("req-3", "decode", agent, 0, 0, 1, ok, 0,
                                    params.generation, "victim-read"))
        forger.message(Heartbeat("req-3", "decode"))
        # ... and Acks to the victim (refusing its read) over the victim's own side channel.
        to_victim = _Recorder(engine.address, KEY, "mallory")
        # Attempt numbers count per process (earlier tests of this process used some): forge
        # the victim's own, which a forger could guess.
        attempt = next(a for a, r in engine.consumer.by_attempt.items()
                       if r.read_id == "victim-read")
        to_victim.message(Ack("req-3", 0, 0, False, attempt, False, True))
        assert conn.poll(WAIT_S)
        assert conn.recv() is True  # the producer polls again
        finished, failed = tt.TransferTestBase.wait(engine, ["victim-read"])
        self.assertEqual((finished, failed), (["victim-read"], []))
        g = tt.global_cache(config.spec, len(tt.REMOTE_IDS) * config.spec.block_size,
                            seed=tt.G_SEED)
        tt.TransferTestBase.check_cache(self, cache, config, g, tt.LOCAL_IDS)
        self.assertGreaterEqual(engine.stats.refused_messages, 1)
        state = self.wait_freed(conn, "req-3")
        self.assertEqual(state[0], 0)
        self.assertGreaterEqual(state[2], 6)  # every forged message refused
        forger.close()
        to_victim.close()

    def test_forged_done_never_releases_the_lease_early(self):
        if not jax_transfer_available():
            self.skipTest("no jax.experimental.transfer")
        conn, address = self.start_producer("jax", auth_key=KEY)
        engine, cache, config = self.consumer("jax", auth_key=KEY)
        engine.add_peer("prefill", [tuple(address)])  # the victim said Hello
        params = tt.TransferTestBase.call(conn, "pin", "req-4", 30.0)
        forger = _Recorder(tuple(address), KEY, "mallory")
        forger.message(Hello("mallory", 0, "mallory/1/1", b""))
        for ok in (True, False):
            forger.message(Done("req-4", "decode", engine.transport.endpoint, 0, 0, 1, ok,
                                0, params.generation, "victim-read"))
        time.sleep(1.0)
        pinned, freed, refused, _, _ = tt.TransferTestBase.call(conn, "state")
        self.assertEqual((pinned, freed), (1, []))  # still pinned for the victim
        self.assertGreaterEqual(refused, 2)
        self.check_read(engine, cache, config, params, "victim-read")
        self.wait_freed(conn, "req-4")
        forger.close()


def _nixl() -> bool:
    from jaxkv.transfer import nixl_available

    return nixl_available()


if __name__ == "__main__":
    absltest.main()
