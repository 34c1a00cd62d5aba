"""The TCP control channel: persistent connections to a side channel, framed messages."""

import socket
import struct
import time

from absl.testing import absltest
from support import transfer as tt

from jaxkv.transfer._control import TcpControlChannel
from jaxkv.transfer._messages import MAX_MESSAGE_BYTES
from jaxkv.transfer._side_channel import CONTROL_MAGIC, MetadataServer


class TcpControlChannelTest(absltest.TestCase):
    def setUp(self):
        super().setUp()
        self.calls = 0
        self.producer = TcpControlChannel(on_message=self._count)
        self.consumer = TcpControlChannel()
        self.server = MetadataServer(on_control=self.producer.adopt)
        for closable in (self.consumer, self.producer, self.server):
            self.addCleanup(closable.close)

    def _count(self):
        self.calls += 1

    def test_both_directions_in_order_and_exact(self):
        target = self.consumer.connect(self.server.address, "producer/1", "producer/1")
        self.assertEqual(target, self.consumer.connect(self.server.address, "p", "p"))  # reused
        # The engine is told as messages arrive (without polling the channel).
        self.assertTrue(self.consumer.send(target, b"first"))
        deadline = time.monotonic() + 5
        while not self.calls and time.monotonic() < deadline:
            time.sleep(0.001)
        self.assertGreater(self.calls, 0)
        self.assertEqual([p for _, p in self.producer.receive()], [b"first"])
        payloads = [bytes([i % 251]) * (i * 37 % 5000) for i in range(200)]
        for payload in payloads:
            self.assertTrue(self.consumer.send(target, payload))
        got = tt.receive_messages(self.producer, len(payloads))
        self.assertEqual([p for _, p in got], payloads)
        sender = got[0][0]
        self.assertEqual({s for s, _ in got}, {sender})
        # The producer answers on the connection the messages came on.
        back = self.producer.accept("consumer/1", sender, b"")
        self.assertTrue(self.producer.send(back, b"ack"))
        self.assertEqual(tt.receive_messages(self.consumer, 1), [(target, b"ack")])

    def test_large_burst_is_queued_not_lost(self):
        target = self.consumer.connect(self.server.address, "p", "p")
        big = b"x" * 60000
        for _ in range(100):  # 6 MB: more than the socket buffers take at once
            self.assertTrue(self.consumer.send(target, big))
        got = tt.receive_messages(self.producer, 100, timeout=20)
        self.assertEqual(len(got), 100)
        self.assertTrue(all(p == big for _, p in got))

    def test_oversized_frame_closes_the_connection(self):
        with socket.create_connection(self.server.address, timeout=5) as sock:
            sock.sendall(CONTROL_MAGIC + struct.pack("!I", 2))
            sock.sendall(struct.pack("!I", 3) + b"abc")
            sock.sendall(struct.pack("!I", MAX_MESSAGE_BYTES + 1) + b"y" * 100)
            self.assertEqual([p for _, p in tt.receive_messages(self.producer, 1)], [b"abc"])
            sock.settimeout(5)
            self.assertEqual(sock.recv(16), b"")  # closed by the channel
        self.assertEqual(self.producer.open_connections, 0)
        self.assertEqual(tt.receive_messages(self.producer, 1, timeout=0.2), [])

    def test_accept_unknown_sender_and_send_to_gone_target(self):
        with self.assertRaisesRegex(ValueError, "no control connection"):
            self.producer.accept("consumer/1", "tcp-in:999", b"")
        self.assertFalse(self.producer.send("tcp-in:999", b"x"))
        target = self.consumer.connect(self.server.address, "p", "p")
        self.consumer.forget(target)
        self.assertFalse(self.consumer.send(target, b"x"))

    def test_connect_failure_is_a_connection_error(self):
        with socket.socket() as free:
            free.bind(("127.0.0.1", 0))
            port = free.getsockname()[1]
        with self.assertRaisesRegex(ConnectionError, "control connection"):
            self.consumer.connect(("127.0.0.1", port), "p", "p")

    def test_server_without_handler_drops_control_connections(self):
        plain = MetadataServer()
        self.addCleanup(plain.close)
        with socket.create_connection(plain.address, timeout=5) as sock:
            sock.sendall(CONTROL_MAGIC + struct.pack("!I", 2))
            sock.settimeout(5)
            self.assertEqual(sock.recv(16), b"")

    def test_reconnects_after_the_peer_closed(self):
        # The consumer's channel thread is kept busy (its message callback sleeps), so only
        # `connect` itself can notice that the producer side closed.
        consumer = TcpControlChannel(on_message=lambda: time.sleep(1.0))
        self.addCleanup(consumer.close)
        target = consumer.connect(self.server.address, "p", "p")
        consumer.send(target, b"one")
        (sender, _), = tt.receive_messages(self.producer, 1)
        self.producer.send(sender, b"bye")  # wakes the consumer's thread into its callback
        time.sleep(0.1)
        self.producer.forget(sender)  # the producer side goes away (e.g. a restart)
        time.sleep(0.1)
        self.assertEqual(consumer.connect(self.server.address, "p", "p"), target)
        self.assertTrue(consumer.send(target, b"two"))
        got = tt.receive_messages(self.producer, 1)
        self.assertEqual([p for _, p in got], [b"two"])
        self.assertNotEqual(got[0][0], sender)  # a new connection

    def test_incoming_connections_are_capped(self):
        producer = TcpControlChannel(max_incoming=2)
        server = MetadataServer(on_control=producer.adopt)
        self.addCleanup(producer.close)
        self.addCleanup(server.close)
        consumers = [TcpControlChannel() for _ in range(3)]
        for consumer in consumers:
            self.addCleanup(consumer.close)
        targets = [c.connect(server.address, "p", "p") for c in consumers]
        for consumer, target in zip(consumers, targets):
            consumer.send(target, b"x")
            tt.receive_messages(producer, 1)
        self.assertEqual(producer.open_connections, 2)
        deadline = time.monotonic() + 5  # the oldest was closed: its peer sees EOF
        while consumers[0].open_connections and time.monotonic() < deadline:
            consumers[0].receive()
            time.sleep(0.01)
        self.assertEqual(consumers[0].open_connections, 0)

    def test_peer_closing_drops_its_connection(self):
        target = self.consumer.connect(self.server.address, "p", "p")
        self.consumer.send(target, b"hello")
        tt.receive_messages(self.producer, 1)
        self.assertEqual(self.producer.open_connections, 1)
        self.consumer.close()
        deadline = time.monotonic() + 5
        while self.producer.open_connections and time.monotonic() < deadline:
            time.sleep(0.01)
        self.assertEqual(self.producer.open_connections, 0)


if __name__ == "__main__":
    absltest.main()
