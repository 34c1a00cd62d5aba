"""Layout advice: `recommend_layout` tells which cache layout avoids post-processing against
given peers (the reading side's choice when it may pick its cache layout)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from jaxkv._parallel import EngineConfig

__all__ = ["LayoutAdvice", "recommend_layout"]


@dataclasses.dataclass(frozen=True)
class LayoutAdvice:
    """What `recommend_layout` returns.

    Attributes:
      layout: the recommended `KVCacheSpec.layout` letters.
      reason: why, in words.
      post_processing: whether reads from the peers would still need post-processing with it.
    """

    layout: str
    reason: str
    post_processing: bool


def _inner(layout: str) -> str:
    return "".join(a for a in layout if a in "HT")


def recommend_layout(self_cfg: EngineConfig, peers: Sequence[EngineConfig]) -> LayoutAdvice:
    """The cache layout that lets this engine exchange blocks with `peers` without
    post-processing and with the fewest descriptors.

    Rules (docs/data-movement.md sections 3-5): the L/K axes of this engine's layout are kept
    (they decide the number of arrays, not the transfer); the H/T order is chosen so that every
    received run of heads lands in place. With another TP size on either side a run is a subset
    of the heads of a block: heads-outer ("HND", ``...HTD``) keeps each head's tokens contiguous
    (one descriptor per head run), tokens-outer needs one chunk per token (strided) or, when the
    orders differ, a permute after the read. So: the peers' common order when they agree and
    TP is homogeneous; HND when TP differs (or the peers disagree), flagging the peers that
    still need a permute. A block size that is not a multiple of a peer's needs a merge.

    Args:
      self_cfg: this engine's config (its spec's layout gives the L/K arrangement).
      peers: the configs of the engines it will read from or be read by.

    Returns:
      A `LayoutAdvice`.

    Example:
      >>> from jaxkv import KVCacheSpec
      >>> spec = KVCacheSpec(num_layers=2, num_kv_heads=8, head_dim=64, block_size=16,
      ...                    layout="LKTHD")
      >>> advice = recommend_layout(EngineConfig(spec, 2), [EngineConfig(spec, 4)])
      >>> advice.layout, advice.post_processing
      ('LKHTD', True)
    """
    spec = self_cfg.spec
    layout = spec.layout
    if "H" not in layout or spec.mla:
        return LayoutAdvice(layout, "no head axis (MLA or one head): any layout reads in place",
                            False)
    outer = "".join(a for a in layout if a in "LK")
    hnd, nhd = outer + "HTD", outer + "THD"
    orders = {_inner(p.spec.layout) for p in peers if "H" in p.spec.layout}
    hetero = any(p.tp_size != self_cfg.tp_size for p in peers)
    multi_head = self_cfg.heads_per_rank > 1 or any(p.heads_per_rank > 1 for p in peers)
    merge = [p for p in peers if spec.block_size != p.spec.block_size]
    notes = []
    if merge:
        notes.append(
            f"{len(merge)} peer(s) use another block size: the larger side merges after reads"
        )
    if not multi_head:
        return LayoutAdvice(layout, "one head per rank on every side: H/T order is free; "
                            + "; ".join(notes), bool(merge))
    if len(orders) == 1 and not hetero:
        order = orders.pop()
        chosen = hnd if order == "HT" else nhd
        return LayoutAdvice(
            chosen,
            f"same TP as every peer and all peers are {'HND' if order == 'HT' else 'NHD'}: "
            "the same H/T order reads whole blocks in place" + ("; " + "; ".join(notes)
                                                               if notes else ""),
            bool(merge),
        )
    mismatched = [p for p in peers if "H" in p.spec.layout and _inner(p.spec.layout) != "HT"]
    reason = ("heterogeneous TP" if hetero else "peers disagree on the H/T order") + (
        ": heads-outer (HND) keeps a head run contiguous in every block, one descriptor per "
        "run; NHD would need per-token chunks or a permute"
    )
    if mismatched:
        reason += f"; {len(mismatched)} NHD peer(s) still need a permute (suggest HND to them)"
    if notes:
        reason += "; " + "; ".join(notes)
    return LayoutAdvice(hnd, reason, bool(mismatched or merge))
