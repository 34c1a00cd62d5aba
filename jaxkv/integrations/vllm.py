"""`JaxKVConnector`: vLLM's KV connector API (0.33, `KVConnectorBase_V1`) on `jaxkv.transfer`.

A prefill engine (``kv_role="kv_producer"``) and a decode engine (``kv_consumer``) move the KV
blocks of each request with `jaxkv.transfer.KVTransferEngine`: the decode side READs them over
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
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import msgspec

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
        KVConnectorTransferResults,
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
    read_plan_ids,
    transfer_params_from_dict,
    transfer_params_to_dict,
)
from jaxkv.transfer import make_transfer_params

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

    from jaxkv.transfer import KVTransferEngine

__all__ = [
    "JaxKVConnector",
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


@dataclasses.dataclass
class JaxKVConnectorMetadata(KVConnectorMetadata):
    """What the scheduler side tells the workers each step.

    Attributes:
      to_publish: producer requests whose prefill completes this step -> their block ids.
      to_send: producer requests handed to consumers (vLLM holds their blocks until
        `get_finished` reports them).
      to_abort: producer requests published but not handed off (aborted): release them.
      to_recv: consumer reads to start.
      to_cancel: consumer requests aborted while their read is in flight: stop it (vLLM
        frees their blocks once `get_finished` reports the read over).
    """

    to_publish: dict[str, list[int]] = dataclasses.field(default_factory=dict)
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


class JaxKVConnector(KVConnectorBase_V1):
    """vLLM KV connector moving KV blocks with jaxkv (see the module docstring).

    Args:
      vllm_config: the engine's config; its ``kv_transfer_config.kv_connector_extra_config``
        holds the `ConnectorSettings`.
      role: `KVConnectorRole.SCHEDULER` or `KVConnectorRole.WORKER`.
      kv_cache_config: vLLM's cache config (one KV cache group is supported).

    Raises:
      ValueError: bad settings, or several KV cache groups.
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ):
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = self._kv_transfer_config
        self.settings = ConnectorSettings.from_dict(
            transfer.kv_connector_extra_config or {}, transfer.engine_id
        )
        if kv_cache_config is not None and len(kv_cache_config.kv_cache_groups) > 1:
            raise ValueError(
                "JaxKVConnector supports one KV cache group (disable vLLM's hybrid allocator)"
            )
        self.block_size = vllm_config.cache_config.block_size
        self.is_producer = transfer.is_kv_producer
        # scheduler side
        self._requests: dict[str, Request] = {}  # producer requests not yet published
        self._published: set[str] = set()
        self._loading: set[str] = set()  # consumer requests whose read is in flight
        self._meta = JaxKVConnectorMetadata()
        # worker side
        self.engine: KVTransferEngine | None = None
        self._reading: dict[str, str] = {}  # consumer request id -> producer request id
        self._releasing: set[str] = set()  # consumer request ids read only to release them
        self._awaiting_send: set[str] = set()
        self._freeable: set[str] = set()
        self._aborted: set[str] = set()
        self._load_errors: set[int] = set()
        self._failed_now: set[str] = set()  # reads refused before they started
        self._cancelled: set[str] = set()  # consumer ids of reads stopped by an abort
        self._stats_seen = (0, 0, 0)  # engine totals at the last stats call

    # -- scheduler side -------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """The remote prompt tokens beyond the local hit (loaded asynchronously)."""
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return 0, False
        remote_tokens = min(int(params.get("remote_num_tokens", 0)), request.num_prompt_tokens)
        count = remote_tokens - num_computed_tokens
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
        if num_external_tokens > 0:
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
                ids = self._kv_cache_manager.get_block_ids(request_id)[0]
                needed = math.ceil(request.num_prompt_tokens / self.block_size)
                meta.to_publish[request_id] = list(ids[:needed])
                self._published.add(request_id)
                del self._requests[request_id]
        return meta

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Producer: keeps a finished prefill's blocks and returns the consumer's params."""
        from vllm.v1.request import RequestStatus

        params = request.kv_transfer_params
        request_id = request.request_id
        self._requests.pop(request_id, None)
        if not params:
            return False, None
        if params.get("do_remote_prefill"):
            # A consumer request finished (aborted) before its read was scheduled: release
            # the producer's blocks now rather than at the end of their lease.
            params["do_remote_prefill"] = False
            self._meta.to_recv.append(_Recv(request_id, dict(params), [], 0, True))
            return False, None
        if not params.get("do_remote_decode"):
            if request_id in self._loading:  # aborted while reading: stop the read
                self._loading.discard(request_id)
                self._meta.to_cancel.add(request_id)
            return False, None
        published = request_id in self._published
        self._published.discard(request_id)
        done = request.status in (
            RequestStatus.FINISHED_LENGTH_CAPPED,
            RequestStatus.FINISHED_STOPPED,
        )
        if not done or not block_ids:
            if published:
                self._meta.to_abort.add(request_id)
            return False, None
        if not published:
            log.error("request %s finished before its prefill completed: not sent", request_id)
            return False, None
        if not self.settings.side_channel:
            raise ValueError("a kv_producer needs side_channel addresses in its settings")
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
        return True, transfer_params_to_dict(transfer, num_tokens, self.block_size)

    def update_connector_output(self, connector_output: Any) -> None:
        """Forgets the consumer reads the workers reported over."""
        self._loading -= set(connector_output.finished_recving or ())

    # -- worker side ----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: Any) -> None:
        """Registers this worker's cache with a new `KVTransferEngine`.

        Args:
          kv_caches: a `jaxkv.PagedKVCache`, or a mapping with one `PagedKVCache` value, or
            GPU vLLM's mapping layer name -> torch tensor, adopted zero-copy (DLPack) with the
            layout its strides show (`jaxkv.integrations._torch`).

        Raises:
          TypeError: anything else.
          ValueError: torch caches jaxkv cannot adopt without a copy (the message says why).
        """
        from jaxkv import EngineConfig, PagedKVCache
        from jaxkv.integrations import _torch

        if _torch.is_torch_caches(kv_caches):
            kv_caches = _torch.adopt_for_vllm(
                kv_caches, self._vllm_config, self._kv_cache_config,
                self.settings.tp_size, self.settings.tp_rank,
            )
        cache = kv_caches
        if isinstance(kv_caches, Mapping):
            values = list(kv_caches.values())
            cache = values[0] if len(values) == 1 else None
        if not isinstance(cache, PagedKVCache):
            raise TypeError(
                "JaxKVConnector.register_kv_caches takes a jaxkv.PagedKVCache (or a mapping "
                f"with one, or vLLM's torch tensors), got {type(kv_caches).__name__}"
            )
        if cache.spec.block_size != self.block_size:
            raise ValueError(
                f"the cache's block size {cache.spec.block_size} is not vLLM's {self.block_size}"
            )
        s = self.settings
        spec = cache.spec
        if s.tp_rank is not None and not spec.mla:
            # one TP rank's cache holds its heads only; the engine describes the model's
            spec = spec.replace(num_kv_heads=s.num_kv_heads or spec.num_kv_heads * s.tp_size)
        self._new_engine(EngineConfig(spec, s.tp_size, s.pp_size))
        self._engine().register_cache(cache, tp_rank=s.tp_rank)

    def _new_engine(self, config: Any) -> KVTransferEngine:
        """Closes the current transfer engine, if any, and starts one for `config` on this
        worker's side-channel address, with the settings' timeouts and transport."""
        from jaxkv.transfer import KVTransferEngine

        s = self.settings
        host, port = (
            s.side_channel[s.process_index] if s.side_channel else ("127.0.0.1", 0)
        )
        options = s.engine_options()
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        self.engine = KVTransferEngine(
            s.engine_id,
            config,
            host=host,
            port=port,
            lease_s=s.lease_s,
            read_timeout_s=s.read_timeout_s,
            handshake_timeout_s=s.handshake_timeout_s,
            early_read_grace_s=s.early_read_grace_s,
            **options,
        )
        return self.engine

    @property
    def address(self) -> tuple[str, int]:
        """This worker's side-channel address (after `register_kv_caches`)."""
        return self._engine().address

    @property
    def cache(self) -> Any:
        """The registered cache, current version (reads rewrite it in place)."""
        return self._engine().caches[0]

    def update_cache(self, cache: Any) -> None:
        """Hands the cache's new version (after a donated update) to the transfer engine."""
        self._engine().update_cache(cache)

    def _engine(self):
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

    def _fail_now(self, recv: _Recv) -> None:
        if recv.release_only:
            return
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

    def _poll_engine(self) -> Any:
        """One `KVTransferEngine.poll` (subclasses add what they polled earlier)."""
        return self._engine().poll()

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Local blocks of failed reads since the last call."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def get_kv_connector_stats(self) -> JaxKVConnectorStats | None:
        """The reads finished or failed since the last call (None when there were none)."""
        if self.engine is None:
            return None
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

