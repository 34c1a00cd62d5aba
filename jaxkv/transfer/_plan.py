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

import dataclasses
import functools
from collections.abc import Sequence

import numpy as np

from jaxkv.transfer._metadata import EngineMetadata, check_compatible

__all__ = [
    "COPY_COLUMNS",
    "PlanError",
    "PostProcess",
    "ReadPlan",
    "ReadPlanner",
    "block_runs",
    "plan_read",
    "read_planner",
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
        return self.planner.copies(self.local_block_ids, self.remote_block_ids)

    @property
    def num_descriptors(self) -> int:
        return int(self.copies.shape[0])

    @property
    def num_bytes(self) -> int:
        if not self.copies.shape[0]:
            return 0
        return int((self.copies[:, _LEN] * self.copies[:, _CNT]).sum())

    @property
    def notify_only(self) -> bool:
        return not len(self.local_block_ids) or self.copies.shape[0] == 0

    def copies_for(self, remote_rank: int) -> np.ndarray:
        return self.copies[self.copies[:, _RR] == remote_rank]

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
        """Plain ``Nx3`` descriptors ``(address, length, device)``: strided rows expanded."""
        loc, rem = self.descriptors(local, remote, remote_rank)
        counts = loc[:, 4].astype(np.int64)
        index = np.repeat(np.arange(len(loc)), counts)
        within = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
        within = within.astype(np.uint64)
        out = []
        for side in (loc, rem):
            rows = np.empty((len(index), 3), dtype=np.uint64)
            rows[:, 0] = side[index, 0] + within * side[index, 3]
            rows[:, 1] = side[index, 1]
            rows[:, 2] = side[index, 2]
            out.append(rows)
        return out[0], out[1]


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
    if meta.padded:
        raise PlanError(
            f"engine {meta.engine_id!r}: packed / interleaved / padded storage (stored layout "
            f"{meta.stored_layout}, packing {meta.packing}, head dim {meta.head_dim} stored as "
            f"{meta.stored_head_dim}) is not planned by this planner"
        )
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


def _source_ranks(local: _Side, remote_meta: EngineMetadata, layer: int) -> list[tuple[int, int]]:
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
    tpl: _Templates, local_ids: np.ndarray, remote_ids: np.ndarray, ratio: int
) -> np.ndarray:
    """Instantiates the per-block templates over the request's blocks, merging runs of
    consecutive ids into one (strided) descriptor where the pattern allows it. Rows keep the
    templates' order (grouped by remote rank)."""
    templates, rbl, lbl = tpl.rows, tpl.remote_block_len, np.int64(tpl.local_block_len)
    if templates.size == 0:
        return np.zeros((0, 9), np.int64)
    if ratio == 1:
        starts, lengths = block_runs(remote_ids, local_ids)
        cnt, rs, ls = templates[:, _CNT], templates[:, _RS], templates[:, _LS]
        mergeable = (cnt == 1) | ((cnt * rs == rbl) & (cnt * ls == lbl))
        if mergeable.all() or len(starts) == len(local_ids):
            k = len(starts)
            r_at, l_at, n_at = remote_ids[starts], local_ids[starts], lengths
        else:  # some patterns do not merge: instantiate every block
            k = len(local_ids)
            r_at, l_at, n_at = remote_ids, local_ids, np.ones(k, np.int64)
            mergeable = np.zeros(len(templates), bool)
        m = len(templates)
        rows = np.empty((m, k, 9), np.int64)
        rows[:] = templates[:, None, :9]
        rows[:, :, _RO] += rbl[:, None] * r_at[None, :]
        rows[:, :, _LO] += lbl * l_at[None, :]
        if mergeable.any():
            t = templates
            single = t[:, _CNT] == 1
            length = t[:, _LEN]
            dense = (length == np.where(single, rbl, t[:, _RS])) & (
                length == np.where(single, lbl, t[:, _LS])
            )
            rows[:, :, _RS] = np.where(single, rbl, t[:, _RS])[:, None]
            rows[:, :, _LS] = np.where(single, lbl, t[:, _LS])[:, None]
            total = t[:, _CNT][:, None] * n_at[None, :]
            rows[:, :, _CNT] = np.where(dense[:, None], 1, total)
            rows[:, :, _LEN] = np.where(dense[:, None], length[:, None] * total, length[:, None])
            dense_rows = np.broadcast_to(dense[:, None], (m, k))
            rows[:, :, _RS] = np.where(dense_rows, rows[:, :, _LEN], rows[:, :, _RS])
            rows[:, :, _LS] = np.where(dense_rows, rows[:, :, _LEN], rows[:, :, _LS])
        return rows.reshape(-1, 9)
    out = []
    for j in range(ratio):
        sel = templates[:, 9] == j
        idx = np.arange(len(local_ids)) * ratio + j
        ok = idx < len(remote_ids)
        lids, rids = local_ids[ok], remote_ids[idx[ok]]
        if not sel.any() or not len(lids):
            continue
        t = templates[sel]
        rows = np.empty((len(t), len(lids), 9), np.int64)
        rows[:] = t[:, None, :9]
        rows[:, :, _RO] += rbl[sel][:, None] * rids[None, :]
        rows[:, :, _LO] += lbl * lids[None, :]
        out.append(rows.reshape(-1, 9))
    if not out:
        return np.zeros((0, 9), np.int64)
    rows = np.concatenate(out)
    return rows[np.argsort(rows[:, _RR], kind="stable")]


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

    def copies(self, local_ids: np.ndarray, remote_ids: np.ndarray) -> np.ndarray:
        """`ReadPlan.copies` of a request's (validated) ids."""
        return _expand(self._tpl, local_ids, remote_ids, self.ratio)

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
        index = np.repeat(np.arange(len(rows)), counts)
        within = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
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
