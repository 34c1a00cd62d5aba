"""Read planning: which remote bytes a decode rank reads into which local bytes.

Pure functions over two `EngineMetadata` (no NIXL, no JAX). The model
(docs/data-movement.md sections 2-6):

* Every block of every region is a set of *slabs*, one per (global layer, kv): the heads of
  the rank for that layer and K/V, ``[H_rank, T, D]`` ("HTD" order) or ``[T, H_rank, D]``
  ("THD" order), contiguous inside the block (layouts whose L/K axes come before H and T).
* For each local slab and each local head, one remote rank is read: the owner of the layer
  (PP) holding the head (TP), the replica ``local_tp_rank % replicas`` when the remote side
  replicates it (replicated KV, MLA). Consecutive heads from the same remote rank form a *run*.
* Equal block sizes and a run whose bytes nest the same way on both sides are copied directly
  into their final place, one (possibly strided) descriptor per run and per run of
  consecutive block ids. Anything else (HND <-> NHD with more than one head, a local block
  holding ``r`` remote blocks) is read *in the sender's arrangement* into the local slab and
  rearranged afterwards: the plan lists those `PostProcess` steps as data.
* Partial prefix hits: only the tail of the remote ids is read; no local ids = notify only.

A descriptor is ``(offset, length, count, stride)`` on each side: ``count`` chunks of
``length`` bytes ``stride`` bytes apart (NIXL 1.5 strided descriptors; ``count == 1`` is a
plain one).
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
from collections.abc import Sequence

import numpy as np

from jaxkv.transfer._metadata import EngineMetadata, check_compatible

__all__ = [
    "COPY_COLUMNS",
    "BlockShare",
    "PlanError",
    "PostProcess",
    "ReadPlan",
    "ReadPlanner",
    "block_runs",
    "plan_read",
    "read_planner",
    "row_chunks",
]

COPY_COLUMNS = (
    "remote_rank",
    "remote_region",
    "remote_offset",
    "local_region",
    "local_offset",
    "length",
    "count",
    "remote_stride",
    "local_stride",
)
"""Columns of `ReadPlan.copies` (int64). Offsets are bytes from the region's base address."""
_RR, _RG, _RO, _LG, _LO, _LEN, _CNT, _RS, _LS = range(9)


class PlanError(ValueError):
    """A read that cannot be planned (ids out of range, unsupported layout, ...)."""


@dataclasses.dataclass(frozen=True)
class PostProcess:
    """Rearrange received blocks of one local array in place (docs/data-movement.md section 3).

    The bytes of each block in `block_ids` of local region `region` (cache array
    `array_index`) arrived as ``[ratio, *src_layout]`` with ``T / ratio`` tokens (``ratio``
    sender blocks back to back, each in `src_layout`, the receiver's layout with its H/T
    letters in the sender's order); they must become one block in `dst_layout` (the local
    layout) where token ``j * (T / ratio) + t`` comes from token ``t`` of sub-block ``j``.
    This is exactly `jaxkv.ops.permute_blocks` (``ratio == 1``) / `jaxkv.ops.merge_blocks`.

    Attributes:
      kind: "permute" (layout only), "merge" (block size only) or "merge_permute" (both).
      block_shape: the local block's sizes in `dst_layout` order (this rank's heads).
    """

    kind: str
    region: int
    array_index: int
    block_ids: np.ndarray
    ratio: int
    src_layout: str
    dst_layout: str
    block_shape: tuple[int, ...]
    itemsize: int

    @property
    def block_nbytes(self) -> int:
        return int(np.prod(self.block_shape)) * self.itemsize

    def op_args(self) -> tuple:
        """``(src_layout, dst_layout, ratio)`` for the ops (hashable: groups equal steps)."""
        return (self.src_layout, self.dst_layout, self.ratio)

    def rearrange(self, blocks: np.ndarray) -> np.ndarray:
        """Applies the rearrangement to raw blocks ``[..., block_nbytes]`` (uint8, numpy):
        the reference the custom calls are checked against."""
        lead = blocks.shape[:-1]
        sizes = dict(zip(self.dst_layout, self.block_shape))
        sizes["T"] //= self.ratio
        x = blocks.reshape(*lead, self.ratio, *(sizes[a] for a in self.src_layout), self.itemsize)
        k = len(lead)
        perm: list[int] = list(range(k))
        for letter in self.dst_layout:
            if letter == "T":
                perm.append(k)  # the sub-block index is the outer part of the token
            perm.append(k + 1 + self.src_layout.index(letter))
        perm.append(k + 1 + len(self.src_layout))
        return np.ascontiguousarray(np.transpose(x, perm)).reshape(*lead, -1)


@dataclasses.dataclass(frozen=True)
class ReadPlan:
    """Everything one local rank does for one request.

    Attributes:
      local_rank, remote_engine: who reads from whom.
      copies: int64 ``[N, 9]`` array, columns `COPY_COLUMNS`, sorted by remote rank; one row is
        one descriptor pair (a property, computed on first use).
      post: `PostProcess` steps to apply after every read finished.
      read_ranks: remote ranks read from.
      notify_ranks: remote ranks to notify once done (every rank of the remote engine, so each
        producer rank knows every consumer rank is finished with the request).
      local_block_ids: local blocks written (to mark invalid on failure).
      remote_block_ids: remote blocks read (after the partial-hit tail cut).
      planner: the `ReadPlanner` that made the plan (its prepared descriptor tables let a
        poster pick this plan's descriptors by index: `ReadPlanner.prepped_indices`).
      expanded: `copies` given up front (a plan made without a planner).
    """

    local_rank: int
    remote_engine: str
    post: tuple[PostProcess, ...]
    read_ranks: tuple[int, ...]
    notify_ranks: tuple[int, ...]
    local_block_ids: np.ndarray
    remote_block_ids: np.ndarray
    planner: ReadPlanner | None = dataclasses.field(default=None, compare=False, repr=False)
    expanded: np.ndarray | None = dataclasses.field(default=None, compare=False, repr=False)

    @functools.cached_property
    def copies(self) -> np.ndarray:
        """int64 ``[N, 9]`` descriptor pairs, columns `COPY_COLUMNS` (computed on first use:
        a read posted from prepared tables never needs them)."""
        if self.expanded is not None:
            return self.expanded
        if self.planner is None or not len(self.local_block_ids):
            return np.zeros((0, 9), np.int64)
        return self.planner.copies(self.local_block_ids, self.remote_block_ids, self._runs)

    @functools.cached_property
    def _runs(self) -> tuple[np.ndarray, np.ndarray] | None:
        """`block_runs` of the ids (both `copies` and `block_share` look at them); None for
        a block-size ratio (no runs: one remote id list per sub-block)."""
        if len(self.remote_block_ids) != len(self.local_block_ids):
            return None
        return block_runs(self.remote_block_ids, self.local_block_ids)

    @functools.cached_property
    def _counts(self) -> tuple[int, int, int]:
        """(descriptors, chunks, bytes): from the per-block form when the rows are one per
        (template, block) (`block_share`: a fragmented request's millions of rows are never
        built to be counted), else from `copies`."""
        share = None if "copies" in self.__dict__ else self._block_form
        if share is not None:
            k = len(share.local_ids)
            t = share.templates
            return len(t) * k, int(t[:, _CNT].sum()) * k, share.num_bytes
        copies = self.copies
        return (int(copies.shape[0]), int(copies[:, _CNT].sum()),
                int((copies[:, _LEN] * copies[:, _CNT]).sum()))

    @property
    def num_descriptors(self) -> int:
        """Rows of `copies` (strided descriptors)."""
        return self._counts[0]

    @property
    def num_chunks(self) -> int:
        """Contiguous chunks the rows of `copies` hold (their counts summed): the plain
        descriptors a transport without strided ones posts."""
        return self._counts[1]

    @property
    def num_bytes(self) -> int:
        return self._counts[2]

    @property
    def notify_only(self) -> bool:
        return not len(self.local_block_ids) or self.num_descriptors == 0

    def block_share(self, remote_rank: int | None) -> BlockShare | None:
        """The rows read from `remote_rank` (None: every rank) in per-block form (see
        `BlockShare`), or None where they are not one row per (template, block): merged runs
        of consecutive ids (few rows), a block-size ratio, a plan without a planner."""
        form = self._block_form
        if form is None or remote_rank is None:
            return form
        first, stop = _rank_rows(form.templates, remote_rank)
        return dataclasses.replace(form, templates=form.templates[first:stop],
                                   remote_block_len=form.remote_block_len[first:stop])

    @functools.cached_property
    def _block_form(self) -> BlockShare | None:
        """`block_share` of every rank, found once per plan."""
        if self.expanded is not None or self.planner is None or not len(self.local_block_ids):
            return None
        return self.planner.block_share(self.local_block_ids, self.remote_block_ids,
                                        self._runs)

    def copies_for(self, remote_rank: int) -> np.ndarray:
        """The rows of `copies` read from `remote_rank`, in their order (a read-only view
        for a planner's plan)."""
        copies = self.copies
        if self.expanded is None and self.planner is not None:
            # A planner's rows are sorted by remote rank (`_expand`): the rank's rows are one
            # slice, found by bisection instead of a mask over millions of rows.
            first, stop = _rank_rows(copies, remote_rank)
            view = copies[first:stop]
            view.flags.writeable = False  # a view of the cached `copies`: not to be written
            return view
        return copies[copies[:, _RR] == remote_rank]

    def descriptors(
        self, local: EngineMetadata, remote: EngineMetadata, remote_rank: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """NIXL strided descriptor arrays ``(local Nx5, remote Nx5)`` of
        ``(address, length, device, stride, count)`` for the reads from `remote_rank`."""
        rows = self.copies_for(remote_rank)
        local_regions = local.rank_info(self.local_rank).regions
        remote_regions = remote.rank_info(remote_rank).regions
        l_base = np.array([r.base_address for r in local_regions], dtype=np.uint64)
        l_dev = np.array([r.device_id for r in local_regions], dtype=np.uint64)
        r_base = np.array([r.base_address for r in remote_regions], dtype=np.uint64)
        r_dev = np.array([r.device_id for r in remote_regions], dtype=np.uint64)
        out_l = np.empty((len(rows), 5), dtype=np.uint64)
        out_r = np.empty((len(rows), 5), dtype=np.uint64)
        out_l[:, 0] = l_base[rows[:, _LG]] + rows[:, _LO].astype(np.uint64)
        out_r[:, 0] = r_base[rows[:, _RG]] + rows[:, _RO].astype(np.uint64)
        out_l[:, 1] = out_r[:, 1] = rows[:, _LEN]
        out_l[:, 2] = l_dev[rows[:, _LG]]
        out_r[:, 2] = r_dev[rows[:, _RG]]
        out_l[:, 3] = rows[:, _LS]
        out_r[:, 3] = rows[:, _RS]
        out_l[:, 4] = out_r[:, 4] = rows[:, _CNT]
        return out_l, out_r

    def expanded_descriptors(
        self, local: EngineMetadata, remote: EngineMetadata, remote_rank: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """Plain ``Nx3`` descriptors ``(address, length, device)``: strided rows expanded.

        Built straight from the rows, column by column (the addresses of `descriptors`, its
        strided rows cut into their chunks): a large fragmented or packed request is
        millions of chunks, so every pass over them counts. Rows with the same count (what
        one geometry gives) expand with one broadcast instead of a repeat per column."""
        rows = self.copies_for(remote_rank)
        counts = rows[:, _CNT]
        n = len(rows)
        uniform = n > 0 and int(counts.min()) == int(counts.max())
        if uniform:
            chunk = int(counts[0])
            total = n * chunk
            within = np.arange(chunk, dtype=np.uint64)
        else:
            index, within = row_chunks(counts)
            total = len(index)
            within = within.astype(np.uint64)
        out = []
        for regions, region_col, offset_col, stride_col in (
            (local.rank_info(self.local_rank).regions, _LG, _LO, _LS),
            (remote.rank_info(remote_rank).regions, _RG, _RO, _RS),
        ):
            base = np.array([r.base_address for r in regions], dtype=np.uint64)
            dev = np.array([r.device_id for r in regions], dtype=np.uint64)
            region = rows[:, region_col]
            start = base[region] + rows[:, offset_col].astype(np.uint64)
            stride = rows[:, stride_col].astype(np.uint64)
            length = rows[:, _LEN].astype(np.uint64)
            device = dev[region]
            side = np.empty((total, 3), dtype=np.uint64)
            if uniform:
                grid = side.reshape(n, chunk, 3)
                grid[:, :, 0] = start[:, None] + within[None, :] * stride[:, None]
                grid[:, :, 1] = length[:, None]
                grid[:, :, 2] = device[:, None]
            else:
                side[:, 0] = start[index] + within * stride[index]
                side[:, 1] = length[index]
                side[:, 2] = device[index]
            out.append(side)
        return out[0], out[1]


def _rank_rows(rows: np.ndarray, remote_rank: int) -> tuple[int, int]:
    """``[first, stop)`` of the rows (or templates) of `remote_rank` in rows sorted by remote
    rank: found by bisection instead of a mask over millions of rows."""
    column = rows[:, _RR]
    first = bisect.bisect_left(column, remote_rank)
    return first, bisect.bisect_right(column, remote_rank, lo=first)


@dataclasses.dataclass(frozen=True)
class BlockShare:
    """Plan rows in per-block form: row ``t * k + b`` (``k = len(local_ids)``; template-major,
    the order of `ReadPlan.copies`) is ``templates[t]`` with ``remote_block_len[t] *
    remote_ids[b]`` added to its remote offset and ``local_block_len * local_ids[b]`` to its
    local one. A fragmented request's rows always have this form: a formatted read cuts,
    describes and scatters them chunk by chunk (`rows`) without building them all.

    Example:
      >>> share = BlockShare(np.array([[0, 0, 8, 0, 0, 4, 1, 4, 4]]), np.array([16]), 32,
      ...                    np.array([2, 5]), np.array([1, 3]))
      >>> share.rows(0, 2)[:, [2, 4]].tolist()  # remote offset, local offset
      [[24, 64], [56, 160]]
    """

    templates: np.ndarray  # int64 [m, 9]: COPY_COLUMNS
    remote_block_len: np.ndarray  # int64 [m]
    local_block_len: int
    local_ids: np.ndarray
    remote_ids: np.ndarray

    @property
    def num_rows(self) -> int:
        return len(self.templates) * len(self.local_ids)

    @property
    def row_bytes(self) -> np.ndarray:
        """Bytes one row of each template moves: int64 ``[m]``."""
        return self.templates[:, _LEN] * self.templates[:, _CNT]

    @property
    def num_bytes(self) -> int:
        return int(self.row_bytes.sum()) * len(self.local_ids)

    def rows(self, first: int, stop: int) -> np.ndarray:
        """Rows ``[first, stop)``, int64 ``[stop - first, 9]`` (`COPY_COLUMNS`)."""
        template, block = np.divmod(np.arange(first, stop, dtype=np.int64),
                                    len(self.local_ids))
        out = self.templates[template]
        out[:, _RO] += self.remote_block_len[template] * self.remote_ids[block]
        out[:, _LO] += np.int64(self.local_block_len) * self.local_ids[block]
        return out


def row_chunks(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per chunk of rows repeated ``counts`` times: (its row, its position within the row).

    Example:
      >>> [a.tolist() for a in row_chunks(np.array([2, 0, 3]))]
      [[0, 0, 2, 2, 2], [0, 1, 0, 1, 2]]
    """
    index = np.repeat(np.arange(len(counts)), counts)
    within = np.arange(len(index)) - np.repeat(np.cumsum(counts) - counts, counts)
    return index, within


def block_runs(remote_ids: np.ndarray, local_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Starts and lengths of runs where both id lists go up by one together."""
    n = len(remote_ids)
    if n == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    breaks = (np.diff(remote_ids) != 1) | (np.diff(local_ids) != 1)
    starts = np.concatenate(([0], np.nonzero(breaks)[0] + 1))
    lengths = np.diff(np.concatenate((starts, [n])))
    return starts.astype(np.int64), lengths.astype(np.int64)


# -- per-side geometry -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Side:
    """Byte geometry of one rank's blocks."""

    meta: EngineMetadata
    rank: int
    tp_rank: int
    pp_rank: int
    layer_start: int
    layer_stop: int
    head_start: int
    heads: int  # heads per rank
    order: str  # "HTD" or "THD" (inner order of a slab)
    slab_nbytes: int
    t_stride: int
    h_stride: int
    block_len: int

    def slab(self, layer: int) -> list[tuple[int, int]]:
        """``(region index, byte offset in the block)`` of each kv slab of a global layer."""
        meta, spec_layout = self.meta, self.meta.layout
        local_layer = layer - self.layer_start
        out = []
        for kv in range(meta.kv_factor):
            offset = 0
            region = None
            for index, info in enumerate(self.meta.rank_info(self.rank).regions):
                if info.layer in (-1, layer) and info.kv in (-1, kv):
                    region = index
                    break
            if region is None:
                raise PlanError(
                    f"rank {self.rank} of {meta.engine_id!r} has no region for "
                    f"layer {layer} kv {kv}"
                )
            # stride of L and K axes inside the block
            sizes = {
                "L": self.layer_stop - self.layer_start,
                "K": meta.kv_factor,
                "H": self.heads,
                "T": meta.block_size,
                "D": meta.head_dim,
            }
            strides = {}
            acc = meta.dtype_itemsize
            for axis in reversed(spec_layout):
                strides[axis] = acc
                acc *= sizes[axis]
            if "L" in spec_layout:
                offset += local_layer * strides["L"]
            if "K" in spec_layout:
                offset += kv * strides["K"]
            out.append((region, offset))
        return out


_SIDE_CACHE: dict[tuple[int, int], _Side] = {}


def _side(meta: EngineMetadata, rank: int) -> _Side:
    """`_build_side`, cached per (metadata object, rank): an engine keeps one metadata object
    per peer and generation, so every read of a peer after the first reuses it."""
    key = (id(meta), rank)
    hit = _SIDE_CACHE.get(key)
    if hit is not None and hit.meta is meta:  # the entry keeps `meta` alive: ids not reused
        return hit
    side = _build_side(meta, rank)
    if len(_SIDE_CACHE) >= _TEMPLATE_CACHE_SIZE:
        _SIDE_CACHE.pop(next(iter(_SIDE_CACHE)), None)
    _SIDE_CACHE[key] = side
    return side


def _build_side(meta: EngineMetadata, rank: int) -> _Side:
    config = meta.config()
    tp_rank, pp_rank = config.coordinates(rank)
    layer_start, layer_stop = config.layer_range(pp_rank)
    head_start, head_stop = config.head_range(tp_rank)
    layout = meta.layout
    inner = [a for a in layout if a in "HT"]
    outer_last = max((layout.index(a) for a in "LK" if a in layout), default=-1)
    inner_first = min(layout.index(a) for a in inner)
    if outer_last > inner_first:
        raise PlanError(
            f"engine {meta.engine_id!r}: layout {layout} interleaves L/K with H/T; the planner "
            "needs the per-(layer, kv) slab [H, T, D] contiguous inside a block"
        )
    order = "HTD" if inner[0] == "H" else "THD"
    heads = head_stop - head_start
    item = meta.dtype_itemsize
    d, t = meta.head_dim, meta.block_size
    if order == "HTD":
        t_stride, h_stride = d * item, t * d * item
    else:
        t_stride, h_stride = heads * d * item, d * item
    return _Side(
        meta=meta,
        rank=rank,
        tp_rank=tp_rank,
        pp_rank=pp_rank,
        layer_start=layer_start,
        layer_stop=layer_stop,
        head_start=head_start,
        heads=heads,
        order=order,
        slab_nbytes=heads * t * d * item,
        t_stride=t_stride,
        h_stride=h_stride,
        block_len=config.local_spec(pp_rank).block_nbytes(config.tp_size),
    )


def _source_ranks(
    local: _Side | _RowSide, remote_meta: EngineMetadata, layer: int
) -> list[tuple[int, int]]:
    """For each local head of `layer`: ``(remote rank, remote head start)``."""
    config = remote_meta.config()
    pp = config.layer_owner(layer)
    out = []
    for h in range(local.head_start, local.head_start + local.heads):
        candidates = [
            tp
            for tp in range(config.tp_size)
            if config.head_range(tp)[0] <= h < config.head_range(tp)[1]
        ]
        tp = candidates[local.tp_rank % len(candidates)]
        out.append((config.rank(tp, pp), config.head_range(tp)[0]))
    return out


def _direct_pattern(
    n: int, t: int, item_d: int, rem: _Side, loc: _Side | _Staging
) -> tuple[int, int, int, int] | None:
    """``(length, count, remote_stride, local_stride)`` copying an ``n``-head run in place, or
    None when it is not one strided descriptor."""
    dims = {"h": (n, rem.h_stride, loc.h_stride), "t": (t, rem.t_stride, loc.t_stride)}
    for outer, inner in (("h", "t"), ("t", "h")):
        chunk = item_d
        size_i, rs_i, ls_i = dims[inner]
        if size_i > 1:
            if rs_i != chunk or ls_i != chunk:
                continue
            chunk *= size_i
        size_o, rs_o, ls_o = dims[outer]
        if size_o == 1 or (rs_o == chunk and ls_o == chunk):
            return chunk * size_o, 1, chunk * size_o, chunk * size_o
        return chunk, size_o, rs_o, ls_o
    return None


def plan_read(
    local: EngineMetadata,
    local_rank: int,
    remote: EngineMetadata,
    local_block_ids: Sequence[int] | np.ndarray,
    remote_block_ids: Sequence[int] | np.ndarray,
    check: bool = True,
    layers: tuple[int, int] | None = None,
) -> ReadPlan:
    """Plans the reads of one local rank for one request.

    Args:
      local, remote: the two engines' metadata (`local` needs at least `local_rank`, `remote`
        every rank this rank reads from).
      local_rank: the reading rank.
      local_block_ids: local blocks (local block size) to fill, in token order; fewer than the
        remote blocks cover means a partial prefix hit (only the tail is read); empty means
        notify only.
      remote_block_ids: the request's blocks on the remote engine (remote block size), all of
        them, in token order.
      check: run `check_compatible` first.
      layers: only the global layers ``[start, stop)`` (layer-wise reads); the descriptors
        are a subset of the whole request's, `post` lists the steps of the arrays touched.

    Raises:
      IncompatibleEngineError: from `check_compatible`.
      PlanError: ids out of range (before anything is posted), more local blocks than the
        remote ones cover, or an unsupported layout.
    """
    if check:
        check_compatible(local, remote)
    return read_planner(local, local_rank, remote, layers).plan(local_block_ids, remote_block_ids)


@dataclasses.dataclass(frozen=True)
class _Templates:
    """Per-block copy patterns of one (local rank, remote engine) pair: they depend only on
    the geometry, not on addresses or ids, so they are cached."""

    rows: np.ndarray  # int64 [N, 10]: COPY_COLUMNS + sub-block index; sorted by remote rank
    remote_block_len: np.ndarray  # per row
    local_block_len: int
    read_ranks: tuple[int, ...]
    post: tuple[dict, ...]

    @functools.cached_property
    def expansion(self) -> _Expansion:
        """Per-template coefficients of `_expand` (cached with the templates: they depend on
        the geometry only)."""
        return _expansion(self)


_TEMPLATE_CACHE: dict[tuple, _Templates] = {}
_TEMPLATE_CACHE_SIZE = 256


def _geometry_key(meta: EngineMetadata) -> tuple:
    return (
        meta.tp_size,
        meta.pp_size,
        tuple(meta.layers_per_pp),
        meta.num_layers,
        meta.num_kv_heads,
        meta.head_dim,
        meta.kv_factor,
        meta.mla,
        meta.dtype,
        meta.layout,
        meta.block_size,
        meta.kv_interleaved,
        meta.packing,
        meta.packed_axis,
        meta.stored_head_dim,
    )


def _templates(
    local: EngineMetadata,
    local_rank: int,
    remote: EngineMetadata,
    layers: tuple[int, int] | None = None,
) -> _Templates:
    key = (_geometry_key(local), local_rank, _geometry_key(remote), layers)
    cached = _TEMPLATE_CACHE.get(key)
    if cached is None:
        if local.padded or remote.padded:
            cached = _build_row_templates(local, local_rank, remote, layers)
        else:
            cached = _build_templates(local, local_rank, remote, layers)
        if len(_TEMPLATE_CACHE) >= _TEMPLATE_CACHE_SIZE:
            _TEMPLATE_CACHE.pop(next(iter(_TEMPLATE_CACHE)))
        _TEMPLATE_CACHE[key] = cached
    return cached


def _staging_layout(local_layout: str, remote_order: str) -> str:
    """The local layout with its H/T letters in the sender's order (`remote_order`)."""
    inner = [c for c in remote_order[:2] if c in local_layout]
    letters = iter(inner)
    return "".join(next(letters) if c in "HT" else c for c in local_layout)


@dataclasses.dataclass(frozen=True)
class _Staging:
    """Strides of a run inside a staging slab (``[H_local, n, D]`` or ``[n, H_local, D]``)."""

    h_stride: int
    t_stride: int


def _build_templates(
    local: EngineMetadata,
    local_rank: int,
    remote: EngineMetadata,
    layers: tuple[int, int] | None = None,
) -> _Templates:
    loc = _side(local, local_rank)
    first, stop = loc.layer_start, loc.layer_stop
    if layers is not None:
        first, stop = max(first, layers[0]), min(stop, layers[1])
    ratio = local.block_size // remote.block_size
    item = local.dtype_itemsize
    d = local.head_dim
    t_local, t_remote = local.block_size, remote.block_size
    templates: list[tuple[int, ...]] = []  # (rr, rg, r_off, lg, l_off, len, cnt, rs, ls, sub)
    post_regions: dict[int, str] = {}  # local region -> sender's H/T order (staged)
    remote_sides: dict[int, _Side] = {}
    sub_len = loc.block_len // ratio  # one sender-sized sub-block of a staged local block
    directs = set()
    for layer in range(first, stop):
        sources = _source_ranks(loc, remote, layer)
        runs: list[
            tuple[int, int, int, int]
        ] = []  # (remote rank, local head idx, n, remote head idx)
        for i, (rr, rh0) in enumerate(sources):
            h = loc.head_start + i
            if (
                runs
                and runs[-1][0] == rr
                and runs[-1][1] + runs[-1][2] == i
                and (runs[-1][3] + runs[-1][2] == h - rh0)
            ):
                runs[-1] = (rr, runs[-1][1], runs[-1][2] + 1, runs[-1][3])
            else:
                runs.append((rr, i, 1, h - rh0))
        local_slabs = loc.slab(layer)
        for rr, _, _, _ in runs:
            if rr not in remote_sides:
                remote_sides[rr] = _side(remote, rr)
        direct = ratio == 1 and all(
            _direct_pattern(n, t_local, item * d, remote_sides[rr], loc) is not None
            for rr, _, n, _ in runs
        )
        directs.add(direct)
        for kv, (lg, l_slab) in enumerate(local_slabs):
            for rr, li, n, ri in runs:
                rem = remote_sides[rr]
                rg, r_slab = rem.slab(layer)[kv]
                r_off = r_slab + ri * rem.h_stride
                if direct:
                    pattern = _direct_pattern(n, t_local, item * d, rem, loc)
                    assert pattern is not None  # `direct` checked every run above
                    length, count, rs, ls = pattern
                    templates.append(
                        (rr, rg, r_off, lg, l_slab + li * loc.h_stride, length, count, rs, ls, 0)
                    )
                    continue
                # Staged: the block is read as `ratio` sender-sized sub-blocks, each in the
                # local layout with the sender's H/T order ([ratio, *src_layout]), then
                # rearranged in place by permute_blocks / merge_blocks.
                post_regions[lg] = rem.order
                if rem.order == "HTD":
                    stage = _Staging(h_stride=t_remote * d * item, t_stride=d * item)
                else:
                    stage = _Staging(h_stride=d * item, t_stride=loc.heads * d * item)
                pattern = _direct_pattern(n, t_remote, item * d, rem, stage)
                assert pattern is not None  # same order on both sides
                # L/K are outer axes: a slab's offset scales with the tokens per block.
                s_off = l_slab // ratio + li * stage.h_stride
                for j in range(ratio):
                    templates.append((rr, rg, r_off, lg, j * sub_len + s_off, *pattern, j))
    if len(directs) > 1:
        raise PlanError("layers of one rank need different read patterns")
    rows = _coalesce_templates(np.array(templates, dtype=np.int64).reshape(-1, 10))
    rows = rows[np.argsort(rows[:, _RR], kind="stable")]
    rbl = np.array([remote_sides[int(r)].block_len for r in rows[:, _RR]], dtype=np.int64)
    sizes = {
        "L": loc.layer_stop - loc.layer_start,
        "K": local.kv_factor,
        "H": loc.heads,
        "T": t_local,
        "D": d,
    }
    post = []
    for lg, recv_order in sorted(post_regions.items()):
        src_layout = _staging_layout(local.layout, recv_order)
        permuted = src_layout != local.layout
        if not permuted and local.layout[0] == "T":
            # Tokens outermost in the block (no layer / K slabs): the sender-sized sub-blocks
            # staged one after another are already the merged block; nothing to rewrite.
            continue
        kind = "merge" if not permuted else ("permute" if ratio == 1 else "merge_permute")
        post.append(
            dict(
                kind=kind,
                region=lg,
                ratio=ratio,
                src_layout=src_layout,
                dst_layout=local.layout,
                block_shape=tuple(sizes[a] for a in local.layout),
                itemsize=item,
            )
        )
    return _Templates(rows, rbl, loc.block_len, tuple(sorted(remote_sides)), tuple(post))


# -- padded storage (packed / interleaved / head-dim-aligned caches): value rows ------------
#
# A block of such a cache stores padding (phantom heads or tokens, head-dim lanes past
# `head_dim`) and may interleave K and V on the head axis, so a run of heads is not a run of
# bytes. The planner then works on *value rows*: the `head_dim` values of one (layer, kv,
# head, token), contiguous on every layout (D is innermost and its padding trails it). Each
# local row is matched with its remote row (TP / PP owner, sender block and token inside it)
# and read straight into its final place: no padding byte is read or written, no rearranging
# step follows. Rows adjacent on both sides coalesce into one descriptor, runs of equal length
# at constant strides on both sides into one strided descriptor (whichever of four orders
# yields the fewest), so an unpadded pair coalesces to the runs the slab planner makes.


@dataclasses.dataclass(frozen=True)
class _RowSide:
    """Byte geometry of one rank's blocks, value row by value row."""

    meta: EngineMetadata
    rank: int
    tp_rank: int
    pp_rank: int
    layer_start: int
    layer_stop: int
    head_start: int
    heads: int  # KV heads per rank (not the combined K/V heads)
    block_len: int
    axes: tuple[str, ...]  # stored block axes (`KVCacheSpec.block_axes`)
    strides: tuple[int, ...]  # byte stride of each stored axis
    interleaved: bool
    packing: int | None
    packed_axis: str
    region_of: np.ndarray  # int64 [local layers, kv_factor]: region index of a row

    def rows(
        self, layer: np.ndarray, kv: np.ndarray, head: np.ndarray, token: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """``(region, byte offset in the block)`` of the value rows of (global layer, kv,
        rank-local head, token), elementwise (int64 arrays of one shape)."""
        local_layer = layer - self.layer_start
        index = {
            "L": local_layer,
            "K": kv,
            "H": 2 * head + kv if self.interleaved else head,
            "T": token,
        }
        if self.packing is not None:
            entry = index[self.packed_axis]
            index[self.packed_axis], index[self.packed_axis.lower()] = np.divmod(
                entry, self.packing
            )
        offset = np.zeros(np.shape(layer), np.int64)
        for axis, stride in zip(self.axes, self.strides):
            if axis != "D":
                offset += index[axis] * stride
        return self.region_of[local_layer, kv], offset


def _row_side(meta: EngineMetadata, rank: int) -> _RowSide:
    config = meta.config()
    tp_rank, pp_rank = config.coordinates(rank)
    layer_start, layer_stop = config.layer_range(pp_rank)
    head_start, head_stop = config.head_range(tp_rank)
    spec = config.local_spec(pp_rank)
    shape = spec.block_shape(config.tp_size)
    item = spec.itemsize
    strides = [item * int(np.prod(shape[i + 1:], dtype=np.int64)) for i in range(len(shape))]
    region_of = np.full((layer_stop - layer_start, spec.kv_factor), -1, np.int64)
    for index, (layer, kv) in enumerate(spec.array_keys()):
        region_of[slice(None) if layer is None else layer,
                  slice(None) if kv is None else kv] = index
    if (region_of < 0).any():  # array_keys cover every (layer, kv): a broken spec
        raise PlanError(f"engine {meta.engine_id!r}: a (layer, kv) without a cache array")
    regions = meta.rank_info(rank).regions
    if len(regions) != spec.num_arrays:
        raise PlanError(
            f"rank {rank} of {meta.engine_id!r} publishes {len(regions)} regions, its layout "
            f"needs {spec.num_arrays}"
        )
    return _RowSide(
        meta=meta,
        rank=rank,
        tp_rank=tp_rank,
        pp_rank=pp_rank,
        layer_start=layer_start,
        layer_stop=layer_stop,
        head_start=head_start,
        heads=head_stop - head_start,
        block_len=spec.block_nbytes(config.tp_size),
        axes=spec.block_axes(),
        strides=tuple(strides),
        interleaved=spec.kv_interleaved,
        packing=spec.packing,
        packed_axis=spec.packed_axis,
        region_of=region_of,
    )


def _build_row_templates(
    local: EngineMetadata,
    local_rank: int,
    remote: EngineMetadata,
    layers: tuple[int, int] | None = None,
) -> _Templates:
    """`_Templates` for a pair where either side stores padding: one descriptor per
    coalesced run of value rows, every row read into its final place (no `post`)."""
    loc = _row_side(local, local_rank)
    first, stop = loc.layer_start, loc.layer_stop
    if layers is not None:
        first, stop = max(first, layers[0]), min(stop, layers[1])
    if local.block_size % remote.block_size:  # check_compatible refuses it first
        raise PlanError(
            f"block size {local.block_size} is not a multiple of the remote {remote.block_size}"
        )
    t_local, t_remote = local.block_size, remote.block_size
    row_len = local.head_dim * local.dtype_itemsize
    # Every local value row: [layers, kv, heads, tokens] flattened.
    grid = np.meshgrid(
        np.arange(first, stop, dtype=np.int64),
        np.arange(local.kv_factor, dtype=np.int64),
        np.arange(loc.heads, dtype=np.int64),
        np.arange(t_local, dtype=np.int64),
        indexing="ij",
    )
    layer, kv, head, token = (g.reshape(-1) for g in grid)
    if not len(layer):
        return _Templates(np.zeros((0, 10), np.int64), np.zeros(0, np.int64), loc.block_len,
                          (), ())
    lg, lo = loc.rows(layer, kv, head, token)
    # The remote rank of each (layer, local head), and the head's index on that rank.
    source_rank = np.empty((stop - first, loc.heads), np.int64)
    source_head = np.empty((stop - first, loc.heads), np.int64)
    for i, lay in enumerate(range(first, stop)):
        for h, (rr, rh0) in enumerate(_source_ranks(loc, remote, lay)):
            source_rank[i, h] = rr
            source_head[i, h] = loc.head_start + h - rh0
    rr_rows = source_rank[layer - first, head]
    rh_rows = source_head[layer - first, head]
    sub, r_token = np.divmod(token, t_remote)
    rg = np.empty_like(lg)
    ro = np.empty_like(lo)
    remote_sides: dict[int, _RowSide] = {}
    for rr in np.unique(rr_rows).tolist():
        side = remote_sides[rr] = _row_side(remote, rr)
        sel = rr_rows == rr
        rg[sel], ro[sel] = side.rows(layer[sel], kv[sel], rh_rows[sel], r_token[sel])
    # Every row inside its block on both sides (the strides come from the stored shapes, so
    # this holds by construction; checked because a wrong offset would write another block).
    r_len = np.zeros_like(ro)
    for rr, side in remote_sides.items():
        r_len[rr_rows == rr] = side.block_len
    if (lo + row_len > loc.block_len).any() or (ro + row_len > r_len).any() or (
        (lo < 0).any() or (ro < 0).any()
    ):
        raise PlanError(
            f"value rows of {local.engine_id!r} rank {local_rank} fall outside a block "
            f"(stored layouts {local.stored_layout} / {remote.stored_layout}): not planned"
        )
    # (layer, kv, head, token) of each row: tie-breakers of the coalescing orders.
    rows = _coalesce_rows(rr_rows, rg, ro, lg, lo, sub, row_len,
                          np.stack([layer, kv, head, token], axis=1))
    rows = rows[np.argsort(rows[:, _RR], kind="stable")]
    rbl = np.array([remote_sides[int(r)].block_len for r in rows[:, _RR]], dtype=np.int64)
    return _Templates(rows, rbl, loc.block_len, tuple(sorted(remote_sides)), ())


def _coalesce_rows(
    rr: np.ndarray,
    rg: np.ndarray,
    ro: np.ndarray,
    lg: np.ndarray,
    lo: np.ndarray,
    sub: np.ndarray,
    row_len: int,
    coords: np.ndarray,
) -> np.ndarray:
    """Template rows (`COPY_COLUMNS` + sub-block) for value rows of `row_len` bytes: rows
    adjacent on both sides merged, then equal runs at constant strides on both sides
    grouped into strided descriptors, in whichever order makes the fewest."""
    # 1. Contiguous runs: in local order, a row continues the previous one when both its
    # offsets follow the previous row's on both sides (same remote rank, regions, sub-block).
    order = np.lexsort((lo, lg, rg, rr, sub))
    key = np.stack([sub, rr, rg, lg], axis=1)[order]
    r_off, l_off = ro[order], lo[order]
    cont = np.ones(len(order), bool)
    cont[0] = False
    cont[1:] = (
        (key[1:] == key[:-1]).all(axis=1)
        & (r_off[1:] - r_off[:-1] == row_len)
        & (l_off[1:] - l_off[:-1] == row_len)
    )
    starts = np.flatnonzero(~cont)
    lengths = np.diff(np.append(starts, len(order))) * row_len
    run_key, run_r, run_l = key[starts], r_off[starts], l_off[starts]
    run_coords = coords[order][starts]
    # 2. Strided groups: try four orders of the runs (local bytes, remote bytes, head-major,
    # token-major) and keep the one with the fewest descriptors.
    base = [run_key[:, 3], run_key[:, 2], run_key[:, 1], run_key[:, 0]]  # lexsort: last first
    layer_, kv_, head_, token_ = (run_coords[:, i] for i in range(4))
    candidates = [
        np.lexsort((run_l, lengths, *base)),
        np.lexsort((run_r, lengths, *base)),
        np.lexsort((token_, head_, kv_, layer_, lengths, *base)),
        np.lexsort((head_, token_, kv_, layer_, lengths, *base)),
    ]
    best: list[tuple[int, ...]] | None = None
    for perm in candidates:
        groups = _stride_groups(run_key[perm], run_r[perm], run_l[perm], lengths[perm])
        if best is None or len(groups) < len(best):
            best = groups
    assert best is not None
    return np.array(best, dtype=np.int64).reshape(-1, 10)


def _stride_groups(
    key: np.ndarray, r_off: np.ndarray, l_off: np.ndarray, lengths: np.ndarray
) -> list[tuple[int, ...]]:
    """Greedy grouping of consecutive runs (same key and length) whose offsets advance by
    the same positive, non-overlapping strides on both sides; one template row per group."""
    keys = [tuple(k) for k in key.tolist()]
    rs, ls, ns = r_off.tolist(), l_off.tolist(), lengths.tolist()
    out: list[tuple[int, ...]] = []
    i, total = 0, len(ns)
    while i < total:
        k, n = keys[i], ns[i]
        j = i + 1
        count = 1
        r_stride = l_stride = n
        if j < total and keys[j] == k and ns[j] == n:
            dr, dl = rs[j] - rs[i], ls[j] - ls[i]
            if dr >= n and dl >= n:
                r_stride, l_stride = dr, dl
                while (
                    j < total
                    and keys[j] == k
                    and ns[j] == n
                    and rs[j] - rs[j - 1] == dr
                    and ls[j] - ls[j - 1] == dl
                ):
                    j += 1
                count = j - i
        sub, rr, rg, lg = k
        if count > 1 and r_stride == n and l_stride == n:  # dense on both sides: one chunk
            out.append((rr, rg, rs[i], lg, ls[i], n * count, 1, n * count, n * count, sub))
        else:
            out.append((rr, rg, rs[i], lg, ls[i], n, count, r_stride, l_stride, sub))
        i += count
    return out


def _coalesce_templates(rows: np.ndarray) -> np.ndarray:
    """Merges plain templates that are adjacent on both sides (e.g. the per-layer slabs of a
    cross-layer block read whole), so a block read whole is one template."""
    if len(rows) < 2:
        return rows
    order = np.lexsort(
        (rows[:, _LO], rows[:, _RO], rows[:, _LG], rows[:, _RG], rows[:, _RR], rows[:, 9])
    )
    merged: list[list[int]] = []
    for row in rows[order].tolist():
        if merged:
            last = merged[-1]
            if (
                row[_CNT] == 1
                and last[_CNT] == 1
                and row[9] == last[9]
                and row[_RR] == last[_RR]
                and row[_RG] == last[_RG]
                and row[_LG] == last[_LG]
                and last[_RO] + last[_LEN] == row[_RO]
                and last[_LO] + last[_LEN] == row[_LO]
            ):
                last[_LEN] += row[_LEN]
                last[_RS] = last[_LS] = last[_LEN]
                continue
        merged.append(list(row))
    return np.array(merged, dtype=np.int64)


def _check_ids(ids: np.ndarray, num_blocks: int, where: str) -> None:
    if len(ids) and (ids.min() < 0 or ids.max() >= num_blocks):
        bad = ids[(ids < 0) | (ids >= num_blocks)]
        raise PlanError(
            f"block ids {bad[:8].tolist()} are outside the {num_blocks} blocks registered by "
            f"{where}"
        )


def _expand(
    tpl: _Templates, local_ids: np.ndarray, remote_ids: np.ndarray, ratio: int,
    runs: tuple[np.ndarray, np.ndarray] | None = None,
) -> np.ndarray:
    """Instantiates the per-block templates over the request's blocks, merging runs of
    consecutive ids into one (strided) descriptor where the pattern allows it. Rows keep the
    templates' order (grouped by remote rank), then the blocks' (or runs') order.

    Every output row is affine in its block: ``const[t] + per_block[t] * n + (rbl[t] * r at
    the remote offset, lbl * l at the local one)`` for template ``t`` and a run of ``n``
    blocks starting at remote id ``r`` and local id ``l`` (`_Expansion`), so each group of
    templates sharing a remote block length is written with one broadcast numpy pass over
    the ``[templates, runs, 9]`` output: a fragmented 128k-token request of an 80-layer model
    is millions of rows, and every extra pass over them costs tens of milliseconds.
    """
    templates, lbl = tpl.rows, np.int64(tpl.local_block_len)
    if templates.size == 0:
        return np.zeros((0, 9), np.int64)
    if ratio != 1:
        return _expand_sub_blocks(tpl, local_ids, remote_ids, ratio)
    starts, lengths = runs if runs is not None else block_runs(remote_ids, local_ids)
    coef = tpl.expansion
    one_block = _per_block_templates(coef, len(starts), len(local_ids))
    ones = one_block is not None  # the common fragmented case: one row per block, one pass
    if one_block is not None:
        r_at, l_at, const = remote_ids, local_ids, one_block
    else:  # every template merges over runs: one (strided or longer) row per run
        r_at, l_at, n_at = remote_ids[starts], local_ids[starts], lengths
        const, per_block = coef.const, coef.per_block
    m, k = len(templates), len(r_at)
    rows = np.empty((m, k, 9), np.int64)
    offsets = np.zeros((k, 9), np.int64)
    offsets[:, _LO] = lbl * l_at
    for first, stop, rbl in coef.groups:
        offsets[:, _RO] = np.int64(rbl) * r_at
        out = rows[first:stop]
        if ones:
            np.add(const[first:stop, None, :], offsets[None, :, :], out=out)
        else:
            np.multiply(per_block[first:stop, None, :], n_at[None, :, None], out=out)
            out += const[first:stop, None, :]
            out += offsets[None, :, :]
    return rows.reshape(-1, 9)


def _per_block_templates(coef: _Expansion, num_runs: int, num_blocks: int) -> np.ndarray | None:
    """The templates a request's rows instantiate once per block (int64 ``[m, 9]``), or None
    where every template merges over runs of consecutive ids (a row per run instead). Runs
    of one block everywhere (no two ids consecutive on both sides): each template's merged
    form for one block; some template that cannot merge: every template as it is."""
    if num_runs == num_blocks:
        return coef.one_block
    return None if coef.all_mergeable else coef.plain


def _expand_sub_blocks(
    tpl: _Templates, local_ids: np.ndarray, remote_ids: np.ndarray, ratio: int
) -> np.ndarray:
    """`_expand` of a block-size ratio: local block ``i`` is read from remote blocks
    ``i * ratio + j`` by the templates of sub-block ``j``; no runs merge. Rows are ordered by
    remote rank, then sub-block, then template, then block: the order of instantiating each
    sub-block's templates over its blocks and stable-sorting the rows by remote rank, built
    in place (no sort of millions of rows)."""
    templates, rbl, lbl = tpl.rows, tpl.remote_block_len, np.int64(tpl.local_block_len)
    n_local = len(local_ids)
    per_sub = []
    for j in range(ratio):
        idx = np.arange(n_local) * ratio + j
        ok = idx < len(remote_ids)
        per_sub.append((local_ids[ok], remote_ids[idx[ok]]))
    pieces = []
    total = 0
    for first, stop, _ in tpl.expansion.groups:
        sub = templates[first:stop, 9]
        for j, (lids, rids) in enumerate(per_sub):
            sel = np.flatnonzero(sub == j) + first
            if len(sel) and len(lids):
                pieces.append((sel, lids, rids, total))
                total += len(sel) * len(lids)
    rows = np.empty((total, 9), np.int64)
    for sel, lids, rids, at in pieces:
        offsets = np.zeros((len(lids), 9), np.int64)
        offsets[:, _RO] = rbl[sel[0]] * rids  # one remote rank: one remote block length
        offsets[:, _LO] = lbl * lids
        out = rows[at : at + len(sel) * len(lids)].reshape(len(sel), len(lids), 9)
        np.add(templates[sel, None, :9], offsets[None, :, :], out=out)
    return rows


@dataclasses.dataclass(frozen=True)
class _Expansion:
    """What `_expand` needs of a `_Templates` besides the ids, derived once per templates.

    Row ``t`` of a request expands to ``const[t] + per_block[t] * n`` plus the block offsets,
    ``n`` the blocks of the run; `const` / `per_block` give the merged form (a run of ``n``
    blocks as one descriptor: a dense template grows its length, a strided or partial one its
    count), `plain` / `zero` the template as it is (one row per block).
    """

    const: np.ndarray  # int64 [m, 9]
    per_block: np.ndarray  # int64 [m, 9]: nonzero only in LEN / CNT / RS / LS
    plain: np.ndarray  # int64 [m, 9]: the templates' own columns
    one_block: np.ndarray  # int64 [m, 9]: rows of runs of one block (`_per_block_templates`)
    any_mergeable: bool
    all_mergeable: bool
    groups: tuple[tuple[int, int, int], ...]  # (first, stop, remote block len): one per rank


def _expansion(tpl: _Templates) -> _Expansion:
    t = tpl.rows
    rbl, lbl = tpl.remote_block_len, np.int64(tpl.local_block_len)
    cnt, rs, ls, length = t[:, _CNT], t[:, _RS], t[:, _LS], t[:, _LEN]
    # A template merges over consecutive blocks when it is one chunk, or its chunks tile the
    # whole block on both sides (the next block's chunks continue at the same strides).
    mergeable = (cnt == 1) | ((cnt * rs == rbl) & (cnt * ls == lbl))
    single = cnt == 1
    rs_run = np.where(single, rbl, rs)  # a single chunk repeats once per block
    ls_run = np.where(single, lbl, ls)
    dense = (length == rs_run) & (length == ls_run)  # chunks back to back: one longer chunk
    plain = np.ascontiguousarray(t[:, :9])
    const = plain.copy()
    per_block = np.zeros_like(plain)
    const[:, _CNT] = np.where(dense, 1, 0)
    per_block[:, _CNT] = np.where(dense, 0, cnt)
    # Dense: one chunk of `length * cnt` bytes per block, its strides its length (as the
    # planner always wrote them). Otherwise: `cnt` chunks per block at the run strides.
    for column, sparse in ((_LEN, length), (_RS, rs_run), (_LS, ls_run)):
        const[:, column] = np.where(dense, 0, sparse)
        per_block[:, column] = np.where(dense, length * cnt, 0)
    # Rows are sorted by remote rank and one rank has one block length: one group per rank
    # read (few, long groups; `_expand_sub_blocks` relies on a group being one rank).
    change = np.flatnonzero((np.diff(t[:, _RR]) != 0) | (np.diff(rbl) != 0)) + 1
    bounds = np.concatenate(([0], change, [len(t)])).tolist()
    groups = tuple(
        (int(a), int(b), int(rbl[a])) for a, b in zip(bounds[:-1], bounds[1:]) if b > a
    )
    return _Expansion(
        const=const,
        per_block=per_block,
        plain=plain,
        # as `_expand` has always written them: the merged forms where any template merges
        one_block=const + per_block if mergeable.any() else plain,
        any_mergeable=bool(mergeable.any()),
        all_mergeable=bool(mergeable.all()),
        groups=groups,
    )


# -- planners: everything but the ids resolved once per (local, rank, remote) ---------------

_SMALL = 64  # ids checked as Python ints up to this many

PREP_MAX_ENTRIES = 1 << 18
"""Most descriptors one side of a prepared table may hold (`ReadPlanner.block_table`): one
per (block, per-block chunk) of the whole registered cache. Preparing is paid by the first
read of a (planner, remote rank): ~50 ms per side for 2**18 rows on the 2-core CPU VM. Larger
caches are read with descriptors built per request."""

PREPPED_MAX_BYTES = 8 << 20
"""Requests up to this size are posted from the prepared tables (one descriptor per block
and chunk) even when runs of consecutive blocks could merge their descriptors: below it the
per-request cost dominates, above it fewer, larger descriptors do."""


class ReadPlanner:
    """Plans one local rank's reads from one remote engine, with everything that does not
    depend on the request (geometry, templates, region addresses, id bounds, post-processing
    steps) resolved once.

    A planner belongs to two metadata objects: a re-registration on either side publishes
    new metadata (a new generation) and so gets a new planner (`read_planner` never hands out
    one made for other metadata objects); nothing cached outlives the addresses it was made
    from.

    Args:
      local, remote: the two engines' metadata.
      local_rank: the reading rank.
      layers: only the global layers ``[start, stop)`` (layer-wise reads).

    Raises:
      PlanError: an unsupported layout.

    Example:
      >>> planner = read_planner(local_meta, 0, remote_meta)  # doctest: +SKIP
      >>> plan = planner.plan([7, 8], [3, 4])  # doctest: +SKIP
    """

    def __init__(
        self,
        local: EngineMetadata,
        local_rank: int,
        remote: EngineMetadata,
        layers: tuple[int, int] | None = None,
    ):
        self.local, self.remote = local, remote
        self.local_rank, self.layers = local_rank, layers
        self.generations = (local.generation, remote.generation)
        self.ratio = local.block_size // remote.block_size
        if local.padded or remote.padded:
            _row_side(local, local_rank)  # checks the local rank
        else:
            _side(local, local_rank)  # checks the local layout
        regions = local.rank_info(local_rank).regions
        self._local_regions = regions
        self._local_blocks = regions[0].num_blocks
        self._notify = tuple(range(remote.world_size))
        self._tpl_cache: _Templates | None = None  # built by the first request reading data
        self._remote_blocks_cache: dict[int, int] = {}
        self._remote_blocks_min = 0
        self._post: tuple[tuple[dict, int], ...] = ()
        self._tables: dict[int, _PrepTable | None] = {}

    def plan(
        self,
        local_block_ids: Sequence[int] | np.ndarray,
        remote_block_ids: Sequence[int] | np.ndarray,
    ) -> ReadPlan:
        """The `ReadPlan` of one request (what `plan_read` returns; arguments as there).

        Raises:
          PlanError: ids out of range, repeated local ids, or more local blocks than the
            remote ones cover.
        """
        local_ids = np.asarray(local_block_ids, dtype=np.int64).reshape(-1)
        remote_all = np.asarray(remote_block_ids, dtype=np.int64).reshape(-1)
        ratio = self.ratio
        n_local_total = -(-len(remote_all) // ratio)
        hit = n_local_total - len(local_ids)
        if hit < 0:
            raise PlanError(
                f"{len(local_ids)} local blocks but the {len(remote_all)} remote blocks of "
                f"block size {self.remote.block_size} fill only {n_local_total} local blocks "
                f"of {self.local.block_size}"
            )
        remote_ids = remote_all[hit * ratio :]
        listed = local_ids.tolist()
        if listed and (min(listed) < 0 or max(listed) >= self._local_blocks):
            _check_ids(local_ids, self._local_blocks, f"local rank {self.local_rank}")
        if len(listed) != len(set(listed)):
            raise PlanError("local block ids repeat")
        engine = self.remote.engine_id
        if not listed:
            return ReadPlan(
                self.local_rank, engine, (), (), self._notify, local_ids, remote_ids, self
            )
        tpl = self._tpl
        # Small requests are checked on Python ints: fewer numpy calls, each of which costs
        # ~10x more right after the process waited (cold caches) than in a hot loop.
        bounds = remote_ids.tolist() if len(remote_ids) <= _SMALL else remote_ids
        if len(remote_ids) and (min(bounds) < 0 or max(bounds) >= self._remote_blocks_min):
            for rr, num_blocks in self._remote_blocks_cache.items():
                _check_ids(remote_ids, num_blocks, f"remote rank {rr}")
        post = tuple(
            PostProcess(**fields, array_index=array_index, block_ids=local_ids)
            for fields, array_index in self._post
        )
        return ReadPlan(
            self.local_rank, engine, post, tpl.read_ranks, self._notify, local_ids, remote_ids,
            self,
        )

    def copies(self, local_ids: np.ndarray, remote_ids: np.ndarray,
               runs: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
        """`ReadPlan.copies` of a request's (validated) ids (`runs`: their `block_runs`,
        if known)."""
        return _expand(self._tpl, local_ids, remote_ids, self.ratio, runs)

    def block_share(self, local_ids: np.ndarray, remote_ids: np.ndarray,
                    runs: tuple[np.ndarray, np.ndarray] | None = None) -> BlockShare | None:
        """`ReadPlan.block_share` of a request's (validated) ids, every rank: the templates
        `_expand` instantiates once per block, where it does (no run of consecutive ids
        merged)."""
        if self.ratio != 1 or not len(local_ids):
            return None
        tpl = self._tpl
        starts, _ = runs if runs is not None else block_runs(remote_ids, local_ids)
        templates = _per_block_templates(tpl.expansion, len(starts), len(local_ids))
        if templates is None:
            return None  # runs merge into one row each: few rows, no per-block form
        return BlockShare(templates, tpl.remote_block_len, int(tpl.local_block_len),
                          local_ids, remote_ids)

    @property
    def _tpl(self) -> _Templates:
        if self._tpl_cache is None:
            tpl = _templates(self.local, self.local_rank, self.remote, self.layers)
            self._remote_blocks_cache = {
                rr: self.remote.rank_info(rr).regions[0].num_blocks for rr in tpl.read_ranks
            }
            self._remote_blocks_min = min(self._remote_blocks_cache.values(), default=0)
            regions = self._local_regions
            self._post = tuple((f, regions[f["region"]].array_index) for f in tpl.post)
            self._tpl_cache = tpl
        return self._tpl_cache

    def block_table(self, remote_rank: int) -> tuple[np.ndarray, np.ndarray] | None:
        """Every descriptor any request may read from `remote_rank`, as two ``Nx3``
        ``(address, length, device)`` tables (local, remote) to prepare once; a request's
        descriptors are rows of them (`prepped_indices`). None: no such tables (a block-size
        ratio, more than `PREP_MAX_ENTRIES` rows, or nothing read from that rank).

        Built on each call and not kept (the poster prepares them once and keeps its own
        lists): a planner holds only the per-block entries."""
        table = self._table(remote_rank)
        if table is None:
            return None
        tpl, entries = self._tpl, table.entries
        remote_regions = self.remote.rank_info(remote_rank).regions
        rbl = int(tpl.remote_block_len[tpl.rows[:, _RR] == remote_rank][0])

        def side(regions, region_col, offset_col, num_blocks, block_len):
            base = np.array([r.base_address for r in regions], dtype=np.uint64)
            dev = np.array([r.device_id for r in regions], dtype=np.uint64)
            blocks = np.arange(num_blocks, dtype=np.uint64) * np.uint64(block_len)
            out = np.empty((len(entries), num_blocks, 3), dtype=np.uint64)
            start = base[entries[:, region_col]] + entries[:, offset_col].astype(np.uint64)
            out[:, :, 0] = start[:, None] + blocks[None, :]
            out[:, :, 1] = entries[:, 4].astype(np.uint64)[:, None]
            out[:, :, 2] = dev[entries[:, region_col]][:, None]
            return out.reshape(-1, 3)

        return (
            side(self._local_regions, 2, 3, table.local_blocks, tpl.local_block_len),
            side(remote_regions, 0, 1, table.remote_blocks, rbl),
        )

    def prepped_indices(
        self, plan: ReadPlan, remote_rank: int
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """Rows of `block_table` (int32 local, remote) that read the same bytes as
        ``plan.expanded_descriptors(..., remote_rank)`` (one row per block and chunk instead
        of merged runs); None when the plan is better posted from its own descriptors (a
        large request whose runs merge) or there are no tables.

        Raises:
          ValueError: a plan made by another planner.
        """
        if plan.planner is not self:
            raise ValueError("the plan was made by another planner (other metadata)")
        table = self._table(remote_rank)
        lids, rids = plan.local_block_ids, plan.remote_block_ids
        if table is None or not len(lids):
            return None
        if (
            len(lids) * table.block_bytes > PREPPED_MAX_BYTES
            and len(block_runs(rids, lids)[0]) < len(lids)
            and len(plan.copies) < len(lids) * len(table.entries)
        ):
            return None  # runs merge into fewer descriptors: post the plan's own
        li = np.add(table.local_base, lids.astype(np.int32)).reshape(-1)
        ri = np.add(table.remote_base, rids.astype(np.int32)).reshape(-1)
        return li, ri

    def _table(self, remote_rank: int) -> _PrepTable | None:
        if remote_rank not in self._tables:
            self._tables[remote_rank] = self._build_table(remote_rank)
        return self._tables[remote_rank]

    def _build_table(self, remote_rank: int) -> _PrepTable | None:
        tpl = self._tpl
        if self.ratio != 1 or remote_rank not in self._remote_blocks_cache:
            return None
        rows = tpl.rows[tpl.rows[:, _RR] == remote_rank]
        if not len(rows):
            return None
        # One entry per chunk of a (possibly strided) per-block template.
        counts = rows[:, _CNT]
        index, within = row_chunks(counts)
        t = rows[index]
        entries = np.stack(
            [
                t[:, _RG],
                t[:, _RO] + within * t[:, _RS],
                t[:, _LG],
                t[:, _LO] + within * t[:, _LS],
                t[:, _LEN],
            ],
            axis=1,
        )
        nbl, nbr = self._local_blocks, self._remote_blocks_cache[remote_rank]
        if len(entries) * max(nbl, nbr) > PREP_MAX_ENTRIES:
            return None
        ent = np.arange(len(entries), dtype=np.int32)[:, None]  # rows fit: PREP_MAX_ENTRIES
        return _PrepTable(
            local_blocks=nbl,
            remote_blocks=nbr,
            entries=entries,
            local_base=ent * nbl,
            remote_base=ent * nbr,
            block_bytes=int(entries[:, 4].sum()),
        )


@dataclasses.dataclass(frozen=True)
class _PrepTable:
    local_blocks: int
    remote_blocks: int
    entries: np.ndarray  # int64 [entries, 5]: remote region, offset, local region, offset, len
    local_base: np.ndarray  # int32 [entries, 1]: first row of each entry in the local table
    remote_base: np.ndarray
    block_bytes: int  # bytes read per block


_PLANNERS: dict[tuple, ReadPlanner] = {}


def read_planner(
    local: EngineMetadata,
    local_rank: int,
    remote: EngineMetadata,
    layers: tuple[int, int] | None = None,
) -> ReadPlanner:
    """The `ReadPlanner` of (local metadata, rank, remote metadata, layers), cached.

    Cached per metadata *object* and generation: an engine keeps one metadata object per peer
    and generation (a re-registration or a re-handshake makes a new one), so every read of a
    peer after the first reuses its planner, and a planner is never reused for other
    metadata (other addresses) even where the generation did not change.
    """
    key = (id(local), local.generation, local_rank, id(remote), remote.generation, layers)
    hit = _PLANNERS.get(key)
    if hit is not None and hit.local is local and hit.remote is remote:
        return hit
    planner = ReadPlanner(local, local_rank, remote, layers)
    if len(_PLANNERS) >= _TEMPLATE_CACHE_SIZE:
        _PLANNERS.pop(next(iter(_PLANNERS)), None)
    _PLANNERS[key] = planner
    return planner
