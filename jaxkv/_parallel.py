"""`EngineConfig`: how an engine splits a model's KV cache over tensor- and pipeline-parallel
ranks (docs/data-movement.md sections 2 and 4). No JAX import.

Rank numbering inside an engine: ``rank = pp_rank * tp_size + tp_rank``. Pipeline parallelism
splits layers (by default the first ``num_layers % pp_size`` ranks get one extra layer);
tensor parallelism splits KV heads, or replicates them when ``tp_size > num_kv_heads``; an MLA
cache is replicated on every TP rank.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from jaxkv._spec import KVCacheSpec

__all__ = ["EngineConfig", "PeerPlan", "default_layer_split", "plan_peers"]


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


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _check_peer_compatible(self_cfg: EngineConfig, peer_cfg: EngineConfig) -> None:
    """Raises ValueError unless two engines hold the same model's cache (layouts aside)."""
    fields = ("num_layers", "num_kv_heads", "head_dim", "block_size", "dtype", "kv_factor", "mla")
    differ = [
        f"{name} {getattr(self_cfg.spec, name)} vs {getattr(peer_cfg.spec, name)}"
        for name in fields
        if getattr(self_cfg.spec, name) != getattr(peer_cfg.spec, name)
    ]
    if differ:
        raise ValueError(
            "the two engines' caches are incompatible for split/concat (self vs peer): "
            + "; ".join(differ)
        )
    if self_cfg.tp_size != peer_cfg.tp_size:
        for name, cfg in (("self", self_cfg), ("peer", peer_cfg)):
            if not _is_power_of_two(cfg.tp_size):
                raise ValueError(
                    f"TP sizes {self_cfg.tp_size} (self) and {peer_cfg.tp_size} (peer) differ, "
                    f"which needs both to be powers of two; the {name} TP size is not"
                )


@dataclasses.dataclass(frozen=True)
class PeerPlan:
    """How one rank exchanges its cache with a peer engine of another TP/PP layout
    (TensorRT-LLM's ``targetIRanks`` and cache split/concat; docs/data-movement.md section 4).

    The same plan serves both directions: a sender splits its blocks into `num_buffers` dense
    buffers and sends buffer ``connection_buffers[p]`` to peer rank ``target_ranks[p]`` (if
    `sends`); a receiver concatenates the buffers of its `kept_connections`, in that order.
    Buffer ``i`` holds local layers ``buffer_layers[i]`` and local heads ``buffer_heads[i]``
    of every block, as a dense ``[num_blocks, layers, K, heads, T, D]`` array.

    Attributes:
      rank, tp_rank, pp_rank: this rank (``rank = pp_rank * tp_size + tp_rank``).
      target_ranks: the peer ranks this rank exchanges with, peer TP rank outer, peer PP rank
        inner (``pp * peer_tp + tp``).
      domain_tp, domain_pp: how many peer TP / PP ranks the domain spans.
      peer_layers: layers shared with each peer PP rank of the domain, in order.
      dup, peer_dup: duplicate-head factors of this engine and of the peer (> 1 where one
        side replicates heads more than the other).
      heads_per_buffer: heads in each buffer.
      sends: whether this rank sends when it is the sender (with ``dup > 1`` only the first
        of each group of ranks holding the same heads sends).
      connection_buffers: for each target rank, the index of the buffer sent to it.
      kept_connections: indices into `target_ranks` whose buffers a receiver concatenates
        (with ``peer_dup > 1`` several peers hold the same heads; one of them is kept).
      buffer_layers, buffer_heads: ``(start, stop)`` of local layers / heads of each buffer.
      kv_factor, block_size, head_dim: the per-block tail of the buffers.

    Example:
      >>> spec = KVCacheSpec(num_layers=4, num_kv_heads=4, head_dim=8, block_size=4)
      >>> plan = plan_peers(EngineConfig(spec, 2), EngineConfig(spec, 1, pp_size=2), rank=1)
      >>> plan.target_ranks, plan.connection_buffers, plan.buffer_shapes(num_blocks=2)
      ((0, 1), (0, 1), ((2, 2, 2, 2, 4, 8), (2, 2, 2, 2, 4, 8)))
    """

    rank: int
    tp_rank: int
    pp_rank: int
    target_ranks: tuple[int, ...]
    domain_tp: int
    domain_pp: int
    peer_layers: tuple[int, ...]
    dup: int
    peer_dup: int
    heads_per_buffer: int
    sends: bool
    connection_buffers: tuple[int, ...]
    kept_connections: tuple[int, ...]
    buffer_layers: tuple[tuple[int, int], ...]
    buffer_heads: tuple[tuple[int, int], ...]
    kv_factor: int
    block_size: int
    head_dim: int

    @property
    def num_buffers(self) -> int:
        """Dense buffers a sender's split produces (= buffers a receiver's concat takes)."""
        return len(self.buffer_layers)

    @property
    def kept_ranks(self) -> tuple[int, ...]:
        """The peer ranks whose buffers a receiver concatenates, in buffer order."""
        return tuple(self.target_ranks[i] for i in self.kept_connections)

    def buffer_shape(self, index: int, num_blocks: int) -> tuple[int, ...]:
        """Shape of buffer `index` for `num_blocks` blocks."""
        layers = self.buffer_layers[index][1] - self.buffer_layers[index][0]
        heads = self.buffer_heads[index][1] - self.buffer_heads[index][0]
        return (int(num_blocks), layers, self.kv_factor, heads, self.block_size, self.head_dim)

    def buffer_shapes(self, num_blocks: int) -> tuple[tuple[int, ...], ...]:
        """Shapes of every buffer for `num_blocks` blocks."""
        return tuple(self.buffer_shape(i, num_blocks) for i in range(self.num_buffers))

    def box_starts(self) -> tuple[int, ...]:
        """Start of each buffer's box inside a local ``LKHTD`` block (axes L, K, H, T, D),
        buffer after buffer: what the split/concat custom calls take."""
        starts: list[int] = []
        for (layer, _), (head, _) in zip(self.buffer_layers, self.buffer_heads):
            starts += [layer, 0, head, 0, 0]
        return tuple(starts)


def plan_peers(self_cfg: EngineConfig, peer_cfg: EngineConfig, rank: int) -> PeerPlan:
    """Plans the exchange of rank `rank` of engine `self_cfg` with the engine `peer_cfg`
    (docs/data-movement.md section 4). Pure: no data, no JAX.

    Args:
      self_cfg: this engine.
      peer_cfg: the peer engine (sender or receiver; the plan is symmetric).
      rank: this rank, ``pp_rank * self_cfg.tp_size + tp_rank``.

    Returns:
      A `PeerPlan`.

    Raises:
      ValueError: the engines hold different models (layers, heads, head dim, block size,
        dtype, K/V factor, MLA), their TP sizes differ without both being powers of two, or
        `rank` is out of range.

    Example:
      >>> spec = KVCacheSpec(num_layers=2, num_kv_heads=4, head_dim=8, block_size=4)
      >>> plan = plan_peers(EngineConfig(spec, 1), EngineConfig(spec, 8), rank=0)
      >>> plan.num_buffers, plan.connection_buffers
      (4, (0, 0, 1, 1, 2, 2, 3, 3))
    """
    _check_peer_compatible(self_cfg, peer_cfg)
    tp_rank, pp_rank = self_cfg.coordinates(rank)
    # PP domain: the peer PP ranks whose layers overlap ours, and how many layers each shares.
    start, stop = self_cfg.layer_range(pp_rank)
    peer_pp_ranks, peer_layers = [], []
    for peer_pp in range(peer_cfg.pp_size):
        peer_start, peer_stop = peer_cfg.layer_range(peer_pp)
        overlap = min(stop, peer_stop) - max(start, peer_start)
        if overlap > 0:
            peer_pp_ranks.append(peer_pp)
            peer_layers.append(overlap)
    domain_pp = len(peer_pp_ranks)
    # TP domain.
    self_tp, peer_tp = self_cfg.tp_size, peer_cfg.tp_size
    if self_tp <= peer_tp:
        domain_tp = peer_tp // self_tp
        first_tp = tp_rank * domain_tp
    else:
        domain_tp = 1
        first_tp = tp_rank // (self_tp // peer_tp)
    target_ranks = tuple(
        peer_pp * peer_tp + peer_tp_rank
        for peer_tp_rank in range(first_tp, first_tp + domain_tp)
        for peer_pp in peer_pp_ranks
    )
    # Duplicate-head factors (heads per rank x TP size counts replicated heads again).
    self_heads, peer_heads = self_cfg.heads_per_rank, peer_cfg.heads_per_rank
    self_total, peer_total = self_heads * self_tp, peer_heads * peer_tp
    dup = max(1, self_total // peer_total)
    peer_dup = max(1, peer_total // self_total)
    if domain_tp % peer_dup or self_heads % (domain_tp // peer_dup):
        raise ValueError(
            f"cannot split {self_heads} heads per rank over a TP domain of {domain_tp} with "
            f"duplicate-head factor {peer_dup}"
        )
    head_groups = domain_tp // peer_dup
    heads_per_buffer = self_heads // head_groups
    layer_offsets = [sum(peer_layers[:r]) for r in range(domain_pp)]
    buffer_layers = tuple(
        (layer_offsets[r], layer_offsets[r] + peer_layers[r])
        for _ in range(head_groups)
        for r in range(domain_pp)
    )
    buffer_heads = tuple(
        (g * heads_per_buffer, (g + 1) * heads_per_buffer)
        for g in range(head_groups)
        for _ in range(domain_pp)
    )
    connection_buffers = tuple(
        ((p // domain_pp) // peer_dup) * domain_pp + p % domain_pp for p in range(len(target_ranks))
    )
    kept_connections = tuple(
        i * domain_pp + j for i in range(domain_tp) if i % peer_dup == 0 for j in range(domain_pp)
    )
    return PeerPlan(
        rank=rank,
        tp_rank=tp_rank,
        pp_rank=pp_rank,
        target_ranks=target_ranks,
        domain_tp=domain_tp,
        domain_pp=domain_pp,
        peer_layers=tuple(peer_layers),
        dup=dup,
        peer_dup=peer_dup,
        heads_per_buffer=heads_per_buffer,
        sends=tp_rank % dup == 0,
        connection_buffers=connection_buffers,
        kept_connections=kept_connections,
        buffer_layers=buffer_layers,
        buffer_heads=buffer_heads,
        kv_factor=self_cfg.spec.kv_factor,
        block_size=self_cfg.spec.block_size,
        head_dim=self_cfg.spec.head_dim,
    )
