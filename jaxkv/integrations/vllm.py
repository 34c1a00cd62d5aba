"""`JaxKVConnector`: vLLM's KV connector API (0.33, `KVConnectorBase_V1`) on `jaxkv.transfer`.

A prefill engine (``kv_role="kv_producer"``) and a decode engine (``kv_consumer``) move the KV
blocks of each request with `jaxkv.transfer.TransferEngine`: the decode side READs them over
NIXL, in its own layout, block size and TP size (jaxkv plans the reads and rewrites what
arrives in another arrangement).

Flow of one request:

* Producer scheduler: `build_connector_meta` tells the workers which requests complete their
  prefill this step, with their block ids. Producer workers: `wait_for_save` (after the
  forward wrote the KV) pins those blocks (`publish_request`), so they are readable before
  the request's output, and so its `kv_transfer_params`, leaves the engine.
* Producer scheduler: `request_finished` keeps the blocks (``delay_free``) and returns the
  `kv_transfer_params` built from the configured side-channel addresses with
  `jaxkv.transfer.make_transfer_params` (the scheduler has no transfer engine); a read that
  reaches a worker before it pinned the request waits up to ``early_read_grace_s``. Aborted
  requests are released by the workers at their next step.
* Consumer scheduler: `get_num_new_matched_tokens` / `update_state_after_alloc` take the
  remote tokens beyond the local prefix hit; consumer workers `start_load_kv` posts the reads
  and `get_finished` reports them (failed ones also through `get_block_ids_with_load_errors`,
  so vLLM recomputes them). A consumer request aborted before its read releases the producer's
  blocks at once (an empty read notifies the producer).
* Producer workers report a request in `get_finished`'s sending set once every consumer rank
  confirmed its read, its lease expired or it was aborted; vLLM then frees the blocks.

The worker side registers a `jaxkv.PagedKVCache` (JAX serving frameworks): `register_kv_caches`
takes the cache, or a one-entry mapping of it; GPU vLLM's torch tensors are adopted zero-copy
(DLPack) as one.

Hybrid models (vLLM's hybrid allocator: full-attention and sliding-window KV cache groups, each
with its own block ids per request): `JaxKVConnector` is `SupportsHMA`. Each group has its own
cache group of one `jaxkv.transfer.TransferEngine` (group ``g`` on its own side
channel: ``side_channel`` port + ``g`` or ``group_ports``); a sliding-window group moves only
the blocks of the last window (`jaxkv.integrations.GroupedTransfer` carries, per group, the
blocks the producer keeps and the position of the first). A read that fails in any group fails
the request (``failed_recving``; vLLM recomputes it).

Settings come from ``kv_connector_extra_config`` (`jaxkv.integrations.ConnectorSettings`).

Example (the configuration of a prefill engine):
  >>> from vllm.config import KVTransferConfig  # doctest: +SKIP
  >>> KVTransferConfig(  # doctest: +SKIP
  ...     kv_connector="JaxKVConnector",
  ...     kv_connector_module_path="jaxkv.integrations.vllm",
  ...     kv_role="kv_producer",
  ...     kv_connector_extra_config={"engine_id": "prefill", "side_channel": [["10.0.0.1", 5600]]},
  ... )
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import msgspec

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
        KVConnectorTransferResults,
        SupportsHMA,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
    )
except ImportError as _error:  # pragma: no cover - depends on the environment
    raise ImportError(
        "jaxkv.integrations.vllm needs vLLM 0.33 (pip install vllm==0.33.0; "
        "scripts/setup_integrations.sh builds a test environment)"
    ) from _error

from jaxkv.integrations._params import (
    ConnectorSettings,
    GroupedTransfer,
    group_name,
    group_read_plan_ids,
    read_plan_ids,
    transfer_params_from_dict,
    transfer_params_to_dict,
)
from jaxkv.transfer import PollResult, make_transfer_params

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

    from jaxkv.transfer import TransferEngine

__all__ = [
    "JaxKVConnector",
    "JaxKVConnectorBase",
    "JaxKVConnectorMetadata",
    "JaxKVConnectorStats",
    "JaxKVPromMetrics",
]

log = logging.getLogger("jaxkv.integrations.vllm")


@dataclasses.dataclass
class _Recv:
    request_id: str  # the consumer's request
    params: dict[str, Any]  # the request's kv_transfer_params
    local_block_ids: list[int]  # blocks to fill (after the local prefix hit); [] = release
    num_local_hit_blocks: int
    release_only: bool = False  # the request was aborted: only release the producer's blocks
    # hybrid models: per KV cache group, (position of the first block to fill, its blocks)
    local_groups: tuple[tuple[int, tuple[int, ...]], ...] = ()


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


@dataclasses.dataclass
class JaxKVConnectorStats(KVConnectorStats):
    """Transfer counters of the worker-side connectors (summed over workers).

    ``data`` keys: ``transfers``, ``failed``, ``bytes``, ``duration_s`` (sums over the
    interval's finished reads).
    """

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = {"transfers": 0, "failed": 0, "bytes": 0, "duration_s": 0.0}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key, value in other.data.items():
            self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
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
        for key, counters in self._counters.items():
            value = transfer_stats_data.get(key, 0)
            if value:
                counters[engine_idx].inc(value)


class JaxKVConnectorBase(KVConnectorBase_V1):
    """The connector's logic (`JaxKVConnector` without vLLM's `SupportsHMA` mark).

    Several KV cache groups (vLLM's hybrid allocator) are served only by subclasses that are
    `SupportsHMA` (vLLM keeps the hybrid allocator off for the others): `JaxKVConnector`.

    Args:
      vllm_config: the engine's config; its ``kv_transfer_config.kv_connector_extra_config``
        holds the `ConnectorSettings`.
      role: `KVConnectorRole.SCHEDULER` or `KVConnectorRole.WORKER`.
      kv_cache_config: vLLM's cache config: its KV cache groups (None: one group).

    Raises:
      ValueError: bad settings, or several KV cache groups for a class that is not
        `SupportsHMA`.
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ):
        if role == KVConnectorRole.WORKER:
            # First: nothing of jaxkv may start JAX's backends before this.
            _confine_jax_to_worker()
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = self._kv_transfer_config
        self.settings = ConnectorSettings.from_dict(
            transfer.kv_connector_extra_config or {}, transfer.engine_id
        )
        groups = list(kv_cache_config.kv_cache_groups) if kv_cache_config is not None else []
        if len(groups) > 1 and not isinstance(self, SupportsHMA):
            raise ValueError(
                f"{type(self).__name__} supports one KV cache group (disable vLLM's hybrid "
                "allocator)"
            )
        if len(groups) > 1:
            _check_groups(groups)
        # hybrid models (vLLM's hybrid allocator): one jaxkv transfer engine per group
        self.grouped = len(groups) > 1
        self.num_groups = max(1, len(groups))
        self._group_layers = [list(g.layer_names) for g in groups]
        self._group_block_sizes = [int(g.kv_cache_spec.block_size) for g in groups]
        self.block_size = vllm_config.cache_config.block_size
        self.is_producer = transfer.is_kv_producer
        # scheduler side
        self._requests: dict[str, Request] = {}  # producer requests not yet published
        self._published: set[str] = set()
        self._published_first: dict[str, list[int]] = {}  # hybrid: first block per group
        self._loading: set[str] = set()  # consumer requests whose read is in flight
        # consumer requests: what their read did, until `request_finished` reports it
        self._load_outcomes: dict[str, dict[str, Any]] = {}
        self._local_hits: dict[str, int] = {}  # consumer requests: local prefix hit tokens
        self._refused: dict[str, str] = {}  # consumer requests whose params were refused
        self.block_format = _block_format()
        self._meta = JaxKVConnectorMetadata()
        # worker side
        self.engine: TransferEngine | None = None  # one cache group or several
        self._reading: dict[str, str] = {}  # consumer request id -> producer request id
        self._releasing: set[str] = set()  # consumer request ids read only to release them
        self._awaiting_send: set[str] = set()
        self._freeable: set[str] = set()
        self._aborted: set[str] = set()
        self._load_errors: set[int] = set()
        self._failed_now: set[str] = set()  # reads refused before they started
        self._cancelled: set[str] = set()  # consumer ids of reads stopped by an abort
        self._stats_seen = (0, 0, 0)  # engine totals at the last stats call
        # hybrid models
        self._group_load_errors: dict[int, set[int]] = {}
        self._group_stats_seen: dict[str, tuple[int, int, int]] = {}

    # -- scheduler side -------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """The remote prompt tokens beyond the local hit (loaded asynchronously)."""
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return 0, False
        remote_format = params.get(BLOCK_FORMAT_KEY)
        if remote_format != self.block_format:
            # Blocks of another format would land as bytes that mean other tokens.
            reason = (f"the producer's blocks are {remote_format or 'token-major'}, this "
                      f"engine's {self.block_format or 'token-major'}: not read")
            if request.request_id not in self._refused:
                log.error("request %s: %s; vLLM computes its prompt", request.request_id, reason)
            self._refused[request.request_id] = reason
            self._local_hits[request.request_id] = num_computed_tokens
            return 0, False
        remote_tokens = min(int(params.get("remote_num_tokens", 0)), request.num_prompt_tokens)
        count = remote_tokens - num_computed_tokens
        self._local_hits[request.request_id] = num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Records a consumer read (the blocks to fill) or a producer request to publish."""
        params = request.kv_transfer_params
        if not params:
            return
        if params.get("do_remote_decode"):
            self._requests[request.request_id] = request
            return
        if not params.get("do_remote_prefill"):
            return
        params["do_remote_prefill"] = False  # one transfer per request
        refused = self._refused.pop(request.request_id, None)
        self._load_outcomes[request.request_id] = {
            "status": "refused" if refused else "reading" if num_external_tokens > 0
            else "local_hit",
            "remote_tokens": int(num_external_tokens),
            "local_hit_tokens": int(self._local_hits.pop(request.request_id, 0)),
        }
        if refused:
            self._load_outcomes[request.request_id]["reason"] = refused
        if num_external_tokens > 0 and self.grouped:
            local_groups = tuple(_blocks_to_fill(group) for group in blocks.blocks)
            flat = [b for _, ids in local_groups for b in ids]
            self._meta.to_recv.append(
                _Recv(request.request_id, dict(params), flat, 0, local_groups=local_groups)
            )
            self._loading.add(request.request_id)
        elif num_external_tokens > 0:
            group = blocks.blocks[0]
            hit = sum(1 for block in group if block.block_hash is not None)
            local = [block.block_id for block in group if block.block_hash is None]
            self._meta.to_recv.append(_Recv(request.request_id, dict(params), local, hit))
            self._loading.add(request.request_id)
        else:
            # Everything was a local hit: the producer's blocks are only released.
            self._meta.to_recv.append(_Recv(request.request_id, dict(params), [], 0, True))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> JaxKVConnectorMetadata:
        """The step's work for the workers (resets the scheduler side's pending state)."""
        meta, self._meta = self._meta, JaxKVConnectorMetadata()
        scheduled = scheduler_output.num_scheduled_tokens
        for request_id, request in list(self._requests.items()):
            n = scheduled.get(request_id)
            if n is None:
                continue
            if request.num_computed_tokens + n >= request.num_prompt_tokens:
                # Its prefill completes this step: the workers pin the blocks after the
                # forward wrote them.
                if self._kv_cache_manager is None:
                    raise RuntimeError("vLLM did not bind its KV cache manager to the connector")
                if self.grouped:
                    firsts = self._window_firsts(request.num_prompt_tokens)
                    all_ids = self._kv_cache_manager.get_block_ids(request_id)
                    meta.to_publish_groups[request_id] = [
                        list(ids[first : math.ceil(request.num_prompt_tokens / size)])
                        for ids, first, size in zip(all_ids, firsts, self._group_block_sizes)
                    ]
                    self._published_first[request_id] = firsts
                else:
                    ids = self._kv_cache_manager.get_block_ids(request_id)[0]
                    needed = math.ceil(request.num_prompt_tokens / self.block_size)
                    meta.to_publish[request_id] = list(ids[:needed])
                self._published.add(request_id)
                del self._requests[request_id]
        return meta

    def _window_firsts(self, num_tokens: int) -> list[int]:
        """Per KV cache group, the first block position a request of `num_tokens` computed
        tokens keeps (its sliding window's; 0 for full attention), as vLLM's managers cut."""
        assert self._kv_cache_manager is not None
        managers = self._kv_cache_manager.coordinator.single_type_managers
        return [
            manager.get_num_skipped_tokens(num_tokens) // size
            for manager, size in zip(managers, self._group_block_sizes)
        ]

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        """Hybrid models: a read fills every KV cache group (vLLM skips zeroing them)."""
        if not self.grouped:
            return super().get_loaded_kv_cache_group_ids(request)
        return tuple(range(self.num_groups))

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Producer: keeps a finished prefill's blocks and returns the consumer's params.
        Consumer: returns ``{"jaxkv_load": outcome}``, what the request's read did (see
        `load_outcome`), so that vLLM's output shows it."""
        if not self._to_send(request, bool(block_ids)):
            return False, self._load_outcome_params(request.request_id)
        if not self.settings.side_channel:
            raise ValueError("a kv_producer needs side_channel addresses in its settings")
        request_id = request.request_id
        num_tokens = request.num_prompt_tokens
        transfer = make_transfer_params(
            self.settings.engine_id,
            list(self.settings.side_channel),
            request_id,
            block_ids,
            self.settings.lease_s,
            num_tokens=num_tokens,
            block_size=self.block_size,
        )
        self._meta.to_send.add(request_id)
        params = transfer_params_to_dict(transfer, num_tokens, self.block_size)
        if self.block_format is not None:
            params[BLOCK_FORMAT_KEY] = self.block_format
        return True, params

    def _request_finished_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """`request_finished` of a hybrid model: block ids per KV cache group."""
        request_id = request.request_id
        firsts = self._published_first.pop(request_id, None)
        if not self._to_send(request, any(block_ids)):
            return False, self._load_outcome_params(request_id)
        if not self.settings.side_channel:
            raise ValueError("a kv_producer needs side_channel addresses in its settings")
        assert firsts is not None and self._kv_cache_manager is not None
        null = self._kv_cache_manager.block_pool.null_block.block_id
        num_tokens = request.num_prompt_tokens
        kept, starts = [], []
        for ids, first, size in zip(block_ids, firsts, self._group_block_sizes):
            ids = list(ids[: math.ceil(num_tokens / size)])
            # vLLM freed the blocks below the window (null now): they were published but
            # must not be read (another request may own them by now)
            gone = max((i + 1 for i, b in enumerate(ids) if b == null), default=0)
            start = max(first, gone)
            kept.append(ids[start:])
            starts.append(start)
        transfer = GroupedTransfer.make(
            self.settings.engine_id,
            self.settings.group_addresses(self.num_groups),
            request_id,
            kept,
            self.settings.lease_s,
            num_tokens=num_tokens,
            block_sizes=self._group_block_sizes,
            first_blocks=starts,
        )
        self._meta.to_send.add(request_id)
        params = transfer.to_dict()
        if self.block_format is not None:
            params[BLOCK_FORMAT_KEY] = self.block_format
        return True, params

    def _load_outcome_params(self, request_id: str) -> dict[str, Any] | None:
        """A consumer request's read outcome as output ``kv_transfer_params`` (None for a
        request that read nothing)."""
        self._local_hits.pop(request_id, None)
        self._refused.pop(request_id, None)
        outcome = self._load_outcomes.pop(request_id, None)
        if outcome is None:
            return None
        if outcome["status"] == "reading":  # finished (aborted) before the read ended
            outcome["status"] = "aborted"
        return {"jaxkv_load": outcome}

    def _to_send(self, request: Request, has_blocks: bool) -> bool:
        """The bookkeeping of a finished request; True when the producer hands it over."""
        from vllm.v1.request import RequestStatus

        params = request.kv_transfer_params
        request_id = request.request_id
        self._requests.pop(request_id, None)
        if not params:
            return False
        if params.get("do_remote_prefill"):
            # A consumer request finished (aborted) before its read was scheduled: release
            # the producer's blocks now rather than at the end of their lease.
            params["do_remote_prefill"] = False
            self._meta.to_recv.append(_Recv(request_id, dict(params), [], 0, True))
            return False
        if not params.get("do_remote_decode"):
            if request_id in self._loading:  # aborted while reading: stop the read
                self._loading.discard(request_id)
                self._meta.to_cancel.add(request_id)
            return False
        published = request_id in self._published
        self._published.discard(request_id)
        done = request.status in (
            RequestStatus.FINISHED_LENGTH_CAPPED,
            RequestStatus.FINISHED_STOPPED,
        )
        if not done or not has_blocks:
            if published:
                self._meta.to_abort.add(request_id)
            return False
        if not published:
            log.error("request %s finished before its prefill completed: not sent", request_id)
            return False
        return True

    def update_connector_output(self, connector_output: Any) -> None:
        """Forgets the consumer reads the workers reported over, noting each one's outcome
        (reported in the request's output by `request_finished`)."""
        finished = set(connector_output.finished_recving or ())
        failed = set(getattr(connector_output, "failed_recving", None) or ())
        self._loading -= finished
        for request_id in finished:
            outcome = self._load_outcomes.get(request_id)
            if outcome is None or outcome["status"] != "reading":
                continue
            if request_id in failed:
                outcome["status"] = "failed"
                log.warning(
                    "request %s: reading its %d prompt tokens from the prefill engine failed; "
                    "vLLM recomputes them (kv_load_failure_policy)", request_id,
                    outcome["remote_tokens"])
            else:
                outcome["status"] = "loaded"

    # -- worker side ----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: Any) -> None:
        """Registers this worker's cache with a new `jaxkv.transfer.TransferEngine` (a hybrid
        model: one cache per KV cache group, each a cache group of the engine).

        Args:
          kv_caches: a `jaxkv.PagedKVCache`, or a mapping with one `PagedKVCache` value, or
            GPU vLLM's mapping layer name -> torch tensor, adopted zero-copy (DLPack) with the
            layout its strides show (`jaxkv.integrations._torch`; per KV cache group for a
            hybrid model). Several KV cache groups and JAX caches: a mapping of layer names
            (those of vLLM's ``kv_cache_config``) to the `PagedKVCache` of their group, which
            holds all of the group's layers (one entry per group suffices), or a sequence of
            one `PagedKVCache` per group, in group order.

        Raises:
          TypeError: anything else, e.g. several caches for one group's layers.
          ValueError: a cache's block size is not its group's, a layer name of no group, a
            group without (or with several) caches, or torch caches jaxkv cannot adopt
            without a copy (the message says why).
        """
        from jaxkv import EngineConfig
        from jaxkv.integrations import _torch

        if _torch.is_torch_caches(kv_caches):
            caches = self._adopt_torch(kv_caches)
        else:
            caches = self._group_caches(kv_caches)
        s = self.settings
        configs = {}
        for g, cache in enumerate(caches):
            block_size = self._group_block_sizes[g] if self.grouped else self.block_size
            if cache.spec.block_size != block_size:
                where = f" of KV cache group {g}" if self.grouped else ""
                raise ValueError(
                    f"the cache's block size {cache.spec.block_size}{where} is not vLLM's "
                    f"{block_size}"
                )
            spec = cache.spec
            if s.tp_rank is not None and not spec.mla:
                # one TP rank's cache holds its heads only; the engine describes the model's
                spec = spec.replace(num_kv_heads=s.num_kv_heads or spec.num_kv_heads * s.tp_size)
            configs[group_name(g)] = EngineConfig(spec, s.tp_size, s.pp_size)
        engine = self._new_engine(configs)
        for g, cache in enumerate(caches):
            engine.register_cache(cache, tp_rank=s.tp_rank,
                                  group=group_name(g) if self.grouped else None)

    def _adopt_torch(self, kv_caches: Mapping[str, Any]) -> list[Any]:
        """Per KV cache group, the `PagedKVCache` over GPU vLLM's torch tensors of its layers
        (zero-copy, `jaxkv.integrations._torch.adopt_for_vllm`)."""
        from jaxkv.integrations import _torch

        s = self.settings
        if not self.grouped:
            return [_torch.adopt_for_vllm(kv_caches, self._vllm_config, self._kv_cache_config,
                                          s.tp_size, s.tp_rank)]
        known = {layer for layers in self._group_layers for layer in layers}
        unknown = sorted(set(kv_caches) - known)
        if unknown:
            raise ValueError(
                f"register_kv_caches: layers {unknown} are in no KV cache group of vLLM's "
                "kv_cache_config"
            )
        return [
            _torch.adopt_for_vllm(
                {name: kv_caches[name] for name in layers if name in kv_caches},
                self._vllm_config, self._kv_cache_config, s.tp_size, s.tp_rank, group=g)
            for g, layers in enumerate(self._group_layers)
        ]

    def _group_caches(self, kv_caches: Any) -> list[Any]:
        """Per KV cache group, the `PagedKVCache` of its layers (see `register_kv_caches`):
        what vLLM hands over, split by group, each group's part adopted by `_adopt_group`."""
        groups = self._split_by_group(kv_caches)
        if not self.grouped:
            return [_adopt_group(groups[0], kv_caches, None)]
        return [_adopt_group(values, kv_caches, g) for g, values in enumerate(groups)]

    def _split_by_group(self, kv_caches: Any) -> list[list[Any]]:
        """Per KV cache group, the values handed over for its layers (in the order given; an
        object given for several layers once).

        Raises:
          ValueError: a layer name of no group, or a group without any value.
          TypeError: neither a mapping nor one value per group.
        """
        if not self.grouped:
            if isinstance(kv_caches, Mapping):
                return [list(kv_caches.values())]
            return [[kv_caches]]
        if isinstance(kv_caches, Mapping):
            group_of = {
                layer: g for g, layers in enumerate(self._group_layers) for layer in layers
            }
            found: list[dict[int, Any]] = [{} for _ in range(self.num_groups)]
            for layer, value in kv_caches.items():
                if layer not in group_of:
                    raise ValueError(
                        f"register_kv_caches: layer {layer!r} is in no KV cache group of "
                        "vLLM's kv_cache_config"
                    )
                found[group_of[layer]].setdefault(id(value), value)
            for g, by_id in enumerate(found):
                if not by_id:
                    raise ValueError(
                        f"register_kv_caches: KV cache group {g} got 0 caches (none of its "
                        f"layers {self._group_layers[g]} was given)"
                    )
            return [list(by_id.values()) for by_id in found]
        if isinstance(kv_caches, (list, tuple)) and len(kv_caches) == self.num_groups:
            return [[cache] for cache in kv_caches]
        raise TypeError(
            f"JaxKVConnector.register_kv_caches takes, for {self.num_groups} KV cache groups, a "
            f"mapping of layer names to caches or {self.num_groups} caches, got "
            f"{type(kv_caches).__name__}"
        )

    def _new_engine(self, configs: Any) -> TransferEngine:
        """Closes the current transfer engine, if any, and starts one for `configs` (an
        `EngineConfig`, or per group name its config for a hybrid model), each group on its
        side-channel address, with the settings' timeouts and transport."""
        from jaxkv.transfer import TransferEngine

        s = self.settings
        if s.side_channel:
            addresses = [a[s.process_index] for a in s.group_addresses(self.num_groups)]
        else:
            addresses = [("127.0.0.1", 0)] * self.num_groups
        self.shutdown()
        common = dict(
            lease_s=s.lease_s,
            read_timeout_s=s.read_timeout_s,
            handshake_timeout_s=s.handshake_timeout_s,
            early_read_grace_s=s.early_read_grace_s,
            **s.engine_options(),
        )
        if not self.grouped:
            (config,) = configs.values() if isinstance(configs, Mapping) else (configs,)
            host, port = addresses[0]
            self.engine = TransferEngine(s.engine_id, config, host=host, port=port, **common)
            return self.engine
        self.engine = TransferEngine(
            s.engine_id,
            configs,
            group_options={
                group_name(g): {"host": host, "port": port}
                for g, (host, port) in enumerate(addresses)
            },
            **common,
        )
        return self.engine

    @property
    def address(self) -> tuple[str, int]:
        """This worker's side-channel address (after `register_kv_caches`; the first group's
        for a hybrid model)."""
        return self.addresses[0]

    @property
    def addresses(self) -> list[tuple[str, int]]:
        """Per KV cache group, this worker's side-channel address (after
        `register_kv_caches`)."""
        return list(self._engine().addresses.values())

    @property
    def cache(self) -> Any:
        """The registered cache, current version (reads rewrite it in place)."""
        return self._engine().caches[0]

    @property
    def caches(self) -> list[Any]:
        """Per KV cache group, the registered cache, current version."""
        return list(self._engine().caches)

    def update_cache(self, cache: Any) -> None:
        """Hands the cache's new version (after a donated update) to the transfer engine
        (hybrid models: to that of the group that registered it)."""
        self._engine().update_cache(cache)

    def _engine(self) -> TransferEngine:
        if self.engine is None:
            raise RuntimeError("register_kv_caches first")
        return self.engine

    def start_load_kv(self, forward_context: ForwardContext | None = None, **kwargs: Any) -> None:
        """Starts this step's reads (consumer) and releases aborted requests (producer)."""
        if not self.has_connector_metadata():
            return
        engine = self._engine()
        meta: JaxKVConnectorMetadata = self._get_connector_metadata()
        for request_id in meta.to_abort:
            engine.abort_request(request_id)
            self._aborted.add(request_id)
        self._awaiting_send |= meta.to_send
        for consumer_id in meta.to_cancel:
            if consumer_id in self._reading:
                self._cancelled.add(consumer_id)
                engine.abort_request(consumer_id)
        for recv in meta.to_recv:
            self._start_read(recv)

    def _start_read(self, recv: _Recv) -> None:
        if self.grouped:
            self._start_group_read(recv)
            return
        engine = self._engine()
        try:
            params = transfer_params_from_dict(recv.params)
            if recv.release_only:  # an empty read: the producer is only notified
                remote_ids, local_ids = params.block_ids, list[int]()
            else:
                remote_ids, local_ids = read_plan_ids(
                    params.block_ids,
                    int(recv.params["remote_num_tokens"]),
                    int(recv.params["remote_block_size"]),
                    recv.local_block_ids,
                    self.block_size,
                    recv.num_local_hit_blocks,
                )
        except ValueError as error:
            log.error("request %s: %s", recv.request_id, error)
            self._fail_now(recv)
            return
        if recv.request_id in self._reading:
            log.error("request %s: its read is already in flight", recv.request_id)
            self._fail_now(recv)
            return
        # Keyed by the consumer's request id: several consumer requests may read one
        # producer request at once (the producer frees it after `reads_per_request`).
        params = msgspec.structs.replace(params, block_ids=remote_ids)
        self._reading[recv.request_id] = params.request_id
        if recv.release_only:
            self._releasing.add(recv.request_id)
        try:
            engine.start_read(params, local_ids, read_id=recv.request_id)
        except Exception as error:  # noqa: BLE001 - a transport error fails this read only
            # (e.g. NIXL refusing to post to a producer that disconnected): the engine holds
            # the read already; stopped, it is reported failed with its blocks by the next poll.
            log.error("request %s: starting its read failed: %s", recv.request_id, error)
            engine.abort_request(recv.request_id)

    def _start_group_read(self, recv: _Recv) -> None:
        """`_start_read` of a hybrid model: one read per KV cache group."""
        engine = self._engine()
        transfer: GroupedTransfer | None = None
        try:
            transfer = GroupedTransfer.from_dict(recv.params)
            if transfer.num_groups != self.num_groups:
                raise ValueError(
                    f"the producer has {transfer.num_groups} KV cache groups, this engine "
                    f"{self.num_groups}"
                )
            groups, local = {}, {}
            for g in range(self.num_groups):
                name = group_name(g)
                remote = transfer.params.groups[name]
                if recv.release_only:  # an empty read: the producer is only notified
                    remote_ids, local_ids = list(remote.block_ids), list[int]()
                else:
                    first, ids = recv.local_groups[g]
                    remote_ids, local_ids = group_read_plan_ids(
                        remote.block_ids,
                        transfer.first_blocks[g],
                        transfer.num_tokens,
                        transfer.block_sizes[g],
                        ids,
                        first,
                        self._group_block_sizes[g],
                    )
                groups[name] = msgspec.structs.replace(remote, block_ids=remote_ids)
                local[name] = local_ids
        except (ValueError, IndexError) as error:
            log.error("request %s: %s", recv.request_id, error)
            self._fail_now(recv)
            if (
                transfer is not None
                and transfer.num_groups == self.num_groups
                and recv.request_id not in self._reading
            ):
                # the producer's blocks are released at once (an empty read of every group
                # notifies it) rather than held until their lease expires
                self._reading[recv.request_id] = transfer.params.request_id
                self._releasing.add(recv.request_id)
                engine.start_read(
                    transfer.params, {name: [] for name in transfer.params.groups},
                    read_id=recv.request_id,
                )
            return
        if recv.request_id in self._reading:
            log.error("request %s: its read is already in flight", recv.request_id)
            self._fail_now(recv)
            return
        self._reading[recv.request_id] = transfer.params.request_id
        if recv.release_only:
            self._releasing.add(recv.request_id)
        # a group failing to start is reported failed by the next poll (the others stopped)
        engine.start_read(
            msgspec.structs.replace(transfer.params, groups=groups), local,
            read_id=recv.request_id,
        )

    def _fail_now(self, recv: _Recv) -> None:
        if recv.release_only:
            return
        if self.grouped:
            for g, (_, ids) in enumerate(recv.local_groups):
                self._group_load_errors.setdefault(g, set()).update(ids)
        else:
            self._load_errors.update(recv.local_block_ids)
        self._failed_now.add(recv.request_id)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: a request's reads complete (`get_finished`) before vLLM
        schedules it."""

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs) -> None:
        """Nothing per layer: the blocks are pinned whole in `wait_for_save`."""

    def wait_for_save(self) -> None:
        """Pins the blocks of the requests whose prefill completed this step."""
        if not self.has_connector_metadata():
            return
        meta: JaxKVConnectorMetadata = self._get_connector_metadata()
        for request_id, block_ids in meta.to_publish.items():
            self._engine().publish_request(
                request_id, block_ids, expected_reads=self.settings.reads_per_request
            )
        for request_id, group_ids in meta.to_publish_groups.items():
            self._engine().publish_request(
                request_id,
                {group_name(g): ids for g, ids in enumerate(group_ids)},
                expected_reads=self.settings.reads_per_request,
            )

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """Polls the transfer engine: (requests whose blocks may be freed, reads finished or
        failed)."""
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending, results.finished_recving

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Polls the transfer engine; failed reads are in both ``finished_recving`` and
        ``failed_recving`` (their blocks in `get_block_ids_with_load_errors`)."""
        results = KVConnectorTransferResults()
        results.finished_recving |= self._failed_now
        results.failed_recving |= self._failed_now
        self._failed_now = set()
        if self.engine is None:
            return results
        polled = self._poll_engine()
        for consumer_id in polled.finished:  # read ids: the consumer's request ids
            self._cancelled.discard(consumer_id)
            if self._reading.pop(consumer_id, None) is not None and (
                consumer_id not in self._releasing
            ):
                results.finished_recving.add(consumer_id)
            self._releasing.discard(consumer_id)
        for failure in polled.failed:
            consumer_id = failure.request_id
            known = self._reading.pop(consumer_id, None) is not None
            if consumer_id in self._releasing:
                self._releasing.discard(consumer_id)
                continue
            if consumer_id in self._cancelled:  # aborted: vLLM frees the blocks
                self._cancelled.discard(consumer_id)
                if known:
                    results.finished_recving.add(consumer_id)
                continue
            log.warning("read of %s failed: %s", consumer_id, failure.reason)
            if self.grouped:
                for name, ids in failure.invalid_by_group.items():
                    self._group_load_errors.setdefault(int(name), set()).update(ids)
            else:
                self._load_errors.update(failure.invalid_block_ids)
            if known:
                results.finished_recving.add(consumer_id)
                results.failed_recving.add(consumer_id)
        self._freeable.update(polled.freeable)
        for request_id in self._freeable & self._aborted:
            self._freeable.discard(request_id)
            self._aborted.discard(request_id)
        sending = self._freeable & self._awaiting_send
        self._freeable -= sending
        self._awaiting_send -= sending
        results.finished_sending |= sending
        return results

    def _poll_engine(self) -> PollResult:
        """One `TransferEngine.poll` (subclasses add what they polled earlier)."""
        return self._engine().poll()

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Local blocks of failed reads since the last call.

        Hybrid models: always empty. vLLM 0.33 refuses block-level load errors with several
        KV cache groups (it cannot map them to requests); a failed read is reported in
        ``failed_recving`` (`get_transfer_results`) and vLLM recomputes the request. Its
        blocks per group: `get_group_block_ids_with_load_errors`.
        """
        errors, self._load_errors = self._load_errors, set()
        return errors

    def get_group_block_ids_with_load_errors(self) -> dict[int, set[int]]:
        """Hybrid models: per KV cache group, the local blocks of failed reads since the last
        call (a group that failed, and the groups stopped or finished with it)."""
        errors, self._group_load_errors = self._group_load_errors, {}
        return errors

    def get_kv_connector_stats(self) -> JaxKVConnectorStats | None:
        """The reads finished or failed since the last call (None when there were none).

        Hybrid models: each KV cache group's read counts as one transfer."""
        if self.engine is None:
            return None
        if self.grouped:
            return self._group_stats()
        stats = self.engine.stats
        seen = self._stats_seen
        self._stats_seen = (stats.requests_total, stats.bytes_total, stats.failed_transfers)
        new = stats.requests_total - seen[0]
        out = JaxKVConnectorStats()
        out.data["transfers"] = new
        out.data["bytes"] = stats.bytes_total - seen[1]
        out.data["failed"] = stats.failed_transfers - seen[2]
        out.data["duration_s"] = sum(r.duration_s for r in stats.records[-new:]) if new else 0.0
        return None if out.is_empty() else out

    def _group_stats(self) -> JaxKVConnectorStats | None:
        engine = self._engine()
        out = JaxKVConnectorStats()
        for name in engine.groups:
            stats = engine.stats_of(name)
            seen = self._group_stats_seen.get(name, (0, 0, 0))
            self._group_stats_seen[name] = (
                stats.requests_total, stats.bytes_total, stats.failed_transfers
            )
            new = stats.requests_total - seen[0]
            out.data["transfers"] += new
            out.data["bytes"] += stats.bytes_total - seen[1]
            out.data["failed"] += stats.failed_transfers - seen[2]
            if new:
                out.data["duration_s"] += sum(r.duration_s for r in stats.records[-new:])
        return None if out.is_empty() else out

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> JaxKVConnectorStats:
        """vLLM rebuilds the workers' stats from their dicts with this."""
        return JaxKVConnectorStats(data=dict(data) if data else {})

    @classmethod
    def build_prom_metrics(
        cls, vllm_config, metric_types, labelnames, per_engine_labelvalues
    ) -> JaxKVPromMetrics:
        """vLLM's Prometheus hook: `JaxKVPromMetrics`."""
        return JaxKVPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        """Closes the transfer engine (its side channel and NIXL agent)."""
        if self.engine is not None:
            self.engine.close()
            self.engine = None


class JaxKVConnector(JaxKVConnectorBase, SupportsHMA):
    """vLLM KV connector moving KV blocks with jaxkv (see the module docstring), for one or
    several KV cache groups (vLLM's hybrid allocator: full attention and sliding window).

    Args:
      vllm_config: the engine's config; its ``kv_transfer_config.kv_connector_extra_config``
        holds the `ConnectorSettings`.
      role: `KVConnectorRole.SCHEDULER` or `KVConnectorRole.WORKER`.
      kv_cache_config: vLLM's cache config: its KV cache groups (None: one group). The
        worker side needs it for several groups (which layers form each).

    Raises:
      ValueError: bad settings.
    """

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's hook with the hybrid allocator: `request_finished` with block ids per KV
        cache group (one group: exactly `request_finished`)."""
        if not self.grouped:
            return self.request_finished(request, block_ids[0])
        return self._request_finished_groups(request, block_ids)


def _check_groups(groups: list[Any]) -> None:
    """Refuses KV cache groups the connector cannot move: groups vLLM excludes from KV
    transfer (scratch buffers) and groups of no attention layers (e.g. Mamba state)."""
    from vllm.v1.kv_cache_interface import AttentionSpec

    for g, group in enumerate(groups):
        if not getattr(group, "enable_kv_transfer", True):
            raise ValueError(
                f"KV cache group {g} ({group.layer_names[:2]}...) is excluded from KV transfer "
                "by vLLM: JaxKVConnector moves every group of a hybrid model"
            )
        if not isinstance(group.kv_cache_spec, AttentionSpec):
            raise ValueError(
                f"KV cache group {g} holds {type(group.kv_cache_spec).__name__}: JaxKVConnector "
                "moves attention KV groups only (full attention, sliding window)"
            )


def _blocks_to_fill(group: Any) -> tuple[int, tuple[int, ...]]:
    """A consumer's blocks of one KV cache group that a read fills: the trailing blocks that
    are neither a local hit (hashed) nor out of the sliding window (vLLM's null block), with
    the token-order position of the first."""
    ids: list[int] = []
    for block in reversed(group):
        if block.is_null or block.block_hash is not None:
            break
        ids.append(block.block_id)
    ids.reverse()
    return len(group) - len(ids), tuple(ids)


def _adopt_group(values: list[Any], given: Any, group: int | None) -> Any:
    """What vLLM's ``register_kv_caches`` hands over for the layers of one KV cache group,
    as the `jaxkv.PagedKVCache` (arrays and spec) the transfer engine registers: today one
    `PagedKVCache` that holds all of the group's layers.

    Args:
      values: the distinct values given for the group's layers, in the order given.
      given: everything `register_kv_caches` got (named in errors).
      group: the group's index (None: the only group).

    Raises:
      TypeError: anything else.
    """
    from jaxkv import PagedKVCache

    if len(values) == 1 and isinstance(values[0], PagedKVCache):
        return values[0]
    if group is None:
        raise TypeError(
            "JaxKVConnector.register_kv_caches takes a jaxkv.PagedKVCache (or a mapping "
            f"with one), got {type(given).__name__}"
        )
    kinds = sorted({type(v).__name__ for v in values})
    raise TypeError(
        f"register_kv_caches: KV cache group {group} got {len(values)} distinct value(s) of "
        f"type {kinds} for its layers; it takes one jaxkv.PagedKVCache holding all of the "
        "group's layers"
    )


BLOCK_FORMAT_KEY = "jaxkv_block_format"
"""The key of a producer's params that names how its blocks hold tokens (see
`_block_format`)."""


def _confine_jax_to_worker() -> None:
    """Keeps JAX in a vLLM worker process to what the worker owns, before JAX starts its
    backends (called first by the worker side of the connector).

    Left alone, JAX's GPU backend preallocates 75% of every GPU it sees, and sees every GPU
    visible to the process: in a vLLM worker, whose KV cache vLLM sized to the memory it left
    free and whose siblings own the other GPUs, that runs out of memory or takes the siblings'
    memory. So, unless the user chose otherwise:

    * ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` (kept if set; read when JAX creates its GPU
      client);
    * ``jax_cuda_visible_devices`` = torch's current CUDA device, the worker's GPU (kept if not
      ``"all"``, JAX's default; nothing is set where torch has no CUDA device, e.g. vLLM's CPU
      platform).

    If JAX's backends have started already (the process used JAX before the connector), these
    can no longer apply; a warning says so where a GPU backend started.
    """
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        if set(xla_bridge.backends()) & {"cuda", "gpu", "rocm"}:
            log.warning(
                "jaxkv: JAX's GPU backend started before the vLLM connector's worker side: it "
                "cannot turn off JAX's GPU preallocation (XLA_PYTHON_CLIENT_PREALLOCATE) or keep "
                "JAX to this worker's GPU (jax_cuda_visible_devices) any more; set them before "
                "JAX starts")
        return
    torch = sys.modules.get("torch")  # vLLM imported it; no import of torch of our own
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return
    if xla_bridge.CUDA_VISIBLE_DEVICES.value == "all":
        # torch's ordinal counts the GPUs of CUDA_VISIBLE_DEVICES, as JAX's setting does.
        jax.config.update("jax_cuda_visible_devices", str(torch.cuda.current_device()))


def _block_format() -> str | None:
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
