"""`KVCacheManager`: per-request block tables on top of a `BlockPool` (vLLM's KVCacheManager).

A request's life: `add_request` (hashes its full prompt blocks) -> `get_computed_blocks` (the
longest cached prefix) -> `allocate_slots` (reuses the prefix, allocates blocks for the new
tokens, registers newly full blocks in the cache) -> for each generated token `append_tokens`
and `allocate_slots(request_id, 1)` (or, for a whole decode step at once, `append_slots`) ->
`free` (blocks return to the pool tail-first and stay hittable until evicted).

Block hashes depend on the hash function and the hash seed (`hash_seed`, deterministic by
default): engines that must agree on hashes (disaggregated prefill and decode, a KV-aware
router) share both, and `hash_identity` names them for the transfer handshake. With
``hash_fn="sha256_cbor"`` hashes and events match vLLM's (see
`jaxkv.blocks._hashing.sha256_cbor` and `jaxkv.blocks.encode_vllm_event_batch`).

Hybrid models have several KV-cache groups (e.g. one full-attention group and sliding-window
groups, see `plan_kv_cache`). Every group has its own block table per request, allocated from
the shared pool; a prefix hit must hold in all groups, and sliding-window groups keep only the
blocks inside the window (dropped positions hold the null block).

Disaggregated prefill/decode: on the decode engine, look up with
``max_hit_tokens=num_prompt_tokens`` (only KV is needed, no logits), allocate the rest of the
prompt with ``delay_caching=True``, read exactly ``Allocation.new_block_ids`` from the prefill
engine (the tail of its block table; when `Allocation.reads_nothing` is true the whole prompt
was a local hit: read nothing and only tell the producer it may free its blocks), then call
`cache_blocks` once the KV has arrived.
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from jaxkv.blocks._errors import BlockError, UnknownRequestError
from jaxkv.blocks._events import KVCacheEvent
from jaxkv.blocks._hashing import (
    DEFAULT_HASH_SEED,
    RANDOM_HASH_SEED,
    BlockHash,
    HashFunction,
    MultiModalInput,
    RequestBlockHasher,
    _check_seed,
    _token_bytes,
    get_hash_function,
    hash_identity,
    random_hash_seed,
    sha256,
)
from jaxkv.blocks._metrics import PrefixCacheStats, PrefixCachingMetrics
from jaxkv.blocks._pool import NULL_BLOCK_ID, BlockId, BlockPool, EvictionHook, TieredBlock

if TYPE_CHECKING:
    from jaxkv.blocks._sizing import KVCachePlan

__all__ = ["Allocation", "CacheHit", "KVCacheManager", "TieredCacheHit"]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclasses.dataclass(frozen=True)
class CacheHit:
    """The cached prefix found for a request (from `KVCacheManager.get_computed_blocks`).

    Attributes:
      request_id: the request it was computed for.
      block_ids: per KV-cache group, the physical blocks of the cached prefix (the null block
        stands for positions a sliding window does not need).
      num_computed_tokens: tokens covered by the hit (a multiple of the block size).
      cache_epoch: the pool's `BlockPool.cache_epoch` at lookup; a later `allocate_slots`
        re-validates the blocks when it changed.

    Example:
      >>> manager = KVCacheManager(num_blocks=8, block_size=4)
      >>> manager.add_request("r", list(range(10)))
      >>> hit = manager.get_computed_blocks("r")
      >>> hit.num_computed_tokens, hit.block_ids
      (0, ((),))
    """

    request_id: str
    block_ids: tuple[tuple[BlockId, ...], ...]
    num_computed_tokens: int
    cache_epoch: int = dataclasses.field(default=0, repr=False, compare=False)
    _arrays: tuple[np.ndarray, ...] | None = dataclasses.field(
        default=None, repr=False, compare=False
    )

    @property
    def num_blocks(self) -> int:
        """Blocks per group in the hit."""
        return len(self.block_ids[0]) if self.block_ids else 0


@dataclasses.dataclass(frozen=True)
class TieredCacheHit:
    """A prefix hit over the device pool and lower tiers (`get_computed_blocks_tiered`).

    Attributes:
      device_hit: the leading device blocks, as a `CacheHit` to pass to `allocate_slots`.
      blocks: one `TieredBlock` per block of the whole hit (tier name and, for device blocks,
        the block id); blocks after the device prefix must be loaded into newly allocated
        blocks (e.g. `jaxkv.offload.OffloadManager.load_hit`).
      block_hashes: the hashes of those blocks.
      block_size: tokens per block.

    Example:
      >>> manager = KVCacheManager(num_blocks=8, block_size=2)
      >>> manager.add_request("r", [1, 2, 3, 4, 5])
      >>> hit = manager.get_computed_blocks_tiered("r", [])
      >>> hit.tiers, hit.num_hit_tokens
      ((), 0)
    """

    device_hit: CacheHit
    blocks: tuple[TieredBlock, ...]
    block_hashes: tuple[BlockHash, ...]
    block_size: int

    @property
    def tiers(self) -> tuple[str, ...]:
        """The tier of each hit block ("device" or a lower tier's name)."""
        return tuple(block.tier for block in self.blocks)

    @property
    def num_hit_tokens(self) -> int:
        """Tokens covered by the hit in all tiers."""
        return len(self.blocks) * self.block_size

    @property
    def num_device_blocks(self) -> int:
        """Leading blocks found on the device (reused without a copy)."""
        return self.device_hit.num_blocks


@dataclasses.dataclass(frozen=True)
class Allocation:
    """What one `KVCacheManager.allocate_slots` call changed.

    Attributes:
      request_id: the request.
      new_block_ids: per KV-cache group, the blocks allocated by this call, in block-table
        order. They hold no computed KV yet: these (and only these) are what a disaggregated
        decode engine reads from the prefill engine.
      num_computed_tokens: tokens already computed before this step (including a prefix hit).
      num_new_tokens: tokens scheduled by this call.

    Example:
      >>> manager = KVCacheManager(num_blocks=8, block_size=4)
      >>> manager.add_request("r", list(range(10)))
      >>> alloc = manager.allocate_slots("r", 10, manager.get_computed_blocks("r"))
      >>> alloc.new_block_ids, alloc.reads_nothing
      (((1, 2, 3),), False)
    """

    request_id: str
    new_block_ids: tuple[tuple[BlockId, ...], ...]
    num_computed_tokens: int
    num_new_tokens: int

    @property
    def reads_nothing(self) -> bool:
        """True when no block was allocated: for a disaggregated decode engine, the prompt was
        a full local hit ("read nothing, just notify the producer")."""
        return not any(self.new_block_ids)


class _Request:
    __slots__ = (
        "allocated",
        "blocks",
        "chunks",
        "hasher",
        "lora_id",
        "num_cached",
        "num_computed",
        "num_tokens",
        "outputs",
        "prompt",
        "request_id",
    )

    def __init__(self, request_id: str, prompt: bytes, hasher: RequestBlockHasher | None,
                 num_groups: int, lora_id: Any) -> None:
        self.request_id = request_id
        self.prompt = prompt  # Little-endian int64 tokens: immutable, no per-token objects.
        self.num_tokens = len(prompt) // 8
        self.outputs: list[int] = []
        self.hasher = hasher  # None when caching is off (no hashes needed).
        self.blocks: list[list[BlockId]] = [[] for _ in range(num_groups)]
        # The same block tables as arrays, one per allocation (None once unusable, e.g. for
        # sliding-window groups whose tables get null blocks); saves list->array conversions.
        self.chunks: list[list[np.ndarray] | None] = [[] for _ in range(num_groups)]
        self.num_cached = [0] * num_groups
        self.num_computed = 0
        self.allocated = False
        self.lora_id = lora_id

    def block_array(self, group: int, start: int, stop: int) -> np.ndarray:
        chunks = self.chunks[group]
        if chunks is not None and 0 < len(chunks) <= 16:
            whole = chunks[0] if len(chunks) == 1 else np.concatenate(chunks)
            if len(whole) == len(self.blocks[group]):
                return whole[start:stop]
        blocks = self.blocks[group][start:stop]
        return np.fromiter(blocks, np.int64, len(blocks))

    def tokens(self, start: int, stop: int) -> list[int]:
        num_prompt = len(self.prompt) // 8
        out: list[int] = []
        if start < num_prompt:
            count = min(stop, num_prompt) - start
            out = list(struct.unpack_from(f"<{count}q", self.prompt, 8 * start))
        if stop > num_prompt:
            out.extend(self.outputs[max(0, start - num_prompt) : stop - num_prompt])
        return out


class KVCacheManager:
    """Block tables of running requests, with prefix caching, over one `BlockPool`.

    Not thread-safe: drive it from one scheduler thread.

    Args:
      num_blocks: blocks in the pool (including the null block), e.g. `KVCachePlan.num_blocks`.
      block_size: tokens per block (all groups).
      max_model_len: the most tokens one request may hold; None for no limit.
      sliding_windows: one entry per KV-cache group: None for full attention, or the sliding
        window in tokens. Default: one full-attention group.
      enable_caching: reuse cached prefixes and register full blocks.
      hash_fn: block hash function (`sha256` default, `xxhash128`, or a name).
      hash_seed: the block-hash seed. Default `DEFAULT_HASH_SEED`: deterministic, so separate
        processes (prefill and decode engines, a router) agree on hashes. ``"random"`` draws
        an unguessable seed (read it back from `hash_seed` to share it with peers). Engines
        must share the hash function and seed; `hash_identity` names both for a handshake.
      enable_events: queue KV-cache events (drain with `take_events`).
      metrics_window: the hit-rate window, in requests.

    Raises:
      ValueError, TypeError: invalid arguments.

    Example:
      >>> manager = KVCacheManager(num_blocks=16, block_size=4)
      >>> prompt = list(range(10))
      >>> manager.add_request("a", prompt)
      >>> manager.allocate_slots("a", 10, manager.get_computed_blocks("a")).new_block_ids
      ((1, 2, 3),)
      >>> manager.add_request("b", prompt[:8] + [99, 98])
      >>> hit = manager.get_computed_blocks("b")
      >>> hit.num_computed_tokens, hit.block_ids
      (8, ((1, 2),))
      >>> manager.allocate_slots("b", 2, hit).new_block_ids
      ((4,),)
      >>> manager.free("a"); manager.free("b"); manager.hit_rate
      0.4
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        max_model_len: int | None = None,
        sliding_windows: Sequence[int | None] = (None,),
        enable_caching: bool = True,
        hash_fn: HashFunction | str = sha256,
        hash_seed: str = DEFAULT_HASH_SEED,
        enable_events: bool = False,
        metrics_window: int = 1000,
    ) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)):
            raise TypeError(f"block_size must be an int, got {type(block_size).__name__}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if max_model_len is not None and max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1 or None, got {max_model_len}")
        windows = tuple(sliding_windows)
        if not windows:
            raise ValueError("need at least one KV-cache group")
        for window in windows:
            if window is not None and (
                isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 1
            ):
                raise ValueError(f"a sliding window must be None or an int >= 1, got {window!r}")
        self._block_size = int(block_size)
        self._max_model_len = None if max_model_len is None else int(max_model_len)
        self._windows = tuple(None if w is None else int(w) for w in windows)
        self._enable_caching = bool(enable_caching)
        self._hash_fn = get_hash_function(hash_fn)
        if hash_seed == RANDOM_HASH_SEED:
            hash_seed = random_hash_seed()
        self._hash_seed = _check_seed(hash_seed)
        self._hash_identity = hash_identity(self._hash_fn, self._hash_seed)
        self._pool = BlockPool(
            num_blocks, enable_caching=enable_caching, enable_events=enable_events
        )
        self._requests: dict[str, _Request] = {}
        self._metrics = PrefixCachingMetrics(metrics_window)
        self._empty_hit_blocks = tuple(() for _ in windows)
        self._block_struct = struct.Struct(f"<{self._block_size}q")
        self._packers: dict[int, struct.Struct] = {}
        self._single_full_group = self._windows == (None,)

    @classmethod
    def from_plan(cls, plan: KVCachePlan, **kwargs: Any) -> KVCacheManager:
        """A manager for the groups, block count, block size and max length of a plan.

        Args:
          plan: from `plan_kv_cache`.
          **kwargs: other constructor arguments (``enable_caching``, ``hash_fn``, ...).

        Raises:
          ValueError: the plan has Mamba (state) groups, or its groups have different block
            sizes.

        Example:
          >>> from jaxkv import KVCacheSpec
          >>> from jaxkv.blocks import AttentionLayers, plan_kv_cache
          >>> spec = KVCacheSpec(num_layers=2, num_kv_heads=1, head_dim=8, block_size=4,
          ...                    dtype="float32")
          >>> plan = plan_kv_cache([AttentionLayers(spec)], 2**20, max_model_len=64)
          >>> KVCacheManager.from_plan(plan).num_free_blocks
          2047
        """
        mamba = [i for i, group in enumerate(plan.groups) if group.is_mamba]
        if mamba:
            # A state group holds one running state per request (plus speculative blocks), not
            # one block per block_size tokens: this manager's block tables do not describe it.
            raise ValueError(
                f"KV-cache groups {mamba} hold Mamba states: KVCacheManager manages attention "
                "blocks only; serve hybrid models through vLLM (jaxkv's connector moves the "
                "states) or manage the state blocks beside this manager")
        sizes = {group.block_size for group in plan.groups}
        if len(sizes) != 1:
            raise ValueError(
                f"all KV-cache groups need one block size, got {plan.block_sizes} (page sizes "
                "were unified by giving layers with smaller pages larger blocks); a "
                "KVCacheManager manages one block size: plan with disable_hybrid=True where "
                "pages match, or choose block sizes that give every layer the same page"
            )
        return cls(
            plan.num_blocks,
            sizes.pop(),
            max_model_len=plan.max_model_len,
            sliding_windows=tuple(group.sliding_window for group in plan.groups),
            **kwargs,
        )

    # ------------------------------------------------------------------ properties

    @property
    def pool(self) -> BlockPool:
        """The block pool (shared by every group)."""
        return self._pool

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        return self._block_size

    @property
    def num_groups(self) -> int:
        """KV-cache groups (block tables per request)."""
        return len(self._windows)

    @property
    def sliding_windows(self) -> tuple[int | None, ...]:
        """Each group's sliding window (None: full attention)."""
        return self._windows

    @property
    def max_model_len(self) -> int | None:
        """The per-request token limit."""
        return self._max_model_len

    @property
    def hash_fn(self) -> HashFunction:
        """The block hash function."""
        return self._hash_fn

    @property
    def hash_seed(self) -> str:
        """The block-hash seed (the drawn one when constructed with ``hash_seed="random"``)."""
        return self._hash_seed

    @property
    def hash_identity(self) -> str:
        """The block-hash configuration as a string, ``"<hash fn>:seed=<digest of the seed>"``
        (see `jaxkv.blocks.hash_identity`).

        Pass it to ``jaxkv.transfer.TransferEngine(block_hashing=manager.hash_identity)`` on
        every engine: the handshake compares it, so engines whose block hashes would never
        match (another hash function or seed) are refused instead of silently missing every
        prefix hit.

        Example:
          >>> KVCacheManager(4, 2).hash_identity == KVCacheManager(8, 4).hash_identity
          True
          >>> KVCacheManager(4, 2, hash_seed="random").hash_identity.startswith("sha256:seed=")
          True
        """
        return self._hash_identity

    @property
    def num_free_blocks(self) -> int:
        """Blocks the pool can allocate now."""
        return self._pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of usable blocks in use."""
        return self._pool.usage

    @property
    def metrics(self) -> PrefixCachingMetrics:
        """Prefix-cache hit-rate metrics over the most recent requests."""
        return self._metrics

    @property
    def hit_rate(self) -> float:
        """Hit tokens / looked-up tokens over the most recent requests."""
        return self._metrics.hit_rate

    @property
    def request_ids(self) -> list[str]:
        """Requests currently known, in the order they were added."""
        return list(self._requests)

    # ------------------------------------------------------------------ requests

    def _request(self, request_id: str) -> _Request:
        try:
            return self._requests[request_id]
        except KeyError:
            raise UnknownRequestError(f"unknown request {request_id!r}") from None

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int] | np.ndarray,
        *,
        lora_id: int | str | None = None,
        mm_inputs: Sequence[MultiModalInput | tuple[str, int, int]] = (),
        cache_salt: str | bytes | None = None,
    ) -> None:
        """Registers a request and hashes its full prompt blocks.

        Args:
          request_id: a new, unique id.
          prompt_token_ids: the prompt (ints or an integer numpy array; at least one token).
          lora_id: LoRA adapter id (an extra key of every block).
          mm_inputs: multimodal inputs (extra keys of the blocks they overlap).
          cache_salt: isolates the request's cache (an extra key of its first block).

        Raises:
          UnknownRequestError: the id is already in use.
          BlockError: an empty prompt, or a prompt longer than ``max_model_len``.
          TypeError, ValueError: invalid tokens or extra-key inputs.

        Example:
          >>> manager = KVCacheManager(num_blocks=4, block_size=4)
          >>> manager.add_request("r", [1, 2, 3, 4, 5]); len(manager.get_block_hashes("r"))
          1
        """
        if request_id in self._requests:
            raise UnknownRequestError(f"request {request_id!r} was already added")
        count = len(prompt_token_ids)
        if count == 0:
            raise BlockError("a request needs at least one prompt token")
        if self._max_model_len is not None and count > self._max_model_len:
            raise BlockError(
                f"prompt of {count} tokens exceeds max_model_len={self._max_model_len}"
            )
        hashing = RequestBlockHasher(  # Built even without caching: it checks the keys.
            self._block_size, self._hash_fn, lora_id=lora_id, mm_inputs=mm_inputs,
            cache_salt=cache_salt, seed=self._hash_seed,
        )
        prompt = _token_bytes(prompt_token_ids)  # Validates the tokens.
        hasher = None
        if self._enable_caching:
            hashing.extend_packed(prompt)
            hasher = hashing
        self._requests[request_id] = _Request(
            request_id, prompt, hasher, len(self._windows), lora_id
        )

    def append_tokens(self, request_id: str, token_ids: Sequence[int] | np.ndarray) -> None:
        """Appends generated tokens to a request (hashing blocks they complete).

        Their KV is computed by a later `allocate_slots` step, as in decoding: sample a token,
        append it, allocate a slot for it.

        Raises:
          UnknownRequestError: unknown request.
          BlockError: the request would exceed ``max_model_len``.
          TypeError, ValueError: invalid tokens (nothing is appended).

        Example:
          >>> manager = KVCacheManager(num_blocks=4, block_size=2)
          >>> manager.add_request("r", [1]); manager.append_tokens("r", [2, 3])
          >>> manager.num_tokens("r"), len(manager.get_block_hashes("r"))
          (3, 1)
        """
        state = self._request(request_id)
        count = len(token_ids)
        if count == 0:
            return
        total = state.num_tokens + count
        if self._max_model_len is not None and total > self._max_model_len:
            raise BlockError(
                f"request {request_id!r} would hold {total} tokens, over "
                f"max_model_len={self._max_model_len}"
            )
        data = _token_bytes(token_ids)  # Validates the tokens.
        hasher = state.hasher
        if hasher is not None:
            if hasher.num_tokens != state.num_tokens:
                self._sync_hasher(state)
            hasher.extend_packed(data)
        state.num_tokens = total
        state.outputs.extend(token_ids.tolist() if isinstance(token_ids, np.ndarray) else token_ids)

    def _sync_hasher(self, state: _Request) -> None:
        """Feeds the request's hasher the tokens `append_slots` appended without it."""
        hasher = state.hasher
        if hasher is not None and hasher.num_tokens < state.num_tokens:
            missing = state.tokens(hasher.num_tokens, state.num_tokens)
            hasher.extend_packed(struct.pack(f"<{len(missing)}q", *missing))

    def append_slots(
        self, request_ids: Sequence[str], token_ids: Sequence[int] | np.ndarray
    ) -> list[BlockId] | None:
        """One decode step for many requests in one call: appends one sampled token to each
        request and gives it a slot (`append_tokens` then ``allocate_slots(request_id, 1)``
        per request, without their per-call costs).

        A request gets a new block when its token starts one; a block its token fills is
        hashed and registered in the prefix cache. Each request must be decoding: every token
        it holds already computed (scheduled) by an earlier allocation. One full-attention
        KV-cache group only (hybrid managers use the per-request calls).

        Args:
          request_ids: distinct running requests.
          token_ids: one new token per request.

        Returns:
          Per request, the block allocated for it by this step, or `NULL_BLOCK_ID` (0) when
          its token fits in its last block; None when the pool has too few free blocks for
          the step (nothing changes: schedule fewer requests or preempt, then retry).

        Raises:
          UnknownRequestError: an unknown request.
          BlockError: a request listed twice, not decoding, or that would exceed
            ``max_model_len``; lengths differ; a hybrid manager. Nothing changes.
          TypeError, ValueError: tokens that are not int64 integers. Nothing changes.

        Example:
          >>> manager = KVCacheManager(num_blocks=8, block_size=2)
          >>> for rid in ("a", "b"):
          ...     manager.add_request(rid, [1, 2, 3] if rid == "a" else [1, 2])
          ...     _ = manager.allocate_slots(rid, manager.num_tokens(rid))
          >>> manager.append_slots(["a", "b"], [7, 8])   # "b" starts a new block
          [0, 4]
          >>> manager.get_block_ids("b"), manager.num_computed_tokens("b")
          (((3, 4),), 3)
        """
        count = len(request_ids)
        if len(token_ids) != count:
            raise BlockError(f"got {count} requests but {len(token_ids)} tokens")
        if not self._single_full_group:
            raise BlockError("append_slots supports one full-attention KV-cache group; use "
                             "append_tokens and allocate_slots per request")
        if count == 0:
            return []
        if type(token_ids) is list:
            # Validates (as append_tokens, the given ints are stored); one cached Struct per
            # batch size.
            packer = self._packers.get(count)
            if packer is None:
                packer = self._packers.setdefault(count, struct.Struct(f"<{count}q"))
            try:
                packer.pack(*token_ids)
            except struct.error:
                _token_bytes(token_ids)  # Raises the precise TypeError or ValueError.
                raise
            tokens: Sequence[int] = token_ids
        else:
            _token_bytes(token_ids)
            tokens = token_ids.tolist() if isinstance(token_ids, np.ndarray) else token_ids
        try:
            states = list(map(self._requests.__getitem__, request_ids))
        except KeyError as error:
            raise UnknownRequestError(f"unknown request {error.args[0]!r}") from None
        except TypeError:
            raise UnknownRequestError("request ids must be hashable") from None
        size = self._block_size
        last = size - 1
        limit = self._max_model_len if self._max_model_len is not None else 1 << 62
        starts: list[int] = []
        fills: list[_Request] = []
        for done, state, token in zip(range(count), states, tokens):  # Hot: keep it lean.
            num = state.num_tokens
            if num != state.num_computed:
                break
            state.outputs.append(token)
            state.num_tokens = state.num_computed = num + 1
            position = num % size
            if position == 0:
                starts.append(done)
                if size == 1:
                    fills.append(state)
            elif position == last:
                fills.append(state)
        else:
            done = count
        over = None
        if done == count and self._max_model_len is not None:
            over = next((state for state in states if state.num_tokens > limit), None)
        if done == count and over is None and len(starts) <= self._pool.num_free_blocks \
                and (count < 2 or len(set(request_ids)) == count):
            out: list[Any] = [NULL_BLOCK_ID] * count
            if starts:
                new = self._pool.allocate(len(starts))
                for index, block in zip(starts, new):
                    state = states[index]
                    state.blocks[0].append(block)
                    state.chunks[0] = None
                    out[index] = block
            if fills and self._enable_caching:
                self._cache_filled_blocks(fills)
            return out
        for state in states[:done]:  # Undo, then say what was wrong.
            state.outputs.pop()
            state.num_tokens = state.num_computed = state.num_tokens - 1
        if over is not None:
            raise BlockError(
                f"request {over.request_id!r} would hold {over.num_tokens + 1} tokens, over "
                f"max_model_len={self._max_model_len}"
            )
        if done < count:
            state = states[done]
            raise BlockError(
                f"request {state.request_id!r} is not decoding: {state.num_tokens} tokens, "
                f"{state.num_computed} computed (allocate its pending tokens first)"
            )
        if len(set(request_ids)) != count:
            raise BlockError("a request is listed twice in one decode step")
        return None

    def _cache_filled_blocks(self, fills: list[_Request]) -> None:
        """Caches the blocks that a decode step's tokens filled. Hot: a few blocks per step,
        one call to the request's hasher and one to the pool each (no lists: on Python 3.11 a
        comprehension costs a function call too)."""
        size = self._block_size
        pack = self._block_struct.pack
        cache_block = self._pool.cache_block
        for state in fills:
            num = state.num_tokens
            index = state.num_cached[0]
            if index * size != num - size:  # Earlier blocks uncached too: the general path.
                self._cache_full_blocks(state, num)
                continue
            hasher = state.hasher
            assert hasher is not None  # caching is on
            block_hash = None
            if len(state.outputs) >= size:  # All sampled tokens: hashed from them directly.
                block_hash = hasher.hash_full_block(pack(*state.outputs[-size:]), num - size)
            if block_hash is None:  # The hasher lags, or prompt tokens in the block.
                self._sync_hasher(state)
                block_hash = hasher.block_hashes[index]
            if cache_block(state.blocks[0][index], block_hash):
                state.num_cached[0] = index + 1
            else:  # An event to record, or the hash already cached: the general path.
                self._cache_full_blocks(state, num)

    def num_tokens(self, request_id: str) -> int:
        """Tokens the request holds (prompt and appended).

        Raises:
          UnknownRequestError: unknown request.

        Example:
          >>> manager = KVCacheManager(num_blocks=4, block_size=2)
          >>> manager.add_request("r", [1, 2, 3]); manager.num_tokens("r")
          3
        """
        return self._request(request_id).num_tokens

    def num_computed_tokens(self, request_id: str) -> int:
        """Tokens whose KV is computed or scheduled by `allocate_slots`.

        Raises:
          UnknownRequestError: unknown request.

        Example:
          >>> manager = KVCacheManager(num_blocks=4, block_size=2)
          >>> manager.add_request("r", [1, 2, 3]); _ = manager.allocate_slots("r", 2)
          >>> manager.num_computed_tokens("r")
          2
        """
        return self._request(request_id).num_computed

    def get_block_ids(self, request_id: str) -> tuple[tuple[BlockId, ...], ...]:
        """The request's block table per group (logical block index -> physical block id).

        Raises:
          UnknownRequestError: unknown request.

        Example:
          >>> manager = KVCacheManager(num_blocks=4, block_size=2)
          >>> manager.add_request("r", [1, 2, 3]); _ = manager.allocate_slots("r", 3)
          >>> manager.get_block_ids("r")
          ((1, 2),)
        """
        return tuple(tuple(blocks) for blocks in self._request(request_id).blocks)

    def get_block_hashes(self, request_id: str) -> tuple[BlockHash, ...]:
        """Hashes of the request's full blocks so far (empty when caching is off).

        Raises:
          UnknownRequestError: unknown request.

        Example:
          >>> manager = KVCacheManager(num_blocks=4, block_size=2)
          >>> manager.add_request("r", [1, 2, 3]); len(manager.get_block_hashes("r"))
          1
        """
        state = self._request(request_id)
        if state.hasher is None:
            return ()
        self._sync_hasher(state)
        return tuple(state.hasher.block_hashes)

    # ------------------------------------------------------------------ prefix lookup

    def _group_hit(
        self, group: int, hashes: Sequence[BlockHash], num_blocks: int
    ) -> list[BlockId]:
        window = self._windows[group]
        if window is None:
            return self._pool.find_longest_cache_hit(hashes[:num_blocks], group)
        # Sliding window: the last cdiv(window - 1, block_size) blocks before the hit's end
        # must be cached; earlier positions are replaced by the null block. Scan right to
        # left for the rightmost run that long (vLLM's SlidingWindowManager).
        needed = _cdiv(window - 1, self._block_size)
        get = self._pool.get_cached_block
        result = [NULL_BLOCK_ID] * num_blocks
        run = 0
        for index in range(num_blocks - 1, -1, -1):
            block = get(hashes[index], group)
            if block is not None:
                result[index] = block
                run += 1
                if run >= needed:
                    del result[index + run :]
                    return result
            else:
                run = 0
        del result[run:]  # Only a run starting at block 0 is a (short) hit.
        return result

    def _lookup_bounds(self, request_id: str, max_hit_tokens: int | None) -> tuple[Any, int, int]:
        """The request's state, its token count and the most tokens a prefix lookup may hit
        (all but the last token by default, so that one is always computed)."""
        state = self._request(request_id)
        if state.allocated:
            raise BlockError(
                f"request {request_id!r} already has blocks; look up its prefix before the "
                "first allocate_slots (free it first to start over)"
            )
        num_tokens = state.num_tokens
        if max_hit_tokens is None:
            return state, num_tokens, num_tokens - 1
        if max_hit_tokens < 0:
            raise BlockError(f"max_hit_tokens must be >= 0, got {max_hit_tokens}")
        return state, num_tokens, min(int(max_hit_tokens), num_tokens)

    def get_computed_blocks(
        self, request_id: str, *, max_hit_tokens: int | None = None
    ) -> CacheHit:
        """Finds the longest cached prefix of a request that every group can reuse.

        Lookup only; pass the result to `allocate_slots` to use it. Records a hit-rate
        observation (when caching is on).

        Args:
          request_id: a request before its first allocation.
          max_hit_tokens: cap on the hit. Default ``num_tokens - 1``: the last prompt token is
            always recomputed so the model produces logits. A disaggregated decode engine that
            only needs KV may pass ``num_tokens``.

        Returns:
          The hit (possibly empty).

        Raises:
          UnknownRequestError: unknown request.
          BlockError: the request already has blocks, or ``max_hit_tokens < 0``.

        Example:
          >>> manager = KVCacheManager(num_blocks=8, block_size=2)
          >>> manager.add_request("a", [1, 2, 3, 4]); _ = manager.allocate_slots("a", 4)
          >>> manager.add_request("b", [1, 2, 3, 4])
          >>> manager.get_computed_blocks("b").num_computed_tokens       # last block recomputed
          2
          >>> manager.get_computed_blocks("b", max_hit_tokens=4).num_computed_tokens
          4
        """
        state, num_tokens, limit = self._lookup_bounds(request_id, max_hit_tokens)
        epoch = self._pool.cache_epoch
        if state.hasher is None:
            return CacheHit(request_id, self._empty_hit_blocks, 0, epoch)
        hashes = state.hasher.block_hashes
        length = min(limit // self._block_size, len(hashes))
        results = [self._group_hit(g, hashes, length) for g in range(len(self._windows))]
        while True:  # Shrink to a length every group agrees on.
            shortest = min(len(r) for r in results)
            if all(len(r) == shortest for r in results):
                break
            length = shortest
            for group, result in enumerate(results):
                if len(result) != length:
                    if self._windows[group] is None:
                        del result[length:]
                    else:
                        results[group] = self._group_hit(group, hashes, length)
        length = len(results[0])
        num_hit = length * self._block_size
        self._metrics.observe(PrefixCacheStats(requests=1, queries=num_tokens, hits=num_hit))
        if not num_hit:
            return CacheHit(request_id, self._empty_hit_blocks, 0, epoch)
        return CacheHit(
            request_id,
            tuple(tuple(r) for r in results),
            num_hit,
            epoch,
            tuple(np.fromiter(r, np.int64, len(r)) for r in results),
        )

    def set_eviction_hook(self, hook: EvictionHook | None) -> None:
        """Lets an offload tier save cached blocks the pool evicts (see
        `BlockPool.set_eviction_hook`).

        Example:
          >>> manager = KVCacheManager(num_blocks=4, block_size=2)
          >>> manager.set_eviction_hook(lambda blocks: None)
        """
        self._pool.set_eviction_hook(hook)

    def get_computed_blocks_tiered(
        self,
        request_id: str,
        lower_tiers: Sequence[tuple[str, Callable[[BlockHash], bool]]],
        *,
        max_hit_tokens: int | None = None,
    ) -> TieredCacheHit:
        """Finds the longest cached prefix of a request on the device, then in lower tiers.

        Each block is looked up on the device first, then in each lower tier in order; the
        hit ends at the first block found nowhere. Lookup only. Records a hit-rate
        observation counting hits of every tier. One full-attention group only.

        Args:
          request_id: a request before its first allocation.
          lower_tiers: ``(name, contains)`` per lower tier, e.g.
            `jaxkv.offload.OffloadManager.lower_tiers()`.
          max_hit_tokens: as in `get_computed_blocks`.

        Returns:
          The `TieredCacheHit`; its `device_hit` goes to `allocate_slots`.

        Raises:
          UnknownRequestError: unknown request.
          BlockError: the request already has blocks, ``max_hit_tokens < 0``, or the manager
            has sliding-window or several groups.

        Example:
          >>> manager = KVCacheManager(num_blocks=8, block_size=2)
          >>> manager.add_request("a", [1, 2, 3, 4, 5]); _ = manager.allocate_slots("a", 5)
          >>> manager.add_request("b", [1, 2, 3, 4, 5, 6, 7])
          >>> hashes = manager.get_block_hashes("b")
          >>> host = {hashes[2]}.__contains__
          >>> manager.get_computed_blocks_tiered("b", [("host", host)]).tiers
          ('device', 'device', 'host')
        """
        if not self._single_full_group:
            raise BlockError("tiered lookups support one full-attention KV-cache group")
        state, num_tokens, limit = self._lookup_bounds(request_id, max_hit_tokens)
        epoch = self._pool.cache_epoch
        if state.hasher is None:
            return TieredCacheHit(CacheHit(request_id, self._empty_hit_blocks, 0, epoch), (), (),
                                  self._block_size)
        hashes = state.hasher.block_hashes
        length = min(limit // self._block_size, len(hashes))
        blocks = self._pool.find_longest_tiered_hit(hashes[:length], lower_tiers)
        device: list[BlockId] = []
        for block in blocks:
            if block.tier != "device" or block.block_id is None:
                break
            device.append(block.block_id)
        self._metrics.observe(PrefixCacheStats(
            requests=1, queries=num_tokens, hits=len(blocks) * self._block_size))
        if device:
            device_hit = CacheHit(request_id, (tuple(device),), len(device) * self._block_size,
                                  epoch, (np.fromiter(device, np.int64, len(device)),))
        else:
            device_hit = CacheHit(request_id, self._empty_hit_blocks, 0, epoch)
        return TieredCacheHit(device_hit, tuple(blocks), tuple(hashes[: len(blocks)]),
                              self._block_size)

    def _check_hit(self, state: _Request, hit: CacheHit) -> None:
        if hit.request_id != state.request_id:
            raise BlockError(
                f"cache hit of request {hit.request_id!r} passed for {state.request_id!r}"
            )
        if state.allocated:
            raise BlockError(
                f"request {state.request_id!r} already has blocks; a cache hit applies only to "
                "its first allocate_slots"
            )
        if len(hit.block_ids) != len(self._windows):
            raise BlockError("cache hit has a different number of groups than the manager")
        if any(len(blocks) != hit.num_blocks for blocks in hit.block_ids):
            raise BlockError("cache hit groups have different lengths")
        if hit.num_computed_tokens != hit.num_blocks * self._block_size:
            raise BlockError("cache hit token count and block count disagree")
        if hit.cache_epoch == self._pool.cache_epoch and hit._arrays is not None:
            return  # From get_computed_blocks, and nothing was evicted since.
        hashes = state.hasher.block_hashes if state.hasher is not None else ()
        if hit.num_blocks > len(hashes):
            raise BlockError(f"cache hit is longer than the full blocks of {state.request_id!r}")
        for group, blocks in enumerate(hit.block_ids):
            for index, block in enumerate(blocks):
                if block == NULL_BLOCK_ID:
                    if self._windows[group] is None:
                        raise BlockError("a full-attention cache hit cannot hold the null block")
                    continue
                if (
                    self._pool.block_hash(block) != hashes[index]
                    or self._pool.block_group(block) != group
                ):
                    raise BlockError(
                        f"stale cache hit for {state.request_id!r}: block {block} was evicted "
                        "since get_computed_blocks; look the prefix up again"
                    )

    # ------------------------------------------------------------------ allocation

    def allocate_slots(
        self,
        request_id: str,
        num_new_tokens: int,
        hit: CacheHit | None = None,
        *,
        num_lookahead_tokens: int = 0,
        delay_caching: bool = False,
    ) -> Allocation | None:
        """Gives a request slots for ``num_new_tokens`` more tokens (after its computed ones
        and, on the first call, after a prefix hit).

        On success the tokens count as computed (scheduled) and newly full blocks are
        registered in the prefix cache (unless ``delay_caching``). When the pool lacks blocks,
        returns None and changes nothing (except that sliding-window blocks that fell out of
        the window are released, as in vLLM).

        Args:
          request_id: the request.
          num_new_tokens: tokens to compute this step (already added to the request).
          hit: the request's `get_computed_blocks` result, on its first call only.
          num_lookahead_tokens: extra slots (e.g. speculative tokens), not counted as computed
            and capped by ``max_model_len``.
          delay_caching: do not register full blocks yet (their KV arrives later, e.g. from a
            prefill engine); call `cache_blocks` when it has.

        Returns:
          The `Allocation`, or None when the pool has too few free blocks.

        Raises:
          UnknownRequestError: unknown request.
          BlockError: more tokens than the request holds, beyond ``max_model_len``, negative
            counts, or a hit that is foreign, late or stale.

        Example:
          >>> manager = KVCacheManager(num_blocks=4, block_size=2)
          >>> manager.add_request("r", [1, 2, 3])
          >>> manager.allocate_slots("r", 3).new_block_ids
          ((1, 2),)
          >>> manager.append_tokens("r", [4, 5]); manager.allocate_slots("r", 2).new_block_ids
          ((3,),)
          >>> manager.append_tokens("r", [6, 7]); manager.allocate_slots("r", 2) is None
          True
        """
        state = self._request(request_id)
        if (  # Fast path for decode steps that fit in the request's last block.
            hit is None
            and state.allocated
            and not num_lookahead_tokens
            and self._single_full_group
            and type(num_new_tokens) is int
            and num_new_tokens >= 0
        ):
            num_computed = state.num_computed
            total = num_computed + num_new_tokens
            if total <= state.num_tokens and total <= len(state.blocks[0]) * self._block_size:
                state.num_computed = total
                if (
                    state.hasher is not None
                    and not delay_caching
                    and total // self._block_size > state.num_cached[0]
                ):
                    self._cache_full_blocks(state, total)
                return Allocation(request_id, self._empty_hit_blocks, num_computed, num_new_tokens)
        if isinstance(num_new_tokens, bool) or num_new_tokens < 0 or num_lookahead_tokens < 0:
            raise BlockError(
                f"token counts must be >= 0, got num_new_tokens={num_new_tokens}, "
                f"num_lookahead_tokens={num_lookahead_tokens}"
            )
        num_new_tokens = int(num_new_tokens)
        if hit is not None and hit.request_id != request_id:
            raise BlockError(f"cache hit of request {hit.request_id!r} passed for {request_id!r}")
        if hit is not None and hit.num_computed_tokens == 0:
            hit = None  # An empty hit changes nothing.
        hit_arrays: tuple[np.ndarray, ...] = ()
        if hit is not None:
            self._check_hit(state, hit)
            hit_tokens = hit.num_computed_tokens
            hit_arrays = hit._arrays if hit._arrays is not None else tuple(
                np.fromiter(blocks, np.int64, len(blocks)) for blocks in hit.block_ids
            )
        else:
            hit_tokens = 0
        num_computed = state.num_computed + hit_tokens
        total = num_computed + num_new_tokens
        if total > state.num_tokens:
            raise BlockError(
                f"request {request_id!r} holds {state.num_tokens} tokens; cannot compute "
                f"{num_new_tokens} more after {num_computed} (append tokens first)"
            )
        slots = total + int(num_lookahead_tokens)
        if self._max_model_len is not None:
            slots = min(slots, self._max_model_len)
        num_slot_blocks = _cdiv(slots, self._block_size)
        pool = self._pool

        # Release blocks that fell out of sliding windows (before counting free blocks).
        for group, window in enumerate(self._windows):
            if window is not None and state.blocks[group]:
                state.chunks[group] = None
                self._remove_skipped_blocks(state.blocks[group], window, num_computed)

        # Blocks always cover the computed tokens, so new positions are never outside a
        # sliding window: every group gets real blocks for all of them.
        plan: list[int] = []
        needed = 0
        for group in range(len(self._windows)):
            have = len(state.blocks[group]) + (len(hit.block_ids[group]) if hit else 0)
            missing = max(0, num_slot_blocks - have)
            plan.append(missing)
            needed += missing
        for array in hit_arrays:
            if array.size:
                needed += pool.count_unreferenced(array)
        if needed > pool.num_free_blocks:
            return None

        if hit is not None:
            for group, array in enumerate(hit_arrays):
                if array.size:
                    pool.touch(array)
                state.blocks[group].extend(hit.block_ids[group])
                state.num_cached[group] = len(hit.block_ids[group])
                chunks = state.chunks[group]
                if chunks is not None:
                    chunks.append(array)
        new_blocks = []
        for group, count in enumerate(plan):
            if count:
                array = pool.allocate_array(count)
                new = array.tolist()
                state.blocks[group].extend(new)
                chunks = state.chunks[group]
                if chunks is not None:
                    chunks.append(array)
                new_blocks.append(tuple(new))
            else:
                new_blocks.append(())
        state.allocated = True
        state.num_computed = total
        if state.hasher is not None and not delay_caching:
            self._cache_full_blocks(state, total)
        return Allocation(request_id, tuple(new_blocks), num_computed, num_new_tokens)

    def _remove_skipped_blocks(
        self, blocks: list[BlockId], window: int, num_computed: int
    ) -> None:
        last_useful_block = (num_computed - window + 1) // self._block_size
        removed = []
        for index in range(min(last_useful_block, len(blocks)) - 1, -1, -1):
            if blocks[index] == NULL_BLOCK_ID:
                break  # Everything before was released by an earlier call.
            removed.append(blocks[index])
            blocks[index] = NULL_BLOCK_ID
        if removed:
            self._pool.free(removed)

    def cache_blocks(self, request_id: str, num_tokens: int | None = None) -> None:
        """Registers a request's full blocks up to ``num_tokens`` in the prefix cache (after a
        ``delay_caching`` allocation, once their KV is valid).

        Args:
          request_id: the request.
          num_tokens: tokens whose KV is valid; default: all computed tokens.

        Raises:
          UnknownRequestError: unknown request.
          BlockError: caching is off, or ``num_tokens`` exceeds the computed tokens.

        Example:
          >>> manager = KVCacheManager(num_blocks=4, block_size=2)
          >>> manager.add_request("r", [1, 2, 3])
          >>> _ = manager.allocate_slots("r", 3, delay_caching=True)
          >>> manager.pool.num_cached_blocks
          0
          >>> manager.cache_blocks("r"); manager.pool.num_cached_blocks
          1
        """
        state = self._request(request_id)
        if not self._enable_caching:
            raise BlockError("prefix caching is disabled")
        if num_tokens is None:
            num_tokens = state.num_computed
        if not 0 <= num_tokens <= state.num_computed:
            raise BlockError(
                f"can cache at most the {state.num_computed} computed tokens of "
                f"{request_id!r}, got {num_tokens}"
            )
        self._cache_full_blocks(state, num_tokens)

    def _cache_full_blocks(self, state: _Request, num_tokens: int) -> None:
        size = self._block_size
        num_full = num_tokens // size
        hasher = state.hasher
        assert hasher is not None
        self._sync_hasher(state)
        hashes = hasher.block_hashes
        events = self._pool.enable_events
        for group, window in enumerate(self._windows):
            start = state.num_cached[group]
            if num_full <= start:
                continue
            blocks = state.blocks[group][start:num_full]
            array = None
            block_hashes = hashes[start:num_full]
            extra = None
            tokens = None
            if events:
                tokens = state.tokens(start * size, num_full * size)
                extra = hasher.extra_keys_of(start, num_full)
            if window is not None and NULL_BLOCK_ID in blocks:
                keep = [i for i, block in enumerate(blocks) if block != NULL_BLOCK_ID]
                blocks = [blocks[i] for i in keep]
                array = np.fromiter(blocks, np.int64, len(blocks))
                block_hashes = [block_hashes[i] for i in keep]
                if extra is not None:
                    extra = [extra[i] for i in keep]
                if tokens is not None:
                    tokens = [t for i in keep for t in tokens[i * size : (i + 1) * size]]
            if blocks:
                self._pool.cache_trusted(
                    blocks,
                    state.block_array(group, start, num_full) if array is None else array,
                    block_hashes,
                    group,
                    hashes[start - 1] if start else None,
                    tokens,
                    size,
                    extra,
                    state.lora_id,
                )
            state.num_cached[group] = num_full

    # ------------------------------------------------------------------ release

    def free(self, request_id: str) -> None:
        """Releases a request's blocks (tail first, so its last blocks are evicted first) and
        forgets the request. Cached blocks stay hittable until evicted.

        Raises:
          UnknownRequestError: unknown request (e.g. freed twice).

        Example:
          >>> manager = KVCacheManager(num_blocks=4, block_size=2)
          >>> manager.add_request("r", [1, 2, 3]); _ = manager.allocate_slots("r", 3)
          >>> manager.free("r"); manager.num_free_blocks
          3
        """
        state = self._requests.pop(request_id, None)
        if state is None:
            raise UnknownRequestError(f"unknown request {request_id!r} (never added, or freed)")
        for group, blocks in enumerate(state.blocks):
            if blocks:
                self._pool.free_array(state.block_array(group, 0, len(blocks))[::-1])

    def num_common_prefix_blocks(
        self, request_id: str, num_running_requests: int
    ) -> tuple[int, ...]:
        """Per group, leading blocks of the request shared by all running requests (cascade
        attention); always 0 for sliding-window groups.

        Args:
          request_id: a running request.
          num_running_requests: how many requests are running.

        Returns:
          One count per group.

        Raises:
          UnknownRequestError: unknown request.

        Example:
          >>> manager = KVCacheManager(num_blocks=8, block_size=2)
          >>> for rid in "ab":
          ...     manager.add_request(rid, [1, 2, 3, 4, ord(rid)])
          ...     hit = manager.get_computed_blocks(rid)
          ...     _ = manager.allocate_slots(rid, 5 - hit.num_computed_tokens, hit)
          >>> manager.num_common_prefix_blocks("a", 2)
          (2,)
        """
        state = self._request(request_id)
        out = []
        for group, window in enumerate(self._windows):
            count = 0
            if window is None:
                for block in state.blocks[group]:
                    if self._pool.ref_count(block) != num_running_requests:
                        break
                    count += 1
            out.append(count)
        return tuple(out)

    # ------------------------------------------------------------------ cache-wide

    def take_events(self) -> list[KVCacheEvent]:
        """Drains the pool's KV-cache events (oldest first; [] when events are off).

        Example:
          >>> manager = KVCacheManager(num_blocks=4, block_size=2, enable_events=True)
          >>> manager.add_request("r", [1, 2, 3]); _ = manager.allocate_slots("r", 3)
          >>> [type(event).__name__ for event in manager.take_events()]
          ['BlockStored']
        """
        return self._pool.take_events()

    def reset_prefix_cache(self) -> bool:
        """Drops every cached hash and resets the hit-rate metrics; only when no request holds
        blocks.

        Returns:
          Whether the cache was reset.

        Example:
          >>> manager = KVCacheManager(num_blocks=4, block_size=2)
          >>> manager.add_request("r", [1, 2, 3]); _ = manager.allocate_slots("r", 3)
          >>> manager.reset_prefix_cache()
          False
          >>> manager.free("r"); manager.reset_prefix_cache()
          True
        """
        if any(state.allocated and any(state.blocks) for state in self._requests.values()):
            return False
        if not self._pool.reset_prefix_cache():
            return False
        self._metrics.reset()
        return True
