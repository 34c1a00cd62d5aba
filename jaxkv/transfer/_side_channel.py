"""Side channel: a small TCP listener that serves an engine's metadata, and its client.

Protocol (one request per connection): the client sends ``MAGIC + u32 protocol version``; the
server answers ``MAGIC + u64 length + payload`` where the payload is `encode_metadata` bytes
(or an empty payload when it has nothing to publish yet). Every socket operation has a
timeout; the client retries a bounded number of times with exponential backoff. The server
serves its connections concurrently, each under a deadline, a bounded number at once.

A connection that starts with ``CONTROL_MAGIC + version`` instead is a persistent control
connection (`jaxkv.transfer._control`): handed to ``on_control`` (dropped without one).
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable

from jaxkv.transfer._metadata import (
    MAX_METADATA_BYTES,
    PROTOCOL_VERSION,
    EngineMetadata,
    MetadataError,
    decode_metadata,
    encode_metadata,
)

__all__ = ["HandshakeError", "MetadataServer", "fetch_metadata"]

MAGIC = b"JKVM"
CONTROL_MAGIC = b"JKVC"  # a persistent control connection (jaxkv.transfer._control)
_REQUEST = struct.Struct("!4sI")
_REPLY = struct.Struct("!4sQ")


class HandshakeError(ConnectionError):
    """The peer's metadata could not be fetched (after the retries) or was refused."""


class MetadataServer:
    """Serves the current `EngineMetadata` on ``host:port`` from a daemon thread.

    Connections are served concurrently by one selector loop (non-blocking sockets): a slow or
    silent client never delays another. Each connection has a deadline (`io_timeout` for the
    request and the reply together); at most `max_connections` are open at once (a new one
    beyond the cap closes the oldest); a request that is not ``MAGIC + version`` is dropped
    unanswered, and nothing past the 8 request bytes is ever read.

    Args:
      host: address to bind (loopback by default).
      port: 0 picks a free port; read it back from `port`.
      io_timeout: seconds each client connection may take.
      max_connections: open connections served at once.
      on_control: takes over control connections (the socket, non-blocking, after its 8
        request bytes); None: they are dropped.

    Example:
      >>> server = MetadataServer()
      >>> server.port > 0
      True
      >>> server.close()
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        io_timeout: float = 5.0,
        max_connections: int = 64,
        on_control: Callable[[socket.socket], None] | None = None,
    ):
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        self._payload = b""
        self.on_control = on_control
        self._lock = threading.Lock()
        self._io_timeout = io_timeout
        self._max_connections = max_connections
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self._sock.listen(max(64, max_connections))
        self._sock.setblocking(False)
        self.host, self.port = self._sock.getsockname()[:2]
        self._closed = threading.Event()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._sock, selectors.EVENT_READ, None)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._conns: dict[socket.socket, _Connection] = {}  # insertion order: oldest first
        self.requests_served = 0
        self.dropped_connections = 0  # timed out, evicted, garbage or closed early
        self._thread = threading.Thread(
            target=self._serve, name=f"jaxkv-metadata-{self.port}", daemon=True
        )
        self._thread.start()

    @property
    def address(self) -> tuple[str, int]:
        return self.host, self.port

    @property
    def open_connections(self) -> int:
        """Client connections being served now."""
        return len(self._conns)

    def publish(self, meta: EngineMetadata | bytes) -> None:
        """Replaces what the server answers (bytes are served as they are: for tests)."""
        payload = meta if isinstance(meta, bytes) else encode_metadata(meta)
        with self._lock:
            self._payload = payload

    def _serve(self) -> None:
        try:
            while not self._closed.is_set():
                now = time.monotonic()
                timeout = 0.5
                if self._conns:
                    timeout = min(timeout, max(0.0, min(c.deadline for c in self._conns.values())
                                               - now))
                for key, events in self._selector.select(timeout):
                    sock = key.fileobj
                    if sock is self._sock:
                        self._accept()
                    elif sock is self._wake_r:
                        with contextlib.suppress(OSError):
                            self._wake_r.recv(64)
                    elif sock in self._conns:
                        self._step(self._conns[sock], events)
                now = time.monotonic()
                for conn in [c for c in self._conns.values() if c.deadline <= now]:
                    self._drop(conn)
        finally:
            for conn in list(self._conns.values()):
                self._drop(conn, dropped=False)

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return  # closed
            sock.setblocking(False)
            if len(self._conns) >= self._max_connections:
                self._drop(next(iter(self._conns.values())))  # the oldest
            conn = _Connection(sock, time.monotonic() + self._io_timeout)
            self._conns[sock] = conn
            self._selector.register(sock, selectors.EVENT_READ, None)

    def _step(self, conn: _Connection, events: int) -> None:
        try:
            if conn.reply is None and events & selectors.EVENT_READ:
                chunk = conn.sock.recv(_REQUEST.size - len(conn.request))
                if not chunk:
                    self._drop(conn)
                    return
                conn.request += chunk
                if len(conn.request) < _REQUEST.size:
                    return
                magic, _version = _REQUEST.unpack(conn.request)
                if magic == CONTROL_MAGIC and self.on_control is not None:
                    self._hand_over(conn)
                    return
                if magic != MAGIC:
                    self._drop(conn)  # garbage: no answer
                    return
                # The client checks the version of what it receives.
                with self._lock:
                    payload = self._payload
                conn.reply = memoryview(_REPLY.pack(MAGIC, len(payload)) + payload)
                self._selector.modify(conn.sock, selectors.EVENT_WRITE, None)
            if conn.reply is not None:
                sent = conn.sock.send(conn.reply[conn.sent:])
                conn.sent += sent
                if conn.sent == len(conn.reply):
                    self.requests_served += 1
                    self._drop(conn, dropped=False)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(conn)

    def _hand_over(self, conn: _Connection) -> None:
        self._conns.pop(conn.sock, None)
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._selector.unregister(conn.sock)
        handler = self.on_control
        try:
            if handler is None:
                raise OSError("no control handler")
            handler(conn.sock)
        except Exception:  # noqa: BLE001 - a refused control connection is closed
            self.dropped_connections += 1
            with contextlib.suppress(OSError):
                conn.sock.close()

    def _drop(self, conn: _Connection, dropped: bool = True) -> None:
        if self._conns.pop(conn.sock, None) is None:
            return
        self.dropped_connections += dropped
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._selector.unregister(conn.sock)
        with contextlib.suppress(OSError):
            conn.sock.close()

    def close(self) -> None:
        """Stops the thread and closes the sockets (idempotent)."""
        if self._closed.is_set():
            return
        self._closed.set()
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        self._thread.join(timeout=2.0)
        for sock in (self._sock, self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                sock.close()
        with contextlib.suppress(OSError, RuntimeError):
            self._selector.close()

    def __enter__(self) -> MetadataServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Connection:
    """One client of a `MetadataServer`: its request bytes so far and its reply."""

    __slots__ = ("deadline", "reply", "request", "sent", "sock")

    def __init__(self, sock: socket.socket, deadline: float):
        self.sock = sock
        self.deadline = deadline
        self.request = b""
        self.reply: memoryview | None = None
        self.sent = 0


def _recv_exact(conn: socket.socket, size: int, deadline: float) -> bytes:
    chunks = []
    remaining = size
    while remaining:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"timed out with {remaining} of {size} bytes missing")
        conn.settimeout(left)
        chunk = conn.recv(min(remaining, 1 << 20))
        if not chunk:
            raise ConnectionError(f"peer closed with {remaining} of {size} bytes missing")
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


def fetch_metadata(
    address: tuple[str, int],
    expected_engine_id: str | None = None,
    timeout: float = 5.0,
    retries: int = 3,
    backoff: float = 0.05,
    max_bytes: int = MAX_METADATA_BYTES,
) -> EngineMetadata:
    """Fetches and validates a peer's metadata.

    Args:
      address: ``(host, port)`` of the peer's `MetadataServer`.
      expected_engine_id: refuse a peer with another engine id (None: accept any).
      timeout: seconds for each attempt (connect, send and receive together).
      retries: further attempts after a connection failure or timeout (a malformed or wrong
        payload is not retried).
      backoff: seconds before the first retry, doubled after each.
      max_bytes: refuse larger payloads before reading them.

    Raises:
      HandshakeError: every attempt failed, or the payload was refused (its cause attached).
    """
    last_error: Exception | None = None
    for attempt in range(retries + 1):
        if attempt:
            time.sleep(backoff * (2 ** (attempt - 1)))
        deadline = time.monotonic() + timeout
        try:
            with socket.create_connection(address, timeout=timeout) as conn:
                conn.sendall(_REQUEST.pack(MAGIC, PROTOCOL_VERSION))
                magic, length = _REPLY.unpack(_recv_exact(conn, _REPLY.size, deadline))
                if magic != MAGIC:
                    raise HandshakeError(f"{address}: not a jaxkv metadata server")
                if length > max_bytes:
                    raise HandshakeError(
                        f"{address}: metadata of {length} bytes is above the {max_bytes} limit"
                    )
                if length == 0:
                    raise ConnectionError(f"{address}: the peer has not published metadata yet")
                payload = _recv_exact(conn, length, deadline)
        except HandshakeError:
            raise
        except (OSError, TimeoutError, ConnectionError) as error:
            last_error = error
            continue
        try:
            return decode_metadata(payload, expected_engine_id, max_bytes)
        except MetadataError as error:
            raise HandshakeError(f"{address}: metadata refused: {error}") from error
    raise HandshakeError(
        f"{address}: no metadata after {retries + 1} attempts: {last_error}"
    ) from last_error
