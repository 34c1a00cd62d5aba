"""`jaxkv.integrations.tpu_inference` driven by vLLM-TPU 0.32's real `Scheduler` and
tpu-inference's runner hooks on a producer engine in another process (TP 2) and consumer
engines in this one, with real jaxkv transfer engines over each transport: NIXL and JAX's
transfer server (``transport: "jax"``, tpu-inference's own); bytes compared exactly with what
tpu-inference's attention kernel writes (`merge_kv` per TP rank)."""

from __future__ import annotations

import importlib.util
import time

import numpy as np
import pytest

if importlib.util.find_spec("tpu_inference") is None:
    pytest.skip(
        "tpu-inference is not installed: run scripts/test.sh --integrations (sets up .venv-tpui)",
        allow_module_level=True,
    )

import tpu_harness as th  # noqa: E402

from jaxkv.transfer import nixl_available  # noqa: E402
from jaxkv.transfer._jax_transport import jax_transfer_available  # noqa: E402

PRODUCER_TP = 2
LEASE_S = 30.0
TRANSPORTS = [
    pytest.param("nixl", marks=pytest.mark.skipif(
        not nixl_available(), reason="NIXL (nixl-cu13) is not installed")),
    # NIXL with packed_transfer "words": whole word columns, padding lanes included
    pytest.param("nixl-words", marks=pytest.mark.skipif(
        not nixl_available(), reason="NIXL (nixl-cu13) is not installed")),
    pytest.param("jax", marks=pytest.mark.skipif(
        not jax_transfer_available(), reason="no jax.experimental.transfer")),
]


def _settings(variant: str) -> dict:
    """The connector settings of a `TRANSPORTS` entry: ``"<transport>[-<packed_transfer>]"``."""
    transport, _, packed = variant.partition("-")
    return {"transport": transport, "packed_transfer": packed or "values"}


@pytest.fixture(scope="module", params=TRANSPORTS)
def remote(request):
    """The producer engine (TP 2) in a spawned process over one transport, shared by the
    tests below (which run once per transport)."""
    transport = request.param
    producer = th.remote_producer(PRODUCER_TP, 256, {"engine_id": f"prefill-{transport}",
                                            "lease_s": LEASE_S, **_settings(transport)})
    producer.transport = transport
    yield producer
    producer.close()


def consumer_side(tp: int = 1, transport: str = "nixl", **kwargs) -> th.Side:
    extra = {"engine_id": f"decode-{transport}", "read_timeout_s": 20.0,
             **_settings(transport), **kwargs.pop("extra", {})}
    side = th.Side("kv_consumer", tp, 256, extra, **kwargs)
    assert side.worker.engine.transport_name == _settings(transport)["transport"]
    return side


def _block_bytes(transport: str) -> int:
    """Bytes a read moves per page and layer (all heads): values only by default (page, K/V,
    heads, the head dim's 96 lanes, bf16); NIXL with packed_transfer "words" reads whole word
    columns (page, words, packing, 128 lanes, bf16)."""
    if transport == "nixl-words":
        return 16 * 4 * 2 * 128 * 2
    return 16 * 2 * th.HEADS * th.HEAD_DIM * 2


def decode(consumer, prompts, params, max_tokens=2):
    reqs = [th.request(p, consumer.block_size, dict(kv), max_tokens) for p, kv in
            zip(prompts, params)]
    for r in reqs:
        consumer.add(r)
    return reqs


def finish(consumer, reqs, remote, timeout_s=120.0):
    th.run_until(
        [consumer],
        lambda: all(r.request_id in consumer.outputs for r in reqs) and not consumer.busy()
        and th.leak_report(consumer) is None,  # (release-only reads end in a later poll)
        timeout_s,
    )
    busy, pinned, _, leak = remote.wait_idle()
    assert (busy, pinned, leak) == (False, 0, None)


@pytest.mark.parametrize("decode_tp", [1, 2])
def test_full_prompts_bytes_exact(remote, decode_tp):
    """Prompts of 7 to 70 tokens prefilled at TP 2 land bit for bit at the interleaved K/V
    positions of a TP-`decode_tp` cache; both engines end empty, the stats count the bytes."""
    consumer = consumer_side(decode_tp, remote.transport)
    try:
        prompts = th.prompts_of([7, 16, 40, 70], seed=decode_tp)
        params = remote.call("add", prompts)
        assert [p["remote_num_tokens"] for p in params] == [7, 16, 40, 70]
        reqs = decode(consumer, prompts, params)
        finish(consumer, reqs, remote)
        for r, p in zip(reqs, prompts):
            th.assert_rows_equal(consumer.received[r.request_id], p, decode_tp, 16)
            assert consumer.outputs[r.request_id].new_token_ids
        assert not consumer.failed and not consumer.load_errors
        blocks = sum(-(-len(p) // 16) for p in prompts)
        block_bytes = _block_bytes(remote.transport)
        assert consumer.stats.data["transfers"] == len(prompts)
        assert consumer.stats.data["bytes"] == blocks * th.LAYERS * block_bytes
        assert consumer.worker.reregistrations == 0
    finally:
        consumer.close()


def test_consumer_pages_twice_the_producers(remote):
    """Pages of 32 tokens read from the producer's pages of 16 (over NIXL): every row lands
    bit for bit in the bigger pages, nothing fails."""
    consumer = consumer_side(1, remote.transport, block_size=32)
    try:
        prompts = th.prompts_of([40, 70], seed=61)
        params = remote.call("add", prompts)
        assert {p["remote_block_size"] for p in params} == {16}
        reqs = decode(consumer, prompts, params)
        finish(consumer, reqs, remote)
        for r, p in zip(reqs, prompts):
            th.assert_rows_equal(consumer.received[r.request_id], p, 1, 32)
        assert not consumer.failed and not consumer.load_errors
    finally:
        consumer.close()


def test_partial_local_prefix_hit_reads_only_the_rest(remote):
    """A consumer holding the first two blocks of a prompt (from an earlier request) reads
    only the remaining blocks; the whole prompt's rows are exact."""
    consumer = consumer_side(1, remote.transport)
    try:
        (first,) = th.prompts_of([40], seed=21)
        params = remote.call("add", [first])
        reqs = decode(consumer, [first], params)
        finish(consumer, reqs, remote)
        bytes_before = consumer.stats.data["bytes"]
        second = first[:32] + th.prompts_of([30], seed=22)[0]  # shares 2 blocks
        params = remote.call("add", [second])
        (req,) = decode(consumer, [second], params)
        finish(consumer, [req], remote)
        read = consumer.stats.data["bytes"] - bytes_before
        per_block = th.LAYERS * _block_bytes(remote.transport)
        assert read == 2 * per_block  # blocks 2 and 3 of 4 (62 tokens), not 0 and 1
        rows = consumer.received[req.request_id]
        assert len(rows[0]) == len(second)
        th.assert_rows_equal(rows, second, 1, 16)
    finally:
        consumer.close()


def test_abort_before_read_releases_producer_at_once(remote):
    """A consumer request aborted before its read was scheduled releases the producer's
    blocks with an empty read (well before the lease)."""
    from vllm.v1.request import RequestStatus

    consumer = consumer_side(1, remote.transport)
    try:
        prompts = th.prompts_of([33, 50], seed=31)
        params = remote.call("add", prompts)
        reqs = decode(consumer, prompts, params)
        start = time.monotonic()
        consumer.scheduler.finish_requests([r.request_id for r in reqs],
                                           RequestStatus.FINISHED_ABORTED)
        th.run_until([consumer], lambda: not consumer.busy()
                     and th.leak_report(consumer) is None, 30.0)
        busy, pinned, expired, leak = remote.wait_idle(30.0)
        assert (busy, pinned, leak) == (False, 0, None)
        assert time.monotonic() - start < LEASE_S / 2
        assert not consumer.received
    finally:
        consumer.close()


def test_abort_during_read(remote):
    """A consumer request aborted while its read is in flight: the read is stopped, vLLM
    frees the blocks once the worker reports it, both engines end empty."""
    from vllm.v1.request import RequestStatus

    consumer = consumer_side(2, remote.transport)
    try:
        prompts = th.prompts_of([70, 64], seed=41)
        params = remote.call("add", prompts)
        reqs = decode(consumer, prompts, params)
        consumer.step()  # the reads start
        in_flight = reqs[0].request_id in consumer.worker.connector_worker.reading
        consumer.scheduler.finish_requests([reqs[0].request_id], RequestStatus.FINISHED_ABORTED)
        finish(consumer, [reqs[1]], remote)
        if in_flight:  # (a read may complete within the step that started it)
            assert reqs[0].request_id not in consumer.received
        th.assert_rows_equal(consumer.received[reqs[1].request_id], prompts[1], 2, 16)
    finally:
        consumer.close()


def test_200_requests_leave_both_sides_empty(remote):
    """200 requests in batches of 25 (the producer holds blocks until they are read): every
    one read exactly, both schedulers and engines empty at the end."""
    consumer = consumer_side(1, remote.transport)
    try:
        rng = np.random.default_rng(51)
        prompts = th.prompts_of(rng.integers(1, 60, size=200).tolist(), seed=52)
        reqs = []
        for start in range(0, 200, 25):
            batch = prompts[start:start + 25]
            new = decode(consumer, batch, remote.call("add", batch), max_tokens=1)
            th.run_until([consumer], lambda new=new: all(
                r.request_id in consumer.received or r.request_id in consumer.failed
                for r in new))
            reqs += new
        finish(consumer, reqs, remote, timeout_s=300.0)
        assert len(consumer.received) == 200
        for r, p in zip(reqs, prompts):
            th.assert_rows_equal(consumer.received[r.request_id], p, 1, 16)
        _, _, expired, _ = remote.call("state")
        assert expired == 0
    finally:
        consumer.close()


def test_runner_that_moves_its_buffers(remote):
    """A runner whose forward returns new buffers every step (no donation), with a local
    request keeping it busy. Over NIXL the connector re-registers them before new reads;
    reads that were landing in old buffers are reported as load errors (vLLM recomputes
    them). Over the JAX transport nothing is registered: the moved buffers are adopted, no
    read fails and none is re-registered. Every request finishes and the rows that were read
    are exact."""
    consumer = consumer_side(1, remote.transport, moves=True)
    try:
        local = th.request(th.prompts_of([300], seed=60)[0], 16, None, 40)
        consumer.add(local)  # computed here: a forward every step
        for seed in (61, 62):
            prompts = th.prompts_of([40, 20, 64], seed=seed)
            params = remote.call("add", prompts)
            reqs = decode(consumer, prompts, params)
            th.run_until([consumer], lambda reqs=reqs: all(
                r.request_id in consumer.outputs for r in reqs))
            assert all(consumer.outputs[r.request_id].new_token_ids for r in reqs)
            assert set(consumer.received) | consumer.failed >= {r.request_id for r in reqs}
            for r, p in zip(reqs, prompts):
                if r.request_id in consumer.received:
                    th.assert_rows_equal(consumer.received[r.request_id], p, 1, 16)
        assert consumer.runner.forwards > 2
        if remote.transport == "jax":
            assert consumer.worker.reregistrations == 0
            assert not consumer.failed and not consumer.load_errors
            assert len(consumer.received) == 6
        else:
            assert consumer.worker.reregistrations >= 1
        finish(consumer, [local], remote)
    finally:
        consumer.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_lease_expiry_then_producer_killed(transport):
    """A second producer (lease 3 s): a consumer that reads after the lease expired gets its
    blocks reported as load errors and vLLM recomputes; then the producer process is killed
    and the next reads fail the same way, bounded by the read timeout (4 s) rather than
    waiting on a dead peer; the consumer ends empty."""
    short = th.remote_producer(PRODUCER_TP, 64, {"engine_id": f"prefill-short-{transport}",
                                        "lease_s": 3.0, "early_read_grace_s": 0.5,
                                        **_settings(transport)})
    consumer = consumer_side(1, transport, extra={"read_timeout_s": 4.0})
    try:
        prompts = th.prompts_of([24, 40], seed=71)
        params = short.call("add", prompts)
        busy, pinned, expired, leak = short.wait_idle(30.0)
        assert (busy, pinned, expired, leak) == (False, 0, 2, None)  # freed by expiry
        reqs = decode(consumer, prompts, params)
        th.run_until([consumer], lambda: all(r.request_id in consumer.outputs for r in reqs)
                     and not consumer.busy(), 120.0)
        assert consumer.failed == {r.request_id for r in reqs}
        assert consumer.load_errors
        assert not consumer.received
        assert all(consumer.outputs[r.request_id].new_token_ids for r in reqs)

        prompts = th.prompts_of([30, 50], seed=72)
        params = short.call("add", prompts)
        short.process.kill()
        short.process.join(10)
        consumer.load_errors.clear()
        start = time.monotonic()
        reqs = decode(consumer, prompts, params)
        th.run_until([consumer], lambda: {r.request_id for r in reqs} <= consumer.failed, 120.0)
        assert time.monotonic() - start < 60.0  # the 4 s read timeout, not an endless wait
        assert consumer.load_errors
        th.run_until([consumer], lambda: all(r.request_id in consumer.outputs for r in reqs)
                     and not consumer.busy() and th.leak_report(consumer) is None, 120.0)
        assert all(consumer.outputs[r.request_id].new_token_ids for r in reqs)
    finally:
        consumer.close()
        short.close()
