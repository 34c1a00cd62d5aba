"""Layout arguments of the reshaping ops: resolution, checks and axis permutations (no JAX)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxkv._spec import LAYOUT_PRESETS, validate_layout

__all__ = ["check_ratio", "layout_pair", "one_layout", "packed_layout_pair", "source_shape"]


def one_layout(layout: str, block_ndim: int, name: str = "layout") -> str:
    """Resolves a layout (letters or preset name) for blocks with `block_ndim` axes.

    Raises:
      ValueError: an invalid layout, or one whose axis count differs from the blocks'.

    Example:
      >>> one_layout("flashinfer_nhd", 4)
      'KTHD'
    """
    try:
        resolved = validate_layout(layout)
    except ValueError as error:
        raise ValueError(f"{name}: {error}") from None
    if len(resolved) != block_ndim:
        raise ValueError(
            f"{name} {resolved!r} has {len(resolved)} axes; the cache blocks have {block_ndim}"
        )
    return resolved


def layout_pair(src_layout: str, dst_layout: str, block_ndim: int) -> tuple[str, str]:
    """Resolves two layouts that must name the same axes in another order.

    Raises:
      ValueError: an invalid layout, a wrong axis count, or different axis sets.

    Example:
      >>> layout_pair("hnd", "nhd", 3)
      ('HTD', 'THD')
    """
    src = one_layout(src_layout, block_ndim, "src_layout")
    dst = one_layout(dst_layout, block_ndim, "dst_layout")
    if set(src) != set(dst):
        raise ValueError(
            f"layouts {src!r} and {dst!r} have different axes ({sorted(set(src) ^ set(dst))} "
            "in only one): a permute or merge can only reorder a block's axes"
        )
    return src, dst


def check_ratio(ratio: int, block_size: int) -> int:
    """Checks a block-size ratio against the receiver's tokens per block.

    Raises:
      ValueError: `ratio` is not a positive integer dividing `block_size`.

    Example:
      >>> check_ratio(2, 16)
      2
    """
    if isinstance(ratio, bool) or not isinstance(ratio, (int, np.integer)) or ratio < 1:
        raise ValueError(f"ratio must be a positive integer, got {ratio!r}")
    ratio = int(ratio)
    if block_size % ratio:
        raise ValueError(
            f"ratio {ratio} does not divide the block size {block_size}: a block cannot hold "
            f"{ratio} sender blocks of equal size"
        )
    return ratio


def source_shape(
    dst_shape: Sequence[int], src_layout: str, dst_layout: str, ratio: int = 1
) -> tuple[int, ...]:
    """The arrangement of a block's bytes before a merge: ``[ratio, *src_layout]`` with the
    token axis ``T / ratio`` long (``ratio == 1``: just the axes in `src_layout` order).

    Example:
      >>> source_shape((16, 8, 128), "HTD", "THD", ratio=2)
      (2, 8, 8, 128)
    """
    sizes = dict(zip(dst_layout, dst_shape))
    sizes["T"] //= ratio
    return (ratio, *(sizes[axis] for axis in src_layout))


def _split_packed(layout: str, name: str) -> tuple[str, str | None]:
    """A stored layout with at most one lowercase letter (the position inside a 32-bit word of
    the packed axis, right after that axis's uppercase letter) as ``(letters, packed axis)``.
    """
    if not isinstance(layout, str):
        raise ValueError(f"{name} must be a string, got {layout!r}")
    layout = LAYOUT_PRESETS.get(layout, layout)
    lower = [(i, c) for i, c in enumerate(layout) if c.islower() and c.upper() in "LKHTD"]
    if not lower:
        return layout, None
    if len(lower) > 1:
        raise ValueError(f"{name} {layout!r} has more than one packed axis "
                         f"({''.join(c for _, c in lower)})")
    i, letter = lower[0]
    if i == 0 or layout[i - 1] != letter.upper():
        raise ValueError(
            f"{name} {layout!r}: the packed position {letter!r} must follow its axis "
            f"{letter.upper()!r} (a packed axis is stored as [words, packing])"
        )
    return layout[:i] + layout[i + 1:], letter.upper()


def packed_layout_pair(src_layout: str, dst_layout: str,
                       block_ndim: int) -> tuple[str, str, str | None]:
    """Resolves two stored layouts that may name a packed axis (``"THhD"``: tokens, words of
    combined K/V heads, position in the word, head dim; as `KVCacheSpec.block_axes` names
    them). The packed pair is one axis of ``words * packing`` entries for the rewrite.

    Returns:
      ``(src letters, dst letters, packed axis or None)``, the letters without the packed
      position (so for blocks with the pair flattened into one axis).

    Raises:
      ValueError: a misplaced or repeated packed position, packed axes that differ between
        the layouts, or the errors of `layout_pair`.

    Example:
      >>> packed_layout_pair("HhTD", "THhD", 4)
      ('HTD', 'THD', 'H')
    """
    src, src_packed = _split_packed(src_layout, "src_layout")
    dst, dst_packed = _split_packed(dst_layout, "dst_layout")
    if src_packed != dst_packed:
        raise ValueError(
            f"layouts {src_layout!r} and {dst_layout!r} pack different axes "
            f"({src_packed} and {dst_packed}); a rewrite keeps the packing"
        )
    packed = dst_packed
    src, dst = layout_pair(src, dst, block_ndim - (packed is not None))
    return src, dst, packed
