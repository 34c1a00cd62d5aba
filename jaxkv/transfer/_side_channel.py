"""Side channel: a small TCP listener that serves an engine's metadata, and its client.

Protocol (one request per connection): the client sends ``MAGIC + u32 protocol version``; the
server answers ``MAGIC + u64 length + payload`` where the payload is `encode_metadata` bytes
(or an empty payload when it has nothing to publish yet). Every socket operation has a
timeout; the client retries a bounded number of times with exponential backoff.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time

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
_REQUEST = struct.Struct("!4sI")
_REPLY = struct.Struct("!4sQ")


class HandshakeError(ConnectionError):
    """The peer's metadata could not be fetched (after the retries) or was refused."""


class MetadataServer:
    """Serves the current `EngineMetadata` on ``host:port`` from a daemon thread.

    Args:
      host: address to bind (loopback by default).
      port: 0 picks a free port; read it back from `port`.
      io_timeout: seconds each client connection may take.

    Example:
      >>> server = MetadataServer()
      >>> server.port > 0
      True
      >>> server.close()
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, io_timeout: float = 5.0):
        self._payload = b""
        self._lock = threading.Lock()
        self._io_timeout = io_timeout
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self._sock.listen(64)
        self._sock.settimeout(0.2)
        self.host, self.port = self._sock.getsockname()[:2]
        self._closed = threading.Event()
        self.requests_served = 0
        self._thread = threading.Thread(
            target=self._serve, name=f"jaxkv-metadata-{self.port}", daemon=True
        )
        self._thread.start()

    @property
    def address(self) -> tuple[str, int]:
        return self.host, self.port

    def publish(self, meta: EngineMetadata | bytes) -> None:
        """Replaces what the server answers (bytes are served as they are: for tests)."""
        payload = meta if isinstance(meta, bytes) else encode_metadata(meta)
        with self._lock:
            self._payload = payload

    def _serve(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                try:
                    conn.settimeout(self._io_timeout)
                    request = _recv_exact(conn, _REQUEST.size, time.monotonic() + self._io_timeout)
                    magic, version = _REQUEST.unpack(request)
                    if magic != MAGIC:
                        continue
                    del version  # the client checks the version of what it receives
                    with self._lock:
                        payload = self._payload
                    conn.sendall(_REPLY.pack(MAGIC, len(payload)) + payload)
                    self.requests_served += 1
                except OSError:
                    continue

    def close(self) -> None:
        """Stops the thread and closes the socket (idempotent)."""
        self._closed.set()
        with contextlib.suppress(OSError):
            self._sock.close()
        self._thread.join(timeout=2.0)

    def __enter__(self) -> MetadataServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


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
