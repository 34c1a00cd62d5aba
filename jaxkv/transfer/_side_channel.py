"""Side channel: a small TCP listener that serves an engine's metadata, and its client.

Protocol (one request per connection): the client sends ``MAGIC + u32 protocol version``; the
server answers ``MAGIC + u64 length + payload`` where the payload is `encode_metadata` bytes
(or an empty payload when it has nothing to publish yet). Every socket operation has a
timeout; the client retries a bounded number of times with exponential backoff. The server
serves its connections concurrently, each under a deadline, a bounded number at once.

A connection that starts with ``CONTROL_MAGIC + version`` instead is a persistent control
connection (`jaxkv.transfer._control`): handed to ``on_control`` (dropped without one).

With a deployment key (`jaxkv.transfer._auth`) the server answers nothing but keyed
connections: ``AUTH_MAGIC`` and the challenge-response first (the purpose, metadata or
control, is part of it), then the metadata as ``u64 length + payload + MAC`` under the
connection's session, or the control connection is handed over with its `Session`. A plain
request gets a refusal naming the reason (``REFUSED + u64 reason``, the size of a reply
header), a wrong proof too; both are logged. Every step stays under the connection's deadline.
"""

from __future__ import annotations

import contextlib
import logging
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable

from jaxkv.transfer._auth import (
    ACCEPTED,
    AUTH_MAGIC,
    AUTH_REQUIRED,
    BAD_HELLO,
    HELLO_REST,
    KEY_MISMATCH,
    MAC_BYTES,
    MAX_IDENTITY_BYTES,
    NO_KEY,
    PURPOSE_CONTROL,
    PURPOSE_METADATA,
    REASONS,
    REFUSAL,
    REFUSED,
    AuthError,
    DeploymentKey,
    Session,
    client_handshake,
    new_nonce,
)
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
_LENGTH = struct.Struct("!Q")
_log = logging.getLogger(__name__)
# Why this server refused a connection, as its log says it.
_SERVER_REASONS = {
    AUTH_REQUIRED: "a connection without the deployment key (auth key mismatch: the client "
                   "has none)",
    NO_KEY: "a keyed connection, and this engine has no deployment key (auth key mismatch)",
    KEY_MISMATCH: "auth key mismatch: the client's proof does not match this deployment key",
    BAD_HELLO: "a malformed keyed handshake",
}


class HandshakeError(ConnectionError):
    """The peer's metadata could not be fetched (after the retries) or was refused."""


class MetadataServer:
    """Serves the current `EngineMetadata` on ``host:port`` from a daemon thread.

    Connections are served concurrently by one selector loop (non-blocking sockets): a slow or
    silent client never delays another. Each connection has a deadline (`io_timeout` for the
    request and the reply together); at most `max_connections` are open at once (a new one
    beyond the cap closes the oldest); a request that is not ``MAGIC + version`` is dropped
    unanswered, and nothing past the 8 request bytes is ever read (with a key: nothing past
    each handshake step's bytes; a client that fails the handshake is refused and closed).

    Args:
      host: address to bind (loopback by default).
      port: 0 picks a free port; read it back from `port`.
      io_timeout: seconds each client connection may take.
      max_connections: open connections served at once.
      on_control: takes over control connections (the socket, non-blocking, after its 8
        request bytes or its handshake, and the connection's `Session`, None without a key);
        None: they are dropped.
      key: the deployment key: only clients that prove it are answered (None: anyone on the
        address, the plain protocol).

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
        on_control: Callable[[socket.socket, Session | None], None] | None = None,
        key: DeploymentKey | None = None,
    ):
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        self._payload = b""
        self._key = key
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
        self.dropped_connections = 0  # timed out, evicted, garbage, refused or closed early
        self.refused_connections = 0  # failed the handshake (no key, another key, malformed)
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
                sock, peer = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return  # closed
            sock.setblocking(False)
            if len(self._conns) >= self._max_connections:
                self._drop(next(iter(self._conns.values())))  # the oldest
            conn = _Connection(sock, time.monotonic() + self._io_timeout, peer)
            self._conns[sock] = conn
            self._selector.register(sock, selectors.EVENT_READ, None)

    def _step(self, conn: _Connection, events: int) -> None:
        """Reads the bytes the connection's current step needs, answers, writes."""
        try:
            if conn.need and events & selectors.EVENT_READ:
                chunk = conn.sock.recv(conn.need - len(conn.inbuf))
                if not chunk:
                    self._drop(conn)
                    return
                conn.inbuf += chunk
                if len(conn.inbuf) < conn.need:
                    return
                data, conn.inbuf, conn.need = bytes(conn.inbuf), b"", 0
                self._advance(conn, data)
                if conn.sock not in self._conns:
                    return  # dropped or handed over
            if conn.out:
                conn.sent += conn.sock.send(conn.out[conn.sent:])
                if conn.sent < len(conn.out):
                    self._watch(conn, selectors.EVENT_WRITE)
                    return
                conn.out, conn.sent = memoryview(b""), 0
                self._written(conn)
        except (BlockingIOError, InterruptedError):
            if conn.out and conn.sock in self._conns:
                self._watch(conn, selectors.EVENT_WRITE)
            return
        except OSError:
            self._drop(conn)

    def _watch(self, conn: _Connection, events: int) -> None:
        if conn.events != events:
            conn.events = events
            self._selector.modify(conn.sock, events, None)

    def _written(self, conn: _Connection) -> None:
        """Everything queued went out: the connection's next step."""
        after, conn.after = conn.after, ""
        if after == "served":
            self.requests_served += 1
            self._drop(conn, dropped=False)
        elif after == "refused":
            self._drop(conn)
        elif after == "control":
            self._hand_over(conn)
        else:
            self._watch(conn, selectors.EVENT_READ)  # the handshake goes on

    def _advance(self, conn: _Connection, data: bytes) -> None:
        """One step of the protocol on the bytes it waited for (validate, then answer)."""
        key = self._key
        if conn.phase == "request":
            magic, _version = _REQUEST.unpack(data)  # the client checks what it receives
            if magic == AUTH_MAGIC:  # refused without a key once its hello is read: the
                # refusal must not be lost to a reset (a close with unread bytes)
                conn.phase, conn.need = "hello", HELLO_REST.size
            elif magic in (MAGIC, CONTROL_MAGIC) and key is not None:
                self._refuse(conn, AUTH_REQUIRED)
            elif magic == CONTROL_MAGIC and self.on_control is not None:
                self._hand_over(conn)
            elif magic == MAGIC:
                self._reply(conn, None)
            else:
                self._drop(conn)  # garbage: no answer
        elif conn.phase == "hello":
            purpose, conn.client_nonce, length = HELLO_REST.unpack(data)
            if purpose == PURPOSE_CONTROL and self.on_control is None:
                self._drop(conn)  # as a plain control connection without a handler
            elif purpose not in (PURPOSE_METADATA, PURPOSE_CONTROL) or not (
                0 < length <= MAX_IDENTITY_BYTES
            ):
                self._refuse(conn, BAD_HELLO)
            else:
                conn.purpose, conn.phase, conn.need = purpose, "identity", length
        elif conn.phase == "identity":
            try:
                conn.identity = data.decode()
            except UnicodeDecodeError:
                self._refuse(conn, BAD_HELLO)
                return
            if key is None:
                self._refuse(conn, NO_KEY)
                return
            conn.server_nonce = new_nonce()
            conn.out = memoryview(AUTH_MAGIC + conn.server_nonce)
            conn.phase, conn.need = "proof", MAC_BYTES
        elif conn.phase == "proof":
            assert key is not None  # only keyed servers get here
            transcript = key.transcript(
                conn.purpose, conn.client_nonce, conn.server_nonce, conn.identity
            )
            if not key.verify_client(transcript, data):
                self._refuse(conn, KEY_MISMATCH)
                return
            conn.session = key.session(transcript, server=True, peer_identity=conn.identity)
            conn.out = memoryview(ACCEPTED + key.server_proof(transcript))
            if conn.purpose == PURPOSE_METADATA:
                self._reply(conn, conn.session)
            else:
                conn.after = "control"

    def _reply(self, conn: _Connection, session: Session | None) -> None:
        """Queues the metadata (after what is queued already: the handshake's answer)."""
        with self._lock:
            payload = self._payload
        if session is None:
            reply = _REPLY.pack(MAGIC, len(payload)) + payload
        else:
            frame = _LENGTH.pack(len(payload)) + payload
            reply = frame + session.seal(frame)
        conn.out = memoryview(bytes(conn.out) + reply)
        conn.after = "served"

    def _refuse(self, conn: _Connection, reason: int) -> None:
        """Answers why (the peer names it) and closes; logged here, named by reason."""
        self.refused_connections += 1
        _log.warning("side channel %s:%d refused %s: %s", self.host, self.port,
                     conn.peer, _SERVER_REASONS[reason])
        conn.out = memoryview(REFUSAL.pack(REFUSED, reason))
        conn.after = "refused"
        conn.need = 0

    def _hand_over(self, conn: _Connection) -> None:
        self._conns.pop(conn.sock, None)
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._selector.unregister(conn.sock)
        handler = self.on_control
        try:
            if handler is None:
                raise OSError("no control handler")
            handler(conn.sock, conn.session)
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
    """One client of a `MetadataServer`: where its protocol stands and what is queued."""

    __slots__ = ("after", "client_nonce", "deadline", "events", "identity", "inbuf", "need",
                 "out", "peer", "phase", "purpose", "sent", "server_nonce", "session", "sock")

    def __init__(self, sock: socket.socket, deadline: float, peer: object = None):
        self.sock = sock
        self.deadline = deadline
        self.peer = peer
        self.phase = "request"
        self.need = _REQUEST.size  # bytes the current step reads
        self.inbuf = b""
        self.out = memoryview(b"")
        self.sent = 0
        self.after = ""  # once `out` is written: "served", "refused", "control" or go on
        self.events = selectors.EVENT_READ
        self.purpose = 0
        self.client_nonce = b""
        self.server_nonce = b""
        self.identity = ""
        self.session: Session | None = None


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
    *,
    key: DeploymentKey | None = None,
    identity: str = "",
) -> EngineMetadata:
    """Fetches and validates a peer's metadata.

    Args:
      address: ``(host, port)`` of the peer's `MetadataServer`.
      expected_engine_id: refuse a peer with another engine id (None: accept any).
      timeout: seconds for each attempt (connect, send and receive together).
      retries: further attempts after a connection failure or timeout (a malformed or wrong
        payload, or a refused handshake, is not retried).
      backoff: seconds before the first retry, doubled after each.
      max_bytes: refuse larger payloads before reading them.
      key: this engine's deployment key (None: the plain protocol, for keyless peers).
      identity: this engine's id, proved with the key (keyed fetches need one).

    Returns:
      The peer's validated metadata.

    Raises:
      HandshakeError: every attempt failed, or the payload or the handshake was refused (a
        key mismatch says so; its cause attached).

    Example:
      >>> fetch_metadata(("127.0.0.1", 1), retries=0)  # doctest: +SKIP
    """
    last_error: Exception | None = None
    for attempt in range(retries + 1):
        if attempt:
            time.sleep(backoff * (2 ** (attempt - 1)))
        deadline = time.monotonic() + timeout
        try:
            with socket.create_connection(address, timeout=timeout) as conn:
                payload = _fetch_once(conn, address, max_bytes, deadline, key, identity)
        except HandshakeError:
            raise
        except AuthError as error:  # a key mismatch does not heal by retrying
            raise HandshakeError(f"{address}: {error}") from error
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


def _fetch_once(conn: socket.socket, address: tuple[str, int], max_bytes: int, deadline: float,
                key: DeploymentKey | None, identity: str) -> bytes:
    """One metadata request on a fresh connection: its payload (checked under the session)."""
    session = client_handshake(conn, key, PURPOSE_METADATA, PROTOCOL_VERSION, identity, deadline)
    if session is None:
        conn.sendall(_REQUEST.pack(MAGIC, PROTOCOL_VERSION))
        magic, length = _REPLY.unpack(_recv_exact(conn, _REPLY.size, deadline))
        if magic == REFUSED:
            raise AuthError(REASONS.get(length, f"the peer refused (reason {length})"))
        if magic != MAGIC:
            raise HandshakeError(f"{address}: not a jaxkv metadata server")
    else:
        head = _recv_exact(conn, _LENGTH.size, deadline)
        (length,) = _LENGTH.unpack(head)
    if length > max_bytes:
        raise HandshakeError(
            f"{address}: metadata of {length} bytes is above the {max_bytes} limit"
        )
    payload = _recv_exact(conn, length, deadline) if length else b""
    if session is not None:
        session.check(head + payload, _recv_exact(conn, MAC_BYTES, deadline))
    if length == 0:
        raise ConnectionError(f"{address}: the peer has not published metadata yet")
    return payload
