"""`TransferEngine`: the one engine of KV-block transfers between serving engines.

One class covers every shape of engine:

* **one cache group** (the default: one `EngineConfig`) or **several** (a hybrid model's
  full-attention and sliding-window groups: a mapping of group names to configs). A request
  publishes its blocks of every group; a read is finished when every group's read is, and
  failed (with each group's blocks invalid) when any group's read failed.
* **one process** (``coordinator=None``) or **several processes of one JAX program**
  (``coordinator=JaxDistributed()``: a multi-controller engine whose processes each own their
  addressable shards and coordinate through ``jax.distributed``'s key-value store; process 0
  serves the merged metadata and reports the engine-level outcomes).

Underneath, each group of each process runs its own protocol core (the producer and consumer
state machines, a transport endpoint and a side channel: `jaxkv.transfer._engine`) and, in a
multi-controller engine, its own process coordination (`jaxkv.transfer._multicontroller`).
Why a core per group rather than one core for all groups: the groups differ in block size,
layout and layers, which every plan, lease and post-processing step is keyed by; keeping them
apart keeps each core's state machine exactly the one-group machine that the fault and
campaign tests exercise, and this class only joins outcomes.

Every result is a `PollResult`, every failure a `FailedRead`, every request's hand-off a
`TransferParams` (with ``groups`` for several groups).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from jaxkv._parallel import EngineConfig
from jaxkv.transfer._engine import KVTransferEngine
from jaxkv.transfer._metadata import EngineMetadata
from jaxkv.transfer._multicontroller import KeyValueClient, MultiControllerEngine
from jaxkv.transfer._params import FailedRead, PollResult, TransferParams
from jaxkv.transfer._stats import TransferStats

__all__ = ["DEFAULT_GROUP", "JaxDistributed", "TransferEngine"]

DEFAULT_GROUP = "kv"
"""The name of the only cache group of an engine created with one `EngineConfig`."""


@dataclasses.dataclass(frozen=True)
class JaxDistributed:
    """The processes of one engine coordinate through ``jax.distributed`` (a multi-controller
    engine: every process calls the same `TransferEngine` methods with the same arguments).

    Attributes:
      timeout_s: bound of every wait on other processes (metadata, publication).
      host, port: where process 0 serves the merged metadata (port 0: a free one).
      store_interval_s: `TransferEngine.poll` reads the key-value store at most this often
        (each read is a round trip to the coordination service); writes are never delayed.
      allow_unauthenticated: serve a non-loopback `host` without a deployment key.
      client, process_id, num_processes: for tests; default ``jax.distributed``'s.

    Example:
      >>> JaxDistributed(timeout_s=30.0).timeout_s
      30.0
    """

    timeout_s: float = 60.0
    host: str = "127.0.0.1"
    port: int = 0
    store_interval_s: float = 0.002
    allow_unauthenticated: bool = False
    client: KeyValueClient | None = None
    process_id: int | None = None
    num_processes: int | None = None


@dataclasses.dataclass
class _ReadOfGroups:
    """A read of an engine with several groups: each group's outcome so far."""

    local: dict[str, tuple[int, ...]]  # group -> the local blocks it fills
    outcome: dict[str, bool | FailedRead | None]  # None: in flight; True: finished
    reason: str = ""
    invalid: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)


class TransferEngine:
    """One process's part of an engine's KV transfers (see the module docstring).

    Args:
      engine_id: the engine's stable name, shared by all of its processes. Group ``g`` of an
        engine with several groups is the protocol engine ``f"{engine_id}.{g}"``.
      config: the engine's `EngineConfig`, or per cache group name its `EngineConfig`.
      coordinator: None (one process) or `JaxDistributed` (several processes of one JAX
        program, one cache group; call `publish_metadata` in every process after
        registering).
      group_options: per group name, keyword arguments for that group only (e.g.
        ``{"port": 5601}``: each group listens on its own side channel), over `options`.
      **options: the transfer options of every group: ``host``, ``port``, ``lease_s``,
        ``read_timeout_s``, ``handshake_timeout_s``, ``handshake_retries``,
        ``host_staging``, ``block_hashing``, ``progress_interval_s``, ``progress_idle_s``,
        ``early_read_grace_s``, ``transport`` (``"nixl"``, ``"jax"``, ``"auto"``),
        ``control``, ``jax_transport_options``, ``agent_options``, ``auth_key``,
        ``allow_unauthenticated``, ``digests``, ``formatted_reads``, ``format_pool_bytes``
        — see docs/transfer.md ("Engine options").

    Raises:
      ValueError: no group, options of unknown groups, bad options, or a coordinator with
        several groups (not supported yet).

    Example:
      >>> from jaxkv import EngineConfig, KVCacheSpec
      >>> spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4)
      >>> with TransferEngine("prefill", EngineConfig(spec, 1), transport="jax") as engine:
      ...     engine.groups
      ('kv',)
    """

    def __init__(
        self,
        engine_id: str,
        config: EngineConfig | Mapping[str, EngineConfig],
        *,
        coordinator: JaxDistributed | None = None,
        group_options: Mapping[str, Mapping[str, Any]] | None = None,
        **options: Any,
    ):
        configs = {DEFAULT_GROUP: config} if isinstance(config, EngineConfig) else dict(config)
        if not configs:
            raise ValueError("at least one cache group")
        unknown = sorted(set(group_options or {}) - set(configs))
        if unknown:
            raise ValueError(f"group_options name unknown groups {unknown}")
        if coordinator is not None and len(configs) > 1:
            # Each group's coordination reports engine-level outcomes on process 0 only; the
            # join of several groups' outcomes per process is not built yet.
            raise ValueError("a multi-controller engine (coordinator) has one cache group; "
                             f"got groups {sorted(configs)}")
        self.engine_id = engine_id
        self.coordinator = coordinator
        self._single = len(configs) == 1
        self._cores: dict[str, KVTransferEngine] = {}
        self._processes: dict[str, MultiControllerEngine] = {}
        try:
            for group, group_config in configs.items():
                name = engine_id if self._single else f"{engine_id}.{group}"
                kwargs = {**options, **(group_options or {}).get(group, {})}
                self._cores[group] = KVTransferEngine(name, group_config, **kwargs)
                if coordinator is not None:
                    self._processes[group] = MultiControllerEngine(
                        self._cores[group],
                        timeout_s=coordinator.timeout_s,
                        host=coordinator.host,
                        port=coordinator.port,
                        store_interval_s=coordinator.store_interval_s,
                        client=coordinator.client,
                        process_id=coordinator.process_id,
                        num_processes=coordinator.num_processes,
                        allow_unauthenticated=coordinator.allow_unauthenticated,
                    )
        except BaseException:
            self.close()
            raise
        self._reads: dict[str, _ReadOfGroups] = {}  # several groups: read id -> outcomes
        self._pinned: dict[str, set[str]] = {}  # several groups: request -> groups not freed

    # -- description ----------------------------------------------------------------------

    @property
    def groups(self) -> tuple[str, ...]:
        """The cache group names, in the order given (one group: ``("kv",)``)."""
        return tuple(self._cores)

    @property
    def num_processes(self) -> int:
        """How many processes the engine spans (1 without a coordinator)."""
        processes = self._processes.get(self.groups[0])
        return 1 if processes is None else processes.num_processes

    @property
    def process_id(self) -> int:
        """This process's index in the engine (0 without a coordinator)."""
        processes = self._processes.get(self.groups[0])
        return 0 if processes is None else processes.process_id

    def _group(self, group: str | None) -> str:
        if group is None:
            if not self._single:
                raise ValueError(f"name the cache group: the engine has groups {self.groups}")
            return self.groups[0]
        if group not in self._cores:
            raise KeyError(f"no cache group {group!r}; groups are {list(self.groups)}")
        return group

    def _front(self, group: str) -> KVTransferEngine | MultiControllerEngine:
        """Where a group's requests go: its process coordination, else its core."""
        return self._processes.get(group) or self._cores[group]

    def config_of(self, group: str | None = None) -> EngineConfig:
        """The `EngineConfig` of a group (None: the only group).

        Raises:
          ValueError: no group named with several groups. KeyError: an unknown group.
        """
        return self._cores[self._group(group)].config

    @property
    def config(self) -> EngineConfig:
        """The `EngineConfig` of an engine with one group (`config_of` for several)."""
        return self.config_of(None)

    def address_of(self, group: str | None = None) -> tuple[str, int]:
        """Where consumers fetch a group's metadata: this process's side channel, or in a
        multi-controller engine process 0's merged-metadata server (after
        `publish_metadata`)."""
        return self._front(self._group(group)).address

    @property
    def address(self) -> tuple[str, int]:
        """`address_of` the only group."""
        return self.address_of(None)

    @property
    def addresses(self) -> dict[str, tuple[str, int]]:
        """Per group, `address_of` it."""
        return {group: self.address_of(group) for group in self.groups}

    def metadata_of(self, group: str | None = None) -> EngineMetadata:
        """A group's metadata (multi-controller: merged over every process)."""
        return self._front(self._group(group)).metadata

    @property
    def metadata(self) -> EngineMetadata:
        """`metadata_of` the only group."""
        return self.metadata_of(None)

    def stats_of(self, group: str | None = None) -> TransferStats:
        """A group's `TransferStats` (this process's transfers)."""
        return self._cores[self._group(group)].stats

    @property
    def stats(self) -> TransferStats:
        """`stats_of` the only group."""
        return self.stats_of(None)

    @property
    def generation(self) -> int:
        """This process's generation of the only group (bumped when registrations change)."""
        return self._cores[self._group(None)].generation

    @property
    def local_ranks(self) -> tuple[int, ...]:
        """The ranks whose shards this process registered (the only group)."""
        return self._cores[self._group(None)].local_ranks

    @property
    def transport_name(self) -> str:
        """What moves the KV: ``"nixl"`` or ``"jax"`` (``transport="auto"`` resolved)."""
        return self._cores[self.groups[0]].transport.name

    @property
    def registers_memory(self) -> bool:
        """Whether the transport addresses the registered buffers (NIXL: they must stay in
        place) rather than moving arrays (the JAX transport)."""
        return self._cores[self.groups[0]].registers_memory

    @property
    def deployment_key(self) -> Any:
        """The deployment key the engine proves and asks for (None: none)."""
        return self._cores[self.groups[0]].deployment_key

    # -- registration ---------------------------------------------------------------------

    def register_cache(self, cache: Any, pp_rank: int = 0, tp_rank: int | None = None, *,
                       group: str | None = None) -> None:
        """Registers every shard of a `PagedKVCache` this process holds.

        Args:
          cache: the cache of pipeline rank `pp_rank`: sharded over the engine's TP ranks
            (multi-controller: a cache over the global mesh; this process's shards are
            registered) or one TP rank's cache (`tp_rank` given).
          pp_rank, tp_rank: which ranks the cache holds.
          group: the cache group (needed with several groups).

        Raises:
          ValueError: the cache does not match the group's config (nothing registered).
        """
        self._cores[self._group(group)].register_cache(cache, pp_rank=pp_rank, tp_rank=tp_rank)

    def publish_metadata(self) -> dict[str, EngineMetadata]:
        """Multi-controller engines: a collective (every process, after its `register_cache`
        calls and again after each re-registration) that agrees on one generation per group
        and serves the merged metadata from process 0. One-process engines publish at
        registration: this returns their metadata.

        Returns:
          Per group, its (merged) metadata.

        Raises:
          TimeoutError, MetadataError: another process did not take part in time, or the
            parts do not make one engine.
        """
        out = {}
        for group in self.groups:
            processes = self._processes.get(group)
            out[group] = (processes.publish_metadata() if processes is not None
                          else self._cores[group].metadata)
        return out

    def update_cache(self, cache: Any, *, group: str | None = None) -> None:
        """Makes `cache` (the output of a donated update of a registered cache) the current
        version; with several groups and no `group`, the group is found by its buffers.

        Raises:
          BufferMovedError: a buffer moved (with a transport that registers memory).
          ValueError: no group registered a cache with these arrays and devices.
        """
        if group is None and not self._single:
            group = self.group_of(cache)
        self._cores[self._group(group)].update_cache(cache)

    def check_registrations(self, cache: Any) -> None:
        """Raises `BufferMovedError` if a registered shard of `cache` moved."""
        for core in self._cores.values():
            core.check_registrations(cache)

    def group_of(self, cache: Any) -> str:
        """The group whose registered cache has `cache`'s buffers.

        Raises:
          ValueError: no group registered a cache with these buffers.
        """
        # Groups' caches may have equal shapes on the same devices: a cache is known by its
        # buffers' addresses (a donated, in-place update keeps them).
        for group, core in self._cores.items():
            if core.holds(cache):
                return group
        raise ValueError("no group registered a cache with these buffers (was the cache "
                         "donated to every update?)")

    def caches_of(self, group: str | None = None) -> tuple[Any, ...]:
        """A group's registered caches (one per PP rank this process holds), current."""
        return self._cores[self._group(group)].caches

    @property
    def caches(self) -> tuple[Any, ...]:
        """Every registered cache, group by group, current versions."""
        return tuple(c for group in self.groups for c in self._cores[group].caches)

    # -- producer -------------------------------------------------------------------------

    def publish_request(
        self,
        request_id: str,
        block_ids: Sequence[int] | Mapping[str, Sequence[int]],
        lease_s: float | None = None,
        *,
        layerwise: bool = False,
        expected_reads: int = 1,
    ) -> TransferParams:
        """Pins a request's blocks until `expected_reads` consumer reads finished (in every
        group and process) or the lease expired.

        Args:
          request_id: the request.
          block_ids: its blocks in token order; with several groups, per group name.
          lease_s: the lease (default: the engine's ``lease_s``).
          layerwise: the blocks are written later and announced with `publish_layers` or
            `jaxkv.transfer.publish_layer_in_jit` (one group only).
          expected_reads: distinct consumer reads (read ids) before the blocks are freeable.

        Returns:
          The `TransferParams` to hand to the consumer (several groups: ``groups`` holds each
          group's).

        Raises:
          ValueError: block ids of other groups than the engine's, or a layer-wise request
            of several groups.
          RuntimeError, TimeoutError: multi-controller: a process could not publish (the
            request is aborted everywhere).

        Example:
          >>> params = engine.publish_request("req-1", [3, 4, 5])  # doctest: +SKIP
        """
        if self._single:
            if isinstance(block_ids, Mapping):
                if set(block_ids) != set(self.groups):
                    raise ValueError(f"block ids for groups {sorted(block_ids)}, the engine "
                                     f"has {list(self.groups)}")
                block_ids = block_ids[self.groups[0]]
            ids: Sequence[int] = block_ids
            return self._front(self.groups[0]).publish_request(
                request_id, ids, lease_s, layerwise=layerwise, expected_reads=expected_reads)
        if not isinstance(block_ids, Mapping) or set(block_ids) != set(self.groups):
            given = sorted(block_ids) if isinstance(block_ids, Mapping) else "one list"
            raise ValueError(f"block ids for groups {given}, the engine has "
                             f"{list(self.groups)}")
        if layerwise:
            raise ValueError("layer-wise publication is for engines with one cache group")
        parts = {}
        try:
            for group in self.groups:
                parts[group] = self._front(group).publish_request(
                    request_id, block_ids[group], lease_s, expected_reads=expected_reads)
        except BaseException:
            for group in parts:  # the groups pinned before the failure are released
                self._front(group).abort_request(request_id)
            raise
        self._pinned[request_id] = set(parts)
        first = parts[self.groups[0]]
        return TransferParams(self.engine_id, [], request_id, [], first.lease_s,
                              groups=parts)

    def publish_layers(self, request_id: str, layer_stop: int | None = None) -> None:
        """Declares the global layers ``[0, layer_stop)`` of a layer-wise request written
        (None: every layer); consumers read them at once.

        Raises:
          KeyError: the request is not pinned. ValueError: a layer outside the model.
        """
        self._front(self._group(None)).publish_layers(request_id, layer_stop)

    def published_layers(self, request_id: str) -> int | None:
        """How many layers of a pinned request are readable (None: not pinned)."""
        return self._cores[self._group(None)].published_layers(request_id)

    def handle(self, request_id: str) -> int:
        """A small positive int naming `request_id` inside jitted code (`publish_in_jit`,
        `wait_in_jit`). Multi-controller: take handles in the same order in every process.

        Example:
          >>> h = engine.handle("req-1")  # doctest: +SKIP
        """
        return self._cores[self._group(None)].handle(request_id)

    def request_of(self, handle: int) -> str:
        """The request id of a `handle` (KeyError if unknown)."""
        return self._cores[self._group(None)].request_of(handle)

    def abort_request(self, request_id: str) -> None:
        """Producer: releases a request's blocks (reported freeable by a later `poll`).
        Consumer: stops the read of that read id (reported failed). In every group, and in a
        multi-controller engine in every process."""
        for group in self.groups:
            self._front(group).abort_request(request_id)

    @property
    def num_pinned(self) -> int:
        """Producer requests this process pins in at least one group."""
        return len(set().union(*(core.producer.pinned for core in self._cores.values())))

    @property
    def num_reading(self) -> int:
        """Consumer reads of this process not yet reported by `poll`."""
        if self._single:
            return self._cores[self.groups[0]].num_reading
        return len(self._reads)

    # -- consumer -------------------------------------------------------------------------

    def add_peer(self, engine_id: str, addresses: Sequence[tuple[str, int]]) -> EngineMetadata:
        """Fetches a peer's metadata now (the warm-up `start_read` otherwise does lazily);
        one group only (several groups: the first read of each group does it).

        Raises:
          HandshakeError, IncompatibleEngineError: nothing is loaded then.
        """
        return self._cores[self._group(None)].add_peer(engine_id, addresses)

    def start_read(
        self,
        params: TransferParams,
        local_block_ids: Sequence[int] | Mapping[str, Sequence[int]],
        timeout_s: float | None = None,
        *,
        read_id: str | None = None,
    ) -> None:
        """Plans and posts a request's reads for every local rank (and group); returns at once.

        Args:
          params: the producer's `TransferParams`.
          local_block_ids: the local blocks to fill in token order; per group name with
            several groups.
          timeout_s: deadline of the reads plus confirmations (default ``read_timeout_s``).
          read_id: the read's key (default: the producer's request id); `poll` reports it.

        Failures (handshake, planning, posting) are reported by `poll`.

        Raises:
          ValueError: groups that do not match the engine's, or a read id already in flight.

        Example:
          >>> engine.start_read(params, [7, 8], read_id="decode-req-3")  # doctest: +SKIP
        """
        if self._single:
            if params.groups:
                raise ValueError(f"the producer has cache groups {sorted(params.groups)}, "
                                 "this engine one")
            if isinstance(local_block_ids, Mapping):
                if set(local_block_ids) != set(self.groups):
                    raise ValueError(f"local block ids for groups {sorted(local_block_ids)}, "
                                     f"the engine has {list(self.groups)}")
                local_block_ids = local_block_ids[self.groups[0]]
            ids: Sequence[int] = local_block_ids
            self._front(self.groups[0]).start_read(params, ids, timeout_s, read_id=read_id)
            return
        if (set(params.groups) != set(self.groups) or not isinstance(local_block_ids, Mapping)
                or set(local_block_ids) != set(self.groups)):
            given = sorted(local_block_ids) if isinstance(local_block_ids, Mapping) else "one"
            raise ValueError(f"groups {sorted(params.groups)} / {given} do not match the "
                             f"engine's {list(self.groups)}")
        key = params.request_id if read_id is None else read_id
        if key in self._reads:
            raise ValueError(f"read {key!r} is already in flight")
        read = _ReadOfGroups(
            local={g: tuple(sorted(int(b) for b in local_block_ids[g])) for g in self.groups},
            outcome={g: None for g in self.groups},
        )
        self._reads[key] = read
        for index, group in enumerate(self.groups):
            try:
                self._front(group).start_read(params.groups[group], local_block_ids[group],
                                              timeout_s, read_id=key)
            except Exception as error:  # noqa: BLE001 - reported by poll, as a core does
                # This group never started: the groups started before it are stopped (their
                # cores report them failed), the later ones never start.
                read.reason = f"group {group!r}: starting the read failed: {error}"
                for started in self.groups[:index]:
                    self._front(started).abort_request(key)
                for other in self.groups[index:]:
                    read.outcome[other] = FailedRead(key, read.reason, read.local[other])
                    read.invalid[other] = read.local[other]
                return

    # -- progress -------------------------------------------------------------------------

    def poll(self) -> PollResult:
        """Makes progress on everything in flight; returns what changed since the last poll
        (each request once). Multi-controller: call it in every process; process 0's result
        holds the engine-level outcomes, every process's `PollResult.local` its own part."""
        if self._single:
            return self._poll_group(self.groups[0])
        out = PollResult()
        for group in self.groups:
            self._join(group, self._poll_group(group), out)
        for read_id, read in list(self._reads.items()):
            if any(value is None for value in read.outcome.values()):
                continue
            del self._reads[read_id]
            if read.reason:
                # a group that finished before another failed holds blocks of a failed read
                for group, value in read.outcome.items():
                    if value is True:
                        read.invalid[group] = read.local[group]
                out.failed.append(FailedRead.of_groups(read_id, read.reason, read.invalid))
            else:
                out.finished.append(read_id)
        return out

    def progress(self) -> None:
        """Moves what is in flight without any JAX work (safe while a jitted step computes on
        the registered caches, e.g. between a decode step's dispatch and its result); what it
        finds is reported by the next `poll`. The engine's progress thread does the same in
        the background (``progress_interval_s``).

        Example:
          >>> engine.progress()  # doctest: +SKIP
        """
        for core in self._cores.values():
            core.progress()

    def _poll_group(self, group: str) -> PollResult:
        processes = self._processes.get(group)
        if processes is None:
            return self._cores[group].poll()
        polled = processes.poll()
        return dataclasses.replace(
            polled.local, finished=polled.finished, failed=polled.failed,
            freeable=polled.freeable, published=polled.published, local=polled.local)

    def _join(self, group: str, result: PollResult, out: PollResult) -> None:
        """Folds one group's poll into the engine's (several groups)."""
        for read_id in result.finished:
            if read_id in self._reads:
                self._reads[read_id].outcome[group] = True
        for failed in result.failed:
            read = self._reads.get(failed.request_id)
            if read is None:
                continue
            read.outcome[group] = failed
            if not read.reason:
                read.reason = f"group {group!r}: {failed.reason}"
                for other in self.groups:  # the blocks are invalid anyway: stop the others
                    if other != group and read.outcome[other] is None:
                        self._front(other).abort_request(failed.request_id)
            read.invalid[group] = failed.invalid_block_ids
        for request_id in result.freeable:
            waiting = self._pinned.get(request_id)
            if waiting is not None:
                waiting.discard(group)
                if not waiting:
                    del self._pinned[request_id]
                    out.freeable.append(request_id)
        out.published += result.published
        out.layers.update(result.layers)
        for request_id, steps in result.post_applied.items():
            out.post_applied.setdefault(request_id, []).extend(steps)

    # -- in-jit entry points (`jaxkv.transfer.publish_in_jit` / `wait_in_jit`) -------------

    def _coordination(self) -> MultiControllerEngine | None:
        """The process coordination of the only group (None: one process): the in-jit
        functions issue their callbacks per device for a multi-controller engine."""
        return self._processes.get(self._group(None))

    def _callback_publish(self, handle: int, block_ids: Any, layer_stop: int,
                          rows: Any = None) -> int:
        return self._cores[self._group(None)]._callback_publish(handle, block_ids, layer_stop,
                                                                rows)

    def _layer_rows_span(self, written: Any) -> tuple[int, int, str] | None:
        return self._cores[self._group(None)]._layer_rows_span(written)

    def _callback_wait(self, handle: int, timeout_s: float) -> int:
        return self._cores[self._group(None)]._callback_wait(handle, timeout_s)

    # -- shutdown -------------------------------------------------------------------------

    def close(self) -> None:
        """Closes every group's protocol core and metadata server (idempotent)."""
        for processes in self._processes.values():
            processes.close()
        for core in self._cores.values():
            core.close()

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
