"""Helpers shared by the offload test suites (not a test module)."""

from __future__ import annotations

import numpy as np

from jaxkv import KVCacheSpec, PagedKVCache
from support import bits

LAYOUTS = ("LKHTD", "LKTHD", "KHTD", "KTHD", "HTD", "THD", "TD")


def spec_for(layout: str, dtype: str = "bfloat16", heads: int = 2,
             block_size: int = 4) -> KVCacheSpec:
    """A small spec of `layout` (an MLA spec for "TD")."""
    if layout == "TD":
        return KVCacheSpec.for_mla(num_layers=2, latent_dim=8, block_size=block_size,
                                   dtype=dtype)
    return KVCacheSpec(num_layers=2, num_kv_heads=heads, head_dim=8, block_size=block_size,
                       dtype=dtype, layout=layout)


def filled_cache(spec: KVCacheSpec, num_blocks: int, seed: int, mesh=None
                 ) -> tuple[PagedKVCache, list[np.ndarray]]:
    """A cache holding random bit patterns (NaN payloads included) and its host copies."""
    rng = np.random.default_rng(seed)
    hosts = [bits.random_bits(rng, spec.array_shape(num_blocks), spec.dtype)
             for _ in range(spec.num_arrays)]
    return PagedKVCache.from_arrays(spec, hosts, mesh=mesh), hosts


def token_axis(spec: KVCacheSpec) -> int:
    """The token axis of one block (without the block axis)."""
    return spec.layout.index("T")


def prefix_copy(dst: np.ndarray, src: np.ndarray, num_tokens: int | None,
                spec: KVCacheSpec) -> None:
    """dst[:] = src for whole blocks, else only the first `num_tokens` tokens (in place)."""
    if num_tokens is None or num_tokens <= 0 or num_tokens >= spec.block_size:
        dst[...] = src
        return
    index = [slice(None)] * dst.ndim
    index[token_axis(spec)] = slice(0, num_tokens)
    dst[tuple(index)] = src[tuple(index)]


