"""Helpers for the jaxkv.transfer tests (not a test module).

`NumpyEngine` holds an engine's cache as raw byte buffers per (rank, region), filled from a
global token-indexed cache ``G[layer, kv, head, position, d]`` by independent layout math, so
that a `ReadPlan`'s byte copies can be simulated and checked bit for bit.
"""

from __future__ import annotations

import numpy as np

from jaxkv import EngineConfig, KVCacheSpec
from jaxkv.transfer import AgentInfo, RankInfo, RegionInfo, engine_metadata

REGION_STRIDE = 1 << 36  # fake base addresses: rank * 2^44 + region * 2^36


def fake_regions(config: EngineConfig, rank: int, num_blocks: int) -> list[RegionInfo]:
    tp_rank, pp_rank = config.coordinates(rank)
    local = config.local_spec(pp_rank)
    layer_start, _ = config.layer_range(pp_rank)
    h0, h1 = config.head_range(tp_rank)
    out = []
    for index, (layer, kv) in enumerate(local.array_keys()):
        out.append(RegionInfo(
            array_index=index, layer=-1 if layer is None else layer + layer_start,
            kv=-1 if kv is None else kv, head_start=h0, head_stop=h1,
            base_address=(rank << 44) + index * REGION_STRIDE,
            block_len=local.block_nbytes(config.tp_size), num_blocks=num_blocks, device_id=0,
            memory_kind="DRAM"))
    return out


def fake_metadata(engine_id: str, config: EngineConfig, num_blocks: int, generation: int = 0):
    ranks = [RankInfo(rank=r, agent_name=f"{engine_id}-{r}",
                      regions=fake_regions(config, r, num_blocks))
             for r in range(config.world_size)]
    agents = [AgentInfo(name=f"{engine_id}-{r}", metadata=b"md") for r in range(config.world_size)]
    return engine_metadata(engine_id, config, ranks, agents, generation)


def global_cache(spec: KVCacheSpec, num_tokens: int, seed: int = 0) -> np.ndarray:
    """``G[layer, kv, head, position, d]`` as unsigned ints of the dtype's width, random bits."""
    rng = np.random.default_rng(seed)
    width = np.dtype(f"u{spec.itemsize}")
    shape = (spec.num_layers, spec.kv_factor, spec.num_kv_heads, num_tokens, spec.head_dim)
    return rng.integers(0, np.iinfo(width).max, size=shape, dtype=width, endpoint=True)


class NumpyEngine:
    """Raw byte buffers of every (rank, region) of an engine."""

    def __init__(self, config: EngineConfig, num_blocks: int, seed: int = 1):
        self.config = config
        self.spec = config.spec
        self.num_blocks = num_blocks
        rng = np.random.default_rng(seed)
        self.buffers: dict[int, list[np.ndarray]] = {}
        for rank in range(config.world_size):
            regions = fake_regions(config, rank, num_blocks)
            self.buffers[rank] = [
                rng.integers(0, 256, size=r.block_len * num_blocks, dtype=np.uint8)
                for r in regions
            ]

    def _rank_blocks(self, rank: int, g_slice: np.ndarray) -> list[np.ndarray]:
        """Splits ``[blocks, L_local, K, H_rank, T, D]`` (uint) into per-region block arrays in
        the layout's order."""
        layout = self.spec.layout
        letters = "LKHTD"
        out = []
        local = self.config.local_spec(self.config.coordinates(rank)[1])
        for layer, kv in local.array_keys():
            x = g_slice
            axes = list(letters)
            for letter, index in (("L", layer), ("K", kv), ("H", None if "H" in layout else 0)):
                if index is not None:
                    x = np.take(x, index, axis=1 + axes.index(letter))
                    axes.remove(letter)
            perm = [0] + [1 + axes.index(a) for a in layout]
            out.append(np.ascontiguousarray(np.transpose(x, perm)))
        return out

    def slice_of(self, rank: int, g: np.ndarray, first_token: int, num_blocks: int) -> list[np.ndarray]:
        """What `rank`'s blocks holding tokens ``[first_token, ...)`` must contain (per region,
        ``[num_blocks, *block_shape]``), from G by independent indexing."""
        tp_rank, pp_rank = self.config.coordinates(rank)
        l0, l1 = self.config.layer_range(pp_rank)
        h0, h1 = self.config.head_range(tp_rank)
        t = self.spec.block_size
        tokens = g[l0:l1, :, h0:h1, first_token:first_token + num_blocks * t, :]
        pad = num_blocks * t - tokens.shape[3]
        if pad:
            tokens = np.concatenate(
                [tokens, np.zeros((*tokens.shape[:3], pad, tokens.shape[4]), tokens.dtype)], axis=3)
        # [L, K, H, blocks*T, D] -> [blocks, L, K, H, T, D]
        blocks = tokens.reshape(*tokens.shape[:3], num_blocks, t, tokens.shape[4])
        blocks = np.moveaxis(blocks, 3, 0)
        return self._rank_blocks(rank, blocks)

    def write_request(self, g: np.ndarray, block_ids, first_token: int = 0) -> None:
        """Stores the request's tokens (from `first_token`) into `block_ids` on every rank."""
        ids = np.asarray(block_ids)
        for rank in range(self.config.world_size):
            for region, blocks in zip(self.buffers[rank], self.slice_of(rank, g, first_token, len(ids))):
                view = region.reshape(self.num_blocks, -1)
                view[ids] = blocks.reshape(len(ids), -1).view(np.uint8)

    def region_blocks(self, rank: int, region: int, block_ids) -> np.ndarray:
        return self.buffers[rank][region].reshape(self.num_blocks, -1)[np.asarray(block_ids, dtype=np.int64)]


def apply_plan(plan, local: NumpyEngine, remote: NumpyEngine) -> None:
    """Simulates a plan: every descriptor's bytes, chunk by chunk, then the post-processing."""
    dst = local.buffers[plan.local_rank]
    for rr, rg, ro, lg, lo, length, count, rs, ls in plan.copies.tolist():
        src = remote.buffers[rr][rg]
        for c in range(count):
            a, b = ro + c * rs, lo + c * ls
            assert a + length <= src.size and b + length <= dst[lg].size, "descriptor out of bounds"
            dst[lg][b:b + length] = src[a:a + length]
    for step in plan.post:
        view = dst[step.region].reshape(local.num_blocks, -1)
        for offset in step.slab_offsets:
            slabs = view[step.block_ids, offset:offset + step.slab_nbytes]
            view[step.block_ids, offset:offset + step.slab_nbytes] = step.rearrange(slabs)
