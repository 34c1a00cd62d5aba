"""`JaxKVWorker`: the worker side of the vLLM connector (`jaxkv.integrations.vllm`).

It owns the worker's `jaxkv.transfer.TransferEngine` (one cache group per vLLM KV cache
group), carries out each step's `JaxKVConnectorMetadata` (pins, reads, releases, stops) and
reports what finished. One KV cache group and several go through the same path: a read is
planned per group (`_plan_read`; `jaxkv.integrations._params` reads the ``kv_transfer_params``
shapes) and posted as one engine read; failures, load errors and counters are kept per group.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import types
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import msgspec
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from jaxkv.integrations._mamba import StateComponent, component_group_name
from jaxkv.integrations._params import (
    ConnectorSettings,
    GroupedTransfer,
    group_name,
    group_read_plan_ids,
    read_plan_ids,
    transfer_params_from_dict,
)
from jaxkv.integrations._vllm_meta import (
    CacheGroups,
    JaxKVConnectorMetadata,
    JaxKVConnectorStats,
    _Recv,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from jaxkv import EngineConfig
    from jaxkv.transfer import PollResult, TransferEngine, TransferParams

__all__ = ["JaxKVWorker", "confine_jax_to_worker"]

log = logging.getLogger("jaxkv.integrations.vllm")


@dataclasses.dataclass(frozen=True)
class _ReadPlan:
    """One consumer read as the transfer engine takes it: the producer's params (cut to the
    blocks read) and, per engine group name, the local blocks to fill."""

    params: TransferParams
    local: dict[str, list[int]]


class _PlanError(ValueError):
    """A read that cannot be planned; `release` (when the params could be read) is the empty
    read that releases the producer's blocks at once."""

    def __init__(self, message: str, release: _ReadPlan | None):
        super().__init__(message)
        self.release = release


class JaxKVWorker:
    """The connector's worker-side state: the transfer engine and the reads and hand-overs in
    flight.

    Args:
      vllm_config: the engine's config (torch caches are adopted with it).
      kv_cache_config: vLLM's cache config (None: one group).
      settings: the connector's settings.
      groups: the engine's KV cache groups.

    Example:
      >>> worker = JaxKVWorker(vllm_config, None, settings, groups)  # doctest: +SKIP
      >>> worker.register_kv_caches(cache)  # doctest: +SKIP
      >>> worker.start_load_kv(meta)  # doctest: +SKIP
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        kv_cache_config: KVCacheConfig | None,
        settings: ConnectorSettings,
        groups: CacheGroups,
    ):
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.settings = settings
        self.groups = groups
        self.engine: TransferEngine | None = None
        self._reading: dict[str, str] = {}  # consumer request id -> producer request id
        self._releasing: set[str] = set()  # consumer request ids read only to release them
        self._awaiting_send: set[str] = set()
        self._freeable: set[str] = set()
        self._aborted: set[str] = set()
        self._failed_now: set[str] = set()  # reads refused before they started
        self._cancelled: set[str] = set()  # consumer ids of reads stopped by an abort
        self._load_errors: dict[int, set[int]] = {}  # per group index
        self._stats_seen: dict[str, tuple[int, int, int]] = {}  # per engine group

    # -- what is in flight (read-only views) ----------------------------------------------

    @property
    def reading(self) -> Mapping[str, str]:
        """Reads in flight: consumer request id -> producer request id."""
        return types.MappingProxyType(self._reading)

    @property
    def releasing(self) -> frozenset[str]:
        """Consumer request ids read only to release the producer's blocks."""
        return frozenset(self._releasing)

    @property
    def cancelled(self) -> frozenset[str]:
        """Consumer request ids whose read an abort stopped, not yet reported."""
        return frozenset(self._cancelled)

    @property
    def awaiting_send(self) -> frozenset[str]:
        """Producer requests handed to consumers, not yet reported sent."""
        return frozenset(self._awaiting_send)

    @property
    def freeable(self) -> frozenset[str]:
        """Producer requests the engine freed, not yet handed over by the scheduler."""
        return frozenset(self._freeable)

    # -- registration ---------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: Any) -> None:
        """Registers this worker's cache with a new `jaxkv.transfer.TransferEngine` (a hybrid
        model: one cache per KV cache group, each a cache group of the engine).

        Args:
          kv_caches: a `jaxkv.PagedKVCache`, or a mapping with one `PagedKVCache` value, or
            GPU vLLM's mapping layer name -> torch tensor, adopted zero-copy (DLPack);
            several KV cache groups: a mapping of layer names to the `PagedKVCache` of their
            group, or a sequence of one `PagedKVCache` per group (see
            `JaxKVConnector.register_kv_caches`).

        Raises:
          TypeError: anything else, e.g. several caches for one group's layers.
          ValueError: a cache's block size is not its group's, a layer name of no group, a
            group without caches, or torch caches jaxkv cannot adopt without a copy.
        """
        from jaxkv import EngineConfig
        from jaxkv.integrations import _torch

        if _torch.is_torch_caches(kv_caches):
            caches = self._adopt_torch(kv_caches)
        else:
            caches = self._group_caches(kv_caches)
        s = self.settings
        configs: dict[str, EngineConfig] = {}
        registered: list[tuple[str, Any]] = []
        for g, cache in enumerate(caches):
            components = self.groups.state_of(g)
            if components is not None:  # a Mamba group: one engine group per state component
                for name, part, config in self._state_configs(g, components, cache):
                    configs[name] = config
                    registered.append((name, part))
                continue
            block_size = self.groups.block_sizes[g]
            if cache.spec.block_size != block_size:
                where = f" of KV cache group {g}" if self.groups.grouped else ""
                raise ValueError(
                    f"the cache's block size {cache.spec.block_size}{where} is not vLLM's "
                    f"{block_size}"
                )
            spec = cache.spec
            if s.tp_rank is not None and not spec.mla:
                # one TP rank's cache holds its heads only; the engine describes the model's
                spec = spec.replace(num_kv_heads=s.num_kv_heads or spec.num_kv_heads * s.tp_size)
            configs[group_name(g)] = EngineConfig(spec, s.tp_size, s.pp_size)
            registered.append((group_name(g), cache))
        engine = self.new_engine(list(configs.values()), list(configs))
        for name, cache in registered:
            # one plain group: the engine's default group
            group = name if self.groups.grouped else engine.groups[0]
            engine.register_cache(cache, tp_rank=s.tp_rank, group=group)

    def _state_configs(
        self, group: int, components: tuple[StateComponent, ...], caches: Any
    ) -> list[tuple[str, Any, EngineConfig]]:
        """A Mamba group's state caches (one `jaxkv.PagedKVCache` per state component, in
        `jaxkv.integrations._mamba.state_components` order) as (engine group, cache, config).

        Raises:
          TypeError: not one cache per component.
          ValueError: a cache whose spec is not its component's (heads, head size, dtype,
            one state per block; any layout).
        """
        from jaxkv import EngineConfig, PagedKVCache

        s = self.settings
        names = [c.name for c in components]
        if not isinstance(caches, (list, tuple)) or len(caches) != len(components) or not all(
            isinstance(c, PagedKVCache) for c in caches
        ):
            raise TypeError(
                f"register_kv_caches: KV cache group {group} holds Mamba state: it takes one "
                f"jaxkv.PagedKVCache per state component {names} (a list or tuple), got "
                f"{type(caches).__name__}"
            )
        out = []
        for component, cache in zip(components, caches):
            want = component.spec(cache.spec.num_layers, cache.spec.layout)
            local = want
            if s.tp_rank is not None and not want.mla:  # one rank's cache holds its heads
                local = want.replace(num_kv_heads=want.heads_per_rank(s.tp_size))
            if cache.spec != local:
                raise ValueError(
                    f"register_kv_caches: the cache of state component {component.name!r} of "
                    f"KV cache group {group} is {cache.spec}, expected {local} (vLLM's "
                    "MambaSpec, one state per block)"
                )
            out.append((component_group_name(group, component), cache,
                        EngineConfig(want, s.tp_size, s.pp_size)))
        return out

    def _adopt_torch(self, kv_caches: Mapping[str, Any]) -> list[Any]:
        """Per KV cache group, the `PagedKVCache` over GPU vLLM's torch tensors of its layers
        (zero-copy, `jaxkv.integrations._torch.adopt_for_vllm`)."""
        from jaxkv.integrations import _torch

        s = self.settings
        if self.groups.has_state:
            raise ValueError(
                "register_kv_caches: torch caches of a model with Mamba layers (vLLM's "
                "MambaSpec groups) are not adopted (their conv and SSM states share one page "
                "per block); register jaxkv.PagedKVCache objects, one per state component"
            )
        if not self.groups.grouped:
            return [_torch.adopt_for_vllm(kv_caches, self.vllm_config, self.kv_cache_config,
                                          s.tp_size, s.tp_rank)]
        known = {layer for layers in self.groups.layers for layer in layers}
        unknown = sorted(set(kv_caches) - known)
        if unknown:
            raise ValueError(
                f"register_kv_caches: layers {unknown} are in no KV cache group of vLLM's "
                "kv_cache_config"
            )
        return [
            _torch.adopt_for_vllm(
                {name: kv_caches[name] for name in layers if name in kv_caches},
                self.vllm_config, self.kv_cache_config, s.tp_size, s.tp_rank, group=g)
            for g, layers in enumerate(self.groups.layers)
        ]

    def _group_caches(self, kv_caches: Any) -> list[Any]:
        """Per KV cache group, the `PagedKVCache` of its layers: what vLLM hands over, split
        by group, each group's part adopted by `_adopt_group`."""
        parts = self._split_by_group(kv_caches)
        if not self.groups.grouped:
            return [_adopt_group(parts[0], kv_caches, None)]
        return [
            _adopt_group(values, kv_caches, g, self.groups.state_of(g) is not None)
            for g, values in enumerate(parts)
        ]

    def _split_by_group(self, kv_caches: Any) -> list[list[Any]]:
        """Per KV cache group, the values handed over for its layers (in the order given; an
        object given for several layers once).

        Raises:
          ValueError: a layer name of no group, or a group without any value.
          TypeError: neither a mapping nor one value per group.
        """
        num_groups = self.groups.num_groups
        if not self.groups.grouped:
            if isinstance(kv_caches, Mapping):
                return [list(kv_caches.values())]
            return [[kv_caches]]
        layers = self.groups.layers
        if isinstance(kv_caches, Mapping):
            group_of = {layer: g for g, names in enumerate(layers) for layer in names}
            found: list[dict[int, Any]] = [{} for _ in range(num_groups)]
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
                        f"layers {list(layers[g])} was given)"
                    )
            return [list(by_id.values()) for by_id in found]
        if isinstance(kv_caches, (list, tuple)) and len(kv_caches) == num_groups:
            return [[cache] for cache in kv_caches]
        raise TypeError(
            f"JaxKVConnector.register_kv_caches takes, for {num_groups} KV cache groups, a "
            f"mapping of layer names to caches or {num_groups} caches, got "
            f"{type(kv_caches).__name__}"
        )

    def new_engine(
        self, configs: list[EngineConfig], names: list[str] | None = None
    ) -> TransferEngine:
        """Closes the current transfer engine, if any, and starts one with a cache group per
        KV cache group (`configs`, in group order; a Mamba group: one per state component,
        named by `names`), each on its side-channel address (the `j`-th group's: the
        settings' port + `j`, or `group_ports`), with the settings' timeouts and transport.

        Returns:
          The new engine (also `engine`).
        """
        from jaxkv.transfer import TransferEngine

        s = self.settings
        if s.side_channel:
            addresses = [a[s.process_index] for a in s.group_addresses(len(configs))]
        else:
            addresses = [("127.0.0.1", 0)] * len(configs)
        self.shutdown()
        common: dict[str, Any] = dict(
            lease_s=s.lease_s,
            read_timeout_s=s.read_timeout_s,
            handshake_timeout_s=s.handshake_timeout_s,
            early_read_grace_s=s.early_read_grace_s,
            **s.engine_options(),
        )
        if len(configs) == 1 and not self.groups.grouped:  # the engine's default group
            host, port = addresses[0]
            self.engine = TransferEngine(s.engine_id, configs[0], host=host, port=port,
                                         **common)
            return self.engine
        names = names or [group_name(g) for g in range(len(configs))]
        self.engine = TransferEngine(
            s.engine_id,
            dict(zip(names, configs, strict=True)),
            group_options={
                name: {"host": host, "port": port}
                for name, (host, port) in zip(names, addresses, strict=True)
            },
            **common,
        )
        return self.engine

    def require_engine(self) -> TransferEngine:
        """The transfer engine.

        Raises:
          RuntimeError: no cache registered yet.
        """
        if self.engine is None:
            raise RuntimeError("register_kv_caches first")
        return self.engine

    # -- the step -------------------------------------------------------------------------

    def start_load_kv(self, meta: JaxKVConnectorMetadata) -> None:
        """Starts the step's reads (consumer), stops the aborted ones and releases aborted
        requests (producer)."""
        engine = self.require_engine()
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

    def wait_for_save(self, meta: JaxKVConnectorMetadata) -> None:
        """Pins the blocks of the requests whose prefill completed this step."""
        engine = self.require_engine()
        published = {rid: [ids] for rid, ids in meta.to_publish.items()}
        published.update(meta.to_publish_groups)
        for request_id, group_ids in published.items():
            if self.groups.grouped:  # a Mamba group's state block: for each component
                by_name = {name: group_ids[g] for g, name in self.groups.engine_groups()}
            else:
                by_name = dict(zip(engine.groups, group_ids, strict=True))
            engine.publish_request(
                request_id, by_name, expected_reads=self.settings.reads_per_request
            )

    def _start_read(self, recv: _Recv) -> None:
        """Plans and posts one consumer read (every KV cache group); a read that cannot be
        planned fails at once (and releases the producer's blocks where its params allow)."""
        try:
            plan = self._plan_read(recv)
        except _PlanError as error:
            log.error("request %s: %s", recv.request_id, error)
            self._fail_now(recv)
            if error.release is not None and recv.request_id not in self._reading:
                # the producer's blocks are released at once (an empty read notifies it)
                # rather than held until their lease expires
                self._post(recv.request_id, error.release, release_only=True)
            return
        if recv.request_id in self._reading:
            log.error("request %s: its read is already in flight", recv.request_id)
            self._fail_now(recv)
            return
        self._post(recv.request_id, plan, release_only=recv.release_only)

    def _post(self, read_id: str, plan: _ReadPlan, release_only: bool) -> None:
        """Starts `plan` under the consumer's request id: several consumer requests may read
        one producer request at once (the producer frees it after `reads_per_request`)."""
        engine = self.require_engine()
        self._reading[read_id] = plan.params.request_id
        if release_only:
            self._releasing.add(read_id)
        try:
            engine.start_read(plan.params, plan.local, read_id=read_id)
        except Exception as error:  # noqa: BLE001 - a transport error fails this read only
            # (e.g. NIXL refusing to post to a producer that disconnected): the engine holds
            # the read already; stopped, it is reported failed with its blocks by the next poll.
            log.error("request %s: starting its read failed: %s", read_id, error)
            engine.abort_request(read_id)

    def _plan_read(self, recv: _Recv) -> _ReadPlan:
        """The read of `recv` per engine group: the remote blocks its local ones cover.

        Raises:
          _PlanError: params that cannot be read or planned for this engine.
        """
        names = self.require_engine().groups
        if not self.groups.grouped:
            try:
                params = transfer_params_from_dict(recv.params)
            except ValueError as error:
                raise _PlanError(str(error), None) from error
            release = _ReadPlan(params, {names[0]: []})
            if recv.release_only:  # an empty read: the producer is only notified
                return release
            try:
                remote_ids, local_ids = read_plan_ids(
                    params.block_ids,
                    int(recv.params["remote_num_tokens"]),
                    int(recv.params["remote_block_size"]),
                    recv.local_block_ids,
                    self.groups.block_size,
                    recv.num_local_hit_blocks,
                )
            except ValueError as error:
                raise _PlanError(str(error), release) from error
            return _ReadPlan(msgspec.structs.replace(params, block_ids=remote_ids),
                             {names[0]: local_ids})
        try:
            transfer = GroupedTransfer.from_dict(recv.params)
        except (ValueError, IndexError) as error:
            raise _PlanError(str(error), None) from error
        if transfer.num_groups != self.groups.num_groups:
            raise _PlanError(
                f"the producer has {transfer.num_groups} KV cache groups, this engine "
                f"{self.groups.num_groups}", None)
        release = _ReadPlan(transfer.params, {name: [] for name in transfer.params.groups})
        mine = [tuple(c.name for c in self.groups.state_of(g) or ()) or None
                for g in range(self.groups.num_groups)]
        theirs = [transfer.state_of(g) for g in range(transfer.num_groups)]
        if mine != theirs:
            raise _PlanError(
                f"the producer's Mamba state components per KV cache group {theirs} are not "
                f"this engine's {mine}", release)
        if recv.release_only:
            return release
        remote_groups, local = {}, {}
        try:
            for g in range(self.groups.num_groups):
                first, ids = recv.local_groups[g]
                if mine[g] is not None:  # a Mamba group: its running state, per component
                    for name in transfer.engine_names(g):
                        remote = transfer.params.groups[name]
                        take = bool(ids) and bool(remote.block_ids)
                        remote_groups[name] = msgspec.structs.replace(
                            remote, block_ids=list(remote.block_ids[:1]) if take else [])
                        local[name] = list(ids[:1]) if take else []
                    continue
                name = group_name(g)
                remote = transfer.params.groups[name]
                remote_ids, local[name] = group_read_plan_ids(
                    remote.block_ids,
                    transfer.first_blocks[g],
                    transfer.num_tokens,
                    transfer.block_sizes[g],
                    ids,
                    first,
                    self.groups.block_sizes[g],
                )
                remote_groups[name] = msgspec.structs.replace(remote, block_ids=remote_ids)
        except (ValueError, IndexError) as error:
            raise _PlanError(str(error), release) from error
        return _ReadPlan(msgspec.structs.replace(transfer.params, groups=remote_groups), local)

    def _fail_now(self, recv: _Recv) -> None:
        if recv.release_only:
            return
        for g, (_, ids) in enumerate(recv.groups()):
            self._load_errors.setdefault(g, set()).update(ids)
        self._failed_now.add(recv.request_id)

    def get_transfer_results(
        self, meta: JaxKVConnectorMetadata | None = None
    ) -> KVConnectorTransferResults:
        """Polls the transfer engine: finished reads, failed ones (in both sets, their
        blocks in the load errors) and producer requests whose blocks may be freed.

        Args:
          meta: the step's metadata, if bound (a subclass decides from it what to sync).
        """
        results = KVConnectorTransferResults()
        results.finished_recving |= self._failed_now
        results.failed_recving |= self._failed_now
        self._failed_now = set()
        if self.engine is None:
            return results
        polled = self.poll()
        names = self.engine.groups
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
            by_group = failure.invalid_by_group or {names[0]: failure.invalid_block_ids}
            vllm_group = {name: g for g, name in self.groups.engine_groups()}
            for name, ids in by_group.items():
                g = vllm_group.get(name, names.index(name))
                self._load_errors.setdefault(g, set()).update(ids)
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

    def poll(self) -> PollResult:
        """One `TransferEngine.poll` (a subclass adds what it polled earlier)."""
        return self.require_engine().poll()

    def get_block_ids_with_load_errors(self) -> set[int]:
        """One KV cache group: the local blocks of failed reads since the last call. Several:
        always empty (vLLM 0.33 refuses block-level load errors with several groups; see
        `get_group_block_ids_with_load_errors`)."""
        if self.groups.num_groups > 1:
            return set()
        return self._load_errors.pop(0, set())

    def get_group_block_ids_with_load_errors(self) -> dict[int, set[int]]:
        """Several KV cache groups: per group, the local blocks of failed reads since the
        last call (one group: empty, see `get_block_ids_with_load_errors`)."""
        if self.groups.num_groups == 1:
            return {}
        errors, self._load_errors = self._load_errors, {}
        return errors

    def get_kv_connector_stats(self) -> JaxKVConnectorStats | None:
        """The reads finished or failed since the last call, summed over the engine's groups
        (each group's read counts as one transfer); None when there were none."""
        if self.engine is None:
            return None
        out = JaxKVConnectorStats()
        for name in self.engine.groups:
            stats = self.engine.stats_of(name)
            seen = self._stats_seen.get(name, (0, 0, 0))
            self._stats_seen[name] = (
                stats.requests_total, stats.bytes_total, stats.failed_transfers
            )
            new = stats.requests_total - seen[0]
            out.data["transfers"] += new
            out.data["bytes"] += stats.bytes_total - seen[1]
            out.data["failed"] += stats.failed_transfers - seen[2]
            if new:
                out.data["duration_s"] += sum(r.duration_s for r in stats.records[-new:])
        return None if out.is_empty() else out

    # -- the registered caches ------------------------------------------------------------

    @property
    def address(self) -> tuple[str, int]:
        """This worker's side-channel address (the first group's)."""
        return self.addresses[0]

    @property
    def addresses(self) -> list[tuple[str, int]]:
        """Per KV cache group, this worker's side-channel address."""
        return list(self.require_engine().addresses.values())

    @property
    def cache(self) -> Any:
        """The registered cache, current version (reads rewrite it in place)."""
        return self.require_engine().caches[0]

    @property
    def caches(self) -> list[Any]:
        """Per KV cache group, the registered cache, current version."""
        return list(self.require_engine().caches)

    def update_cache(self, cache: Any) -> None:
        """Hands the cache's new version (after a donated update) to the transfer engine."""
        self.require_engine().update_cache(cache)

    def shutdown(self) -> None:
        """Closes the transfer engine (its side channel and NIXL agent)."""
        if self.engine is not None:
            self.engine.close()
            self.engine = None


def _adopt_group(values: list[Any], given: Any, group: int | None, state: bool = False) -> Any:
    """What vLLM's ``register_kv_caches`` hands over for the layers of one KV cache group,
    as the `jaxkv.PagedKVCache` the transfer engine registers (one that holds all of the
    group's layers).

    Args:
      values: the distinct values given for the group's layers, in the order given.
      given: everything `register_kv_caches` got (named in errors).
      group: the group's index (None: the only group).

    Raises:
      TypeError: anything else.
    """
    from jaxkv import PagedKVCache

    if state and len(values) == 1:  # a Mamba group: its state caches (`_state_configs`)
        return values[0]
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


def confine_jax_to_worker() -> None:
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
