"""`JaxKVConnector` with GPU-vLLM-shaped torch KV caches on both sides (vLLM 0.33's allocator,
adopted zero-copy through DLPack): real vLLM schedulers, real jaxkv engines over NIXL, the
producer in another process; the consumer's torch tensors hold the producer's bytes exactly."""

from __future__ import annotations

import os

os.environ.setdefault("UCX_TLS", "tcp,sm,self")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import importlib.util  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

if importlib.util.find_spec("vllm") is None or importlib.util.find_spec("torch") is None:
    pytest.skip(
        "vLLM/torch are not installed: run scripts/test.sh --integrations (sets up .venv-vllm)",
        allow_module_level=True,
    )

from jaxkv.transfer import nixl_available  # noqa: E402

if not nixl_available():
    pytest.skip("NIXL (nixl-cu13) is not installed", allow_module_level=True)

import torch  # noqa: E402
import torch_harness as th  # noqa: E402
import transfer_testing as tt  # noqa: E402
import vllm_harness as vh  # noqa: E402

NUM_BLOCKS = 64


def prompts_of(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(10, 50000, size=n).tolist() for n in lengths]


@pytest.mark.parametrize(
    "layout_name,side_kwargs,p_tp,d_tp",
    [
        ("LBNHC", dict(dtype="bfloat16"), 1, 1),  # vLLM's default NHD layout: per-layer arrays
        ("BLHNC", dict(dtype="fp8"), 1, 1),  # cross-layer: one array; fp8 stored as uint8
        ("LBHNC", dict(dtype="float16", mla=True, head_size=32), 1, 1),  # MLA latent cache
        # heterogeneous TP, one vLLM worker (connector, engine, torch caches) per rank
        ("LBHNC", dict(dtype="bfloat16"), 1, 2),
        ("LBNHC", dict(dtype="float32"), 2, 1),
    ],
)
def test_torch_caches_between_two_processes(layout_name, side_kwargs, p_tp, d_tp):
    remote = tt.RemoteProcess(th.torch_producer_process,
                              (layout_name, NUM_BLOCKS, {"engine_id": "prefill", "lease_s": 30.0},
                               dict(side_kwargs, tp=p_tp)))
    consumer = th.TorchSide("kv_consumer", layout_name, NUM_BLOCKS,
                            {"engine_id": "decode", "read_timeout_s": 20.0}, **side_kwargs,
                            tp=d_tp)
    try:
        # the transfer engine registered the torch memory itself
        registered = {b.address for b in consumer.worker.cache.shard_buffers()}
        assert registered <= {t.data_ptr() for t in consumer.torch_caches.values()}
        prompts = prompts_of([5, 8, 21, 40], seed=4)
        params = remote.call("add", prompts)
        reqs = [vh.request(p, consumer.spec.block_size, dict(kv), 2)
                for p, kv in zip(prompts, params)]
        for r in reqs:
            consumer.add(r)
        vh.run_until([consumer], lambda: all(r.request_id in consumer.outputs for r in reqs)
                     and not consumer.busy(), 60.0)
        assert not consumer.load_errors and not consumer.failed_blocks
        for r, p in zip(reqs, prompts):
            got = consumer.torch_received[r.request_id]
            n = -(-len(p) // consumer.spec.block_size)
            expected = consumer.expected_torch_blocks(p, n)
            assert len(got) == len(expected) == consumer.spec.num_layers * d_tp
            for a, b in zip(got, expected):
                np.testing.assert_array_equal(a, b)
        for worker in consumer.workers:
            assert worker.engine.stats.requests_total == len(prompts)
        vh.assert_empty(consumer)
        assert remote.wait_idle(30.0) == (False, 0)
    finally:
        consumer.close()
        remote.close()


def _handoff(producer, consumer, prompts):
    reqs = [vh.request(p, producer.spec.block_size, {"do_remote_decode": True}, 1)
            for p in prompts]
    for r in reqs:
        producer.add(r)
    vh.run_until([producer], lambda: all(r.request_id in producer.sent_params for r in reqs))
    creqs = [vh.request(p, consumer.spec.block_size, dict(producer.sent_params[r.request_id]), 2)
             for p, r in zip(prompts, reqs)]
    for r in creqs:
        consumer.add(r)
    vh.run_until([producer, consumer],
                 lambda: all(r.request_id in consumer.outputs for r in creqs)
                 and not consumer.busy() and not producer.busy(), 60.0)
    return creqs


@pytest.mark.parametrize(
    "producer_layout,producer_block_size,consumer_block_size",
    [("LBHNC", 8, 8),  # HND blocks into an NHD cache: a permute
     ("LBNHC", 8, 16),  # two producer blocks per consumer block: a merge
     ("LBHNC", 8, 16)],  # both
)
def test_blocks_needing_a_rewrite_land_in_the_torch_memory(
        producer_layout, producer_block_size, consumer_block_size):
    """A producer in another layout or block size: the consumer rewrites the received blocks
    out of place (JAX does not write torch memory in place) and copies exactly those blocks
    back into its torch tensors. Bytes exact; the cache is still the torch memory; blocks of
    no request keep their bytes; the next read is exact too."""
    producer = th.TorchSide("kv_producer", producer_layout, NUM_BLOCKS,
                            {"engine_id": "prefill-other", "lease_s": 20.0},
                            block_size=producer_block_size)
    consumer = th.TorchSide("kv_consumer", "LBNHC", NUM_BLOCKS,
                            {"engine_id": "decode", "read_timeout_s": 20.0},
                            block_size=consumer_block_size)
    try:
        sentinel = {n: t.view(torch.int16).fill_(-7).clone()
                    for n, t in consumer.torch_caches.items()}
        used: set[int] = set()
        for seed in (5, 6):
            # whole blocks on both sides: a consumer block's tail beyond the prompt keeps its
            # bytes (no producer block covers it)
            (prompt,) = prompts_of([48], seed=seed)
            (req,) = _handoff(producer, consumer, [prompt])
            assert req.request_id not in consumer.failed_blocks
            assert not consumer.load_errors
            got = consumer.torch_received[req.request_id]
            n = -(-len(prompt) // consumer_block_size)
            for a, b in zip(got, consumer.expected_torch_blocks(prompt, n)):
                np.testing.assert_array_equal(a, b)
            used.update(consumer.received_block_ids[req.request_id])
            cache = consumer.worker.cache
            assert [a.unsafe_buffer_pointer() for a in cache.arrays] == [
                consumer.torch_caches[name].data_ptr() for name in consumer.names]
        untouched = [i for i in range(NUM_BLOCKS) if i not in used]
        assert untouched
        for name, tensor in consumer.torch_caches.items():
            np.testing.assert_array_equal(tensor.view(torch.int16)[untouched].numpy(),
                                          sentinel[name][untouched].numpy())
        vh.assert_empty(consumer)
    finally:
        consumer.close()
        producer.close()
