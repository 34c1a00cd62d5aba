"""Drives vLLM-TPU's `Scheduler` with `jaxkv.integrations.tpu_inference` on both sides, a fake
tpu-inference model runner and real jaxkv engines (not a test module).

The fake runner holds tpu-inference's own cache (`tpu_inference.runner.kv_cache.
create_kv_caches`: one array per layer on a ``("data", "model")`` CPU mesh) and its "forward"
writes the K/V of the scheduled prompt tokens the way tpu-inference's attention kernel does:
each TP rank merges its heads' K and V with `ragged_paged_attention.v3.kernel.merge_kv`
(interleaved, packed into 32-bit words, head dim padded to 128 lanes) and the merged rows are
stored at the tokens' page slots, in a jitted update that donates the cache (as the runner's
``model_fn`` does) and reassigns ``runner.kv_caches``. A token's K/V is random bits seeded by the
tokens up to it (two requests sharing a prefix share its KV, as with a real model).

Each step runs the worker hooks exactly as tpu-inference's runner does: vLLM's
`KVConnectorModelRunnerMixin` context around the forward (start_load_kv, wait_for_save,
get_transfer_results, get_block_ids_with_load_errors), with the worker connector as vLLM's
process-wide KV transfer group.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import os
import time
from typing import Any

import numpy as np

LAYERS, HEADS, HEAD_DIM = 2, 4, 96  # head dim padded to 128 lanes in the cache
MODULE = "jaxkv.integrations.tpu_inference"
EOS = 50256
_ids = itertools.count(1)


def vllm_config(role: str, block_size: int, extra: dict[str, Any]):
    from vllm.config import (
        CacheConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    model = ModelConfig(model="facebook/opt-125m", dtype="bfloat16", seed=0)
    scheduler = SchedulerConfig(
        max_num_seqs=64,
        max_num_batched_tokens=512,
        max_model_len=4096,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
    )
    cache = CacheConfig(block_size=block_size, cache_dtype="auto", enable_prefix_caching=True)
    transfer = KVTransferConfig(
        # tpu-inference's platform accepts only its own connector names: the module path
        # makes vLLM load jaxkv's class of that name.
        kv_connector="TPUConnector",
        kv_connector_module_path=MODULE,
        kv_role=role,
        kv_connector_extra_config={"num_kv_heads": HEADS, "head_dim": HEAD_DIM, **extra},
        kv_load_failure_policy="recompute",
    )
    return VllmConfig(
        scheduler_config=scheduler,
        model_config=model,
        cache_config=cache,
        kv_transfer_config=transfer,
    )


def kv_cache_config(block_size: int, num_blocks: int):
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                [f"layer.{i}" for i in range(LAYERS)],
                FullAttentionSpec(
                    block_size=block_size, num_kv_heads=HEADS, head_size=HEAD_DIM,
                    dtype=torch.bfloat16,
                ),
            )
        ],
    )


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
        request_id=request_id or f"req-{os.getpid()}-{next(_ids)}",
        prompt_token_ids=list(prompt),
        sampling_params=sampling,
        pooling_params=None,
        block_hasher=get_request_block_hasher(block_size, sha256),
    )
    req.kv_transfer_params = params
    return req


def prompts_of(lengths, seed=0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(10, 50000, size=n).tolist() for n in lengths]


_kv_memo: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}


def token_kv(prompt: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(K, V) of a prompt, each ``[layers, tokens, heads, head_dim]`` bfloat16: position p
    holds random bits seeded by ``prompt[:p + 1]`` (no NaN or infinity patterns)."""
    import ml_dtypes

    key = tuple(prompt)
    if key not in _kv_memo:
        if len(_kv_memo) > 1024:
            _kv_memo.clear()
        k = np.empty((LAYERS, len(prompt), HEADS, HEAD_DIM), np.uint16)
        v = np.empty_like(k)
        digest = hashlib.sha256()
        for p, token in enumerate(prompt):
            digest.update(int(token).to_bytes(8, "little"))
            rng = np.random.default_rng(int.from_bytes(digest.copy().digest()[:8], "little"))
            bits = rng.integers(0, 1 << 16, size=(2, LAYERS, HEADS, HEAD_DIM), dtype=np.uint16)
            bits &= 0xBFFF  # exponent below all-ones: finite values only
            k[:, p], v[:, p] = bits[0], bits[1]
        _kv_memo[key] = (k.view(ml_dtypes.bfloat16), v.view(ml_dtypes.bfloat16))
    return _kv_memo[key]


def merged_rows(k: np.ndarray, v: np.ndarray, tp: int) -> np.ndarray:
    """tpu-inference's cache rows of tokens' K/V on a TP-`tp` mesh: every rank merges its heads
    with the attention kernel's own `merge_kv`, the ranks side by side on the word axis.

    Args:
      k, v: ``[tokens, heads, head_dim]``.

    Returns:
      ``[tokens, words, packing, align(head_dim, 128)]`` (the global array's row layout).
    """
    from tpu_inference.kernels.ragged_paged_attention.v3.kernel import merge_kv

    per = k.shape[1] // tp
    parts = [
        np.asarray(merge_kv(np.ascontiguousarray(k[:, r * per:(r + 1) * per]),
                            np.ascontiguousarray(v[:, r * per:(r + 1) * per])))
        for r in range(tp)
    ]
    return np.concatenate(parts, axis=1)


def expected_pages(prompt: list[int], tp: int, block_size: int, upto: int | None = None):
    """Per layer, what the request's pages hold (rows of tokens ``[0, upto)``) and a mask of the
    entries that hold values: ``([layer][tokens, words, packing, D]``, same-shaped mask)."""
    k, v = token_kv(prompt)
    n = len(prompt) if upto is None else upto
    ones = np.ones((n, HEADS, HEAD_DIM), k.dtype)
    mask = merged_rows(ones, ones, tp).view(np.uint16) != 0
    return [merged_rows(k[layer, :n], v[layer, :n], tp) for layer in range(LAYERS)], mask


def page_rows(kv_caches, block_ids, num_tokens: int, block_size: int) -> list[np.ndarray]:
    """The rows of tokens ``[0, num_tokens)`` stored in `block_ids` (token order), per layer.

    Gathered on the device as raw bits (``np.asarray`` of a live cache array would keep a host
    view of its buffer, after which the runner's next forward could not donate it and would
    move the cache: tpu-inference never reads its cache on the host)."""
    import jax
    import jax.numpy as jnp
    import ml_dtypes

    pages = jnp.asarray(np.repeat(np.asarray(block_ids), block_size)[:num_tokens])
    slots = jnp.asarray(np.tile(np.arange(block_size), len(block_ids))[:num_tokens])
    return [
        np.asarray(jax.lax.bitcast_convert_type(c, jnp.uint16)[pages, slots]).view(
            ml_dtypes.bfloat16)
        for c in kv_caches
    ]


def assert_rows_equal(got: list[np.ndarray], prompt, tp: int, block_size: int) -> None:
    """Bit-exact comparison of a request's rows with what tpu-inference's kernel writes
    (padding entries excluded: they are never transferred)."""
    expected, mask = expected_pages(prompt, tp, block_size, len(got[0]))
    for layer, (a, b) in enumerate(zip(got, expected)):
        a16, b16 = a.view(np.uint16), b.view(np.uint16)
        bad = np.argwhere((a16 != b16) & mask)
        assert not len(bad), (
            f"layer {layer}: {len(bad)} entries differ, first at (token, word, slot, lane) "
            f"{tuple(bad[0])}: got {a16[tuple(bad[0])]:#06x}, expected {b16[tuple(bad[0])]:#06x}"
        )


class FakeRunner:
    """tpu-inference's runner as the connector sees it: ``kv_caches`` (tpu-inference's own
    allocation), ``mesh``, and a forward that reassigns ``kv_caches``.

    Args:
      tp: TP size (the ``model`` mesh axis; CPU devices).
      moves: the forward returns fresh buffers (no donation) instead of updating in place.
    """

    def __init__(self, tp: int, num_blocks: int, block_size: int, moves: bool = False):
        import jax
        import jax.numpy as jnp
        from jax.sharding import Mesh
        from tpu_inference.runner.kv_cache import create_kv_caches

        self.tp, self.block_size, self.moves = tp, block_size, moves
        self.mesh = Mesh(np.array(jax.devices()[:tp]).reshape(1, tp), ("data", "model"))
        self.kv_caches = create_kv_caches(
            num_blocks, block_size, HEADS, HEAD_DIM, self.mesh,
            [f"layer.{i}" for i in range(LAYERS)], cache_dtype=jnp.bfloat16,
        )
        self.topology_order_id = 0
        self.forwards = 0

    def forward(self, writes: list[tuple[list[int], list[int], int, int]]) -> None:
        """Writes, per ``(prompt, block_ids, start, stop)``, the K/V of prompt tokens
        ``[start, stop)`` into their page slots, and reassigns ``kv_caches``."""
        rows, pages, slots = [], [], []
        for prompt, block_ids, start, stop in writes:
            if stop <= start:
                continue
            k, v = token_kv(prompt)
            rows.append(np.stack([merged_rows(k[layer, start:stop], v[layer, start:stop],
                                              self.tp) for layer in range(LAYERS)]))
            positions = np.arange(start, stop)
            pages.append(np.asarray(block_ids)[positions // self.block_size])
            slots.append(positions % self.block_size)
        self.forwards += 1
        if not rows:
            if self.moves:
                self.kv_caches = _copied(self.kv_caches)
            return
        merged = np.concatenate(rows, axis=1)
        page = np.concatenate(pages).astype(np.int32)
        slot = np.concatenate(slots).astype(np.int32)
        # Pads to a power of two (fewer compilations); the padding writes zeros into page 0,
        # vLLM's null block, which no request owns.
        n = max(16, 1 << (len(page) - 1).bit_length())
        pad = n - len(page)
        merged = np.pad(merged, [(0, 0), (0, pad)] + [(0, 0)] * 3)
        page, slot = np.pad(page, (0, pad)), np.pad(slot, (0, pad))
        step = _write_moving if self.moves else _write_donating
        self.kv_caches = step(self.kv_caches, page, slot, merged)


def _write(caches, page, slot, merged):
    return [c.at[page, slot].set(merged[i]) for i, c in enumerate(caches)]


@functools.cache
def _jitted(donate: bool, shardings: tuple):
    import jax

    # The outputs keep the cache's sharding, so the donated buffers are updated in place.
    return jax.jit(_write, donate_argnums=(0,) if donate else (), out_shardings=list(shardings))


def _write_donating(caches, page, slot, merged):
    return _jitted(True, tuple(c.sharding for c in caches))(caches, page, slot, merged)


def _write_moving(caches, page, slot, merged):
    return _copied(_jitted(False, tuple(c.sharding for c in caches))(caches, page, slot, merged))


def _copied(caches):
    import jax.numpy as jnp

    return [jnp.copy(c) for c in caches]


class Side:
    """One vLLM-TPU engine: its scheduler (whose connector vLLM's factory loads from jaxkv), a
    worker connector registered with a `FakeRunner`, and the step loop of tpu-inference's
    runner."""

    def __init__(self, role: str, tp: int, num_blocks: int, extra: dict[str, Any],
                 block_size: int = 16, moves: bool = False):
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager

        self.role, self.tp, self.block_size, self.num_blocks = role, tp, block_size, num_blocks
        cache_config = kv_cache_config(block_size, num_blocks)
        worker_config = vllm_config(role, block_size, extra)
        self.worker = KVConnectorFactory.create_connector(
            worker_config, KVConnectorRole.WORKER, cache_config
        )
        self.runner = FakeRunner(tp, num_blocks, block_size, moves)
        self.worker.register_runner(self.runner)
        sched_extra = dict(extra)
        if role == "kv_producer":
            sched_extra["side_channel"] = [list(self.worker.address)]
        self.config = vllm_config(role, block_size, sched_extra)
        self.config.cache_config.num_gpu_blocks = num_blocks
        self.scheduler = Scheduler(
            vllm_config=self.config,
            kv_cache_config=cache_config,
            log_stats=True,
            structured_output_manager=StructuredOutputManager(self.config),
            block_size=block_size,
        )
        self.connector = self.scheduler.connector
        self.outputs: dict[str, Any] = {}
        self.sent_params: dict[str, dict] = {}
        self.received: dict[str, list[np.ndarray]] = {}  # rows as read, at the read's end
        self.failed: set[str] = set()
        self.load_errors: set[int] = set()
        self.stats = None
        self.steps = 0

    def add(self, req) -> None:
        self.scheduler.add_request(req)

    def block_ids(self, request_id: str) -> list[int]:
        return list(self.scheduler.kv_cache_manager.get_block_ids(request_id)[0])

    def step(self) -> None:
        import jax
        from vllm.distributed.kv_transfer import kv_transfer_state
        from vllm.forward_context import set_forward_context
        from vllm.v1.outputs import ModelRunnerOutput
        from vllm.v1.worker.kv_connector_model_runner_mixin import (
            KVConnectorModelRunnerMixin as Mixin,
        )

        out = self.scheduler.schedule()
        kv_transfer_state._KV_CONNECTOR_AGENT = self.worker  # the process's transfer group
        writes = []
        for request_id, n in out.num_scheduled_tokens.items():
            req = self.scheduler.requests[request_id]
            # schedule() already counted this step's tokens as computed
            stop = min(req.num_computed_tokens, req.num_prompt_tokens)
            start = min(req.num_computed_tokens - n, stop)
            writes.append((req.prompt_token_ids, self.block_ids(request_id), start, stop))
        # tpu-inference's execute_model runs the forward and every connector hook with the
        # runner's ('data', 'model') mesh as JAX's context mesh
        with jax.set_mesh(self.runner.mesh):
            if out.total_num_scheduled_tokens:
                with set_forward_context(None, self.config), Mixin.maybe_get_kv_connector_output(
                    out
                ) as kv_out:
                    self.runner.forward(writes)
            else:
                kv_out = Mixin.kv_connector_no_forward(out, self.config).kv_connector_output
        if kv_out is not None:
            self._collect(kv_out)
        req_ids = list(out.num_scheduled_tokens)
        runner_out = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[
                [7] if self.scheduler.requests[r].num_computed_tokens
                >= self.scheduler.requests[r].num_prompt_tokens else []
                for r in req_ids
            ],
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=None,
            kv_connector_output=kv_out,
        )
        for outputs in self.scheduler.update_from_output(out, runner_out).values():
            for o in outputs.outputs:
                if o.finish_reason is not None:
                    self.outputs[o.request_id] = o
                    if o.kv_transfer_params:
                        self.sent_params[o.request_id] = o.kv_transfer_params
        self.steps += 1

    def _collect(self, kv_out) -> None:
        failed = set(kv_out.failed_recving or ())
        self.failed |= failed
        self.load_errors |= set(kv_out.invalid_block_ids or ())
        if kv_out.kv_connector_stats is not None:
            stats = type(self.worker).build_kv_connector_stats(kv_out.kv_connector_stats.data)
            self.stats = stats if self.stats is None else self.stats.aggregate(stats)
        for request_id in set(kv_out.finished_recving or ()) - failed:
            req = self.scheduler.requests.get(request_id)
            if req is None or req.is_finished():
                continue  # aborted while reading
            n = int(req.kv_transfer_params.get("remote_num_tokens", 0)) if \
                req.kv_transfer_params else 0
            self.received[request_id] = page_rows(
                self.runner.kv_caches, self.block_ids(request_id), n, self.block_size
            )

    def busy(self) -> bool:
        s = self.scheduler
        return bool(s.requests or s.finished_req_ids or s.finished_recving_kv_req_ids)

    def close(self) -> None:
        from vllm.distributed.kv_transfer import kv_transfer_state

        if kv_transfer_state._KV_CONNECTOR_AGENT is self.worker:
            kv_transfer_state._KV_CONNECTOR_AGENT = None
        self.worker.shutdown()
        self.scheduler.shutdown()


def run_until(sides, done, timeout_s: float = 120.0) -> None:
    """Steps every side until `done()` (TimeoutError after `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError("the schedulers did not finish in time")
        for side in sides:
            side.step()


def leak_report(side: Side) -> str | None:
    """None when no request, block or connector state is left (vLLM's own leak checks,
    re-expressed), else what is left."""
    s = side.scheduler
    if s.requests or s.waiting or s.running:
        return "requests left"
    if s.finished_req_ids or s.finished_recving_kv_req_ids:
        return "finished ids left"
    manager = s.kv_cache_manager
    if manager.coordinator.single_type_managers[0].req_to_blocks:
        return "blocks held"
    pool = manager.block_pool
    if pool.free_block_queue.num_free_blocks != pool.num_gpu_blocks - 1:
        return "blocks not free"
    w = side.worker
    ws = w.connector_worker
    if ws.reading or ws.awaiting_send or ws.freeable:
        return "connector state left"
    if w.engine.num_pinned or w.engine.num_reading:
        return "engine state left"
    return None


# -- a producer engine in another process ----------------------------------------------------


def producer_process(conn, tp: int, num_blocks: int, extra: dict) -> None:
    """A producer `Side` serving commands from `conn` and stepping in between:
    ("add", prompts) -> the consumer params of each, once all were handed over;
    ("pause", seconds) -> stops stepping that long, then True;
    ("state",) -> (busy, pinned, expired leases, leak report or None); ("exit",)."""
    import transfer_testing as tt

    tt.child_env(4)
    os.environ["JAX_PLATFORMS"] = "cpu"
    side = Side("kv_producer", tp, num_blocks, extra)
    conn.send(("ready", side.worker.address))

    def state():
        engine = side.worker.engine
        return side.busy(), engine.num_pinned, engine.stats.expired_leases, leak_report(side)

    tt.serve_scheduler_side(
        conn, side,
        lambda prompt: request(prompt, side.block_size, {"do_remote_decode": True}, 1),
        state, interval=0.002)


def remote_producer(tp: int, num_blocks: int, extra: dict):
    """The producer engine in a spawned process (`producer_process`): a
    `transfer_testing.RemoteProcess`, whose ``wait_idle`` polls its state."""
    import transfer_testing as tt

    return tt.RemoteProcess(producer_process, (tp, num_blocks, extra), start_timeout_s=600,
                            call_timeout_s=120.0)
