"""Formatted reads over NIXL: a request's chunks gathered into one send buffer per peer rank.

A direct read posts one NIXL descriptor (chunk) per contiguous byte range the plan lists: a
fragmented request of per-layer caches, or a packed cache read across TP ranks, is hundreds of
thousands of small chunks, and each costs the transport a couple of microseconds however small
it is. A *formatted* read moves the same bytes as few large ones (TensorRT-LLM's cache
formatter, generalised to any plan):

1. the consumer plans the read exactly as a direct read (`jaxkv.transfer._plan`) and cuts the
   plan's rows for one producer rank into chunks of at most ``chunk_bytes``; it reserves a
   slot of its registered *receive pool* for a chunk and sends the chunk's producer-side rows
   (`Format`): explicitly, or as the per-block templates they are made of and a row range. A
   fragmented request's rows are all of that form (`ReadPlan.block_share`): they are cut and
   described from the templates (`block_share_chunks`) and made one chunk at a time, so
   starting a read is O(templates + chunks) however many rows it has;
2. the producer process checks them against its registered regions and the request's
   publication, gathers those byte ranges into a slot of its registered *send pool*, in row
   order, and answers where they are (`Formatted`);
3. the consumer READs the slot with one descriptor (the READ's notification, `Released`,
   frees the producer's slot once the bytes left) and scatters it into its cache by the
   plan's local rows;

the bytes land exactly where the direct read would have put them, so everything after
(post-processing, digests, `Done` / `Ack`, leases, generations, invalid blocks on failure)
is the direct read's. Chunks flow as pool slots allow: the producer gathers chunk ``i + 1``
while chunk ``i`` is on the wire and chunk ``i - 1`` is scattered.

Copies run in `jaxkv._ffi_cpu.copy_rows` (C++, the GIL released), which checks every row
against its region's bounds before any byte moves; large ones prefetch the chunks ahead
(scattered 4 KiB chunks otherwise stall at each start) and write with streaming stores. A
consumer scatters each landed chunk of 1 MiB or more on a native thread of its own
(`_ffi_cpu.RowCopy`, which never takes the GIL) while it reads the next, and reports the
read only once every scatter finished; a read released early waits for its scatters, so no
byte is written into the cache after its read ended. The producer progresses its transport
after each gather, so consumers' READs of earlier chunks complete meanwhile. Both caches
must be in host memory (CPU caches, host-staged mirrors); device caches are read directly
(a device-side gather is not built).

Which path a read takes is decided per request by `PathCosts` (descriptors x per-descriptor
cost + bytes / wire against rank pairs x round trip + bytes / formatted bandwidth),
calibrated from the reads made with each producer engine, each path from its own reads.
"""

from __future__ import annotations

import bisect
import dataclasses
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jaxkv.transfer._plan import BlockShare

__all__ = [
    "FORMATTED_MODES",
    "FormatServer",
    "FormattedFetch",
    "HostPool",
    "PathCosts",
    "WaitingChunk",
    "block_share_chunks",
    "chunk_bounds",
    "describe_share",
    "expand_templates",
    "gather_rows",
    "scatter_rows",
    "template_fields",
    "template_form",
]

FORMATTED_MODES = ("auto", "always", "never")
"""`KVTransferEngine(formatted_reads=...)`: by cost, every eligible read, none."""

DEFAULT_CHUNK_BYTES = 8 << 20
DEFAULT_POOL_BYTES = 64 << 20
BACKGROUND_SCATTER_BYTES = 1 << 20
"""Landed chunks of at least this many bytes are scattered on a thread of their own (a
thread start, ~50 us here, is worth it against a copy of ~40 us per MiB)."""
MIN_FORMATTED_BYTES = 4 << 20
"""Reads below this many bytes per rank pair stay direct in ``"auto"`` mode: a formatted read
costs a control round trip per chunk, which small reads do not win back."""
MAX_FORMAT_ROWS = 1 << 16  # rows per `Format` message (5 int64 each: 2.5 MiB)
EXPLICIT_ROWS = 1024  # shares of up to this many rows name them explicitly (40 KiB at most)

_RR, _RG, _RO, _LG, _LO, _LEN, _CNT, _RS, _LS = range(9)
_REMOTE_COLUMNS = [_RG, _RO, _LEN, _CNT, _RS]  # what a `Format` names of a plan row


def _cpu() -> Any:
    """`jaxkv._ffi_cpu` (its `copy_rows` and `RowCopy`), imported when first needed."""
    from jaxkv import _ffi_cpu

    return _ffi_cpu


_REREGISTERED = ("the local cache was re-registered during the read: its chunks are not "
                 "written into memory it no longer owns")


class HostPool:
    """A host buffer registered with the NIXL agent once, handing out byte slots.

    Slots are first-fit over a sorted free list, aligned to 64 bytes; `alloc` returns None
    when no free range is large enough (the caller waits for `free`).

    Args:
      agent: the process's `NixlAgent` (registers the buffer; deregistered by `close`).
      nbytes: the pool's size.
    """

    ALIGN = 64

    def __init__(self, agent: Any, nbytes: int):
        if nbytes <= 0:
            raise ValueError(f"a pool needs a positive size, got {nbytes}")
        self.nbytes = int(nbytes)
        raw = np.empty(self.nbytes + 4096, np.uint8)
        start = (-raw.ctypes.data) % 4096
        self.buffer = raw[start : start + self.nbytes]
        self.address = int(self.buffer.ctypes.data)
        self._raw = raw
        self._agent = agent
        self._region = (self.address, self.nbytes, 0, "DRAM")
        agent.register([self._region])
        self._free: list[tuple[int, int]] = [(0, self.nbytes)]  # (offset, size), sorted
        self._used: dict[int, int] = {}
        self._lock = threading.Lock()

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return sum(self._used.values())

    def alloc(self, nbytes: int) -> int | None:
        """A slot of `nbytes` (its offset in the pool), or None when none is free."""
        size = max(self.ALIGN, -(-int(nbytes) // self.ALIGN) * self.ALIGN)
        with self._lock:
            for i, (offset, free) in enumerate(self._free):
                if free >= size:
                    if free == size:
                        del self._free[i]
                    else:
                        self._free[i] = (offset + size, free - size)
                    self._used[offset] = size
                    return offset
        return None

    def free(self, offset: int) -> None:
        """Returns a slot (unknown offsets are ignored: a slot is freed once)."""
        with self._lock:
            size = self._used.pop(offset, None)
            if size is None:
                return
            self._free.append((offset, size))
            self._free.sort()
            merged: list[tuple[int, int]] = []
            for start, length in self._free:
                if merged and merged[-1][0] + merged[-1][1] == start:
                    merged[-1] = (merged[-1][0], merged[-1][1] + length)
                else:
                    merged.append((start, length))
            self._free = merged

    def close(self) -> None:
        self._agent.deregister([self._region])


def _split_rows(rows: np.ndarray, chunk_bytes: int) -> np.ndarray:
    """Rows cut so that none moves more than `chunk_bytes` (strided rows by count, single
    chunks by length), in the same byte order."""
    sizes = rows[:, _LEN] * rows[:, _CNT]
    if not len(rows) or int(sizes.max()) <= chunk_bytes:
        return rows
    out = []
    for row in rows:
        length, count = int(row[_LEN]), int(row[_CNT])
        if length * count <= chunk_bytes:
            out.append(row[None])
        elif count > 1 and length <= chunk_bytes:
            per = max(1, chunk_bytes // length)
            starts = np.arange(0, count, per)
            piece = np.repeat(row[None], len(starts), axis=0)
            piece[:, _CNT] = np.minimum(per, count - starts)
            piece[:, _RO] += starts * row[_RS]
            piece[:, _LO] += starts * row[_LS]
            out.append(piece)
        else:  # chunks longer than a wire chunk: each chunk cut by length
            within = np.arange(count)
            cuts = np.arange(0, length, chunk_bytes)
            piece = np.repeat(row[None], count * len(cuts), axis=0)
            c = np.repeat(within, len(cuts))
            k = np.tile(cuts, count)
            piece[:, _CNT] = 1
            piece[:, _LEN] = np.minimum(chunk_bytes, length - k)
            piece[:, _RO] += c * row[_RS] + k
            piece[:, _LO] += c * row[_LS] + k
            out.append(piece)
    return np.concatenate(out)


def chunk_bounds(rows: np.ndarray, chunk_bytes: int) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """The plan rows read from one remote rank, cut into wire chunks of at most `chunk_bytes`
    each (and at most `MAX_FORMAT_ROWS` rows): ``(rows, [(start, stop), ...])``, `rows` with
    any row larger than a chunk split first (the same bytes, in the same order)."""
    rows = _split_rows(np.asarray(rows, np.int64), int(chunk_bytes))
    if not len(rows):
        return rows, []
    ends = np.cumsum(rows[:, _LEN] * rows[:, _CNT])
    bounds = []
    first = 0
    while first < len(rows):
        base = int(ends[first - 1]) if first else 0
        stop = int(np.searchsorted(ends, base + chunk_bytes, side="right"))
        stop = min(max(stop, first + 1), first + MAX_FORMAT_ROWS)
        bounds.append((first, stop))
        first = stop
    return rows, bounds


def template_form(rows: np.ndarray, remote_ids: np.ndarray,
                  block_lens: np.ndarray) -> np.ndarray | None:
    """The producer-side ranges of `rows` as per-block templates, when the rows are one per
    (template, block) in template-major order, each at ``offset + block_len * block id`` of
    its region (a fragmented request: the large case): int64 ``[m, 5]`` (region, offset in
    the block, length, count, stride), or None. A chunk is then named by its first row and
    row count: O(templates) bytes instead of O(rows) (`expand_templates`).

    Args:
      rows: the plan rows (`COPY_COLUMNS`) read from one remote rank.
      remote_ids: the remote blocks read, in order.
      block_lens: the remote rank's regions' bytes per block.
    """
    n, total = len(remote_ids), len(rows)
    if n < 2 or total % n or not total:
        return None
    grid = rows.reshape(total // n, n, 9)
    first = grid[:, 0]
    # column by column on views: millions of rows, no fancy-indexed copies
    for column in (_RG, _LEN, _CNT, _RS):
        if not np.array_equal(grid[:, :, column], np.broadcast_to(
                first[:, column, None], (len(first), n))):
            return None
    regions = first[:, _RG]
    if regions.min() < 0 or regions.max() >= len(block_lens):
        return None
    base = first[:, _RO] - block_lens[regions] * remote_ids[0]
    expected = base[:, None] + np.multiply.outer(block_lens[regions], remote_ids)
    if not np.array_equal(grid[:, :, _RO], expected):
        return None
    return np.stack([first[:, _RG], base, first[:, _LEN], first[:, _CNT], first[:, _RS]],
                    axis=1).astype(np.int64)


def expand_templates(templates: np.ndarray, block_lens: Sequence[int], remote_ids: np.ndarray,
                     first_row: int, num_rows: int) -> np.ndarray:
    """Producer: rows ``[first_row, first_row + num_rows)`` of a template form (see
    `template_form`) over `remote_ids`: int64 ``[num_rows, 5]``.

    Raises:
      ValueError: templates that are malformed or name a region that does not exist, rows
        past the form's end.
    """
    templates = np.asarray(templates, np.int64).reshape(-1, 5)
    n = len(remote_ids)
    if not n or first_row < 0 or num_rows < 0 or first_row + num_rows > len(templates) * n:
        raise ValueError(f"rows [{first_row}, {first_row + num_rows}) are outside the "
                         f"{len(templates)} x {n} rows of the form")
    lens = np.asarray(block_lens, np.int64)
    if len(templates) and (templates[:, 0].min() < 0 or templates[:, 0].max() >= len(lens)):
        raise ValueError("a template names a region this rank does not have")
    index = np.arange(first_row, first_row + num_rows)
    picked = templates[index // n]
    picked[:, 1] += lens[picked[:, 0]] * np.asarray(remote_ids, np.int64)[index % n]
    return picked


def describe_share(rows: np.ndarray, chunk_bytes: int, remote_ids: np.ndarray | None,
                   block_lens: Sequence[int]) -> tuple[np.ndarray, list[tuple[int, int]],
                                                        np.ndarray | None]:
    """How one (local rank, remote rank) share of a formatted read is cut and described:
    ``(rows, chunk bounds, templates)`` (`chunk_bounds`; `template_form` where the rows have
    one, else None: each chunk's rows travel explicitly)."""
    split, bounds = chunk_bounds(rows, chunk_bytes)
    templates = None
    # Few rows (runs of consecutive ids merged) travel as they are: looking for a template
    # form would cost more than it saves.
    if remote_ids is not None and len(split) == len(rows) > EXPLICIT_ROWS:  # none split
        templates = template_form(split, np.asarray(remote_ids, np.int64),
                                  np.asarray(block_lens, np.int64))
    return split, bounds, templates


def block_share_chunks(share: BlockShare, chunk_bytes: int, block_lens: Sequence[int]
                       ) -> tuple[list[tuple[int, int, int]], np.ndarray] | None:
    """How a share in per-block form (`BlockShare`) is cut and described without its rows:
    ``([(first row, stop row, bytes), ...], templates)``, the chunks exactly those
    `chunk_bounds` cuts the rows into, the templates those `template_form` finds in them
    (int64 ``[m, 5]``) — in O(templates + chunks), not O(rows). None where the rows need
    more than that: a row larger than a chunk, an empty row, or a remote block length other
    than its region's (what `expand_templates` on the producer assumes).

    Args:
      share: one (local rank, remote rank) share (`ReadPlan.block_share`).
      chunk_bytes: the wire chunk size.
      block_lens: the remote rank's regions' bytes per block.
    """
    t = share.templates
    sizes = share.row_bytes.tolist()
    lens = np.asarray(block_lens, np.int64)
    if not len(t) or min(sizes) <= 0 or max(sizes) > chunk_bytes:
        return None
    if t[:, _RG].min() < 0 or t[:, _RG].max() >= len(lens) or not np.array_equal(
            lens[t[:, _RG]], share.remote_block_len):
        return None
    k = len(share.local_ids)
    starts = [0]  # bytes before template i's rows
    for size in sizes:
        starts.append(starts[-1] + size * k)
    total_rows = len(sizes) * k
    chunks = []
    first = base = 0
    while first < total_rows:
        # `chunk_bounds`' greedy cut: every row whose end is within a chunk of `base`
        target = base + chunk_bytes
        i = bisect.bisect_right(starts, target) - 1
        stop = total_rows if i >= len(sizes) else i * k + min(k, (target - starts[i]) // sizes[i])
        stop = min(max(stop, first + 1), first + MAX_FORMAT_ROWS)
        last, within = divmod(stop - 1, k)
        end = starts[last] + (within + 1) * sizes[last]
        chunks.append((first, stop, end - base))
        first, base = stop, end
    return chunks, t[:, _REMOTE_COLUMNS]


def template_fields(templates: np.ndarray, num_remote: int, first_row: int,
                    num_rows: int) -> dict:
    """The `Format` fields naming rows ``[first_row, first_row + num_rows)`` of a template
    form over `num_remote` blocks: only the templates those rows are made of (rows are
    template-major, `num_remote` per template), so a share's messages hold O(templates +
    chunks) bytes, not every template once per chunk."""
    first = first_row // num_remote
    stop = (first_row + num_rows - 1) // num_remote + 1
    return dict(templates=templates[first:stop].astype("<i8").tobytes(),
                first_row=first_row - first * num_remote, num_rows=num_rows,
                num_remote=num_remote)


def wire_offsets(lengths: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, int]:
    """Each row's offset in the gathered buffer (rows back to back, chunks back to back) and
    the buffer's size."""
    sizes = lengths * counts
    ends = np.cumsum(sizes)
    return ends - sizes, int(ends[-1]) if len(ends) else 0


def gather_rows(remote_rows: np.ndarray, regions: Sequence[tuple[int, int]], address: int,
                nbytes: int) -> None:
    """Producer: copies the byte ranges of `remote_rows` (int64 ``[N, 5]``: region, offset,
    length, count, stride) out of `regions` (``(base address, size)`` per region index) into
    the buffer at `address`, back to back.

    Raises:
      IndexError: a row outside its region, or more bytes than `nbytes`.
      ValueError: malformed rows.
    """
    rows = np.asarray(remote_rows, np.int64)
    if rows.ndim != 2 or rows.shape[1] != 5:
        raise ValueError(f"format rows must be int64 [N, 5], got shape {rows.shape}")
    offsets, total = wire_offsets(rows[:, 2], rows[:, 3])
    if total > nbytes:
        raise IndexError(f"the rows move {total} bytes, the buffer holds {nbytes}")
    copy = np.empty((len(rows), 8), np.int64)
    copy[:, 0], copy[:, 1] = rows[:, 0], rows[:, 1]
    copy[:, 2], copy[:, 3] = 0, offsets
    copy[:, 4], copy[:, 5] = rows[:, 2], rows[:, 3]
    copy[:, 6], copy[:, 7] = rows[:, 4], rows[:, 2]
    _cpu().copy_rows(np.array([r[0] for r in regions], np.uint64),
                     np.array([r[1] for r in regions], np.int64),
                     np.array([address], np.uint64), np.array([nbytes], np.int64), copy)


def scatter_rows(rows: np.ndarray, regions: Sequence[tuple[int, int]], address: int,
                 nbytes: int, background: bool = False) -> Any:
    """Consumer: copies the gathered buffer at `address` into the local byte ranges of the
    plan rows `rows` (`COPY_COLUMNS`) of `regions` (local ``(base address, size)``).

    Args:
      background: copy on a native thread (rows checked first, here): returns its
        `_ffi_cpu.RowCopy` (``done()``, ``wait(timeout_s)``); both buffers must stay valid
        until it is done. Else copies now and returns None.

    Raises:
      IndexError: a row outside its region, or more bytes than the buffer holds.
    """
    offsets, total = wire_offsets(rows[:, _LEN], rows[:, _CNT])
    if total > nbytes:
        raise IndexError(f"the rows move {total} bytes, the buffer holds {nbytes}")
    copy = np.empty((len(rows), 8), np.int64)
    copy[:, 0], copy[:, 1] = 0, offsets
    copy[:, 2], copy[:, 3] = rows[:, _LG], rows[:, _LO]
    copy[:, 4], copy[:, 5] = rows[:, _LEN], rows[:, _CNT]
    copy[:, 6], copy[:, 7] = rows[:, _LEN], rows[:, _LS]
    args = (np.array([address], np.uint64), np.array([nbytes], np.int64),
            np.array([r[0] for r in regions], np.uint64),
            np.array([r[1] for r in regions], np.int64), copy)
    if background:
        return _cpu().RowCopy(*args)
    _cpu().copy_rows(*args)
    return None


def remote_half(rows: np.ndarray) -> bytes:
    """What a `Format` message carries of plan rows: int64 LE ``[N, 5]`` (remote region,
    offset, length, count, stride)."""
    half = rows[:, _REMOTE_COLUMNS]  # a new C-ordered array
    return half.astype("<i8", copy=False).tobytes()


def parse_remote_half(payload: bytes) -> np.ndarray:
    """The rows of a `Format` message.

    Raises:
      ValueError: not a whole number of 5-column int64 rows.
    """
    if len(payload) % 40:
        raise ValueError(f"format rows of {len(payload)} bytes are not int64 [N, 5]")
    return np.frombuffer(payload, "<i8").reshape(-1, 5).astype(np.int64)


# -- the consumer's side ----------------------------------------------------------------------


@dataclasses.dataclass
class _Chunk:
    index: int
    rows: np.ndarray | None  # plan rows (COPY_COLUMNS); None: the share's, made when needed
    nbytes: int
    first_row: int = 0  # its rows' place in the share's rows (template form)
    num_rows: int = 0
    slot: int | None = None  # receive pool offset
    handle: Any = None  # the READ
    scatter: Any = None  # its scatter under way (`_ffi_cpu.RowCopy`)
    state: str = "queued"  # queued -> asked -> reading [-> scattering] -> done


class FormattedFetch:
    """One (local rank, producer rank) pair of a formatted read: its chunks, asked for as
    receive-pool slots allow, read when the producer answers, scattered when landed.

    Args:
      agent: the `NixlAgent` (READs).
      pool: the receive `HostPool`.
      remote_name: the producer agent's NIXL name.
      local_rank, remote_rank: the pair.
      rows: the plan rows of the pair (`ReadPlan.copies_for`), or the pair's share in
        per-block form (`ReadPlan.block_share`: chunks cut, described and scattered from
        its templates, rows made per chunk; a fragmented request's planning stays
        O(templates + chunks)).
      local_regions: ``(base address, size)`` of the local rank's regions.
      chunk_bytes: the wire chunk size.
      ask: ``ask(chunk index, nbytes, fields) -> bool`` sends a `Format` with `fields` (its
        ranges: explicit ``rows``, or ``templates`` / ``first_row`` / ``num_rows`` /
        ``num_remote``; False: could not send).
      remote_ids: the remote blocks read (the template form's blocks).
      remote_block_lens: the producer rank's regions' bytes per block.
      first_chunk: the id of its first chunk (ids are unique within a read).
      released: ``released(chunk index) -> bytes`` the notification a READ carries.
      regions_current: whether `local_regions` are still registered as they were (a chunk
        is never scattered into memory the cache no longer owns).
      background_scatter: chunks of at least `BACKGROUND_SCATTER_BYTES` are scattered on a
        native thread while the polling thread reads the next ones (on a host whose wire is
        a CPU copy, the READ and the scatter then use two cores); False: `check` scatters
        every chunk itself.
    """

    def __init__(self, agent: Any, pool: HostPool, remote_name: str, local_rank: int,
                 remote_rank: int, rows: np.ndarray | BlockShare,
                 local_regions: Sequence[tuple[int, int]],
                 chunk_bytes: int, ask: Callable[[int, int, dict], bool],
                 released: Callable[[int], bytes],
                 regions_current: Callable[[], bool] = lambda: True,
                 remote_ids: np.ndarray | None = None,
                 remote_block_lens: Sequence[int] = (), first_chunk: int = 0,
                 background_scatter: bool = True):
        self.regions_current = regions_current
        self.background_scatter = background_scatter
        self.first_chunk = first_chunk
        self.agent, self.pool, self.remote_name = agent, pool, remote_name
        self.local_rank, self.remote_rank = local_rank, remote_rank
        self.local_regions = list(local_regions)
        self._ask, self._released = ask, released
        self.chunks = []
        self._share: BlockShare | None = None
        self.templates: np.ndarray | None = None  # the share's template form, if any
        self.num_remote = 0 if remote_ids is None else len(remote_ids)
        if isinstance(rows, BlockShare):
            cut = block_share_chunks(rows, chunk_bytes, remote_block_lens)
            if cut is None:
                rows = rows.rows(0, rows.num_rows)
            else:
                self._share = rows
                self.num_remote = len(rows.remote_ids)
                bounds, self.templates = cut
                for i, (first, stop, nbytes) in enumerate(bounds):
                    self.chunks.append(_Chunk(first_chunk + i, None, nbytes, first, stop - first))
        if not isinstance(rows, BlockShare):
            split, rows_bounds, self.templates = describe_share(rows, chunk_bytes, remote_ids,
                                                                remote_block_lens)
            for i, (first, stop) in enumerate(rows_bounds):
                part = split[first:stop]
                _, nbytes = wire_offsets(part[:, _LEN], part[:, _CNT])
                self.chunks.append(_Chunk(first_chunk + i, part, nbytes, first, stop - first))
        for chunk in self.chunks:
            if chunk.nbytes > pool.nbytes:
                raise ValueError(f"a formatted chunk of {chunk.nbytes} bytes exceeds the "
                                 f"{pool.nbytes}-byte receive pool")
        self.error: str | None = None
        self.nbytes = sum(c.nbytes for c in self.chunks)
        self.advance()

    def advance(self) -> None:
        """Asks for the queued chunks the receive pool has room for, in order."""
        for chunk in self.chunks:
            if chunk.state != "queued":
                continue
            slot = self.pool.alloc(chunk.nbytes)
            if slot is None:
                return  # later chunks wait for this one (order keeps the pool unfragmented)
            chunk.slot = slot
            if self.templates is not None:
                fields = template_fields(self.templates, self.num_remote, chunk.first_row,
                                         chunk.num_rows)
            else:
                fields = dict(rows=remote_half(self._rows(chunk)))
            if not self._ask(chunk.index, chunk.nbytes, fields):
                self.pool.free(slot)
                chunk.slot = None
                self.error = f"could not ask producer rank {self.remote_rank} for chunk " \
                             f"{chunk.index}"
                return
            chunk.state = "asked"

    def _rows(self, chunk: _Chunk) -> np.ndarray:
        """A chunk's plan rows (made from the share's templates when it has no rows)."""
        if chunk.rows is not None:
            return chunk.rows
        assert self._share is not None
        return self._share.rows(chunk.first_row, chunk.first_row + chunk.num_rows)

    def owns(self, chunk_index: int) -> bool:
        """Whether chunk id `chunk_index` is one of this fetch's."""
        return 0 <= chunk_index - self.first_chunk < len(self.chunks)

    def on_formatted(self, chunk_index: int, address: int, nbytes: int, error: str) -> None:
        """The producer's answer for one chunk: READ it, or fail with its reason."""
        if not self.owns(chunk_index):
            self.error = f"producer rank {self.remote_rank} answered unknown chunk {chunk_index}"
            return
        chunk = self.chunks[chunk_index - self.first_chunk]
        if chunk.state != "asked":
            return  # a duplicate answer
        if error:
            self.error = f"producer rank {self.remote_rank} could not format chunk " \
                         f"{chunk_index}: {error}"
            return
        if nbytes != chunk.nbytes:
            self.error = (f"producer rank {self.remote_rank} formatted {nbytes} bytes for "
                          f"chunk {chunk_index}, the plan moves {chunk.nbytes}")
            return
        assert chunk.slot is not None
        local = np.array([[self.pool.address + chunk.slot, nbytes, 0]], np.uint64)
        remote = np.array([[address, nbytes, 0]], np.uint64)
        try:
            chunk.handle = self.agent.read(local, remote, self.remote_name, "DRAM", "DRAM",
                                           notif=self._released(chunk_index))
        except ConnectionError as err:
            self.error = str(err)
            return
        chunk.state = "reading"

    def check(self) -> str:
        """``"DONE"`` once every chunk landed in the cache, ``"ERR"``, else ``"PROC"``
        (scatters the chunks whose READ completed: large ones on a native thread, checked
        here until done)."""
        if self.error is not None:
            return "ERR"
        for chunk in self.chunks:
            if chunk.state == "scattering":
                if not chunk.scatter.done():
                    continue
                chunk.scatter = None
                self._landed(chunk)
                if not self.regions_current():  # re-registered while it was copied (like a
                    # READ still in flight then): the read fails, its blocks are invalid
                    self.error = _REREGISTERED
                    return "ERR"
                continue
            if chunk.state != "reading":
                continue
            state = self.agent.state(chunk.handle)
            if state == "ERR":
                self.error = f"the READ of chunk {chunk.index} from producer rank " \
                             f"{self.remote_rank} failed"
                return "ERR"
            if state != "DONE":
                continue
            assert chunk.slot is not None
            if not self.regions_current():
                self.error = _REREGISTERED
                return "ERR"
            background = self.background_scatter and chunk.nbytes >= BACKGROUND_SCATTER_BYTES
            try:
                chunk.scatter = scatter_rows(self._rows(chunk), self.local_regions,
                                             self.pool.address + chunk.slot, chunk.nbytes,
                                             background=background)
            except (IndexError, ValueError) as err:
                self.error = f"scattering chunk {chunk.index}: {err}"
                return "ERR"
            if chunk.scatter is not None:
                chunk.state = "scattering"
                continue
            self._landed(chunk)
        self.advance()
        if self.error is not None:
            return "ERR"
        return "DONE" if all(c.state == "done" for c in self.chunks) else "PROC"

    def _landed(self, chunk: _Chunk) -> None:
        """A chunk is in the cache: its READ and receive slot are freed."""
        self.agent.release(chunk.handle)
        chunk.handle = None
        assert chunk.slot is not None
        self.pool.free(chunk.slot)
        chunk.slot = None
        chunk.state = "done"

    def release(self, scatter_timeout_s: float = 60.0) -> bool:
        """Cancels what is in flight and frees the receive slots. A slot whose READ could not
        be released stays allocated (NIXL may still write it); a scatter under way is waited
        for (up to `scatter_timeout_s`: a copy of one chunk), so that no byte is written into
        the cache after its read ended; one that does not finish keeps its slot."""
        clean = True
        for chunk in self.chunks:
            if chunk.scatter is not None:
                if not chunk.scatter.wait(scatter_timeout_s):
                    clean = False
                    chunk.slot = None  # leaked on purpose: still being read
                chunk.scatter = None
            if chunk.handle is not None:
                ok = self.agent.release(chunk.handle)
                clean &= ok
                chunk.handle = None
                if not ok:
                    chunk.slot = None  # leaked on purpose: never reused while written
            if chunk.slot is not None:
                self.pool.free(chunk.slot)
                chunk.slot = None
        return clean


# -- the choice ------------------------------------------------------------------------------


@dataclasses.dataclass
class PathCosts:
    """What a read costs one way or the other, per producer engine (calibrated from its reads).

    Direct: ``descriptors x descriptor_s + bytes / wire_bps``. Formatted: ``shares x
    round_trip_s + bytes / formatted_bps``: one round trip per (local rank, producer rank)
    share before its first chunk moves (later chunks are asked for while earlier ones move),
    then the gather, the wire and the scatter as one bandwidth, measured as a whole (on a
    small machine they overlap only partly, on a large one fully: neither is assumed).
    Each path's constants are calibrated from that path's own finished reads only. Defaults
    measured on the 2-core CPU VM of benchmarks/RESULTS.md (UCX shared memory, idle).
    """

    descriptor_s: float = 1.6e-6
    wire_bps: float = 7e9
    formatted_bps: float = 6e9
    round_trip_s: float = 5e-4
    smoothing: float = 0.5  # weight of a new measurement

    def direct_s(self, descriptors: int, nbytes: int) -> float:
        return descriptors * self.descriptor_s + nbytes / self.wire_bps

    def formatted_s(self, shares: int, nbytes: int) -> float:
        return shares * self.round_trip_s + nbytes / self.formatted_bps

    def _blend(self, old: float, new: float) -> float:
        return (1 - self.smoothing) * old + self.smoothing * new

    def observe_direct(self, descriptors: int, nbytes: int, seconds: float) -> None:
        """Calibrates from a finished direct read: the wire from one of few large
        descriptors, the per-descriptor cost from one of many."""
        if seconds <= 0 or nbytes <= 0:
            return
        if descriptors <= 64 and nbytes >= (1 << 20):
            self.wire_bps = self._blend(self.wire_bps, nbytes / seconds)
        elif descriptors >= 1024:
            per = max(0.0, seconds - nbytes / self.wire_bps) / descriptors
            self.descriptor_s = self._blend(self.descriptor_s, max(per, 1e-8))

    def observe_formatted(self, shares: int, nbytes: int, seconds: float) -> None:
        """Calibrates from a finished formatted read of `shares` (local, producer) rank
        pairs."""
        if seconds <= 0 or nbytes < (1 << 20):
            return
        rest = seconds - shares * self.round_trip_s
        self.formatted_bps = self._blend(self.formatted_bps,
                                         nbytes / max(rest, seconds * 0.05))


# -- the producer's side ----------------------------------------------------------------------


@dataclasses.dataclass
class WaitingChunk:
    message: Any  # `Format`
    target: Any  # the consumer's control target
    expiry: float  # time.monotonic()


class FormatServer:
    """Producer: gathers the chunks consumers ask for (`Format`) into send-pool slots, held
    until the consumer's READ released them (`Released`) or the request is freed.

    A chunk the pool has no room for waits (`waiting`, retried by `retry`) until its expiry;
    one larger than the whole pool is refused at once.

    Args:
      pool: the send `HostPool`.
    """

    def __init__(self, pool: HostPool):
        self.pool = pool
        self.slots: dict[tuple, tuple[str, int]] = {}  # chunk key -> (request id, offset)
        self.waiting: list[WaitingChunk] = []
        self.formatted_chunks = 0  # chunks gathered (stats)

    @staticmethod
    def key(message: Any) -> tuple:
        """A chunk's key: (consumer agent, attempt, chunk, producer rank, consumer rank)."""
        return (message.agent_name, message.attempt, message.chunk, message.producer_rank,
                message.consumer_rank)

    def gather(self, message: Any, regions: Sequence[tuple[int, int]],
               block_lens: Sequence[int], block_ids: Sequence[int]) -> tuple[int, int] | None:
        """Gathers one chunk: ``(address, nbytes)`` of its slot, or None when the pool has
        no room now (a slot already gathered for this chunk is answered again).

        Args:
          message: the `Format`.
          regions: ``(base address, size)`` of the producer rank's regions.
          block_lens: their bytes per block (a template form's offsets).
          block_ids: the published request's blocks (a template form reads their tail).

        Raises:
          ValueError, IndexError: malformed rows, rows outside the regions, a chunk larger
            than the pool.
        """
        key = self.key(message)
        held = self.slots.get(key)
        if held is not None:
            return self.pool.address + held[1], int(message.nbytes)
        if message.templates:
            if not 0 < message.num_remote <= len(block_ids):
                raise ValueError(f"the chunk reads {message.num_remote} of the request's "
                                 f"{len(block_ids)} blocks")
            if len(message.templates) % 40:
                raise ValueError("format templates are not int64 [N, 5]")
            ids = np.asarray(block_ids[len(block_ids) - message.num_remote:], np.int64)
            rows = expand_templates(np.frombuffer(message.templates, "<i8"), block_lens, ids,
                                    message.first_row, message.num_rows)
        else:
            rows = parse_remote_half(message.rows)
        if int(message.nbytes) > self.pool.nbytes:
            raise ValueError(f"a chunk of {message.nbytes} bytes exceeds the "
                             f"{self.pool.nbytes}-byte send pool")
        offset = self.pool.alloc(int(message.nbytes))
        if offset is None:
            return None
        try:
            gather_rows(rows, regions, self.pool.address + offset, int(message.nbytes))
        except BaseException:
            self.pool.free(offset)
            raise
        self.slots[key] = (message.request_id, offset)
        self.formatted_chunks += 1
        return self.pool.address + offset, int(message.nbytes)

    def release(self, key: tuple) -> None:
        """The consumer's READ of a chunk completed: its slot is free."""
        held = self.slots.pop(key, None)
        if held is not None:
            self.pool.free(held[1])

    def drop_request(self, request_id: str) -> None:
        """The request was freed (confirmed, aborted or expired): its slots and waiting
        chunks go (a reader still at it fails: the request is no longer pinned)."""
        for key in [k for k, (r, _) in self.slots.items() if r == request_id]:
            self.release(key)
        self.waiting = [w for w in self.waiting if w.message.request_id != request_id]

    @property
    def held_bytes(self) -> int:
        return self.pool.used_bytes

    def close(self) -> None:
        self.slots.clear()
        self.waiting.clear()
        self.pool.close()
