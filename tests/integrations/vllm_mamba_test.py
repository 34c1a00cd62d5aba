"""`JaxKVConnector` with a hybrid attention + Mamba model (vLLM's ``MambaSpec`` groups): a
producer and a consumer vLLM 0.33 `Scheduler` for a model of 2 full-attention and 2 Mamba2
layers, grouped by vLLM's own planner, real jaxkv transfer engines over NIXL (the producer in
its own process), a fake model that writes attention KV and a per-request state. Every group's
bytes compared exactly, every block no read filled checked untouched.

vLLM 0.33's own tests re-expressed here: ``test_p_side_chunked_prefill_mamba`` (the producer
computes ``N - 1`` prompt tokens in chunks, finishes with one output token, and hands over the
state of those ``N - 1`` tokens, which the consumer reads beside the attention blocks, then
computes token ``N`` itself) and ``test_async_load_does_not_double_reserve_mamba_spec_blocks``
(two hybrid reads with Mamba's speculative scratch blocks admitted together, both read)."""

from __future__ import annotations

import os

os.environ.setdefault("UCX_TLS", "tcp,sm,self")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import hashlib  # noqa: E402
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
NUM_BLOCKS = 400
STEP = 64  # tokens per scheduler step (vLLM's minimum here: max_num_seqs)
ATTN, MAMBA = 0, 1
ATTN_LAYER = dict(num_kv_heads=4, head_dim=8, dtype="bfloat16")
# Mamba2 over the whole model: 4 SSM heads of head dim 4, state size 8, 2 groups, conv kernel 4
HEADS, HEAD_DIM, STATE, NGROUPS, CONV_ROWS = 4, 4, 8, 2, 3


def mamba_shapes(tp: int) -> tuple[tuple[int, int], tuple[int, int, int]]:
    """One TP rank's conv (vLLM's DS layout: dim, rows) and SSM state shapes."""
    conv_dim = HEADS * HEAD_DIM + 2 * NGROUPS * STATE
    return (conv_dim // tp, CONV_ROWS), (HEADS // tp, HEAD_DIM, STATE)


def kv_cache_config(config, num_blocks: int, tp: int = 1, spec_blocks: int = 0):
    """vLLM's cache config of the hybrid model, as its engine core plans it (the Mamba page
    padded to the attention page, as vLLM's hybrid model config does)."""
    import torch
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    attention = FullAttentionSpec(block_size=BLOCK, num_kv_heads=4 // tp, head_size=8,
                                  dtype=torch.bfloat16)
    mamba = MambaSpec(block_size=BLOCK, shapes=mamba_shapes(tp),
                      dtypes=(torch.bfloat16, torch.float32),
                      page_size_padded=attention.page_size_bytes,
                      num_speculative_blocks=spec_blocks)
    specs = {
        (f"model.layers.{i}.self_attn.attn" if i % 2 == 0 else f"model.layers.{i}.mixer"):
        (attention if i % 2 == 0 else mamba)
        for i in range(4)
    }
    config.cache_config.num_gpu_blocks_override = num_blocks
    resolve_kv_cache_layout(config, [["NHD"]], [attention])
    groups = get_global_kv_cache_groups(config, [specs])
    (kv_config,) = get_kv_cache_configs(config, [specs], [1 << 30], groups)
    return kv_config


def hybrid_config(role: str, extra: dict[str, Any], spec_blocks: int = 0):
    config = vh.vllm_config(role, BLOCK, extra, NUM_BLOCKS, max_num_batched_tokens=STEP)
    config.cache_config.enable_prefix_caching = False  # vLLM's Mamba mode "none"
    if spec_blocks:
        from vllm.config import SpeculativeConfig

        config.speculative_config = SpeculativeConfig(model="ngram",
                                                      num_speculative_tokens=spec_blocks)
    return config


def state_bits(spec: KVCacheSpec, tokens: list[int], name: str) -> list[np.ndarray]:
    """The state a request's first ``len(tokens)`` tokens leave in one component (random bits
    seeded by the tokens and the component), one ``[1, *block_shape]`` array per cache array."""
    seed = hashlib.sha256(repr((name, [int(t) for t in tokens])).encode()).digest()
    rng = np.random.default_rng(int.from_bytes(seed[:8], "little"))
    width = np.dtype(f"u{spec.itemsize}")
    return [
        rng.integers(0, np.iinfo(width).max, size=(1, *spec.block_shape()), dtype=width,
                     endpoint=True).view(spec.dtype)
        for _ in range(spec.num_arrays)
    ]


class MambaSide:
    """One vLLM engine of the hybrid model: its scheduler, a worker connector, an attention
    cache and one cache per Mamba state component (``tp`` TP ranks as devices of the
    worker)."""

    def __init__(self, role: str, extra: dict[str, Any], tp: int = 1,
                 layouts: tuple[str, str] = ("LKHTD", "LHTD"), spec_blocks: int = 0):
        import jax
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager

        from jaxkv.integrations.vllm import JaxKVConnector

        self.role, self.tp = role, tp
        extra = {**extra, "tp_size": tp}
        worker_config = hybrid_config(role, dict(extra), spec_blocks)
        self.kv_config = kv_cache_config(worker_config, NUM_BLOCKS, tp, spec_blocks)
        groups = self.kv_config.kv_cache_groups
        kinds = [type(g.kv_cache_spec).__name__ for g in groups]
        assert kinds == ["FullAttentionSpec", "MambaSpec"], kinds
        self.worker = JaxKVConnector(worker_config, KVConnectorRole.WORKER, self.kv_config)
        self.components = self.worker.groups.state_of(MAMBA)
        assert [c.name for c in self.components] == ["conv_x", "conv_b", "conv_c", "ssm"]
        self.attn_spec = KVCacheSpec(num_layers=2, block_size=BLOCK, layout=layouts[0],
                                     **ATTN_LAYER)
        self.state_specs = [c.spec(2, layouts[1]) for c in self.components]
        mesh = jax.sharding.Mesh(np.array(jax.devices()[:tp]), ("tp",)) if tp > 1 else None
        attn = PagedKVCache.allocate(self.attn_spec, NUM_BLOCKS, mesh=mesh)
        states = tuple(PagedKVCache.allocate(s, NUM_BLOCKS, mesh=mesh) for s in self.state_specs)
        self.worker.register_kv_caches(
            {name: (attn if g == ATTN else states) for g, group in enumerate(groups)
             for name in group.layer_names})
        self.names = list(self.worker.engine.groups)
        assert self.names == ["0", "1_conv_x", "1_conv_b", "1_conv_c", "1_ssm"], self.names
        sched_extra = dict(extra)
        if role == "kv_producer":
            addresses = self.worker.addresses
            sched_extra["side_channel"] = [list(addresses[0])]
            sched_extra["group_ports"] = [[port for _, port in addresses]]
        self.config = hybrid_config(role, sched_extra, spec_blocks)
        assert not self.config.scheduler_config.disable_hybrid_kv_cache_manager
        self.scheduler = Scheduler(
            vllm_config=self.config,
            kv_cache_config=kv_cache_config(self.config, NUM_BLOCKS, tp, spec_blocks),
            log_stats=True,
            structured_output_manager=StructuredOutputManager(self.config),
            block_size=BLOCK,
        )
        self.spec_blocks = spec_blocks
        self.null = self.scheduler.kv_cache_manager.block_pool.null_block.block_id
        self.outputs: dict[str, Any] = {}
        self.sent_params: dict[str, dict] = {}
        self.received: dict[str, tuple[list[np.ndarray], list[list[np.ndarray]]]] = {}
        self.read_blocks: dict[str, tuple[list[int], int]] = {}
        self.failed: set[str] = set()
        self.group_errors: dict[int, set[int]] = {}
        self.chunks: dict[str, list[int]] = {}  # request -> tokens scheduled per step

    def cache(self, name: str) -> Any:
        return self.worker.engine.caches_of(name)[0]

    def add(self, req) -> None:
        self.scheduler.add_request(req)

    def blocks(self, request_id: str) -> tuple[list[int], int]:
        """The request's attention block ids and its Mamba running-state block."""
        attn, mamba = self.scheduler.kv_cache_manager.get_block_ids(request_id)
        state = mamba[: len(mamba) - min(self.spec_blocks, len(mamba) - 1)][-1]
        return list(attn), state

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
        assert not worker.get_block_ids_with_load_errors()  # vLLM refuses them with 2 groups
        for g, ids in worker.get_group_block_ids_with_load_errors().items():
            self.group_errors.setdefault(g, set()).update(ids)
        worker.clear_connector_metadata()
        recving, failed = results.finished_recving, results.failed_recving
        self.failed |= failed
        for request_id in recving - failed:
            req = self.scheduler.requests[request_id]
            if req.is_finished():
                continue
            attn, state = self.blocks(request_id)
            n = math.ceil((req.num_prompt_tokens - 1) / BLOCK)  # the producer's N - 1 tokens
            self.read_blocks[request_id] = (attn[:n], state)
            self.received[request_id] = (
                [np.asarray(a) for a in self.cache("0").gather_blocks(
                    np.asarray(attn[:n], np.int32))],
                [[np.asarray(a) for a in self.cache(name).gather_blocks(
                    np.asarray([state], np.int32))] for name in self.names[1:]],
            )
        reqs = self.scheduler.requests
        req_ids = list(out.num_scheduled_tokens)
        for r in req_ids:
            self.chunks.setdefault(r, []).append(out.num_scheduled_tokens[r])
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
                invalid_block_ids=set(),
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
        """Every scheduled request: the KV of its computed prompt tokens into its attention
        blocks, and the state those tokens leave into its state block (each chunk overwrites
        the previous chunk's state, as a Mamba layer does)."""
        for request_id in out.num_scheduled_tokens:
            req = self.scheduler.requests[request_id]
            upto = min(req.num_computed_tokens, req.num_prompt_tokens)
            if upto == 0:
                continue
            attn, state = self.blocks(request_id)
            n = math.ceil(upto / BLOCK)
            kv = vh.token_kv(self.attn_spec, req.prompt_token_ids)[:, :, :, :upto]
            dense = vh.dense_blocks(self.attn_spec, kv, n)
            self.worker.update_cache(
                self.cache("0").scatter_blocks(dense, np.asarray(attn[:n], np.int32)))
            for name, spec in zip(self.names[1:], self.state_specs):
                bits = state_bits(spec, req.prompt_token_ids[:upto], name)
                self.worker.update_cache(
                    self.cache(name).scatter_blocks(bits, np.asarray([state], np.int32)))

    def check_received(self, req, prompt: list[int]) -> int:
        """Compares the attention blocks and every state component read for `req` with the
        producer's (the state of the first ``N - 1`` tokens); returns the attention blocks
        compared."""
        attn, states = self.received[req.request_id]
        n = math.ceil((len(prompt) - 1) / BLOCK)
        kv = vh.token_kv(self.attn_spec, prompt)[:, :, :, : len(prompt) - 1]
        for a, b in zip(attn, vh.dense_blocks(self.attn_spec, kv, n), strict=True):
            np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))
        for name, spec, got in zip(self.names[1:], self.state_specs, states, strict=True):
            for a, b in zip(got, state_bits(spec, prompt[:-1], name), strict=True):
                np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))
        return n

    def assert_untouched_except(self, blocks: set[int], state_blocks: set[int]) -> None:
        """Blocks no read filled still hold zeros, in the attention cache and every state
        component (a consumer's model never writes here)."""
        others = np.asarray(sorted(set(range(NUM_BLOCKS)) - blocks), np.int32)
        for a in self.cache("0").gather_blocks(others):
            assert not np.asarray(a).view(np.uint8).any(), "an unread attention block changed"
        others = np.asarray(sorted(set(range(NUM_BLOCKS)) - state_blocks), np.int32)
        for name in self.names[1:]:
            for a in self.cache(name).gather_blocks(others):
                assert not np.asarray(a).view(np.uint8).any(), f"an unread {name} block changed"

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
        ws = self.worker.connector_worker
        assert not ws.reading and not ws.awaiting_send and not ws.freeable, "connector state"
        assert not ws.cancelled and not ws.releasing, "connector state"
        engine = self.worker.engine
        assert engine.num_pinned == 0 and engine.num_reading == 0, "engine state left"

    def expired_leases(self) -> int:
        engine = self.worker.engine
        return sum(engine.stats_of(g).expired_leases for g in engine.groups)

    def bytes_read(self) -> dict[str, int]:
        engine = self.worker.engine
        return {g: engine.stats_of(g).bytes_total for g in engine.groups}

    def close(self) -> None:
        self.worker.shutdown()
        self.scheduler.shutdown()


def make_request(prompt: list[int], params: dict | None, max_tokens: int = 8):
    return vh.request(prompt, BLOCK, params, max_tokens)


def producer_process(conn, extra: dict) -> None:
    """A hybrid producer `MambaSide` in its own process, serving commands from `conn`
    (`transfer_testing.serve_scheduler_side`); ("chunks",) -> tokens scheduled per step of
    each request it handed over."""
    import transfer_testing as tt

    tt.child_env(1)
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    side = MambaSide("kv_producer", extra)
    conn.send(("ready",))

    def state():
        try:
            side.assert_empty()
            leak = None
        except AssertionError as error:
            leak = str(error) or "leak"
        return (side.busy(), side.worker.engine.num_pinned, side.expired_leases(), leak,
                {r: side.chunks.get(r, []) for r in side.sent_params})

    # max_tokens 8: the producer caps a request at one output token itself (vLLM's N-1 rule)
    tt.serve_scheduler_side(conn, side, lambda p: make_request(p, {"do_remote_decode": True}),
                            state)


@pytest.fixture(scope="module")
def producer():
    import transfer_testing as tt

    remote = tt.RemoteProcess(producer_process, ({"engine_id": "prefill", "lease_s": 30.0},),
                              call_timeout_s=120.0)
    assert remote.ready == ("ready",)
    yield remote
    remote.close()


def prompts_of(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(10, 50000, size=n).tolist() for n in lengths]


def finish(consumer, producer, reqs, timeout_s=60.0):
    vh.run_until([consumer], lambda: all(r.request_id in consumer.outputs for r in reqs)
                 and not consumer.busy(), timeout_s)
    consumer.assert_empty()
    busy, pinned, expired, leak, chunks = producer.wait_idle(30.0)
    assert (busy, pinned, expired, leak) == (False, 0, 0, None)
    return chunks


@pytest.mark.parametrize("tp", [1, 2])  # decode TP 1 and 2 (state sharded by heads) from TP 1
def test_state_moves_with_attention_blocks_bit_exact(producer, tp):
    """vLLM's ``test_p_side_chunked_prefill_mamba``, end to end: prompts longer than a step
    (64 tokens) are prefilled in chunks of their first ``N - 1`` tokens and finish with one
    output token; the params carry the attention blocks and the one state block; the
    consumer reads both (every state component, sharded by heads at decode TP 2), loads
    ``N - 1`` tokens and computes the last prompt token itself. Unread blocks untouched."""
    consumer = MambaSide("kv_consumer", {"engine_id": "decode", "read_timeout_s": 20.0}, tp=tp)
    try:
        prompts = prompts_of([5, 17, 40, 130], seed=tp)
        params = producer.call("add", prompts)
        for p, prompt in zip(params, prompts):
            attn, state = p["remote_block_ids"]
            assert len(attn) == math.ceil((len(prompt) - 1) / BLOCK) and len(state) == 1
            assert p["remote_num_tokens"] == len(prompt) - 1
            assert [s and s["components"] for s in p["jaxkv_states"]] == [
                None, ["conv_x", "conv_b", "conv_c", "ssm"]]
        reqs = [make_request(p, dict(kv), 2) for p, kv in zip(prompts, params)]
        for r in reqs:
            consumer.add(r)
        chunks = finish(consumer, producer, reqs)
        # the producer: N - 1 tokens in chunks of at most a step (vLLM's chunked prefill)
        for p, kv in zip(prompts, params):
            steps = chunks[kv["remote_request_id"]]
            assert sum(steps) == len(p) - 1 and max(steps) <= STEP, steps
        assert len(chunks[params[-1]["remote_request_id"]]) >= 3  # 129 tokens: 3 chunks
        for r, p in zip(reqs, prompts):
            assert consumer.check_received(r, p) == math.ceil((len(p) - 1) / BLOCK)
            out = consumer.outputs[r.request_id]
            assert out.kv_transfer_params["jaxkv_load"]["status"] == "loaded"
            assert out.kv_transfer_params["jaxkv_load"]["remote_tokens"] == len(p) - 1
            assert out.new_token_ids and r.num_output_tokens == 2
            # the consumer's first step computes prompt token N only (N - 1 were read)
            assert consumer.chunks[r.request_id][0] == 1
        assert not consumer.failed and not consumer.group_errors
        read = consumer.read_blocks.values()
        consumer.assert_untouched_except({b for attn, _ in read for b in attn},
                                         {state for _, state in read})
        # each state component moved one block per request
        got = consumer.bytes_read()
        for name, spec in zip(consumer.names[1:], consumer.state_specs):
            assert got[name] == len(prompts) * spec.block_nbytes() * spec.num_arrays, name
        assert got["0"] == sum(math.ceil((len(p) - 1) / BLOCK) for p in prompts) * (
            consumer.attn_spec.block_nbytes() * consumer.attn_spec.num_arrays)
    finally:
        consumer.close()


def test_failed_state_read_invalidates_every_group(producer):
    """A request whose state block cannot be read (its id out of the producer's range): the
    attention read of the same request is stopped, the request is reported failed with its
    blocks of both groups, vLLM recomputes it; the other request reads both groups exactly."""
    consumer = MambaSide("kv_consumer", {"engine_id": "decode", "read_timeout_s": 10.0})
    try:
        prompts = prompts_of([30, 19], seed=5)
        params = producer.call("add", prompts)
        bad = dict(params[0])
        attn, _ = bad["remote_block_ids"]
        bad["remote_block_ids"] = [attn, [NUM_BLOCKS + 7]]
        reqs = [make_request(p, dict(kv), 2) for p, kv in zip(prompts, [bad, params[1]])]
        for r in reqs:
            consumer.add(r)
        vh.run_until([consumer], lambda: all(r.request_id in consumer.outputs for r in reqs)
                     and not consumer.busy(), 60.0)
        consumer.assert_empty()
        assert consumer.failed == {reqs[0].request_id}
        assert {g: len(ids) for g, ids in consumer.group_errors.items()} == {
            ATTN: math.ceil(29 / BLOCK), MAMBA: 1}
        assert consumer.outputs[reqs[0].request_id].kv_transfer_params["jaxkv_load"][
            "status"] == "failed"
        assert reqs[0].request_id not in consumer.received
        consumer.check_received(reqs[1], prompts[1])
        # the failed request's producer blocks are released by lease or release: none pinned
        vh.run_until([consumer], lambda: producer.call("state")[1] == 0, 40.0)
    finally:
        consumer.close()


def test_async_loads_with_speculative_state_blocks_both_read():
    """vLLM's ``test_async_load_does_not_double_reserve_mamba_spec_blocks`` with real reads:
    with 3 speculative tokens vLLM appends 3 scratch blocks to each request's Mamba blocks;
    two loads are admitted together, the connector reads only the running-state block of
    each (not the scratch ones), both requests run."""
    producer = MambaSide("kv_producer", {"engine_id": "prefill", "lease_s": 20.0},
                         spec_blocks=3)
    consumer = MambaSide("kv_consumer", {"engine_id": "decode", "read_timeout_s": 20.0},
                         spec_blocks=3)
    try:
        prompts = prompts_of([64, 48], seed=9)
        reqs = [make_request(p, {"do_remote_decode": True}) for p in prompts]
        for r in reqs:
            producer.add(r)
        vh.run_until([producer], lambda: all(r.request_id in producer.sent_params for r in reqs))
        params = [producer.sent_params[r.request_id] for r in reqs]
        assert all(len(p["remote_block_ids"][MAMBA]) == 1 for p in params)
        creqs = [make_request(p, dict(kv), 1) for p, kv in zip(prompts, params)]
        for r in creqs:
            consumer.add(r)
        vh.run_until([producer, consumer],
                     lambda: all(r.request_id in consumer.outputs for r in creqs)
                     and not producer.busy() and not consumer.busy(), 60.0)
        producer.assert_empty()
        consumer.assert_empty()
        for r, p in zip(creqs, prompts):
            consumer.check_received(r, p)
        for name, spec in zip(consumer.names[1:], consumer.state_specs):
            assert consumer.bytes_read()[name] == 2 * spec.block_nbytes() * spec.num_arrays
        assert producer.expired_leases() == 0
    finally:
        consumer.close()
        producer.close()


def test_state_caches_are_checked_against_the_mamba_spec():
    """A Mamba group takes one cache per state component, each of its component's spec; the
    error names the component and what was expected."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from jaxkv.integrations.vllm import JaxKVConnector

    config = hybrid_config("kv_consumer", {"engine_id": "d"})
    kv_config = kv_cache_config(config, NUM_BLOCKS)
    names = [g.layer_names for g in kv_config.kv_cache_groups]
    worker = JaxKVConnector(config, KVConnectorRole.WORKER, kv_config)
    try:
        attn = PagedKVCache.allocate(KVCacheSpec(num_layers=2, block_size=BLOCK, **ATTN_LAYER),
                                     NUM_BLOCKS)
        specs = [c.spec(2) for c in worker.groups.state_of(MAMBA)]
        states = [PagedKVCache.allocate(s, NUM_BLOCKS) for s in specs]
        with pytest.raises(TypeError, match=r"one jaxkv.PagedKVCache per state component"):
            worker.register_kv_caches({names[0][0]: attn, names[1][0]: tuple(states[:3])})
        wrong = states[:3] + [PagedKVCache.allocate(specs[3].replace(head_dim=16), NUM_BLOCKS)]
        with pytest.raises(ValueError, match=r"state component 'ssm' of KV cache group 1"):
            worker.register_kv_caches({names[0][0]: attn, names[1][0]: tuple(wrong)})
        worker.register_kv_caches([attn, tuple(states)])
        assert list(worker.engine.groups) == ["0", "1_conv_x", "1_conv_b", "1_conv_c", "1_ssm"]
    finally:
        worker.shutdown()
