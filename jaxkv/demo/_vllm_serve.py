"""`--serve_with=vllm-scheduler`: the demo's prompts scheduled by vLLM's own `Scheduler` on
both sides, with `jaxkv.integrations.vllm.JaxKVConnector` moving the KV.

* Prefill (a spawned process): a vLLM scheduler in the ``kv_producer`` role admits each prompt
  with ``do_remote_decode``, runs the demo model on what it schedules (prefix hits come from
  vLLM's prefix cache), samples one token and returns the request's ``kv_transfer_params``
  from `request_finished`; the connector's worker pins the blocks and frees them once the
  decode side confirmed.
* Decode (this process): a vLLM scheduler in the ``kv_consumer`` role admits the prompt with
  those params; the connector reports the remote tokens, reads them asynchronously (the
  transfer layer permutes / merges them into the local layout), vLLM re-computes the last
  prompt token to sample from and decodes greedily.

The model runner here is the demo's: vLLM decides which tokens of which request run in a step
and where their KV goes (its block tables); the runner computes them. Tokens and prompt KV
bytes are compared with the colocated run, as in the default serving mode.

Needs vLLM (`scripts/setup_integrations.sh` builds an environment with it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import multiprocessing
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from jaxkv.demo._engines import (
    DemoSettings,
    RequestResult,
    _child_env,
    _chunk,
    _devices,
    await_prefill_ready,
    make_prompts,
    run_colocated,
    stop_prefill,
    wait_ready,
)
from jaxkv.demo._router import Router

__all__ = ["run_with_vllm_scheduler"]

_CONNECTOR_MODULE = "jaxkv.integrations.vllm"
_POLL_S = 0.0005


def _vllm_env() -> None:
    """vLLM's CPU platform, and the offline Hugging Face cache the integration environment
    carries (vLLM's config needs a model's config.json; no weights are loaded)."""
    hf_home = os.path.join(sys.prefix, "hf-home")
    if os.path.isdir(hf_home):
        os.environ.setdefault("HF_HOME", hf_home)
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


def _check_vllm() -> None:
    try:
        import vllm  # noqa: F401
    except ImportError as error:
        raise RuntimeError(
            "--serve_with=vllm-scheduler needs vLLM installed (scripts/setup_integrations.sh "
            f"builds an environment with it): {error}"
        ) from error


class _VllmEngine:
    """One side: a vLLM `Scheduler` with the jaxkv connector, and the demo model runner
    computing what it schedules.

    Args:
      settings: the run.
      role: ``"kv_producer"`` or ``"kv_consumer"``.
      layout, block_size, devices: the side's cache layout, block size and TP devices.
      engine_id: the connector's engine id.
    """

    def __init__(self, settings: DemoSettings, role: str, layout: str, block_size: int,
                 devices: list, engine_id: str):
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

        from jaxkv.demo._model import ModelRunner, make_mesh
        from jaxkv.integrations.vllm import JaxKVConnector

        self.settings, self.role, self.block_size = settings, role, block_size
        model = settings.model()
        spec = model.kv_spec(block_size, layout, settings.dtype)
        tokens = settings.prompt_len if role == "kv_producer" else settings.max_len
        self.num_blocks = settings.blocks_for(block_size, tokens)
        self.runner = ModelRunner(model, spec, make_mesh(devices), self.num_blocks,
                                  settings.max_len)
        extra: dict[str, Any] = {
            "engine_id": engine_id, "tp_size": len(devices), "lease_s": settings.lease_s,
            "read_timeout_s": settings.read_timeout_s,
        }
        self.worker = JaxKVConnector(self._config(extra), KVConnectorRole.WORKER)
        self.worker.register_kv_caches({"jaxkv": self.runner.cache})
        if role == "kv_producer":
            extra["side_channel"] = [list(self.worker.address)]
        self.config = self._config(extra)
        self.scheduler = self._scheduler()
        self.hit_tokens: dict[str, int] = {}  # request -> prefix tokens vLLM found cached
        self.block_ids: dict[str, list[int]] = {}  # request -> its blocks at its last step
        self.failed: dict[str, str] = {}  # consumer request -> why its load failed

    def _config(self, extra: dict[str, Any]):
        from vllm.config import (
            CacheConfig,
            DeviceConfig,
            KVTransferConfig,
            ModelConfig,
            SchedulerConfig,
            VllmConfig,
        )

        s = self.settings
        batch = s.decode_batch if self.role == "kv_consumer" else max(s.num_requests, 1)
        scheduler = SchedulerConfig(
            max_num_seqs=batch,
            max_num_batched_tokens=max(s.prompt_len, 256) * 4,
            max_model_len=s.max_len,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
        )
        cache = CacheConfig(block_size=self.block_size, cache_dtype="auto",
                            enable_prefix_caching=True)
        cache.num_gpu_blocks = self.num_blocks
        transfer = KVTransferConfig(
            kv_connector="JaxKVConnector",
            kv_connector_module_path=_CONNECTOR_MODULE,
            kv_role=self.role,
            kv_connector_extra_config=dict(extra),
            kv_load_failure_policy="recompute",
        )
        return VllmConfig(
            scheduler_config=scheduler,
            # vLLM's config needs a model; only its name and limits are used (no weights).
            model_config=ModelConfig(model="facebook/opt-125m", dtype="float16", seed=0,
                                     max_model_len=s.max_len),
            cache_config=cache,
            kv_transfer_config=transfer,
            device_config=DeviceConfig("cpu"),
        )

    def _scheduler(self):
        import torch
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.structured_output import StructuredOutputManager

        # The scheduler counts blocks; the tensors are jaxkv's, so the spec's sizes are moot.
        kv_cache_config = KVCacheConfig(
            num_blocks=self.num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(
                ["model"], FullAttentionSpec(block_size=self.block_size, num_kv_heads=1,
                                             head_size=1, dtype=torch.float32),
            )],
        )
        return Scheduler(
            vllm_config=self.config,
            kv_cache_config=kv_cache_config,
            log_stats=True,
            structured_output_manager=StructuredOutputManager(self.config),
            block_size=self.block_size,
        )

    def add(self, request_id: str, prompt: list[int], params: dict[str, Any],
            max_tokens: int) -> None:
        from vllm import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.request import Request

        init_none_hash(sha256)
        request = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt),
            sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                           ignore_eos=True),
            pooling_params=None,
            block_hasher=get_request_block_hasher(self.block_size, sha256),
        )
        request.kv_transfer_params = params
        self.scheduler.add_request(request)

    def busy(self) -> bool:
        s = self.scheduler
        return bool(s.requests or s.finished_req_ids or s.finished_recving_kv_req_ids)

    def step(self) -> list[Any]:
        """One scheduler step: schedule, run the model on the scheduled tokens, hand the
        outputs (sampled tokens, the connector's transfer results) back. Returns vLLM's
        `EngineCoreOutput`s of this step."""
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        out = self.scheduler.schedule()
        if self.role == "kv_producer":
            for new in out.scheduled_new_reqs:
                self.hit_tokens.setdefault(new.req_id, new.num_computed_tokens)
        else:  # the local prefix hit the connector's read leaves out
            for recv in getattr(out.kv_connector_metadata, "to_recv", ()):
                self.hit_tokens[recv.request_id] = recv.num_local_hit_blocks * self.block_size
        worker = self.worker
        worker.bind_connector_metadata(out.kv_connector_metadata)
        worker.start_load_kv(None)
        sampled = self._forward(out.num_scheduled_tokens) if out.num_scheduled_tokens else {}
        worker.wait_for_save()
        results = worker.get_transfer_results(out.finished_req_ids)
        invalid = worker.get_block_ids_with_load_errors()
        worker.clear_connector_metadata()
        failed = set(results.failed_recving) & set(results.finished_recving)
        for request_id in failed:
            self.failed[request_id] = "the KV read failed"
        req_ids = list(out.num_scheduled_tokens)
        runner_output = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[sampled.get(r, []) for r in req_ids],
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=None,
            kv_connector_output=KVConnectorOutput(
                finished_sending=set(results.finished_sending) or None,
                finished_recving=set(results.finished_recving) or None,
                failed_recving=failed,
                invalid_block_ids=invalid,
                kv_connector_stats=None,
            ),
        )
        outputs = []
        for engine_outputs in self.scheduler.update_from_output(out, runner_output).values():
            outputs.extend(engine_outputs.outputs)
        return outputs

    def _forward(self, scheduled: dict[str, int]) -> dict[str, list[int]]:
        """Runs the model on this step's tokens; returns each request's sampled token (none
        for a partial prefill). Prompt tokens run as a prefill chunk of their request (padded
        like the colocated run's, so their KV and logits are bit-identical to it); generated
        tokens run in decode batches of ``decode_batch`` rows."""
        runner = self.runner
        runner.cache = self.worker.cache  # reads may have rewritten it (post-processing)
        manager = self.scheduler.kv_cache_manager
        sampled: dict[str, list[int]] = {}
        pending = []  # (request, sampled index or None, next tokens array)
        decode_rows = []
        for request_id, n in scheduled.items():
            request = self.scheduler.requests[request_id]
            start = request.num_computed_tokens - n  # schedule() counted this step's tokens
            table = list(manager.get_block_ids(request_id)[0])
            self.block_ids[request_id] = table
            tokens = request.all_token_ids[start:start + n]
            samples = start + n >= request.num_prompt_tokens
            if start >= request.num_prompt_tokens and n == 1:
                decode_rows.append((request_id, tokens[0], start, table))
                continue
            width = _chunk(n)
            batch = np.zeros((1, width), np.int32)
            positions = np.full((1, width), -1, np.int32)
            batch[0, :n] = tokens
            positions[0, :n] = np.arange(start, start + n)
            next_tokens, _ = runner.dispatch(batch, positions, [table])
            pending.append((request_id, n - 1 if samples else None, next_tokens, 0))
        b = self.settings.decode_batch
        for first in range(0, len(decode_rows), b):
            rows = decode_rows[first:first + b]
            batch = np.zeros((b, 1), np.int32)
            positions = np.full((b, 1), -1, np.int32)
            tables: list = [[]] * b
            for i, (_, token, position, table) in enumerate(rows):
                batch[i, 0], positions[i, 0], tables[i] = token, position, table
            next_tokens, _ = runner.dispatch(batch, positions, tables)
            pending.extend((rid, 0, next_tokens, i) for i, (rid, *_rest) in enumerate(rows))
        if pending:
            wait_ready([pending[-1][2], *runner.cache.arrays], None)
        self.worker.update_cache(runner.cache)  # raises if the step moved a buffer
        for request_id, index, next_tokens, row in pending:
            if index is not None:
                sampled[request_id] = [int(np.asarray(next_tokens)[row, index])]
        return sampled

    def prompt_kv(self, request_id: str, prompt_len: int) -> np.ndarray:
        return self.runner.prompt_kv(self.block_ids[request_id], prompt_len)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.worker.shutdown()
        with contextlib.suppress(Exception):
            self.scheduler.shutdown()


def vllm_prefill_main(conn, settings_kwargs: dict) -> None:
    """The prefill process (spawned): serves ``("request", id, prompt)`` and ``("exit",)``;
    answers ``("ready", address)``, then ``("published", id, kv_transfer_params,
    first_token, hit_tokens, start, end)`` per request."""
    settings = DemoSettings(**settings_kwargs)
    _child_env(settings, settings.prefill_tp)
    _vllm_env()
    engine = _VllmEngine(settings, "kv_producer", settings.prefill_layout,
                         settings.prefill_block_size, _devices(settings, settings.prefill_tp),
                         "prefill")
    started: dict[str, float] = {}
    try:
        conn.send(("ready", engine.worker.address))
        while True:
            while conn.poll(0 if engine.busy() else _POLL_S):
                command = conn.recv()
                if command[0] == "exit":
                    return
                _, rid, prompt = command
                started[rid] = time.monotonic()
                engine.add(rid, prompt, {"do_remote_decode": True}, 1)
            if not engine.busy():
                continue
            for output in engine.step():
                if output.finish_reason is None:
                    continue
                rid = output.request_id
                if not output.kv_transfer_params:
                    conn.send(("error", rid, "vLLM finished the request without transfer "
                                             "params"))
                    continue
                conn.send(("published", rid, output.kv_transfer_params,
                           int(output.new_token_ids[-1]), engine.hit_tokens.get(rid, 0),
                           started.pop(rid, time.monotonic()), time.monotonic()))
    finally:
        engine.close()


def run_with_vllm_scheduler(
    settings: DemoSettings,
    reference: dict[str, dict[str, Any]] | None = None,
    devices=None,
    progress: Callable[[list[RequestResult]], None] | None = None,
) -> dict[str, Any]:
    """Serves the demo's prompts with vLLM's schedulers on both sides and the jaxkv connector.

    Args:
      settings: the run (``kill_prefill_after`` and ``request_interval_s`` apply as in
        `run_disaggregated`).
      reference: `run_colocated`'s result; computed here when None.
      devices: the decode devices (default: the first ``decode_tp`` devices).
      progress: called with the results after every change.

    Returns:
      The report dict (`jaxkv.demo._report.build_report`), with ``"serve_with":
      "vllm-scheduler"``.

    Raises:
      RuntimeError: vLLM is not installed, or the prefill process did not start.
      ValueError: ``prefill_processes`` other than 1.
    """
    _check_vllm()
    if settings.prefill_processes != 1:
        raise ValueError("--serve_with=vllm-scheduler runs a one-process prefill engine "
                         f"(prefill_processes={settings.prefill_processes})")
    _vllm_env()
    t_begin = time.monotonic()
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    process = ctx.Process(target=vllm_prefill_main, args=(child, dataclasses.asdict(settings)),
                          daemon=True)
    process.start()
    child.close()
    results = {f"req-{i}": RequestResult(f"req-{i}") for i in range(settings.num_requests)}
    timings: dict[str, float] = {}
    engine = None
    stats: dict[str, Any] = {}
    try:
        devices = devices or _devices(settings, settings.decode_tp)
        t0 = time.monotonic()
        if reference is None:
            reference = run_colocated(settings, devices)
        timings["colocated_s"] = time.monotonic() - t0
        engine = _VllmEngine(settings, "kv_consumer", settings.decode_layout,
                             settings.decode_block_size, devices, "decode")
        timings["decode_ready_s"] = time.monotonic() - t_begin
        await_prefill_ready(parent, process, settings.timeout_s)
        timings["prefill_ready_s"] = time.monotonic() - t_begin
        t_serve = time.monotonic()
        Router(settings, parent, process, make_prompts(settings), results, reference, progress,
               t_serve).run(_VllmDecode(settings, engine))
        timings["serve_s"] = time.monotonic() - t_serve
        stats = engine.worker.engine.stats.summary() if engine.worker.engine else {}
    finally:
        stop_prefill(parent, process)
        if engine is not None:
            engine.close()
    timings["total_s"] = time.monotonic() - t_begin
    from jaxkv.demo._report import build_report

    report = build_report(settings, list(results.values()), reference, None, stats, timings)
    report["serve_with"] = "vllm-scheduler"
    return report


def _record_read(engine: _VllmEngine, r: RequestResult, admitted_s: float) -> None:
    """Copies the transfer engine's record of the request's read into its result."""
    transfer = engine.worker.engine
    record = None if transfer is None else next(
        (x for x in reversed(transfer.stats.records) if x.request_id == r.request_id), None
    )
    if record is None:  # nothing was read (a full local hit) or the read failed
        r.transfer_s = admitted_s
        return
    r.bytes, r.descriptors = record.bytes, record.descriptors
    r.nixl_descriptors = record.expanded_descriptors
    r.transfer_s = record.duration_s + record.confirm_s
    r.read_s, r.post_s = record.duration_s, record.post_s


class _VllmDecode:
    """The decode side of ``--serve_with=vllm-scheduler`` (a
    `jaxkv.demo._router.DecodeSide`): admits published requests into vLLM's consumer
    scheduler with their ``kv_transfer_params``, steps it, and hands finished requests back
    to the router."""

    def __init__(self, settings: DemoSettings, engine: _VllmEngine) -> None:
        self.settings, self.engine = settings, engine
        self.generated: dict[str, list[int]] = {}
        self.admitted: dict[str, float] = {}
        self.finished_reads = 0

    def release(self, request_id: str) -> None:
        """Nothing to free: vLLM's scheduler owns the request's blocks."""

    def first_token(self, router, rid: str, first: int) -> None:
        """Never called: layer-pipelined prefill runs with the demo's own decode side."""
        raise NotImplementedError("--layerwise runs with --serve_with=jaxkv")

    def admit(self, router, rid: str, params, first: int | None) -> None:
        del first  # vLLM re-computes the last prompt token to sample from
        self.admitted[rid] = time.monotonic()
        self.engine.add(rid, router.prompt(rid), params, self.settings.max_new_tokens)

    def advance(self, router) -> None:
        engine, generated = self.engine, self.generated
        if not engine.busy():
            time.sleep(_POLL_S)
            return
        changed = False
        for output in engine.step():
            rid = output.request_id
            r = router.results[rid]
            if output.new_token_ids:
                if not generated.get(rid):
                    r.ttft_s = time.monotonic() - router.arrival[rid]
                    self.finished_reads += 1
                    _record_read(engine, r, time.monotonic() - self.admitted[rid])
                generated.setdefault(rid, []).extend(int(t) for t in output.new_token_ids)
            if output.finish_reason is None:
                continue
            changed = True
            prompt = router.prompt(rid)
            r = router.finish(rid, generated.get(rid, []),
                              functools.partial(engine.prompt_kv, rid, len(prompt)))
            r.decode_hit_tokens = engine.hit_tokens.get(rid, 0)
            if r.bytes:
                size = engine.block_size
                r.blocks_read = -(-len(prompt) // size) - r.decode_hit_tokens // size
            if rid in engine.failed:
                r.error = engine.failed[rid]  # vLLM recomputed the prompt locally
            r.status = "done" if len(r.tokens) == self.settings.max_new_tokens else "failed"
            if r.status == "failed":
                r.error = r.error or f"vLLM finished it ({output.finish_reason}) after " \
                                     f"{len(r.tokens)} tokens"
        if changed:
            router.report()
