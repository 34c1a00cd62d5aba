"""Drives a vLLM `Scheduler` with `JaxKVConnector` on both sides and a fake model (not a test
module).

The fake model writes, for every scheduled request, the KV of its computed prompt tokens into
its blocks; a token's KV is random bits seeded by the hash of the tokens up to it (so two
requests sharing a prefix share its KV, as with a real model). Only the producer's model
writes: a consumer's blocks then hold exactly what its reads brought, checked bit for bit.
"""

from __future__ import annotations

import hashlib
import itertools
import time
from typing import Any

import numpy as np
import transfer_testing as tt

from jaxkv import EngineConfig, KVCacheSpec, PagedKVCache

MODULE = "jaxkv.integrations.vllm"
EOS = 50256
_ids = itertools.count(1)


def vllm_config(role: str, block_size: int, extra: dict[str, Any], num_blocks: int,
                max_num_batched_tokens: int = 256):
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    model = ModelConfig(model="facebook/opt-125m", dtype="float16", seed=0)
    scheduler = SchedulerConfig(
        max_num_seqs=64,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=4096,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
    )
    cache = CacheConfig(block_size=block_size, cache_dtype="auto", enable_prefix_caching=True)
    cache.num_gpu_blocks = num_blocks
    transfer = KVTransferConfig(
        kv_connector="JaxKVConnector",
        kv_connector_module_path=MODULE,
        kv_role=role,
        kv_connector_extra_config=extra,
        kv_load_failure_policy="recompute",
    )
    return VllmConfig(
        scheduler_config=scheduler,
        model_config=model,
        cache_config=cache,
        kv_transfer_config=transfer,
        device_config=DeviceConfig("cpu"),
    )


def scheduler(config, num_blocks: int):
    import torch
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    block_size = config.cache_config.block_size
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["layer"],
                FullAttentionSpec(
                    block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32
                ),
            )
        ],
    )
    return Scheduler(
        vllm_config=config,
        kv_cache_config=kv_cache_config,
        log_stats=True,
        structured_output_manager=StructuredOutputManager(config),
        block_size=block_size,
    ), kv_cache_config


_hash_ready = False


def request(prompt: list[int], block_size: int, params: dict | None, max_tokens: int,
            request_id: str | None = None):
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    global _hash_ready
    if not _hash_ready:
        init_none_hash(sha256)
        _hash_ready = True
    sampling = SamplingParams(max_tokens=max_tokens)
    sampling.update_from_generation_config({}, EOS)
    req = Request(
        request_id=request_id or f"req-{next(_ids)}",
        prompt_token_ids=list(prompt),
        sampling_params=sampling,
        pooling_params=None,
        block_hasher=get_request_block_hasher(block_size, sha256),
    )
    req.kv_transfer_params = params
    return req


_kv_memo: dict[tuple, np.ndarray] = {}


def token_kv(spec: KVCacheSpec, prompt: list[int]) -> np.ndarray:
    """``G[layer, kv, head, position, d]`` (unsigned ints of the dtype's width): position p
    holds random bits seeded by the tokens ``prompt[:p + 1]``."""
    key = (spec.num_layers, spec.kv_factor, spec.num_kv_heads, spec.head_dim, spec.itemsize,
           tuple(prompt))
    if key not in _kv_memo:
        if len(_kv_memo) > 1024:
            _kv_memo.clear()
        _kv_memo[key] = _token_kv(spec, prompt)
    return _kv_memo[key]


def _token_kv(spec: KVCacheSpec, prompt: list[int]) -> np.ndarray:
    width = np.dtype(f"u{spec.itemsize}")
    shape = (spec.num_layers, spec.kv_factor, spec.num_kv_heads, spec.head_dim)
    out = np.empty((*shape[:3], len(prompt), shape[3]), width)
    digest = hashlib.sha256()
    for p, token in enumerate(prompt):
        digest.update(int(token).to_bytes(8, "little"))
        seed = int.from_bytes(digest.copy().digest()[:8], "little")
        out[:, :, :, p, :] = np.random.default_rng(seed).integers(
            0, np.iinfo(width).max, size=shape, dtype=width, endpoint=True
        )
    return out


def dense_blocks(spec: KVCacheSpec, g: np.ndarray, num_blocks: int, first_token: int = 0):
    """What `num_blocks` blocks holding tokens ``[first_token, ...)`` of G contain (zeros past
    G's end), one ``[n, *block_shape]`` array per cache array, in the spec's dtype."""
    arrays = tt.expected_arrays(EngineConfig(spec, 1), 0, g, list(range(num_blocks)), first_token)
    return [a.view(spec.dtype) for a in arrays]


class Side:
    """One vLLM engine: its scheduler, its worker-side connectors and their jaxkv caches.

    ``tp`` TP ranks are either devices of one worker (``rank_workers=False``: one connector,
    one transfer engine) or one worker each (``rank_workers=True``: a connector, a transfer
    engine and a cache of its heads per rank, as vLLM runs one worker process per rank)."""

    def __init__(self, role: str, spec: KVCacheSpec, num_blocks: int, extra: dict[str, Any],
                 tp: int = 1, scheduler_extra: dict[str, Any] | None = None,
                 rank_workers: bool = False):
        import jax
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

        from jaxkv.integrations.vllm import JaxKVConnector

        self.role, self.spec, self.num_blocks, self.tp = role, spec, num_blocks, tp
        self.rank_workers = rank_workers
        self.workers = []
        for rank in range(tp if rank_workers else 1):
            worker_extra = {**extra, "tp_size": tp}
            if rank_workers:
                worker_extra.update(tp_rank=rank, process_index=rank)
                rank_spec = spec.replace(num_kv_heads=spec.heads_per_rank(tp))
                cache = PagedKVCache.allocate(rank_spec, num_blocks)
            else:
                mesh = jax.sharding.Mesh(np.array(jax.devices()[:tp]), ("tp",))
                cache = PagedKVCache.allocate(spec, num_blocks, mesh=mesh if tp > 1 else None)
            config = vllm_config(role, spec.block_size, worker_extra, num_blocks)
            worker = JaxKVConnector(config, KVConnectorRole.WORKER)
            worker.register_kv_caches({"jaxkv": cache})
            self.workers.append(worker)
        self.worker = self.workers[0]
        sched_extra = {**extra, "tp_size": tp, **(scheduler_extra or {})}
        if role == "kv_producer":
            sched_extra["side_channel"] = [list(w.address) for w in self.workers]
        self.config = vllm_config(role, spec.block_size, sched_extra, num_blocks)
        self.scheduler, _ = scheduler(self.config, num_blocks)
        self.connector = self.scheduler.connector
        self.outputs: dict[str, Any] = {}  # finished request id -> EngineCoreOutput
        self.received: dict[str, list[np.ndarray]] = {}  # consumer: blocks as read
        self.sent_params: dict[str, dict] = {}
        self.load_errors: set[int] = set()
        self.stats = None  # the workers' KVConnectorStats, aggregated over steps
        self.failed_blocks: dict[str, set[int]] = {}  # consumer: blocks of failed reads
        self._counts: dict[tuple[str, str], int] = {}  # (kind, request) -> workers reporting
        self.steps = 0

    def add(self, req) -> None:
        self.scheduler.add_request(req)

    def expected_blocks(self, prompt: list[int], num_blocks: int) -> list[np.ndarray]:
        """What a request's blocks hold on every worker (uint views, worker by worker)."""
        g = token_kv(self.spec, prompt)
        if not self.rank_workers:
            return [a.view(np.uint8) for a in dense_blocks(self.spec, g, num_blocks)]
        layout = tt.NumpyEngine.__new__(tt.NumpyEngine)
        layout.config, layout.spec = EngineConfig(self.spec, self.tp), self.spec
        return [a.view(np.uint8) for r in range(self.tp) for a in layout.slice_of(r, g, 0,
                                                                                  num_blocks)]

    def _all_reported(self, kind: str, ids: set[str]) -> set[str]:
        """vLLM's KVOutputAggregator: a request is over once every worker reported it."""
        done = set()
        for request_id in ids:
            key = (kind, request_id)
            self._counts[key] = self._counts.get(key, 0) + 1
            if self._counts[key] == len(self.workers):
                del self._counts[key]
                done.add(request_id)
        return done

    def step(self) -> None:
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        out = self.scheduler.schedule()
        sending, recving, failed, invalid = set(), set(), set(), set()
        for rank, worker in enumerate(self.workers):
            worker.bind_connector_metadata(out.kv_connector_metadata)
            worker.start_load_kv(None)
            if self.role == "kv_producer":
                self._fake_forward(out, rank, worker)
            worker.wait_for_save()
            results = worker.get_transfer_results(out.finished_req_ids)
            sending |= self._all_reported("send", results.finished_sending)
            recving |= self._all_reported("recv", results.finished_recving)
            failed |= results.failed_recving
            invalid |= worker.get_block_ids_with_load_errors()
            stats = worker.get_kv_connector_stats()
            if stats is not None:
                # what vLLM's KVOutputAggregator / logger do with worker stats
                rebuilt = type(worker).build_kv_connector_stats(stats.to_dict())
                self.stats = rebuilt if self.stats is None else self.stats.aggregate(rebuilt)
            worker.clear_connector_metadata()
        failed &= recving | failed
        self.load_errors |= invalid
        for request_id in failed & recving:
            self.failed_blocks[request_id] = set(self._block_ids(request_id))
        for request_id in recving - failed:
            if self.scheduler.requests[request_id].is_finished():
                continue  # aborted while reading: its read was stopped
            ids = np.asarray(self._block_ids(request_id), np.int32)
            self.received[request_id] = [
                np.asarray(a) for w in self.workers for a in w.cache.gather_blocks(ids)
            ]
        req_ids = list(out.num_scheduled_tokens)
        runner = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            # a partial prefill samples nothing
            sampled_token_ids=[
                [7] if self.scheduler.requests[r].num_computed_tokens
                >= self.scheduler.requests[r].num_prompt_tokens else []
                for r in req_ids
            ],
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=None,
            kv_connector_output=KVConnectorOutput(
                finished_sending=sending or None,
                finished_recving=recving or None,
                failed_recving=failed & recving,
                invalid_block_ids=invalid,
                kv_connector_stats=None,
            ),
        )
        engine_outputs = self.scheduler.update_from_output(out, runner)
        for outputs in engine_outputs.values():
            for o in outputs.outputs:
                if o.finish_reason is not None:
                    self.outputs[o.request_id] = o
                    if o.kv_transfer_params:
                        self.sent_params[o.request_id] = o.kv_transfer_params
        self.steps += 1

    def _block_ids(self, request_id: str) -> list[int]:
        return list(self.scheduler.kv_cache_manager.get_block_ids(request_id)[0])

    def _fake_forward(self, out, rank: int, worker) -> None:
        """Writes the KV of every scheduled request's computed prompt tokens (this worker's
        heads)."""
        cache = worker.cache
        layout = None
        if self.rank_workers:
            layout = tt.NumpyEngine.__new__(tt.NumpyEngine)
            layout.config, layout.spec = EngineConfig(self.spec, self.tp), self.spec
        for request_id in out.num_scheduled_tokens:
            req = self.scheduler.requests[request_id]
            # schedule() already counted this step's tokens as computed
            upto = min(req.num_computed_tokens, req.num_prompt_tokens)
            if upto == 0:
                continue
            blocks = -(-upto // self.spec.block_size)
            ids = self._block_ids(request_id)[:blocks]
            g = token_kv(self.spec, req.prompt_token_ids)[:, :, :, :upto]
            if layout is None:
                dense = dense_blocks(self.spec, g, blocks)
            else:
                dense = [a.view(self.spec.dtype) for a in layout.slice_of(rank, g, 0, blocks)]
            cache = cache.scatter_blocks(dense, np.asarray(ids, np.int32))
        worker.update_cache(cache)

    def busy(self) -> bool:
        s = self.scheduler
        return bool(s.requests or s.finished_req_ids or s.finished_recving_kv_req_ids)

    def close(self) -> None:
        for worker in self.workers:
            worker.shutdown()
        self.scheduler.shutdown()


def run_until(sides, done, timeout_s: float = 60.0) -> None:
    """Steps every side until `done()` (raises TimeoutError after `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError("the schedulers did not finish in time")
        for side in sides:
            side.step()


def assert_empty(side: Side) -> None:
    """No request, block or connector state left (vLLM's own leak checks, re-expressed)."""
    s = side.scheduler
    assert not s.requests and not s.waiting and not s.running, "requests left"
    assert not s.finished_req_ids and not s.finished_recving_kv_req_ids
    manager = s.kv_cache_manager
    assert not manager.coordinator.single_type_managers[0].req_to_blocks, "blocks held"
    pool = manager.block_pool
    assert pool.free_block_queue.num_free_blocks == pool.num_gpu_blocks - 1, "blocks not free"
    assert all(block.ref_cnt == 0 for block in pool.blocks)
    for w in side.workers:
        ws = w.connector_worker
        assert not ws.reading and not ws.awaiting_send and not ws.freeable, "connector state"
        assert w.engine.num_pinned == 0 and w.engine.num_reading == 0, "engine state left"


# -- a producer engine in another process ----------------------------------------------------


def producer_process(conn, spec_kwargs: dict, num_blocks: int, extra: dict) -> None:
    """A producer `Side` serving commands from `conn` and stepping in between:
    ("add", prompts) -> the consumer params of each, once all were handed over;
    ("pause", seconds) -> stops stepping that long (the engine's threads still answer), then
    True;
    ("state",) -> (busy, pinned, expired leases, leak report or None); ("exit",)."""
    tt.child_env(1)
    import os

    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    side = Side("kv_producer", KVCacheSpec(**spec_kwargs), num_blocks, extra)
    conn.send(("ready", side.worker.address))

    def state():
        try:
            assert_empty(side)
            leak = None
        except AssertionError as error:
            leak = str(error) or "leak"
        engine = side.worker.engine
        return side.busy(), engine.num_pinned, engine.stats.expired_leases, leak

    tt.serve_scheduler_side(
        conn, side,
        lambda prompt: request(prompt, side.spec.block_size, {"do_remote_decode": True}, 1),
        state)
