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
import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import xxhash

from jaxkv.transfer._plan import row_chunks

__all__ = [
    "DIGEST_MODES",
    "DigestError",
    "DigestOptions",
    "RankDigests",
    "algorithm_for",
    "device_digests",
    "host_view",
    "landed_pieces",
    "producer_digests",
    "LandedDigest",
    "LandedPieces",
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


def sample_positions(num_blocks: int, options: DigestOptions,
                     rng: np.random.Generator | None = None) -> np.ndarray:
    """The block positions a publication digests: every one (full), or the last (read by
    every partial prefix hit) and ``samples - 1`` others drawn at random (sampled).

    Example:
      >>> sample_positions(5, DigestOptions("full")).tolist()
      [0, 1, 2, 3, 4]
      >>> sample_positions(5, DigestOptions("sampled", 1)).tolist()
      [4]
    """
    if num_blocks <= 0 or not options.enabled:
        return np.zeros(0, np.int64)
    if options.mode == "full" or options.samples >= num_blocks:
        return np.arange(num_blocks, dtype=np.int64)
    rng = rng or np.random.default_rng()
    others = rng.choice(num_blocks - 1, size=options.samples - 1, replace=False)
    return np.sort(np.append(others, num_blocks - 1)).astype(np.int64)


def sample_seed(request_id: str, generation: int) -> int:
    """The seed of a request's sampled positions, derived alike by the producer and its
    consumers (the request id and the producer's generation, both in the params): a consumer
    so digests only the sampled blocks when its bytes land, before any `Ack` arrived.

    Example:
      >>> sample_seed("req-1", 7) == sample_seed("req-1", 7)
      True
    """
    text = f"{request_id}\x00{int(generation)}".encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")


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


# -- producer ------------------------------------------------------------------------------


def _rank_sources(entry: Any, rank: int) -> tuple[list[int], list[str], list[Any], int]:
    """(host base addresses or None, memory kinds, device arrays, block_len) of a rank's
    regions in one registered cache (`jaxkv.transfer._registry.Registered`)."""
    device_id = entry.rank_devices[rank]
    buffers = sorted((b for b in entry.cache.shard_buffers() if b.device.id == device_id),
                     key=lambda b: b.array_index)
    block_len = buffers[0].nbytes // entry.cache.num_blocks
    if entry.mirror is not None:
        bases = [entry.mirror.address(b.array_index, device_id) for b in buffers]
        return bases, ["DRAM"] * len(buffers), [], block_len
    kinds = [b.memory_kind for b in buffers]
    arrays = []
    if algorithm_for(kinds) == "sum32":
        for b in buffers:
            array = entry.cache.arrays[b.array_index]
            arrays.append(next(s.data for s in array.addressable_shards
                               if s.device.id == device_id))
    return [b.address for b in buffers], kinds, arrays, block_len


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
    ids = np.asarray(block_ids, np.int64)[positions]
    out: dict[int, RankDigests] = {}
    for entry in registry.caches:
        for rank in entry.ranks:
            bases, kinds, arrays, block_len = _rank_sources(entry, rank)
            nbytes = block_len * entry.cache.num_blocks
            algorithm = algorithm_for(kinds)
            if algorithm == "sum32":
                table = np.repeat(ids[:, None], len(arrays), axis=1)
                values = device_digests(arrays, table)
            else:
                views = [host_view(base, nbytes) for base in bases]
                values = np.empty(len(ids), np.uint64)
                for n, block in enumerate(ids):
                    h = xxhash.xxh3_64()
                    lo = int(block) * block_len
                    for view in views:
                        h.update(view[lo:lo + block_len].data)
                    values[n] = h.intdigest()
            out[rank] = RankDigests(algorithm, positions.astype(np.int64), values)
    return out


# -- consumer ------------------------------------------------------------------------------


@dataclasses.dataclass
class LandedPieces:
    """Where the bytes of each producer block image landed in this process, sorted by
    (remote rank, position, local rank, image offset); int64 columns of equal length."""

    remote_rank: np.ndarray
    position: np.ndarray
    local_rank: np.ndarray
    image_offset: np.ndarray  # in the producer's image: region * L + offset in the block
    local_region: np.ndarray
    local_offset: np.ndarray  # from the local region's base
    length: np.ndarray
    image_len: dict[int, int]  # remote rank -> K * L
    local_block_len: dict[int, int]  # local rank -> its block_len


def landed_pieces(plans: Sequence[Any], local_meta: Any, remote_meta: Any,
                  remote_ids: np.ndarray) -> LandedPieces:
    """Maps every byte range a read's plans land back to the producer's block images.

    Args:
      plans: the read's `ReadPlan` of each local rank (whole request).
      local_meta, remote_meta: the metadata the plans were made from.
      remote_ids: the request's blocks on the producer, every one (the positions' ids).

    Returns:
      The `LandedPieces`.

    Raises:
      DigestError: a remote block id repeats in the request (its position is ambiguous).
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
    rr, pos, lr, img, lg, lo, length = (
        joined[k][order] for k in ("rr", "pos", "lr", "img", "lg", "lo", "len"))
    return LandedPieces(rr, pos, lr, img, lg, lo, length, image_len, local_block_len)


def _covers(pieces: list[tuple[int, int, int, int, int]], total: int) -> bool:
    """Whether pieces ``(image offset, length, ...)`` sorted by offset tile ``[0, total)``."""
    end = 0
    for img, length, *_ in pieces:
        if img != end:
            return False
        end += length
    return end == total


@dataclasses.dataclass
class LandedDigest:
    """The digests one process computed of one producer block image it received."""

    values: list[int]  # one per cover (several local ranks may each hold the whole image)
    local_blocks: set[int]  # local block ids holding its bytes
    verifiable: bool


def verify_landed(pieces: LandedPieces, algorithms: dict[int, str],
                  local_regions: dict[int, list[tuple[int, str, int]]],
                  local_device_arrays: dict[int, list[Any]],
                  wanted: set[tuple[int, int]] | None = None,
                  ) -> dict[tuple[int, int], LandedDigest]:
    """Digests of the producer block images this process received (see the module docs).

    Args:
      pieces: `landed_pieces` of the read.
      algorithms: remote rank -> the algorithm of its digests (`algorithm_for`).
      local_regions: local rank -> per region (base address, memory kind, bytes): where
        its bytes are now (the host mirror with host staging).
      local_device_arrays: local rank -> per region its single-device array (device
        landings; may be empty for host landings).
      wanted: only these (remote rank, position) (None: every one).

    Returns:
      (remote rank, position) -> `LandedDigest` (``verifiable`` False where this process
      holds only part of the image, or a device landing that does not map whole blocks).
    """
    out: dict[tuple[int, int], LandedDigest] = {}
    # Plain Python over the pieces: a group is usually a few pieces (one per region), and
    # per-group numpy calls would cost more than the hashing of small blocks.
    groups: dict[tuple[int, int], list[tuple[int, int, int, int, int]]] = {}
    for rr, pos, lr, img, lg, lo, length in zip(
            pieces.remote_rank.tolist(), pieces.position.tolist(), pieces.local_rank.tolist(),
            pieces.image_offset.tolist(), pieces.local_region.tolist(),
            pieces.local_offset.tolist(), pieces.length.tolist()):
        if wanted is None or (rr, pos) in wanted:
            groups.setdefault((rr, pos), []).append((img, length, lr, lg, lo))
    views: dict[tuple[int, int], np.ndarray] = {}
    device_jobs: list[tuple[tuple[int, int], int, list[int]]] = []
    for (rr, pos), group in groups.items():
        total = pieces.image_len[rr]
        blocks: set[int] = set()
        by_rank: dict[int, list[tuple[int, int, int, int, int]]] = {}
        for piece in group:
            img, length, lr, lg, lo = piece
            blen = pieces.local_block_len[lr]
            blocks.update(range(lo // blen, (lo + length - 1) // blen + 1))
            by_rank.setdefault(lr, []).append(piece)
        # Each local rank holding the whole image alone (same TP, fewer consumer ranks, MLA
        # replicas) is one cover; else the local ranks' pieces together must tile it.
        covers = [sorted(p) for p in by_rank.values()]
        if not all(_covers(c, total) for c in covers):
            covers = [sorted(group)]
            if not _covers(covers[0], total):
                out[(rr, pos)] = LandedDigest([], blocks, False)
                continue
        algorithm = algorithms[rr]
        values: list[int] = []
        verifiable = True
        for cover in covers:
            if any(local_regions[lr][lg][1] != "DRAM" for _, _, lr, lg, _ in cover):
                job = _device_job(cover, pieces.local_block_len)
                if job is None or algorithm != "sum32":
                    verifiable = False
                    break
                device_jobs.append(((rr, pos), cover[0][2], job))
                continue
            h = xxhash.xxh3_64() if algorithm == "xxh3" else None
            s1 = s2 = 0
            for img, length, lr, lg, lo in cover:
                view = views.get((lr, lg))
                if view is None:
                    base, _, nbytes = local_regions[lr][lg]
                    view = views[(lr, lg)] = host_view(base, nbytes)
                chunk = view[lo:lo + length]
                if h is not None:
                    h.update(chunk.data)
                else:
                    if img % 4 or length % 4:
                        verifiable = False
                        break
                    p1, p2 = sum32_numpy(chunk, img // 4)
                    s1, s2 = (s1 + p1) & 0xFFFFFFFF, (s2 + p2) & 0xFFFFFFFF
            if not verifiable:
                break
            values.append(h.intdigest() if h is not None else _combine(s1, s2))
        out[(rr, pos)] = LandedDigest(values, blocks, verifiable)
    by_local: dict[int, list[tuple[tuple[int, int], list[int]]]] = {}
    for key, lr, job in device_jobs:
        by_local.setdefault(lr, []).append((key, job))
    for lr, jobs in by_local.items():
        table = np.asarray([job for _, job in jobs], np.int64)
        for (key, _), value in zip(jobs, device_digests(local_device_arrays[lr], table)):
            out[key].values.append(int(value))
    return out


def _device_job(cover: list[tuple[int, int, int, int, int]],
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
