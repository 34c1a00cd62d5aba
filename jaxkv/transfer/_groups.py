"""Cache groups (hybrid models) and layout advice.

A hybrid model keeps several KV-cache groups (vLLM: full attention and sliding window), each
its own `PagedKVCache` with its own block table: a request has block ids per group.
`GroupedTransferEngine` moves such requests: one `KVTransferEngine` per group (engine id
``"<engine_id>.<group>"``, its own NIXL agent and side channel), requests published and read
per group with that group's ids, and a request reported finished only when every group
finished (failed when any failed: the other groups are aborted and all ids are invalid).

`recommend_layout` tells which cache layout avoids post-processing against given peers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from jaxkv._parallel import EngineConfig
from jaxkv.transfer._engine import KVTransferEngine, TransferParams
from jaxkv.transfer._params import FailedRead

__all__ = ["GroupedParams", "GroupedPollResult", "GroupedTransferEngine", "LayoutAdvice",
           "recommend_layout"]


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


class GroupedParams(msgspec.Struct, frozen=True):
    """Per cache group, the `TransferParams` of one request (what the router forwards)."""

    request_id: str
    groups: dict[str, TransferParams]


@dataclasses.dataclass
class GroupedPollResult:
    """What `GroupedTransferEngine.poll` reports (each request once).

    Attributes:
      finished: requests whose every group finished.
      failed: ``(request_id, reason, {group: invalid local block ids})``.
      freeable: producer requests freeable in every group.
    """

    finished: list[str] = dataclasses.field(default_factory=list)
    failed: list[tuple[str, str, dict[str, tuple[int, ...]]]] = dataclasses.field(
        default_factory=list
    )
    freeable: list[str] = dataclasses.field(default_factory=list)


class GroupedTransferEngine:
    """KV transfers of a model with several cache groups (see the module docstring).

    Args:
      engine_id: the engine's name; group ``g`` is engine ``f"{engine_id}.{g}"``.
      configs: per group name, its `EngineConfig` (the group's layers, layout, block size).
      group_options: per group name, `KVTransferEngine` keyword arguments for that group's
        engine only (e.g. ``{"port": 5601}``: each group listens on its own side channel),
        over `engine_kwargs`.
      **engine_kwargs: passed to every `KVTransferEngine`.

    Example:
      >>> engine = GroupedTransferEngine(  # doctest: +SKIP
      ...     "prefill", {"full": full_cfg, "swa": swa_cfg})
      >>> engine.register_cache("full", full_cache)  # doctest: +SKIP
      >>> engine.register_cache("swa", swa_cache)  # doctest: +SKIP
      >>> params = engine.publish_request("r", {"full": [1, 2, 3], "swa": [7]})  # doctest: +SKIP
    """

    def __init__(self, engine_id: str, configs: Mapping[str, EngineConfig],
                 group_options: Mapping[str, Mapping[str, Any]] | None = None,
                 **engine_kwargs: Any):
        if not configs:
            raise ValueError("at least one cache group")
        unknown = sorted(set(group_options or {}) - set(configs))
        if unknown:
            raise ValueError(f"group_options name unknown groups {unknown}")
        self.engine_id = engine_id
        self.engines: dict[str, KVTransferEngine] = {}
        try:
            for group, config in configs.items():
                options = {**engine_kwargs, **(group_options or {}).get(group, {})}
                self.engines[group] = KVTransferEngine(
                    f"{engine_id}.{group}", config, **options
                )
        except Exception:
            self.close()
            raise
        self._reading: dict[str, dict[str, Any]] = {}  # request -> {group: outcome | None}
        self._pinned: dict[str, set[str]] = {}  # request -> groups not yet freeable
        self._failed: dict[str, tuple[str, dict[str, tuple[int, ...]]]] = {}
        self._local: dict[str, dict[str, tuple[int, ...]]] = {}

    @property
    def addresses(self) -> dict[str, tuple[str, int]]:
        """Per group, this process's side-channel address."""
        return {g: e.address for g, e in self.engines.items()}

    def _engine(self, group: str) -> KVTransferEngine:
        try:
            return self.engines[group]
        except KeyError:
            raise KeyError(f"no cache group {group!r}; groups are {list(self.engines)}") from None

    def register_cache(self, group: str, cache: Any, pp_rank: int = 0,
                       tp_rank: int | None = None) -> None:
        """Registers the cache of one group (`KVTransferEngine.register_cache`).

        Raises:
          KeyError: unknown group. ValueError: as `KVTransferEngine.register_cache`.
        """
        self._engine(group).register_cache(cache, pp_rank=pp_rank, tp_rank=tp_rank)

    def publish_request(self, request_id: str, block_ids: Mapping[str, Sequence[int]],
                        lease_s: float | None = None, *,
                        expected_reads: int = 1) -> GroupedParams:
        """Pins the request's blocks in every group (ids per group); freeable once
        `expected_reads` consumer reads (read ids) finished in every group, or the lease
        expired (`KVTransferEngine.publish_request`).

        Raises:
          ValueError: the groups given are not exactly the engine's groups.
        """
        if set(block_ids) != set(self.engines):
            raise ValueError(f"block ids for groups {sorted(block_ids)}, the engine has "
                             f"{sorted(self.engines)}")
        params = {g: self.engines[g].publish_request(request_id, ids, lease_s,
                                                     expected_reads=expected_reads)
                  for g, ids in block_ids.items()}
        self._pinned[request_id] = set(params)
        return GroupedParams(request_id, params)

    def start_read(self, params: GroupedParams, local_block_ids: Mapping[str, Sequence[int]],
                   timeout_s: float | None = None, *, read_id: str | None = None) -> None:
        """Starts the reads of every group (local ids per group); returns at once.

        `read_id` keys the read (default: the producer's request id), as in
        `KVTransferEngine.start_read`; `poll` reports it. A group whose engine refuses to
        start its read (an exception) fails the read as any other failure: the groups started
        before it are stopped, and `poll` reports the read failed with every group's ids.

        Raises:
          ValueError: groups that do not match, or the read id is already in flight.
        """
        if set(params.groups) != set(self.engines) or set(local_block_ids) != set(self.engines):
            raise ValueError(f"groups {sorted(params.groups)} / {sorted(local_block_ids)} do "
                             f"not match the engine's {sorted(self.engines)}")
        key = params.request_id if read_id is None else read_id
        if key in self._reading:
            raise ValueError(f"read {key!r} is already in flight")
        state: dict[str, Any] = {g: None for g in self.engines}
        self._reading[key] = state
        self._local[key] = {
            g: tuple(sorted(int(b) for b in ids)) for g, ids in local_block_ids.items()
        }
        for group, engine in self.engines.items():
            try:
                engine.start_read(params.groups[group], local_block_ids[group], timeout_s,
                                  read_id=key)
            except Exception as error:  # noqa: BLE001 - reported by poll, as the engines do
                # This group never started: it fails here, the groups started before it are
                # stopped (their engines report them failed), the later ones never start.
                reason = f"group {group!r}: starting the read failed: {error}"
                self._failed[key] = (reason, {})
                started = list(self.engines)[: list(self.engines).index(group)]
                for other in self.engines:
                    if other in started:
                        self.engines[other].abort_request(key)
                    else:
                        state[other] = FailedRead(key, reason, self._local[key][other])
                        self._failed[key][1][other] = self._local[key][other]
                return

    def abort_request(self, request_id: str) -> None:
        """Producer: releases a request's blocks in every group (reported freeable once every
        group released them). Consumer: stops the read of that read id in every group
        (reported failed). `KVTransferEngine.abort_request` in each group."""
        for engine in self.engines.values():
            engine.abort_request(request_id)

    def update_cache(self, group: str, cache: Any) -> None:
        """`KVTransferEngine.update_cache` of one group's engine."""
        self._engine(group).update_cache(cache)

    def group_of(self, cache: Any) -> str:
        """The group whose registered cache has `cache`'s arrays and devices.

        Raises:
          ValueError: no group registered a cache with these buffers.
        """
        # The groups' caches may have equal shapes on the same devices: a cache is known by
        # its buffers' addresses (an in-place update keeps them).
        where = {(b.array_index, b.device.id, b.address) for b in cache.shard_buffers()}
        for group, engine in self.engines.items():
            for entry in engine._registry.caches:
                if entry.cache is cache or where == {
                    (b.array_index, b.device.id, b.address) for b in entry.buffers
                }:
                    return group
        raise ValueError(
            "no group registered a cache with these buffers (was the cache donated to every "
            "update?)"
        )

    @property
    def caches(self) -> dict[str, Any]:
        """Per group, its registered cache (current version; one per engine process)."""
        return {g: e.caches[0] for g, e in self.engines.items()}

    @property
    def num_pinned(self) -> int:
        """Producer requests pinned in at least one group."""
        return len(set().union(*(e.producer.pinned for e in self.engines.values())))

    @property
    def num_reading(self) -> int:
        """Consumer reads not yet reported by `poll`."""
        return len(self._reading)

    def poll(self) -> GroupedPollResult:
        """Polls every group; a request is finished when all its groups are."""
        out = GroupedPollResult()
        for group, engine in self.engines.items():
            result = engine.poll()
            for request_id in result.finished:
                if request_id in self._reading:
                    self._reading[request_id][group] = True
            for failed in result.failed:
                state = self._reading.get(failed.request_id)
                if state is None:
                    continue
                state[group] = failed
                if failed.request_id not in self._failed:
                    self._failed[failed.request_id] = (f"group {group!r}: {failed.reason}", {})
                    for other, other_engine in self.engines.items():
                        if other != group and state[other] is None:
                            other_engine.abort_request(failed.request_id)
                self._failed[failed.request_id][1][group] = failed.invalid_block_ids
            for request_id in result.freeable:
                groups = self._pinned.get(request_id)
                if groups is not None:
                    groups.discard(group)
                    if not groups:
                        del self._pinned[request_id]
                        out.freeable.append(request_id)
        for request_id, state in list(self._reading.items()):
            if any(v is None for v in state.values()):
                continue
            del self._reading[request_id]
            if request_id in self._failed:
                reason, invalid = self._failed.pop(request_id)
                # a group that finished before another failed: its blocks are invalid too
                local = self._local.pop(request_id, {})
                for group, value in state.items():
                    if value is True:
                        invalid[group] = local.get(group, ())
                out.failed.append((request_id, reason, invalid))
            else:
                self._local.pop(request_id, None)
                out.finished.append(request_id)
        return out

    def close(self) -> None:
        """Closes every group's engine (idempotent)."""
        for engine in self.engines.values():
            engine.close()

    def __enter__(self) -> GroupedTransferEngine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
