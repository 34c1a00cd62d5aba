"""The deployment key: authenticates side-channel and control-channel connections.

Every engine of a deployment holds the same secret key (`load_auth_key`: an argument, a key
file or an environment variable). A keyed connection starts with a challenge-response over
fresh nonces from both sides (HMAC-SHA256, `hmac` and `secrets` of the standard library):

1. client -> server: ``AUTH_MAGIC + u32 version + u8 purpose + client nonce (32 bytes) +
   u16 length + the client's identity`` (its engine id);
2. server -> client: ``AUTH_MAGIC + server nonce (32 bytes)``;
3. client -> server: ``HMAC(key, "client" + transcript)`` (the transcript is the purpose,
   both nonces and the identity);
4. server -> client: ``ACCEPTED + HMAC(key, "server" + transcript)``, or ``REFUSED + u64
   reason`` (then the server closes).

Both sides so prove the key without sending it, and a recorded handshake is useless: the
other side's nonce is new on every connection. Every message after it carries a MAC under a
`Session` key derived from the transcript, one per direction, over a sequence number that
counts the messages of that direction: a message replayed, reordered, cut out or moved to
another connection fails its check and the connection is closed.

Why HMAC and not TLS (`ssl`): the channels are a few small messages between engines that
share a deployment (no certificate authority, no host names: peers are addressed by IP and
port, often behind a scheduler); a shared secret is what the deployment tools already
distribute (vLLM, Kubernetes secrets), and the MACs need no wrapping of the non-blocking
selector loops (TLS over non-blocking sockets needs ``want-read/want-write`` handling in
both loops). The messages are authenticated, not encrypted: metadata and control messages
hold no secret beyond what a key holder may read anyway (see docs/transfer.md, Trust model).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import os
import secrets
import socket
import struct
import time
from pathlib import Path

__all__ = [
    "AuthError",
    "DeploymentKey",
    "Session",
    "check_exposure",
    "client_handshake",
    "load_auth_key",
]

_log = logging.getLogger(__name__)

KEY_ENV = "JAXKV_AUTH_KEY"
KEY_FILE_ENV = "JAXKV_AUTH_KEY_FILE"
MIN_KEY_BYTES = 16
NONCE_BYTES = 32
MAC_BYTES = 32
MAX_IDENTITY_BYTES = 512
AUTH_MAGIC = b"JKVA"  # a keyed connection (the plain ones start with JKVM / JKVC)
ACCEPTED = b"JKOK"
REFUSED = b"JKVX"
PURPOSE_METADATA = 1
PURPOSE_CONTROL = 2
HELLO_HEAD = struct.Struct("!4sIB32sH")  # after it: the identity
HELLO_REST = struct.Struct("!B32sH")  # what follows the 8 request bytes
REFUSAL = struct.Struct("!4sQ")  # same size as a plain metadata reply header

# Why a server refused (the u64 of REFUSED), as each side words it.
AUTH_REQUIRED = 1
NO_KEY = 2
KEY_MISMATCH = 3
BAD_HELLO = 4
REASONS = {
    AUTH_REQUIRED: "the peer requires the deployment key and this engine has none "
                   f"(auth key mismatch: set auth_key, {KEY_ENV} or {KEY_FILE_ENV})",
    NO_KEY: "the peer has no deployment key and this engine has one (auth key mismatch)",
    KEY_MISMATCH: "auth key mismatch: the peer holds another deployment key",
    BAD_HELLO: "the peer refused a malformed handshake",
}


class AuthError(ConnectionError):
    """A handshake was refused (the key mismatch named) or a message failed its MAC."""


def load_auth_key(
    key: bytes | str | None = None, *, path: str | os.PathLike | None = None
) -> bytes | None:
    """The deployment key: `key`, else the file `path`, else the file named by
    ``JAXKV_AUTH_KEY_FILE``, else ``JAXKV_AUTH_KEY`` (UTF-8), else None (no key).

    A key file holds the key's bytes; one trailing newline is ignored. Generate one with
    ``python -c "import secrets; print(secrets.token_hex(32))" > jaxkv.key``.

    Args:
      key: the key itself (a str is UTF-8 encoded).
      path: a file holding the key.

    Returns:
      The key's bytes, or None when none was given anywhere.

    Raises:
      ValueError: a key shorter than 16 bytes.
      OSError: the key file cannot be read.

    Example:
      >>> load_auth_key("0123456789abcdef0123")
      b'0123456789abcdef0123'
    """
    if key is None and path is None:
        path = os.environ.get(KEY_FILE_ENV) or None
        if path is None:
            key = os.environ.get(KEY_ENV) or None
    if key is None and path is not None:
        key = Path(path).read_bytes()
        if key.endswith(b"\n"):
            key = key[:-2] if key.endswith(b"\r\n") else key[:-1]
    if key is None:
        return None
    raw = key.encode() if isinstance(key, str) else bytes(key)
    if len(raw) < MIN_KEY_BYTES:
        raise ValueError(
            f"the deployment key must have at least {MIN_KEY_BYTES} bytes, got {len(raw)}"
        )
    return raw


def is_loopback(host: str) -> bool:
    """Whether `host` is a loopback address (``localhost`` included; a name is not)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_exposure(host: str, key: DeploymentKey | None, allow_unauthenticated: bool) -> None:
    """Refuses to serve metadata on a non-loopback address without a key.

    Whoever fetches the metadata can READ every registered cache through NIXL and send
    control messages; on loopback only processes of this host can, as before.

    Raises:
      ValueError: `host` is not loopback, there is no key and not `allow_unauthenticated`.
    """
    if key is not None or is_loopback(host):
        return
    if not allow_unauthenticated:
        raise ValueError(
            f"refusing to serve the side channel on {host!r} without a deployment key: anyone "
            "who reaches it gets the metadata that lets a NIXL agent READ every registered "
            f"cache, and may send control messages. Set auth_key (or {KEY_ENV} / "
            f"{KEY_FILE_ENV}) on every engine, or pass allow_unauthenticated=True on a "
            "network you trust"
        )
    _log.warning(
        "jaxkv side channel on %s without a deployment key (allow_unauthenticated=True): "
        "every process that reaches it can read the registered KV caches", host,
    )


class DeploymentKey:
    """The deployment key and the handshake's proofs under it (the key is never shown).

    Args:
      key: at least 16 bytes (`load_auth_key`).

    Example:
      >>> k = DeploymentKey(b"k" * 32)
      >>> t = k.transcript(PURPOSE_CONTROL, b"a" * 32, b"b" * 32, "decode")
      >>> k.verify_client(t, k.client_proof(t))
      True
    """

    __slots__ = ("_key",)

    def __init__(self, key: bytes):
        if len(key) < MIN_KEY_BYTES:
            raise ValueError(f"the deployment key must have at least {MIN_KEY_BYTES} bytes")
        self._key = bytes(key)

    def __repr__(self) -> str:
        return "DeploymentKey(<hidden>)"

    @staticmethod
    def transcript(purpose: int, client_nonce: bytes, server_nonce: bytes, identity: str) -> bytes:
        """What both proofs and the session keys are bound to."""
        return bytes([purpose]) + client_nonce + server_nonce + identity.encode()

    def _mac(self, label: bytes, transcript: bytes) -> bytes:
        return hmac.digest(self._key, b"jaxkv-auth-v1 " + label + b"\0" + transcript, "sha256")

    def client_proof(self, transcript: bytes) -> bytes:
        return self._mac(b"client", transcript)

    def server_proof(self, transcript: bytes) -> bytes:
        return self._mac(b"server", transcript)

    def verify_client(self, transcript: bytes, proof: bytes) -> bool:
        return hmac.compare_digest(self.client_proof(transcript), proof)

    def verify_server(self, transcript: bytes, proof: bytes) -> bool:
        return hmac.compare_digest(self.server_proof(transcript), proof)

    def session(self, transcript: bytes, server: bool, peer_identity: str) -> Session:
        """The MAC keys of a connection whose handshake had this transcript."""
        c2s, s2c = self._mac(b"session c2s", transcript), self._mac(b"session s2c", transcript)
        return Session(s2c, c2s, peer_identity) if server else Session(c2s, s2c, peer_identity)


class Session:
    """Per-message MACs of one authenticated connection: a key and a sequence number per
    direction (callers serialize each direction: the MACs must be made and checked in the
    order the messages travel).

    Args:
      send_key, receive_key: the directions' MAC keys (`DeploymentKey.session`).
      peer_identity: the identity the peer proved with the key (the client's engine id; ""
        on the client side).

    Example:
      >>> a, b = Session(b"x" * 32, b"y" * 32, "p"), Session(b"y" * 32, b"x" * 32, "q")
      >>> b.check(b"hi", a.seal(b"hi"))
      >>> b.check(b"hi", a.seal(b"hi")) is None  # the next message: the next number
      True
    """

    __slots__ = ("_receive_mac", "_received", "_send_mac", "_sent", "peer_identity")

    def __init__(self, send_key: bytes, receive_key: bytes, peer_identity: str):
        # Keyed once: each message copies the keyed state (cheaper than re-keying).
        self._send_mac = hmac.new(send_key, digestmod=hashlib.sha256)
        self._receive_mac = hmac.new(receive_key, digestmod=hashlib.sha256)
        self._sent = 0
        self._received = 0
        self.peer_identity = peer_identity

    def seal(self, payload: bytes) -> bytes:
        """The MAC of the next message sent (`MAC_BYTES`)."""
        mac = self._send_mac.copy()
        mac.update(self._sent.to_bytes(8, "big"))
        mac.update(payload)
        self._sent += 1
        return mac.digest()

    def check(self, payload: bytes, mac: bytes | bytearray) -> None:
        """Checks the next message received.

        Raises:
          AuthError: the MAC does not match (forged, replayed, reordered or corrupted).
        """
        want = self._receive_mac.copy()
        want.update(self._received.to_bytes(8, "big"))
        want.update(payload)
        if not hmac.compare_digest(want.digest(), bytes(mac)):
            raise AuthError("a message failed its MAC (forged, replayed or corrupted)")
        self._received += 1


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def client_hello(purpose: int, version: int, nonce: bytes, identity: str) -> bytes:
    """Step 1 of the handshake (the client's first bytes)."""
    ident = identity.encode()
    if len(ident) > MAX_IDENTITY_BYTES:
        raise ValueError(f"identity of {len(ident)} bytes is above {MAX_IDENTITY_BYTES}")
    return HELLO_HEAD.pack(AUTH_MAGIC, version, purpose, nonce, len(ident)) + ident


def _recv_exact(sock: socket.socket, size: int, deadline: float) -> bytes:
    chunks, remaining = [], size
    while remaining:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"handshake timed out with {remaining} of {size} bytes missing")
        sock.settimeout(left)
        chunk = sock.recv(remaining)
        if not chunk:
            raise ConnectionError(f"peer closed the handshake ({remaining} bytes missing)")
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


def _refusal(sock: socket.socket, deadline: float) -> AuthError:
    (code,) = struct.unpack("!Q", _recv_exact(sock, 8, deadline))
    return AuthError(REASONS.get(code, f"the peer refused the handshake (reason {code})"))


def client_handshake(
    sock: socket.socket,
    key: DeploymentKey | None,
    purpose: int,
    version: int,
    identity: str,
    deadline: float,
) -> Session | None:
    """The client's side of the handshake on a connected blocking socket.

    Without a key, sends nothing (the plain protocol follows) and returns None.

    Args:
      sock: the connection.
      key: this engine's key.
      purpose: `PURPOSE_METADATA` or `PURPOSE_CONTROL`.
      version: the protocol version.
      identity: this engine's id (bound to the connection on the server).
      deadline: `time.monotonic` bound of the whole handshake.

    Returns:
      The connection's `Session`.

    Raises:
      AuthError: the server refused (the reason named: key mismatch, no key) or failed to
        prove the key.
      TimeoutError, ConnectionError: the connection failed.
    """
    if key is None:
        return None
    client_nonce = new_nonce()
    sock.sendall(client_hello(purpose, version, client_nonce, identity))
    magic = _recv_exact(sock, 4, deadline)
    if magic == REFUSED:
        raise _refusal(sock, deadline)
    if magic != AUTH_MAGIC:
        raise AuthError("the peer does not speak the keyed jaxkv handshake")
    server_nonce = _recv_exact(sock, NONCE_BYTES, deadline)
    transcript = key.transcript(purpose, client_nonce, server_nonce, identity)
    sock.sendall(key.client_proof(transcript))
    magic = _recv_exact(sock, 4, deadline)
    if magic == REFUSED:
        raise _refusal(sock, deadline)
    if magic != ACCEPTED or not key.verify_server(transcript, _recv_exact(sock, MAC_BYTES,
                                                                          deadline)):
        raise AuthError("auth key mismatch: the peer failed to prove the deployment key")
    return key.session(transcript, server=False, peer_identity="")

