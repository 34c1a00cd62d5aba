"""`EngineConfig`: how an engine splits a model's KV cache over tensor- and pipeline-parallel
ranks (semantics.md sections 2 and 4). No JAX import.

Rank numbering inside an engine: ``rank = pp_rank * tp_size + tp_rank``. Pipeline parallelism
splits layers (by default the first ``num_layers % pp_size`` ranks get one extra layer);
tensor parallelism splits KV heads, or replicates them when ``tp_size > num_kv_heads``; an MLA
cache is replicated on every TP rank.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from jaxkv._spec import KVCacheSpec

__all__ = ["EngineConfig", "default_layer_split"]


def default_layer_split(num_layers: int, pp_size: int) -> tuple[int, ...]:
    """Layers per pipeline rank: ``num_layers // pp_size`` each, and one more for each of the
    first ``num_layers % pp_size`` ranks.

    Raises:
      ValueError: fewer layers than pipeline ranks.

    Example:
      >>> default_layer_split(10, 4)
      (3, 3, 2, 2)
    """
    if pp_size < 1:
        raise ValueError(f"pp_size must be >= 1, got {pp_size}")
    if num_layers < pp_size:
        raise ValueError(f"{num_layers} layers cannot be split over {pp_size} pipeline ranks")
    base, extra = divmod(num_layers, pp_size)
    return tuple(base + (1 if r < extra else 0) for r in range(pp_size))


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """The parallel layout of one engine's KV cache.

    Attributes:
      spec: the model's cache spec (all layers, all KV heads).
      tp_size: tensor-parallel size.
      pp_size: pipeline-parallel size.
      layers_per_pp: layers held by each pipeline rank (sums to ``spec.num_layers``); None
        for `default_layer_split`.

    Raises:
      ValueError: from the constructor, for sizes < 1, heads that do not divide over TP, or a
        layer split that does not match the model.

    Example:
      >>> spec = KVCacheSpec(num_layers=5, num_kv_heads=4, head_dim=8, block_size=4)
      >>> cfg = EngineConfig(spec, tp_size=2, pp_size=2)
      >>> cfg.layers_per_pp, cfg.layer_range(pp_rank=1), cfg.head_range(tp_rank=1)
      ((3, 2), (3, 5), (2, 4))
      >>> cfg.rank(tp_rank=1, pp_rank=1), cfg.coordinates(3)
      (3, (1, 1))
    """

    spec: KVCacheSpec
    tp_size: int
    pp_size: int = 1
    layers_per_pp: Sequence[int] | None = None

    def __post_init__(self) -> None:
        for name in ("tp_size", "pp_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"EngineConfig.{name} must be a positive integer, got {value!r}")
        self.spec.heads_per_rank(self.tp_size)  # validates heads vs TP
        if self.layers_per_pp is None:
            split = default_layer_split(self.spec.num_layers, self.pp_size)
        else:
            split = tuple(int(n) for n in self.layers_per_pp)
            if len(split) != self.pp_size or any(n < 1 for n in split):
                raise ValueError(
                    f"layers_per_pp must give >= 1 layer to each of {self.pp_size} pipeline "
                    f"ranks, got {list(self.layers_per_pp)}"
                )
            if sum(split) != self.spec.num_layers:
                raise ValueError(
                    f"layers_per_pp {list(split)} sums to {sum(split)}, the model has "
                    f"{self.spec.num_layers} layers"
                )
        object.__setattr__(self, "layers_per_pp", split)

    @property
    def layer_split(self) -> tuple[int, ...]:
        """Layers held by each pipeline rank (`layers_per_pp` as resolved at construction)."""
        return tuple(self.layers_per_pp or ())

    @property
    def world_size(self) -> int:
        """Ranks in the engine: ``tp_size * pp_size``."""
        return self.tp_size * self.pp_size

    @property
    def heads_per_rank(self) -> int:
        """KV heads each TP rank holds."""
        return self.spec.heads_per_rank(self.tp_size)

    def rank(self, tp_rank: int, pp_rank: int = 0) -> int:
        """The engine rank of a (TP rank, PP rank) pair.

        Raises:
          ValueError: a coordinate out of range.
        """
        if not 0 <= tp_rank < self.tp_size or not 0 <= pp_rank < self.pp_size:
            raise ValueError(
                f"(tp_rank={tp_rank}, pp_rank={pp_rank}) is outside tp_size={self.tp_size}, "
                f"pp_size={self.pp_size}"
            )
        return pp_rank * self.tp_size + tp_rank

    def coordinates(self, rank: int) -> tuple[int, int]:
        """``(tp_rank, pp_rank)`` of an engine rank.

        Raises:
          ValueError: rank out of range.
        """
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside an engine of {self.world_size} ranks")
        return rank % self.tp_size, rank // self.tp_size

    def layer_range(self, pp_rank: int) -> tuple[int, int]:
        """Global layers ``[start, stop)`` held by a pipeline rank."""
        if not 0 <= pp_rank < self.pp_size:
            raise ValueError(f"pp_rank {pp_rank} is outside pp_size={self.pp_size}")
        split = self.layer_split
        start = sum(split[:pp_rank])
        return start, start + split[pp_rank]

    def layer_owner(self, layer: int) -> int:
        """The pipeline rank holding global layer `layer`."""
        for pp_rank in range(self.pp_size):
            start, stop = self.layer_range(pp_rank)
            if start <= layer < stop:
                return pp_rank
        raise ValueError(f"layer {layer} is outside a model of {self.spec.num_layers} layers")

    def head_range(self, tp_rank: int) -> tuple[int, int]:
        """Global KV heads ``[start, stop)`` held by a TP rank (all heads for MLA; with
        replication, consecutive ranks hold the same head)."""
        if not 0 <= tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {tp_rank} is outside tp_size={self.tp_size}")
        if self.spec.mla:
            return 0, self.spec.num_kv_heads
        per_rank = self.heads_per_rank
        if self.tp_size > self.spec.num_kv_heads:
            first = tp_rank // self.spec.head_replication(self.tp_size)
        else:
            first = tp_rank * per_rank
        return first, first + per_rank

    def local_spec(self, pp_rank: int = 0) -> KVCacheSpec:
        """The spec of one pipeline rank's cache (its layers; heads are split by
        `KVCacheSpec.block_shape(tp_size)`)."""
        start, stop = self.layer_range(pp_rank)
        return self.spec.replace(num_layers=stop - start)

    def local_block_shape(self, pp_rank: int = 0) -> tuple[int, ...]:
        """Per-block shape of one rank's cache array, in the spec's layout."""
        return self.local_spec(pp_rank).block_shape(self.tp_size)
