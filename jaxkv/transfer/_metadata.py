"""Engine metadata: what an engine publishes so that a peer can read its KV blocks.

Wire format: msgpack through msgspec structs, versioned (`PROTOCOL_VERSION`), size-bounded
(`MAX_METADATA_BYTES`) and validated against the schema on decode (types, ranges, string and
list lengths, cross-field consistency). No JAX and no NIXL import.

Fields that must match between two engines for a transfer to be meaningful (model geometry and
element type) are hashed into `EngineMetadata.compat_hash`; fields that may differ (TP/PP
sizes, layout, block size) are converted by the read planner or refused by it with a reason.
"""

from __future__ import annotations

import hashlib
from typing import Annotated

import msgspec

from jaxkv._parallel import EngineConfig
from jaxkv._spec import KVCacheSpec, canonical_dtype, validate_layout

__all__ = [
    "AgentInfo",
    "EngineMetadata",
    "IncompatibleEngineError",
    "MAX_METADATA_BYTES",
    "MetadataError",
    "PROTOCOL_VERSION",
    "RankInfo",
    "RegionInfo",
    "check_compatible",
    "compat_fields",
    "compute_compat_hash",
    "decode_metadata",
    "encode_metadata",
    "engine_metadata",
]

PROTOCOL_VERSION = 6  # 2: Done names the consumer's read (read_id); 3: metadata names the
# transport, control connections on the side channel, Want describes the read; 4: metadata
# describes packed / interleaved / padded storage (kv_interleaved, packing, packed_axis,
# head_dim_alignment, stored_head_dim, stored_layout); 5: metadata declares the integrity
# digests (digests), Ack carries them; 6: formatted reads (Format, Formatted, Released),
# sampled digest positions drawn by the splitmix64 sampler, Want names layer groups
"""Version of the wire format; a peer speaking another version is refused."""

MAX_METADATA_BYTES = 8 << 20
"""Largest encoded `EngineMetadata` accepted (NIXL agent metadata is a few KiB per agent)."""

_U64 = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]
_NonNeg = Annotated[int, msgspec.Meta(ge=0, le=(1 << 62))]
_Positive = Annotated[int, msgspec.Meta(ge=1, le=(1 << 40))]
_Small = Annotated[int, msgspec.Meta(ge=1, le=1 << 16)]
_Name = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
_OptIndex = Annotated[int, msgspec.Meta(ge=-1, le=1 << 20)]


class MetadataError(ValueError):
    """A metadata payload that is malformed, oversized, of another version or inconsistent."""


class IncompatibleEngineError(ValueError):
    """Two engines whose caches cannot exchange blocks; the message names the fields."""


class RegionInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One registered cache buffer of one rank (a shard of one cache array).

    `layer` / `kv` are -1 when the array spans every (local) layer / both K and V. `layer` is a
    global layer index. Block `b` of the region starts at ``base_address + b * block_len``.
    """

    array_index: Annotated[int, msgspec.Meta(ge=0, le=1 << 20)]
    layer: _OptIndex
    kv: Annotated[int, msgspec.Meta(ge=-1, le=1)]
    head_start: _NonNeg
    head_stop: _NonNeg
    base_address: _U64
    block_len: _Positive
    num_blocks: _Positive
    device_id: _NonNeg
    memory_kind: Annotated[str, msgspec.Meta(pattern="^(DRAM|VRAM)$")]


class AgentInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One process's transport endpoint: its name, its serialized transport metadata (NIXL:
    `get_agent_metadata`) and the side-channel address of its process, where control messages
    for the ranks it serves go (None: the address the metadata was fetched from; a
    multi-controller engine serves every process's entry from one address)."""

    name: _Name
    metadata: Annotated[bytes, msgspec.Meta(max_length=MAX_METADATA_BYTES)]
    control: tuple[Annotated[str, msgspec.Meta(min_length=1, max_length=255)],
                   Annotated[int, msgspec.Meta(ge=1, le=65535)]] | None = None


class RankInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One rank of an engine: its coordinates, agent and registered regions."""

    rank: Annotated[int, msgspec.Meta(ge=0, le=1 << 16)]
    agent_name: _Name
    regions: Annotated[list[RegionInfo], msgspec.Meta(max_length=1 << 16)]


class EngineMetadata(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What an engine publishes through its side channel.

    Attributes:
      version: `PROTOCOL_VERSION` of the publisher.
      engine_id: stable name of the engine.
      generation: changes whenever the engine restarts or re-registers (a peer that sees a new
        generation re-handshakes and forgets the old agents).
      tp_size, pp_size, layers_per_pp: the parallel split.
      num_layers, num_kv_heads, head_dim, kv_factor, mla, dtype: model geometry (must match).
      layout, block_size: per-block arrangement (may differ: converted after the read).
      kv_interleaved, packing, packed_axis, head_dim_alignment: the storage fields of
        `KVCacheSpec` (tpu-inference's K/V interleaved on the head axis, sub-32-bit values
        packed per 32-bit word, head dim padded to the alignment); may differ between the
        engines (only values are moved, never padding).
      stored_head_dim: ``D`` as stored (`head_dim` rounded up to `head_dim_alignment`).
      stored_layout: `KVCacheSpec.stored_layout`: the stored block axes, the packed axis
        followed by its lowercase position in the word (``"THhD"``); equal to `layout` for
        an unpacked cache. Both derived fields are checked against the others on decode.
      compat_hash: hex digest over `compat_fields`.
      agents: the transport's entry of each of the engine's processes (NIXL: its agent).
      ranks: per rank, its agent and regions (may be a subset while being assembled).
      transport: how peers move the KV (``"nixl"``: one-sided READs of the registered
        regions; ``"jax"``: `jax.experimental.transfer` pulls); both engines must agree, and
        `agents` carries each process's transport entry.
      block_hashing: how the engine names blocks by content (prefix caching, KV events), an
        opaque string such as ``"sha256_cbor:seed=ab12"``; None: not declared. Two engines
        that both declare it must agree (`check_compatible`).
      digests: the engine's integrity digests (`jaxkv.transfer._digest`): ``"off"``,
        ``"full"`` or ``"sampled:K"``; both engines of a transfer must declare the same (a
        producer computes them, a consumer verifies them: one without the other would be
        a silent no-op or a refusal of every read).
    """

    version: Annotated[int, msgspec.Meta(ge=0, le=1 << 16)]
    engine_id: _Name
    generation: _NonNeg
    tp_size: _Small
    pp_size: _Small
    layers_per_pp: Annotated[list[_Positive], msgspec.Meta(min_length=1, max_length=1 << 16)]
    num_layers: _Positive
    num_kv_heads: _Positive
    head_dim: _Positive
    kv_factor: Annotated[int, msgspec.Meta(ge=1, le=2)]
    mla: bool
    dtype: Annotated[str, msgspec.Meta(min_length=1, max_length=32)]
    layout: Annotated[str, msgspec.Meta(min_length=2, max_length=5)]
    block_size: _Positive
    compat_hash: Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{64}$")]
    agents: Annotated[list[AgentInfo], msgspec.Meta(max_length=1 << 16)]
    ranks: Annotated[list[RankInfo], msgspec.Meta(max_length=1 << 16)]
    block_hashing: Annotated[str, msgspec.Meta(min_length=1, max_length=1024)] | None = None
    transport: Annotated[str, msgspec.Meta(pattern="^[a-z][a-z0-9_]{0,31}$")] = "nixl"
    kv_interleaved: bool = False
    packing: Annotated[int, msgspec.Meta(ge=1, le=4)] | None = None
    packed_axis: Annotated[str, msgspec.Meta(pattern="^[HT]$")] = "H"
    head_dim_alignment: _Small = 1
    stored_head_dim: Annotated[int, msgspec.Meta(ge=0, le=1 << 40)] = 0
    stored_layout: Annotated[str, msgspec.Meta(max_length=6)] = ""
    digests: Annotated[str, msgspec.Meta(pattern="^(off|full|sampled:[1-9][0-9]{0,4})$")] = "off"

    # -- derived --------------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def dtype_itemsize(self) -> int:
        return canonical_dtype(self.dtype).itemsize

    def spec(self) -> KVCacheSpec:
        """The model-wide `KVCacheSpec` this metadata describes."""
        return KVCacheSpec(
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            block_size=self.block_size,
            dtype=self.dtype,
            layout=self.layout,
            kv_factor=self.kv_factor,
            mla=self.mla,
            kv_interleaved=self.kv_interleaved,
            packing=self.packing,
            packed_axis=self.packed_axis,
            head_dim_alignment=self.head_dim_alignment,
        )

    @property
    def padded(self) -> bool:
        """Whether the engine's blocks store padding or interleave K/V on the head axis (the
        planner then moves values row by row: `KVCacheSpec.payload_runs`)."""
        return self.kv_interleaved or self.packing is not None or (
            self.stored_head_dim != self.head_dim)

    def config(self) -> EngineConfig:
        """The `EngineConfig` (TP/PP split) this metadata describes."""
        return EngineConfig(self.spec(), self.tp_size, self.pp_size, tuple(self.layers_per_pp))

    def rank_info(self, rank: int) -> RankInfo:
        if 0 <= rank < len(self.ranks) and self.ranks[rank].rank == rank:
            return self.ranks[rank]  # ranks are published in order: no scan
        for info in self.ranks:
            if info.rank == rank:
                return info
        raise KeyError(f"engine {self.engine_id!r} publishes no rank {rank}")

    def agent_metadata(self, name: str) -> bytes:
        for agent in self.agents:
            if agent.name == name:
                return agent.metadata
        raise KeyError(f"engine {self.engine_id!r} publishes no agent {name!r}")


def compat_fields(meta: EngineMetadata) -> dict[str, object]:
    """The fields that must be equal on both sides of a transfer."""
    return {
        "version": meta.version,
        "num_layers": meta.num_layers,
        "num_kv_heads": meta.num_kv_heads,
        "head_dim": meta.head_dim,
        "kv_factor": meta.kv_factor,
        "mla": meta.mla,
        "dtype": meta.dtype,
    }


def compute_compat_hash(fields: dict[str, object]) -> str:
    """sha256 over a canonical msgpack encoding of `compat_fields`."""
    canonical = msgspec.msgpack.encode(sorted(fields.items()))
    return hashlib.sha256(canonical).hexdigest()


def engine_metadata(
    engine_id: str,
    config: EngineConfig,
    ranks: list[RankInfo],
    agents: list[AgentInfo],
    generation: int = 0,
    block_hashing: str | None = None,
    transport: str = "nixl",
    digests: str = "off",
) -> EngineMetadata:
    """Builds a validated `EngineMetadata` from an `EngineConfig` and per-rank registrations.

    Raises:
      MetadataError: the description is inconsistent (see `validate_metadata`).
    """
    spec = config.spec
    fields = dict(
        version=PROTOCOL_VERSION,
        engine_id=engine_id,
        generation=int(generation),
        tp_size=config.tp_size,
        pp_size=config.pp_size,
        layers_per_pp=list(config.layer_split),
        num_layers=spec.num_layers,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        kv_factor=spec.kv_factor,
        mla=spec.mla,
        dtype=spec.dtype.name,
        layout=spec.layout,
        block_size=spec.block_size,
        compat_hash="0" * 64,
        agents=list(agents),
        ranks=sorted(ranks, key=lambda r: r.rank),
        block_hashing=block_hashing,
        transport=transport,
        kv_interleaved=spec.kv_interleaved,
        packing=spec.packing,
        packed_axis=spec.packed_axis,
        head_dim_alignment=spec.head_dim_alignment,
        stored_head_dim=spec.block_shape()[-1],
        stored_layout=spec.stored_layout,
        digests=digests,
    )
    meta = EngineMetadata(**fields)
    meta = msgspec.structs.replace(meta, compat_hash=compute_compat_hash(compat_fields(meta)))
    validate_metadata(meta)
    return meta


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(EngineMetadata)


def encode_metadata(meta: EngineMetadata) -> bytes:
    """msgpack bytes of `meta` (raises `MetadataError` above `MAX_METADATA_BYTES`)."""
    payload = _ENCODER.encode(meta)
    if len(payload) > MAX_METADATA_BYTES:
        raise MetadataError(f"engine metadata is {len(payload)} bytes, above {MAX_METADATA_BYTES}")
    return payload


def decode_metadata(
    payload: bytes, expected_engine_id: str | None = None, max_bytes: int = MAX_METADATA_BYTES
) -> EngineMetadata:
    """Decodes and validates a payload from `encode_metadata`.

    Raises:
      MetadataError: oversized, not msgpack, not matching the schema, another protocol
        version, another engine id than expected, or internally inconsistent.
    """
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise MetadataError(f"metadata payload must be bytes, got {type(payload).__name__}")
    if len(payload) > max_bytes:
        raise MetadataError(
            f"metadata payload is {len(payload)} bytes, above the {max_bytes} limit"
        )
    try:
        meta = _DECODER.decode(payload)
    except (msgspec.ValidationError, msgspec.DecodeError) as error:
        raise MetadataError(f"malformed engine metadata: {error}") from error
    if expected_engine_id is not None and meta.engine_id != expected_engine_id:
        raise MetadataError(
            f"wrong engine: expected {expected_engine_id!r}, the peer is {meta.engine_id!r}"
        )
    validate_metadata(meta)
    return meta


def validate_metadata(meta: EngineMetadata) -> None:
    """Cross-field checks that a schema cannot express.

    Raises:
      MetadataError: the first inconsistency found, described.
    """
    if meta.version != PROTOCOL_VERSION:
        raise MetadataError(
            f"engine {meta.engine_id!r} speaks protocol version {meta.version}, "
            f"this jaxkv speaks {PROTOCOL_VERSION}"
        )
    try:
        validate_layout(meta.layout)
        config = meta.config()
    except ValueError as error:
        raise MetadataError(
            f"engine {meta.engine_id!r}: invalid cache description: {error}"
        ) from error
    if meta.layout != config.spec.layout:
        raise MetadataError(f"engine {meta.engine_id!r}: layout must be given as letters")
    expected_hash = compute_compat_hash(compat_fields(meta))
    if meta.compat_hash != expected_hash:
        raise MetadataError(
            f"engine {meta.engine_id!r}: compat_hash {meta.compat_hash[:12]}... does not match its "
            f"fields ({expected_hash[:12]}...)"
        )
    stored_head_dim = config.spec.block_shape()[-1]
    if meta.stored_head_dim != stored_head_dim:
        raise MetadataError(
            f"engine {meta.engine_id!r}: stored_head_dim {meta.stored_head_dim} is not "
            f"head_dim {meta.head_dim} aligned to head_dim_alignment "
            f"{meta.head_dim_alignment} ({stored_head_dim})"
        )
    if meta.stored_layout != config.spec.stored_layout:
        raise MetadataError(
            f"engine {meta.engine_id!r}: stored_layout {meta.stored_layout!r} does not match "
            f"layout {meta.layout!r} with packing {meta.packing} on packed_axis "
            f"{meta.packed_axis!r} ({config.spec.stored_layout!r})"
        )
    agent_names = [a.name for a in meta.agents]
    if len(set(agent_names)) != len(agent_names):
        raise MetadataError(f"engine {meta.engine_id!r}: repeated agent names")
    seen_ranks: set[int] = set()
    spec = config.spec
    keys = spec.array_keys()
    for info in meta.ranks:
        if info.rank >= config.world_size or info.rank in seen_ranks:
            raise MetadataError(
                f"engine {meta.engine_id!r}: rank {info.rank} is repeated or outside "
                f"{config.world_size} ranks"
            )
        seen_ranks.add(info.rank)
        if info.agent_name not in agent_names:
            raise MetadataError(
                f"engine {meta.engine_id!r}: rank {info.rank} names unknown agent "
                f"{info.agent_name!r}"
            )
        tp_rank, pp_rank = config.coordinates(info.rank)
        layer_start, layer_stop = config.layer_range(pp_rank)
        head_start, head_stop = config.head_range(tp_rank)
        block_len = config.local_spec(pp_rank).block_nbytes(config.tp_size)
        local_keys = config.local_spec(pp_rank).array_keys()
        if len(info.regions) != len(local_keys):
            raise MetadataError(
                f"engine {meta.engine_id!r}: rank {info.rank} has {len(info.regions)} regions, its "
                f"layout {spec.layout} needs {len(local_keys)}"
            )
        num_blocks = {r.num_blocks for r in info.regions}
        if len(num_blocks) != 1:
            raise MetadataError(
                f"engine {meta.engine_id!r}: rank {info.rank} regions differ in num_blocks"
            )
        for index, (region, key) in enumerate(zip(info.regions, local_keys)):
            layer = -1 if key[0] is None else key[0] + layer_start
            kv = -1 if key[1] is None else key[1]
            problems = []
            if region.array_index != index:
                problems.append(f"array_index {region.array_index} != {index}")
            if (region.layer, region.kv) != (layer, kv):
                problems.append(f"(layer, kv) ({region.layer}, {region.kv}) != ({layer}, {kv})")
            if (region.head_start, region.head_stop) != (head_start, head_stop):
                problems.append(
                    f"heads [{region.head_start}, {region.head_stop}) != "
                    f"[{head_start}, {head_stop})"
                )
            if region.block_len != block_len:
                problems.append(f"block_len {region.block_len} != {block_len}")
            if region.base_address + region.block_len * region.num_blocks > (1 << 63):
                problems.append("region extends past the address space")
            if problems:
                raise MetadataError(
                    f"engine {meta.engine_id!r}: rank {info.rank} region {index}: "
                    + "; ".join(problems)
                )
    del keys, layer_stop


def check_compatible(local: EngineMetadata, remote: EngineMetadata) -> None:
    """Refuses a pair of engines whose caches cannot exchange blocks.

    Raises:
      IncompatibleEngineError: naming every differing must-match field with both values, or a
        block-size / layout relation the planner cannot convert, block hashing schemes
        that both engines declare and that differ, or differing integrity digest modes.
    """
    ours, theirs = compat_fields(local), compat_fields(remote)
    differing = [
        f"{k}: local {ours[k]!r}, remote {theirs[k]!r}" for k in ours if ours[k] != theirs[k]
    ]
    if (
        local.block_hashing is not None
        and remote.block_hashing is not None
        and local.block_hashing != remote.block_hashing
    ):
        differing.append(
            f"block hashing differs: {remote.engine_id!r} uses {remote.block_hashing!r}, "
            f"{local.engine_id!r} uses {local.block_hashing!r}; prefix hits and KV events "
            "would never match"
        )
    if local.transport != remote.transport:
        differing.append(
            f"transport: {remote.engine_id!r} moves KV over {remote.transport!r}, "
            f"{local.engine_id!r} over {local.transport!r}"
        )
    if local.digests != remote.digests:
        differing.append(
            f"digests: {remote.engine_id!r} declares {remote.digests!r}, {local.engine_id!r} "
            f"{local.digests!r} (integrity digests are computed by the producer and verified "
            "by the consumer: both engines must enable the same mode)"
        )
    if local.block_size % remote.block_size:
        differing.append(
            f"block_size: local {local.block_size} is not a multiple of remote {remote.block_size}"
        )
    if differing:
        raise IncompatibleEngineError(
            f"engine {remote.engine_id!r} is incompatible with {local.engine_id!r}: "
            + "; ".join(differing)
        )
    if local.compat_hash != remote.compat_hash:  # same fields, so a different hash function
        raise IncompatibleEngineError(
            f"engine {remote.engine_id!r}: compat_hash differs although the fields match"
        )
