"""tpu-inference's own connector test scenarios (its tests/distributed/test_tpu_connector.py),
re-expressed against jaxkv's connector with real vLLM objects and real engines, and the exact
description of tpu-inference's cache (`KVCacheSpec.for_tpu_inference`) checked against
tpu-inference's own allocation and K/V merge."""

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

from jaxkv import KVCacheSpec  # noqa: E402
from jaxkv.transfer import make_transfer_params, nixl_available  # noqa: E402

# -- the cache layout ------------------------------------------------------------------------


def _mesh(tp):
    import jax
    from jax.sharding import Mesh

    return Mesh(np.array(jax.devices()[:tp]).reshape(1, tp), ("data", "model"))


def _finite_bits(rng, shape, dtype):
    """Random values of `dtype` whose top exponent bit is clear (no NaN or infinity)."""
    dtype = np.dtype(dtype)
    width = np.dtype(f"u{dtype.itemsize}")
    bits = rng.integers(0, np.iinfo(width).max, size=shape, dtype=width, endpoint=True)
    bits &= ~np.array(1 << (8 * dtype.itemsize - 2), width)
    return bits.view(dtype)


@pytest.mark.parametrize(
    "dtype, heads, tp",
    [("bfloat16", 4, 1), ("bfloat16", 4, 2), ("bfloat16", 2, 2), ("float32", 2, 2),
     ("float8_e4m3fn", 4, 2), ("float8_e4m3fn", 2, 2), ("float8_e4m3fn", 3, 1)],
)
def test_for_tpu_inference_describes_tpu_inference_cache(dtype, heads, tp):
    """tpu-inference's allocation has `for_tpu_inference`'s global shape; in the rows its
    attention kernel writes (`merge_kv`, per TP rank), K and V of every head sit exactly where
    `combined_head` says and the entries that hold values are `payload_mask`'s."""
    import jax.numpy as jnp
    from tpu_inference.kernels.ragged_paged_attention.v3.kernel import merge_kv
    from tpu_inference.runner.kv_cache import create_kv_caches

    head_dim, page = 96, 16
    spec = KVCacheSpec.for_tpu_inference(1, heads, head_dim, page, dtype)
    (cache,) = create_kv_caches(4, page, heads, head_dim, _mesh(tp), ["l"],
                                cache_dtype=jnp.dtype(spec.dtype))
    assert cache.shape[1:] == spec.global_block_shape(tp)
    rng = np.random.default_rng(1)
    per = spec.heads_per_rank(tp)
    k = _finite_bits(rng, (page, heads, head_dim), spec.dtype)
    v = _finite_bits(rng, (page, heads, head_dim), spec.dtype)
    width = np.dtype(f"u{spec.itemsize}")
    mask = spec.payload_mask(tp)
    for rank in range(tp):
        rows = np.asarray(merge_kv(jnp.asarray(k[:, rank * per:(rank + 1) * per]),
                                   jnp.asarray(v[:, rank * per:(rank + 1) * per])))
        assert rows.shape[1:] == spec.block_shape(tp)[1:]
        rows = rows.view(width)
        for head in range(per):
            for kv, source in ((0, k), (1, v)):
                index = spec.combined_head(head, kv)
                np.testing.assert_array_equal(
                    rows[(slice(None), *index, slice(0, head_dim))],
                    source[:, rank * per + head].view(width),
                )
        ones = np.ones((page, per, head_dim), spec.dtype)
        np.testing.assert_array_equal(
            np.asarray(merge_kv(jnp.asarray(ones), jnp.asarray(ones))).view(width) != 0, mask
        )


def test_runner_caches_adopted_zero_copy_and_head_dim_64_refused():
    """`describe_runner_caches` reads tpu-inference's arrays (mesh, TP axis, spec) and the
    engine's view holds the same buffers; head dim 64 (tpu-inference's kernel_hd64 puts K and
    V side by side on the lanes) is refused by name."""
    import jax.numpy as jnp
    from tpu_inference.runner.kv_cache import create_kv_caches

    from jaxkv.integrations.tpu_inference import describe_runner_caches

    caches = create_kv_caches(8, 16, 4, 96, _mesh(2), ["a", "b"], cache_dtype=jnp.bfloat16)
    layout = describe_runner_caches(caches, 4, 96)
    assert (layout.tp_size, layout.tp_axis, layout.data_axis) == (2, "model", None)
    assert layout.spec == KVCacheSpec.for_tpu_inference(2, 4, 96, 16, "bfloat16")
    view = layout.wrap(caches)
    assert all(a is b for a, b in zip(view.arrays, caches))
    pointers = sorted(s.data.unsafe_buffer_pointer() for c in caches for s in c.addressable_shards)
    assert sorted(b.address for b in view.shard_buffers()) == pointers
    assert [(b.head_start, b.head_stop) for b in view.shard_buffers()][:2] == [(0, 2), (2, 4)]
    hd64 = create_kv_caches(8, 16, 4, 64, _mesh(1), ["a"], cache_dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="head_dim 64"):
        describe_runner_caches(hd64, 4, 64)
    with pytest.raises(ValueError, match="cache of 2 KV heads of dim 96 over TP 2"):
        describe_runner_caches(caches, 2, 96)  # the model config disagrees with the cache


# -- scheduler side (tpu-inference's TestTPUConnectorScheduler, re-expressed) ----------------


def _scheduler_connector(role):
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    extra = {"engine_id": "p" if role == "kv_producer" else "d"}
    if role == "kv_producer":
        extra["side_channel"] = [["127.0.0.1", 5601]]
    config = th.vllm_config(role, 16, extra)
    return KVConnectorFactory.create_connector(
        config, KVConnectorRole.SCHEDULER, th.kv_cache_config(16, 64)
    )


def _remote_params(num_tokens, block_ids):
    from jaxkv.integrations import transfer_params_to_dict

    params = make_transfer_params("p", ("127.0.0.1", 5601), "p-req", block_ids, 20.0)
    return transfer_params_to_dict(params, num_tokens, 16)


def _blocks(ids, hits=0):
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    blocks = [KVCacheBlock(block_id=b) for b in ids]
    for block in blocks[:hits]:
        block._block_hash = b"hit"
    return KVCacheBlocks((blocks,))


def test_scheduler_matched_tokens():
    """Producer: nothing to load. Consumer: the remote tokens beyond the local hit, loaded
    asynchronously (tpu-inference rounds down to whole blocks and recomputes the rest; jaxkv
    reads the partial last block too); nothing once fully computed locally."""
    from jaxkv.integrations.tpu_inference import JaxKVTPUConnector

    producer = _scheduler_connector("kv_producer")
    assert isinstance(producer, JaxKVTPUConnector)
    req = th.request(list(range(35)), 16, {"do_remote_decode": True}, 1)
    assert producer.get_num_new_matched_tokens(req, 16) == (0, False)
    consumer = _scheduler_connector("kv_consumer")
    req = th.request(list(range(35)), 16, _remote_params(35, [4, 5, 6]), 1)
    assert consumer.get_num_new_matched_tokens(req, 16) == (19, True)
    assert consumer.get_num_new_matched_tokens(req, 35) == (0, False)
    assert consumer.get_num_new_matched_tokens(th.request([1] * 35, 16, None, 1), 0) == (0, False)


def test_scheduler_update_state_and_build_meta():
    """With external tokens: a read of the non-hit blocks; without (all local): an empty read
    that only releases the producer's blocks; the meta is handed over once and reset."""
    consumer = _scheduler_connector("kv_consumer")
    req = th.request(list(range(40)), 16, _remote_params(40, [7, 8, 9]), 1)
    consumer.update_state_after_alloc(req, _blocks([1, 2, 3], hits=1), 24)
    assert req.kv_transfer_params["do_remote_prefill"] is False  # one transfer per request
    full = th.request(list(range(32)), 16, _remote_params(32, [10, 11]), 1)
    consumer.update_state_after_alloc(full, _blocks([4, 5], hits=2), 0)
    meta = consumer.build_connector_meta(_scheduler_output())
    reads = {r.request_id: r for r in meta.to_recv}
    assert (reads[req.request_id].local_block_ids, reads[req.request_id].num_local_hit_blocks) \
        == ([2, 3], 1)
    assert reads[full.request_id].release_only and not reads[full.request_id].local_block_ids
    assert not consumer.build_connector_meta(_scheduler_output()).to_recv  # reset


def _scheduler_output(scheduled=None):
    from vllm.v1.core.sched.output import SchedulerOutput

    output = SchedulerOutput.make_empty()
    output.num_scheduled_tokens = dict(scheduled or {})
    return output


class _Manager:
    """The scheduler's KV cache manager as the connector uses it (block ids per request)."""

    block_pool = None

    def __init__(self, ids):
        self.ids = ids

    def get_block_ids(self, request_id):
        return (self.ids[request_id],)


def test_scheduler_request_finished():
    """Consumer: nothing to keep. Producer, finished by length after its blocks were
    published: keeps them and returns the consumer's params (a prompt shorter than a block
    is sent too: tpu-inference recomputes it); aborted: keeps nothing and the workers release
    the published blocks."""
    from vllm.v1.request import RequestStatus

    consumer = _scheduler_connector("kv_consumer")
    assert consumer.request_finished(th.request([1, 2], 16, None, 1), []) == (False, None)
    producer = _scheduler_connector("kv_producer")
    done = th.request(list(range(40)), 16, {"do_remote_decode": True}, 1)
    short = th.request(list(range(10)), 16, {"do_remote_decode": True}, 1)
    aborted = th.request(list(range(20)), 16, {"do_remote_decode": True}, 1)
    for req in (done, short, aborted):
        producer.update_state_after_alloc(req, _blocks([]), 0)
    producer.bind_kv_cache_manager(_Manager({done.request_id: [3, 4, 5, 6],
                                             short.request_id: [9],
                                             aborted.request_id: [11, 12]}))
    meta = producer.build_connector_meta(_scheduler_output(
        {done.request_id: 40, short.request_id: 10, aborted.request_id: 20}))
    assert meta.to_publish == {done.request_id: [3, 4, 5], short.request_id: [9],
                               aborted.request_id: [11, 12]}
    done.status = short.status = RequestStatus.FINISHED_LENGTH_CAPPED
    keep, params = producer.request_finished(done, [3, 4, 5, 6])
    assert keep and params["remote_block_ids"] == [[3, 4, 5]]  # one list per group (NIXL's)
    assert params["remote_num_tokens"] == 40
    assert params["jaxkv_addresses"] == [[["127.0.0.1", 5601]]]
    assert (params["remote_host"], params["remote_port"]) == ("127.0.0.1", 5601)
    keep, params = producer.request_finished(short, [9])
    assert keep and params["remote_block_ids"] == [[9]]
    aborted.status = RequestStatus.FINISHED_ABORTED
    assert producer.request_finished(aborted, [11, 12]) == (False, None)
    meta = producer.build_connector_meta(_scheduler_output())
    assert meta.to_send == {done.request_id, short.request_id}
    assert meta.to_abort == {aborted.request_id}


# -- worker side (tpu-inference's TestTPUConnectorWorker, re-expressed) -----------------------


needs_nixl = pytest.mark.skipif(not nixl_available(), reason="NIXL (nixl-cu13) is not installed")


def _worker(role, extra, block_size=16):
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    worker = KVConnectorFactory.create_connector(
        th.vllm_config(role, block_size, extra), KVConnectorRole.WORKER,
        th.kv_cache_config(block_size, 32),
    )
    runner = th.FakeRunner(1, 32, block_size)
    worker.register_runner(runner)
    return worker, runner


def _run_step(worker, meta):
    """tpu-inference's runner hooks of one step without a forward."""
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    worker.wait_for_save()
    sending, recving = worker.get_finished(set())
    errors = worker.get_block_ids_with_load_errors()
    worker.clear_connector_metadata()
    return sending, recving, errors


def _until(worker, predicate, timeout_s=30.0):
    from jaxkv.integrations.vllm import JaxKVConnectorMetadata

    deadline = time.monotonic() + timeout_s
    seen = (set(), set(), set())
    while time.monotonic() < deadline:
        for acc, new in zip(seen, _run_step(worker, JaxKVConnectorMetadata())):
            acc |= new
        if predicate(*seen):
            return seen
        time.sleep(0.01)
    raise TimeoutError(f"not reached; saw {seen}")


@needs_nixl
def test_worker_release_before_publish_then_lease_expiry():
    """tpu-inference's "pull done before registration is released after registration" and
    "expired requests are reported done sending": a consumer's empty read that reaches the
    producer before its worker pinned the request frees it right after the pin (not at lease
    end); a request nobody reads is reported in the sending set once its lease expired."""
    from jaxkv.integrations.vllm import JaxKVConnectorMetadata, _Recv

    # a lease long enough that "released by the read" cannot be the lease on a busy machine
    producer, _ = _worker("kv_producer", {"engine_id": "p-w", "lease_s": 6.0})
    consumer, _ = _worker("kv_consumer", {"engine_id": "d-w"})
    try:
        params = _remote_params_at(producer.address, "p-w", "early", [3, 4], 20)
        meta = JaxKVConnectorMetadata(to_recv=[_Recv("d-early", params, [], 0, True)])
        _run_step(consumer, meta)  # the release arrives first
        time.sleep(0.2)
        start = time.monotonic()
        sending, _, _ = _run_step(producer, JaxKVConnectorMetadata(
            to_publish={"early": [3, 4]}, to_send={"early"}))
        if "early" not in sending:  # the held release may be handled in the publishing step
            sending, _, _ = _until(producer, lambda s, r, e: "early" in s)
        assert time.monotonic() - start < 3.0  # released by the read, not by the lease
        assert producer.engine.stats.expired_leases == 0
        _run_step(producer, JaxKVConnectorMetadata(to_publish={"unread": [5]},
                                                   to_send={"unread"}))
        sending, _, _ = _until(producer, lambda s, r, e: "unread" in s)
        assert producer.engine.stats.expired_leases == 1
        assert producer.engine.num_pinned == 0
    finally:
        consumer.shutdown()
        producer.shutdown()


def _remote_params_at(address, engine_id, request_id, block_ids, num_tokens):
    from jaxkv.integrations import transfer_params_to_dict

    params = make_transfer_params(engine_id, tuple(address), request_id, block_ids, 20.0)
    return transfer_params_to_dict(params, num_tokens, 16)


TRANSPORTS = [pytest.param("nixl", marks=needs_nixl), "jax"]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_worker_failed_read_is_reported_not_inserted(transport):
    """tpu-inference's "failed pull is reported" / "failed pull is not inserted": a read of a
    request the producer never pins fails; its local blocks come back through
    get_block_ids_with_load_errors in the step that reports it finished, and the bytes of a
    successful read of the same producer land where expected."""
    from jaxkv.integrations.vllm import JaxKVConnectorMetadata, _Recv

    producer, prunner = _worker("kv_producer", {"engine_id": "p-f", "early_read_grace_s": 0.3,
                                                "transport": transport})
    consumer, crunner = _worker("kv_consumer", {"engine_id": "d-f", "read_timeout_s": 10.0,
                                                "transport": transport})
    try:
        prompt = th.prompts_of([20], seed=81)[0]
        prunner.forward([(prompt, [6, 7], 0, 20)])
        _run_step(producer, JaxKVConnectorMetadata(to_publish={"good": [6, 7]},
                                                   to_send={"good"}))
        good = _remote_params_at(producer.address, "p-f", "good", [6, 7], 20)
        never = _remote_params_at(producer.address, "p-f", "never", [8, 9], 20)
        meta = JaxKVConnectorMetadata(to_recv=[_Recv("d-good", good, [2, 3], 0),
                                               _Recv("d-never", never, [4, 5], 0)])
        _, recving, errors = _run_step(consumer, meta)
        sent: set[str] = set()
        deadline = time.monotonic() + 30
        while ({"d-good", "d-never"} - recving or "good" not in sent) and (
            time.monotonic() < deadline
        ):
            sent |= _run_step(producer, JaxKVConnectorMetadata())[0]
            _, r, e = _run_step(consumer, JaxKVConnectorMetadata())
            recving |= r
            errors |= e
        assert recving == {"d-good", "d-never"} and sent == {"good"}
        assert errors == {4, 5}
        assert consumer.engine.stats.failed_transfers == 1
        rows = th.page_rows(crunner.kv_caches, [2, 3], 20, 16)
        th.assert_rows_equal(rows, prompt, 1, 16)
    finally:
        consumer.shutdown()
        producer.shutdown()


def test_worker_jax_read_lands_in_runner_caches_with_runner_sharding():
    """Over the JAX transport the consumer's engine writes a read with JAX ops (new arrays):
    in the step that reports it finished, ``runner.kv_caches`` hold the rows, with the
    runner's own shardings (not the transfer view's mesh) over the same buffers, and are the
    engine's current cache; the runner's next forward donates them in place (no move, no
    re-registration) and a second read lands in its output."""
    from jaxkv.integrations.vllm import JaxKVConnectorMetadata, _Recv

    producer, prunner = _worker("kv_producer", {"engine_id": "p-j", "transport": "jax"})
    consumer, crunner = _worker("kv_consumer", {"engine_id": "d-j", "read_timeout_s": 20.0,
                                                "transport": "jax"})
    try:
        shardings = [c.sharding for c in crunner.kv_caches]
        pointers = [c.addressable_shards[0].data.unsafe_buffer_pointer()
                    for c in crunner.kv_caches]
        first, second = th.prompts_of([20, 30], seed=91)
        prunner.forward([(first, [6, 7], 0, 20), (second, [8, 9], 0, 30)])
        _run_step(producer, JaxKVConnectorMetadata(to_publish={"a": [6, 7], "b": [8, 9]},
                                                   to_send={"a", "b"}))
        params = _remote_params_at(producer.address, "p-j", "a", [6, 7], 20)
        _run_step(consumer, JaxKVConnectorMetadata(to_recv=[_Recv("d-a", params, [2, 3], 0)]))
        recving: set[str] = set()
        deadline = time.monotonic() + 30
        while "d-a" not in recving and time.monotonic() < deadline:
            _run_step(producer, JaxKVConnectorMetadata())
            _, r, errors = _run_step(consumer, JaxKVConnectorMetadata())
            recving |= r
            assert not errors
        assert recving == {"d-a"}
        assert all(a is b for a, b in zip(crunner.kv_caches, consumer.cache.arrays))
        assert [c.sharding for c in crunner.kv_caches] == shardings
        assert [c.addressable_shards[0].data.unsafe_buffer_pointer()
                for c in crunner.kv_caches] == pointers  # written in place on CPU
        th.assert_rows_equal(th.page_rows(crunner.kv_caches, [2, 3], 20, 16), first, 1, 16)
        crunner.forward([(first, [2, 3], 19, 20)])  # the runner computes on what it got
        assert [c.addressable_shards[0].data.unsafe_buffer_pointer()
                for c in crunner.kv_caches] == pointers
        params = _remote_params_at(producer.address, "p-j", "b", [8, 9], 30)
        _run_step(consumer, JaxKVConnectorMetadata(to_recv=[_Recv("d-b", params, [4, 5], 0)]))
        deadline = time.monotonic() + 30
        while "d-b" not in recving and time.monotonic() < deadline:
            _run_step(producer, JaxKVConnectorMetadata())
            _, r, errors = _run_step(consumer, JaxKVConnectorMetadata())
            recving |= r
            assert not errors
        assert "d-b" in recving and consumer.reregistrations == 0
        th.assert_rows_equal(th.page_rows(crunner.kv_caches, [4, 5], 30, 16), second, 1, 16)
        th.assert_rows_equal(th.page_rows(crunner.kv_caches, [2, 3], 20, 16), first, 1, 16)
    finally:
        consumer.shutdown()
        producer.shutdown()


def test_transport_setting_is_passed_to_the_engine():
    """``transport`` goes to `KVTransferEngine` ("jax": memory is not registered); an unknown
    name is refused by name."""
    worker, _ = _worker("kv_producer", {"engine_id": "p-t", "transport": "jax"})
    try:
        assert worker.engine.transport_name == "jax"
        assert not worker.engine.registers_memory
        # the exact packed description, not NIXL's word-column view
        assert worker.engine.config.spec == worker.layout.spec
        assert worker.engine.caches[0].spec.kv_interleaved
    finally:
        worker.shutdown()
    with pytest.raises(ValueError, match="carrier-pigeon"):
        _worker("kv_producer", {"engine_id": "p-u", "transport": "carrier-pigeon"})


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_partial_word_fp8_cache_is_moved_as_values(transport):
    """An fp8 cache of 3 KV heads (6 combined heads in words of 4: phantom entries inside
    a rank) has no word-column view: registered exactly (values only) over either transport;
    NIXL's packed_transfer "words" refuses it by name."""
    import types

    import jax.numpy as jnp
    from tpu_inference.runner.kv_cache import create_kv_caches
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from jaxkv.integrations.tpu_inference import describe_runner_caches

    caches = create_kv_caches(8, 16, 3, 128, _mesh(1), ["a", "b"],
                              cache_dtype=jnp.float8_e4m3fn)
    layout = describe_runner_caches(caches, 3, 128)
    assert layout.view is None and "whole" in layout.view_error
    with pytest.raises(ValueError, match="whole"):
        layout.wrap(caches)
    assert all(a is b for a, b in zip(layout.wrap_exact(caches).arrays, caches))
    extra = {"engine_id": f"d-8-{transport}", "num_kv_heads": 3, "head_dim": 128,
             "transport": transport}
    worker = KVConnectorFactory.create_connector(
        th.vllm_config("kv_consumer", 16, extra), KVConnectorRole.WORKER,
        th.kv_cache_config(16, 8))
    try:
        runner = types.SimpleNamespace(kv_caches=caches)
        worker.register_runner(runner)
        assert worker.engine.config.spec == layout.spec
    finally:
        worker.shutdown()
    if transport == "nixl":
        extra = dict(extra, engine_id="d-8-words", packed_transfer="words")
        worker = KVConnectorFactory.create_connector(
            th.vllm_config("kv_consumer", 16, extra), KVConnectorRole.WORKER,
            th.kv_cache_config(16, 8))
        try:
            with pytest.raises(ValueError, match="whole"):
                worker.register_runner(types.SimpleNamespace(kv_caches=caches))
        finally:
            worker.shutdown()
