"""The control channel over persistent TCP connections to the peers' side channels.

A consumer process opens one connection to each producer process's side channel
(`MetadataServer`), introduced by ``CONTROL_MAGIC + u32 protocol version`` instead of a
metadata request; the server hands such connections to its engine's `TcpControlChannel`.
Both directions then carry frames of ``u32 length + msgspec message`` (at most
`MAX_MESSAGE_BYTES`; a larger frame or anything unreadable closes the connection). The
producer answers on the connection a consumer's `Hello` came on.

With a deployment key (`jaxkv.transfer._auth`) a connection opens with the keyed handshake
(purpose: control) instead, and every frame carries a MAC after its payload (``u32 length +
message + MAC``, the length counting the message) under the connection's `Session`: one that
fails it closes the connection before anything of it is delivered. The server side binds the
identity the client proved (its engine id) to the connection (`identity`).

One selector thread per channel reads every connection as bytes arrive and calls
``on_message`` (the engine handles the messages at once when it is idle, else its current
poll does). Sends never wait for the peer: what the socket does not take at once is queued
and written by the selector thread.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable

from jaxkv.transfer._auth import (
    MAC_BYTES,
    PURPOSE_CONTROL,
    AuthError,
    DeploymentKey,
    Session,
    client_handshake,
)
from jaxkv.transfer._messages import MAX_MESSAGE_BYTES
from jaxkv.transfer._metadata import PROTOCOL_VERSION
from jaxkv.transfer._side_channel import CONTROL_MAGIC

__all__ = ["CONTROL_MAGIC", "TcpControlChannel"]

_HELLO = struct.Struct("!4sI")
_FRAME = struct.Struct("!I")
_MAX_QUEUED = 64 << 20  # bytes queued for one slow connection before it is dropped


class _Conn:
    __slots__ = ("alive", "inbuf", "key", "lock", "outbuf", "rlock", "session", "sock")

    def __init__(self, key: str, sock: socket.socket, session: Session | None):
        self.key = key
        self.sock = sock
        self.session = session  # MACs of a keyed connection (None: plain frames)
        self.inbuf = bytearray()
        self.outbuf = bytearray()
        self.lock = threading.Lock()  # sends
        self.rlock = threading.Lock()  # reads (the channel's thread and pollers)
        self.alive = True


class TcpControlChannel:
    """`ControlChannel` over persistent TCP connections (see the module docstring).

    Args:
      on_message: called from the channel's thread after messages arrived (must not block).
      connect_timeout_s: bound on opening a connection to a peer.
      max_incoming: connections adopted from the side channel kept at once (a new one beyond
        it closes the oldest).
      key: the deployment key `connect` proves (None: plain connections).
      identity: this engine's id, proved with the key when connecting.

    Example:
      >>> a, b = TcpControlChannel(), TcpControlChannel()
      >>> from jaxkv.transfer._side_channel import MetadataServer
      >>> server = MetadataServer(on_control=b.adopt)
      >>> target = a.connect(server.address, "producer", "producer")
      >>> a.send(target, b"hi")
      True
      >>> import time; time.sleep(0.2)
      >>> [payload for _, payload in b.receive()]
      [b'hi']
      >>> for closable in (a, b, server): closable.close()
    """

    name = "tcp"

    def __init__(
        self,
        on_message: Callable[[], None] | None = None,
        connect_timeout_s: float = 5.0,
        max_incoming: int = 1024,
        *,
        key: DeploymentKey | None = None,
        identity: str = "",
    ):
        if max_incoming < 1:
            raise ValueError(f"max_incoming must be >= 1, got {max_incoming}")
        self._max_incoming = max_incoming
        self._key = key
        self._identity = identity
        self._on_message = on_message
        self._connect_timeout_s = connect_timeout_s
        self._conns: dict[str, _Conn] = {}
        self._by_sock: dict[socket.socket, _Conn] = {}
        self._inbox: collections.deque[tuple[str, bytes]] = collections.deque()
        self._lock = threading.Lock()  # guards _conns, _by_sock and _pending
        self._pending: list[tuple[str, _Conn]] = []  # ("add" | "write" | "drop", conn)
        self._ids = itertools.count(1)
        self._closed = threading.Event()
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self.dropped_connections = 0
        self._thread = threading.Thread(target=self._serve, name="jaxkv-control", daemon=True)
        self._thread.start()

    # -- ControlChannel ---------------------------------------------------------------------

    def hello_payload(self) -> bytes:
        return b""  # the connection itself is the way back

    def connect(self, address: tuple[str, int], agent: str, transport_name: str) -> str:
        """The (reused or new) connection to a producer process's side channel."""
        del agent, transport_name
        key = f"tcp:{address[0]}:{address[1]}"
        with self._lock:
            conn = self._conns.get(key)
        if conn is not None and conn.alive:
            self._read(conn)  # notices a peer that closed (e.g. restarted on the same port)
        if conn is not None and conn.alive:
            return key
        deadline = time.monotonic() + self._connect_timeout_s
        sock = None
        try:
            sock = socket.create_connection(
                (str(address[0]), int(address[1])), timeout=self._connect_timeout_s
            )
            session = client_handshake(sock, self._key, PURPOSE_CONTROL, PROTOCOL_VERSION,
                                       self._identity, deadline)
            if session is None:
                sock.sendall(_HELLO.pack(CONTROL_MAGIC, PROTOCOL_VERSION))
        except (OSError, TimeoutError) as error:  # AuthError included: it names the reason
            if sock is not None:
                sock.close()
            raise ConnectionError(f"control connection to {address} failed: {error}") from error
        self._add(key, sock, session)
        return key

    def identity(self, sender: str) -> str | None:
        """The identity (engine id) the peer of a connection proved with the deployment key;
        None for a plain connection or an unknown sender.

        Example:
          >>> TcpControlChannel().identity("tcp-in:1") is None
          True
        """
        with self._lock:
            conn = self._conns.get(sender)
        if conn is None or conn.session is None:
            return None
        return conn.session.peer_identity

    def adopt(self, sock: socket.socket, session: Session | None = None) -> None:
        """Takes over a connection a `MetadataServer` accepted as a control connection (with
        the `Session` of its handshake, None for a plain one)."""
        with self._lock:
            incoming = [c for c in self._conns.values() if c.key.startswith("tcp-in:")]
        if len(incoming) >= self._max_incoming:
            incoming[0].alive = False  # the oldest
            self._request("drop", incoming[0])
        self._add(f"tcp-in:{next(self._ids)}", sock, session)

    def accept(self, agent: str, sender: str, payload: bytes) -> str:
        del agent, payload
        with self._lock:
            if sender not in self._conns:
                raise ValueError(f"no control connection {sender!r}")
        return sender

    def send(self, target: str, payload: bytes) -> bool:
        with self._lock:
            conn = self._conns.get(target)
        if conn is None or not conn.alive:
            return False
        with conn.lock:
            if not conn.alive:
                return False
            # Sealed under the send lock: the MACs' sequence is the order on the wire.
            frame = _FRAME.pack(len(payload)) + payload
            if conn.session is not None:
                frame += conn.session.seal(payload)
            if not conn.outbuf:
                try:
                    sent = conn.sock.send(frame)
                except (BlockingIOError, InterruptedError):
                    sent = 0
                except OSError:
                    conn.alive = False
                    self._request("drop", conn)
                    return False
                frame = frame[sent:]
            if frame:
                if len(conn.outbuf) + len(frame) > _MAX_QUEUED:
                    conn.alive = False
                    self._request("drop", conn)
                    return False
                conn.outbuf += frame
                self._request("write", conn)
        return True

    def receive(self) -> list[tuple[str, bytes]]:
        """Messages that arrived, reading the sockets from the calling thread too: a poller
        that holds the GIL then never waits for the channel's thread to be scheduled."""
        with self._lock:
            conns = list(self._conns.values())
        for conn in conns:
            if conn.alive:
                self._read(conn)
        out = []
        while True:
            try:
                out.append(self._inbox.popleft())
            except IndexError:
                return out

    def forget(self, target: str) -> None:
        with self._lock:
            conn = self._conns.get(target)
        if conn is not None:
            conn.alive = False
            self._request("drop", conn)

    @property
    def open_connections(self) -> int:
        with self._lock:
            return sum(c.alive for c in self._conns.values())

    def close(self) -> None:
        """Closes every connection and stops the thread (idempotent)."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._wake()
        self._thread.join(timeout=2.0)
        with self._lock:
            conns = list(self._conns.values())
            self._conns.clear()
            self._by_sock.clear()
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.sock.close()
        for sock in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                sock.close()
        with contextlib.suppress(OSError, RuntimeError):
            self._selector.close()

    # -- the selector thread ----------------------------------------------------------------

    def _add(self, key: str, sock: socket.socket, session: Session | None) -> None:
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = _Conn(key, sock, session)
        with self._lock:
            old = self._conns.get(key)
            self._conns[key] = conn
            self._by_sock[sock] = conn
        if old is not None:
            old.alive = False
            self._request("drop", old)
        self._request("add", conn)

    def _request(self, what: str, conn: _Conn) -> None:
        with self._lock:
            self._pending.append((what, conn))
        self._wake()

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    def _serve(self) -> None:
        while not self._closed.is_set():
            with self._lock:
                pending, self._pending = self._pending, []
            for what, conn in pending:
                self._apply(what, conn)
            arrived = False
            for key, events in self._selector.select(1.0):
                sock = key.fileobj
                if sock is self._wake_r:
                    with contextlib.suppress(OSError):
                        while self._wake_r.recv(4096):
                            pass
                    continue
                conn = key.data
                if events & selectors.EVENT_READ:
                    arrived |= self._read(conn)
                if events & selectors.EVENT_WRITE and conn.alive:
                    self._flush(conn)
            if arrived and self._on_message is not None:
                # A failure is the engine's to report: its next poll handles the messages.
                with contextlib.suppress(Exception):
                    self._on_message()

    def _apply(self, what: str, conn: _Conn) -> None:
        if what == "add" and conn.alive:
            with contextlib.suppress(KeyError, ValueError, OSError):
                self._selector.register(conn.sock, selectors.EVENT_READ, conn)
        elif what == "write" and conn.alive:
            with contextlib.suppress(KeyError, ValueError, OSError):
                self._selector.modify(
                    conn.sock, selectors.EVENT_READ | selectors.EVENT_WRITE, conn
                )
        elif what == "drop":
            self._drop(conn)

    def _read(self, conn: _Conn) -> bool:
        """Reads what arrived on `conn` into the inbox (any thread); True if messages did.
        A connection that closed, sent a frame above the limit or one that fails its MAC
        is dropped (nothing of that frame or after it is delivered)."""
        with conn.rlock:
            try:
                chunk = conn.sock.recv(1 << 16)
            except (BlockingIOError, InterruptedError):
                return False
            except OSError:
                chunk = b""
            bad = not chunk
            arrived = False
            if chunk:
                conn.inbuf += chunk
            while not bad and len(conn.inbuf) >= _FRAME.size:
                (length,) = _FRAME.unpack_from(conn.inbuf)
                if length > MAX_MESSAGE_BYTES:
                    bad = True  # garbage or hostile: nothing more from it
                    break
                mac = MAC_BYTES if conn.session is not None else 0
                if len(conn.inbuf) < _FRAME.size + length + mac:
                    break
                end = _FRAME.size + length
                payload = bytes(conn.inbuf[_FRAME.size:end])
                if conn.session is not None:
                    try:
                        conn.session.check(payload, conn.inbuf[end:end + mac])
                    except AuthError:
                        bad = True  # forged, replayed or garbage: nothing more from it
                        break
                del conn.inbuf[:end + mac]
                self._inbox.append((conn.key, payload))
                arrived = True
        if bad:
            conn.alive = False
            self._request("drop", conn)
        return arrived

    def _flush(self, conn: _Conn) -> None:
        with conn.lock:
            try:
                sent = conn.sock.send(conn.outbuf)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                conn.alive = False
                sent = -1
            if sent >= 0:
                del conn.outbuf[:sent]
                if conn.outbuf:
                    return
        if not conn.alive:
            self._drop(conn)
            return
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._selector.modify(conn.sock, selectors.EVENT_READ, conn)

    def _drop(self, conn: _Conn) -> None:
        conn.alive = False
        with self._lock:
            if self._by_sock.pop(conn.sock, None) is None:
                return
            if self._conns.get(conn.key) is conn:
                del self._conns[conn.key]
        self.dropped_connections += 1
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._selector.unregister(conn.sock)
        with contextlib.suppress(OSError):
            conn.sock.close()
