"""`KVCacheSpec`: what a paged KV cache holds and how each block is laid out.

This module imports numpy and ml_dtypes only (no JAX), so host-side bookkeeping such as
`jaxkv.blocks` can size caches without starting a JAX backend.

Layout vocabulary (see semantics.md section 1): a layout is the order of the axes inside one
block, written with the letters ``L`` (layer), ``K`` (K/V), ``H`` (KV head), ``T`` (token) and
``D`` (head dim, always last). The block axis is always the leading array axis. Axes that a
layout leaves out become separate arrays: ``"KHTD"`` is one array per layer, ``"HTD"`` one
array per layer and K/V.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import ml_dtypes
import numpy as np

__all__ = [
    "KVCacheSpec",
    "LAYOUT_PRESETS",
    "SUPPORTED_DTYPES",
    "ArrayKey",
    "canonical_dtype",
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
    """KV heads each tensor-parallel rank holds (semantics.md section 2).

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
        """Size of every axis letter for one rank's view of a block."""
        return {
            "L": self.num_layers,
            "K": self.kv_factor,
            "H": self.heads_per_rank(tp_size),
            "T": self.block_size,
            "D": self.head_dim,
        }

    def block_shape(self, tp_size: int = 1) -> tuple[int, ...]:
        """Shape of one block of one cache array, on one TP rank (``tp_size=1``: global)."""
        sizes = self.axis_sizes(tp_size)
        return tuple(sizes[axis] for axis in self.layout)

    def array_keys(self) -> tuple[ArrayKey, ...]:
        """The ``(layer, kv)`` slice each cache array holds, in the cache's array order
        (layer-major, then K before V)."""
        layers: list[int | None] = [None] if "L" in self.layout else list(range(self.num_layers))
        kvs: list[int | None] = [None] if "K" in self.layout else list(range(self.kv_factor))
        return tuple((layer, kv) for layer in layers for kv in kvs)

    @property
    def num_arrays(self) -> int:
        """Number of arrays a cache with this layout consists of."""
        return len(self.array_keys())

    def array_shape(self, num_blocks: int, tp_size: int = 1) -> tuple[int, ...]:
        """Shape of one cache array: ``(num_blocks, *block_shape)``."""
        return (int(num_blocks), *self.block_shape(tp_size))

    def block_nbytes(self, tp_size: int = 1) -> int:
        """Bytes of one block of one array on one TP rank."""
        return int(np.prod(self.block_shape(tp_size))) * self.itemsize

    def page_nbytes_per_layer(self, tp_size: int = 1) -> int:
        """Bytes one block id costs per layer on one TP rank (K and V together), as vLLM's
        ``page_size_bytes``."""
        return self.kv_factor * self.heads_per_rank(tp_size) * self.block_size * self.head_dim * (
            self.itemsize
        )

    def page_nbytes(self, tp_size: int = 1) -> int:
        """Bytes one block id costs over every layer and K/V on one TP rank."""
        return self.page_nbytes_per_layer(tp_size) * self.num_layers

    def cache_nbytes(self, num_blocks: int, tp_size: int = 1) -> int:
        """Bytes of a whole cache of ``num_blocks`` blocks on one TP rank."""
        return self.page_nbytes(tp_size) * int(num_blocks)
