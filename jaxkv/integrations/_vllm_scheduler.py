"""`JaxKVScheduler`: the scheduler side of the vLLM connector (`jaxkv.integrations.vllm`).

It decides, per step, what the workers do (`JaxKVConnectorMetadata`): which producer requests
to pin, which consumer reads to start, stop or turn into a release; and it builds the
``kv_transfer_params`` a producer hands to consumers. It has no transfer engine. One KV cache
group and several (vLLM's hybrid allocator) go through the same methods and give params of
one shape: vLLM NIXL connector's keys (``remote_block_ids`` one list per group) with jaxkv's
beside them (`transfer_params_to_dict` for one group, `GroupedTransfer` for several).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from jaxkv.integrations._mamba import clip_state_blocks
from jaxkv.integrations._params import (
    ConnectorSettings,
    GroupedTransfer,
    transfer_params_to_dict,
)
from jaxkv.integrations._vllm_meta import (
    BLOCK_FORMAT_KEY,
    CacheGroups,
    JaxKVConnectorMetadata,
    _Recv,
    block_format,
)
from jaxkv.transfer import make_transfer_params

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

__all__ = ["JaxKVScheduler"]

log = logging.getLogger("jaxkv.integrations.vllm")


class JaxKVScheduler:
    """The connector's scheduler-side state: producer requests to publish and hand over,
    consumer reads to order, and each consumer read's outcome.

    Args:
      settings: the connector's settings.
      groups: the engine's KV cache groups.
      is_producer: the engine's ``kv_role`` produces KV.

    Example:
      >>> scheduler = JaxKVScheduler(settings, CacheGroups.of(vllm_config, None),  # doctest: +SKIP
      ...                            is_producer=True)
    """

    def __init__(self, settings: ConnectorSettings, groups: CacheGroups, is_producer: bool):
        self.settings = settings
        self.groups = groups
        self.is_producer = is_producer
        self.block_format = block_format()
        self._manager: KVCacheManager | None = None
        self._requests: dict[str, Request] = {}  # producer requests not yet published
        self._published: set[str] = set()
        self._published_first: dict[str, list[int]] = {}  # first block kept per group
        self._loading: set[str] = set()  # consumer requests whose read is in flight
        # consumer requests: what their read did, until `request_finished` reports it
        self._load_outcomes: dict[str, dict[str, Any]] = {}
        self._local_hits: dict[str, int] = {}  # consumer requests: local prefix hit tokens
        self._refused: dict[str, str] = {}  # consumer requests whose params were refused
        self._meta = JaxKVConnectorMetadata()

    def bind_kv_cache_manager(self, manager: KVCacheManager) -> None:
        """vLLM's KV cache manager (the blocks of requests to publish)."""
        self._manager = manager

    def _kv_cache_manager(self) -> KVCacheManager:
        if self._manager is None:
            raise RuntimeError("vLLM did not bind its KV cache manager to the connector")
        return self._manager

    # -- Mamba groups: the last prompt token is the decode side's ---------------------------

    def prefill_backoff(self) -> int:
        """Trailing prompt tokens the producer does not compute (vLLM's NIXL rule): 1 with a
        Mamba group, whose state after the prompt's last token cannot be handed over as
        attention KV can: the producer stops at ``h(N-1)`` and the consumer computes token
        ``N`` from it. 0 otherwise."""
        return 1 if self.groups.has_state else 0

    def on_new_request(self, request: Request) -> None:
        """Producer with a Mamba group: drops the request's last prompt token and caps it at
        one output token (the prefill hands over the state of the first ``N - 1`` tokens;
        vLLM's NIXL connector does the same, once per request, and not for a request that
        skips the prefix cache, whose consumer computes the whole prompt)."""
        params = request.kv_transfer_params
        backoff = self.prefill_backoff()
        if (
            not backoff
            or not params
            or not params.get("do_remote_decode")
            or params.get(_TRUNCATED_KEY)
            or request.num_prompt_tokens <= backoff
            or request.get_skip_reading_prefix_cache()
            or request.prompt_token_ids is None
        ):
            return
        _drop_last_prompt_tokens(request, backoff)
        request.max_tokens = 1
        params[_TRUNCATED_KEY] = True

    # -- consumer -------------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """The remote prompt tokens beyond the local hit (loaded asynchronously).

        Returns:
          (tokens to load, whether asynchronously); (0, False) for a request that reads
          nothing or whose producer's blocks are of another format.
        """
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
        # with a Mamba group the consumer computes the last prompt token itself
        prompt = request.num_prompt_tokens
        backoff = self.prefill_backoff()
        own = prompt - backoff if backoff and prompt > backoff else prompt
        if "remote_num_tokens" not in params:
            # NIXL-shaped params built without it (a router's own): the producer computed the
            # prompt, as vLLM's NIXL connector assumes; never "nothing to read" in silence.
            log.info("request %s: its kv_transfer_params name no remote_num_tokens; reading "
                     "the whole prompt (%d tokens) as vLLM's NIXL connector does",
                     request.request_id, own)
            params["remote_num_tokens"] = own
        remote_tokens = min(int(params["remote_num_tokens"]), own)
        count = remote_tokens - num_computed_tokens
        self._local_hits[request.request_id] = num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Records a consumer read (the blocks to fill, per KV cache group) or a producer
        request to publish."""
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
        outcome: dict[str, Any] = {
            "status": "refused" if refused else "reading" if num_external_tokens > 0
            else "local_hit",
            "remote_tokens": int(num_external_tokens),
            "local_hit_tokens": int(self._local_hits.pop(request.request_id, 0)),
        }
        if refused:
            outcome["reason"] = refused
        self._load_outcomes[request.request_id] = outcome
        if num_external_tokens <= 0:
            # Everything was a local hit: the producer's blocks are only released.
            self._meta.to_recv.append(_Recv(request.request_id, dict(params), [], 0, True))
            return
        fill = tuple(
            _blocks_to_fill(group) if self.groups.state_of(g) is None
            else _state_to_fill(group, self.groups.spec_blocks[g])
            for g, group in enumerate(blocks.blocks)
        )
        if self.groups.grouped:
            flat = [b for _, ids in fill for b in ids]
            recv = _Recv(request.request_id, dict(params), flat, 0, local_groups=fill)
        else:
            hit, ids = fill[0]
            recv = _Recv(request.request_id, dict(params), list(ids), hit)
        self._meta.to_recv.append(recv)
        self._loading.add(request.request_id)

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

    def loaded_group_ids(self) -> tuple[int, ...] | None:
        """The KV cache groups a read fills: every group of a hybrid model (vLLM skips
        zeroing them); None with one group (vLLM's default)."""
        return tuple(range(self.groups.num_groups)) if self.groups.grouped else None

    # -- the step -------------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> JaxKVConnectorMetadata:
        """The step's work for the workers (resets the pending state).

        Raises:
          RuntimeError: a request to publish but no KV cache manager bound.
        """
        meta, self._meta = self._meta, JaxKVConnectorMetadata()
        scheduled = scheduler_output.num_scheduled_tokens
        for request_id, request in list(self._requests.items()):
            n = scheduled.get(request_id)
            if n is None or request.num_computed_tokens + n < request.num_prompt_tokens:
                continue
            # Its prefill completes this step: the workers pin the blocks after the forward
            # wrote them (per group, from the first block its window keeps).
            num_tokens = request.num_prompt_tokens
            all_ids = self._kv_cache_manager().get_block_ids(request_id)
            firsts = self._window_firsts(num_tokens)
            kept = []
            for g, (ids, size) in enumerate(zip(all_ids, self.groups.block_sizes)):
                if self.groups.state_of(g) is None:
                    kept.append(list(ids[firsts[g] : math.ceil(num_tokens / size)]))
                else:  # a Mamba group: the running state's block
                    firsts[g], state = _state_block(ids, self.groups.spec_blocks[g])
                    kept.append(state)
            if self.groups.grouped:
                meta.to_publish_groups[request_id] = kept
            else:
                meta.to_publish[request_id] = kept[0]
            self._published_first[request_id] = firsts
            self._published.add(request_id)
            del self._requests[request_id]
        return meta

    def _window_firsts(self, num_tokens: int) -> list[int]:
        """Per KV cache group, the first block position a request of `num_tokens` computed
        tokens keeps (its sliding window's; 0 for full attention), as vLLM's managers cut.
        One group: 0 (its params carry no first block)."""
        if not self.groups.grouped:
            return [0]
        managers = self._kv_cache_manager().coordinator.single_type_managers
        return [
            0 if self.groups.state_of(g) is not None
            else manager.get_num_skipped_tokens(num_tokens) // size
            for g, (manager, size) in enumerate(zip(managers, self.groups.block_sizes))
        ]

    # -- finished requests ----------------------------------------------------------------

    def request_finished(
        self, request: Request, block_ids: Sequence[Sequence[int]]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Producer: keeps a finished prefill's blocks and returns the consumer's params.
        Consumer: returns ``{"jaxkv_load": outcome}``, what the request's read did.

        Args:
          request: the finished request.
          block_ids: its blocks, per KV cache group.

        Returns:
          (whether vLLM must keep the blocks until the workers report them sent, the
          request's output ``kv_transfer_params``).

        Raises:
          ValueError: a producer without side-channel addresses in its settings.
        """
        request_id = request.request_id
        firsts = self._published_first.pop(request_id, None)
        if not self._to_send(request, any(block_ids)):
            return False, self._load_outcome_params(request_id)
        if not self.settings.side_channel:
            raise ValueError("a kv_producer needs side_channel addresses in its settings")
        kept, starts = self._kept_blocks(block_ids, firsts or [0] * len(block_ids),
                                         request.num_prompt_tokens)
        params = self._transfer_params(request_id, kept, starts, request.num_prompt_tokens)
        self._meta.to_send.add(request_id)
        if self.block_format is not None:
            params[BLOCK_FORMAT_KEY] = self.block_format
        return True, params

    def _kept_blocks(
        self, block_ids: Sequence[Sequence[int]], firsts: Sequence[int], num_tokens: int
    ) -> tuple[list[list[int]], list[int]]:
        """Per KV cache group, the blocks a consumer may read and the position of the first.

        One group: every block given, from position 0. Several: each group's blocks of the
        prompt from the first its window kept, past the blocks vLLM freed since (null now:
        published, but another request may own them by now)."""
        if not self.groups.grouped:
            return [list(block_ids[0])], [0]
        null = self._kv_cache_manager().block_pool.null_block.block_id
        kept, starts = [], []
        for g, (ids, first, size) in enumerate(zip(block_ids, firsts, self.groups.block_sizes)):
            if self.groups.state_of(g) is not None:  # a Mamba group: the running state's block
                start, state = _state_block(ids, self.groups.spec_blocks[g], null)
                kept.append(state)
                starts.append(start)
                continue
            ids = list(ids[: math.ceil(num_tokens / size)])
            gone = max((i + 1 for i, b in enumerate(ids) if b == null), default=0)
            start = max(first, gone)
            kept.append(ids[start:])
            starts.append(start)
        return kept, starts

    def _transfer_params(
        self, request_id: str, kept: list[list[int]], starts: list[int], num_tokens: int
    ) -> dict[str, Any]:
        """The consumer's ``kv_transfer_params`` of a producer request (one shape for one
        group and several: `transfer_params_to_dict`'s)."""
        s = self.settings
        if not self.groups.grouped:
            transfer = make_transfer_params(
                s.engine_id, list(s.side_channel), request_id, kept[0], s.lease_s,
                num_tokens=num_tokens, block_size=self.groups.block_size,
            )
            return transfer_params_to_dict(
                transfer, num_tokens, self.groups.block_size, tp_size=s.tp_size
            )
        engine_groups = self.groups.engine_groups()
        addresses = s.group_addresses(len(engine_groups))
        first_of: dict[int, int] = {}  # vLLM group -> index of its first engine group
        for j, (g, _) in enumerate(engine_groups):
            first_of.setdefault(g, j)
        states = [
            None if self.groups.state_of(g) is None else [
                (c.name, addresses[first_of[g] + i])
                for i, c in enumerate(self.groups.state_of(g) or ())
            ]
            for g in range(self.groups.num_groups)
        ]
        return GroupedTransfer.make(
            s.engine_id,
            [addresses[first_of[g]] for g in range(self.groups.num_groups)],
            request_id,
            kept,
            s.lease_s,
            num_tokens=num_tokens,
            block_sizes=list(self.groups.block_sizes),
            first_blocks=starts,
            states=states if self.groups.has_state else (),
        ).to_dict(tp_size=s.tp_size)

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


_TRUNCATED_KEY = "_p_side_truncated"  # vLLM NIXL's mark: the prompt lost its last token once


def _drop_last_prompt_tokens(request: Request, count: int) -> None:
    """Drops the last `count` prompt tokens of a request that has computed nothing yet.

    vLLM's `Request` has no public way to shorten a prompt; its NIXL connector edits the
    same fields (the prompt ids, the id list the scheduler reads and the prompt length), so
    this does exactly what it does."""
    del request.prompt_token_ids[-count:]
    del request._all_token_ids[-count:]  # vLLM's own connector edits it too (see above)
    request.num_prompt_tokens -= count


def _state_block(
    ids: Sequence[int], spec_blocks: int, null: int | None = None
) -> tuple[int, list[int]]:
    """A Mamba group's running-state block of a request's block ids and its position
    (``([], len)``: none, e.g. only the null block)."""
    state = clip_state_blocks(list(ids), spec_blocks)
    if not state or (null is not None and state[0] == null):
        return len(ids), []
    return len(ids) - 1 - min(spec_blocks, len(ids) - 1), state


def _state_to_fill(group: Any, spec_blocks: int) -> tuple[int, tuple[int, ...]]:
    """A consumer's Mamba block that a read fills: the running state's block (the last
    one before the speculative scratch blocks), unless a local prefix hit holds it."""
    pos, state = _state_block([b.block_id for b in group], spec_blocks)
    if not state or group[pos].is_null or group[pos].block_hash is not None:
        return len(group), ()
    return pos, tuple(state)


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
