"""Adopting GPU vLLM's torch KV caches as a `jaxkv.PagedKVCache`, zero-copy (DLPack).

vLLM 0.33 hands a KV connector's `register_kv_caches` one torch tensor per attention layer,
each a view of one raw allocation with the logical shape ``[B, H, N, C]``: blocks, KV heads
(of this TP rank), tokens per block and the content of one (head, token) cell, K then V
(``C = head_size + head_size_v`` elements; an MLA layer has ``H = 1`` and ``C`` the latent
width). Its memory order follows the resolved `KVCacheLayout` (``LBNHC``, ``LBHNC``, the
cross-layer ``BLNHC``, ``BLHNC``, ``BHLNC``, or ``LHBNC``): the strides say it, whatever the
logical axis order.

Adoption reads each tensor's memory order from its strides (stride sort), checks that the
memory is dense in that order, and names it in jaxkv's layout letters:

* ``C`` becomes ``D``: K then V of a head as one vector (``kv_factor=1``, ``head_dim =
  head_size + head_size_v``), as vLLM's NIXL connector moves them. ``fuse_kv=False`` splits
  it into ``K`` and ``D`` instead (``"THKD"``), exact but refused by jaxkv's transfer
  planner, which needs the K/V axis outside the heads and tokens.
* The letters after the block axis are the block layout: ``LBNHC`` -> ``"THD"``, ``LBHNC``
  -> ``"HTD"``; MLA -> ``"TD"``.
* Axes stored outside the blocks become separate arrays, as jaxkv's layouts describe: the
  layer axis of ``LB..`` layouts, a ``K`` axis before the blocks (older backends'
  ``(2, num_blocks, ...)`` caches). Layers sharing one allocation with the blocks outermost
  (``BL..``, ``BH..``) are adopted as one array with an ``L`` axis. ``LHBNC`` (heads outside
  the blocks) is refused.

Each array is the torch memory itself: the view permuted into memory order (row-major),
imported with `jax.dlpack.from_dlpack` (``copy=False``).

Writes: the transfer engine's NIXL reads write the registered memory, i.e. the torch tensors.
JAX does not write donated foreign (DLPack) buffers in place: a jaxkv op on the adopted cache
(``cache.copy_blocks(...)``) returns arrays in new buffers, which the transfer engine refuses
(`jaxkv.BufferMovedError`); the adopted cache then adopts the torch memory again. A consumer's
rewrite of blocks that arrived in another layout or block size goes through
`AdoptedKVCache.store_blocks`: the blocks are gathered, rewritten out of place, and copied back
into the torch tensors (never a copy of the whole array).

Ordering on CUDA: JAX imports the tensors once, ordered after torch's current stream only at
that moment, while vLLM's kernels keep writing them on that stream. Before jaxkv reads an
adopted cache with JAX (the post-processing gather, host staging's `stage_out`) it calls
`AdoptedKVCache.wait_for_torch`, which waits for torch's current stream on the tensors' device
(JAX has no public way to make its stream wait on a torch event); `store_blocks` waits for
its own copy. NIXL's reads need neither: vLLM synchronises before a step's transfers start.

The pure helpers (`physical_order`, `plan_adoption`) work on shapes and strides and need no
torch.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jaxkv._spec import KVCacheSpec, canonical_dtype

__all__ = [
    "AdoptionPlan",
    "adopt_for_vllm",
    "adopt_torch_kv_caches",
    "is_torch_caches",
    "physical_order",
    "plan_adoption",
    "vllm_cache_params",
]

# Axes a plan may store outside the blocks (each index a separate array).
_SPLITTABLE = "LK"


def physical_order(shape: Sequence[int], strides: Sequence[int]) -> tuple[int, ...]:
    """The axes of a strided view from outermost to innermost in memory (stride sort).

    Axes of size 1 take no memory; their stride (as vLLM's views keep it) places them, and an
    axis of size 1 sorts inside a larger axis of the same stride.

    Args:
      shape: the view's sizes.
      strides: its strides (any unit, e.g. elements).

    Returns:
      Axis indices, outermost first.

    Example:
      >>> physical_order((10, 4, 16, 128), (8192, 128, 512, 1))  # [B, H, N, C] stored BNHC
      (0, 2, 1, 3)
    """
    if len(shape) != len(strides):
        raise ValueError(f"shape {tuple(shape)} and strides {tuple(strides)} differ in length")
    axes = range(len(shape))
    return tuple(sorted(axes, key=lambda a: (-int(strides[a]), int(shape[a]) == 1, a)))


def _is_dense(shape: Sequence[int], strides: Sequence[int], order: Sequence[int]) -> bool:
    """Whether the view covers one gap-free run in `order` (row-major after permuting)."""
    expected = 1
    for axis in reversed(order):
        if shape[axis] == 1:
            continue
        if strides[axis] != expected:
            return False
        expected *= shape[axis]
    return True


@dataclasses.dataclass(frozen=True)
class AdoptionPlan:
    """How a strided view maps onto jaxkv arrays.

    Attributes:
      order: the view's axes in memory order (permute the view by it: row-major result).
      split: letters of the leading axes stored outside the blocks (each index its own array),
        outermost first: a subset of ``"LK"``.
      layout: the letters of the axes after the block axis (jaxkv's block layout).
    """

    order: tuple[int, ...]
    split: str
    layout: str


def plan_adoption(letters: str, shape: Sequence[int], strides: Sequence[int],
                  name: str = "tensor") -> AdoptionPlan:
    """Describes a strided view in jaxkv's terms from its strides.

    Args:
      letters: one letter per axis of the view: ``B`` (blocks) and jaxkv's ``L``, ``K``,
        ``H``, ``T``, ``D``.
      shape: the view's sizes.
      strides: its strides in elements.
      name: what error messages call the view (a layer name).

    Returns:
      The `AdoptionPlan`.

    Raises:
      ValueError: the memory is not dense in its own order (gaps, overlaps), an axis other
        than ``L`` or ``K`` is stored outside the blocks, or ``D`` is not innermost.

    Example:
      >>> plan = plan_adoption("BHTKD", (10, 4, 16, 2, 64), (8192, 128, 512, 64, 1))
      >>> plan.order, plan.split, plan.layout
      ((0, 2, 1, 3, 4), '', 'THKD')
      >>> plan_adoption("KBTHD", (2, 10, 16, 4, 64), (40960, 4096, 256, 64, 1)).split
      'K'
    """
    if len(letters) != len(shape) or sorted(set(letters)) != sorted(letters) or "B" not in letters:
        raise ValueError(f"{name}: axis letters {letters!r} do not fit shape {tuple(shape)}")
    order = physical_order(shape, strides)
    physical = "".join(letters[a] for a in order)
    if not _is_dense(shape, strides, order):
        raise ValueError(
            f"{name}: its memory is not dense (shape {tuple(shape)}, strides {tuple(strides)}, "
            f"memory order {physical!r}): it has gaps or overlaps, so it is not one block-major "
            "array jaxkv can adopt without a copy"
        )
    # Axes of size 1 hold no memory: keep them inside the blocks and before the head dim.
    units = {c for c, n in zip(letters, shape) if n == 1 and c != "B"}
    split, layout = physical.split("B")
    moved = "".join(c for c in split if c in units)
    split = "".join(c for c in split if c not in units)
    layout = moved + layout
    if "D" in layout:
        tail = layout[layout.index("D") + 1:]
        if tail and set(tail) <= units:
            layout = layout[: layout.index("D")] + tail + "D"
    bad = sorted(set(split) - set(_SPLITTABLE))
    if bad:
        raise ValueError(
            f"{name}: axes {bad} are stored outside the blocks (memory order {physical!r}); "
            "jaxkv adopts only blocks-first storage, with at most the layer and K/V axes "
            "outside (layouts such as vLLM's LHBNC are not supported)"
        )
    if not layout.endswith("D"):
        raise ValueError(f"{name}: the head dim is not innermost (memory order {physical!r})")
    order = tuple(letters.index(c) for c in split + "B" + layout)
    return AdoptionPlan(order, split, layout)


def _natural_key(name: str) -> list[Any]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def vllm_cache_params(vllm_config: Any, kv_cache_config: Any = None,
                      group: int = 0) -> dict[str, Any]:
    """What `adopt_torch_kv_caches` needs, from vLLM's configs: the attention spec of KV
    cache group `group` when known, else the model config.

    Returns:
      ``num_kv_heads`` (this rank's), ``head_size``, ``head_size_v``, ``block_size``,
      ``mla`` and ``dtype`` (the element type the bytes hold: fp8 caches, which vLLM stores
      as ``uint8``, are named by ``cache_config.cache_dtype``).

    Raises:
      ValueError: a cache vLLM stores quantized with inline scales or padded pages.
    """
    cache_config = vllm_config.cache_config
    cache_dtype = str(getattr(cache_config, "cache_dtype", "auto") or "auto")
    spec = None
    if kv_cache_config is not None and kv_cache_config.kv_cache_groups:
        spec = kv_cache_config.kv_cache_groups[group].kv_cache_spec
        specs = getattr(spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs
        if specs:
            spec = next(iter(specs.values()))
    if spec is not None and hasattr(spec, "num_kv_heads"):
        for field in ("state_content_bytes", "num_head_slots", "page_size_padded"):
            if getattr(spec, field, None) is not None:
                raise ValueError(
                    f"vLLM's KV cache spec sets {field} (packed, quantized-with-scales or "
                    "padded pages): jaxkv cannot describe that storage"
                )
        if getattr(spec, "tokens_per_state", 1) != 1:
            raise ValueError("vLLM's KV cache stores several tokens per state: not supported")
        mla = type(spec).__name__.endswith("MLASpec") or type(spec).__name__ == "MLAAttentionSpec"
        params: dict[str, Any] = dict(
            num_kv_heads=int(spec.num_kv_heads),
            head_size=int(spec.head_size),
            head_size_v=int(spec.head_size_v),
            block_size=int(spec.block_size),
            mla=mla,
        )
        torch_dtype = spec.dtype
    else:
        model = vllm_config.model_config
        mla = bool(getattr(model, "use_mla", False))
        head_size = int(model.get_head_size())
        params = dict(
            num_kv_heads=1 if mla else int(model.get_num_kv_heads(vllm_config.parallel_config)),
            head_size=head_size,
            head_size_v=0 if mla else head_size,
            block_size=int(cache_config.block_size),
            mla=mla,
        )
        torch_dtype = model.dtype
    if cache_dtype.startswith("fp8"):
        params["dtype"] = "float8_e5m2" if cache_dtype == "fp8_e5m2" else "float8_e4m3fn"
    elif cache_dtype not in ("auto", "bfloat16", "float16", "half", "float", "float32"):
        raise ValueError(f"vLLM cache_dtype {cache_dtype!r} is not supported by jaxkv")
    else:
        params["dtype"] = str(torch_dtype).removeprefix("torch.")
    return params


def adopt_torch_kv_caches(
    kv_caches: Mapping[str, Any],
    *,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: Any = None,
    head_size_v: int | None = None,
    mla: bool = False,
    letters: str | None = None,
    fuse_kv: bool = True,
) -> tuple[Any, tuple[str, ...]]:
    """Adopts vLLM's per-layer torch KV caches as one `jaxkv.PagedKVCache`, zero-copy.

    Args:
      kv_caches: layer name -> torch tensor, as vLLM's `register_kv_caches` receives them.
        Layers are numbered in natural order of their names (``layers.2`` before
        ``layers.10``); names that alias another layer's memory (vLLM's KV sharing) are
        adopted once.
      num_kv_heads: KV heads in each tensor (this TP rank's).
      head_size: elements of K per head (the latent width for MLA).
      block_size: tokens per block (vLLM's block size).
      dtype: the element type the bytes hold (vLLM stores fp8 caches as ``uint8``: pass
        ``"float8_e4m3fn"``); None: the tensors' dtype.
      head_size_v: elements of V per head (default `head_size`; 0 for MLA).
      mla: an MLA cache (one latent vector per token, ``H == 1``).
      letters: the tensors' logical axes, when not vLLM 0.33's ``[B, H, N, C]`` (``C``
        holding K then V): e.g. ``"KBTHD"`` for ``(2, num_blocks, block_size, heads,
        head_size)``, ``"BKTHD"`` for ``(num_blocks, 2, ...)``, ``"BTD"`` for
        ``(num_blocks, block_size, latent)``.
      fuse_kv: with vLLM 0.33's ``C`` axis (K then V of a head), describe each head's K and V
        as one vector of ``head_size + head_size_v`` elements (``kv_factor=1``, layouts such
        as ``"THD"``), as vLLM's own NIXL connector moves them: the form jaxkv's transfer
        planner takes, so the connector uses it (its peers must describe their caches the
        same way, as the connector does for every vLLM torch cache). False: a ``K`` axis
        next to ``D`` (``"THKD"``; exact, but the planner refuses K inside the heads and
        tokens).

    Returns:
      ``(cache, layer_names)``: the cache (its arrays are the torch memory: equal
      ``unsafe_buffer_pointer()`` and ``data_ptr()``) and the adopted layers in cache order.

    Raises:
      TypeError: a value is not a torch tensor.
      ValueError: an empty mapping, tensors of different dtypes, shapes or devices, shapes that
        do not match the parameters, non-dense or unsupported memory orders, a dtype jaxkv
        does not support, or memory JAX cannot import without a copy (CPU needs 64-byte
        alignment) or cannot run programs on (GPUs need 16-byte alignment); each message
        names the layer.

    Example (needs torch; vLLM's LBNHC layout: each layer ``[B, N, H, C]`` in memory):
      >>> import torch  # doctest: +SKIP
      >>> raw = torch.zeros(2, 8, 16, 4, 2 * 64, dtype=torch.bfloat16)  # doctest: +SKIP
      >>> layers = {f"layers.{i}": raw[i].permute(0, 2, 1, 3)  # doctest: +SKIP
      ...           for i in range(2)}  # [B, H, N, C] views
      >>> cache, names = adopt_torch_kv_caches(  # doctest: +SKIP
      ...     layers, num_kv_heads=4, head_size=64, block_size=16)
      >>> cache.spec.layout, cache.arrays[0].unsafe_buffer_pointer() == raw.data_ptr()
      ... # doctest: +SKIP
      ('THD', True)
    """
    import torch

    from jaxkv import PagedKVCache

    if not isinstance(kv_caches, Mapping) or not kv_caches:
        raise ValueError("register_kv_caches needs a non-empty mapping layer name -> tensor")
    for name, tensor in kv_caches.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"layer {name!r}: a {type(tensor).__name__}, not a torch tensor")
    if head_size_v is None:
        head_size_v = 0 if mla else head_size
    if mla and (num_kv_heads != 1 or head_size_v != 0):
        raise ValueError("an MLA cache has one head and no separate V (head_size_v=0)")
    fused = fuse_kv and letters is None
    if not mla and not fused and head_size_v != head_size:
        raise ValueError(
            f"K and V head sizes differ ({head_size} and {head_size_v}): jaxkv stores K and V "
            "with one head dim"
        )
    names = sorted(kv_caches, key=_natural_key)
    first = kv_caches[names[0]]
    for name in names[1:]:
        t = kv_caches[name]
        for what, a, b in (("dtype", t.dtype, first.dtype), ("shape", tuple(t.shape),
                           tuple(first.shape)), ("device", t.device, first.device)):
            if a != b:
                raise ValueError(
                    f"layer {name!r} has {what} {a}, layer {names[0]!r} {b}: one cache needs "
                    "one dtype, shape and device (several KV cache groups are not adopted here)"
                )
    # vLLM's KV sharing binds one tensor to several layer names: adopt it once.
    unique: list[str] = []
    seen: set[tuple] = set()
    for name in names:
        t = kv_caches[name]
        key = (t.data_ptr(), tuple(t.stride()))
        if key not in seen:
            seen.add(key)
            unique.append(name)

    kv_factor = 1 if mla or fused else 2
    head_dim = head_size + head_size_v if fused else head_size
    torch_dtype = first.dtype
    element = canonical_dtype(dtype if dtype is not None else str(torch_dtype).split(".")[-1])
    view_dtype = _torch_dtype(element)
    if torch_dtype != view_dtype and first.element_size() != element.itemsize:
        raise ValueError(
            f"the tensors hold {torch_dtype} ({first.element_size()} bytes), which cannot "
            f"be read as {element.name} ({element.itemsize} bytes)"
        )
    views = {}
    for name in unique:
        t = kv_caches[name]
        if torch_dtype != view_dtype:
            t = t.view(view_dtype)
        views[name] = t
    if letters is None:
        letters = "BHTC"
        sizes = dict(H=num_kv_heads, T=block_size, C=head_size + head_size_v)
    else:
        sizes = dict(H=num_kv_heads, T=block_size, D=head_size, K=kv_factor)
    # Check the logical sizes before reading the memory order.
    shape = tuple(first.shape)
    if len(shape) != len(letters):
        raise ValueError(
            f"layer {names[0]!r} has shape {shape}; expected axes {letters!r} "
            f"({_describe(letters)})"
        )
    for letter, size in zip(letters, shape):
        want = sizes.get(letter)
        if want is not None and size != want:
            if letter == "T" and size < block_size and block_size % size == 0:
                raise ValueError(
                    f"layer {names[0]!r} holds {size}-token kernel blocks, not vLLM's "
                    f"{block_size}-token blocks (kernel block splitting): not supported; use a "
                    f"block size of {size}"
                )
            raise ValueError(
                f"layer {names[0]!r} has shape {shape}; axis {letter!r} ({_describe(letter)}) "
                f"should be {want} for num_kv_heads={num_kv_heads}, head_size={head_size}, "
                f"head_size_v={head_size_v}, block_size={block_size}"
            )
    if fused:  # K then V of a head: one vector
        letters = letters.replace("C", "D")
    elif "C" in letters:  # vLLM 0.33: C holds K then V of one head dim
        c = letters.index("C")
        for name, t in views.items():
            views[name] = t.unflatten(c, (kv_factor, head_size))
        letters = letters.replace("C", "KD")
    if mla:  # the latent cache: drop the unit head (and K) axes, jaxkv's "TD"
        for axis in "HK":
            if axis in letters:
                i = letters.index(axis)
                views = {name: t.squeeze(i) for name, t in views.items()}
                letters = letters.replace(axis, "")

    arrays_by_key, layout, split = _plan_layers(views, unique, letters)
    num_layers = len(unique)
    spec = KVCacheSpec(
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=element,
        layout=layout,
        kv_factor=kv_factor,
        mla=mla,
    )
    sources = [arrays_by_key[key] for key in spec.array_keys()]
    wrapped = PagedKVCache.wrap([_import(name, tensor) for name, tensor in sources], spec)
    cache = _adopted_class()(wrapped.spec, wrapped.arrays, wrapped.sharding, tuple(sources))
    return cache, tuple(unique)


_ADOPTED: list[type] = []


def _adopted_class() -> type:
    """`AdoptedKVCache`, defined on first use (it subclasses `PagedKVCache`, whose module
    imports JAX)."""
    if _ADOPTED:
        return _ADOPTED[0]
    import jax

    from jaxkv import PagedKVCache

    @jax.tree_util.register_pytree_node_class
    class AdoptedKVCache(PagedKVCache):
        """A `PagedKVCache` over torch memory (`adopt_torch_kv_caches`).

        An update that donates its arrays deletes them without writing the torch memory (JAX
        does not alias foreign buffers): the result is in new buffers, which the transfer
        engine refuses. The deleted arrays are then adopted again from the torch tensors (the
        same memory), so the cache stays usable. The transfer engine's rewrite of received
        blocks calls `store_blocks`, which copies those blocks into the torch memory, after
        `wait_for_torch`. Through ``jax.jit`` (pytree flattening) it comes back as a plain
        cache of the step's outputs.
        """

        _arrays: tuple[Any, ...]

        def __init__(self, spec: Any, arrays: Sequence[Any], sharding: Any,
                     sources: tuple[tuple[str, Any], ...] = ()):
            self._sources = sources
            super().__init__(spec, arrays, sharding)

        @property
        def arrays(self) -> tuple[Any, ...]:
            arrays = self._arrays
            if self._sources and any(
                isinstance(a, jax.Array) and not isinstance(a, jax.core.Tracer)
                and a.is_deleted() for a in arrays
            ):
                arrays = tuple(
                    _import(name, tensor) if a.is_deleted() else a
                    for a, (name, tensor) in zip(arrays, self._sources)
                )
                self._arrays = arrays
            return arrays

        @arrays.setter
        def arrays(self, value: Sequence[Any]) -> None:
            self._arrays = tuple(value)

        def wait_for_torch(self) -> None:
            """Waits for the work queued on torch's current stream of the tensors' device
            (vLLM's writes of the cache), so that JAX reads what torch wrote. JAX orders its
            reads after torch only when it imports the memory; call this before reading the
            adopted arrays with JAX. Nothing to wait for on CPU tensors."""
            import torch

            devices = {tensor.device for _, tensor in self._sources}
            for device in devices:
                if device.type == "cuda":
                    torch.cuda.current_stream(device).synchronize()

        def store_blocks(self, index: int, ids: Any, blocks: Any) -> None:
            """Writes ``blocks[i]`` into block ``ids[i]`` of this cache's torch memory (array
            `index`) and waits for the copy; negative ids (padding) are skipped. Other blocks
            are not touched: reads of other requests may be landing in them.

            Args:
              index: the cache array.
              ids: block ids, shape ``[n]``.
              blocks: JAX array ``[n, *block]`` of the array's block shape and dtype, e.g. the
                transfer engine's rewrite of gathered blocks.

            Raises:
              ValueError: a cache without torch memory, or `blocks` of the wrong shape.
            """
            import torch

            if not self._sources:
                raise ValueError("store_blocks: this cache holds no torch memory")
            _, tensor = self._sources[index]
            ids = np.asarray(ids).reshape(-1)
            # Same-width signed integers: every bit kept (NaNs, fp8) and torch indexes them
            # on every device.
            width = {1: (torch.int8, "int8"), 2: (torch.int16, "int16"),
                     4: (torch.int32, "int32"), 8: (torch.int64, "int64")}
            torch_int, jax_int = width[tensor.element_size()]
            target = tensor.view(torch_int)
            if tuple(blocks.shape) != (len(ids), *target.shape[1:]):
                raise ValueError(
                    f"store_blocks: {len(ids)} blocks of array {index} need shape "
                    f"{(len(ids), *tuple(target.shape[1:]))}, got {tuple(blocks.shape)}")
            keep = np.flatnonzero(ids >= 0)
            if not keep.size:
                return
            if keep.size < len(ids):
                blocks = blocks[keep]
            bits = jax.lax.bitcast_convert_type(blocks, jax_int).block_until_ready()
            at = torch.as_tensor(ids[keep].astype(np.int64), device=target.device)
            target.index_copy_(0, at, torch.from_dlpack(bits).to(target.device))
            if target.device.type == "cuda":
                torch.cuda.current_stream(target.device).synchronize()

        @classmethod
        def tree_unflatten(cls, aux, arrays):
            spec, sharding = aux
            return PagedKVCache(spec, arrays, sharding)

    _ADOPTED.append(AdoptedKVCache)
    return AdoptedKVCache


def _describe(letters: str) -> str:
    words = {"B": "blocks", "L": "layers", "K": "K/V", "H": "KV heads", "T": "tokens per block",
             "D": "head dim", "C": "K and V of one head"}
    return ", ".join(words.get(c, c) for c in letters)


def _torch_dtype(dtype: np.dtype) -> Any:
    import torch

    name = {"float8_e4m3fn": "float8_e4m3fn", "float8_e5m2": "float8_e5m2"}.get(
        dtype.name, dtype.name)
    return getattr(torch, name)


def _plan_layers(views: Mapping[str, Any], names: Sequence[str], letters: str):
    """The arrays of every layer: ``{(layer, kv): (name, row-major tensor)}``, the block
    layout and the split letters."""
    import torch

    first = views[names[0]]
    try:
        plans = [plan_adoption(letters, tuple(views[n].shape), tuple(views[n].stride()),
                               f"layer {n!r}")
                 for n in names]
        per_layer_error = None
    except ValueError as error:
        plans, per_layer_error = [], error
    if plans and len({(p.split, p.layout) for p in plans}) > 1:
        raise ValueError(
            "the layers are stored in different orders: "
            + ", ".join(f"{n}: {p.split}B{p.layout}" for n, p in zip(names, plans))
        )
    if plans:
        plan = plans[0]
        out = {}
        for layer, (name, plan_n) in enumerate(zip(names, plans)):
            t = views[name].permute(plan_n.order)
            for index in np.ndindex(*t.shape[: len(plan_n.split)]):
                key = {"L": layer, "K": None if "K" in plan_n.layout else 0}
                key.update(zip(plan_n.split, index))
                out[(key["L"], key["K"])] = (name, t[index] if index else t)
        return out, plan.layout, plan.split
    # Not dense per layer: the layers may be slices of one block-major allocation (vLLM's
    # cross-layer layouts, block axis outermost). Adopt them as one array with an L axis.
    assert per_layer_error is not None
    if len(names) < 2:
        raise per_layer_error
    storage = {views[n].untyped_storage().data_ptr() for n in names}
    strides = {tuple(views[n].stride()) for n in names}
    item = first.element_size()
    offsets = [views[n].data_ptr() - views[names[0]].data_ptr() for n in names]
    steps = {b - a for a, b in zip(offsets, offsets[1:])}
    if len(storage) != 1 or len(strides) != 1 or len(steps) != 1 or steps == {0} or (
            next(iter(steps)) % item):
        raise per_layer_error
    step = next(iter(steps)) // item
    stacked = torch.as_strided(
        first, (len(names), *first.shape), (step, *first.stride()), first.storage_offset()
    )
    try:
        plan = plan_adoption("L" + letters, tuple(stacked.shape), tuple(stacked.stride()),
                             f"layers {names[0]!r}..{names[-1]!r} together")
    except ValueError:
        raise per_layer_error from None
    t = stacked.permute(plan.order)
    out = {}
    for index in np.ndindex(*t.shape[: len(plan.split)]):
        key = {"L": None, "K": None if "K" in plan.layout else 0}
        key.update(zip(plan.split, index))
        label = names[key["L"]] if key["L"] is not None else names[0]
        out[(key["L"], key["K"])] = (label, t[index] if index else t)
    return out, plan.layout, plan.split


# XLA's GPU runtime requires every program parameter to start on a 16-byte boundary.
_GPU_PARAMETER_ALIGNMENT = 16


def _import(name: str, tensor: Any) -> Any:
    """`tensor` (row-major) as a JAX array over the same memory."""
    import jax

    if not tensor.is_contiguous():
        raise ValueError(f"layer {name!r}: internal error, the permuted view is not row-major")
    try:
        array = jax.dlpack.from_dlpack(tensor.detach(), copy=False)
    except (ValueError, TypeError, RuntimeError) as error:
        raise ValueError(
            f"layer {name!r}: JAX cannot adopt this memory without a copy ({error})"
        ) from error
    if array.unsafe_buffer_pointer() != tensor.data_ptr():
        raise ValueError(f"layer {name!r}: JAX imported a copy, not the torch memory")
    if tensor.device.type != "cpu" and tensor.data_ptr() % _GPU_PARAMETER_ALIGNMENT:
        # JAX imports such a view without a copy, but XLA's GPU runtime then refuses every
        # program it is passed to ("Address of buffer 0 must be a multiple of 10").
        raise ValueError(
            f"layer {name!r}: the tensor starts at {tensor.data_ptr():#x}, not a multiple of "
            f"{_GPU_PARAMETER_ALIGNMENT} bytes: XLA on GPUs runs no program on such memory")
    return array


def is_torch_caches(kv_caches: Any) -> bool:
    """Whether `kv_caches` is a mapping whose values are torch tensors (GPU vLLM's
    `register_kv_caches` argument); never imports torch.

    Example:
      >>> is_torch_caches({"layers.0": np.zeros(4)})
      False
    """
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(kv_caches, Mapping) or not kv_caches:
        return False
    return any(isinstance(v, torch.Tensor) for v in kv_caches.values())


def adopt_for_vllm(kv_caches: Mapping[str, Any], vllm_config: Any, kv_cache_config: Any,
                   tp_size: int, tp_rank: int | None, group: int = 0) -> Any:
    """The `PagedKVCache` over vLLM's torch caches (`adopt_torch_kv_caches` with the
    parameters of `vllm_cache_params`), for `JaxKVConnector.register_kv_caches`: all of them,
    or (several KV cache groups) the layers of KV cache group `group`.

    Raises:
      ValueError: what `adopt_torch_kv_caches` and `vllm_cache_params` raise, several TP
        ranks without this worker's ``tp_rank`` (a vLLM worker's tensors hold its own heads),
        or a layout jaxkv's transfer planner does not take (``BHLNC``: layers inside heads).
    """
    if tp_size > 1 and tp_rank is None:
        raise ValueError(
            "vLLM's torch KV caches hold one TP rank's heads: set tp_rank (and process_index) "
            "in kv_connector_extra_config"
        )
    params = vllm_cache_params(vllm_config, kv_cache_config, group)
    cache, _ = adopt_torch_kv_caches(kv_caches, **params)
    layout = cache.spec.layout
    inner = min(layout.index(a) for a in "HT" if a in layout)
    if any(layout.index(a) > inner for a in "LK" if a in layout):
        # jaxkv's transfer planner moves per-(layer, K/V) slabs of [H, T, D]
        raise ValueError(
            f"vLLM's KV cache layout stores the layers inside the heads (jaxkv layout "
            f"{layout!r}): jaxkv cannot transfer it; use VLLM_KV_CACHE_LAYOUT=LBNHC, LBHNC, "
            "BLNHC or BLHNC"
        )
    return cache
