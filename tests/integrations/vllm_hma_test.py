"""`JaxKVConnector` with several KV cache groups (vLLM's hybrid allocator): a producer and a
consumer vLLM 0.33 `Scheduler` for a hybrid model (full-attention and sliding-window layers,
grouped by vLLM's own planner), one jaxkv transfer engine per group moving real bytes over
NIXL, a fake model; every group's blocks compared bit for bit."""

from __future__ import annotations

import os

os.environ.setdefault("UCX_TLS", "tcp,sm,self")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import importlib.util  # noqa: E402
import math  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

if importlib.util.find_spec("vllm") is None:
    pytest.skip(
        "vLLM is not installed: run scripts/test.sh --integrations (sets up .venv-vllm)",
        allow_module_level=True,
    )

from jaxkv import KVCacheSpec, PagedKVCache  # noqa: E402
from jaxkv.transfer import nixl_available  # noqa: E402

if not nixl_available():
    pytest.skip("NIXL (nixl-cu13) is not installed", allow_module_level=True)

import vllm_harness as vh  # noqa: E402

BLOCK = 8
WINDOW = 8  # tokens of the sliding-window layers
NUM_BLOCKS = 300
# a layer of either kind: 4 KV heads of 8 (bf16); vLLM groups the 2 full-attention layers and
# the 2 sliding-window layers
LAYER = dict(num_kv_heads=4, head_dim=8, dtype="bfloat16")
FULL, SWA = 0, 1


def kv_cache_config(config, num_blocks: int, block: int = BLOCK):
    """vLLM's cache config of the hybrid model, as its engine core plans it."""
    import torch
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    common = dict(block_size=block, num_kv_heads=4, head_size=8, dtype=torch.bfloat16)
    specs = {
        f"model.layers.{i}.self_attn.attn": (
            FullAttentionSpec(**common)
            if i % 2 == 0
            else SlidingWindowSpec(**common, sliding_window=WINDOW)
        )
        for i in range(4)
    }
    config.cache_config.num_gpu_blocks_override = num_blocks
    resolve_kv_cache_layout(config, [["NHD"]], specs.values())
    groups = get_global_kv_cache_groups(config, [specs])
    (kv_config,) = get_kv_cache_configs(config, [specs], [1 << 30], groups)
    return kv_config


def group_kv(spec: KVCacheSpec, prompt: list[int], group: int) -> np.ndarray:
    """G of one group (`vllm_harness.token_kv`; the sliding-window group's bits inverted, so
    the two groups' blocks differ)."""
    g = vh.token_kv(spec, prompt)
    return g if group == FULL else ~g


class HybridSide:
    """One vLLM engine of the hybrid model: its scheduler, a worker connector and one jaxkv
    cache per KV cache group (``tp`` TP ranks as devices of the worker)."""

    def __init__(self, role: str, layouts: tuple[str, str], extra: dict[str, Any],
                 block: int = BLOCK, tp: int = 1):
        import jax
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager

        from jaxkv.integrations.vllm import JaxKVConnector

        self.role, self.block = role, block
        extra = {**extra, "tp_size": tp}
        worker_config = vh.vllm_config(role, block, dict(extra), NUM_BLOCKS)
        self.kv_config = kv_cache_config(worker_config, NUM_BLOCKS, block)
        groups = self.kv_config.kv_cache_groups
        assert len(groups) == 2, groups
        self.kinds = [type(g.kv_cache_spec).__name__ for g in groups]
        assert self.kinds == ["FullAttentionSpec", "SlidingWindowSpec"], self.kinds
        self.specs = [
            KVCacheSpec(num_layers=len(g.layer_names), block_size=block, layout=layout, **LAYER)
            for g, layout in zip(groups, layouts)
        ]
        self.worker = JaxKVConnector(worker_config, KVConnectorRole.WORKER, self.kv_config)
        mesh = jax.sharding.Mesh(np.array(jax.devices()[:tp]), ("tp",)) if tp > 1 else None
        caches = [PagedKVCache.allocate(spec, self.kv_config.num_blocks, mesh=mesh)
                  for spec in self.specs]
        # what a JAX framework hands over: every layer name -> the cache of its group
        self.worker.register_kv_caches(
            {name: caches[g] for g, group in enumerate(groups) for name in group.layer_names}
        )
        sched_extra = dict(extra)
        if role == "kv_producer":
            addresses = self.worker.addresses
            sched_extra["side_channel"] = [list(addresses[0])]
            sched_extra["group_ports"] = [[port for _, port in addresses]]
        self.config = vh.vllm_config(role, block, sched_extra, NUM_BLOCKS)
        assert not self.config.scheduler_config.disable_hybrid_kv_cache_manager
        self.scheduler = Scheduler(
            vllm_config=self.config,
            kv_cache_config=kv_cache_config(self.config, NUM_BLOCKS, block),
            log_stats=True,
            structured_output_manager=StructuredOutputManager(self.config),
            block_size=block,
        )
        self.connector = self.scheduler.connector
        self.null = self.scheduler.kv_cache_manager.block_pool.null_block.block_id
        self.outputs: dict[str, Any] = {}
        self.sent_params: dict[str, dict] = {}
        self.received: dict[str, list[tuple[int, list[np.ndarray]]]] = {}
        self.failed: set[str] = set()
        self.group_errors: dict[int, set[int]] = {}
        self.flat_errors: set[int] = set()

    def add(self, req) -> None:
        self.scheduler.add_request(req)

    def block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return self.scheduler.kv_cache_manager.get_block_ids(request_id)

    def kept(self, request_id: str) -> list[tuple[int, list[int]]]:
        """Per group, (first position, ids) of the request's blocks that are not null."""
        out = []
        for ids in self.block_ids(request_id):
            first = next((i for i, b in enumerate(ids) if b != self.null), len(ids))
            assert self.null not in ids[first:]
            out.append((first, list(ids[first:])))
        return out

    def step(self) -> None:
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        out = self.scheduler.schedule()
        worker = self.worker
        worker.bind_connector_metadata(out.kv_connector_metadata)
        worker.start_load_kv(None)
        if self.role == "kv_producer":
            self._fake_forward(out)
        worker.wait_for_save()
        results = worker.get_transfer_results(out.finished_req_ids)
        invalid = worker.get_block_ids_with_load_errors()
        self.flat_errors |= invalid
        for g, ids in worker.get_group_block_ids_with_load_errors().items():
            self.group_errors.setdefault(g, set()).update(ids)
        worker.clear_connector_metadata()
        recving, failed = results.finished_recving, results.failed_recving
        self.failed |= failed
        for request_id in recving - failed:
            if self.scheduler.requests[request_id].is_finished():
                continue  # aborted while reading
            n = math.ceil(self.scheduler.requests[request_id].num_prompt_tokens / self.block)
            self.received[request_id] = [
                (first, [np.asarray(a) for a in cache.gather_blocks(np.asarray(ids[:n - first],
                                                                               np.int32))])
                for (first, ids), cache in zip(self.kept(request_id), worker.caches)
            ]
        req_ids = list(out.num_scheduled_tokens)
        reqs = self.scheduler.requests
        runner = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[
                [7] if reqs[r].num_computed_tokens >= reqs[r].num_prompt_tokens else []
                for r in req_ids
            ],
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=None,
            kv_connector_output=KVConnectorOutput(
                finished_sending=results.finished_sending or None,
                finished_recving=recving or None,
                failed_recving=failed,
                invalid_block_ids=invalid,
                kv_connector_stats=None,
            ),
        )
        for outputs in self.scheduler.update_from_output(out, runner).values():
            for o in outputs.outputs:
                if o.finish_reason is not None:
                    self.outputs[o.request_id] = o
                    if o.kv_transfer_params:
                        self.sent_params[o.request_id] = o.kv_transfer_params

    def _fake_forward(self, out) -> None:
        """Writes every scheduled request's computed prompt tokens into the blocks each group
        holds (a sliding-window group: those not freed yet)."""
        for request_id in out.num_scheduled_tokens:
            req = self.scheduler.requests[request_id]
            upto = min(req.num_computed_tokens, req.num_prompt_tokens)
            if upto == 0:
                continue
            n = math.ceil(upto / self.block)
            for g, (first, ids) in enumerate(self.kept(request_id)):
                if first >= n:
                    continue
                spec = self.specs[g]
                kv = group_kv(spec, req.prompt_token_ids, g)[:, :, :, :upto]
                dense = vh.dense_blocks(spec, kv, n - first, first * self.block)
                cache = self.worker.caches[g].scatter_blocks(
                    dense, np.asarray(ids[: n - first], np.int32)
                )
                self.worker.update_cache(cache)

    def check_received(self, req, prompt: list[int]) -> list[int]:
        """Compares every group's read blocks with the producer's KV; returns each group's
        number of blocks compared."""
        counts = []
        for g, (first, got) in enumerate(self.received[req.request_id]):
            spec = self.specs[g]
            n = len(got[0])
            assert first + n == math.ceil(len(prompt) / self.block)
            expected = vh.dense_blocks(spec, group_kv(spec, prompt, g), n, first * self.block)
            for a, b in zip(got, expected, strict=True):
                np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))
            counts.append(n)
        return counts

    def busy(self) -> bool:
        s = self.scheduler
        return bool(s.requests or s.finished_req_ids or s.finished_recving_kv_req_ids)

    def assert_empty(self) -> None:
        s = self.scheduler
        assert not s.requests and not s.waiting and not s.running, "requests left"
        for manager in s.kv_cache_manager.coordinator.single_type_managers:
            assert not manager.req_to_blocks, "blocks held"
        pool = s.kv_cache_manager.block_pool
        assert pool.free_block_queue.num_free_blocks == pool.num_gpu_blocks - 1
        w = self.worker
        ws = w.connector_worker
        assert not ws.reading and not ws.awaiting_send and not ws.freeable, "connector state"
        assert not ws.cancelled and not ws.releasing, "connector state"
        engine = w.engine
        assert engine is not None
        assert engine.num_pinned == 0 and engine.num_reading == 0, "engine state left"

    def expired_leases(self) -> int:
        engine = self.worker.engine
        assert engine is not None
        return sum(engine.stats_of(g).expired_leases for g in engine.groups)

    def bytes_read(self) -> int:
        engine = self.worker.engine
        assert engine is not None
        return sum(engine.stats_of(g).bytes_total for g in engine.groups)

    def close(self) -> None:
        self.worker.shutdown()
        self.scheduler.shutdown()


@pytest.fixture
def pair(request):
    """(producer, consumer); parameter: the consumer's TP size (devices of its worker)."""
    producer = HybridSide("kv_producer", ("LKHTD", "LKHTD"),
                          {"engine_id": "prefill", "lease_s": 20.0})
    consumer = HybridSide("kv_consumer", ("KTHD", "LKTHD"),
                          {"engine_id": "decode", "read_timeout_s": 20.0},
                          tp=getattr(request, "param", 1))
    yield producer, consumer
    consumer.close()
    producer.close()


def prefill(producer, prompts):
    reqs = [vh.request(p, BLOCK, {"do_remote_decode": True}, 1) for p in prompts]
    for r in reqs:
        producer.add(r)
    vh.run_until([producer], lambda: all(r.request_id in producer.sent_params for r in reqs))
    return [producer.sent_params[r.request_id] for r in reqs]


def decode(consumer, prompts, params, max_tokens=2):
    reqs = [vh.request(p, consumer.block, dict(kv), max_tokens)
            for p, kv in zip(prompts, params)]
    for r in reqs:
        consumer.add(r)
    return reqs


def finish(pair_, reqs, timeout_s=60.0):
    producer, consumer = pair_
    vh.run_until(
        [producer, consumer],
        lambda: all(r.request_id in consumer.outputs for r in reqs)
        and not producer.busy()
        and not consumer.busy(),
        timeout_s,
    )
    producer.assert_empty()
    consumer.assert_empty()


def prompts_of(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(10, 50000, size=n).tolist() for n in lengths]


def block_nbytes(spec: KVCacheSpec) -> int:
    """Bytes of one block id in every array of a group's cache."""
    return spec.block_nbytes() * spec.num_arrays


def window_blocks(num_tokens: int, block: int = BLOCK) -> int:
    """Blocks a sliding-window group keeps of a prompt (vLLM: the window of the next
    token)."""
    skipped = max(0, num_tokens - WINDOW + 1)
    return math.ceil(num_tokens / block) - skipped // block


@pytest.mark.parametrize("pair", [1, 2], indirect=True)  # decode TP 1 and 2 from TP 1
def test_full_prompts_every_group_exact(pair):
    producer, consumer = pair
    prompts = prompts_of([5, 8, 21, 40], seed=1)
    params = prefill(producer, prompts)
    # NIXL's shape: one block id list per group, jaxkv's per-group fields beside it
    assert [len(p["remote_block_ids"]) for p in params] == [2] * 4
    assert producer.worker.engine.num_pinned == 4
    for p, prompt in zip(params, prompts):
        full, swa = p["remote_block_ids"]
        assert len(full) == math.ceil(len(prompt) / BLOCK)
        assert p["jaxkv_first_blocks"][FULL] == 0
        # the sliding-window group hands over the last window's blocks only
        assert len(swa) == window_blocks(len(prompt))
        assert p["jaxkv_first_blocks"][SWA] == (
            math.ceil(len(prompt) / BLOCK) - window_blocks(len(prompt)))
    reqs = decode(consumer, prompts, params)
    finish(pair, reqs)
    for r, p in zip(reqs, prompts):
        counts = consumer.check_received(r, p)
        assert counts == [math.ceil(len(p) / BLOCK), window_blocks(len(p))]
        assert consumer.outputs[r.request_id].new_token_ids
    assert not consumer.failed and not consumer.flat_errors and not consumer.group_errors
    block_bytes = block_nbytes(consumer.specs[FULL])
    assert block_bytes == block_nbytes(consumer.specs[SWA])
    assert consumer.bytes_read() == block_bytes * sum(
        math.ceil(len(p) / BLOCK) + window_blocks(len(p)) for p in prompts
    )
    stats = consumer.worker.get_kv_connector_stats()
    assert stats is not None and stats.data["transfers"] == 8  # 4 requests x 2 groups
    assert producer.expired_leases() == 0


def test_partial_local_prefix_hit(pair):
    """The second request shares 3 full blocks with the first: the full-attention group reads
    only the 2 blocks past the local hit, the sliding-window group the last window's."""
    producer, consumer = pair
    shared = prompts_of([24], seed=2)[0]
    first = shared + prompts_of([5], seed=3)[0]
    second = shared + prompts_of([13], seed=4)[0]
    reqs = decode(consumer, [first], prefill(producer, [first]))
    finish(pair, reqs)
    consumer.check_received(reqs[0], first)
    before = consumer.bytes_read()
    reqs2 = decode(consumer, [second], prefill(producer, [second]))
    finish(pair, reqs2)
    # every block compared: the local hit's and the read ones
    assert consumer.check_received(reqs2[0], second) == [5, window_blocks(37)]
    block_bytes = block_nbytes(consumer.specs[FULL])
    assert block_bytes == block_nbytes(consumer.specs[SWA])
    # read: the full-attention group's blocks 3-4 (0-2 were a local hit), the sliding-window
    # group's last window (its hit block 2 is out of the window of token 37)
    assert consumer.bytes_read() - before == (2 + window_blocks(37)) * block_bytes


def test_abort_before_transfer_releases_producer(pair):
    producer, consumer = pair
    prompts = prompts_of([20, 33], seed=5)
    params = prefill(producer, prompts)
    reqs = decode(consumer, prompts, params)
    from vllm.v1.request import RequestStatus

    consumer.scheduler.finish_requests([reqs[0].request_id], RequestStatus.FINISHED_ABORTED)
    finish(pair, reqs[1:], timeout_s=15.0)  # well before the producer's 20 s lease
    consumer.check_received(reqs[1], prompts[1])
    assert reqs[0].request_id not in consumer.received
    assert producer.expired_leases() == 0


def test_abort_during_transfer(pair):
    """A consumer request aborted while its reads (both groups) wait for the producer: they
    are stopped, vLLM frees the blocks, the producer is released without lease expiry."""
    producer, consumer = pair
    prompts = prompts_of([30, 17], seed=12)
    params = prefill(producer, prompts)
    reqs = decode(consumer, prompts, params)
    # only the consumer steps: the producer does not confirm, the reads stay in flight
    vh.run_until([consumer], lambda: consumer.worker.engine.num_reading == 2, 20.0)
    from vllm.v1.request import RequestStatus

    consumer.scheduler.finish_requests([reqs[0].request_id], RequestStatus.FINISHED_ABORTED)
    finish(pair, reqs[1:], timeout_s=15.0)
    consumer.check_received(reqs[1], prompts[1])
    assert reqs[0].request_id not in consumer.received
    assert not consumer.failed and not consumer.group_errors
    assert producer.expired_leases() == 0


def test_producer_abort_after_publish(pair):
    producer, _ = pair
    (prompt,) = prompts_of([30], seed=6)
    req = vh.request(prompt, BLOCK, {"do_remote_decode": True}, 4)  # not finished by prefill
    producer.add(req)
    engine = producer.worker.engine
    vh.run_until([producer], lambda: engine.num_pinned == 1)
    from vllm.v1.request import RequestStatus

    producer.scheduler.finish_requests([req.request_id], RequestStatus.FINISHED_ABORTED)
    vh.run_until([producer], lambda: not producer.busy() and not engine.num_pinned)
    producer.assert_empty()
    assert req.request_id not in producer.sent_params


def test_failure_in_one_group_is_a_failed_read_vllm_recomputes():
    """One group's read fails (its remote ids are out of the producer's range): the other
    group is stopped, the read is reported in ``failed_recving`` with every group's blocks
    (``get_group_block_ids_with_load_errors``; vLLM refuses flat block ids with several
    groups), vLLM recomputes the request, and both engines end empty."""
    producer = HybridSide("kv_producer", ("LKHTD", "LKHTD"),
                          {"engine_id": "prefill", "lease_s": 2.0})
    consumer = HybridSide("kv_consumer", ("LKHTD", "LKHTD"),
                          {"engine_id": "decode", "read_timeout_s": 10.0})
    try:
        prompts = prompts_of([30, 19], seed=6)
        params = prefill(producer, prompts)
        bad = dict(params[0])
        groups = [list(ids) for ids in bad["remote_block_ids"]]
        groups[SWA] = [NUM_BLOCKS + 5 + i for i in range(len(groups[SWA]))]
        bad["remote_block_ids"] = groups
        reqs = decode(consumer, prompts, [bad, params[1]])
        finish((producer, consumer), reqs)
        assert consumer.failed == {reqs[0].request_id}
        assert not consumer.flat_errors  # vLLM raises on block-level errors with 2 groups
        # every group's blocks of the failed read: 4 full-attention ones, the window's
        assert {g: len(ids) for g, ids in consumer.group_errors.items()} == {
            FULL: math.ceil(30 / BLOCK), SWA: window_blocks(30)}
        assert reqs[0].request_id not in consumer.received
        consumer.check_received(reqs[1], prompts[1])
        assert all(consumer.outputs[r.request_id].new_token_ids for r in reqs)
    finally:
        consumer.close()
        producer.close()


def test_many_requests_leave_both_schedulers_empty(pair):
    producer, consumer = pair
    rng = np.random.default_rng(7)
    prompts = prompts_of(rng.integers(1, 60, size=200).tolist(), seed=8)
    pending = list(enumerate(prompts))
    sent: dict[str, int] = {}
    reqs: dict[int, Any] = {}

    def pump():
        while pending and len(producer.scheduler.requests) < 8:
            index, prompt = pending.pop(0)
            r = vh.request(prompt, BLOCK, {"do_remote_decode": True}, 1)
            sent[r.request_id] = index
            producer.add(r)
        for request_id, kv in list(producer.sent_params.items()):
            index = sent.pop(request_id, None)
            if index is not None:
                reqs[index] = decode(consumer, [prompts[index]], [kv])[0]
        return len(reqs) == len(prompts)

    vh.run_until([producer, consumer], pump, timeout_s=240.0)
    finish(pair, list(reqs.values()), timeout_s=120.0)
    assert not consumer.failed and not consumer.group_errors
    for index, prompt in enumerate(prompts):
        consumer.check_received(reqs[index], prompt)
    assert producer.expired_leases() == 0
    # every read moved each group's blocks (prompts repeat no prefix: no local hits)
    assert consumer.bytes_read() == block_nbytes(consumer.specs[FULL]) * sum(
        math.ceil(len(p) / BLOCK) + window_blocks(len(p)) for p in prompts
    )


# -- the producer engine in another process --------------------------------------------------


def producer_process(conn, extra: dict) -> None:
    """A hybrid producer `HybridSide` serving commands from `conn`, stepping in between:
    ("add", prompts) -> the consumer params of each once all were handed over;
    ("state",) -> (busy, pinned, expired leases, leak report or None); ("exit",)."""

    import transfer_testing as tt

    tt.child_env(1)
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    side = HybridSide("kv_producer", ("LKHTD", "KHTD"), extra)
    conn.send(("ready",))

    def state():
        try:
            side.assert_empty()
            leak = None
        except AssertionError as error:
            leak = str(error) or "leak"
        assert side.worker.engine is not None
        return (side.busy(), side.worker.engine.num_pinned, side.expired_leases(), leak)

    tt.serve_scheduler_side(
        conn, side, lambda prompt: vh.request(prompt, BLOCK, {"do_remote_decode": True}, 1),
        state)


def test_producer_in_another_process_then_killed_mid_transfer():
    """The hybrid producer runs in its own process (its groups' engines on their own side
    channels): the consumer's reads of both groups are bit exact and the producer ends with
    nothing pinned, its blocks freed by the consumer's confirmations. Then the producer is
    stopped and killed while both groups' reads are in flight: the reads fail, vLLM
    recomputes the requests, the consumer ends empty."""
    import transfer_testing as tt

    remote = tt.RemoteProcess(producer_process, ({"engine_id": "prefill", "lease_s": 30.0},),
                              call_timeout_s=120.0)
    consumer = HybridSide("kv_consumer", ("KTHD", "LKTHD"),
                          {"engine_id": "decode", "read_timeout_s": 5.0})
    try:
        assert remote.ready == ("ready",)
        prompts = prompts_of([7, 32, 50], seed=10)
        params = remote.call("add", prompts)
        reqs = decode(consumer, prompts, params)
        vh.run_until([consumer], lambda: not consumer.busy(), 60.0)
        consumer.assert_empty()
        for r, p in zip(reqs, prompts):
            assert consumer.check_received(r, p) == [math.ceil(len(p) / BLOCK),
                                                     window_blocks(len(p))]
        assert remote.wait_idle(30.0) == (False, 0, 0, None)

        prompts = prompts_of([24, 40], seed=11)
        params = remote.call("add", prompts)
        tt.pause(remote.process.pid)  # its engines' threads stop answering too
        reqs = decode(consumer, prompts, params)
        vh.run_until([consumer], lambda: consumer.worker.engine.num_reading == 2, 30.0)
        remote.process.kill()
        remote.process.join(10)
        vh.run_until([consumer], lambda: not consumer.busy(), 60.0)
        consumer.assert_empty()
        assert consumer.failed == {r.request_id for r in reqs}
        assert set(consumer.group_errors) == {FULL, SWA} and not consumer.flat_errors
        assert all(consumer.outputs[r.request_id].new_token_ids for r in reqs)  # recomputed
    finally:
        consumer.close()
        remote.close()


def test_register_kv_caches_of_several_groups():
    """A worker of the hybrid model takes one cache per group (by layer name or in group
    order) and names what is wrong otherwise."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from jaxkv.integrations.vllm import JaxKVConnector

    config = vh.vllm_config("kv_consumer", BLOCK, {"engine_id": "d"}, NUM_BLOCKS)
    kv_config = kv_cache_config(config, NUM_BLOCKS)
    names = [g.layer_names for g in kv_config.kv_cache_groups]
    spec = KVCacheSpec(num_layers=2, block_size=BLOCK, layout="LKHTD", **LAYER)
    full, swa = (PagedKVCache.allocate(spec, NUM_BLOCKS) for _ in range(2))
    worker = JaxKVConnector(config, KVConnectorRole.WORKER, kv_config)
    try:
        worker.register_kv_caches([full, swa])  # in group order
        assert worker.caches == [full, swa] and len(set(worker.addresses)) == 2
        worker.register_kv_caches({names[0][0]: full, names[1][1]: swa})  # one layer each
        assert worker.caches == [full, swa]
        with pytest.raises(ValueError, match="layer 'lm_head' is in no KV cache group"):
            worker.register_kv_caches({names[0][0]: full, "lm_head": swa})
        with pytest.raises(ValueError, match="group 1 got 0 caches"):
            worker.register_kv_caches({names[0][0]: full})
        with pytest.raises(TypeError, match="group 0 got 2 distinct value"):
            worker.register_kv_caches({names[0][0]: full, names[0][1]: swa, names[1][0]: swa})
        with pytest.raises(TypeError, match="2 KV cache groups"):
            worker.register_kv_caches(full)
        with pytest.raises(ValueError, match="block size 16 of KV cache group 1"):
            worker.register_kv_caches(
                [full, PagedKVCache.allocate(spec.replace(block_size=16), NUM_BLOCKS)])
    finally:
        worker.shutdown()


def test_groups_it_cannot_move_are_refused_by_name():
    import dataclasses

    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from jaxkv.integrations.vllm import JaxKVConnector

    config = vh.vllm_config("kv_consumer", BLOCK, {"engine_id": "d"}, NUM_BLOCKS)
    kv_config = kv_cache_config(config, NUM_BLOCKS)
    groups = list(kv_config.kv_cache_groups)
    groups[SWA] = dataclasses.replace(groups[SWA], enable_kv_transfer=False)
    excluded = dataclasses.replace(kv_config, kv_cache_groups=groups)
    with pytest.raises(ValueError, match="group 1 .* is excluded from KV transfer"):
        JaxKVConnector(config, KVConnectorRole.SCHEDULER, excluded)


def test_consumer_blocks_twice_the_producers():
    """Decode blocks of 16 from prefill blocks of 8: the full-attention group merges pairs of
    producer blocks. A sliding-window group whose window starts in the second half of the
    consumer's first block cannot be read (the producer freed the first half): that request
    fails, vLLM recomputes it, the producer is released at once (no lease expiry)."""
    producer = HybridSide("kv_producer", ("LKHTD", "LKHTD"),
                          {"engine_id": "prefill", "lease_s": 20.0})
    consumer = HybridSide("kv_consumer", ("KTHD", "LKHTD"),
                          {"engine_id": "decode", "read_timeout_s": 20.0}, block=16)
    try:
        # window start (N - 7) modulo 16: 1, 7, 0 readable; 14, 11 not
        lengths = [40, 30, 23, 21, 50]
        prompts = prompts_of(lengths, seed=14)
        params = prefill(producer, prompts)
        reqs = decode(consumer, prompts, params)
        finish((producer, consumer), reqs, timeout_s=15.0)  # well before the 20 s lease
        unreadable = {reqs[3].request_id, reqs[4].request_id}
        assert consumer.failed == unreadable
        for r, p in zip(reqs[:3], prompts[:3]):
            assert consumer.check_received(r, p) == [math.ceil(len(p) / 16),
                                                     window_blocks(len(p), 16)]
        assert all(consumer.outputs[r.request_id].new_token_ids for r in reqs)
        assert producer.expired_leases() == 0
    finally:
        consumer.close()
        producer.close()
