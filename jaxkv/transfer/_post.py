"""Applying a read plan's `PostProcess` steps to a JAX cache, in place.

Received bytes that could not be placed directly (a layout change with more than one head per
run, a local block holding several sender blocks) arrive in the sender's arrangement; the
steps rewrite exactly those blocks with `jaxkv.ops.permute_blocks` / `jaxkv.ops.merge_blocks`,
custom calls that update the donated cache buffers in place, so NIXL registrations of the
buffers stay valid.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from jaxkv.transfer._plan import PostProcess

__all__ = ["apply_post_processing", "group_post_steps"]


def group_post_steps(
    steps: Iterable[PostProcess],
) -> dict[int, tuple[tuple[str, str, int], np.ndarray]]:
    """Per cache array: ``((src_layout, dst_layout, ratio), block ids)``.

    Steps of several ranks of one sharded cache array must agree (the ops run the same
    rewrite on every shard); equal steps are merged.

    Raises:
      ValueError: two different rewrites for one array.
    """
    out: dict[int, tuple[tuple[str, str, int], np.ndarray]] = {}
    for step in steps:
        ids = np.asarray(step.block_ids, dtype=np.int64).reshape(-1)
        previous = out.get(step.array_index)
        if previous is None:
            out[step.array_index] = (step.op_args(), ids)
        elif previous[0] != step.op_args() or not np.array_equal(previous[1], ids):
            raise ValueError(
                f"cache array {step.array_index}: different post-processing per shard "
                f"({previous[0]} vs {step.op_args()}); one rewrite per array is supported"
            )
    return out


def apply_post_processing(cache: Any, steps: Iterable[PostProcess], *, wait: bool = True) -> Any:
    """Rewrites the received blocks of `cache` from the sender's arrangement into its own.

    Args:
      cache: the `PagedKVCache` the plan's reads wrote into (for a cache sharded over several
        TP ranks, the steps of every rank, which must agree). Its rewritten arrays are
        consumed (donated): use the returned cache.
      steps: `PostProcess` steps (`ReadPlan.post`, `PollResult.post_applied`).
      wait: block until the rewrite finished.

    Returns:
      The updated cache (same buffers: `PagedKVCache.verify_unmoved` passes).

    Raises:
      ValueError: steps that disagree for one array, or that do not fit the cache.
    """
    from jaxkv.ops import gather_blocks, merge_blocks, pad_block_ids, permute_blocks

    groups = group_post_steps(steps)
    if not groups:
        return cache
    # A cache over memory JAX does not own (torch tensors adopted through DLPack) cannot be
    # updated in place, and an eager op on it would first copy the whole array (JAX cannot
    # donate a foreign buffer): its blocks to rewrite are gathered, rewritten in that small
    # array, and stored back, and only those (`AdoptedKVCache.store_blocks`).
    store_blocks = getattr(cache, "store_blocks", None)
    if store_blocks is not None:
        cache.wait_for_torch()  # JAX reads the torch memory next: after torch's writes
    arrays = list(cache.arrays)
    for index, ((src, dst, ratio), ids) in sorted(groups.items()):
        if dst != cache.spec.layout:
            raise ValueError(f"post-processing targets layout {dst!r}, the cache is "
                             f"{cache.spec.layout!r}")
        padded = pad_block_ids(ids)
        if store_blocks is None:
            target, rewrite = arrays[index], padded
        else:
            # Row i of the gathered array is block padded[i] (padding rows skipped).
            target = gather_blocks(arrays[index], padded)
            rewrite = np.where(padded >= 0, np.arange(len(padded)), -1).astype(padded.dtype)
        if ratio == 1:
            rewritten = permute_blocks(target, rewrite, src, dst)
        else:
            rewritten = merge_blocks(target, rewrite, ratio, src, dst)
        if store_blocks is None:
            arrays[index] = rewritten
        else:
            store_blocks(index, padded, rewritten)
    if store_blocks is not None:
        arrays = list(cache.arrays)
    updated = cache._with_arrays(arrays)
    if wait:
        updated.block_until_ready()
    return updated
