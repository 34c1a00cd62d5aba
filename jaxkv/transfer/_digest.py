"""End-to-end integrity digests of transferred KV blocks (opt-in per engine).

A digest names the bytes of one **producer block image**: for producer rank ``r`` and the
request's block at position ``p`` (its index in the published ``block_ids``), the bytes of
that block in each of rank ``r``'s registered regions, region after region (``K`` regions of
``L`` bytes: ``K * L`` bytes). It is what the producer holds where peers read it: the host
mirror with host staging, else the cache's own buffers.

* **Producer**: computes the digests when a request becomes fully readable (`publish_request`,
  or the last `publish_layers`), all blocks (``"full"``) or ``k`` of them (``"sampled:k"``:
  always the last block, which every partial prefix hit reads, plus ``k - 1`` drawn
  pseudo-randomly from the request id and the producer's generation, `sample_seed`, so the
  consumer knows them without asking), and keeps them with the pinned request.
* **Carried in the `Ack`**: the producer answers each consumer rank's `Done` with the digests
  of its rank. The `Ack` is the one message every read receives from every producer rank
  after its bytes landed, whatever the transport, the layer-wise mode or the control channel
  (the params are built before anything is hashed, and `Ready` exists for layer-wise reads
  only); the digests so cost no extra round trip, and the producer's answer about a request
  it no longer pins carries none.
* **Consumer**: when a read's bytes landed (before post-processing rewrites them, before the
  host mirror is copied to the device) it recomputes the digests of every producer block image
  this process received *whole* from the bytes where they landed (`landed_pieces` maps each
  byte range back to the producer's image through the read plan: heterogeneous TP, layouts,
  block-size ratios and MLA replicas included) and compares them with the `Ack`'s before the
  read is reported finished. A mismatch fails the read with exactly the local blocks that hold
  the bytes of the mismatched producer blocks listed invalid, and counts
  `TransferStats.digest_mismatches`.

Per read, both sides do work in proportion to the blocks they digest only: what depends on
the geometry is cached. The consumer's `LandingMap` (where each byte of a block image lands,
relative to its local block, and which pieces make its covers) is derived once per read's
planners, so per metadata pair: a re-registration on either side or a peer of another
geometry derives its own. Where a rank's bytes are (`RankRegions`, host views included) is
cached per registered entry and rank until the entry's buffers or mirror are other objects.

Algorithms: ``"xxh3"`` (xxh3-64 of the image, on host memory views: CPU caches and host
mirrors) and ``"sum32"`` (a jitted JAX reduction computed where the cache lives, for device
memory that is not host-addressable: the image as little-endian 32-bit words ``w_i``,
``h1 = sum(w_i * (2i + 1))`` and ``h2 = sum(rotl(w_i, 7) * (i * 0x9E3779B9 | 1))`` modulo
2**32, digest ``h2 << 32 | h1``: any change of one word changes ``h1``). The algorithm follows
from the producer's published regions (`algorithm_for`); the consumer computes it on its
landed bytes with numpy (host) or the same jitted reduction (device landings whose pieces map
whole regions of whole blocks). The ``"sum32"`` device path is checked against its numpy
reference on CPU only: on GPU / TPU it is unvalidated.

What a consumer process cannot verify fails the read (no silent success): producer blocks it
receives only in part (consumer TP ranks in separate processes reading one producer rank,
pipeline splits across consumer processes, padded or packed storage, whose padding is never
moved) and, over the JAX transport, reads converted to another layout or block size by the
producer's formatter. Use ``digests="off"`` for such pairs.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import os
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np
import xxhash

from jaxkv.transfer._plan import row_chunks

__all__ = [
    "DIGEST_MODES",
    "DigestError",
    "DigestOptions",
    "LandedDigest",
    "LandedPieces",
    "LandingMap",
    "Piece",
    "RankDigests",
    "RankRegions",
    "algorithm_for",
    "device_arrays",
    "device_digests",
    "host_view",
    "landed_pieces",
    "landing_map",
    "plan_pieces",
    "producer_digests",
    "rank_regions",
    "sample_positions",
    "sample_seed",
    "sum32_numpy",
    "verify_landed",
]

DIGEST_MODES = ("off", "full", "sampled:K")
"""The `KVTransferEngine` ``digests`` choices (``K`` >= 1 blocks per request)."""

MAX_SAMPLES = 1 << 16


class DigestError(RuntimeError):
    """Landed bytes that cannot be verified (see the module docstring)."""


@dataclasses.dataclass(frozen=True)
class DigestOptions:
    """Parsed ``digests`` option of an engine.

    Attributes:
      mode: ``"off"``, ``"full"`` or ``"sampled"``.
      samples: blocks per request in the sampled mode (0 otherwise).

    Example:
      >>> DigestOptions.parse("sampled:4")
      DigestOptions(mode='sampled', samples=4)
      >>> DigestOptions.parse("full").wire
      'full'
      >>> DigestOptions.parse("sometimes")
      Traceback (most recent call last):
      ...
      ValueError: digests must be 'off', 'full' or 'sampled:K' (K >= 1), got 'sometimes'
    """

    mode: str = "off"
    samples: int = 0

    @classmethod
    def parse(cls, value: str | DigestOptions | None) -> DigestOptions:
        """Parses ``"off"`` / ``"full"`` / ``"sampled:K"`` (None: off).

        Raises:
          ValueError: any other value.
        """
        if isinstance(value, DigestOptions):
            return value
        if value is None or value == "off":
            return cls()
        if value == "full":
            return cls("full")
        if isinstance(value, str) and value.startswith("sampled:"):
            count = value[len("sampled:"):]
            if count.isdigit() and 1 <= int(count) <= MAX_SAMPLES:
                return cls("sampled", int(count))
        raise ValueError(
            f"digests must be 'off', 'full' or 'sampled:K' (K >= 1), got {value!r}"
        )

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    @property
    def wire(self) -> str:
        """The mode as published in the metadata (both engines must publish the same)."""
        return f"sampled:{self.samples}" if self.mode == "sampled" else self.mode


@dataclasses.dataclass(frozen=True)
class RankDigests:
    """The digests of one producer rank for one request.

    Attributes:
      algorithm: ``"xxh3"`` or ``"sum32"``.
      positions: the block positions (in the published ``block_ids``) digested, ascending.
      values: their digests (uint64, one per position).
    """

    algorithm: str
    positions: np.ndarray
    values: np.ndarray

    def as_dict(self) -> dict[int, int]:
        return {int(p): int(v) for p, v in zip(self.positions, self.values)}


_MASK64 = (1 << 64) - 1


def sample_positions(num_blocks: int, options: DigestOptions,
                     seed: int | None = None) -> np.ndarray:
    """The block positions a publication digests: every one (full), or the last (read by
    every partial prefix hit) and ``samples - 1`` others drawn pseudo-randomly from `seed`
    (sampled; None: a random seed).

    The draw is Floyd's sampling over a splitmix64 stream, in plain Python integers: the
    producer and its consumers derive the same positions from the same seed (`sample_seed`)
    on any platform, and each side pays a few microseconds per request (seeding a numpy
    generator cost more than hashing a sampled block's worth of overhead).

    Example:
      >>> sample_positions(5, DigestOptions("full")).tolist()
      [0, 1, 2, 3, 4]
      >>> sample_positions(5, DigestOptions("sampled", 1)).tolist()
      [4]
      >>> sample_positions(100, DigestOptions("sampled", 3), seed=7).tolist()
      [9, 33, 99]
    """
    if num_blocks <= 0 or not options.enabled:
        return np.zeros(0, np.int64)
    if options.mode == "full" or options.samples >= num_blocks:
        return np.arange(num_blocks, dtype=np.int64)
    state = (int.from_bytes(os.urandom(8), "little") if seed is None else int(seed)) & _MASK64
    n, k = num_blocks - 1, options.samples - 1  # k distinct of the first n positions
    chosen: set[int] = set()
    for j in range(n - k, n):
        state = (state + 0x9E3779B97F4A7C15) & _MASK64  # splitmix64
        z = ((state ^ (state >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        t = (z ^ (z >> 31)) % (j + 1)
        chosen.add(j if t in chosen else t)
    return np.asarray(sorted(chosen) + [num_blocks - 1], np.int64)


def sample_seed(request_id: str, generation: int) -> int:
    """The seed of a request's sampled positions, derived alike by the producer and its
    consumers (the request id and the producer's generation, both in the params): a consumer
    so digests only the sampled blocks when its bytes land, before any `Ack` arrived.

    Example:
      >>> sample_seed("req-1", 7) == sample_seed("req-1", 7)
      True
    """
    return xxhash.xxh3_64_intdigest(f"{request_id}\x00{int(generation)}".encode())


def algorithm_for(memory_kinds: Sequence[str]) -> str:
    """``"xxh3"`` where every region of a rank is host memory, else ``"sum32"``."""
    return "xxh3" if all(kind == "DRAM" for kind in memory_kinds) else "sum32"


@functools.lru_cache(maxsize=4096)
def _view(address: int, nbytes: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(address))


def host_view(address: int, nbytes: int) -> np.ndarray:
    """A uint8 numpy view of host memory (a CPU buffer or a host mirror that the engine
    keeps alive: registered caches do not move while registered)."""
    return _view(int(address), int(nbytes))


# -- sum32: the device reduction and its numpy reference -----------------------------------

_GOLDEN = np.uint32(0x9E3779B9)


def sum32_numpy(words: np.ndarray, first_index: int = 0) -> tuple[int, int]:
    """Partial ``(h1, h2)`` sums of the little-endian uint32 `words` whose image word index
    starts at `first_index` (sums of pieces add up modulo 2**32)."""
    w = np.ascontiguousarray(words).view("<u4").astype(np.uint32, copy=False)
    i = np.arange(first_index, first_index + len(w), dtype=np.uint64).astype(np.uint32)
    with np.errstate(over="ignore"):
        h1 = (w * (i * np.uint32(2) + np.uint32(1))).sum(dtype=np.uint32)
        rot = (w << np.uint32(7)) | (w >> np.uint32(25))
        h2 = (rot * ((i * _GOLDEN) | np.uint32(1))).sum(dtype=np.uint32)
    return int(h1), int(h2)


def _combine(h1: int, h2: int) -> int:
    return ((int(h2) & 0xFFFFFFFF) << 32) | (int(h1) & 0xFFFFFFFF)


@functools.lru_cache(maxsize=64)
def _sum32_fn(num_regions: int) -> Any:
    import jax
    import jax.numpy as jnp

    def words(x: Any) -> Any:
        # [n, ...] any dtype -> [n, L / 4] uint32, little-endian
        raw = jax.lax.bitcast_convert_type(x, jnp.uint8) if x.dtype.itemsize > 1 else (
            jax.lax.bitcast_convert_type(x, jnp.uint8)[..., None])
        b = raw.reshape(x.shape[0], -1, 4).astype(jnp.uint32)
        return b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)

    def digest(regions: tuple, ids: Any) -> Any:
        h1 = jnp.zeros((ids.shape[0],), jnp.uint32)
        h2 = jnp.zeros((ids.shape[0],), jnp.uint32)
        offset = 0
        for k, array in enumerate(regions):
            w = words(jnp.take(array, ids[:, k], axis=0))
            i = (jnp.arange(w.shape[1], dtype=jnp.uint32) + jnp.uint32(offset))[None, :]
            h1 = h1 + (w * (i * jnp.uint32(2) + jnp.uint32(1))).sum(axis=1, dtype=jnp.uint32)
            rot = (w << jnp.uint32(7)) | (w >> jnp.uint32(25))
            h2 = h2 + (rot * ((i * jnp.uint32(0x9E3779B9)) | jnp.uint32(1))).sum(
                axis=1, dtype=jnp.uint32)
            offset += w.shape[1]
        return jnp.stack([h1, h2], axis=1)

    del num_regions  # one compiled function per region count (jit caches per shapes)
    return jax.jit(digest)


def device_digests(regions: Sequence[Any], ids: np.ndarray) -> np.ndarray:
    """``"sum32"`` digests computed where the arrays live (a jitted reduction).

    Args:
      regions: one single-device array per region of the image, ``[num_blocks, ...]``.
      ids: int ``[n, K]``: the block of region ``k`` in image ``p`` (K = len(regions)).

    Returns:
      uint64 ``[n]`` digests (equal to `sum32_numpy` over the same bytes).

    Raises:
      DigestError: a region's block is not a whole number of 32-bit words.
    """
    for array in regions:
        nbytes = int(np.prod(array.shape[1:])) * array.dtype.itemsize
        if nbytes % 4:
            raise DigestError(f"sum32 digests need blocks of whole 32-bit words ({nbytes} B)")
    if not len(ids):
        return np.zeros(0, np.uint64)
    import jax.numpy as jnp

    out = np.asarray(_sum32_fn(len(regions))(tuple(regions), jnp.asarray(ids, jnp.int32)))
    return (out[:, 1].astype(np.uint64) << np.uint64(32)) | out[:, 0].astype(np.uint64)


# -- where a rank's bytes are (both sides) ---------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RankRegions:
    """Where one rank's registered regions are now, in region (array index) order: the host
    mirror with host staging, else the cache's own buffers (`Registered.buffers`, which the
    engine keeps current: registered in place over NIXL, replaced by ``update_cache`` or a
    landing over the JAX transport).

    Attributes:
      bases: base address per region.
      kinds: memory kind per region (``"DRAM"`` for a mirror).
      nbytes: bytes per region.
      views: per region a byte memoryview of host memory (None for device memory).
      block_len: bytes of one block in one region.
      array_indices: the cache array of each region.
      device_id: the rank's device.
    """

    bases: tuple[int, ...]
    kinds: tuple[str, ...]
    nbytes: tuple[int, ...]
    views: tuple[memoryview | None, ...]
    block_len: int
    array_indices: tuple[int, ...]
    device_id: int

    @property
    def on_host(self) -> bool:
        return all(kind == "DRAM" for kind in self.kinds)


# (id(entry), rank) -> (entry.buffers, weakref to entry.mirror, RankRegions). The buffers
# tuple (ShardBuffers: addresses and devices, no arrays) is held and compared by identity: a
# re-registration makes a new entry with its own tuple, a move over the JAX transport
# replaces the tuple. Neither the entry nor its mirror is held (a cached entry must not keep
# a replaced cache's memory alive); the views point into memory the engine keeps alive
# while the tuple is current, and are never used once it is not.
_RANK_REGIONS: dict[tuple[int, int], tuple[Any, Any, RankRegions]] = {}
_RANK_REGIONS_SIZE = 256


def rank_regions(entry: Any, rank: int) -> RankRegions:
    """The `RankRegions` of `rank` in one registered cache (`jaxkv.transfer._registry.Registered`),
    cached until the entry's buffers or mirror are other objects.

    Example:
      >>> regions = rank_regions(engine._registry.rank_cache[0], 0)  # doctest: +SKIP
    """
    key = (id(entry), int(rank))
    hit = _RANK_REGIONS.get(key)
    mirror = entry.mirror
    if hit is not None and hit[0] is entry.buffers and (
            (hit[1] is None and mirror is None) or (hit[1] is not None and hit[1]() is mirror)):
        return hit[2]
    device_id = entry.rank_devices[rank]
    buffers = sorted((b for b in entry.buffers if b.device.id == device_id),
                     key=lambda b: b.array_index)
    if mirror is not None:
        bases = [mirror.address(b.array_index, device_id) for b in buffers]
        kinds = ["DRAM"] * len(buffers)
    else:
        bases = [int(b.address) for b in buffers]
        kinds = [b.memory_kind for b in buffers]
    sizes = [int(b.nbytes) for b in buffers]
    views = [host_view(base, size).data if kind == "DRAM" else None
             for base, kind, size in zip(bases, kinds, sizes)]
    regions = RankRegions(tuple(bases), tuple(kinds), tuple(sizes), tuple(views),
                          sizes[0] // entry.cache.num_blocks,
                          tuple(b.array_index for b in buffers), device_id)
    if len(_RANK_REGIONS) >= _RANK_REGIONS_SIZE:
        _RANK_REGIONS.pop(next(iter(_RANK_REGIONS)))
    _RANK_REGIONS[key] = (entry.buffers, None if mirror is None else weakref.ref(mirror),
                          regions)
    return regions


def device_arrays(entry: Any, regions: RankRegions) -> list[Any]:
    """The single-device arrays of a rank's regions in the entry's current cache (looked up
    on each call: donated updates replace the arrays)."""
    return [next(s.data for s in entry.cache.arrays[index].addressable_shards
                 if s.device.id == regions.device_id) for index in regions.array_indices]


# -- producer ------------------------------------------------------------------------------


def producer_digests(registry: Any, block_ids: Sequence[int],
                     positions: np.ndarray) -> dict[int, RankDigests]:
    """The digests of every local producer rank for the blocks at `positions` of a request.

    Args:
      registry: the engine's `CacheRegistry` (current caches and mirrors).
      block_ids: the request's blocks, in token order.
      positions: the positions to digest (`sample_positions`).

    Returns:
      producer rank -> its `RankDigests`.

    Example:
      >>> digests = producer_digests(engine._registry, [3, 4], np.arange(2))  # doctest: +SKIP
    """
    ids = [int(block_ids[p]) for p in positions.tolist()]
    positions = positions.astype(np.int64)
    out: dict[int, RankDigests] = {}
    for entry in registry.caches:
        if entry.mirror is None and not all(a.is_ready() for a in entry.cache.arrays):
            # The bytes a step writes asynchronously are the published ones (the mirror was
            # written synchronously from the finished cache).
            entry.cache.block_until_ready()
        for rank in entry.ranks:
            regions = rank_regions(entry, rank)
            if not regions.on_host:
                table = np.repeat(np.asarray(ids, np.int64)[:, None], len(regions.kinds), axis=1)
                values = device_digests(device_arrays(entry, regions), table)
                out[rank] = RankDigests("sum32", positions, values)
                continue
            block_len = regions.block_len
            views = regions.views
            if len(views) == 1:  # one region (cross-layer blocks): one call per block
                view = views[0]
                assert view is not None
                digests = [xxhash.xxh3_64_intdigest(view[b * block_len:(b + 1) * block_len])
                           for b in ids]
            else:
                digests = []
                for b in ids:
                    h = xxhash.xxh3_64()
                    lo = b * block_len
                    for view in views:
                        assert view is not None
                        h.update(view[lo:lo + block_len])
                    digests.append(h.intdigest())
            out[rank] = RankDigests("xxh3", positions, np.asarray(digests, np.uint64))
    return out


# -- consumer ------------------------------------------------------------------------------

Piece = tuple[int, int, int, int, int]
"""One landed byte range of a producer block image: (image offset, length, local rank, local
region, offset from the local region's base)."""

Covers = tuple[tuple[int, ...], ...]
"""The covers of a group of pieces (`cover_indices`): per cover, its pieces' indices in the
group, in image order."""


class LandedPieces:
    """Where the bytes of producer block images landed in this process.

    Attributes:
      groups: (remote rank, position) -> its `Piece`s sorted by (local rank, image offset);
        keys in (remote rank, position) order.
      image_len: remote rank -> bytes of its image (``K * L``).
      local_block_len: local rank -> its block_len.
      resolved: (remote rank, position) -> (`cover_indices` of its group, the local blocks
        holding it), where a `LandingMap` resolved them once per geometry (else None, and
        `verify_landed` resolves each group).
      source: ``(LandingMap, local ids per local rank index, positions)`` for the pieces of a
        map, whose `groups` are made on first use: `verify_landed` digests host landings
        straight from the map (`LandingMap.verify_host`).
    """

    def __init__(self, groups: dict[tuple[int, int], list[Piece]] | None,
                 image_len: dict[int, int], local_block_len: dict[int, int],
                 resolved: dict[tuple[int, int], tuple[Covers | None, set[int]]] | None = None,
                 source: tuple[LandingMap, Sequence[Sequence[int]], Sequence[int]] | None = None):
        self._groups = groups
        self._resolved = resolved
        self.image_len = image_len
        self.local_block_len = local_block_len
        self.source = source

    @property
    def groups(self) -> dict[tuple[int, int], list[Piece]]:
        if self._groups is None:
            assert self.source is not None
            landing, local_ids, positions = self.source
            self._groups, self._resolved = landing.instantiate(local_ids, positions)
        return self._groups

    @groups.setter
    def groups(self, value: dict[tuple[int, int], list[Piece]]) -> None:
        self._groups = value

    @property
    def resolved(self) -> dict[tuple[int, int], tuple[Covers | None, set[int]]] | None:
        self.groups  # noqa: B018 - instantiates a map's pieces
        return self._resolved


def plan_pieces(plans: Sequence[Any], local_meta: Any, remote_meta: Any,
                remote_ids: np.ndarray) -> LandedPieces:
    """Maps every byte range a read's plans land back to the producer's block images, from
    the plans' expanded copies: the reference `LandingMap` is checked against, and the path
    of plans made without a planner.

    Args:
      plans: the read's `ReadPlan` of each local rank (whole request).
      local_meta, remote_meta: the metadata the plans were made from.
      remote_ids: the request's blocks on the producer, every one (the positions' ids).

    Returns:
      The `LandedPieces` of every position.

    Raises:
      DigestError: a remote block id repeats in the request (mapped back by id here, its
        position would be ambiguous).
    """
    remote_ids = np.asarray(remote_ids, np.int64)
    if len(np.unique(remote_ids)) != len(remote_ids):
        raise DigestError("the request repeats a block id: its digests are ambiguous")
    cols: dict[str, list[np.ndarray]] = {k: [] for k in (
        "rr", "pos", "lr", "img", "lg", "lo", "len")}
    image_len: dict[int, int] = {}
    local_block_len: dict[int, int] = {}
    for plan in plans:
        local_block_len[plan.local_rank] = int(
            local_meta.rank_info(plan.local_rank).regions[0].block_len)
        for remote_rank in plan.read_ranks:
            rows = plan.copies_for(remote_rank)
            if not len(rows):
                continue
            regions = remote_meta.rank_info(remote_rank).regions
            block_len = int(regions[0].block_len)
            image_len[remote_rank] = block_len * len(regions)
            lookup = np.full(int(regions[0].num_blocks), -1, np.int64)
            lookup[remote_ids] = np.arange(len(remote_ids))
            index, within = row_chunks(rows[:, 6])  # the strided rows' chunks
            r_off = rows[index, 2] + within * rows[index, 7]
            l_off = rows[index, 4] + within * rows[index, 8]
            length = rows[index, 5]
            region = rows[index, 1]
            l_region = rows[index, 3]
            # Split chunks that cross remote block boundaries (runs of consecutive blocks).
            first = r_off // block_len
            last = (r_off + length - 1) // block_len
            parts = last - first + 1
            idx, step = row_chunks(parts)
            block = first[idx] + step
            start = np.maximum(r_off[idx], block * block_len)
            stop = np.minimum(r_off[idx] + length[idx], (block + 1) * block_len)
            position = lookup[block]
            if (position < 0).any():
                raise DigestError(f"the plan reads blocks of producer rank {remote_rank} "
                                  "outside the request")
            cols["rr"].append(np.full(len(idx), remote_rank, np.int64))
            cols["pos"].append(position)
            cols["lr"].append(np.full(len(idx), plan.local_rank, np.int64))
            cols["img"].append(region[idx] * block_len + start - block * block_len)
            cols["lg"].append(l_region[idx])
            cols["lo"].append(l_off[idx] + (start - r_off[idx]))
            cols["len"].append(stop - start)
    joined = {k: (np.concatenate(v) if v else np.zeros(0, np.int64)) for k, v in cols.items()}
    order = np.lexsort((joined["img"], joined["lr"], joined["pos"], joined["rr"]))
    groups: dict[tuple[int, int], list[Piece]] = {}
    for rr, pos, lr, img, lg, lo, length in zip(*(
            joined[k][order].tolist() for k in ("rr", "pos", "lr", "img", "lg", "lo", "len"))):
        groups.setdefault((rr, pos), []).append((img, length, lr, lg, lo))
    return LandedPieces(groups, image_len, local_block_len)


@dataclasses.dataclass(frozen=True)
class LandingMap:
    """Where each byte of a producer block image lands, relative to the local block that
    receives it: one geometry's `plan_pieces`, derived once from a read of one local block.

    A planner's copies are affine in the blocks (`jaxkv.transfer._plan._expand`): the bytes
    of the read's remote block at position ``p`` land in local block ``p // ratio`` at the
    same offsets whatever the ids (runs of consecutive ids only merge descriptors). So the
    pieces of a one-block read (local block 0, remote blocks ``0 .. ratio - 1``) are those of
    every block, shifted by its local block; a read instantiates them for the positions it
    digests only (the sampled ones), by position (no lookup by block id).

    Attributes:
      planners: the read's planners (one per local rank), which the map belongs to.
      ratio: local / remote block size.
      templates: remote rank -> per sub-block (``p % ratio``) its pieces ``(image offset,
        length, local rank index, local region, offset in the local block)``, sorted by
        (local rank, image offset).
      resolved: remote rank -> per sub-block (its `cover_indices`, the local rank indices
        whose block holds its pieces), or None where a piece is not inside one local block
        (then `verify_landed` resolves each group as it comes).
      local_ranks: the local rank of each local rank index (the planners' order).
      image_len, local_block_len: as in `LandedPieces`.
    """

    planners: tuple[Any, ...]
    ratio: int
    templates: dict[int, tuple[tuple[Piece, ...], ...]]
    resolved: dict[int, tuple[tuple[Covers | None, tuple[int, ...]] | None, ...]]
    local_ranks: tuple[int, ...]
    image_len: dict[int, int]
    local_block_len: dict[int, int]
    # remote rank -> per sub-block None (no pieces) or (covers as (local rank index, region,
    # offset in the block, length) in image order, or None: not verifiable; the local rank
    # indices holding it); None where a sub-block is not resolved (no `verify_host`)
    host_covers: dict[int, tuple[tuple[tuple[tuple[tuple[int, int, int, int], ...], ...] | None,
                                       tuple[int, ...]] | None, ...]] | None = None

    @classmethod
    def build(cls, planners: Sequence[Any]) -> LandingMap:
        """The map of the planners of one read (one per local rank, one remote engine).

        Raises:
          PlanError: a planner cannot plan the one-block read (`ReadPlanner.plan`).
        """
        ratio = int(planners[0].ratio)
        probe = [p.plan(np.zeros(1, np.int64), np.arange(ratio, dtype=np.int64))
                 for p in planners]
        pieces = plan_pieces(probe, planners[0].local, planners[0].remote,
                             np.arange(ratio, dtype=np.int64))
        local_ranks = tuple(int(p.local_rank) for p in planners)
        index_of = {r: i for i, r in enumerate(local_ranks)}
        templates: dict[int, list[tuple[Piece, ...]]] = {}
        resolved: dict[int, list[tuple[Covers | None, tuple[int, ...]] | None]] = {}
        for (rr, sub), group in pieces.groups.items():
            per_sub = templates.setdefault(rr, [()] * ratio)
            # local block 0: the local offset is the offset in the block
            per_sub[sub] = tuple((img, length, index_of[lr], lg, lo)
                                 for img, length, lr, lg, lo in group)
            # Which pieces make a cover depends on image offsets and local ranks only, and
            # every piece inside one local block lands in that rank's block of the position:
            # both resolved here, once.
            inside = all(lo + length <= pieces.local_block_len[lr]
                         for _, length, lr, _, lo in group)
            ranks = tuple(sorted({index_of[lr] for _, _, lr, _, _ in group}))
            resolved.setdefault(rr, [None] * ratio)[sub] = (
                (cover_indices(group, pieces.image_len[rr]), ranks) if inside else None)
        host_covers: dict[int, list] | None = {}
        for rr, per_sub in templates.items():
            for sub, template in enumerate(per_sub):
                known = resolved[rr][sub]
                if template and known is None:
                    host_covers = None  # a piece across local blocks: per group only
                if not template or host_covers is None or known is None:
                    continue
                covers = None if known[0] is None else tuple(
                    tuple((template[k][2], template[k][3], template[k][4], template[k][1])
                          for k in ks) for ks in known[0])
                host_covers.setdefault(rr, [None] * ratio)[sub] = (covers, known[1])
        return cls(tuple(planners), ratio, {rr: tuple(t) for rr, t in templates.items()},
                   {rr: tuple(r) for rr, r in resolved.items()}, local_ranks,
                   dict(pieces.image_len), dict(pieces.local_block_len),
                   None if host_covers is None else {
                       rr: tuple(c) for rr, c in host_covers.items()})

    def pieces(self, local_ids: Sequence[Sequence[int]],
               positions: Sequence[int]) -> LandedPieces:
        """The `LandedPieces` of the read's `positions` (ascending indices of its remote
        blocks), ``local_ids[i]`` the local blocks of local rank index ``i``; its groups are
        made on first use (`instantiate`)."""
        return LandedPieces(None, self.image_len, self.local_block_len,
                            source=(self, local_ids, positions))

    def instantiate(self, local_ids: Sequence[Sequence[int]], positions: Sequence[int],
                    ) -> tuple[dict[tuple[int, int], list[Piece]],
                               dict[tuple[int, int], tuple[Covers | None, set[int]]]]:
        """`LandedPieces.groups` and `LandedPieces.resolved` of `pieces`."""
        ratio, lranks = self.ratio, self.local_ranks
        lbl = [self.local_block_len[r] for r in lranks]
        groups: dict[tuple[int, int], list[Piece]] = {}
        resolved: dict[tuple[int, int], tuple[Covers | None, set[int]]] = {}
        for rr, per_sub in self.templates.items():
            per_resolved = self.resolved[rr]
            for p in positions:
                template = per_sub[p % ratio]
                if template:
                    i = p // ratio
                    groups[(rr, p)] = [
                        (img, length, lranks[ri], lg, local_ids[ri][i] * lbl[ri] + off)
                        for img, length, ri, lg, off in template]
                    known = per_resolved[p % ratio]
                    if known is not None:
                        resolved[(rr, p)] = (known[0], {local_ids[ri][i] for ri in known[1]})
        return groups, resolved

    def verify_host(self, local_ids: Sequence[Sequence[int]], positions: Sequence[int],
                    local_regions: dict[int, RankRegions]) -> dict[tuple[int, int], LandedDigest]:
        """`verify_landed` of `pieces` for xxh3 images landed in host memory, straight from
        the resolved covers (no groups; the same covers, chunks and blocks)."""
        assert self.host_covers is not None
        ratio = self.ratio
        lbl = [self.local_block_len[r] for r in self.local_ranks]
        views = [local_regions[r].views for r in self.local_ranks]
        out: dict[tuple[int, int], LandedDigest] = {}
        jobs: list[tuple[list[int], list[memoryview]]] = []
        for rr, per_sub in self.host_covers.items():
            for p in positions:
                entry = per_sub[p % ratio]
                if entry is None:
                    continue
                covers, ranks = entry
                i = p // ratio
                digest = out[(rr, p)] = LandedDigest(
                    [], {local_ids[ri][i] for ri in ranks}, covers is not None)
                for cover in covers or ():
                    jobs.append((digest.values, [
                        views[ri][lg][local_ids[ri][i] * lbl[ri] + off:  # type: ignore[index]
                                      local_ids[ri][i] * lbl[ri] + off + length]
                        for ri, lg, off, length in cover]))
        _hash_xxh3(jobs)
        return out


# (id of each planner) -> LandingMap; the map holds its planners (small: metadata and
# templates, no cache memory) and is returned only for those very objects. A planner belongs
# to two metadata objects (`read_planner`): a re-registration on either side, or a peer of
# another geometry, makes other planners, hence another map.
_LANDING_MAPS: dict[tuple[int, ...], LandingMap] = {}
_LANDING_MAPS_SIZE = 256


def landing_map(planners: Sequence[Any]) -> LandingMap:
    """The cached `LandingMap` of a read's planners (built on first use).

    Raises:
      PlanError: see `LandingMap.build`.
    """
    key = tuple(id(p) for p in planners)
    hit = _LANDING_MAPS.get(key)
    if hit is not None and len(hit.planners) == len(planners) and all(
            a is b for a, b in zip(hit.planners, planners)):
        return hit
    built = LandingMap.build(planners)
    if len(_LANDING_MAPS) >= _LANDING_MAPS_SIZE:
        _LANDING_MAPS.pop(next(iter(_LANDING_MAPS)))
    _LANDING_MAPS[key] = built
    return built


def landed_pieces(plans: Sequence[Any], local_meta: Any, remote_meta: Any,
                  remote_ids: np.ndarray, positions: Sequence[int] | np.ndarray | None = None,
                  ) -> LandedPieces:
    """Maps the byte ranges a read's plans land back to the producer's block images, for the
    read's `positions` (None: every one): from the cached `LandingMap` of the plans'
    planners (per read, work in proportion to the positions), else (plans made without a
    planner) from the plans' copies (`plan_pieces`).

    Args:
      plans: the read's `ReadPlan` of each local rank (whole request).
      local_meta, remote_meta: the metadata the plans were made from.
      remote_ids: the read's blocks on the producer (``plans[i].remote_block_ids``).
      positions: ascending indices into `remote_ids` (None: all).

    Returns:
      The `LandedPieces` of those positions.

    Raises:
      DigestError: see `plan_pieces`.
      PlanError: see `LandingMap.build`.
    """
    planners = [plan.planner for plan in plans]
    usable = bool(plans) and all(
        p is not None and p.local is local_meta and p.remote is remote_meta
        and plan.expanded is None and p.local_rank == plan.local_rank
        and len(plan.local_block_ids) == len(plans[0].local_block_ids)
        for plan, p in zip(plans, planners))
    if positions is None:
        positions = range(len(remote_ids))
    if not usable:
        pieces = plan_pieces(plans, local_meta, remote_meta, remote_ids)
        wanted = {int(p) for p in positions}
        pieces.groups = {k: v for k, v in pieces.groups.items() if k[1] in wanted}
        return pieces
    return landing_map(planners).pieces(
        [plan.local_block_ids.tolist() for plan in plans],
        [int(p) for p in positions])


def _covers(pieces: Sequence[Piece], total: int) -> bool:
    """Whether pieces ``(image offset, length, ...)`` sorted by offset tile ``[0, total)``."""
    end = 0
    for img, length, *_ in pieces:
        if img != end:
            return False
        end += length
    return end == total


def cover_indices(group: Sequence[Piece], total: int) -> Covers | None:
    """The covers of one producer block image's landed pieces, as indices into `group`:
    each local rank holding the whole image alone (same TP, fewer consumer ranks, MLA
    replicas) is one cover; else the local ranks' pieces together must tile it; None when
    they do not (this process holds only part of the image).

    Example:
      >>> cover_indices([(4, 4, 0, 0, 12), (0, 4, 0, 0, 8)], 8)
      ((1, 0),)
      >>> cover_indices([(0, 4, 0, 0, 0), (4, 4, 1, 0, 0)], 8), cover_indices([(0, 4, 0, 0, 0)], 8)
      (((0, 1),), None)
    """
    if len(group) == 1:  # one region per block: the image in one piece
        return ((0,),) if group[0][0] == 0 and group[0][1] == total else None
    by_rank: dict[int, list[int]] = {}
    for k, piece in enumerate(group):
        by_rank.setdefault(piece[2], []).append(k)
    covers = [tuple(sorted(ks, key=group.__getitem__)) for ks in by_rank.values()]
    if all(_covers([group[k] for k in ks], total) for ks in covers):
        return tuple(covers)
    whole = tuple(sorted(range(len(group)), key=group.__getitem__))
    return (whole,) if _covers([group[k] for k in whole], total) else None


@dataclasses.dataclass
class LandedDigest:
    """The digests one process computed of one producer block image it received."""

    values: list[int]  # one per cover (several local ranks may each hold the whole image)
    local_blocks: set[int]  # local block ids holding its bytes
    verifiable: bool


def verify_landed(pieces: LandedPieces, algorithms: dict[int, str],
                  local_regions: dict[int, RankRegions],
                  local_device_arrays: dict[int, list[Any]],
                  ) -> dict[tuple[int, int], LandedDigest]:
    """Digests of the producer block images this process received (see the module docs).

    Args:
      pieces: `landed_pieces` of the read (the positions to digest).
      algorithms: remote rank -> the algorithm of its digests (`algorithm_for`).
      local_regions: local rank -> where its bytes are now (`rank_regions`: the host mirror
        with host staging).
      local_device_arrays: local rank -> per region its single-device array (device
        landings; may be empty for host landings).

    Returns:
      (remote rank, position) -> `LandedDigest` (``verifiable`` False where this process
      holds only part of the image, or a device landing that does not map whole blocks).
    """
    source = pieces.source
    if source is not None and source[0].host_covers is not None and all(
            algorithms[rr] == "xxh3" for rr in source[0].host_covers) and all(
            local_regions[r].on_host for r in source[0].local_ranks):
        return source[0].verify_host(source[1], source[2], local_regions)
    out: dict[tuple[int, int], LandedDigest] = {}
    # Plain Python over the pieces: a group is usually a few pieces (one per region), and
    # per-group numpy calls would cost more than the hashing of small blocks.
    device_jobs: list[tuple[tuple[int, int], int, list[int]]] = []
    xxh3_jobs: list[tuple[list[int], list[memoryview]]] = []  # (the digest's values, chunks)
    image_len, local_block_len = pieces.image_len, pieces.local_block_len
    resolved = pieces.resolved or {}
    for (rr, pos), group in pieces.groups.items():
        known = resolved.get((rr, pos))
        if known is not None:
            indices, blocks = known
        else:
            indices = cover_indices(group, image_len[rr])
            blocks = set()
            for _, length, lr, _, lo in group:
                blen = local_block_len[lr]
                blocks.update(range(lo // blen, (lo + length - 1) // blen + 1))
        if indices is None:
            out[(rr, pos)] = LandedDigest([], blocks, False)
            continue
        covers = [[group[k] for k in ks] for ks in indices]
        algorithm = algorithms[rr]
        digest = out[(rr, pos)] = LandedDigest([], blocks, True)
        for cover in covers:
            if len(cover) == 1:
                on_device = local_regions[cover[0][2]].kinds[cover[0][3]] != "DRAM"
            else:
                on_device = any(local_regions[lr].kinds[lg] != "DRAM"
                                for _, _, lr, lg, _ in cover)
            if on_device:
                job = _device_job(cover, local_block_len)
                if job is None or algorithm != "sum32":
                    digest.verifiable = False
                    break
                device_jobs.append(((rr, pos), cover[0][2], job))
                continue
            chunks = []
            for _, length, lr, lg, lo in cover:
                view = local_regions[lr].views[lg]
                assert view is not None  # DRAM
                chunks.append(view[lo:lo + length])
            if algorithm == "xxh3":
                xxh3_jobs.append((digest.values, chunks))
                continue
            s1 = s2 = 0
            for (img, length, *_), chunk in zip(cover, chunks):
                if img % 4 or length % 4:
                    digest.verifiable = False
                    break
                p1, p2 = sum32_numpy(np.frombuffer(chunk, np.uint8), img // 4)
                s1, s2 = (s1 + p1) & 0xFFFFFFFF, (s2 + p2) & 0xFFFFFFFF
            if not digest.verifiable:
                break
            digest.values.append(_combine(s1, s2))
    _hash_xxh3(xxh3_jobs)
    by_local: dict[int, list[tuple[tuple[int, int], list[int]]]] = {}
    for key, lr, job in device_jobs:
        by_local.setdefault(lr, []).append((key, job))
    for lr, jobs in by_local.items():
        table = np.asarray([job for _, job in jobs], np.int64)
        for (key, _), value in zip(jobs, device_digests(local_device_arrays[lr], table)):
            out[key].values.append(int(value))
    return out


def _hash_xxh3(jobs: list[tuple[list[int], list[memoryview]]]) -> None:
    """Appends to each job's values the xxh3-64 of its chunks, concatenated. Hashed apart
    from the bookkeeping: a block hashed streams through the CPU caches and evicts the
    interpreter's working set, which a loop of only hash calls barely needs."""
    for values, chunks in jobs:
        if len(chunks) == 1:
            values.append(xxhash.xxh3_64_intdigest(chunks[0]))
        else:
            h = xxhash.xxh3_64()
            for chunk in chunks:
                h.update(chunk)
            values.append(h.intdigest())


def _device_job(cover: list[Piece],
                local_block_len: dict[int, int]) -> list[int] | None:
    """For a device landing: the local block of each image region when every piece is one
    whole region of a whole block, landed at a local block boundary of the same region
    index in one local rank (identity geometry), else None (not verifiable on the device)."""
    lr = cover[0][2]
    blen = local_block_len[lr]
    out = []
    for k, (img, length, rank, lg, lo) in enumerate(cover):
        if rank != lr or length != blen or img != k * blen or lo % blen or lg != k:
            return None
        out.append(lo // blen)
    return out
