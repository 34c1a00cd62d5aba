"""Chained block hashes for prefix caching (docs/data-movement.md section 7).

A full block's hash is ``hash_fn(parent_hash || token_ids || tail)``, where

* ``parent_hash`` is the previous block's hash, or `none_hash` for the first block;
* ``token_ids`` are the block's tokens as little-endian ``int64`` values;
* ``tail`` is empty when the block has no extra keys; otherwise ``E || zeros || len(E)``:
  ``E`` is the canonical encoding (`encode_key`) of the extra-key tuple, padded with zero bytes
  to a multiple of 8, followed by ``len(E)`` as a little-endian ``uint32``.

The serialisation is injective: the parent has a fixed length for a given hash function; the
message length is a multiple of 8 exactly when there is no tail (tails are 4 bytes past a
multiple of 8), and a tail ends with its own length; what remains is the tokens. So two
different ``(parent, tokens, extra keys)`` triples never hash the same bytes. It is independent
of the Python version, the platform and the process (no pickle).

The hash seed: ``none_hash`` (the parent of a request's first block) is derived from an explicit
seed string, `DEFAULT_HASH_SEED` unless another is given, and never from the environment: two
processes (a prefill and a decode engine, a KV-aware router) with the same hash function and
seed agree on every hash. A random seed is drawn only when asked for (`random_hash_seed`, or
``hash_seed="random"`` on `KVCacheManager`), e.g. by multi-tenant deployments that want
unguessable hashes; share the drawn seed with the peers that must agree. `hash_identity` names
the hash function and a digest of the seed, for a handshake to compare.

vLLM-compatible mode: with `sha256_cbor` a block's hash is instead vLLM's: SHA-256 of the
canonical CBOR encoding (RFC 8949, via the ``cbor2`` library) of the array
``(parent_hash, token_ids, extra_keys)`` (``extra_keys`` an array, or CBOR null when the block
has none), and `none_hash` is SHA-256 of the canonical CBOR text string of the seed, so a seed
``s`` gives the hashes vLLM computes with ``--prefix-caching-hash-algo sha256_cbor`` and
``PYTHONHASHSEED=s`` (LoRA extra keys must then be the LoRA name, as vLLM hashes names).

Extra keys (in this order, as vLLM): the LoRA id; ``(mm_hash, start_offset)`` for each
multimodal input overlapping the block, where ``start_offset`` is the input's first token
relative to the block's first token (negative when the input began in an earlier block); the
cache salt, on the first block only.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import secrets
import struct
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, NewType

import numpy as np

from jaxkv.blocks._errors import PartialBlockError

try:  # A declared dependency; kept optional so that the native encodings work without it.
    import cbor2 as _cbor2
except ImportError:  # pragma: no cover - exercised only where cbor2 is missing
    _cbor2 = None  # type: ignore[assignment]

try:  # A declared dependency; kept optional so that sha256 works without it.
    import xxhash as _xxhash
except ImportError:  # pragma: no cover - exercised only where xxhash is missing
    _xxhash = None  # type: ignore[assignment]

__all__ = [
    "DEFAULT_HASH_SEED",
    "NONE_HASH",
    "RANDOM_HASH_SEED",
    "BlockHash",
    "ExtraKeys",
    "HashFunction",
    "MultiModalInput",
    "RequestBlockHasher",
    "block_extra_keys",
    "encode_key",
    "get_hash_function",
    "hash_block_tokens",
    "hash_identity",
    "hash_request_tokens",
    "none_hash",
    "random_hash_seed",
    "sha256",
    "sha256_cbor",
    "xxhash128",
]

BlockHash = NewType("BlockHash", bytes)
"""The hash of a full block: the digest bytes of a `HashFunction`."""

ExtraKeys = tuple[Any, ...]
"""Extra keys of one block, e.g. ``(7, ("img-hash", -3), "salt")``; ``None`` when empty."""

_I64 = np.dtype("<i8")
_U32 = struct.Struct("<I")


@dataclasses.dataclass(frozen=True, eq=False)
class HashFunction:
    """A hash function for block hashes: bytes in, a fixed-size digest out.

    Attributes:
      name: a short name (``"sha256"``, ``"xxh3_128"``).
      digest_size: bytes of every digest.
      digest: ``digest(data: bytes) -> bytes``.
      constructor: optional hashlib-style constructor, ``constructor(data).digest()``; when
        given, the chained loop calls it directly (one Python call less per block).
      encoding: how a block is serialised before hashing: ``"native"`` (jaxkv's byte layout,
        see the module docstring) or ``"cbor"`` (vLLM's canonical CBOR of
        ``(parent, tokens, extra_keys)``).

    Raises:
      ValueError: from the constructor when ``digest_size < 1`` or an unknown encoding.

    Example:
      >>> fn = HashFunction("md5", 16, lambda data: hashlib.md5(data).digest())
      >>> len(fn(b"abc"))
      16
    """

    name: str
    digest_size: int
    digest: Callable[[bytes], bytes]
    constructor: Callable[[bytes], Any] | None = None
    encoding: str = "native"

    def __post_init__(self) -> None:
        if not isinstance(self.digest_size, int) or self.digest_size < 1:
            raise ValueError(f"digest_size must be a positive int, got {self.digest_size!r}")
        if self.encoding not in ("native", "cbor"):
            raise ValueError(f"encoding must be 'native' or 'cbor', got {self.encoding!r}")

    def __call__(self, data: bytes) -> bytes:
        """Returns the digest of ``data``."""
        return self.digest(data)

    def __repr__(self) -> str:
        return f"HashFunction({self.name!r}, digest_size={self.digest_size})"


def _sha256_digest(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


sha256 = HashFunction("sha256", 32, _sha256_digest, constructor=hashlib.sha256)
"""SHA-256 (cryptographic; the default). 32-byte digests."""


def _xxh3_128_digest(data: bytes) -> bytes:
    if _xxhash is None:
        raise ImportError("the xxh3_128 block hash needs the xxhash package: pip install xxhash")
    return _xxhash.xxh3_128_digest(data)


xxhash128 = HashFunction(
    "xxh3_128",
    16,
    _xxhash.xxh3_128_digest if _xxhash is not None else _xxh3_128_digest,
)
"""XXH3-128 (fast, non-cryptographic: use it only where prompts are not adversarial, since
a crafted collision would let one request read another's KV). 16-byte digests."""

sha256_cbor = HashFunction("sha256_cbor", 32, _sha256_digest, constructor=hashlib.sha256,
                           encoding="cbor")
"""vLLM's ``sha256_cbor`` block hash: SHA-256 of canonical CBOR (see the module docstring).
Use it where hashes or KV events must match vLLM's (a KV-aware router that follows vLLM's
event stream, a mixed fleet). Slower than `sha256` (a CBOR encoding per block). 32-byte
digests."""

_NAMED_HASH_FUNCTIONS = {
    "sha256": sha256,
    "sha256_cbor": sha256_cbor,
    "xxh3_128": xxhash128,
    "xxhash": xxhash128,
    "xxhash128": xxhash128,
}


def get_hash_function(hash_fn: HashFunction | str) -> HashFunction:
    """Resolves a hash function given by name or object.

    Args:
      hash_fn: a `HashFunction`, or one of ``"sha256"``, ``"sha256_cbor"``, ``"xxh3_128"``
        (alias ``"xxhash"``).

    Returns:
      The `HashFunction`.

    Raises:
      ValueError: an unknown name.
      TypeError: neither a name nor a `HashFunction`.

    Example:
      >>> get_hash_function("xxhash").digest_size
      16
    """
    if isinstance(hash_fn, HashFunction):
        return hash_fn
    if isinstance(hash_fn, str):
        try:
            return _NAMED_HASH_FUNCTIONS[hash_fn.lower()]
        except KeyError:
            raise ValueError(
                f"unknown hash function {hash_fn!r}; use one of {sorted(_NAMED_HASH_FUNCTIONS)} "
                "or a HashFunction"
            ) from None
    raise TypeError(f"hash_fn must be a HashFunction or a name, got {type(hash_fn).__name__}")


# ----------------------------------------------------------------------------- NONE_HASH

DEFAULT_HASH_SEED = "0"
"""The hash seed used unless another is given: deterministic, so separate processes agree on
block hashes without any environment variable. With ``sha256_cbor`` it gives the same
``NONE_HASH`` as vLLM run with ``PYTHONHASHSEED=0``."""

RANDOM_HASH_SEED = "random"
"""Pass as ``hash_seed`` to `KVCacheManager` to draw a fresh random seed (`random_hash_seed`);
the low-level functions take concrete seeds only and reject it."""


def random_hash_seed() -> str:
    """A fresh, unguessable hash seed (128 random bits as hex), to share with every engine and
    router that must agree on block hashes.

    Example:
      >>> seed = random_hash_seed()
      >>> len(seed), seed != random_hash_seed()
      (32, True)
    """
    return secrets.token_hex(16)


def _check_seed(seed: Any) -> str:
    if not isinstance(seed, str):
        raise TypeError(f"a hash seed must be a str, got {type(seed).__name__}")
    if seed == RANDOM_HASH_SEED:
        raise ValueError(
            f"{RANDOM_HASH_SEED!r} is not a concrete hash seed: draw one with random_hash_seed() "
            "(and share it with the peers that must agree on hashes)"
        )
    return seed


def _cbor(obj: Any) -> bytes:
    if _cbor2 is None:
        raise ImportError("CBOR block hashes need the cbor2 package: pip install cbor2")
    try:
        return _cbor2.dumps(obj, canonical=True)
    except _cbor2.CBOREncodeError as error:
        raise TypeError(f"cannot encode a block hash key as CBOR: {error}") from None


@functools.lru_cache(maxsize=64)
def _seeded_none_hash(hash_fn: HashFunction, seed: str) -> bytes:
    if hash_fn.encoding == "cbor":  # vLLM: NONE_HASH = hash_fn(seed string).
        value = hash_fn(_cbor(seed))
    else:
        value = hash_fn(b"jaxkv.blocks.NONE_HASH\x00" + seed.encode("utf-8"))
    if not isinstance(value, bytes) or len(value) != hash_fn.digest_size:
        raise ValueError(
            f"hash function {hash_fn.name!r} returned {type(value).__name__} of length "
            f"{len(value) if isinstance(value, bytes) else '?'}; expected "
            f"{hash_fn.digest_size} bytes"
        )
    return value


def none_hash(hash_fn: HashFunction | str = sha256, seed: str = DEFAULT_HASH_SEED) -> BlockHash:
    """The parent hash of a request's first block, derived from the hash seed.

    Deterministic: the same hash function and seed give the same value in every process
    (the environment, e.g. ``PYTHONHASHSEED``, plays no part). For `sha256_cbor` it is
    vLLM's ``NONE_HASH`` for ``PYTHONHASHSEED=seed``: SHA-256 of the seed as canonical CBOR.

    Args:
      hash_fn: the block hash function (the value has its digest size).
      seed: the hash seed (`DEFAULT_HASH_SEED` by default; see `random_hash_seed`).

    Returns:
      ``digest_size`` bytes.

    Raises:
      ValueError: the hash function returns digests of the wrong size, or ``seed`` is
        ``"random"``.
      TypeError: a seed that is not a str.

    Example:
      >>> len(none_hash(sha256)), len(none_hash("xxh3_128"))
      (32, 16)
      >>> none_hash(sha256, "a") == none_hash(sha256, "a") != none_hash(sha256, "b")
      True
    """
    return BlockHash(_seeded_none_hash(get_hash_function(hash_fn), _check_seed(seed)))


def hash_identity(hash_fn: HashFunction | str = sha256, seed: str = DEFAULT_HASH_SEED) -> str:
    """A short string naming a block-hash configuration: the hash function and a digest of
    the seed. Two engines compute the same block hashes exactly when their identities are
    equal; pass it to ``jaxkv.transfer.TransferEngine(block_hashing=...)`` so that a
    handshake between engines that disagree is refused. The seed itself is not revealed.

    Args:
      hash_fn: the block hash function.
      seed: the hash seed.

    Returns:
      ``"<hash function name>:seed=<16 hex digits>"``.

    Raises:
      ValueError, TypeError: as `none_hash`.

    Example:
      >>> hash_identity("sha256", "0")
      'sha256:seed=...'
      >>> hash_identity("sha256", "0") == hash_identity("sha256", "1")
      False
    """
    hash_fn = get_hash_function(hash_fn)
    digest = hashlib.sha256(b"jaxkv.blocks.hash_seed\x00" + _check_seed(seed).encode("utf-8"))
    return f"{hash_fn.name}:seed={digest.hexdigest()[:16]}"


NONE_HASH: BlockHash = none_hash(sha256)
"""`none_hash` of `sha256` with `DEFAULT_HASH_SEED`."""


# ----------------------------------------------------------------------------- encoding


def _encode_into(obj: Any, out: list[bytes]) -> None:
    if obj is None:
        out.append(b"N")
    elif obj is True:
        out.append(b"T")
    elif obj is False:
        out.append(b"F")
    elif isinstance(obj, (int, np.integer)):
        value = int(obj)
        raw = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
        out.append(b"I" + _U32.pack(len(raw)) + raw)
    elif isinstance(obj, str):
        raw = obj.encode("utf-8")
        out.append(b"S" + _U32.pack(len(raw)) + raw)
    elif isinstance(obj, (bytes, bytearray, memoryview)):
        raw = bytes(obj)
        out.append(b"B" + _U32.pack(len(raw)) + raw)
    elif isinstance(obj, (float, np.floating)):
        out.append(b"D" + struct.pack("<d", float(obj)))
    elif isinstance(obj, (tuple, list)):
        out.append(b"L" + _U32.pack(len(obj)))
        for item in obj:
            _encode_into(item, out)
    else:
        raise TypeError(
            f"cannot encode {type(obj).__name__} in a block hash key; use None, bool, int, "
            "float, str, bytes or tuples/lists of them"
        )


def encode_key(obj: Any) -> bytes:
    """Canonical, deterministic bytes of a key (no pickle): the same value gives the same
    bytes in every process, Python version and platform, and different values give different
    bytes.

    Tuples and lists encode alike; bool is distinct from int; ints have arbitrary size.

    Args:
      obj: None, bool, int, float, str, bytes, or (nested) tuples/lists of these.

    Returns:
      The encoding.

    Raises:
      TypeError: an unsupported type.

    Example:
      >>> encode_key(("a", 1)) == encode_key(["a", 1])
      True
      >>> encode_key(1) == encode_key(True)
      False
    """
    out: list[bytes] = []
    _encode_into(obj, out)
    return b"".join(out)


def _token_bytes(token_ids: Any) -> bytes:
    """Token ids as little-endian int64 bytes, validated."""
    if isinstance(token_ids, np.ndarray):
        if token_ids.ndim != 1:
            raise ValueError(f"token ids must be one-dimensional, got shape {token_ids.shape}")
        if token_ids.size == 0:
            return b""
        if token_ids.dtype.kind == "u" and token_ids.dtype.itemsize == 8:
            if int(token_ids.max()) >= 2**63:
                raise ValueError("token ids must fit in int64")
        elif token_ids.dtype.kind not in "iu":
            raise TypeError(f"token ids must be integers, got dtype {token_ids.dtype}")
        return token_ids.astype(_I64, copy=False).tobytes()
    if isinstance(token_ids, (str, bytes, bytearray)):
        raise TypeError(f"token ids must be a sequence of ints, got {type(token_ids).__name__}")
    try:
        return struct.pack(f"<{len(token_ids)}q", *token_ids)
    except struct.error as error:
        if "integer" in str(error) and "range" not in str(error):
            raise TypeError(f"token ids must be integers: {error}") from None
        raise ValueError(f"token ids must fit in int64: {error}") from None


def _check_parent(parent_hash: Any, hash_fn: HashFunction, seed: str) -> bytes:
    if parent_hash is None:
        return none_hash(hash_fn, seed)
    if not isinstance(parent_hash, bytes) or len(parent_hash) != hash_fn.digest_size:
        raise ValueError(
            f"parent hash must be {hash_fn.digest_size} bytes of {hash_fn.name}, got "
            f"{type(parent_hash).__name__}"
            + (f" of length {len(parent_hash)}" if isinstance(parent_hash, bytes) else "")
        )
    return parent_hash


def _extra_tail(extra_keys: ExtraKeys | None) -> bytes:
    """The hashed tail for a block's extra keys (see the module docstring)."""
    if not extra_keys:
        return b""
    encoded = encode_key(tuple(extra_keys))
    return encoded + b"\x00" * (-len(encoded) % 8) + _U32.pack(len(encoded))


def _chain(
    parent: bytes,
    data: bytes,
    num_tokens_per_block: int,
    num_blocks: int,
    hash_fn: HashFunction,
    extras: Sequence[ExtraKeys | None] | None,
) -> list[BlockHash]:
    """Hashes ``num_blocks`` consecutive blocks of ``data`` (int64 tokens), chained;
    ``extras`` holds each block's extra keys (None: no block has any)."""
    width = 8 * num_tokens_per_block
    out: list[Any] = []  # BlockHash values (NewType calls would cost a call per block).
    append = out.append
    if hash_fn.encoding == "cbor":
        if _cbor2 is None:
            _cbor(None)  # Raises the ImportError.
        dumps = _cbor2.dumps
        unpack = struct.Struct(f"<{num_tokens_per_block}q").unpack_from
        digest = hash_fn.digest
        try:
            for i in range(num_blocks):
                keys = extras[i] if extras is not None else None
                message = (parent, unpack(data, i * width), tuple(keys) if keys else None)
                parent = digest(dumps(message, canonical=True))
                append(parent)
        except _cbor2.CBOREncodeError as error:
            raise TypeError(f"cannot encode a block hash key as CBOR: {error}") from None
        return out
    constructor = hash_fn.constructor
    if extras is None:
        if constructor is not None:
            for offset in range(0, num_blocks * width, width):
                parent = constructor(parent + data[offset : offset + width]).digest()
                append(parent)
        else:
            digest = hash_fn.digest
            for offset in range(0, num_blocks * width, width):
                parent = digest(parent + data[offset : offset + width])
                append(parent)
    else:
        tails = [_extra_tail(keys) for keys in extras]  # Validates every key first.
        digest = hash_fn.digest
        for i in range(num_blocks):
            offset = i * width
            parent = digest(parent + data[offset : offset + width] + tails[i])
            append(parent)
    return out


# ----------------------------------------------------------------------------- extra keys


class MultiModalInput(NamedTuple):
    """A multimodal input placed in a request's token sequence.

    Attributes:
      mm_hash: identifies the input's content (e.g. a hash of the image bytes).
      offset: index of its first placeholder token in the request.
      length: number of placeholder tokens.

    Example:
      >>> MultiModalInput("img0", offset=3, length=8).mm_hash
      'img0'
    """

    mm_hash: str
    offset: int
    length: int


def _check_mm_inputs(mm_inputs: Sequence[Any]) -> tuple[MultiModalInput, ...]:
    checked = []
    for item in mm_inputs:
        item = MultiModalInput(*item)
        if not isinstance(item.mm_hash, (str, bytes)) or not item.mm_hash:
            raise ValueError(f"multimodal input hash must be a non-empty str or bytes: {item!r}")
        for name in ("offset", "length"):
            value = getattr(item, name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
                raise TypeError(f"multimodal input {name} must be an int: {item!r}")
        if item.offset < 0 or item.length < 1:
            raise ValueError(f"multimodal input needs offset >= 0 and length >= 1: {item!r}")
        checked.append(MultiModalInput(item.mm_hash, int(item.offset), int(item.length)))
    checked.sort(key=lambda m: m.offset)
    for before, after in zip(checked, checked[1:]):
        if after.offset < before.offset + before.length:
            raise ValueError(f"multimodal inputs overlap: {before!r} and {after!r}")
    return tuple(checked)


def _check_lora_and_salt(lora_id: Any, cache_salt: Any) -> None:
    if lora_id is not None and (
        isinstance(lora_id, bool) or not isinstance(lora_id, (int, np.integer, str))
    ):
        raise TypeError(f"lora_id must be an int or str, got {type(lora_id).__name__}")
    if cache_salt is not None and not isinstance(cache_salt, (str, bytes)):
        raise TypeError(f"cache_salt must be a str or bytes, got {type(cache_salt).__name__}")


def _extra_keys(
    start: int,
    end: int,
    lora_id: Any,
    mm_inputs: tuple[MultiModalInput, ...],
    mm_first: int,
    cache_salt: Any,
) -> tuple[ExtraKeys | None, int]:
    """Extra keys of the block ``[start, end)`` and the first mm input a later block can
    overlap (inputs are sorted and disjoint)."""
    keys: list[Any] = []
    if lora_id is not None:
        keys.append(lora_id)
    index = mm_first
    while index < len(mm_inputs) and mm_inputs[index].offset + mm_inputs[index].length <= start:
        index += 1
    next_first = index
    while index < len(mm_inputs) and mm_inputs[index].offset < end:
        item = mm_inputs[index]
        keys.append((item.mm_hash, item.offset - start))
        index += 1
    if start == 0 and cache_salt:
        keys.append(cache_salt)
    return (tuple(keys) if keys else None), next_first


def block_extra_keys(
    start: int,
    end: int,
    *,
    lora_id: int | str | None = None,
    mm_inputs: Sequence[MultiModalInput | tuple[str, int, int]] = (),
    cache_salt: str | bytes | None = None,
) -> ExtraKeys | None:
    """The extra hash keys of the block holding tokens ``[start, end)`` of a request.

    Args:
      start: index of the block's first token.
      end: one past its last token.
      lora_id: the request's LoRA adapter id, if any.
      mm_inputs: the request's multimodal inputs (any order; must not overlap).
      cache_salt: the request's cache salt, if any; only the first block (``start == 0``)
        carries it. An empty salt counts as none.

    Returns:
      ``(lora_id, *(mm_hash, offset - start) for overlapping inputs, salt)`` with absent parts
      left out, or None when the block has no extra keys.

    Raises:
      ValueError: ``end <= start`` or bad multimodal inputs.
      TypeError: wrongly typed arguments.

    Example:
      >>> mm = [MultiModalInput("h1", 0, 5), MultiModalInput("h2", 10, 5)]
      >>> block_extra_keys(3, 8, mm_inputs=mm)
      (('h1', -3),)
      >>> block_extra_keys(0, 15, mm_inputs=mm, lora_id=7, cache_salt="s")
      (7, ('h1', 0), ('h2', 10), 's')
      >>> block_extra_keys(5, 10, mm_inputs=mm) is None
      True
    """
    if end <= start or start < 0:
        raise ValueError(f"need 0 <= start < end, got start={start}, end={end}")
    _check_lora_and_salt(lora_id, cache_salt)
    keys, _ = _extra_keys(start, end, lora_id, _check_mm_inputs(mm_inputs), 0, cache_salt)
    return keys


def hash_block_tokens(
    parent_hash: bytes | None,
    token_ids: Sequence[int] | np.ndarray,
    extra_keys: ExtraKeys | None = None,
    hash_fn: HashFunction | str = sha256,
    *,
    block_size: int | None = None,
    seed: str = DEFAULT_HASH_SEED,
) -> BlockHash:
    """Hashes one full block, chained to its parent.

    Args:
      parent_hash: the previous block's hash, or None for a request's first block (then
        `none_hash` is used).
      token_ids: the block's tokens (ints, or an integer numpy array).
      extra_keys: the block's extra keys (`block_extra_keys`); ``()`` counts as None.
      hash_fn: `sha256` (default), `xxhash128`, a name, or any `HashFunction`.
      block_size: when given, ``token_ids`` must hold exactly this many tokens.
      seed: the hash seed, used when ``parent_hash`` is None (see `none_hash`).

    Returns:
      The block hash (``hash_fn.digest_size`` bytes).

    Raises:
      PartialBlockError: no tokens, or fewer/more than ``block_size``.
      ValueError: a parent hash of the wrong size, or token ids outside int64.
      TypeError: non-integer tokens or unencodable extra keys.

    Example:
      >>> h0 = hash_block_tokens(None, range(4), block_size=4)
      >>> h1 = hash_block_tokens(h0, [4, 5, 6, 7], extra_keys=("salt",))
      >>> len(h1), h1 != hash_block_tokens(h0, [4, 5, 6, 7])
      (32, True)
    """
    hash_fn = get_hash_function(hash_fn)
    parent = _check_parent(parent_hash, hash_fn, seed)
    data = _token_bytes(token_ids)
    num_tokens = len(data) // 8
    if num_tokens == 0:
        raise PartialBlockError("a block hash needs at least one token")
    if block_size is not None and num_tokens != block_size:
        raise PartialBlockError(
            f"a full block holds {block_size} tokens, got {num_tokens}: partial blocks are "
            "never hashed"
        )
    extras = None if not extra_keys else [tuple(extra_keys)]
    return _chain(parent, data, num_tokens, 1, hash_fn, extras)[0]


# ----------------------------------------------------------------------------- per request


class RequestBlockHasher:
    """Incremental block hashes of one request: hashes each block once, when it fills.

    Tokens are appended as they arrive (the prompt, then each sampled token); only newly
    completed full blocks are hashed, and the partial tail is kept until it fills.

    Args:
      block_size: tokens per block.
      hash_fn: the hash function (`sha256` by default, or a name).
      lora_id: the request's LoRA adapter id, an extra key of every block.
      mm_inputs: the request's multimodal inputs; each is an extra key of the blocks it
        overlaps, with its start offset relative to the block.
      cache_salt: isolates this request's cache (extra key of the first block only).
      seed: the hash seed (see `none_hash`).

    Raises:
      ValueError, TypeError: invalid arguments.

    Example:
      >>> hasher = RequestBlockHasher(block_size=4)
      >>> len(hasher.extend([1, 2, 3, 4, 5, 6]))
      1
      >>> len(hasher.extend([7, 8])), hasher.num_tokens, len(hasher.block_hashes)
      (1, 8, 2)
    """

    __slots__ = (
        "_block_hashes",
        "_block_size",
        "_bytes_hash",
        "_cache_salt",
        "_extra_keys",
        "_hash_fn",
        "_lora_id",
        "_mm_first",
        "_mm_inputs",
        "_needs_extra",
        "_num_tokens",
        "_parent",
        "_pending",
    )

    def __init__(
        self,
        block_size: int,
        hash_fn: HashFunction | str = sha256,
        *,
        lora_id: int | str | None = None,
        mm_inputs: Sequence[MultiModalInput | tuple[str, int, int]] = (),
        cache_salt: str | bytes | None = None,
        seed: str = DEFAULT_HASH_SEED,
    ) -> None:
        if not isinstance(block_size, (int, np.integer)) or isinstance(block_size, bool):
            raise TypeError(f"block_size must be an int, got {type(block_size).__name__}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        _check_lora_and_salt(lora_id, cache_salt)
        self._block_size = int(block_size)
        self._hash_fn = get_hash_function(hash_fn)
        self._lora_id = lora_id
        self._mm_inputs = _check_mm_inputs(mm_inputs)
        self._cache_salt = cache_salt
        self._needs_extra = lora_id is not None or bool(self._mm_inputs) or bool(cache_salt)
        self._mm_first = 0
        self._parent = none_hash(self._hash_fn, seed)
        self._pending: list[int] = []
        self._num_tokens = 0
        self._block_hashes: list[BlockHash] = []
        self._extra_keys: list[ExtraKeys | None] | None = [] if self._needs_extra else None
        # What `hash_full_block` hashes a block with directly: a native hash of the parent and
        # the packed tokens, when no block has extra keys (None: go through `extend_packed`).
        native = self._hash_fn.constructor is not None and self._hash_fn.encoding == "native"
        self._bytes_hash = self._hash_fn.constructor if native and not self._needs_extra else None

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        return self._block_size

    @property
    def hash_fn(self) -> HashFunction:
        """The hash function."""
        return self._hash_fn

    @property
    def lora_id(self) -> int | str | None:
        """The LoRA id given at construction."""
        return self._lora_id

    @property
    def num_tokens(self) -> int:
        """Tokens appended so far (including the unhashed tail)."""
        return self._num_tokens

    @property
    def block_hashes(self) -> list[BlockHash]:
        """Hashes of every full block so far, in order. The list is the hasher's own: read it,
        do not modify it."""
        return self._block_hashes

    def extra_keys(self, block_index: int) -> ExtraKeys | None:
        """The extra keys that went into full block ``block_index``'s hash.

        Raises:
          IndexError: the block is not full yet.

        Example:
          >>> hasher = RequestBlockHasher(2, cache_salt="s")
          >>> _ = hasher.extend([1, 2, 3, 4])
          >>> hasher.extra_keys(0), hasher.extra_keys(1)
          (('s',), None)
        """
        if not 0 <= block_index < len(self._block_hashes):
            raise IndexError(
                f"block {block_index} is not a full block (the request has "
                f"{len(self._block_hashes)} full blocks)"
            )
        return None if self._extra_keys is None else self._extra_keys[block_index]

    def extend(self, token_ids: Sequence[int] | np.ndarray) -> list[BlockHash]:
        """Appends tokens and hashes every block they complete.

        Args:
          token_ids: new tokens (ints or an integer numpy array).

        Returns:
          Hashes of the blocks completed by these tokens (possibly none).

        Raises:
          TypeError, ValueError: tokens that are not int64 integers (nothing is appended).

        Example:
          >>> hasher = RequestBlockHasher(2)
          >>> [len(hasher.extend([t])) for t in range(5)]
          [0, 1, 0, 1, 0]
        """
        count = len(token_ids)
        if count == 0:
            return []
        pending = self._pending
        size = self._block_size
        if len(pending) + count < size:  # No block completes: validate and keep.
            _token_bytes(token_ids)
            pending.extend(token_ids.tolist() if isinstance(token_ids, np.ndarray) else token_ids)
            self._num_tokens += count
            return []
        return self.extend_packed(_token_bytes(token_ids))  # Validates before any change.

    def extend_packed(self, data: bytes) -> list[BlockHash]:
        """`extend` with tokens already packed as little-endian int64 bytes (unchecked: the
        block manager packs and validates them once for the whole request).

        Example:
          >>> hasher = RequestBlockHasher(2)
          >>> len(hasher.extend_packed(struct.pack("<3q", 1, 2, 3))), hasher.num_tokens
          (1, 3)
        """
        count = len(data) // 8
        pending = self._pending
        size = self._block_size
        if len(pending) + count < size:
            pending.extend(struct.unpack(f"<{count}q", data))
            self._num_tokens += count
            return []
        if pending:
            data = _token_bytes(pending) + data
        total = len(pending) + count
        num_blocks = total // size
        tail_start = num_blocks * size
        extras = None
        if self._needs_extra:
            extras, mm_first = self._block_extras(len(self._block_hashes), num_blocks)
        hashes = _chain(self._parent, data, size, num_blocks, self._hash_fn, extras)
        if extras is not None:
            self._extra_keys.extend(extras)  # type: ignore[union-attr]
            self._mm_first = mm_first
        self._block_hashes.extend(hashes)
        self._parent = hashes[-1]
        tail = data[tail_start * 8 :]
        self._pending = list(struct.unpack(f"<{len(tail) // 8}q", tail)) if tail else []
        self._num_tokens += count
        return hashes

    def hash_full_block(self, data: bytes, start: int) -> BlockHash | None:
        """Hashes one whole block of tokens that starts at token `start` (`data`: exactly
        `block_size` little-endian int64 tokens), when the hasher stands at `start` with no
        partial tail; None otherwise (feed the tokens with `extend_packed` instead). The decode
        fast path: one call per block a step filled, no repacking, no loop.

        Example:
          >>> hasher = RequestBlockHasher(2)
          >>> hasher.hash_full_block(struct.pack("<2q", 1, 2), 0) == hasher.block_hashes[0]
          True
          >>> hasher.hash_full_block(struct.pack("<2q", 3, 4), 0) is None  # not at token 0
          True
        """
        if self._num_tokens != start or self._pending:
            return None
        constructor = self._bytes_hash
        if constructor is None:
            return self.extend_packed(data)[-1]
        block_hash = constructor(self._parent + data).digest()
        self._block_hashes.append(block_hash)
        self._parent = block_hash
        self._num_tokens = start + self._block_size
        return block_hash

    def extra_keys_of(self, start: int, stop: int) -> list[ExtraKeys | None] | None:
        """The extra keys of full blocks ``[start, stop)``, or None when no block has any
        (no LoRA, multimodal input or salt).

        Example:
          >>> hasher = RequestBlockHasher(2, lora_id=7)
          >>> _ = hasher.extend([1, 2, 3, 4])
          >>> hasher.extra_keys_of(0, 2), RequestBlockHasher(2).extra_keys_of(0, 2)
          ([(7,), (7,)], None)
        """
        return None if self._extra_keys is None else self._extra_keys[start:stop]

    def _block_extras(
        self, first_block: int, num_blocks: int
    ) -> tuple[list[ExtraKeys | None], int]:
        size = self._block_size
        keys_list: list[ExtraKeys | None] = []
        mm_first = self._mm_first
        for block in range(first_block, first_block + num_blocks):
            start = block * size
            keys, mm_first = _extra_keys(
                start, start + size, self._lora_id, self._mm_inputs, mm_first, self._cache_salt
            )
            keys_list.append(keys)
        return keys_list, mm_first


def hash_request_tokens(
    token_ids: Sequence[int] | np.ndarray,
    block_size: int,
    hash_fn: HashFunction | str = sha256,
    *,
    lora_id: int | str | None = None,
    mm_inputs: Sequence[MultiModalInput | tuple[str, int, int]] = (),
    cache_salt: str | bytes | None = None,
    seed: str = DEFAULT_HASH_SEED,
) -> list[BlockHash]:
    """Chained hashes of every full block of a token sequence (a partial tail is ignored).

    Args:
      token_ids: the request's tokens.
      block_size: tokens per block.
      hash_fn: the hash function.
      lora_id, mm_inputs, cache_salt: extra keys, as in `RequestBlockHasher`.
      seed: the hash seed (see `none_hash`).

    Returns:
      ``len(token_ids) // block_size`` hashes.

    Raises:
      TypeError, ValueError: invalid arguments.

    Example:
      >>> hashes = hash_request_tokens(list(range(10)), block_size=4)
      >>> len(hashes), hashes[1] == hash_block_tokens(hashes[0], [4, 5, 6, 7])
      (2, True)
    """
    hasher = RequestBlockHasher(
        block_size, hash_fn, lora_id=lora_id, mm_inputs=mm_inputs, cache_salt=cache_salt,
        seed=seed,
    )
    hasher.extend(token_ids)
    return list(hasher.block_hashes)

