"""vLLM-shaped torch KV caches for the DLPack adoption tests (not a test module).

`vllm_caches` allocates them with vLLM 0.33's own allocator (`allocate_kv_cache`, one raw
int8 buffer viewed per layer as ``[B, H, N, C]`` in a `KVCacheLayout`'s memory order), as GPU
vLLM's model runner hands them to `register_kv_caches`. `TorchSide` is a `vllm_harness.Side`
whose workers register such torch caches; its fake model writes K/V into the torch tensors (as
vLLM's attention kernels do), and consumer reads are checked in the torch tensors.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import transfer_testing as tt
import vllm_harness as vh

from jaxkv import KVCacheSpec

INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
TORCH_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "fp8": torch.uint8,  # vLLM stores fp8 caches as uint8
}


def layer_names(num_layers: int) -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in range(num_layers)]


def attention_spec(num_kv_heads: int, head_size: int, block_size: int, dtype: str,
                   mla: bool = False):
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    if mla:
        return MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=head_size,
                                dtype=TORCH_DTYPES[dtype])
    return FullAttentionSpec(block_size=block_size, num_kv_heads=num_kv_heads,
                             head_size=head_size, dtype=TORCH_DTYPES[dtype])


def kv_cache_config(layout_name: str, spec, num_layers: int, num_blocks: int):
    """vLLM's `KVCacheConfig` for one group of `num_layers` layers, its tensor placed as vLLM's
    planner places it for the layout (`compute_layout_strides`)."""
    from vllm.v1.kv_cache_interface import (
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
        compute_layout_strides,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout

    names = layer_names(num_layers)
    layout = KVCacheLayout[layout_name]
    layer_stride, block_stride, *_ = compute_layout_strides(spec, num_blocks, num_layers, layout)
    size = spec.page_size_bytes * num_blocks * num_layers
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[KVCacheTensor(size=size, layers=names, layer_stride=layer_stride,
                                        block_stride=block_stride)],
        kv_cache_groups=[KVCacheGroupSpec(names, spec)],
    )


def vllm_caches(layout_name: str, spec, num_layers: int, num_blocks: int) -> dict[str, Any]:
    """Layer name -> torch tensor from vLLM's allocator (CPU)."""
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    config = kv_cache_config(layout_name, spec, num_layers, num_blocks)
    return allocate_kv_cache(config, torch.device("cpu"), KVCacheLayout[layout_name])


def as_numpy(tensor) -> np.ndarray:
    """A tensor's values as unsigned ints of its width (bit for bit)."""
    ints = tensor.contiguous().view(INT_OF_SIZE[tensor.element_size()]).numpy()
    return ints.view(f"u{tensor.element_size()}")


def fill_random(kv_caches: dict[str, Any], seed: int = 0) -> None:
    """Random bits into every layer's tensor (through the strided views)."""
    rng = np.random.default_rng(seed)
    for t in kv_caches.values():
        ints = t.view(INT_OF_SIZE[t.element_size()])
        info = np.iinfo(f"i{t.element_size()}")
        values = rng.integers(info.min, info.max, size=tuple(t.shape), dtype=f"i{t.element_size()}")
        ints.copy_(torch.from_numpy(values))


def block_cells(g: np.ndarray, layer: int, first_token: int, block_size: int,
                mla: bool) -> np.ndarray:
    """One block of one layer in vLLM's logical ``[H, N, C]`` (C = K then V), from
    ``G[layer, kv, head, position, d]``; zeros past G's end."""
    _, kv, heads, positions, d = g.shape
    out = np.zeros((heads, block_size, kv, d), g.dtype)
    n = max(0, min(block_size, positions - first_token))
    out[:, :n] = g[layer, :, :, first_token:first_token + n, :].transpose(1, 2, 0, 3)
    return out.reshape(heads, block_size, kv * d)


class TorchSide(vh.Side):
    """A `vllm_harness.Side` whose workers register vLLM-allocated torch caches: one worker,
    or (``tp > 1``) one worker per TP rank, each with the torch caches of its heads, as vLLM
    runs them."""

    def __init__(self, role: str, layout_name: str, num_blocks: int, extra: dict[str, Any],
                 *, num_layers: int = 2, num_kv_heads: int = 4, head_size: int = 8,
                 block_size: int = 8, dtype: str = "bfloat16", mla: bool = False,
                 tp: int = 1):
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

        from jaxkv.integrations.vllm import JaxKVConnector

        self.role, self.num_blocks, self.tp, self.rank_workers = role, num_blocks, tp, tp > 1
        self.mla = mla
        rank_heads = num_kv_heads if mla else num_kv_heads // tp
        vspec = attention_spec(rank_heads, head_size, block_size, dtype, mla)
        self.names = layer_names(num_layers)
        self.rank_caches: list[dict[str, Any]] = []
        self.workers = []
        for rank in range(tp):
            worker_extra = dict(extra)
            if tp > 1:
                worker_extra.update(tp_size=tp, tp_rank=rank, process_index=rank,
                                    num_kv_heads=num_kv_heads)
            caches = vllm_caches(layout_name, vspec, num_layers, num_blocks)
            config = vh.vllm_config(role, block_size, worker_extra, num_blocks)
            if dtype == "fp8":
                config.cache_config.cache_dtype = "fp8"
            worker = JaxKVConnector(config, KVConnectorRole.WORKER,
                                    kv_cache_config(layout_name, vspec, num_layers, num_blocks))
            worker.register_kv_caches(caches)
            self.rank_caches.append(caches)
            self.workers.append(worker)
        self.torch_caches = self.rank_caches[0]
        worker = self.worker = self.workers[0]
        extra = {**extra, "tp_size": tp} if tp > 1 else extra
        # what token_kv needs (layers, K/V, heads, head dim, element width)
        self.spec = KVCacheSpec(num_layers=num_layers, num_kv_heads=1 if mla else num_kv_heads,
                                head_dim=head_size, block_size=block_size,
                                dtype=worker.cache.spec.dtype, kv_factor=1 if mla else 2,
                                mla=mla, layout="TD" if mla else "LKHTD")
        sched_extra = dict(extra)
        if role == "kv_producer":
            sched_extra["side_channel"] = [list(w.address) for w in self.workers]
        self.config = vh.vllm_config(role, block_size, sched_extra, num_blocks)
        self.scheduler, _ = vh.scheduler(self.config, num_blocks)
        self.connector = self.scheduler.connector
        self.outputs, self.received, self.sent_params = {}, {}, {}
        self.load_errors, self.stats, self.failed_blocks = set(), None, {}
        self._counts, self.steps = {}, 0
        self.torch_received: dict[str, list[np.ndarray]] = {}
        self.received_block_ids: dict[str, list[int]] = {}

    def torch_blocks(self, block_ids: list[int]) -> list[np.ndarray]:
        """The blocks as the torch tensors hold them: per rank and layer ``[n, H, N, C]``
        uints."""
        return [as_numpy(caches[name][block_ids]) for caches in self.rank_caches
                for name in self.names]

    def rank_g(self, prompt: list[int], rank: int) -> np.ndarray:
        """G of the rank's heads (all heads for MLA, which every rank holds)."""
        g = vh.token_kv(self.spec, prompt)
        if self.mla:
            return g
        per = self.spec.num_kv_heads // self.tp
        return g[:, :, rank * per:(rank + 1) * per]

    def expected_torch_blocks(self, prompt: list[int], num_blocks: int) -> list[np.ndarray]:
        bs = self.spec.block_size
        return [np.stack([block_cells(self.rank_g(prompt, rank), layer, i * bs, bs, self.mla)
                          for i in range(num_blocks)])
                for rank in range(self.tp) for layer in range(self.spec.num_layers)]

    def step(self) -> None:
        before = set(self.received)
        super().step()
        for request_id in set(self.received) - before:
            ids = list(self._block_ids(request_id))
            self.received_block_ids[request_id] = ids
            self.torch_received[request_id] = self.torch_blocks(ids)

    def _fake_forward(self, out, rank: int, worker) -> None:
        """Writes the KV of the scheduled requests' computed prompt tokens into the torch
        tensors, as vLLM's attention kernels would."""
        bs = self.spec.block_size
        for request_id in out.num_scheduled_tokens:
            req = self.scheduler.requests[request_id]
            upto = min(req.num_computed_tokens, req.num_prompt_tokens)
            if upto == 0:
                continue
            g = self.rank_g(req.prompt_token_ids, rank)[:, :, :, :upto]
            ids = self._block_ids(request_id)[: -(-upto // bs)]
            for layer, name in enumerate(self.names):
                t = self.rank_caches[rank][name]
                ints = t.view(INT_OF_SIZE[t.element_size()])
                for i, block in enumerate(ids):
                    cells = block_cells(g, layer, i * bs, bs, self.mla)
                    ints[block] = torch.from_numpy(cells.view(f"i{t.element_size()}"))


def torch_producer_process(conn, layout_name: str, num_blocks: int, extra: dict,
                           side_kwargs: dict) -> None:
    """A producer `TorchSide` in a spawned process: ("add", prompts) -> their consumer
    params, once all were handed over; ("state",) -> (busy, pinned); ("exit",)."""
    tt.child_env(1)
    import os

    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    side = TorchSide("kv_producer", layout_name, num_blocks, extra, **side_kwargs)
    conn.send(("ready", side.worker.address))
    tt.serve_scheduler_side(
        conn, side,
        lambda prompt: vh.request(prompt, side.spec.block_size, {"do_remote_decode": True}, 1),
        lambda: (side.busy(), side.worker.engine.num_pinned))
