"""`JaxKVConnector` driven by vLLM 0.33's real `Scheduler` on a producer and a consumer engine,
with real jaxkv transfer engines over NIXL and a fake model (bytes compared exactly)."""

from __future__ import annotations

import os

os.environ.setdefault("UCX_TLS", "tcp,sm,self")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import importlib.util  # noqa: E402
import os  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

if importlib.util.find_spec("vllm") is None:
    pytest.skip(
        "vLLM is not installed: run scripts/test.sh --integrations (sets up .venv-vllm)",
        allow_module_level=True,
    )

from jaxkv import KVCacheSpec  # noqa: E402
from jaxkv.transfer import nixl_available  # noqa: E402

if not nixl_available():
    pytest.skip("NIXL (nixl-cu13) is not installed", allow_module_level=True)

import transfer_testing as tt  # noqa: E402
import vllm_harness as vh  # noqa: E402

SPEC = dict(num_layers=2, num_kv_heads=4, head_dim=8, dtype="bfloat16")


def spec(layout: str, block_size: int) -> KVCacheSpec:
    return KVCacheSpec(**SPEC, block_size=block_size, layout=layout)


@pytest.fixture
def pair(request):
    """(producer, consumer) `Side`s; parameters: (p_layout, p_block, d_layout, d_block, d_tp
    [, p_tp[, p_rank_workers, d_rank_workers]]): TP ranks as devices of one worker, or (rank
    workers) one worker, transfer engine and cache per rank."""
    p_layout, p_block, d_layout, d_block, d_tp, *rest = getattr(
        request, "param", ("LKHTD", 8, "LKHTD", 8, 1)
    )
    p_tp = rest[:1]
    p_ranks, d_ranks = rest[1:3] if len(rest) == 3 else (False, False)
    producer = vh.Side(
        "kv_producer",
        spec(p_layout, p_block),
        64,
        {"engine_id": "prefill", "lease_s": 20.0},
        tp=p_tp[0] if p_tp else 1,
        rank_workers=p_ranks,
    )
    consumer = vh.Side(
        "kv_consumer",
        spec(d_layout, d_block),
        64,
        {"engine_id": "decode", "read_timeout_s": 20.0},
        tp=d_tp,
        rank_workers=d_ranks,
    )
    yield producer, consumer
    consumer.close()
    producer.close()


def prefill(producer, prompts, max_steps=50):
    """Runs prompts through the producer; returns their consumer-side params, in order."""
    reqs = [vh.request(p, producer.spec.block_size, {"do_remote_decode": True}, 1) for p in prompts]
    for r in reqs:
        producer.add(r)
    vh.run_until([producer], lambda: all(r.request_id in producer.sent_params for r in reqs))
    return [producer.sent_params[r.request_id] for r in reqs]


def decode(consumer, prompts, params, max_tokens=3):
    reqs = [
        vh.request(p, consumer.spec.block_size, dict(kv), max_tokens)
        for p, kv in zip(prompts, params)
    ]
    for r in reqs:
        consumer.add(r)
    return reqs


def check_received(consumer, req, prompt):
    got = consumer.received[req.request_id]
    n = len(got[0])
    assert n == -(-len(prompt) // consumer.spec.block_size)
    expected = consumer.expected_blocks(prompt, n)
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        np.testing.assert_array_equal(a.view(np.uint8).reshape(b.shape), b)


def finish(pair_, reqs, timeout_s=60.0):
    producer, consumer = pair_
    vh.run_until(
        [producer, consumer],
        lambda: all(r.request_id in consumer.outputs for r in reqs)
        and not producer.busy()
        and not consumer.busy(),
        timeout_s,
    )
    vh.assert_empty(producer)
    vh.assert_empty(consumer)


def prompts_of(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(10, 50000, size=n).tolist() for n in lengths]


def test_full_prompts(pair):
    producer, consumer = pair
    prompts = prompts_of([5, 8, 21, 40])
    params = prefill(producer, prompts)
    assert params[0]["remote_engine_id"] == "prefill"
    assert producer.worker.engine.num_pinned == 4  # held until the consumer read them
    reqs = decode(consumer, prompts, params)
    finish(pair, reqs)
    for r, p in zip(reqs, prompts):
        check_received(consumer, r, p)
        assert len(consumer.outputs[r.request_id].new_token_ids) >= 1
        # the decode output says what its read did (vLLM's num_cached_tokens does not)
        assert consumer.outputs[r.request_id].kv_transfer_params == {
            "jaxkv_load": {"status": "loaded", "remote_tokens": len(p), "local_hit_tokens": 0}}
    assert consumer.worker.engine.stats.requests_total == 4
    assert not consumer.load_errors
    # loaded through vLLM's factory from kv_connector_module_path
    from jaxkv.integrations.vllm import JaxKVConnector

    assert isinstance(consumer.scheduler.connector, JaxKVConnector)
    # the worker's KVConnectorStats, as vLLM aggregates and reduces them
    reduced = consumer.stats.reduce()
    assert reduced["transfers"] == 4 and reduced["failed"] == 0
    assert reduced["bytes"] == sum(
        consumer.spec.block_nbytes(1) * -(-len(p) // consumer.spec.block_size) for p in prompts
    )
    # ... and through vLLM's Prometheus hook (build_prom_metrics)
    import prometheus_client
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm

    labels = {"model_name": "m", "engine": "0"}
    prom = KVConnectorProm(consumer.config, list(labels), {0: list(labels.values())})
    prom.observe(consumer.stats.to_dict(), 0)
    sample = prometheus_client.REGISTRY.get_sample_value
    assert sample("vllm:jaxkv_transfers_total", labels) == 4
    assert sample("vllm:jaxkv_transferred_bytes_total", labels) == reduced["bytes"]


def test_params_without_remote_num_tokens_read_the_whole_prompt(pair):
    # NIXL-shaped params a router built itself, without remote_num_tokens: read the whole
    # prompt as vLLM's NIXL connector does (was: nothing read, the prompt recomputed silently)
    producer, consumer = pair
    prompts = prompts_of([13, 32])
    params = prefill(producer, prompts)
    for p in params:
        del p["remote_num_tokens"]
    reqs = decode(consumer, prompts, params)
    finish(pair, reqs)
    for r, p in zip(reqs, prompts):
        check_received(consumer, r, p)
        assert consumer.outputs[r.request_id].kv_transfer_params["jaxkv_load"] == {
            "status": "loaded", "remote_tokens": len(p), "local_hit_tokens": 0}
    assert not consumer.load_errors


@pytest.mark.parametrize(
    "pair",
    [
        # (p_layout, p_block, d_layout, d_block, d_tp): another layout (post-processing),
        # a consumer block twice the producer's (merged), decode TP 2 from prefill TP 1
        ("LKHTD", 8, "KTHD", 8, 1),
        ("LKHTD", 8, "LKHTD", 16, 1),
        ("KHTD", 8, "KTHD", 16, 2),
        # prefill TP 2 (two devices of one process) to decode TP 1 and TP 2
        ("KHTD", 8, "LKTHD", 8, 1, 2),
        ("THD", 8, "KTHD", 16, 2, 2),
        # one worker (transfer engine, cache of its heads) per TP rank, as vLLM runs them:
        # prefill TP 2 -> decode TP 1 and TP 2 (block size x2), prefill TP 1 -> decode TP 2
        ("KHTD", 8, "KTHD", 8, 1, 2, True, False),
        ("LKHTD", 8, "KTHD", 16, 2, 2, True, True),
        ("LKHTD", 8, "LKHTD", 8, 2, 1, False, True),
    ],
    indirect=True,
)
def test_other_layout_block_size_tp(pair):
    producer, consumer = pair
    # whole consumer blocks: an even number of producer blocks when the sizes differ
    prompts = prompts_of([16, 45, 64], seed=1)
    params = prefill(producer, prompts)
    # one per worker
    assert [len(a) for a in params[0]["jaxkv_addresses"]] == [len(producer.workers)]
    reqs = decode(consumer, prompts, params)
    finish(pair, reqs)
    for r, p in zip(reqs, prompts):
        check_received(consumer, r, p)


def test_partial_local_prefix_hit(pair):
    producer, consumer = pair
    shared = prompts_of([24], seed=2)[0]
    first = shared + prompts_of([5], seed=3)[0]
    second = shared + prompts_of([13], seed=4)[0]
    params = prefill(producer, [first])
    reqs = decode(consumer, [first], params)
    finish(pair, reqs)
    before = consumer.worker.engine.stats.bytes_total
    params = prefill(producer, [second])
    reqs2 = decode(consumer, [second], params)
    finish(pair, reqs2)
    check_received(consumer, reqs2[0], second)
    # the 3 shared full blocks were a local hit: only the tail (37 tokens -> blocks 3, 4) read
    block_bytes = consumer.spec.block_nbytes(1)
    assert consumer.worker.engine.stats.bytes_total - before == 2 * block_bytes
    assert consumer.outputs[reqs2[0].request_id].kv_transfer_params["jaxkv_load"] == {
        "status": "loaded", "remote_tokens": len(second) - 24, "local_hit_tokens": 24}


def test_prefix_cache_hit_producer_hands_over_every_block(pair):
    """vLLM's ``test_prefix_cache_lifecycle`` (its NIXL params), re-expressed: a remote-decode
    request whose prompt is partly a prefix-cache hit on the producer hands over every block,
    the partial one included, as one block id list per KV cache group (NIXL's
    ``remote_block_ids``); the consumer reads them exactly and both engines end empty."""
    producer, consumer = pair
    block = producer.spec.block_size
    primer = prompts_of([block * 3 + block // 2], seed=7)[0]
    normal = vh.request(primer, block, None, 1)
    producer.add(normal)
    vh.run_until([producer], lambda: normal.request_id in producer.outputs)
    prompt = primer[: block * 2 + block // 2]
    remote = vh.request(prompt, block, {"do_remote_decode": True}, 1)
    hit = producer.scheduler.kv_cache_manager.get_computed_blocks(remote)[1]
    assert hit == 2 * block  # a prefix cache hit of 2 full blocks
    producer.add(remote)
    vh.run_until([producer], lambda: remote.request_id in producer.sent_params)
    params = producer.sent_params[remote.request_id]
    assert len(params["remote_block_ids"]) == 1  # one KV cache group
    assert len(params["remote_block_ids"][0]) == 3  # every block, the partial one included
    reqs = decode(consumer, [prompt], [params])
    finish(pair, reqs)
    check_received(consumer, reqs[0], prompt)


def test_abort_before_transfer_releases_producer(pair):
    producer, consumer = pair
    prompts = prompts_of([20, 20], seed=5)
    params = prefill(producer, prompts)
    reqs = decode(consumer, prompts, params)
    from vllm.v1.request import RequestStatus

    consumer.scheduler.finish_requests([reqs[0].request_id], RequestStatus.FINISHED_ABORTED)
    finish(pair, reqs[1:], timeout_s=15.0)  # well before the producer's 20 s lease
    check_received(consumer, reqs[1], prompts[1])
    assert producer.worker.engine.stats.expired_leases == 0


def test_abort_during_transfer(pair):
    """A consumer request aborted while its read waits for the producer's confirmation: the
    read is stopped, vLLM frees its blocks, the producer is released without lease expiry."""
    producer, consumer = pair
    prompts = prompts_of([30, 17], seed=12)
    params = prefill(producer, prompts)
    reqs = decode(consumer, prompts, params)
    # only the consumer steps: the producer does not acknowledge, the reads stay in flight
    vh.run_until([consumer], lambda: consumer.worker.engine.num_reading == 2, 20.0)
    from vllm.v1.request import RequestStatus

    consumer.scheduler.finish_requests([reqs[0].request_id], RequestStatus.FINISHED_ABORTED)
    finish(pair, reqs[1:], timeout_s=15.0)  # well before the producer's 20 s lease
    check_received(consumer, reqs[1], prompts[1])
    assert reqs[0].request_id not in consumer.received
    assert not consumer.load_errors and not consumer.failed_blocks
    assert producer.worker.engine.stats.expired_leases == 0
    stats = consumer.worker.engine.stats
    assert (stats.requests_total, stats.failed_transfers) == (1, 1)  # one read was stopped


def test_producer_abort_after_publish(pair):
    producer, consumer = pair
    (prompt,) = prompts_of([30], seed=6)
    req = vh.request(prompt, 8, {"do_remote_decode": True}, 4)  # not finished by its prefill
    producer.add(req)
    engine = producer.worker.engine
    vh.run_until([producer], lambda: engine.published_layers(req.request_id) is not None)
    from vllm.v1.request import RequestStatus

    producer.scheduler.finish_requests([req.request_id], RequestStatus.FINISHED_ABORTED)
    vh.run_until([producer], lambda: not producer.busy() and not producer.worker.engine.num_pinned)
    vh.assert_empty(producer)
    assert req.request_id not in producer.sent_params


def test_200_requests_leave_both_schedulers_empty(pair):
    """200 requests streamed through both engines (more than either cache holds at once):
    each consumer request starts once its producer request handed over its params."""
    producer, consumer = pair
    rng = np.random.default_rng(7)
    prompts = prompts_of(rng.integers(1, 60, size=200).tolist(), seed=8)
    pending = list(enumerate(prompts))
    sent: dict[str, int] = {}
    reqs: dict[int, object] = {}

    def pump():
        while pending and len(producer.scheduler.requests) < 8:
            index, prompt = pending.pop(0)
            r = vh.request(prompt, producer.spec.block_size, {"do_remote_decode": True}, 1)
            sent[r.request_id] = index
            producer.add(r)
        for request_id, kv in list(producer.sent_params.items()):
            index = sent.pop(request_id, None)
            if index is not None:
                reqs[index] = decode(consumer, [prompts[index]], [kv], max_tokens=2)[0]
        return len(reqs) == 200

    vh.run_until([producer, consumer], pump, timeout_s=240.0)
    finish(pair, list(reqs.values()), timeout_s=120.0)
    assert not consumer.load_errors
    for index, prompt in enumerate(prompts):
        check_received(consumer, reqs[index], prompt)
    assert consumer.worker.engine.stats.requests_total == 200


def test_lease_expiry_is_a_load_error_vllm_recomputes():
    """A consumer that reads after the producer's lease expired gets its blocks reported
    through get_block_ids_with_load_errors; vLLM recomputes the request, which finishes."""
    producer = vh.Side(
        "kv_producer", spec("LKHTD", 8), 64, {"engine_id": "prefill", "lease_s": 0.5}
    )
    consumer = vh.Side("kv_consumer", spec("LKHTD", 8), 64, {"engine_id": "decode"})
    try:
        prompts = prompts_of([20, 33], seed=9)
        params = prefill(producer, prompts)
        vh.run_until([producer], lambda: not producer.busy(), 10.0)  # freed by expiry
        assert producer.worker.engine.stats.expired_leases == 2
        reqs = decode(consumer, prompts, params)
        finish((producer, consumer), reqs)
        expected = {b for r in reqs for b in consumer.failed_blocks.get(r.request_id, ())}
        assert sorted(consumer.failed_blocks) == sorted(r.request_id for r in reqs)
        assert consumer.load_errors and consumer.load_errors <= expected
        assert all(consumer.outputs[r.request_id].new_token_ids for r in reqs)
        assert not consumer.received  # nothing was reported as read
        for r in reqs:  # and the outputs say so
            assert consumer.outputs[r.request_id].kv_transfer_params["jaxkv_load"][
                "status"] == "failed"
    finally:
        consumer.close()
        producer.close()


def test_two_processes_then_producer_killed_mid_transfer():
    """The producer engine runs in another process: reads are bytes exact; then the producer
    stops answering and is killed while the consumer's reads are in flight: their blocks come
    back through get_block_ids_with_load_errors, vLLM recomputes, both ends stay consistent."""
    spec_kwargs = dict(SPEC, block_size=8, layout="LKHTD")
    remote = tt.RemoteProcess(vh.producer_process,
                              (spec_kwargs, 64, {"engine_id": "prefill", "lease_s": 30.0}))
    consumer = vh.Side(
        "kv_consumer", spec("KTHD", 16), 64, {"engine_id": "decode", "read_timeout_s": 3.0}
    )
    try:
        prompts = prompts_of([7, 32, 50], seed=10)
        params = remote.call("add", prompts)
        reqs = decode(consumer, prompts, params)
        vh.run_until([consumer], lambda: not consumer.busy(), 60.0)
        for r, p in zip(reqs, prompts):
            check_received(consumer, r, p)
        busy, pinned, expired, leak = remote.call("state")
        deadline = time.monotonic() + 30
        while (busy or pinned) and time.monotonic() < deadline:
            busy, pinned, expired, leak = remote.call("state")
        assert (busy, pinned, expired, leak) == (False, 0, 0, None)

        prompts = prompts_of([24, 40], seed=11)
        params = remote.call("add", prompts)
        # Stopped outright: the producer's engine acknowledges from its own threads (control
        # channel, progress thread) even while its scheduler loop pauses.
        tt.pause(remote.process.pid)
        reqs = decode(consumer, prompts, params)
        vh.run_until([consumer], lambda: consumer.worker.engine.num_reading == 2, 30.0)
        remote.process.kill()
        remote.process.join(10)
        vh.run_until([consumer], lambda: not consumer.busy(), 60.0)
        vh.assert_empty(consumer)
        assert sorted(consumer.failed_blocks) == sorted(r.request_id for r in reqs)
        expected = set().union(*consumer.failed_blocks.values())
        assert consumer.load_errors and consumer.load_errors <= expected
        assert all(consumer.outputs[r.request_id].new_token_ids for r in reqs)
        assert consumer.worker.engine.stats.failed_transfers == 2
    finally:
        consumer.close()
        remote.close()


def test_two_consumer_requests_of_one_producer_request():
    """Reads are keyed by the consumer's request id: two consumer requests read the same
    producer request at once, both exactly; the producer (``reads_per_request=2``) frees it
    after both."""
    producer = vh.Side(
        "kv_producer",
        spec("LKHTD", 8),
        64,
        {"engine_id": "prefill", "lease_s": 20.0, "reads_per_request": 2},
    )
    consumer = vh.Side(
        "kv_consumer", spec("LKHTD", 8), 64, {"engine_id": "decode", "read_timeout_s": 20.0}
    )
    try:
        (prompt,) = prompts_of([26], seed=13)
        (params,) = prefill(producer, [prompt])
        first, second = decode(consumer, [prompt, prompt], [params, params])
        finish((producer, consumer), [first, second])
        check_received(consumer, first, prompt)
        check_received(consumer, second, prompt)
        assert not consumer.failed_blocks and not consumer.load_errors
        assert producer.worker.engine.stats.expired_leases == 0
    finally:
        consumer.close()
        producer.close()
