"""Control messages between engines, carried as NIXL notifications (msgpack, tagged union,
size-bounded, schema-validated like the metadata)."""

from __future__ import annotations

from typing import Annotated

import msgspec

from jaxkv.transfer._metadata import MAX_METADATA_BYTES

__all__ = [
    "Ack",
    "Done",
    "Format",
    "Formatted",
    "Heartbeat",
    "Hello",
    "MAX_MESSAGE_BYTES",
    "Ready",
    "Released",
    "Want",
    "decode_message",
    "encode_message",
]

MAX_MESSAGE_BYTES = MAX_METADATA_BYTES + 4096
_Id = Annotated[str, msgspec.Meta(min_length=1, max_length=512)]
_Rank = Annotated[int, msgspec.Meta(ge=0, le=1 << 16)]


class Hello(msgspec.Struct, tag="hello", frozen=True, forbid_unknown_fields=True):
    """Consumer -> producer, once per producer agent: lets the producer answer (`Ack`)."""

    engine_id: _Id
    generation: Annotated[int, msgspec.Meta(ge=0)]
    agent_name: _Id
    agent_metadata: Annotated[bytes, msgspec.Meta(max_length=MAX_METADATA_BYTES)]


class Heartbeat(msgspec.Struct, tag="hb", frozen=True, forbid_unknown_fields=True):
    """Consumer -> producer while reading: extends the request's lease."""

    request_id: _Id
    engine_id: _Id


class Done(msgspec.Struct, tag="done", frozen=True, forbid_unknown_fields=True):
    """Consumer rank -> producer rank: finished with the request's blocks (read or failed).
    Unique per (request, producer rank, consumer engine, consumer rank)."""

    request_id: _Id
    engine_id: _Id
    agent_name: _Id
    consumer_rank: _Rank
    producer_rank: _Rank
    expected: Annotated[int, msgspec.Meta(ge=1, le=1 << 16)]
    ok: bool
    # The consumer's read attempt, echoed in `Ack`: answers to an earlier read of the same
    # request are ignored. Sent attached to the READ itself when the read has data.
    attempt: Annotated[int, msgspec.Meta(ge=0)] = 0
    # The producer process generation the consumer planned its READs against (-1: none); the
    # producer refuses to confirm a read planned against regions it no longer registers.
    generation: Annotated[int, msgspec.Meta(ge=-1)] = -1
    # The consumer's own key of the read (its request id; "" = the producer's request id): a
    # producer request read by several consumer requests is freed once each of them finished.
    read_id: Annotated[str, msgspec.Meta(max_length=512)] = ""


class Ack(msgspec.Struct, tag="ack", frozen=True, forbid_unknown_fields=True):
    """Producer -> consumer answer to `Done`: whether the blocks were still pinned when the
    consumer's `Done` arrived (after its read had completed)."""

    request_id: _Id
    producer_rank: _Rank
    consumer_rank: _Rank
    pinned: bool
    attempt: Annotated[int, msgspec.Meta(ge=0)] = 0
    # The consumer read regions of an older generation (the producer re-registered since):
    # its cached metadata is stale and must be fetched again.
    stale: bool = False
    # The producer never pinned the request (not published within its early-read grace window).
    unpublished: bool = False
    # Integrity digests (`jaxkv.transfer._digest`) of the producer rank's block images, sent
    # with a pinned answer when the engines enabled them: the algorithm, the block positions
    # digested (empty: every position of the request, in order) and the little-endian uint64
    # digests. The Ack is the one message every read gets from every producer rank once its
    # bytes landed, whatever the transport or control channel: no extra round trip.
    digest_algorithm: Annotated[str, msgspec.Meta(pattern="^(|xxh3|sum32)$")] = ""
    digest_positions: Annotated[list[Annotated[int, msgspec.Meta(ge=0, le=1 << 30)]],
                                msgspec.Meta(max_length=1 << 16)] = []
    digests: Annotated[bytes, msgspec.Meta(max_length=8 << 20)] = b""


class Want(msgspec.Struct, tag="want", frozen=True, forbid_unknown_fields=True):
    """Consumer -> producer process: send me `Ready` updates for this request (a request
    published layer by layer, or from inside a jitted step, is read only as it becomes ready)."""

    request_id: _Id
    agent_name: _Id
    # Sent for every read (not only layer-wise ones) when the transport prepares per-consumer
    # buffers (`Transport.announces_reads`, e.g. jax.experimental.transfer): which read, how
    # many of the request's blocks it reads (the tail; -1: all), and the consumer process's
    # side channel (its metadata: ranks, layout, block size). The JAX transport also sends
    # the read's attempt and the geometry of the consumer's ranks inline (`layout` empty: not
    # given), so that the producer formats without fetching the consumer's metadata.
    read_id: Annotated[str, msgspec.Meta(max_length=512)] = ""
    num_blocks: Annotated[int, msgspec.Meta(ge=-1, le=1 << 30)] = -1
    address: Annotated[list[str | int], msgspec.Meta(max_length=2)] = []
    attempt: Annotated[int, msgspec.Meta(ge=0)] = 0
    layout: Annotated[str, msgspec.Meta(max_length=5)] = ""
    block_size: Annotated[int, msgspec.Meta(ge=0, le=1 << 20)] = 0
    tp_size: Annotated[int, msgspec.Meta(ge=0, le=1 << 16)] = 0
    pp_size: Annotated[int, msgspec.Meta(ge=0, le=1 << 16)] = 0
    layers_per_pp: Annotated[list[Annotated[int, msgspec.Meta(ge=1, le=1 << 20)]],
                             msgspec.Meta(max_length=1 << 16)] = []
    ranks: Annotated[list[_Rank], msgspec.Meta(max_length=1 << 16)] = []
    # JAX transport, a layer-wise read: pulled in layer groups of at least this many bytes
    # (`jaxkv.transfer._formatter.layer_groups`, the same ranges on both sides; 0: whole)
    layer_group_bytes: Annotated[int, msgspec.Meta(ge=0, le=1 << 40)] = 0


class Ready(msgspec.Struct, tag="ready", frozen=True, forbid_unknown_fields=True):
    """Producer process -> consumer: the global layers ``[0, layer_stop)`` that `ranks` hold
    of the request are written (monotonic; ``layer_stop`` = the model's layer count: all)."""

    request_id: _Id
    ranks: Annotated[list[_Rank], msgspec.Meta(max_length=1 << 16)]
    layer_stop: Annotated[int, msgspec.Meta(ge=0, le=1 << 20)]


_Key = Annotated[str, msgspec.Meta(max_length=512)]
_Chunk = Annotated[int, msgspec.Meta(ge=0, le=1 << 24)]
_Address = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]


class Format(msgspec.Struct, tag="format", frozen=True, forbid_unknown_fields=True):
    """Consumer -> producer process: gather these byte ranges of a published request into a
    send buffer (one chunk of a formatted read, `jaxkv.transfer._formatted`)."""

    request_id: _Id
    engine_id: _Id
    agent_name: _Id
    read_id: _Key
    attempt: Annotated[int, msgspec.Meta(ge=0)]
    chunk: _Chunk
    producer_rank: _Rank
    consumer_rank: _Rank
    generation: Annotated[int, msgspec.Meta(ge=-1)]
    nbytes: Annotated[int, msgspec.Meta(ge=0, le=1 << 40)]
    # The ranges, explicit: int64 little-endian [N, 5] (producer region, offset, length,
    # count, stride); or as per-block templates (same columns, offsets within a block) over
    # the tail of `num_remote` of the request's blocks, rows [first_row, first_row + num_rows)
    # of templates x blocks in template-major order (`jaxkv.transfer._formatted`).
    rows: Annotated[bytes, msgspec.Meta(max_length=4 << 20)] = b""
    templates: Annotated[bytes, msgspec.Meta(max_length=1 << 20)] = b""
    first_row: Annotated[int, msgspec.Meta(ge=0, le=1 << 40)] = 0
    num_rows: Annotated[int, msgspec.Meta(ge=0, le=1 << 24)] = 0
    num_remote: Annotated[int, msgspec.Meta(ge=0, le=1 << 30)] = 0
    # the global layers [0, layer_stop) the ranges read must be published first (0: all)
    layer_stop: Annotated[int, msgspec.Meta(ge=0, le=1 << 20)] = 0


class Formatted(msgspec.Struct, tag="formatted", frozen=True, forbid_unknown_fields=True):
    """Producer -> consumer: where a chunk's gathered bytes wait (`error` empty), or why
    they cannot be gathered."""

    request_id: _Id
    attempt: Annotated[int, msgspec.Meta(ge=0)]
    chunk: _Chunk
    producer_rank: _Rank
    consumer_rank: _Rank
    address: _Address = 0
    nbytes: Annotated[int, msgspec.Meta(ge=0, le=1 << 40)] = 0
    error: Annotated[str, msgspec.Meta(max_length=1024)] = ""


class Released(msgspec.Struct, tag="released", frozen=True, forbid_unknown_fields=True):
    """Consumer -> producer process, attached to the READ of a formatted chunk: the chunk's
    send buffer may be reused."""

    request_id: _Id
    agent_name: _Id
    attempt: Annotated[int, msgspec.Meta(ge=0)]
    chunk: _Chunk
    producer_rank: _Rank
    consumer_rank: _Rank


Message = Hello | Heartbeat | Done | Ack | Want | Ready | Format | Formatted | Released
_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Message)


def encode_message(message: Message) -> bytes:
    return _ENCODER.encode(message)


def decode_message(payload: bytes) -> Message:
    """Raises ValueError for an oversized, malformed or unknown message."""
    if len(payload) > MAX_MESSAGE_BYTES:
        raise ValueError(f"message of {len(payload)} bytes is above {MAX_MESSAGE_BYTES}")
    try:
        return _DECODER.decode(payload)
    except (msgspec.ValidationError, msgspec.DecodeError) as error:
        raise ValueError(f"malformed message: {error}") from error
