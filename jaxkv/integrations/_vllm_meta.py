"""What the vLLM connector's scheduler side and worker side share: the step metadata the
scheduler hands the workers (`JaxKVConnectorMetadata`), the KV cache groups both sides
describe (`CacheGroups`), the workers' transfer counters (`JaxKVConnectorStats`,
`JaxKVPromMetrics`) and the producer's block format.

The connector (`jaxkv.integrations.vllm`) is a facade over `_vllm_scheduler.JaxKVScheduler`
and `_vllm_worker.JaxKVWorker`; this module imports neither.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from jaxkv.integrations._mamba import StateComponent, component_group_name, components_of

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

BLOCK_FORMAT_KEY = "jaxkv_block_format"
"""The key of a producer's params that names how its blocks hold tokens (see
`block_format`)."""


@dataclasses.dataclass
class _Recv:
    """One consumer read the scheduler side orders (the name is kept for pickled metadata).

    Attributes:
      request_id: the consumer's request.
      params: the request's ``kv_transfer_params``.
      local_block_ids: one KV cache group: the blocks to fill (after the local prefix hit);
        ``[]`` with `release_only`.
      num_local_hit_blocks: one KV cache group: the blocks of the local prefix hit.
      release_only: the request was aborted or hit locally: only release the producer's
        blocks (an empty read notifies the producer).
      local_groups: several KV cache groups: per group, (position of the first block to
        fill, its blocks).
    """

    request_id: str
    params: dict[str, Any]
    local_block_ids: list[int]
    num_local_hit_blocks: int
    release_only: bool = False
    local_groups: tuple[tuple[int, tuple[int, ...]], ...] = ()

    def groups(self) -> tuple[tuple[int, tuple[int, ...]], ...]:
        """Per KV cache group, (position of the first block to fill, the blocks): the one
        group's are its local prefix hit and `local_block_ids`.

        Example:
          >>> _Recv("d-1", {}, [7, 8], 2).groups()
          ((2, (7, 8)),)
        """
        if self.local_groups:
            return self.local_groups
        return ((self.num_local_hit_blocks, tuple(self.local_block_ids)),)


@dataclasses.dataclass
class JaxKVConnectorMetadata(KVConnectorMetadata):
    """What the scheduler side tells the workers each step.

    Attributes:
      to_publish: producer requests whose prefill completes this step -> their block ids.
      to_publish_groups: the same for a hybrid model: per KV cache group, the ids of the
        blocks it keeps (a sliding-window group: the last window's).
      to_send: producer requests handed to consumers (vLLM holds their blocks until
        `get_finished` reports them).
      to_abort: producer requests published but not handed off (aborted): release them.
      to_recv: consumer reads to start.
      to_cancel: consumer requests aborted while their read is in flight: stop it (vLLM
        frees their blocks once `get_finished` reports the read over).
    """

    to_publish: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    to_publish_groups: dict[str, list[list[int]]] = dataclasses.field(default_factory=dict)
    to_send: set[str] = dataclasses.field(default_factory=set)
    to_abort: set[str] = dataclasses.field(default_factory=set)
    to_recv: list[_Recv] = dataclasses.field(default_factory=list)
    to_cancel: set[str] = dataclasses.field(default_factory=set)

    def has_work(self) -> bool:
        """Whether the workers have anything to publish, read, release or stop this step."""
        return bool(self.to_publish or self.to_publish_groups or self.to_recv or self.to_abort
                    or self.to_cancel)


@dataclasses.dataclass(frozen=True)
class CacheGroups:
    """The KV cache groups of a vLLM engine, as both connector sides see them.

    Attributes:
      block_size: vLLM's block size (``cache_config.block_size``).
      layers: per group, its layer names (empty without a ``kv_cache_config``).
      block_sizes: per group, its block size (one group: `block_size`).
      states: per group, None for attention KV, or the state components of a Mamba group
        (vLLM's ``MambaSpec``: `jaxkv.integrations._mamba`), each moved as its own cache
        group of the transfer engine; empty: no Mamba group.
      spec_blocks: per group, the speculative-decoding scratch blocks vLLM appends to a Mamba
        group's blocks (``MambaSpec.num_speculative_blocks``; 0 otherwise); empty: none.

    Example:
      >>> CacheGroups(16, (), (16,)).grouped, CacheGroups(16, (), (16,)).num_groups
      (False, 1)
    """

    block_size: int
    layers: tuple[tuple[str, ...], ...]
    block_sizes: tuple[int, ...]
    states: tuple[tuple[StateComponent, ...] | None, ...] = ()
    spec_blocks: tuple[int, ...] = ()

    @classmethod
    def of(cls, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None,
           tp_size: int = 1) -> CacheGroups:
        """The groups of `kv_cache_config` (None: one group of vLLM's block size).

        Args:
          vllm_config: the engine's config.
          kv_cache_config: vLLM's cache config.
          tp_size: the engine's TP size (a Mamba group's shapes are one rank's).

        Raises:
          ValueError: a group excluded from KV transfer, or one that holds neither attention
            KV nor Mamba state (`check_groups`).
        """
        from vllm.v1.kv_cache_interface import MambaSpec

        groups = list(kv_cache_config.kv_cache_groups) if kv_cache_config is not None else []
        block_size = int(vllm_config.cache_config.block_size)
        if groups:
            check_groups(groups)
        mamba = [isinstance(g.kv_cache_spec, MambaSpec) for g in groups]
        if len(groups) > 1 or any(mamba):
            sizes = tuple(int(g.kv_cache_spec.block_size) for g in groups)
        else:
            sizes = (block_size,)
        states: tuple[tuple[StateComponent, ...] | None, ...] = ()
        spec_blocks: tuple[int, ...] = ()
        if any(mamba):
            states = tuple(
                components_of(g.kv_cache_spec, tp_size) if m else None
                for g, m in zip(groups, mamba)
            )
            spec_blocks = tuple(
                int(getattr(g.kv_cache_spec, "num_speculative_blocks", 0)) if m else 0
                for g, m in zip(groups, mamba)
            )
        return cls(block_size, tuple(tuple(g.layer_names) for g in groups), sizes, states,
                   spec_blocks)

    @property
    def grouped(self) -> bool:
        """Several KV cache groups (vLLM's hybrid allocator), or a Mamba group: the
        per-group path (params, reads and failures per group)."""
        return len(self.block_sizes) > 1 or self.has_state

    @property
    def num_groups(self) -> int:
        """How many KV cache groups (at least 1)."""
        return len(self.block_sizes)

    @property
    def has_state(self) -> bool:
        """A Mamba (state-space) group is among them."""
        return any(s is not None for s in self.states)

    def state_of(self, group: int) -> tuple[StateComponent, ...] | None:
        """The state components of group `group` (None: an attention group)."""
        return self.states[group] if self.states else None

    def engine_groups(self) -> list[tuple[int, str]]:
        """The transfer engine's cache groups in order: (vLLM group, engine group name);
        an attention group is one (`group_name`), a Mamba group one per state component
        (`component_group_name`)."""
        from jaxkv.integrations._params import group_name

        out: list[tuple[int, str]] = []
        for g in range(self.num_groups):
            components = self.state_of(g)
            if components is None:
                out.append((g, group_name(g)))
            else:
                out.extend((g, component_group_name(g, c)) for c in components)
        return out


def check_groups(groups: Sequence[Any]) -> None:
    """Refuses KV cache groups the connector cannot move: groups vLLM excludes from KV
    transfer (scratch buffers) and groups that hold neither attention KV nor Mamba state.

    Raises:
      ValueError: such a group.
    """
    from vllm.v1.kv_cache_interface import AttentionSpec, MambaSpec

    for g, group in enumerate(groups):
        if not getattr(group, "enable_kv_transfer", True):
            raise ValueError(
                f"KV cache group {g} ({group.layer_names[:2]}...) is excluded from KV transfer "
                "by vLLM: JaxKVConnector moves every group of a hybrid model"
            )
        if not isinstance(group.kv_cache_spec, (AttentionSpec, MambaSpec)):
            raise ValueError(
                f"KV cache group {g} holds {type(group.kv_cache_spec).__name__}: JaxKVConnector "
                "moves attention KV groups (full attention, sliding window) and Mamba state "
                "groups (MambaSpec)"
            )


def block_format() -> str | None:
    """How this engine's vLLM blocks hold their tokens, when it is not vLLM's token-major
    paged layout: ``"vllm-cpu-attention"`` on vLLM's CPU platform, whose attention stores each
    (block, head) as a K region in an instruction-set-specific order (one token's K spread over
    the region) followed by V as ``[tokens, head_size]`` rows. Such blocks are exact only when
    moved whole between engines of the same format; jaxkv cannot split them into tokens
    (another block size, layout or backend). None: the token-major layout."""
    try:
        from vllm.platforms import current_platform
    except ImportError:  # pragma: no cover - vLLM is imported by this module already
        return None
    return "vllm-cpu-attention" if current_platform.is_cpu() else None


@dataclasses.dataclass
class JaxKVConnectorStats(KVConnectorStats):
    """Transfer counters of the worker-side connectors (summed over workers).

    ``data`` keys: ``transfers``, ``failed``, ``bytes``, ``duration_s`` (sums over the
    interval's finished reads).

    Example:
      >>> stats = JaxKVConnectorStats(data={"transfers": 2, "failed": 0, "bytes": 4_000_000,
      ...                                   "duration_s": 0.5})
      >>> stats.reduce()["mean_ms"], stats.reduce()["throughput_MBps"]
      (250.0, 8.0)
    """

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        """Zeroes the counters."""
        self.data = {"transfers": 0, "failed": 0, "bytes": 0, "duration_s": 0.0}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        """Adds `other`'s counters to these; returns self."""
        for key, value in other.data.items():
            self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        """The counters with the mean read time and the throughput."""
        transfers = self.data["transfers"]
        return {
            "transfers": transfers,
            "failed": self.data["failed"],
            "bytes": self.data["bytes"],
            "mean_ms": 1e3 * self.data["duration_s"] / transfers if transfers else 0.0,
            "throughput_MBps": (
                self.data["bytes"] / self.data["duration_s"] / 1e6
                if self.data["duration_s"] > 0
                else 0.0
            ),
        }

    def is_empty(self) -> bool:
        """No read finished or failed."""
        return self.data["transfers"] == 0 and self.data["failed"] == 0


class JaxKVPromMetrics(KVConnectorPromMetrics):
    """Prometheus counters of the connector's transfers, per vLLM engine:
    ``vllm:jaxkv_transfers``, ``vllm:jaxkv_failed_transfers`` and
    ``vllm:jaxkv_transferred_bytes`` (``_total`` samples), fed from `JaxKVConnectorStats`."""

    _METRICS = (
        ("transfers", "vllm:jaxkv_transfers", "KV reads finished by the jaxkv connector"),
        ("failed", "vllm:jaxkv_failed_transfers", "KV reads of the jaxkv connector that failed"),
        ("bytes", "vllm:jaxkv_transferred_bytes", "Bytes read by the jaxkv connector"),
    )

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {}
        for key, name, documentation in self._METRICS:
            counter = self._counter_cls(
                name=name, documentation=documentation, labelnames=labelnames
            )
            self._counters[key] = {
                index: counter.labels(*values) for index, values in per_engine_labelvalues.items()
            }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Adds one interval's counters (`JaxKVConnectorStats.data`) of engine `engine_idx`."""
        for key, counters in self._counters.items():
            value = transfer_stats_data.get(key, 0)
            if value:
                counters[engine_idx].inc(value)
