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

Structure (as vLLM's own NIXL connector): `JaxKVConnector` is a facade that hands each call
to one of two objects, by role: in the scheduler process a `JaxKVScheduler`
(``connector_scheduler``: what the workers do each step, the producer's params, each consumer
read's outcome), in each worker process a `JaxKVWorker` (``connector_worker``: the transfer
engine, the reads and hand-overs in flight). The step's `JaxKVConnectorMetadata` is all that
passes from one to the other. One KV cache group and several take the same path on both sides.

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

from typing import TYPE_CHECKING, Any

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorRole,
        KVConnectorTransferResults,
        SupportsHMA,
    )
except ImportError as _error:  # pragma: no cover - depends on the environment
    raise ImportError(
        "jaxkv.integrations.vllm needs vLLM 0.33 (pip install vllm==0.33.0; "
        "scripts/setup_integrations.sh builds a test environment)"
    ) from _error

from jaxkv.integrations._params import ConnectorSettings
from jaxkv.integrations._vllm_meta import BLOCK_FORMAT_KEY as BLOCK_FORMAT_KEY
from jaxkv.integrations._vllm_meta import (
    CacheGroups,
    JaxKVConnectorMetadata,
    JaxKVConnectorStats,
    JaxKVPromMetrics,
)
from jaxkv.integrations._vllm_meta import _Recv as _Recv
from jaxkv.integrations._vllm_scheduler import JaxKVScheduler
from jaxkv.integrations._vllm_worker import JaxKVWorker, confine_jax_to_worker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
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

class JaxKVConnectorBase(KVConnectorBase_V1):
    """The connector (`JaxKVConnector` without vLLM's `SupportsHMA` mark): a facade that
    hands each `KVConnectorBase_V1` call to its scheduler-side object
    (`connector_scheduler`, a `JaxKVScheduler`, in the scheduler process) or its worker-side
    object (`connector_worker`, a `JaxKVWorker`, in each worker process).

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
            confine_jax_to_worker()
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = self._kv_transfer_config
        self.settings = ConnectorSettings.from_dict(
            transfer.kv_connector_extra_config or {}, transfer.engine_id
        )
        num_groups = len(kv_cache_config.kv_cache_groups) if kv_cache_config is not None else 0
        if num_groups > 1 and not isinstance(self, SupportsHMA):
            raise ValueError(
                f"{type(self).__name__} supports one KV cache group (disable vLLM's hybrid "
                "allocator)"
            )
        self.groups = CacheGroups.of(vllm_config, kv_cache_config, self.settings.tp_size)
        self.is_producer = transfer.is_kv_producer
        self.connector_scheduler: JaxKVScheduler | None = None
        self.connector_worker: JaxKVWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = JaxKVScheduler(self.settings, self.groups,
                                                      self.is_producer)
        else:
            self.connector_worker = self._make_worker(vllm_config, kv_cache_config)

    def _make_worker(
        self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None
    ) -> JaxKVWorker:
        """The worker-side object (a subclass's connector builds its own kind)."""
        return JaxKVWorker(vllm_config, kv_cache_config, self.settings, self.groups)

    @property
    def grouped(self) -> bool:
        """Several KV cache groups (vLLM's hybrid allocator)."""
        return self.groups.grouped

    @property
    def num_groups(self) -> int:
        """How many KV cache groups (at least 1)."""
        return self.groups.num_groups

    @property
    def block_size(self) -> int:
        """vLLM's block size."""
        return self.groups.block_size

    def _scheduler(self) -> JaxKVScheduler:
        if self.connector_scheduler is None:
            raise RuntimeError("a scheduler-side call on the connector's worker side")
        return self.connector_scheduler

    def _worker(self) -> JaxKVWorker:
        if self.connector_worker is None:
            raise RuntimeError("a worker-side call on the connector's scheduler side")
        return self.connector_worker

    def _meta(self) -> JaxKVConnectorMetadata | None:
        """The step's metadata bound by vLLM (None: none bound)."""
        if not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        return meta if isinstance(meta, JaxKVConnectorMetadata) else None

    # -- scheduler side -------------------------------------------------------------------

    @property
    def block_format(self) -> str | None:
        """How this engine's blocks hold tokens (None: vLLM's token-major layout)."""
        return self._scheduler().block_format

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        """vLLM binds its KV cache manager (the scheduler side reads request blocks)."""
        super().bind_kv_cache_manager(kv_cache_manager)
        if self.connector_scheduler is not None:
            self.connector_scheduler.bind_kv_cache_manager(kv_cache_manager)

    def on_new_request(self, request: Request) -> None:
        """A producer of a model with Mamba layers computes all but the prompt's last token
        (`JaxKVScheduler.on_new_request`)."""
        self._scheduler().on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """The remote prompt tokens beyond the local hit (loaded asynchronously)."""
        return self._scheduler().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Records a consumer read (the blocks to fill) or a producer request to publish."""
        self._scheduler().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> JaxKVConnectorMetadata:
        """The step's work for the workers (resets the scheduler side's pending state)."""
        return self._scheduler().build_connector_meta(scheduler_output)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        """Hybrid models: a read fills every KV cache group (vLLM skips zeroing them)."""
        loaded = self._scheduler().loaded_group_ids()
        return super().get_loaded_kv_cache_group_ids(request) if loaded is None else loaded

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Producer: keeps a finished prefill's blocks and returns the consumer's params.
        Consumer: returns ``{"jaxkv_load": outcome}``, what the request's read did, so that
        vLLM's output shows it."""
        return self._scheduler().request_finished(request, (block_ids,))

    def update_connector_output(self, connector_output: Any) -> None:
        """Forgets the consumer reads the workers reported over, noting each one's outcome
        (reported in the request's output by `request_finished`)."""
        self._scheduler().update_connector_output(connector_output)

    # -- worker side ----------------------------------------------------------------------

    @property
    def engine(self) -> TransferEngine | None:
        """The worker's transfer engine (None before `register_kv_caches`, and on the
        scheduler side)."""
        return None if self.connector_worker is None else self.connector_worker.engine

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
        self._worker().register_kv_caches(kv_caches)

    @property
    def address(self) -> tuple[str, int]:
        """This worker's side-channel address (after `register_kv_caches`; the first group's
        for a hybrid model)."""
        return self._worker().address

    @property
    def addresses(self) -> list[tuple[str, int]]:
        """Per KV cache group, this worker's side-channel address (after
        `register_kv_caches`)."""
        return self._worker().addresses

    @property
    def cache(self) -> Any:
        """The registered cache, current version (reads rewrite it in place)."""
        return self._worker().cache

    @property
    def caches(self) -> list[Any]:
        """Per KV cache group, the registered cache, current version."""
        return self._worker().caches

    def update_cache(self, cache: Any) -> None:
        """Hands the cache's new version (after a donated update) to the transfer engine
        (hybrid models: to that of the group that registered it)."""
        self._worker().update_cache(cache)

    def start_load_kv(self, forward_context: ForwardContext | None = None, **kwargs: Any) -> None:
        """Starts this step's reads (consumer) and releases aborted requests (producer)."""
        meta = self._meta()
        if meta is not None:
            self._worker().start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: a request's reads complete (`get_finished`) before vLLM
        schedules it."""

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs) -> None:
        """Nothing per layer: the blocks are pinned whole in `wait_for_save`."""

    def wait_for_save(self) -> None:
        """Pins the blocks of the requests whose prefill completed this step."""
        meta = self._meta()
        if meta is not None:
            self._worker().wait_for_save(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """Polls the transfer engine: (requests whose blocks may be freed, reads finished or
        failed)."""
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending, results.finished_recving

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Polls the transfer engine; failed reads are in both ``finished_recving`` and
        ``failed_recving`` (their blocks in `get_block_ids_with_load_errors`)."""
        return self._worker().get_transfer_results(self._meta())

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Local blocks of failed reads since the last call.

        Hybrid models: always empty. vLLM 0.33 refuses block-level load errors with several
        KV cache groups (it cannot map them to requests); a failed read is reported in
        ``failed_recving`` (`get_transfer_results`) and vLLM recomputes the request. Its
        blocks per group: `get_group_block_ids_with_load_errors`.
        """
        return self._worker().get_block_ids_with_load_errors()

    def get_group_block_ids_with_load_errors(self) -> dict[int, set[int]]:
        """Hybrid models: per KV cache group, the local blocks of failed reads since the last
        call (a group that failed, and the groups stopped or finished with it)."""
        return self._worker().get_group_block_ids_with_load_errors()

    def get_kv_connector_stats(self) -> JaxKVConnectorStats | None:
        """The reads finished or failed since the last call (None when there were none).

        Hybrid models: each KV cache group's read counts as one transfer."""
        if self.connector_worker is None:
            return None
        return self.connector_worker.get_kv_connector_stats()

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
        if self.connector_worker is not None:
            self.connector_worker.shutdown()


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
        return self._scheduler().request_finished(request, block_ids)
