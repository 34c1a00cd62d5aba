"""Pallas TPU kernels for the block ops, with the per-shard signatures of the custom calls.

Written for TPU hardware and validated only in Pallas's TPU interpret mode on CPU
(``interpret=True`` here means ``pltpu.InterpretParams()``); no TPU was available to this
project, so the compiled (Mosaic) path is unvalidated on hardware.

Design:
- Block moves (copy, gather, scatter, split, concat, prefix copy) are DMAs between HBM refs
  (``memory_space=pl.ANY``): the ids are scalar-prefetched into SMEM, up to `_IN_FLIGHT` DMAs
  run at once (one DMA semaphore per slot, a slot is waited on before it is reused), and the
  updated array is aliased to the output (``input_output_aliases``), so it is updated in
  place when the caller donates it. Negative ids are padding and are skipped; ids
  ``>= num_blocks`` are skipped too, so no DMA ever leaves its buffer.
- Layout rewrites (permute, merge) stage each block through VMEM as a ``[rows, D]`` matrix
  (``D``, always the innermost axis, stays on the 128 lanes; rows on sublanes). Any permute or
  merge is a fixed permutation of those rows made of runs with a constant source stride, done
  with strided sublane loads into a second 32-bit buffer. Sub-32-bit dtypes pack 2 or 4 rows
  per sublane word, so the block is unpacked to 32 bits once as a whole (bit-exact integer
  widening) before the strided loads and packed once as a whole after them: no store ever
  writes part of a packed sublane word. Blocks are double-buffered: the next block's load DMA
  and the previous block's store DMA overlap the rewrite of the current one.
- Packed caches (tpu-inference's ``[T, words, packing, D]`` blocks, K/V interleaved in the
  combined head axis) are rewritten with the word axis and its packing flattened into one
  axis of combined heads; their padding (phantom heads, padded head-dim lanes) is zeroed in
  VMEM (a lane mask, strided zero stores over the phantom rows), so no padding value reaches
  the result.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxkv.ops._layouts import source_shape

__all__ = [
    "concat_blocks",
    "copy_block_prefix",
    "copy_blocks",
    "gather_blocks",
    "gather_blocks_into",
    "rearrange_blocks",
    "scatter_blocks",
    "split_blocks",
]

# HBM operands left in place for DMAs: `pl.ANY` (jax 0.10); later releases also name the TPU
# memory space `pltpu.HBM`, which means the same for these kernels.
_ANY = getattr(pl, "ANY", None) or getattr(pltpu, "ANY", None) or pltpu.HBM

_IN_FLIGHT = 8
"""DMAs one kernel keeps in flight (per semaphore group)."""

_ZERO_CHUNK_BYTES = 1 << 20
"""Largest VMEM zero buffer used to fill the rows of padding ids."""

_REARRANGE_VMEM_BYTES = 24 << 20
"""VMEM the permute/merge kernel may use (two input and two output blocks plus two 32-bit
copies of one); larger blocks take the XLA path on TPU."""


def _interpret(interpret: Any) -> Any:
    """``interpret``: False (compile for TPU), True (TPU interpret mode) or a
    ``pltpu.InterpretParams`` (interpret mode with those settings, e.g. race detection)."""
    if interpret is True:
        return pltpu.InterpretParams()
    return interpret or False


def _pallas_call(kernel, *, out_shape, num_prefetch, num_inputs, scratch, aliases, interpret,
                 num_outputs=1):
    any_spec = pl.BlockSpec(memory_space=_ANY)
    out_specs = any_spec if num_outputs == 1 and not isinstance(out_shape, tuple) else tuple(
        any_spec for _ in range(num_outputs))
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=num_prefetch,
            grid=(1,),
            in_specs=[any_spec] * num_inputs,
            out_specs=out_specs,
            scratch_shapes=scratch,
        ),
        input_output_aliases=aliases,
        interpret=_interpret(interpret),
    )


class _Slots:
    """`_IN_FLIGHT` DMA slots whose DMAs all move the same number of bytes, so that any
    descriptor of that size (`wait_src` -> `wait_dst`) waits on a slot. `pending` (SMEM)
    remembers which slots hold a started DMA: a skipped (padding) id starts none, and waiting
    on a semaphore nobody signals would hang."""

    def __init__(self, sems, pending, offset: int, wait_src, wait_dst):
        self.sems, self.pending, self.offset = sems, pending, offset
        self.wait_src, self.wait_dst = wait_src, wait_dst

    def reset(self) -> None:
        for k in range(_IN_FLIGHT):
            self.pending[self.offset + k] = 0

    def wait(self, slot) -> None:
        @pl.when(self.pending[self.offset + slot] != 0)
        def _():
            pltpu.make_async_copy(self.wait_src, self.wait_dst,
                                  self.sems.at[self.offset + slot]).wait()
            self.pending[self.offset + slot] = 0

    def start(self, slot, ok, src, dst) -> None:
        """Waits for the slot's previous DMA, then starts ``src -> dst`` when `ok`."""
        self.wait(slot)

        def issue():
            pltpu.make_async_copy(src, dst, self.sems.at[self.offset + slot]).start()
            self.pending[self.offset + slot] = 1

        if ok is True:
            issue()
        else:
            pl.when(ok)(issue)

    def drain(self) -> None:
        for k in range(_IN_FLIGHT):
            self.wait(k)


def _valid(block_id, num_blocks: int):
    return (block_id >= 0) & (block_id < num_blocks)


def _zero_chunk(shape: Sequence[int], dtype) -> tuple[int, tuple[int, ...]]:
    """Rows of the leading axis per zero-fill DMA, and the VMEM zero buffer's shape."""
    shape = tuple(shape)
    row_bytes = math.prod(shape[1:]) * np.dtype(dtype).itemsize
    rows = max(1, min(shape[0], _ZERO_CHUNK_BYTES // max(1, row_bytes)))
    while shape[0] % rows:
        rows -= 1
    return rows, (rows, *shape[1:])


def _zero_fill(zeros, sem, dst, shape: Sequence[int]) -> None:
    """Writes zeros into `dst` (a ref view of `shape`) from the VMEM buffer `zeros`, chunk by
    chunk along the leading axis, and waits (padding rows are rare: no overlap needed)."""
    rows = zeros.shape[0]
    for k in range(shape[0] // rows):
        copy = pltpu.make_async_copy(zeros, dst.at[pl.ds(k * rows, rows)], sem)
        copy.start()
        copy.wait()


# ---------------------------------------------------------------------------------------------
# copy / gather / scatter


def copy_blocks(cache, src_ids, dst_ids, *, interpret: bool):
    """``cache[dst[i]] = cache[src[i]]`` in place (HBM -> HBM DMAs)."""
    n, num_blocks = src_ids.shape[0], cache.shape[0]
    if n == 0:
        return cache

    def kernel(src_ref, dst_ref, _, out_ref, sems, pending):
        slots = _Slots(sems, pending, 0, out_ref.at[0], out_ref.at[0])
        slots.reset()

        def body(i, carry):
            s, d = src_ref[i], dst_ref[i]
            slots.start(i % _IN_FLIGHT, _valid(s, num_blocks) & _valid(d, num_blocks),
                        out_ref.at[s], out_ref.at[d])
            return carry

        jax.lax.fori_loop(0, n, body, 0)
        slots.drain()

    return _pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct(cache.shape, cache.dtype), num_prefetch=2,
        num_inputs=1, aliases={2: 0}, interpret=interpret,
        scratch=[pltpu.SemaphoreType.DMA((_IN_FLIGHT,)), pltpu.SMEM((_IN_FLIGHT,), jnp.int32)],
    )(src_ids, dst_ids, cache)


def _gather_kernel(n: int, num_blocks: int, block_shape: tuple[int, ...]):
    def kernel(ids_ref, cache_ref, *refs):
        out_ref, zeros, sems, pending, zero_sem = refs[-5:]
        slots = _Slots(sems, pending, 0, cache_ref.at[0], out_ref.at[0])
        slots.reset()
        zeros[...] = jnp.zeros(zeros.shape, zeros.dtype)

        def body(i, carry):
            b = ids_ref[i]
            ok = _valid(b, num_blocks)
            slots.start(i % _IN_FLIGHT, ok, cache_ref.at[b], out_ref.at[i])

            @pl.when(jnp.logical_not(ok))
            def _():
                _zero_fill(zeros, zero_sem, out_ref.at[i], block_shape)

            return carry

        jax.lax.fori_loop(0, n, body, 0)
        slots.drain()

    return kernel


def _gather_scratch(block_shape, dtype):
    _, zero_shape = _zero_chunk(block_shape, dtype)
    return [
        pltpu.VMEM(zero_shape, dtype),
        pltpu.SemaphoreType.DMA((_IN_FLIGHT,)),
        pltpu.SMEM((_IN_FLIGHT,), jnp.int32),
        pltpu.SemaphoreType.DMA(()),
    ]


def gather_blocks(cache, ids, *, interpret: bool):
    """``out[i] = cache[ids[i]]`` (zeros for padding ids) into a new array."""
    n, block_shape = ids.shape[0], tuple(cache.shape[1:])
    out_shape = jax.ShapeDtypeStruct((n, *block_shape), cache.dtype)
    if n == 0:
        return jnp.zeros(out_shape.shape, out_shape.dtype)
    return _pallas_call(
        _gather_kernel(n, cache.shape[0], block_shape), out_shape=out_shape, num_prefetch=1,
        num_inputs=1, aliases={}, interpret=interpret,
        scratch=_gather_scratch(block_shape, cache.dtype),
    )(ids, cache)


def gather_blocks_into(cache, ids, out, *, interpret: bool):
    """`gather_blocks` written into `out` (aliased: in place when donated)."""
    n, block_shape = ids.shape[0], tuple(cache.shape[1:])
    if n == 0:
        return out
    return _pallas_call(
        _gather_kernel(n, cache.shape[0], block_shape),
        out_shape=jax.ShapeDtypeStruct(out.shape, out.dtype), num_prefetch=1, num_inputs=2,
        aliases={2: 0}, interpret=interpret, scratch=_gather_scratch(block_shape, cache.dtype),
    )(ids, cache, out)


def scatter_blocks(cache, blocks, ids, *, interpret: bool):
    """``cache[ids[i]] = blocks[i]`` in place; padding ids skipped."""
    n, num_blocks = ids.shape[0], cache.shape[0]
    if n == 0:
        return cache

    def kernel(ids_ref, _, blocks_ref, out_ref, sems, pending):
        slots = _Slots(sems, pending, 0, blocks_ref.at[0], out_ref.at[0])
        slots.reset()

        def body(i, carry):
            b = ids_ref[i]
            slots.start(i % _IN_FLIGHT, _valid(b, num_blocks), blocks_ref.at[i], out_ref.at[b])
            return carry

        jax.lax.fori_loop(0, n, body, 0)
        slots.drain()

    return _pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct(cache.shape, cache.dtype), num_prefetch=1,
        num_inputs=2, aliases={1: 0}, interpret=interpret,
        scratch=[pltpu.SemaphoreType.DMA((_IN_FLIGHT,)), pltpu.SMEM((_IN_FLIGHT,), jnp.int32)],
    )(ids, cache, blocks)


# ---------------------------------------------------------------------------------------------
# permute / merge: a static permutation of a block's [rows, D] matrix, through VMEM


def row_runs(block_shape: Sequence[int], src_layout: str, dst_layout: str,
             ratio: int) -> tuple[int, tuple[int, ...], tuple[int, ...], int]:
    """The rewrite of one block as runs of rows (a row is the innermost axis ``D``).

    Destination rows come in runs of `run` consecutive rows whose source rows are
    ``start + k * stride``. Run ``r`` starts at destination row ``r * run`` and its source
    start is ``sum(digit_j(r) * source_strides[j])``, where the digits decompose ``r`` over
    `radices` (most significant first).

    Returns:
      ``(run, radices, source_strides, stride)``.
    """
    major_dst = dst_layout[:-1]
    sizes = dict(zip(dst_layout, block_shape))
    arranged = source_shape(block_shape, src_layout, dst_layout, ratio)[:-1]  # without D
    # Row strides of the source arrangement [ratio, *src_layout[:-1]] (in rows).
    strides = [0] * len(arranged)
    acc = 1
    for k in range(len(arranged) - 1, -1, -1):
        strides[k] = acc
        acc *= arranged[k]
    ratio_stride = strides[0]
    axis_stride = {axis: strides[1 + k] for k, axis in enumerate(src_layout[:-1])}
    # Destination digits, outermost first: T splits into (sub-block j, token t) with t inner.
    digits: list[tuple[int, int]] = []  # (size, source stride)
    for axis in major_dst:
        if axis == "T":
            digits.append((ratio, ratio_stride))
            digits.append((sizes["T"] // ratio, axis_stride["T"]))
        else:
            digits.append((sizes[axis], axis_stride[axis]))
    run, stride = digits[-1]
    outer = digits[:-1]
    return run, tuple(d[0] for d in outer), tuple(d[1] for d in outer), stride


def phantom_rows(block_shape: Sequence[int], dst_layout: str, axis: str,
                 valid: int) -> tuple[tuple[int, int, int], ...]:
    """The rows (a row is the innermost axis ``D``) of a block in `dst_layout` whose entry of
    `axis` is ``>= valid`` (phantom heads or tokens of a packed axis), as strided row sets
    ``(start, count, stride)``: few and static, whichever of the two decompositions needs
    fewer stores.

    Example:
      >>> phantom_rows((4, 8, 128), "THD", "H", 6)   # rows t*8 + 6 and t*8 + 7
      ((6, 4, 8), (7, 4, 8))
    """
    sizes = list(block_shape[:-1])
    k = dst_layout.index(axis)
    size = sizes[k]
    outer, inner = math.prod(sizes[:k]), math.prod(sizes[k + 1:])
    if valid >= size:
        return ()
    if inner >= outer:  # one contiguous run of `inner` rows per (outer index, phantom entry)
        return tuple((o * size * inner + c * inner, inner, 1)
                     for o in range(outer) for c in range(valid, size))
    return tuple((c * inner + i, outer, size * inner)
                 for c in range(valid, size) for i in range(inner))


def rearrange_blocks(cache, ids, *, src_layout: str, dst_layout: str, ratio: int,
                     interpret: bool, payload: tuple[str, int, int] | None = None):
    """Permutes (``ratio == 1``) or merges the listed blocks in place, through VMEM.

    `payload` ``(axis, entries, lanes)`` marks padding of a packed cache: entries of `axis`
    from `entries` on (phantom heads or tokens) and lanes of ``D`` from `lanes` on come out
    zero; no padding value reaches the result.
    """
    n, num_blocks = ids.shape[0], cache.shape[0]
    block_shape = tuple(cache.shape[1:])
    if n == 0:
        return cache
    width = block_shape[-1]
    rows = math.prod(block_shape[:-1])
    run, radices, source_strides, stride = row_runs(block_shape, src_layout, dst_layout, ratio)
    num_runs = rows // run
    dtype = np.dtype(cache.dtype)
    vmem = math.prod(block_shape) * (4 * dtype.itemsize + 8)
    if not interpret and vmem > _REARRANGE_VMEM_BYTES:
        # A block too large to stage in VMEM: XLA's gather/transpose/scatter on unsigned
        # views (bit-exact), still in place when the cache is donated.
        from jaxkv.ops._dispatch import _reference_rearrange

        unsigned = jnp.dtype(f"uint{8 * dtype.itemsize}")
        out = _reference_rearrange(jax.lax.bitcast_convert_type(cache, unsigned), ids,
                                   src_layout=src_layout, dst_layout=dst_layout, ratio=ratio,
                                   payload=payload)
        return jax.lax.bitcast_convert_type(out, cache.dtype)
    phantom: tuple[tuple[int, int, int], ...] = ()
    lanes = width
    if payload is not None:
        axis, entries, lanes = payload
        phantom = phantom_rows(block_shape, dst_layout, axis, entries)
    # Same-width integers keep every bit pattern (NaN payloads included). The rewrite runs on
    # 32-bit rows, the TPU's unpacked sublane layout: a sub-32-bit block is unpacked once as a
    # whole (2 or 4 values share a 32-bit sublane word, so single rows of it cannot be moved
    # with strided sublane loads), rewritten, and packed once as a whole.
    narrow = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[dtype.itemsize]
    rows_view = cache.reshape(num_blocks, rows, width)

    def kernel(ids_ref, _, out_ref, in_buf, wide, wide_out, out_buf, in_sems, out_sems,
               pending):
        for k in range(2):
            pending[k] = 0

        def load(i, slot):
            return pltpu.make_async_copy(out_ref.at[ids_ref[i]], in_buf.at[slot],
                                         in_sems.at[slot])

        def store(slot, b):
            return pltpu.make_async_copy(out_buf.at[slot], out_ref.at[b], out_sems.at[slot])

        @pl.when(_valid(ids_ref[0], num_blocks))
        def _():
            load(0, 0).start()

        def body(i, carry):
            slot = i % 2
            b = ids_ref[i]

            @pl.when((i + 1 < n) & _valid(ids_ref[jnp.minimum(i + 1, n - 1)], num_blocks))
            def _():
                load(i + 1, 1 - slot).start()

            @pl.when(_valid(b, num_blocks))
            def _():
                load(i, slot).wait()

                @pl.when(pending[slot] != 0)
                def _():
                    store(slot, 0).wait()

                block = jax.lax.bitcast_convert_type(in_buf[slot], narrow).astype(jnp.uint32)
                if lanes < width:  # padded head-dim lanes: never carried into the result
                    lane = jax.lax.broadcasted_iota(jnp.int32, (rows, width), 1)
                    block = jnp.where(lane < lanes, block, jnp.uint32(0))
                wide[...] = block

                def copy_run(r, c):
                    source = 0
                    rest = r
                    for size, src_stride in zip(reversed(radices), reversed(source_strides)):
                        # lax.rem/div (values are non-negative): jnp's floor semantics lower
                        # through sign(), which Mosaic lowers per TPU generation.
                        source = source + jax.lax.rem(rest, size) * src_stride
                        rest = jax.lax.div(rest, size)
                    part = wide[pl.ds(source, run, stride=stride), :] if run > 1 else (
                        wide[pl.ds(source, 1), :])
                    wide_out[pl.ds(r * run, run), :] = part
                    return c

                jax.lax.fori_loop(0, num_runs, copy_run, 0)
                for start, count, step in phantom:  # phantom heads/tokens: zero rows
                    index = pl.ds(start, count, stride=step) if step > 1 and count > 1 else (
                        pl.ds(start, count))
                    wide_out[index, :] = jnp.zeros((count, width), jnp.uint32)
                out_buf[slot] = jax.lax.bitcast_convert_type(wide_out[...].astype(narrow),
                                                             cache.dtype)
                store(slot, b).start()
                pending[slot] = 1

            return carry

        jax.lax.fori_loop(0, n, body, 0)
        for k in range(2):
            @pl.when(pending[k] != 0)
            def _(k=k):
                store(k, 0).wait()

    out = _pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct(rows_view.shape, rows_view.dtype),
        num_prefetch=1, num_inputs=1, aliases={1: 0}, interpret=interpret,
        scratch=[
            pltpu.VMEM((2, rows, width), cache.dtype),
            pltpu.VMEM((rows, width), jnp.uint32),
            pltpu.VMEM((rows, width), jnp.uint32),
            pltpu.VMEM((2, rows, width), cache.dtype),
            pltpu.SemaphoreType.DMA((2,)),
            pltpu.SemaphoreType.DMA((2,)),
            pltpu.SMEM((2,), jnp.int32),
        ],
    )(ids, rows_view)
    return out.reshape(cache.shape)


# ---------------------------------------------------------------------------------------------
# copy_block_prefix: one DMA per copied token slice


def _prefix_kernel(n: int, num_src: int, num_dst: int, block_shape: tuple[int, ...],
                   t_axis: int, in_place: bool):
    tokens = block_shape[t_axis]

    def token_view(ref, block, t):
        index = [pl.ds(0, size) for size in block_shape]
        index[t_axis] = pl.ds(t, 1)
        return ref.at[(block, *index)]

    def kernel(src_ids, dst_ids, count_ref, *refs):
        if in_place:
            _, out_ref, sems, pending = refs
            src_ref = out_ref
        else:
            src_ref, _, out_ref, sems, pending = refs
        slots = _Slots(sems, pending, 0, token_view(src_ref, 0, 0), token_view(out_ref, 0, 0))
        slots.reset()
        count = count_ref[0]
        count = jnp.where((count <= 0) | (count >= tokens), tokens, count)

        def pair(i, issued):
            s, d = src_ids[i], dst_ids[i]
            ok = _valid(s, num_src) & _valid(d, num_dst)
            todo = jnp.where(ok, count, 0)

            def token(t, issued):
                slots.start(issued % _IN_FLIGHT, True, token_view(src_ref, s, t),
                            token_view(out_ref, d, t))
                return issued + 1

            return jax.lax.fori_loop(0, todo, token, issued)

        jax.lax.fori_loop(0, n, pair, 0)
        slots.drain()

    return kernel


def copy_block_prefix(src_cache, dst_cache, src_ids, dst_ids, num_tokens, *, layout: str,
                      interpret: bool):
    """Tokens ``[0, num_tokens)`` of each source block into its destination (in place)."""
    n = src_ids.shape[0]
    if n == 0:
        return dst_cache
    block_shape = tuple(dst_cache.shape[1:])
    kernel = _prefix_kernel(n, src_cache.shape[0], dst_cache.shape[0], block_shape,
                            layout.index("T"), in_place=False)
    count = jnp.reshape(jnp.asarray(num_tokens, jnp.int32), (1,))
    return _pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct(dst_cache.shape, dst_cache.dtype),
        num_prefetch=3, num_inputs=2, aliases={4: 0}, interpret=interpret,
        scratch=[pltpu.SemaphoreType.DMA((_IN_FLIGHT,)), pltpu.SMEM((_IN_FLIGHT,), jnp.int32)],
    )(src_ids, dst_ids, count, src_cache, dst_cache)


def copy_block_prefix_in_place(cache, src_ids, dst_ids, num_tokens, *, layout: str,
                               interpret: bool):
    """`copy_block_prefix` inside one cache (sources and destinations disjoint)."""
    n = src_ids.shape[0]
    if n == 0:
        return cache
    block_shape = tuple(cache.shape[1:])
    kernel = _prefix_kernel(n, cache.shape[0], cache.shape[0], block_shape, layout.index("T"),
                            in_place=True)
    count = jnp.reshape(jnp.asarray(num_tokens, jnp.int32), (1,))
    return _pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct(cache.shape, cache.dtype), num_prefetch=3,
        num_inputs=1, aliases={3: 0}, interpret=interpret,
        scratch=[pltpu.SemaphoreType.DMA((_IN_FLIGHT,)), pltpu.SMEM((_IN_FLIGHT,), jnp.int32)],
    )(src_ids, dst_ids, count, cache)


# ---------------------------------------------------------------------------------------------
# split / concat: one strided DMA per (block, buffer) box


def _box_view(ref, block, starts: Sequence[int], shape: Sequence[int]):
    return ref.at[(block, *(pl.ds(s, size) for s, size in zip(starts, shape)))]


def _box_starts(box_starts: Sequence[int], count: int, ndim: int) -> list[tuple[int, ...]]:
    return [tuple(box_starts[k * ndim:(k + 1) * ndim]) for k in range(count)]


def split_blocks(cache, ids, *into, box_starts: tuple[int, ...],
                 shapes: tuple[tuple[int, ...], ...], interpret: bool):
    """Buffer ``k`` row ``i`` = the box ``k`` of block ``ids[i]`` (zeros for padding ids)."""
    n, num_blocks, count = ids.shape[0], cache.shape[0], len(shapes)
    ndim = cache.ndim - 1
    starts = _box_starts(box_starts, count, ndim)
    out_shapes = tuple(jax.ShapeDtypeStruct((n, *shape), cache.dtype) for shape in shapes)
    if n == 0:
        return tuple(into) if into else tuple(jnp.zeros(s.shape, s.dtype) for s in out_shapes)
    zero_shapes = [_zero_chunk(shape, cache.dtype)[1] for shape in shapes]

    def kernel(ids_ref, cache_ref, *refs):
        outs = refs[len(into):len(into) + count]
        zeros = refs[len(into) + count:len(into) + 2 * count]
        sems, pending, zero_sem = refs[len(into) + 2 * count:]
        groups = [
            _Slots(sems, pending, k * _IN_FLIGHT, _box_view(cache_ref, 0, starts[k], shapes[k]),
                   outs[k].at[0])
            for k in range(count)
        ]
        for k in range(count):
            groups[k].reset()
            zeros[k][...] = jnp.zeros(zeros[k].shape, zeros[k].dtype)

        def body(i, carry):
            b = ids_ref[i]
            ok = _valid(b, num_blocks)
            for k in range(count):
                groups[k].start(i % _IN_FLIGHT, ok, _box_view(cache_ref, b, starts[k], shapes[k]),
                                outs[k].at[i])

            @pl.when(jnp.logical_not(ok))
            def _():
                for k in range(count):
                    _zero_fill(zeros[k], zero_sem, outs[k].at[i], shapes[k])

            return carry

        jax.lax.fori_loop(0, n, body, 0)
        for group in groups:
            group.drain()

    aliases = {2 + k: k for k in range(len(into))}
    result = _pallas_call(
        kernel, out_shape=out_shapes, num_prefetch=1, num_inputs=1 + len(into), aliases=aliases,
        interpret=interpret, num_outputs=count,
        scratch=[
            *(pltpu.VMEM(shape, cache.dtype) for shape in zero_shapes),
            pltpu.SemaphoreType.DMA((count * _IN_FLIGHT,)),
            pltpu.SMEM((count * _IN_FLIGHT,), jnp.int32),
            pltpu.SemaphoreType.DMA(()),
        ],
    )(ids, cache, *into)
    return tuple(result)


def concat_blocks(cache, ids, *buffers, box_starts: tuple[int, ...], interpret: bool):
    """Box ``k`` of block ``ids[i]`` = buffer ``k`` row ``i``, in place; padding skipped."""
    n, num_blocks, count = ids.shape[0], cache.shape[0], len(buffers)
    ndim = cache.ndim - 1
    starts = _box_starts(box_starts, count, ndim)
    shapes = [tuple(b.shape[1:]) for b in buffers]
    if n == 0:
        return cache

    def kernel(ids_ref, _, *refs):
        bufs = refs[:count]
        out_ref, sems, pending = refs[count:]
        groups = [
            _Slots(sems, pending, k * _IN_FLIGHT, bufs[k].at[0],
                   _box_view(out_ref, 0, starts[k], shapes[k]))
            for k in range(count)
        ]
        for group in groups:
            group.reset()

        def body(i, carry):
            b = ids_ref[i]
            ok = _valid(b, num_blocks)
            for k in range(count):
                groups[k].start(i % _IN_FLIGHT, ok, bufs[k].at[i],
                                _box_view(out_ref, b, starts[k], shapes[k]))
            return carry

        jax.lax.fori_loop(0, n, body, 0)
        for group in groups:
            group.drain()

    return _pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct(cache.shape, cache.dtype), num_prefetch=1,
        num_inputs=1 + count, aliases={1: 0}, interpret=interpret,
        scratch=[pltpu.SemaphoreType.DMA((count * _IN_FLIGHT,)),
                 pltpu.SMEM((count * _IN_FLIGHT,), jnp.int32)],
    )(ids, cache, *buffers)


OPS: dict[str, Callable[..., Any]] = {
    "copy": copy_blocks,
    "gather": gather_blocks,
    "gather_into": gather_blocks_into,
    "scatter": scatter_blocks,
    "rearrange": rearrange_blocks,
    "prefix": copy_block_prefix,
    "prefix_in_place": copy_block_prefix_in_place,
    "split": split_blocks,
    "concat": concat_blocks,
}
"""Per-shard Pallas implementations by op name (keyword ``interpret`` selects the mode)."""
