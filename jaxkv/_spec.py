"""`KVCacheSpec`: what a paged KV cache holds and how each block is laid out.

This module imports numpy and ml_dtypes only (no JAX), so host-side bookkeeping such as
`jaxkv.blocks` can size caches without starting a JAX backend.

Layout vocabulary (see docs/data-movement.md section 1): a layout is the order of the axes inside
one block, written with the letters ``L`` (layer), ``K`` (K/V), ``H`` (KV head), ``T`` (token) and
``D`` (head dim, always last). The block axis is always the leading array axis. Axes that a
layout leaves out become separate arrays: ``"KHTD"`` is one array per layer, ``"HTD"`` one
array per layer and K/V.

Caches of JAX serving frameworks on TPU (tpu-inference, sglang-jax) store more than the model's
values, and the spec describes that storage exactly:
- ``kv_interleaved``: K and V share the head axis (one array per layer, no ``K`` axis): K of
  head ``h`` at combined head ``2h``, V at ``2h + 1``.
- ``packing`` (with ``packed_axis`` ``"H"`` or ``"T"``): the TPU packs ``32 // dtype_bits``
  sub-32-bit values into one 32-bit word, so the packed axis is stored as two axes
  ``[ceil(n / packing), packing]``; the padding entries ("phantom" heads or tokens) hold
  nothing.
- ``head_dim_alignment``: ``D`` is stored padded to a multiple (128 lanes on TPU).
Padding is never transferred: `KVCacheSpec.payload_runs` lists the bytes of a block that hold
values.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import ml_dtypes
import numpy as np

__all__ = [
    "CACHE_PRESETS",
    "KVCacheSpec",
    "LAYOUT_PRESETS",
    "SUPPORTED_DTYPES",
    "ArrayKey",
    "canonical_dtype",
    "dtype_packing",
    "heads_per_rank",
    "validate_layout",
]

AXIS_LETTERS = "LKHTD"
"""Every letter a layout may use, in TensorRT-LLM's cross-layer order."""

LAYOUT_PRESETS: Mapping[str, str] = {
    "trtllm": "LKHTD",  # TensorRT-LLM pool: [num_blocks, L, K, H, T, D]
    "cross_layer_hnd": "LKHTD",
    "cross_layer_nhd": "LKTHD",
    "flashinfer_hnd": "KHTD",  # one array per layer
    "flashinfer_nhd": "KTHD",
    "vllm_flash_attn": "THD",  # one array per layer and K/V
    "hnd": "HTD",
    "nhd": "THD",
    "mla": "TD",  # latent cache: K = 1, H = 1
}
"""Named layouts found in the wild, by the name used in jaxkv (values are layout strings)."""

SUPPORTED_DTYPES: tuple[np.dtype, ...] = (
    np.dtype(np.float32),
    np.dtype(ml_dtypes.bfloat16),
    np.dtype(np.float16),
    np.dtype(ml_dtypes.float8_e4m3fn),
    np.dtype(ml_dtypes.float8_e5m2),
    np.dtype(np.int8),
)
"""Element types a cache may hold."""

_DTYPE_ALIASES: Mapping[str, np.dtype] = {
    "fp32": np.dtype(np.float32),
    "bf16": np.dtype(ml_dtypes.bfloat16),
    "fp16": np.dtype(np.float16),
    "half": np.dtype(np.float16),
    "fp8": np.dtype(ml_dtypes.float8_e4m3fn),
    "fp8_e4m3": np.dtype(ml_dtypes.float8_e4m3fn),
    "float8_e4m3": np.dtype(ml_dtypes.float8_e4m3fn),
    "fp8_e5m2": np.dtype(ml_dtypes.float8_e5m2),
}

ArrayKey = tuple[int | None, int | None]
"""Which slice of the model one cache array holds: ``(layer, kv)``; ``None`` means the array
spans that whole axis (the layout contains ``L`` or ``K``)."""


def canonical_dtype(dtype: Any) -> np.dtype:
    """Returns the numpy dtype for a dtype-like (name, alias such as ``"bf16"``, numpy or JAX
    dtype).

    Raises:
      ValueError: the dtype is not one of `SUPPORTED_DTYPES`.

    Example:
      >>> canonical_dtype("bf16").name
      'bfloat16'
    """
    if isinstance(dtype, str) and dtype.lower() in _DTYPE_ALIASES:
        result = _DTYPE_ALIASES[dtype.lower()]
    else:
        try:
            result = np.dtype(dtype)
        except TypeError as error:
            raise ValueError(f"unknown dtype {dtype!r}") from error
    if result not in SUPPORTED_DTYPES:
        names = ", ".join(d.name for d in SUPPORTED_DTYPES)
        raise ValueError(f"unsupported KV-cache dtype {result.name}; supported: {names}")
    return result


def dtype_packing(dtype: Any) -> int:
    """Values of `dtype` per 32-bit word (``32 // bits``), as TPU kernels pack them.

    Example:
      >>> dtype_packing("bfloat16"), dtype_packing("float8_e4m3fn"), dtype_packing("float32")
      (2, 4, 1)
    """
    return 4 // canonical_dtype(dtype).itemsize


def _align(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def validate_layout(layout: str) -> str:
    """Checks a layout string and returns it.

    Args:
      layout: per-block axes in order, e.g. ``"LKHTD"``; or a name from `LAYOUT_PRESETS`.

    Returns:
      The layout string (a preset name is resolved to its letters).

    Raises:
      ValueError: unknown letters, a repeated letter, ``T`` or ``D`` missing, or ``D`` not last.

    Example:
      >>> validate_layout("flashinfer_nhd")
      'KTHD'
    """
    if not isinstance(layout, str) or not layout:
        raise ValueError(f"layout must be a non-empty string, got {layout!r}")
    layout = LAYOUT_PRESETS.get(layout, layout)
    unknown = sorted(set(layout) - set(AXIS_LETTERS))
    if unknown:
        raise ValueError(
            f"layout {layout!r} has unknown axis letters {unknown}; use only {AXIS_LETTERS} "
            f"(L layer, K kv, H head, T token, D head dim) or a preset: {sorted(LAYOUT_PRESETS)}"
        )
    repeated = sorted({c for c in layout if layout.count(c) > 1})
    if repeated:
        raise ValueError(f"layout {layout!r} repeats axis letters {repeated}")
    for required in "TD":
        if required not in layout:
            raise ValueError(f"layout {layout!r} lacks the {required!r} axis")
    if layout[-1] != "D":
        raise ValueError(f"layout {layout!r} must end with 'D' (head dim innermost)")
    return layout


def heads_per_rank(num_kv_heads: int, tp_size: int) -> int:
    """KV heads each tensor-parallel rank holds (docs/data-movement.md section 2).

    With ``tp_size <= num_kv_heads`` the heads are split evenly; with more ranks than heads
    each rank holds one head and ``tp_size // num_kv_heads`` consecutive ranks share it.

    Raises:
      ValueError: the head count and TP size do not divide one another.

    Example:
      >>> heads_per_rank(8, 2), heads_per_rank(2, 8)
      (4, 1)
    """
    if num_kv_heads < 1 or tp_size < 1:
        raise ValueError(f"need num_kv_heads >= 1 and tp_size >= 1, got {num_kv_heads}, {tp_size}")
    if tp_size <= num_kv_heads:
        if num_kv_heads % tp_size:
            raise ValueError(
                f"{num_kv_heads} KV heads cannot be split evenly over tensor-parallel size "
                f"{tp_size}"
            )
        return num_kv_heads // tp_size
    if tp_size % num_kv_heads:
        raise ValueError(
            f"tensor-parallel size {tp_size} is not a multiple of the {num_kv_heads} KV heads, "
            "so heads cannot be replicated evenly"
        )
    return 1


@dataclasses.dataclass(frozen=True)
class KVCacheSpec:
    """The shape, element type and block layout of a model's paged KV cache.

    Attributes:
      num_layers: attention layers whose KV the cache holds.
      num_kv_heads: KV heads of the whole model (before tensor parallelism).
      head_dim: elements per head (the latent width for MLA).
      block_size: tokens per block.
      dtype: element type; any of `SUPPORTED_DTYPES` or an alias (stored as a numpy dtype).
      layout: per-block axis order, or a preset name from `LAYOUT_PRESETS`.
      kv_factor: 2 for separate K and V, 1 for a K-only or MLA cache.
      mla: a multi-head latent attention cache: one head, ``kv_factor == 1``, and replicated
        on every tensor-parallel rank instead of split by heads.
      kv_interleaved: K and V interleaved on the head axis (K of head ``h`` at ``2h``, V at
        ``2h + 1``); the layout has ``H`` and no ``K``, and the stored head axis is
        ``2 * heads`` long per rank (before packing).
      packing: values per 32-bit word along `packed_axis`: that axis of ``n`` entries is
        stored as ``[ceil(n / packing), packing]`` (per rank), the tail entries padding (1
        still adds the axis of size 1, as float32 caches of tpu-inference do). None: the axis
        is stored as is.
      packed_axis: ``"H"`` (tpu-inference's combined K/V heads) or ``"T"`` (its MLA cache).
      head_dim_alignment: ``D`` is stored padded to a multiple of this (128 on TPU); the
        padding lanes hold nothing.

    Raises:
      ValueError: from the constructor when a field is invalid, with the reason.

    Example:
      >>> spec = KVCacheSpec(num_layers=2, num_kv_heads=8, head_dim=64, block_size=16,
      ...                    dtype="bfloat16", layout="LKHTD")
      >>> spec.block_shape(tp_size=2)
      (2, 2, 4, 16, 64)
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: Any = "bfloat16"
    layout: str = "LKHTD"
    kv_factor: int = 2
    mla: bool = False
    kv_interleaved: bool = False
    packing: int | None = None
    packed_axis: str = "H"
    head_dim_alignment: int = 1

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
                raise ValueError(f"KVCacheSpec.{name} must be a positive integer, got {value!r}")
            object.__setattr__(self, name, int(value))
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype))
        object.__setattr__(self, "layout", validate_layout(self.layout))
        if self.kv_factor not in (1, 2):
            raise ValueError(f"KVCacheSpec.kv_factor must be 1 or 2, got {self.kv_factor!r}")
        if self.mla and (self.kv_factor != 1 or self.num_kv_heads != 1):
            raise ValueError(
                "an MLA cache has kv_factor=1 and num_kv_heads=1 "
                f"(got kv_factor={self.kv_factor}, num_kv_heads={self.num_kv_heads})"
            )
        if "H" not in self.layout and self.num_kv_heads != 1:
            raise ValueError(
                f"layout {self.layout!r} has no 'H' axis but the model has "
                f"{self.num_kv_heads} KV heads"
            )
        if self.kv_interleaved and (
            "K" in self.layout or "H" not in self.layout or self.kv_factor != 2
        ):
            raise ValueError(
                "kv_interleaved needs a layout with 'H' and without 'K', and kv_factor=2 "
                f"(got layout {self.layout!r}, kv_factor={self.kv_factor})"
            )
        if self.packing not in (None, 1, 2, 4):
            raise ValueError(
                f"KVCacheSpec.packing must be None, 1, 2 or 4, got {self.packing!r}"
            )
        if self.packing is not None and self.packing * self.dtype.itemsize > 4:
            raise ValueError(
                f"packing {self.packing} values of {self.dtype.name} do not fit a 32-bit word "
                f"(at most {dtype_packing(self.dtype)})"
            )
        if self.packed_axis not in ("H", "T") or (
            self.packing is not None and self.packed_axis not in self.layout
        ):
            raise ValueError(
                f"packed_axis must be 'H' or 'T' and in the layout {self.layout!r}, got "
                f"{self.packed_axis!r}"
            )
        if not isinstance(self.head_dim_alignment, int) or self.head_dim_alignment < 1:
            raise ValueError(
                f"head_dim_alignment must be a positive integer, got {self.head_dim_alignment!r}"
            )

    @classmethod
    def for_mla(
        cls,
        num_layers: int,
        latent_dim: int,
        block_size: int,
        dtype: Any = "bfloat16",
        layout: str = "TD",
    ) -> KVCacheSpec:
        """A multi-head latent attention cache (one latent vector per token, replicated).

        Example:
          >>> KVCacheSpec.for_mla(num_layers=4, latent_dim=576, block_size=64).layout
          'TD'
        """
        return cls(
            num_layers=num_layers,
            num_kv_heads=1,
            head_dim=latent_dim,
            block_size=block_size,
            dtype=dtype,
            layout=layout,
            kv_factor=1,
            mla=True,
        )

    @classmethod
    def for_tpu_inference(
        cls, num_layers: int, num_kv_heads: int, head_dim: int, page_size: int,
        dtype: Any = "bfloat16",
    ) -> KVCacheSpec:
        """The per-layer cache of vLLM's JAX backend tpu-inference (also sglang-jax's):
        ``[num_pages, page_size, align(2 * heads, packing) // packing, packing,
        align(head_dim, 128)]`` per rank's heads, K and V interleaved on the head axis,
        ``packing = 32 // dtype_bits``.

        Example:
          >>> spec = KVCacheSpec.for_tpu_inference(2, num_kv_heads=3, head_dim=64, page_size=16,
          ...                                      dtype="float8_e4m3fn")
          >>> spec.array_shape(num_blocks=10), spec.num_arrays
          ((10, 16, 2, 4, 128), 2)
        """
        dtype = canonical_dtype(dtype)
        return cls(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
                   block_size=page_size, dtype=dtype, layout="THD", kv_interleaved=True,
                   packing=dtype_packing(dtype), packed_axis="H", head_dim_alignment=128)

    @classmethod
    def for_sglang_jax(
        cls, num_layers: int, num_kv_heads: int, head_dim: int, page_size: int,
        dtype: Any = "bfloat16",
    ) -> KVCacheSpec:
        """sglang-jax's fused per-layer cache: the same storage as `for_tpu_inference`."""
        return cls.for_tpu_inference(num_layers, num_kv_heads, head_dim, page_size, dtype)

    @classmethod
    def for_tpu_inference_mla(
        cls, num_layers: int, latent_dim: int, page_size: int, dtype: Any = "bfloat16",
        packing: int | None = None,
    ) -> KVCacheSpec:
        """tpu-inference's MLA cache: ``[num_pages, align(page_size, packing) // packing,
        packing, align(latent_dim, 128)]`` (tokens packed; `latent_dim` is the compressed KV
        plus the rope part), replicated over tensor parallelism.

        Example:
          >>> KVCacheSpec.for_tpu_inference_mla(4, latent_dim=576, page_size=64).block_shape()
          (32, 2, 640)
        """
        dtype = canonical_dtype(dtype)
        return cls(num_layers=num_layers, num_kv_heads=1, head_dim=latent_dim,
                   block_size=page_size, dtype=dtype, layout="TD", kv_factor=1, mla=True,
                   packing=dtype_packing(dtype) if packing is None else packing,
                   packed_axis="T", head_dim_alignment=128)

    def replace(self, **changes: Any) -> KVCacheSpec:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return self.dtype.itemsize

    def heads_per_rank(self, tp_size: int = 1) -> int:
        """KV heads held by each tensor-parallel rank (all heads, i.e. 1, for MLA)."""
        if self.mla:
            return self.num_kv_heads
        return heads_per_rank(self.num_kv_heads, tp_size)

    def head_replication(self, tp_size: int = 1) -> int:
        """How many consecutive TP ranks hold the same heads (``tp_size`` for MLA)."""
        if self.mla:
            return tp_size
        return max(1, tp_size // self.num_kv_heads)

    def axis_sizes(self, tp_size: int = 1) -> dict[str, int]:
        """Size of every axis letter for one rank's view of a block (values, no padding; with
        `kv_interleaved`, ``H`` counts the combined K/V heads)."""
        heads = self.heads_per_rank(tp_size)
        return {
            "L": self.num_layers,
            "K": self.kv_factor,
            "H": 2 * heads if self.kv_interleaved else heads,
            "T": self.block_size,
            "D": self.head_dim,
        }

    @property
    def padded(self) -> bool:
        """Whether blocks are stored with padding (packing or an aligned head dim)."""
        return (self.packing or 1) > 1 or self.head_dim_alignment > 1

    def block_axes(self) -> tuple[str, ...]:
        """The letter of every stored block axis: the packed axis appears twice (its word
        index, then its ``"p"`` position inside the word, written lowercase).

        Example:
          >>> KVCacheSpec.for_tpu_inference(1, 8, 128, 16).block_axes()
          ('T', 'H', 'h', 'D')
        """
        axes: list[str] = []
        for axis in self.layout:
            axes.append(axis)
            if self.packing is not None and axis == self.packed_axis:
                axes.append(axis.lower())
        return tuple(axes)

    @property
    def stored_layout(self) -> str:
        """`block_axes` as one layout string, the form `jaxkv.ops.permute_blocks` and
        `jaxkv.ops.merge_blocks` take for a packed cache.

        Example:
          >>> KVCacheSpec.for_tpu_inference(1, 8, 128, 16).stored_layout
          'THhD'
        """
        return "".join(self.block_axes())

    def block_shape(self, tp_size: int = 1) -> tuple[int, ...]:
        """Stored shape of one block of one cache array, on one TP rank (``tp_size=1``:
        global), padding included."""
        sizes = self.axis_sizes(tp_size)
        shape: list[int] = []
        for axis in self.block_axes():
            if axis == "D":
                shape.append(_align(self.head_dim, self.head_dim_alignment))
            elif axis.islower():
                # block_axes() yields a lowercase axis only when packing is set.
                assert self.packing is not None
                shape.append(self.packing)
            elif self.packing is not None and axis == self.packed_axis:
                shape.append(-(-sizes[axis] // self.packing))
            else:
                shape.append(sizes[axis])
        return tuple(shape)

    def global_block_shape(self, tp_size: int = 1) -> tuple[int, ...]:
        """Shape of a block of the global array when `tp_size` ranks each store
        `block_shape(tp_size)` side by side on the head axis (tpu-inference pads per rank).

        Example:
          >>> spec = KVCacheSpec.for_tpu_inference(1, 2, 128, 16, dtype="float8_e4m3fn")
          >>> spec.block_shape(2), spec.global_block_shape(2)
          ((16, 1, 4, 128), (16, 2, 4, 128))
        """
        shape = list(self.block_shape(tp_size))
        if "H" in self.layout and not self.mla:
            shards = tp_size if tp_size <= self.num_kv_heads else self.num_kv_heads
            shape[self.block_axes().index("H")] *= shards
        return tuple(shape)

    def payload_mask(self, tp_size: int = 1) -> np.ndarray:
        """Boolean mask over `block_shape(tp_size)`: True where a block stores a value, False
        on padding (phantom heads or tokens, padded head-dim lanes).

        Example:
          >>> spec = KVCacheSpec.for_tpu_inference(1, 1, 2, 4, dtype="float8_e4m3fn")
          >>> spec.payload_mask()[0, 0, :, :3].tolist()
          [[True, True, False], [True, True, False], [False, False, False], [False, False, False]]
        """
        shape = self.block_shape(tp_size)
        axes = self.block_axes()
        sizes = self.axis_sizes(tp_size)
        mask = np.ones(shape, bool)
        d_axis = axes.index("D")
        lanes = np.arange(shape[d_axis]) < self.head_dim
        mask &= lanes.reshape([-1 if i == d_axis else 1 for i in range(len(shape))])
        if self.packing is not None:
            word = axes.index(self.packed_axis)
            entry = (np.arange(shape[word])[:, None] * self.packing
                     + np.arange(self.packing)[None, :]) < sizes[self.packed_axis]
            mask &= entry.reshape([shape[i] if i in (word, word + 1) else 1
                                   for i in range(len(shape))])
        return mask

    def payload_runs(self, tp_size: int = 1) -> tuple[tuple[int, int], ...]:
        """The bytes of one stored block that hold values, as ``(offset, length)`` runs in
        increasing order (merged where adjacent): what a transfer moves; padding is never
        sent. An unpadded block is one run.

        Example:
          >>> KVCacheSpec.for_tpu_inference(1, 1, 100, 1, dtype="float32").payload_runs()
          ((0, 400), (512, 400))
        """
        flat = self.payload_mask(tp_size).reshape(-1)
        edges = np.flatnonzero(np.diff(np.concatenate([[False], flat, [False]]).astype(np.int8)))
        item = self.itemsize
        return tuple((int(a) * item, int(b - a) * item) for a, b in zip(edges[::2], edges[1::2]))

    def payload_nbytes(self, tp_size: int = 1) -> int:
        """Bytes of values (no padding) in one block of one array on one TP rank."""
        return int(self.payload_mask(tp_size).sum()) * self.itemsize

    def combined_head(self, head: int, kv: int) -> tuple[int, ...]:
        """Index of (rank-local) `head`'s K (``kv=0``) or V on the stored head axes: one index,
        or ``(word, position)`` when heads are packed.

        Example:
          >>> KVCacheSpec.for_tpu_inference(1, 4, 128, 16).combined_head(1, kv=1)
          (1, 1)
        """
        index = 2 * head + kv if self.kv_interleaved else head
        if self.packing is not None and self.packed_axis == "H":
            return divmod(index, self.packing)
        return (index,)

    def array_keys(self) -> tuple[ArrayKey, ...]:
        """The ``(layer, kv)`` slice each cache array holds, in the cache's array order
        (layer-major, then K before V)."""
        layers: list[int | None] = [None] if "L" in self.layout else list(range(self.num_layers))
        spans_kv = "K" in self.layout or self.kv_interleaved
        kvs: list[int | None] = [None] if spans_kv else list(range(self.kv_factor))
        return tuple((layer, kv) for layer in layers for kv in kvs)

    @property
    def num_arrays(self) -> int:
        """Number of arrays a cache with this layout consists of."""
        return len(self.array_keys())

    def array_shape(self, num_blocks: int, tp_size: int = 1) -> tuple[int, ...]:
        """Shape of one cache array: ``(num_blocks, *block_shape)``."""
        return (int(num_blocks), *self.block_shape(tp_size))

    def block_nbytes(self, tp_size: int = 1) -> int:
        """Bytes of one stored block of one array on one TP rank (padding included)."""
        return int(np.prod(self.block_shape(tp_size))) * self.itemsize

    def page_nbytes_per_layer(self, tp_size: int = 1) -> int:
        """Bytes one block id costs per layer on one TP rank (K and V together, padding
        included), as vLLM's ``page_size_bytes``."""
        if "L" in self.layout:  # one block spans every layer
            return self.block_nbytes(tp_size) // self.num_layers
        return self.block_nbytes(tp_size) * (self.num_arrays // self.num_layers)

    def page_nbytes(self, tp_size: int = 1) -> int:
        """Bytes one block id costs over every layer and K/V on one TP rank."""
        return self.page_nbytes_per_layer(tp_size) * self.num_layers

    def cache_nbytes(self, num_blocks: int, tp_size: int = 1) -> int:
        """Bytes of a whole cache of ``num_blocks`` blocks on one TP rank."""
        return self.page_nbytes(tp_size) * int(num_blocks)


CACHE_PRESETS: Mapping[str, Callable[..., KVCacheSpec]] = {
    "tpu_inference": KVCacheSpec.for_tpu_inference,
    "sglang_jax": KVCacheSpec.for_sglang_jax,
    "tpu_inference_mla": KVCacheSpec.for_tpu_inference_mla,
}
"""Spec constructors for the caches of JAX serving frameworks, by framework name."""
