"""KV-cache sizing: how many blocks fit a memory budget, and how hybrid models are grouped.

Follows vLLM's ``get_kv_cache_config`` (v1):

* One attention type (every layer has the same spec and window): one KV-cache group holding all
  layers; ``num_blocks = available_memory // page_nbytes // num_layers`` where ``page_nbytes``
  is one layer's bytes per block (`KVCacheSpec.page_nbytes_per_layer`).
* Several types with one page size per layer (e.g. full attention + sliding window): layers of
  each type are split into groups of ``group_size`` layers, ``group_size`` being the smallest
  type's layer count, or the largest one's when the largest is under 1.5x the smallest (fewer
  padding layers; vLLM 0.33's ratio). Type ``t`` with ``n`` layers gets ``k = ceil(n /
  group_size)`` groups, the i-th holding ``layers[i::k]`` (strided, so pipeline stages stay
  balanced); a group with fewer layers is padded (those slots waste memory). There are
  ``group_size`` buffers; buffer ``i`` is shared by the i-th layer of every group, and a block
  id indexes the same page in every buffer. Each group has its own block table per request.
  ``num_blocks = available_memory // page_nbytes // group_size``.
* One max-length request needs, per group, ``ceil(max_model_len / block_size)`` blocks for
  full attention, or ``ceil(min(window - 1 + max_num_batched_tokens, max_model_len) /
  block_size) + 1`` for a sliding window; it must fit next to the null block, or sizing fails
  with the largest max_model_len that would fit.
* Maximum concurrency = usable blocks / blocks one max-length request needs.
* Attention types whose pages differ (e.g. a full-attention layer with head size 64 next to a
  sliding-window layer with head size 32) are unified first, as vLLM's
  ``unify_kv_cache_spec_page_size``: a type with a smaller page gets a block size
  ``largest page / its page`` times larger, so every page has the largest size; its group then
  has that larger block size (one block covers more of its tokens). A smaller page that does
  not divide the largest cannot be unified and is refused.
* ``disable_hybrid=True`` (vLLM's ``--disable-hybrid-kv-cache-manager``): when full-attention
  and sliding-window layers are both present, the sliding-window layers are managed as full
  attention (they keep every block; the attention itself still uses its window), so a model
  whose layers then share one spec has a single group. This saves scheduling work, not
  memory.

* State-space (Mamba) layers of hybrid models (Jamba, Nemotron-H, Granite 4, Qwen3-Next;
  vLLM's ``MambaSpec``, given as `MambaLayers`): a block holds one request's recurrent state
  (a conv and an SSM state per layer), whose size does not depend on tokens. Next to attention,
  page sizes are aligned first, as vLLM's ``Platform._align_hybrid_block_size``: with ``P``
  the bytes one token takes in one attention layer, ``S`` the largest Mamba state (bytes per
  layer on one TP rank) and ``a = max(kernel_block_alignment, block_size)`` (128 at least for
  MLA), the attention block size becomes ``a * ceil(S / (a * P))`` (rounded up to a multiple
  of ``kernel_block_alignment``), the smallest such multiple whose page holds a state; every
  Mamba page is then padded to that attention page. The layers are then grouped as above, a
  Mamba type being one more type of that page size. A Mamba group needs ``1 +
  num_speculative_blocks`` blocks per request, whatever the length (vLLM's
  ``mamba_cache_mode='none'``; mode ``'align'``, vLLM's default with prefix caching, is
  refused). A model of Mamba layers only has one page per state and no alignment.

Difference from vLLM: the null block (block 0, never allocated) is left out of the usable
blocks in the concurrency; vLLM 0.33 leaves it out of the fit check (as jaxkv does) but counts
it in the concurrency. A Mamba group's `KVCacheGroup.block_size` is 1 (one state per block, as
the connector's state components describe it) where vLLM's ``MambaSpec.block_size`` is
``max_model_len`` in mode 'none'; the blocks counted are the same.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from jaxkv._spec import KVCacheSpec, canonical_dtype
from jaxkv.blocks._errors import InsufficientMemoryError

__all__ = [
    "AttentionLayers",
    "KVCacheBuffer",
    "KVCacheGroup",
    "KVCachePlan",
    "MambaLayers",
    "blocks_per_request",
    "estimate_max_model_len",
    "num_blocks_for_memory",
    "plan_kv_cache",
]

_GIB = float(1 << 30)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _positive_int(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class AttentionLayers:
    """Layers of a model that share one attention type.

    Attributes:
      spec: the cache spec of these layers; ``spec.num_layers`` is how many there are.
      layers: their indices in the model (distinct, ``>= 0``); default ``0 .. num_layers - 1``
        (only sensible for a model with one attention type).
      sliding_window: the attention window in tokens, or None for full attention.

    Raises:
      ValueError: from the constructor when ``layers`` does not match ``spec.num_layers``,
        repeats an index, or the window is not positive.

    Example:
      >>> spec = KVCacheSpec(num_layers=2, num_kv_heads=8, head_dim=128, block_size=16)
      >>> AttentionLayers(spec, layers=(1, 3), sliding_window=4096).layers
      (1, 3)
    """

    spec: KVCacheSpec
    layers: tuple[int, ...] | None = None
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.spec, KVCacheSpec):
            raise TypeError(f"spec must be a KVCacheSpec, got {type(self.spec).__name__}")
        layers = tuple(range(self.spec.num_layers)) if self.layers is None else tuple(self.layers)
        for layer in layers:
            if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
                raise ValueError(f"layer indices must be ints >= 0, got {layer!r}")
        if len(set(layers)) != len(layers):
            raise ValueError(f"repeated layer indices in {layers}")
        if len(layers) != self.spec.num_layers:
            raise ValueError(
                f"{len(layers)} layer indices given for a spec of {self.spec.num_layers} layers"
            )
        object.__setattr__(self, "layers", layers)
        if self.sliding_window is not None:
            _positive_int(self.sliding_window, "sliding_window")


# vLLM's mamba_cache_mode values; only 'none' is sized here.
_MAMBA_CACHE_MODES = ("none", "align", "all")


@dataclasses.dataclass(frozen=True)
class MambaLayers:
    """State-space (Mamba) layers of a hybrid model that share one state layout (vLLM's
    ``MambaSpec``): a block holds one request's state, not tokens.

    Not in ``jaxkv.blocks.__all__`` (the public API is capped): import it from
    ``jaxkv.blocks._sizing``.

    Attributes:
      state_nbytes: bytes of one layer's state on one tensor-parallel rank of the plan's
        ``tp_size``, unpadded (vLLM's ``MambaSpec.real_page_size_bytes``: the sum over its
        ``shapes`` (per rank) of elements times the dtype's size); see `from_shapes`.
      layers: their indices in the model (distinct, ``>= 0``).
      num_speculative_blocks: extra state blocks per request for speculative decoding
        (vLLM: the number of speculative tokens, 0 with ReplaySSM).
      cache_mode: vLLM's ``mamba_cache_mode``; only ``"none"`` (vLLM's mode without prefix
        caching) is sized, ``"align"`` and ``"all"`` are refused by `plan_kv_cache`.

    Raises:
      ValueError: from the constructor, for a non-positive ``state_nbytes``, no or repeated
        layers, a negative ``num_speculative_blocks`` or an unknown ``cache_mode``.

    Example:
      >>> MambaLayers(state_nbytes=4096, layers=(0, 2)).layers
      (0, 2)
    """

    state_nbytes: int
    layers: tuple[int, ...]
    num_speculative_blocks: int = 0
    cache_mode: str = "none"

    def __post_init__(self) -> None:
        _positive_int(self.state_nbytes, "state_nbytes")
        layers = tuple(self.layers)
        if not layers:
            raise ValueError("MambaLayers needs at least one layer index")
        for layer in layers:
            if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
                raise ValueError(f"layer indices must be ints >= 0, got {layer!r}")
        if len(set(layers)) != len(layers):
            raise ValueError(f"repeated layer indices in {layers}")
        object.__setattr__(self, "layers", layers)
        spec = self.num_speculative_blocks
        if isinstance(spec, bool) or not isinstance(spec, int) or spec < 0:
            raise ValueError(f"num_speculative_blocks must be an int >= 0, got {spec!r}")
        if self.cache_mode not in _MAMBA_CACHE_MODES:
            raise ValueError(
                f"unknown mamba cache_mode {self.cache_mode!r}; vLLM's are {_MAMBA_CACHE_MODES}"
            )

    @classmethod
    def from_shapes(
        cls,
        shapes: Sequence[Sequence[int]],
        dtypes: Sequence[Any],
        layers: Sequence[int],
        **kwargs: Any,
    ) -> MambaLayers:
        """Layers whose state is vLLM's ``MambaSpec.shapes`` / ``dtypes`` (one TP rank's).

        Args:
          shapes: per state array (conv, SSM, ...), its shape on one TP rank.
          dtypes: one dtype (name, numpy or torch dtype) per state, or one for all.
          layers: the layers' indices in the model.
          **kwargs: the other fields (``num_speculative_blocks``, ``cache_mode``).

        Returns:
          The layers, ``state_nbytes`` the sum of each state's elements times its dtype's size.

        Raises:
          ValueError: no shapes, a count of dtypes that is neither 1 nor one per shape, an
            unsupported dtype.

        Example:
          >>> # Mamba2, Nemotron-H-8B-like, TP 1: conv (10240, 3) and SSM (128, 64, 128) bf16
          >>> MambaLayers.from_shapes([(10240, 3), (128, 64, 128)], ["bfloat16"],
          ...                         layers=(0, 1)).state_nbytes
          2158592
        """
        shapes = [tuple(int(d) for d in shape) for shape in shapes]
        names = [str(dtype).removeprefix("torch.") for dtype in dtypes]
        if not shapes:
            raise ValueError("a Mamba state of no arrays")
        if len(names) == 1:
            names = names * len(shapes)
        if len(names) != len(shapes):
            raise ValueError(f"{len(shapes)} state shapes but {len(names)} dtypes")
        nbytes = sum(math.prod(shape) * canonical_dtype(name).itemsize
                     for shape, name in zip(shapes, names))
        return cls(state_nbytes=nbytes, layers=tuple(layers), **kwargs)


@dataclasses.dataclass(frozen=True)
class KVCacheGroup:
    """Layers that share one block table per request.

    Attributes:
      group_id: index in `KVCachePlan.groups` (the ``group`` of pool and manager calls).
      layers: model layer indices (all of one attention type).
      num_padding_layers: unused buffer slots of this group (``group_size - len(layers)``).
      spec: the cache spec of the group's layers (``num_layers == len(layers)``); for a Mamba
        group, its (padded) page as bytes: ``KVCacheSpec(n, 1, page_nbytes, block_size=1,
        dtype="int8", kv_factor=1, mla=True)`` (one state per block, every TP rank the same
        page size).
      sliding_window: the window in tokens, or None for full attention (and Mamba groups).
      state_nbytes: for a Mamba group, one layer's unpadded state bytes on one TP rank
        (the page pads it to the plan's ``page_nbytes``); None for attention.
      num_speculative_blocks: for a Mamba group, the speculative-decoding state blocks each
        request holds beside its running state (0 for attention).

    Example:
      >>> spec = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=8, block_size=16)
      >>> KVCacheGroup(0, (0,), 0, spec, None).block_size
      16
    """

    group_id: int
    layers: tuple[int, ...]
    num_padding_layers: int
    spec: KVCacheSpec
    sliding_window: int | None
    state_nbytes: int | None = None
    num_speculative_blocks: int = 0

    @property
    def block_size(self) -> int:
        """Tokens per block (1 for a Mamba group: one state per block)."""
        return self.spec.block_size

    @property
    def is_mamba(self) -> bool:
        """Whether this group holds state-space (Mamba) states rather than attention KV."""
        return self.state_nbytes is not None

    def blocks_per_request(
        self, max_model_len: int, max_num_batched_tokens: int | None = None
    ) -> int:
        """Blocks one request of ``max_model_len`` tokens needs in this group (see
        `blocks_per_request`).

        A Mamba group needs ``1 + num_speculative_blocks`` whatever the length (vLLM's mode
        'none').

        Example:
          >>> spec = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=8, block_size=16)
          >>> KVCacheGroup(0, (0,), 0, spec, 64).blocks_per_request(1024, 256)
          21
        """
        if self.is_mamba:
            _positive_int(max_model_len, "max_model_len")
            return 1 + self.num_speculative_blocks
        return blocks_per_request(
            self.block_size, max_model_len, self.sliding_window, max_num_batched_tokens
        )


@dataclasses.dataclass(frozen=True)
class KVCacheBuffer:
    """One memory buffer of the cache: ``num_blocks`` pages, shared by one layer per group.

    Attributes:
      nbytes: its size on one tensor-parallel rank.
      layers: the model layers stored in it, one from each group (block ``b`` of group ``g``
        lives in page ``b`` of its layer's buffer).

    Example:
      >>> KVCacheBuffer(nbytes=1024, layers=(0, 1)).layers
      (0, 1)
    """

    nbytes: int
    layers: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class KVCachePlan:
    """The result of `plan_kv_cache`.

    Attributes:
      num_blocks: blocks per buffer (the pool size, including the null block).
      page_nbytes: bytes of one layer's page (one block) on one TP rank.
      groups: the KV-cache groups.
      buffers: the memory buffers (as many as layers per group).
      max_model_len: the length the plan was checked for.
      max_num_batched_tokens: tokens per scheduler step assumed for sliding windows.
      tp_size: the tensor-parallel size the page size is for.
      blocks_per_request: blocks (summed over groups) one max-length request needs.

    Example:
      >>> spec = KVCacheSpec(num_layers=4, num_kv_heads=2, head_dim=64, block_size=16,
      ...                    dtype="bfloat16")
      >>> plan = plan_kv_cache([AttentionLayers(spec)], 1 << 30, max_model_len=4096)
      >>> plan.num_blocks, plan.blocks_per_request, round(plan.max_concurrency, 2)
      (32768, 256, 128.0)
    """

    num_blocks: int
    page_nbytes: int
    groups: tuple[KVCacheGroup, ...]
    buffers: tuple[KVCacheBuffer, ...]
    max_model_len: int
    max_num_batched_tokens: int
    tp_size: int
    blocks_per_request: int

    @property
    def group_size(self) -> int:
        """Layers (real or padding) per group = number of buffers."""
        return len(self.buffers)

    @property
    def block_size(self) -> int:
        """Tokens per block of the first attention group (all attention groups share it unless
        page sizes were unified, see `block_sizes`); 1 for a model of Mamba layers only."""
        return next((g.block_size for g in self.groups if not g.is_mamba), 1)

    @property
    def block_sizes(self) -> tuple[int, ...]:
        """Tokens per block of each group (they differ where page sizes were unified)."""
        return tuple(group.block_size for group in self.groups)

    @property
    def num_usable_blocks(self) -> int:
        """Blocks that can be allocated (all but the null block)."""
        return self.num_blocks - 1

    @property
    def cache_nbytes(self) -> int:
        """Total bytes of all buffers on one TP rank."""
        return sum(buffer.nbytes for buffer in self.buffers)

    @property
    def max_concurrency(self) -> float:
        """How many max-length requests fit at once."""
        return self.num_usable_blocks / self.blocks_per_request

    def concurrency(self, max_model_len: int) -> float:
        """How many requests of ``max_model_len`` tokens fit at once.

        Example:
          >>> spec = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=8, block_size=16,
          ...                    dtype="float32")
          >>> plan = plan_kv_cache([AttentionLayers(spec)], 1025 * 1024, max_model_len=256)
          >>> plan.num_blocks, plan.concurrency(256), plan.concurrency(512)
          (1025, 64.0, 32.0)
        """
        needed = sum(group.blocks_per_request(max_model_len, self.max_num_batched_tokens)
                     for group in self.groups)
        return self.num_usable_blocks / needed


def blocks_per_request(
    block_size: int,
    max_model_len: int,
    sliding_window: int | None = None,
    max_num_batched_tokens: int | None = None,
) -> int:
    """Blocks one request of ``max_model_len`` tokens needs in one group (vLLM's
    ``max_memory_usage_bytes / page_size``).

    Args:
      block_size: tokens per block.
      max_model_len: the request length.
      sliding_window: the window, or None for full attention.
      max_num_batched_tokens: tokens one scheduler step computes (chunked prefill); default
        ``max_model_len``. Only matters for sliding windows: the window's last ``window - 1``
        tokens plus one step's tokens must be resident, plus one block because the window
        need not start at a block boundary.

    Returns:
      The block count.

    Raises:
      ValueError: non-positive arguments.

    Example:
      >>> blocks_per_request(16, 1000), blocks_per_request(16, 32768, 4096, 2048)
      (63, 385)
    """
    _positive_int(block_size, "block_size")
    _positive_int(max_model_len, "max_model_len")
    if sliding_window is None:
        return _cdiv(max_model_len, block_size)
    _positive_int(sliding_window, "sliding_window")
    step = max_model_len if max_num_batched_tokens is None else _positive_int(
        max_num_batched_tokens, "max_num_batched_tokens"
    )
    return _cdiv(min(sliding_window - 1 + step, max_model_len), block_size) + 1


def num_blocks_for_memory(available_memory: int, page_nbytes: int, num_layers: int) -> int:
    """Blocks that fit a budget: ``available_memory // page_nbytes // num_layers`` (>= 0).

    Args:
      available_memory: bytes for the KV cache on one device.
      page_nbytes: one layer's bytes per block (`KVCacheSpec.page_nbytes_per_layer`).
      num_layers: layers (buffers) that each hold one page per block.

    Returns:
      The block count.

    Raises:
      ValueError: non-positive page size or layer count.

    Example:
      >>> num_blocks_for_memory(10_000, page_nbytes=100, num_layers=3)
      33
    """
    _positive_int(page_nbytes, "page_nbytes")
    _positive_int(num_layers, "num_layers")
    return max(0, int(available_memory) // page_nbytes // num_layers)


_Layers = AttentionLayers | MambaLayers
_LayersArg = Sequence[_Layers] | _Layers | KVCacheSpec


def _as_layers(attention: _LayersArg) -> list[_Layers]:
    if isinstance(attention, KVCacheSpec):
        return [AttentionLayers(attention)]
    if isinstance(attention, (AttentionLayers, MambaLayers)):
        return [attention]
    items = list(attention)
    if not items:
        raise ValueError("need at least one AttentionLayers or MambaLayers")
    for item in items:
        if not isinstance(item, (AttentionLayers, MambaLayers)):
            raise TypeError(f"expected AttentionLayers or MambaLayers, got {type(item).__name__}")
    return items


_Types = dict[tuple[KVCacheSpec, int | None], list[int]]


@dataclasses.dataclass(frozen=True)
class _State:
    """A Mamba type: layers with one state size and speculative block count."""

    state_nbytes: int
    num_speculative_blocks: int


# (layers, per-layer spec, window, Mamba state or None) of one group.
_GroupLayout = tuple[list[int], KVCacheSpec, int | None, "_State | None"]


def _unify_page_sizes(types: _Types, tp_size: int) -> _Types:
    """vLLM's ``unify_kv_cache_spec_page_size``: types with a smaller page get a proportionally
    larger block size, so every page has the largest size."""
    pages = {spec.page_nbytes_per_layer(tp_size) for spec, _ in types}
    if len(pages) <= 1:
        return types
    largest = max(pages)
    unified: _Types = {}
    for (spec, window), layers in types.items():
        page = spec.page_nbytes_per_layer(tp_size)
        if page != largest:
            if largest % page:
                raise ValueError(
                    f"cannot unify page sizes: layers {sorted(layers)[:8]} have {page}-byte pages "
                    f"(bytes per block per layer), which do not divide the largest page "
                    f"({largest} bytes), so no larger block size matches it. Choose block sizes "
                    "whose pages divide each other."
                )
            spec = spec.replace(block_size=spec.block_size * (largest // page))
        unified.setdefault((spec, window), []).extend(layers)
    return unified


def _fold_sliding_windows(types: _Types) -> _Types:
    """vLLM's ``disable_hybrid_kv_cache_manager``: sliding-window layers next to full-attention
    layers are managed as full attention."""
    windows = {window for _, window in types}
    if None not in windows or len(windows) == 1:
        return types
    folded: _Types = {}
    for (spec, _), layers in types.items():
        folded.setdefault((spec, None), []).extend(layers)
    return folded


def _aligned_block_size(
    specs: Sequence[KVCacheSpec], state_nbytes: int, tp_size: int, kernel_block_alignment: int
) -> int:
    """vLLM's ``Platform._align_hybrid_block_size``: the attention block size whose page holds
    the largest Mamba state (``state_nbytes``)."""
    block_sizes = sorted({spec.block_size for spec in specs})
    if len(block_sizes) > 1:
        raise ValueError(
            f"next to Mamba layers every attention layer needs one block size (vLLM's "
            f"--block-size, which it then raises until a page holds a Mamba state), got "
            f"{block_sizes}"
        )
    block_size = block_sizes[0]
    per_token = 0
    for spec in specs:
        page = spec.page_nbytes_per_layer(tp_size)
        if page % spec.block_size:
            raise ValueError(
                f"cannot align the attention block size to Mamba states: a {page}-byte page "
                f"of {spec.block_size} tokens is not a whole number of bytes per token"
            )
        # vLLM takes the model's attention (its head size and KV heads); where attention
        # types differ, the largest per-token page keeps every page >= the state.
        per_token = max(per_token, page // spec.block_size)
    alignment = max(kernel_block_alignment, block_size)
    if any(spec.mla for spec in specs):
        # vLLM: TRTLLM/FlashInfer MLA kernels want blocks of a multiple of 128 tokens.
        alignment = max(alignment, 128)
    aligned = alignment * _cdiv(state_nbytes, alignment * per_token)
    aligned = kernel_block_alignment * _cdiv(aligned, kernel_block_alignment)
    return max(block_size, aligned)


def _mamba_page_spec(page_nbytes: int) -> KVCacheSpec:
    """A Mamba group's page as bytes: one state per block, the same size on every TP rank
    (vLLM binds a Mamba page as a ``[blocks, 1, 1, page bytes]`` int8 view)."""
    return KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=page_nbytes, block_size=1,
                       dtype="int8", kv_factor=1, mla=True)


def _group(
    items: list[_Layers], tp_size: int, disable_hybrid: bool = False,
    kernel_block_alignment: int = 16,
) -> tuple[int, list[_GroupLayout], int]:
    """Returns (page_nbytes, [(layers, per-layer spec, window, state)] per group, group_size)."""
    _positive_int(kernel_block_alignment, "kernel_block_alignment")
    seen: set[int] = set()
    types: _Types = {}
    states: dict[_State, list[int]] = {}
    for item in items:
        for layer in item.layers:  # type: ignore[union-attr]
            if layer in seen:
                raise ValueError(f"layer {layer} appears in two AttentionLayers or MambaLayers")
            seen.add(layer)
        if isinstance(item, MambaLayers):
            if item.cache_mode != "none":
                raise ValueError(
                    f"Mamba layers {list(item.layers)[:8]} have cache_mode="
                    f"{item.cache_mode!r}: jaxkv sizes vLLM's mamba_cache_mode 'none' only "
                    "(vLLM without prefix caching; with --enable-prefix-caching vLLM switches "
                    "to 'align', which keeps more state blocks per request and aligns blocks "
                    "to prefill checkpoints). Plan with cache_mode='none'."
                )
            key = _State(item.state_nbytes, item.num_speculative_blocks)
            states.setdefault(key, []).extend(item.layers)
            continue
        key_ = (item.spec.replace(num_layers=1), item.sliding_window)
        types.setdefault(key_, []).extend(item.layers)  # type: ignore[arg-type]
    largest_state = max((state.state_nbytes for state in states), default=0)
    if types and states:
        block_size = _aligned_block_size(
            [spec for spec, _ in types], largest_state, tp_size, kernel_block_alignment
        )
        aligned: _Types = {}
        for (spec, window), layers in types.items():
            aligned.setdefault((spec.replace(block_size=block_size), window), []).extend(layers)
        types = aligned
    if disable_hybrid and types:
        types = _fold_sliding_windows(types)
        pages = {spec.page_nbytes_per_layer(tp_size) for spec, _ in types}
        if len(pages) > 1:
            raise ValueError(
                "disable_hybrid needs every layer to have the same page size (bytes per block "
                f"per layer; Mamba layers aside); got {sorted(pages)} bytes. vLLM then sizes "
                "each layer's buffer separately, which jaxkv's shared buffers do not; leave "
                "disable_hybrid off to unify page sizes by block size instead."
            )
    types = _unify_page_sizes(types, tp_size)
    page_nbytes = max(
        [spec.page_nbytes_per_layer(tp_size) for spec, _ in types] + [largest_state]
    )
    # Every type, in the order of its first layer (vLLM's layer order).
    ordered: list[tuple[list[int], KVCacheSpec, int | None, _State | None]] = [
        (layers, spec, window, None) for (spec, window), layers in types.items()
    ]
    mamba_spec = _mamba_page_spec(page_nbytes)  # states padded to the common page
    ordered += [(layers, mamba_spec, None, state) for state, layers in states.items()]
    ordered.sort(key=lambda item: min(item[0]))
    for layers, _, _, _ in ordered:
        layers.sort()
    if len(ordered) == 1:
        return page_nbytes, ordered, len(ordered[0][0])
    counts = [len(layers) for layers, _, _, _ in ordered]
    group_size = min(counts)
    # vLLM 0.33: the largest count when it is under 1.5x the smallest (fewer padding layers).
    if max(counts) < group_size * 1.5:
        group_size = max(counts)
    groups: list[_GroupLayout] = []
    for layers, spec, window, state in ordered:
        num_groups = _cdiv(len(layers), group_size)
        for index in range(num_groups):
            groups.append((layers[index::num_groups], spec, window, state))
    return page_nbytes, groups, group_size


def _needed_blocks(groups: list[_GroupLayout], max_model_len: int,
                   max_num_batched_tokens: int | None) -> int:
    return sum(
        1 + state.num_speculative_blocks if state is not None else
        blocks_per_request(spec.block_size, max_model_len, window, max_num_batched_tokens)
        for _, spec, window, state in groups
    )


def estimate_max_model_len(
    attention: _LayersArg,
    available_memory: int,
    *,
    upper: int,
    tp_size: int = 1,
    max_num_batched_tokens: int | None = None,
    disable_hybrid: bool = False,
    kernel_block_alignment: int = 16,
) -> int:
    """The longest request (up to ``upper`` tokens) whose KV fits the budget, next to the null
    block; 0 when not even one token fits.

    Args:
      attention: the model's layers (or one spec for a single-type model), Mamba layers
        included (see `plan_kv_cache`).
      available_memory: bytes for the KV cache on one device.
      upper: the largest length considered.
      tp_size: tensor-parallel size.
      max_num_batched_tokens: see `blocks_per_request`.
      disable_hybrid: see `plan_kv_cache`.
      kernel_block_alignment: see `plan_kv_cache`.

    Returns:
      The length.

    Raises:
      ValueError, TypeError: invalid layers or arguments.

    Example:
      >>> spec = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=8, block_size=16,
      ...                    dtype="float32")   # 1 KiB pages
      >>> estimate_max_model_len(spec, 5 * 1024, upper=1000)
      64
    """
    page_nbytes, groups, group_size = _group(
        _as_layers(attention), tp_size, disable_hybrid, kernel_block_alignment
    )
    _positive_int(upper, "upper")
    usable = num_blocks_for_memory(available_memory, page_nbytes, group_size) - 1

    def fits(length: int) -> bool:
        step = None if max_num_batched_tokens is None else min(max_num_batched_tokens, length)
        return _needed_blocks(groups, length, step) <= usable

    if not fits(1):
        return 0
    low, high = 1, upper
    while low < high:
        middle = (low + high + 1) // 2
        if fits(middle):
            low = middle
        else:
            high = middle - 1
    return low


def plan_kv_cache(
    attention: _LayersArg,
    available_memory: int,
    *,
    max_model_len: int,
    tp_size: int = 1,
    max_num_batched_tokens: int | None = None,
    num_blocks_override: int | None = None,
    disable_hybrid: bool = False,
    kernel_block_alignment: int = 16,
) -> KVCachePlan:
    """Sizes a KV cache for a memory budget and groups a (hybrid) model's layers.

    Args:
      attention: the model's layers by attention type, or one `KVCacheSpec` for a model with
        one type; a hybrid attention + state-space model adds its Mamba layers as
        `MambaLayers` (``from jaxkv.blocks._sizing import MambaLayers``): the attention block
        size is then raised until a page holds the largest state, and the states are padded
        to that page (vLLM's alignment, see the module docstring).
      available_memory: bytes for the KV cache on one device (after weights and activations).
      max_model_len: the longest request that must fit.
      tp_size: tensor-parallel size (page sizes are per rank).
      max_num_batched_tokens: tokens per scheduler step (see `blocks_per_request`).
      num_blocks_override: use this block count instead of the budget's (tests, debugging).
      disable_hybrid: manage sliding-window layers as full attention when both types are
        present (vLLM's ``--disable-hybrid-kv-cache-manager``); every attention layer must then
        have the same page size (Mamba layers keep their own groups, as in vLLM).
      kernel_block_alignment: with Mamba layers, the attention block size is a multiple of
        ``max(this, block_size)`` (128 at least for MLA): the smallest block size the
        attention kernel supports (vLLM: 16 for FlashAttention and Triton, the default).

    Returns:
      The plan. Attention types with different page sizes are unified by block size (see the
      module docstring), so groups may have different block sizes (`KVCachePlan.block_sizes`).

    Raises:
      InsufficientMemoryError: no memory, or not enough for one ``max_model_len`` request
        (the message gives the longest length that fits).
      ValueError: page sizes that cannot be unified (a smaller page does not divide the
        largest; or differ at all with ``disable_hybrid``), a layer appears twice, Mamba layers
        in a cache mode other than ``"none"``, attention layers of several block sizes next to
        Mamba layers, or other invalid arguments.

    Example:
      >>> full = KVCacheSpec(num_layers=2, num_kv_heads=1, head_dim=8, block_size=16,
      ...                    dtype="float32")
      >>> local = full.replace(num_layers=3)
      >>> plan = plan_kv_cache([AttentionLayers(full, (0, 3)),
      ...                       AttentionLayers(local, (1, 2, 4), sliding_window=32)],
      ...                      available_memory=1 << 20, max_model_len=256)
      >>> [(g.layers, g.num_padding_layers, g.sliding_window) for g in plan.groups]
      [((0, 3), 0, None), ((1, 4), 0, 32), ((2,), 1, 32)]
      >>> [b.layers for b in plan.buffers], plan.num_blocks
      ([(0, 1, 2), (3, 4)], 512)
      >>> small = local.replace(num_layers=3, head_dim=4)   # half the page: twice the block
      >>> plan = plan_kv_cache([AttentionLayers(full, (0, 3)),
      ...                       AttentionLayers(small, (1, 2, 4), sliding_window=32)],
      ...                      available_memory=1 << 20, max_model_len=256)
      >>> plan.block_sizes, plan.page_nbytes
      ((16, 32, 32), 1024)
      >>> plan = plan_kv_cache([AttentionLayers(full, (0, 3)),
      ...                       AttentionLayers(local, (1, 2, 4), sliding_window=32)],
      ...                      available_memory=1 << 20, max_model_len=256, disable_hybrid=True)
      >>> [(g.layers, g.sliding_window) for g in plan.groups]
      [((0, 1, 2, 3, 4), None)]
      >>> attn = KVCacheSpec(num_layers=1, num_kv_heads=8, head_dim=128, block_size=16)
      >>> mamba = MambaLayers.from_shapes([(10240, 3), (128, 64, 128)], ["bfloat16"],
      ...                                 layers=(0, 1, 2, 4, 5, 6))   # Nemotron-H-like
      >>> plan = plan_kv_cache([AttentionLayers(attn, (3,)), mamba], 1 << 30,
      ...                      max_model_len=8192)
      >>> plan.block_size, plan.page_nbytes, [len(g.layers) for g in plan.groups]
      (528, 2162688, [1, 1, 1, 1, 1, 1, 1])
      >>> plan.blocks_per_request   # 16 attention blocks + 1 state block per Mamba group
      22
    """
    attention = _as_layers(attention)
    _positive_int(max_model_len, "max_model_len")
    _positive_int(tp_size, "tp_size")
    if max_num_batched_tokens is not None:
        _positive_int(max_num_batched_tokens, "max_num_batched_tokens")
    page_nbytes, groups, group_size = _group(
        attention, tp_size, disable_hybrid, kernel_block_alignment
    )
    needed = _needed_blocks(groups, max_model_len, max_num_batched_tokens)
    if num_blocks_override is not None:
        if isinstance(num_blocks_override, bool) or not isinstance(num_blocks_override, int) \
                or num_blocks_override < 2:
            raise ValueError(
                f"num_blocks_override must be an int >= 2, got {num_blocks_override!r}"
            )
        num_blocks = num_blocks_override
    else:
        if available_memory <= 0:
            raise InsufficientMemoryError(
                f"no memory available for the KV cache (available_memory={available_memory})"
            )
        num_blocks = num_blocks_for_memory(available_memory, page_nbytes, group_size)
    if num_blocks - 1 < needed:
        needed_nbytes = (needed + 1) * page_nbytes * group_size
        message = (
            f"one request of max_model_len={max_model_len} tokens needs {needed} blocks "
            f"({needed_nbytes / _GIB:.3f} GiB with the null block, {group_size} layer(s) per "
            f"block of {page_nbytes} bytes) but only {max(num_blocks - 1, 0)} usable blocks "
        )
        if num_blocks_override is None:
            message += f"fit in the available {available_memory / _GIB:.3f} GiB"
            fitting = estimate_max_model_len(
                attention, available_memory, upper=max_model_len, tp_size=tp_size,
                max_num_batched_tokens=max_num_batched_tokens, disable_hybrid=disable_hybrid,
                kernel_block_alignment=kernel_block_alignment,
            )
            if fitting:
                message += f"; the longest max_model_len that fits is {fitting}"
        else:
            message += f"exist (num_blocks_override={num_blocks_override})"
        raise InsufficientMemoryError(
            message + ". Give the cache more memory or lower max_model_len."
        )
    group_objects = tuple(
        KVCacheGroup(
            group_id=index,
            layers=tuple(layers),
            num_padding_layers=group_size - len(layers),
            spec=spec.replace(num_layers=len(layers)),
            sliding_window=window,
            state_nbytes=None if state is None else state.state_nbytes,
            num_speculative_blocks=0 if state is None else state.num_speculative_blocks,
        )
        for index, (layers, spec, window, state) in enumerate(groups)
    )
    buffers = tuple(
        KVCacheBuffer(
            nbytes=page_nbytes * num_blocks,
            layers=tuple(group.layers[i] for group in group_objects if i < len(group.layers)),
        )
        for i in range(group_size)
    )
    return KVCachePlan(
        num_blocks=num_blocks,
        page_nbytes=page_nbytes,
        groups=group_objects,
        buffers=buffers,
        max_model_len=max_model_len,
        max_num_batched_tokens=max_model_len if max_num_batched_tokens is None
        else max_num_batched_tokens,
        tp_size=tp_size,
        blocks_per_request=needed,
    )
