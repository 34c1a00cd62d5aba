"""The demo's engines: a prefill process, a decode process, and a colocated reference.

* Prefill (a spawned process with its own TP, layout and block size): computes each prompt
  (reusing cached prefix blocks of its `KVCacheManager`), samples the first token, publishes
  the request's blocks with `TransferEngine.publish_request` and hands the
  `TransferParams` to the router (this process) over a pipe; frees blocks when the transfer
  layer says so.
* Decode (this process): allocates blocks with its own `KVCacheManager` (a local prefix hit
  means only the missing blocks are read), pulls them with `start_read` / `poll` (the transfer
  layer permutes / merges them into the local layout), then decodes greedily in a batch.
* Colocated reference: one engine with the decode engine's TP, layout and block size computes
  prompts and decodes with the same code: its tokens and prompt KV bytes are what the
  disaggregated run must reproduce.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import multiprocessing
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from jaxkv.demo._router import Router

__all__ = [
    "DemoSettings",
    "RequestResult",
    "make_prompts",
    "run_colocated",
    "run_disaggregated",
]

MIN_PREFILL_CHUNK = 64
"""Prefill chunks are padded to a power of two of at least this many tokens, so that a run
compiles few step shapes. (Numerics do not need it: the model's KV does not depend on the
chunk width, `jaxkv.demo._model`.)"""


POLL_INTERVAL_S = 0.002
"""Default sleep between two polls of a transfer engine while a process waits."""


@dataclasses.dataclass(frozen=True)
class DemoSettings:
    """Everything a demo run depends on (the CLI flags).

    Example:
      >>> DemoSettings(prompt_len=100, max_new_tokens=8).max_len   # a multiple of 64
      128
    """

    prefill_tp: int = 2
    decode_tp: int = 1
    prefill_layout: str = "KHTD"
    decode_layout: str = "THD"
    prefill_block_size: int = 8
    decode_block_size: int = 16
    dtype: str = "bfloat16"
    num_requests: int = 8
    prompt_len: int = 96
    max_new_tokens: int = 16
    shared_prefix_len: int = 64
    decode_batch: int = 8
    seed: int = 0
    num_layers: int = 4
    d_model: int = 256
    num_heads: int = 8
    num_kv_heads: int = 4
    head_dim: int = 32
    vocab_size: int = 512
    backend: str = "cpu"
    request_interval_s: float = 0.0
    kill_prefill_after: int = 0
    read_timeout_s: float = 20.0
    poll_during_steps: bool = True
    nixl_progress_thread: bool = False
    lease_s: float = 30.0
    timeout_s: float = 300.0  # the serving phase's deadline after the last arrival
    prefill_processes: int = 1
    auth_key_file: str | None = None  # the deployment key both engines prove (None: none)
    # layer-pipelined transfer: the prefill process publishes each request before computing
    # it and announces every layer from inside the step as it is written; the decode
    # process reads the layers while the later ones are computed
    layerwise: bool = False
    # one request of each pair layer-pipelined, the other whole, the order alternating from
    # pair to pair (req-1, req-2, req-5, req-6, ...): both modes in one run, same processes
    # and load (TTFT reported per mode)
    layerwise_ab: bool = False
    transport: str = "nixl"  # "nixl" or "jax" (jax.experimental.transfer)
    host_staging: bool = False  # NIXL through host mirrors of both caches
    # the sleep between two polls of a transfer engine while a process waits (a step, a
    # message, a read): shorter answers sooner, but every poll costs CPU the steps of both
    # processes share on a small host
    poll_interval_s: float = POLL_INTERVAL_S
    # the prefill process on the first half of this process's CPUs, the decode process on
    # the rest (as on two machines: neither side's work takes CPU from the other's steps)
    pin_cpus: bool = False
    # before the timed requests, throwaway requests go through both engines, one per transfer
    # mode the run uses (and again with a prefix hit if prompts share one): the first read of
    # a geometry compiles the producer's and the consumer's formatting programs (the JAX
    # transport: ~250 ms layer-wise, 1.2-1.4 s whole, measured in the demo), which a serving
    # deployment pays at start-up, not in a TTFT (the demo's own decode loop; not with
    # serve_with="vllm-scheduler")
    warm_up_reads: bool = True

    def __post_init__(self) -> None:
        if self.prompt_len < 1 or self.max_new_tokens < 1 or self.num_requests < 1:
            raise ValueError("prompt_len, max_new_tokens and num_requests must be >= 1")
        if not 0 <= self.shared_prefix_len <= self.prompt_len:
            raise ValueError("shared_prefix_len must be between 0 and prompt_len")
        if self.decode_block_size % self.prefill_block_size:
            raise ValueError(
                "the transfer layer merges prefill blocks into decode blocks: decode_block_size "
                f"({self.decode_block_size}) must be a multiple of prefill_block_size "
                f"({self.prefill_block_size})"
            )
        for name in ("prefill_tp", "decode_tp"):
            tp = getattr(self, name)
            if tp < 1 or self.num_kv_heads % tp:
                raise ValueError(f"{name}={tp} must divide num_kv_heads={self.num_kv_heads}")
        if self.backend not in ("cpu", "auto"):
            raise ValueError(f"backend must be 'cpu' or 'auto', got {self.backend!r}")
        if self.decode_batch < 1:
            raise ValueError("decode_batch must be >= 1")
        if not 0 < self.poll_interval_s <= 1:
            raise ValueError(f"poll_interval_s must be in (0, 1], got {self.poll_interval_s}")
        if self.prefill_processes < 1 or self.prefill_tp % self.prefill_processes:
            raise ValueError(
                f"prefill_processes={self.prefill_processes} must divide "
                f"prefill_tp={self.prefill_tp} (each process holds prefill_tp / "
                "prefill_processes devices of the prefill engine's mesh)"
            )
        if self.prefill_processes > 1 and self.backend != "cpu":
            raise ValueError("prefill_processes > 1 runs on CPU devices only (backend='cpu')")
        if self.transport not in ("nixl", "jax"):
            raise ValueError(f"transport must be 'nixl' or 'jax', got {self.transport!r}")
        if self.host_staging and self.transport != "nixl":
            raise ValueError("host_staging stages NIXL reads through host mirrors: it needs "
                             "transport='nixl'")
        if self.pin_cpus and self.prefill_processes > 1:
            raise ValueError("pin_cpus runs with a one-process prefill engine "
                             "(prefill_processes=1)")
        if self.layerwise and self.layerwise_ab:
            raise ValueError("layerwise pipelines every request, layerwise_ab every other "
                             "one: pick one")
        if (self.layerwise or self.layerwise_ab or self.transport != "nixl"
                or self.host_staging) and self.prefill_processes > 1:
            raise ValueError("layerwise, transport='jax' and host_staging run with a "
                             "one-process prefill engine (prefill_processes=1)")

    @property
    def step_poll_interval_s(self) -> float:
        """The interval of a process's transfer polls while its own model step computes
        (`STEP_POLL_INTERVAL_S`, or `poll_interval_s` where longer)."""
        return max(self.poll_interval_s, STEP_POLL_INTERVAL_S)

    def layer_pipelined(self, request_id: str) -> bool:
        """Whether request `request_id` (``req-<i>``) is transferred layer by layer: every
        request with `layerwise`, never a replay; with `layerwise_ab` one request of each
        pair (``req-0``/``req-1``, ``req-2``/``req-3``, ...), the second in even pairs and
        the first in odd ones (whole, layer-wise, layer-wise, whole, ...: an ABBA order, so
        that neither mode always runs first in its pair).

        Example:
          >>> ab = DemoSettings(layerwise_ab=True)
          >>> [ab.layer_pipelined(f"req-{i}") for i in range(4)]
          [False, True, True, False]
        """
        if request_id.startswith("replay-"):
            return False
        if self.layerwise_ab:
            index = int(request_id.rsplit("-", 1)[1])
            return (index % 2) != (index // 2) % 2
        return self.layerwise

    def model(self):
        from jaxkv.demo._model import ModelConfig

        return ModelConfig(
            vocab_size=self.vocab_size, d_model=self.d_model, num_layers=self.num_layers,
            num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            ffn_dim=2 * self.d_model, seed=self.seed,
        )

    @property
    def max_len(self) -> int:
        """Sequence capacity, the same for every engine (it fixes the attention length)."""
        unit = math.lcm(self.prefill_block_size, self.decode_block_size, MIN_PREFILL_CHUNK)
        return -(-(self.prompt_len + self.max_new_tokens) // unit) * unit

    def blocks_for(self, block_size: int, tokens: int) -> int:
        return self.num_requests * -(-tokens // block_size) + 2


@dataclasses.dataclass
class RequestResult:
    """What happened to one request in the disaggregated run (times in seconds)."""

    request_id: str
    status: str = "pending"  # "done" or "failed"
    error: str = ""
    tokens: list[int] = dataclasses.field(default_factory=list)
    prefill_hit_tokens: int = 0
    decode_hit_tokens: int = 0
    blocks_read: int = 0
    bytes: int = 0
    descriptors: int = 0  # as planned (a strided row counts once)
    nixl_descriptors: int = 0  # as posted to NIXL (strided rows expanded)
    queue_s: float = 0.0
    prefill_s: float = 0.0
    handshake_s: float = 0.0
    transfer_s: float = 0.0  # start_read -> READs complete -> producer confirmed
    read_s: float = 0.0  # start_read -> READs complete
    post_s: float = 0.0
    ttft_s: float = 0.0
    total_s: float = 0.0
    tokens_match: bool | None = None
    kv_match: bool | None = None


def make_prompts(settings: DemoSettings) -> list[list[int]]:
    """Deterministic prompts: a common prefix of ``shared_prefix_len`` tokens, then random
    tokens per request.

    Example:
      >>> p = make_prompts(DemoSettings(num_requests=2, prompt_len=8, shared_prefix_len=4))
      >>> p[0][:4] == p[1][:4], len(p[1])
      (True, 8)
    """
    rng = np.random.default_rng(settings.seed + 1)
    prefix = rng.integers(0, settings.vocab_size, settings.shared_prefix_len).tolist()
    rest = settings.prompt_len - settings.shared_prefix_len
    return [
        prefix + rng.integers(0, settings.vocab_size, rest).tolist()
        for _ in range(settings.num_requests)
    ]


STEP_TIMEOUT_S = 120.0
"""Deadline of one model step while the caller polls its transfer engine meanwhile."""

STEP_POLL_INTERVAL_S = 0.02
"""The shortest interval between two polls of a transfer engine while the process's own model
step computes (`wait_ready`; `--poll_interval_ms` where longer). The engines' background
threads move the transfers meanwhile (`_transport_options`), so such a poll only picks up what
needs the caller (JAX work, blocks to free); on a core the step shares each one takes CPU from
it: at 2 ms a 2048-token prefill's ~3900 polls cost its 8.5 s step ~450 ms (the wake-ups and
220-300 ms inside `poll`, measured per thread). The step's end is seen at once regardless."""


def wait_ready(arrays, idle: Callable[[], Any] | None, timeout_s: float = STEP_TIMEOUT_S,
               interval_s: float = POLL_INTERVAL_S) -> None:
    """Waits until every JAX array in `arrays` is ready, calling `idle` (e.g. a transfer
    engine's poll) first and then every `interval_s` meanwhile: JAX dispatches a step
    asynchronously, so this process keeps serving or receiving transfers while it computes.
    Returns as soon as the arrays are ready, not at the next interval (a helper thread
    blocks on them). Without `idle`, a plain block.

    Raises:
      TimeoutError: not ready within `timeout_s` seconds.
      Exception: what blocking on an array raised (a failed step).

    Example:
      >>> import jax.numpy as jnp
      >>> calls = []
      >>> wait_ready([jnp.ones(3) * 2], lambda: calls.append(1))
      >>> len(calls) >= 1
      True
    """
    if idle is None:
        for a in arrays:
            a.block_until_ready()
        return
    done = threading.Event()
    failures: list[BaseException] = []

    def block() -> None:
        try:
            for a in arrays:
                a.block_until_ready()
        except BaseException as error:  # noqa: BLE001 - re-raised by the waiting thread
            failures.append(error)
        finally:
            done.set()

    threading.Thread(target=block, name="jaxkv-demo-step-wait", daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while True:
        idle()
        if done.wait(interval_s):
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"a model step did not finish within {timeout_s:.0f}s")
    if failures:
        raise failures[0]


def _chunk(n: int) -> int:
    return max(MIN_PREFILL_CHUNK, 1 << (n - 1).bit_length())


def _devices(settings: DemoSettings, count: int) -> list:
    import jax

    devices = jax.devices() if settings.backend == "auto" else jax.devices("cpu")
    if len(devices) < count:
        raise RuntimeError(
            f"TP={count} needs {count} devices, {len(devices)} visible ({devices[0].platform}); "
            "on CPU set XLA_FLAGS=--xla_force_host_platform_device_count before JAX starts"
        )
    return devices[:count]


class _Engine:
    """A model runner plus its block manager: prefill and decode steps with paged KV."""

    def __init__(self, settings: DemoSettings, layout: str, block_size: int, devices, tokens: int):
        from jaxkv.blocks import KVCacheManager
        from jaxkv.demo._model import ModelRunner, make_mesh

        self.settings = settings
        model = settings.model()
        spec = model.kv_spec(block_size, layout, settings.dtype)
        num_blocks = settings.blocks_for(block_size, tokens)
        self.runner = ModelRunner(model, spec, make_mesh(devices), num_blocks, settings.max_len)
        self.manager = KVCacheManager(num_blocks, block_size)
        self.slots: list[str | None] = [None] * settings.decode_batch
        self.state: dict[str, dict[str, Any]] = {}

    def prefill(
        self, request_id: str, prompt: list[int], idle: Callable[[], Any] | None = None
    ) -> tuple[int, int]:
        """Computes the prompt past its cached prefix; returns (first token, hit tokens).
        `idle` is called repeatedly while the step computes (see `wait_ready`)."""
        tokens, positions, table, n, start = self.plan_prefill(request_id, prompt)
        return self.run_prefill(tokens, positions, table, n, idle), start

    def plan_prefill(
        self, request_id: str, prompt: list[int]
    ) -> tuple[np.ndarray, np.ndarray, list[int], int, int]:
        """The scheduler's half of `prefill` (block manager only, no device work): the step's
        ``(tokens, positions, block table, new tokens, hit tokens)``."""
        m = self.manager
        m.add_request(request_id, prompt)
        hit = m.get_computed_blocks(request_id)
        start = hit.num_computed_tokens
        if m.allocate_slots(request_id, len(prompt) - start, hit) is None:
            raise RuntimeError(f"prefill: no free blocks for {request_id}")
        n = len(prompt) - start
        width = _chunk(n)
        tokens = np.zeros((1, width), np.int32)
        positions = np.full((1, width), -1, np.int32)
        tokens[0, :n] = prompt[start:]
        positions[0, :n] = np.arange(start, len(prompt))
        table = [int(b) for b in m.get_block_ids(request_id)[0]]
        return tokens, positions, table, n, start

    def run_prefill(
        self, tokens, positions, table, n: int, idle: Callable[[], Any] | None = None
    ) -> int:
        """The device half of `prefill`: runs the step; returns the first sampled token."""
        next_tokens, _ = self.runner.dispatch(tokens, positions, [table])
        wait_ready([next_tokens, *self.runner.cache.arrays], idle,
                   interval_s=self.settings.step_poll_interval_s)
        return int(np.asarray(next_tokens)[0, n - 1])

    def prefill_widths(self) -> list[int]:
        """The prefill chunk sizes the run will use."""
        s = self.settings
        return sorted({_chunk(s.prompt_len), _chunk(max(1, s.prompt_len - s.shared_prefix_len))})

    def warm_up(self) -> None:
        """Compiles the prefill chunk sizes the run will use (padding only: writes nothing)."""
        for width in self.prefill_widths():
            self.runner.run(np.zeros((1, width), np.int32), np.full((1, width), -1, np.int32), [[]])

    def warm_up_announced(self, transfer) -> None:
        """Compiles the layer-announcing prefill step for `transfer` (``--layerwise``) at
        every prefill chunk size and runs it once each, as `warm_up` runs the plain step: on
        padding (writes nothing), announcing a request of no blocks that no consumer reads
        (aborted after). Its first run cost the first layer-wise request ~300 ms more than
        later ones (measured in the demo)."""
        for width in self.prefill_widths():
            self.runner.compile_announced(transfer, (1, width))
            rid = f"warm-up-{width}"
            transfer.publish_request(rid, [], layerwise=True)
            try:
                next_tokens, _ = self.runner.dispatch_announced(
                    np.zeros((1, width), np.int32), np.full((1, width), -1, np.int32), [[]],
                    transfer, transfer.handle(rid), [])
                wait_ready([next_tokens, *self.runner.cache.arrays], None)
                transfer.update_cache(self.runner.cache)
            finally:
                transfer.abort_request(rid)
                transfer.poll()

    def warm_up_decode(self) -> None:
        b = self.settings.decode_batch
        self.runner.run(np.zeros((b, 1), np.int32), np.full((b, 1), -1, np.int32), [[]] * b)

    # -- decode batch -------------------------------------------------------------------------

    def free_slots(self) -> int:
        return sum(s is None for s in self.slots)

    def admit(self, request_id: str, prompt_len: int, first_token: int) -> None:
        slot = self.slots.index(None)
        self.slots[slot] = request_id
        self.state[request_id] = {"prompt_len": prompt_len, "tokens": [first_token]}

    def decode_step(self, idle: Callable[[], Any] | None = None) -> list[str]:
        """One greedy step of every occupied slot; returns the requests that finished (their
        slots are free again, their blocks still allocated). `idle` is called repeatedly
        while the step computes (see `wait_ready`)."""
        b = len(self.slots)
        tokens = np.zeros((b, 1), np.int32)
        positions = np.full((b, 1), -1, np.int32)
        tables: list = [[]] * b
        finished = []
        for i, rid in enumerate(self.slots):
            if rid is None:
                continue
            st = self.state[rid]
            last = st["tokens"][-1]
            self.manager.append_tokens(rid, [last])
            if self.manager.allocate_slots(rid, 1) is None:
                raise RuntimeError(f"decode: no free blocks for {rid}")
            tokens[i, 0] = last
            positions[i, 0] = st["prompt_len"] + len(st["tokens"]) - 1
            tables[i] = self.manager.get_block_ids(rid)[0]
        if all(s is None for s in self.slots):
            return []
        next_tokens, _ = self.runner.dispatch(tokens, positions, tables)
        wait_ready([next_tokens, *self.runner.cache.arrays], idle,
                   interval_s=self.settings.step_poll_interval_s)
        host_tokens = np.asarray(next_tokens)
        for i, rid in enumerate(self.slots):
            if rid is None:
                continue
            st = self.state[rid]
            st["tokens"].append(int(host_tokens[i, 0]))
            if len(st["tokens"]) >= self.settings.max_new_tokens:
                finished.append(rid)
                self.slots[i] = None
        return finished

    def finish_ready(self) -> list[str]:
        """Requests whose only token came from prefill (``max_new_tokens == 1``)."""
        done = []
        for i, rid in enumerate(self.slots):
            if rid is not None and len(self.state[rid]["tokens"]) >= self.settings.max_new_tokens:
                done.append(rid)
                self.slots[i] = None
        return done

    def prompt_kv(self, request_id: str) -> np.ndarray:
        st = self.state[request_id]
        return self.runner.prompt_kv(self.manager.get_block_ids(request_id)[0], st["prompt_len"])


def run_colocated(settings: DemoSettings, devices=None) -> dict[str, dict[str, Any]]:
    """The reference: one engine (decode TP, layout and block size) prefills and decodes.

    Args:
      settings: the run.
      devices: the decode devices (default: the first ``decode_tp`` devices).

    Returns:
      request id -> {"tokens": greedy tokens (the first from prefill), "kv": prompt K/V
      ``[L, 2, H, prompt_len, D]``, "prefill_hit_tokens": prefix-cache hit}.

    Example:
      >>> ref = run_colocated(DemoSettings(num_requests=1, prompt_len=8, max_new_tokens=2,
      ...                                  shared_prefix_len=0, decode_tp=1, num_layers=1))
      >>> len(ref["req-0"]["tokens"])
      2
    """
    devices = devices or _devices(settings, settings.decode_tp)
    engine = _Engine(
        settings, settings.decode_layout, settings.decode_block_size, devices, settings.max_len
    )
    prompts = make_prompts(settings)
    out: dict[str, dict[str, Any]] = {}
    pending = [(f"req-{i}", p) for i, p in enumerate(prompts)]
    active = 0
    while pending or active:
        while pending and engine.free_slots():
            rid, prompt = pending.pop(0)
            first, hit = engine.prefill(rid, prompt)
            engine.admit(rid, len(prompt), first)
            out[rid] = {"prefill_hit_tokens": hit}
            active += 1
        for rid in engine.finish_ready() + engine.decode_step():
            out[rid]["tokens"] = list(engine.state[rid]["tokens"])
            out[rid]["kv"] = engine.prompt_kv(rid)
            engine.manager.free(rid)
            active -= 1
    return out


# -- the prefill process -----------------------------------------------------------------------


def cpu_halves() -> tuple[list[int], list[int]] | None:
    """The CPUs this process may run on, split in two halves (prefill, decode) for
    `DemoSettings.pin_cpus`; None with fewer than 2 CPUs (or no affinity API)."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None
    return cpus[: len(cpus) // 2], cpus[len(cpus) // 2:]


def pin_process(cpus: list[int]) -> None:
    """Restricts every thread of this process (and the threads they start) to `cpus`
    (affinity is per thread on Linux: JAX's threads may already run)."""
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):  # the thread ended meanwhile
            os.sched_setaffinity(int(tid), cpus)


def ucx_transports(backend: str) -> str:
    """The demo engines' UCX transports (``UCX_TLS`` unless set): shared memory and TCP
    between its processes on one host, and with ``backend="auto"`` (caches on GPUs where JAX
    sees them) UCX's CUDA transports too, without which UCX cannot move GPU memory.

    Example:
      >>> ucx_transports("cpu"), ucx_transports("auto")
      ('tcp,sm,self', 'tcp,sm,self,cuda_copy,cuda_ipc')
    """
    return "tcp,sm,self" if backend == "cpu" else "tcp,sm,self,cuda_copy,cuda_ipc"


def _child_env(settings: DemoSettings, num_devices: int) -> None:
    flags = os.environ.get("XLA_FLAGS", "")
    flags = " ".join(f for f in flags.split() if "xla_force_host_platform_device_count" not in f)
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={num_devices}"
    os.environ.setdefault("UCX_TLS", ucx_transports(settings.backend))
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    if settings.backend == "cpu":
        os.environ["JAX_PLATFORMS"] = "cpu"


def _agent_options(settings: DemoSettings):
    from jaxkv.transfer._agent import AgentOptions

    return AgentOptions(progress_thread=settings.nixl_progress_thread)


PROGRESS_IDLE_S = 0.1
"""The transfer engines' longest background-progress interval while nothing happens
(`TransferEngine`'s ``progress_idle_s``). The demo's steps are CPU-bound on the cores its
transfers share, and its peers are on one host: their READs (shared memory, or the JAX
transfer server's own threads) need no progress from the producer, whose control messages
are handled as they arrive and whose step callbacks progress it. A 10 ms cap (the default)
woke the producer's thread ~850 times in an 8 s prefill step (~40-120 ms of that step's
core, measured per thread)."""


def _transport_options(settings: DemoSettings) -> dict[str, Any]:
    """The `TransferEngine` arguments of the transport flags (both engines); their
    background progress polls at the demo's poll interval while something happens and backs
    off to `PROGRESS_IDLE_S` (each poll costs CPU the steps share)."""
    cadence = {"progress_interval_s": settings.poll_interval_s,
               "progress_idle_s": max(settings.poll_interval_s, PROGRESS_IDLE_S)}
    if settings.transport == "jax":
        return {"transport": "jax", **cadence}
    return {"transport": "nixl", "agent_options": _agent_options(settings),
            "host_staging": settings.host_staging, **cadence}


def _prefill_layerwise(engine: _Engine, transfer, conn, rid: str, prompt: list[int],
                       start: float, idle: Callable[[], Any] | None) -> tuple[int, int]:
    """Prefill with layer-pipelined transfer: publishes the request (``layerwise=True``) and
    hands its params to the router (``("started", id, params, hit tokens, start)``) before
    computing, then runs the one-program step that announces each layer from inside itself
    (`publish_layer_in_jit`) as soon as its KV is written, the engine polled while it runs.
    Returns (first token, hit tokens)."""
    tokens, positions, table, n, hit = engine.plan_prefill(rid, prompt)
    ids = engine.manager.get_block_ids(rid)[0]
    params = transfer.publish_request(rid, ids, layerwise=True)
    conn.send(("started", rid, params, hit, start))
    next_tokens, _ = engine.runner.dispatch_announced(tokens, positions, [table], transfer,
                                                      transfer.handle(rid), ids)
    wait_ready([next_tokens, *engine.runner.cache.arrays], idle,
               interval_s=engine.settings.step_poll_interval_s)
    transfer.update_cache(engine.runner.cache)
    return int(np.asarray(next_tokens)[0, n - 1]), hit


def _auth_key(settings: DemoSettings) -> bytes | None:
    """The deployment key of both engines (`auth_key_file`; None: the environment's, if
    any: `jaxkv.transfer.load_auth_key`)."""
    from jaxkv.transfer import load_auth_key

    return load_auth_key(path=settings.auth_key_file)


def prefill_main(conn, settings_kwargs: dict) -> None:
    """The prefill process (spawned): serves ``("request", id, prompt, arrival)`` and
    ``("exit",)`` from `conn`; answers ``("ready", address)`` once compiled, then
    ``("published", id, params, first_token, hit_tokens, start, end)`` per request (monotonic
    clock), or ``("error", id, message)``."""
    settings = DemoSettings(**settings_kwargs)
    halves = cpu_halves() if settings.pin_cpus else None
    if halves is not None:  # (inherited from the parent before it pinned itself)
        pin_process(halves[0])
    # Over the JAX transport a TP > 1 prefill engine gets one host device more than its
    # mesh: the transfer engine formats and offers the layers a step announces there while
    # the step still holds the mesh's devices (`JaxTransport.reads_step_memory`).
    extra = settings.transport == "jax" and settings.prefill_tp > 1 and settings.backend == "cpu"
    _child_env(settings, settings.prefill_tp + int(extra))
    from jaxkv._parallel import EngineConfig
    from jaxkv.transfer import TransferEngine

    engine = _Engine(
        settings,
        settings.prefill_layout,
        settings.prefill_block_size,
        _devices(settings, settings.prefill_tp),
        settings.prompt_len,
    )
    engine.warm_up()
    config = EngineConfig(engine.runner.spec, settings.prefill_tp)
    queue: list[tuple[str, list[int]]] = []
    with TransferEngine(
        "prefill", config, lease_s=settings.lease_s,
        block_hashing=engine.manager.hash_identity, auth_key=_auth_key(settings),
        **_transport_options(settings),
    ) as transfer:
        transfer.register_cache(engine.runner.cache)
        if settings.layerwise or settings.layerwise_ab:
            engine.warm_up_announced(transfer)

        def serve_transfers() -> None:
            # Serves the decode side's READs and confirmations (UCX over TCP without a
            # progress thread moves data only while someone polls) and frees the blocks of
            # confirmed requests; called between requests and while a prefill step computes.
            for rid in transfer.poll().freeable:
                engine.manager.free(rid)

        conn.send(("ready", transfer.address))
        while True:
            if conn.poll(0 if queue else settings.poll_interval_s):  # idle: serve transfers
                command = conn.recv()
                if command[0] == "exit":
                    break
                queue.append((command[1], command[2]))
            if queue:
                rid, prompt = queue.pop(0)
                start = time.monotonic()
                idle = serve_transfers if settings.poll_during_steps else None
                try:
                    if settings.layer_pipelined(rid):
                        first, hit = _prefill_layerwise(engine, transfer, conn, rid, prompt,
                                                        start, idle)
                        params = None  # handed over with "started"
                    else:
                        first, hit = engine.prefill(rid, prompt, idle)
                        engine.runner.cache.block_until_ready()
                        transfer.update_cache(engine.runner.cache)  # raises if a buffer moved
                        params = transfer.publish_request(rid,
                                                          engine.manager.get_block_ids(rid)[0])
                except Exception as error:  # noqa: BLE001 - reported to the router
                    conn.send(("error", rid, f"{type(error).__name__}: {error}"))
                    continue
                conn.send(("published", rid, params, first, hit, start, time.monotonic()))
            serve_transfers()


def prefill_mc_main(conn, settings_kwargs: dict, process_id: int, port: int) -> None:
    """One process of a multi-process prefill engine (spawned when ``prefill_processes > 1``):
    one JAX program over the processes (``jax.distributed``, gloo collectives on CPU), each
    holding ``prefill_tp / prefill_processes`` devices of the engine's mesh. Process 0 runs
    the scheduler (block manager) and talks to the router over `conn` as `prefill_main` does;
    it broadcasts each step's inputs to the others (`StepChannel`); every process runs the
    step, and every process publishes its shards (`TransferEngine` with a `JaxDistributed`
    coordinator). The other processes get ``conn=None``."""
    settings = DemoSettings(**settings_kwargs)
    count = settings.prefill_processes
    _child_env(settings, settings.prefill_tp // count)
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=count, process_id=process_id)
    from jaxkv._parallel import EngineConfig
    from jaxkv.transfer import JaxDistributed, StepChannel, TransferEngine

    engine = _Engine(
        settings,
        settings.prefill_layout,
        settings.prefill_block_size,
        _devices(settings, settings.prefill_tp),  # the global mesh: every process's devices
        settings.prompt_len,
    )
    engine.warm_up()
    config = EngineConfig(engine.runner.spec, settings.prefill_tp)
    channel = StepChannel("jaxkv-demo-prefill", timeout_s=settings.timeout_s)
    with TransferEngine(
        "prefill", config, agent_options=_agent_options(settings), lease_s=settings.lease_s,
        block_hashing=engine.manager.hash_identity, auth_key=_auth_key(settings),
        coordinator=JaxDistributed(timeout_s=settings.timeout_s),
    ) as transfer:
        transfer.register_cache(engine.runner.cache)  # this process's shards
        transfer.publish_metadata()  # a collective: every process
        if process_id == 0:
            _prefill_scheduler(conn, settings, engine, transfer, channel)
        else:
            _prefill_follower(settings, engine, transfer, channel)


def _prefill_scheduler(conn, settings, engine, transfer, channel) -> None:
    """Process 0 of a multi-process prefill engine: `prefill_main`'s loop, with each step's
    inputs broadcast and each request published by every process."""
    queue: list[tuple[str, list[int]]] = []

    def serve_transfers() -> None:
        for rid in transfer.poll().freeable:  # freed by every process
            engine.manager.free(rid)

    conn.send(("ready", transfer.address))
    while True:
        if conn.poll(0 if queue else settings.poll_interval_s):
            command = conn.recv()
            if command[0] == "exit":
                channel.broadcast(("exit",))
                break
            queue.append((command[1], command[2]))
        if queue:
            rid, prompt = queue.pop(0)
            start = time.monotonic()
            try:
                tokens, positions, table, n, hit = engine.plan_prefill(rid, prompt)
            except Exception as error:  # noqa: BLE001 - reported to the router
                conn.send(("error", rid, f"{type(error).__name__}: {error}"))
                continue
            block_ids = list(engine.manager.get_block_ids(rid)[0])
            channel.broadcast(("prefill", rid, tokens, positions, table, n, block_ids))
            try:
                first = engine.run_prefill(
                    tokens, positions, table, n,
                    serve_transfers if settings.poll_during_steps else None,
                )
                transfer.update_cache(engine.runner.cache)  # raises if a buffer moved
                params = transfer.publish_request(rid, block_ids)  # once every process pinned it
            except Exception as error:  # noqa: BLE001 - reported to the router
                conn.send(("error", rid, f"{type(error).__name__}: {error}"))
                continue
            conn.send(("published", rid, params, first, hit, start, time.monotonic()))
        serve_transfers()


def _prefill_follower(settings, engine, transfer, channel) -> None:
    """Another process of a multi-process prefill engine: runs the steps process 0
    broadcasts and publishes its shards of each request."""
    while True:
        try:
            step = channel.broadcast(None, timeout_s=0)
        except TimeoutError:
            transfer.poll()  # applies aborts, reports this process's freed parts to process 0
            time.sleep(settings.poll_interval_s)
            continue
        if step[0] == "exit":
            break
        _, rid, tokens, positions, table, n, block_ids = step
        engine.run_prefill(
            tokens, positions, list(table), n, transfer.poll if settings.poll_during_steps else None
        )
        transfer.update_cache(engine.runner.cache)
        with contextlib.suppress(Exception):  # a failure is reported to process 0 (aborted)
            transfer.publish_request(rid, block_ids)
        transfer.poll()


class _ProcessGroup:
    """The prefill engine's processes, seen by the router as one (alive while all are)."""

    def __init__(self, processes: list):
        self.processes = processes

    def is_alive(self) -> bool:
        return all(p.is_alive() for p in self.processes)

    @property
    def exitcode(self) -> int | None:
        codes = [p.exitcode for p in self.processes if p.exitcode is not None]
        return codes[0] if codes else None

    def kill(self) -> None:
        for p in self.processes:
            p.kill()

    def join(self, timeout: float | None = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        for p in self.processes:
            p.join(None if deadline is None else max(0.0, deadline - time.monotonic()))


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _start_prefill(ctx, settings: DemoSettings):
    """Spawns the prefill engine's process(es); returns (router pipe end, process group)."""
    parent, child = ctx.Pipe()
    if settings.prefill_processes == 1:
        process = ctx.Process(
            target=prefill_main, args=(child, dataclasses.asdict(settings)), daemon=True
        )
        process.start()
        child.close()
        return parent, process
    port = _free_port()
    processes = []
    for pid in range(settings.prefill_processes):
        process = ctx.Process(
            target=prefill_mc_main,
            args=(child if pid == 0 else None, dataclasses.asdict(settings), pid, port),
            daemon=True,
        )
        process.start()
        processes.append(process)
    child.close()
    return parent, _ProcessGroup(processes)


def await_prefill_ready(parent, process, timeout_s: float) -> Any:
    """Waits for the prefill side's ``("ready", address)``; returns its address.

    Raises:
      RuntimeError: it did not start in time, exited, or said something else.
    """
    if not parent.poll(max(1.0, timeout_s)):
        raise RuntimeError("the prefill process did not start in time")
    try:
        message = parent.recv()
    except EOFError:
        process.join(timeout=10)
        raise RuntimeError(
            f"the prefill process exited during start-up (code {process.exitcode})"
        ) from None
    if message[0] != "ready":
        raise RuntimeError(f"prefill process: unexpected {message!r}")
    return message[1]


def stop_prefill(parent, process) -> None:
    """Asks the prefill side to exit, kills it if it does not, closes the pipe."""
    with contextlib.suppress(OSError, BrokenPipeError):
        parent.send(("exit",))
    process.join(timeout=10)
    if process.is_alive():
        process.kill()
        process.join(timeout=5)
    parent.close()


# -- the decode process ------------------------------------------------------------------------


def run_disaggregated(
    settings: DemoSettings,
    reference: dict[str, dict[str, Any]] | None = None,
    devices=None,
    progress: Callable[[list[RequestResult]], None] | None = None,
) -> dict[str, Any]:
    """Runs the prefill process and this (decode) process; compares with `reference`.

    Args:
      settings: the run.
      reference: `run_colocated`'s result; computed here (while the prefill process starts)
        when None.
      devices: the decode devices (default: the first ``decode_tp`` devices).
      progress: called with the results after every change.

    Returns:
      The report dict (see `jaxkv.demo._report.build_report`).

    Raises:
      RuntimeError: the prefill process did not start in time.
    """
    from jaxkv._parallel import EngineConfig
    from jaxkv.transfer import TransferEngine

    t_begin = time.monotonic()
    ctx = multiprocessing.get_context("spawn")
    halves = cpu_halves() if settings.pin_cpus else None
    parent, process = _start_prefill(ctx, settings)  # (pins itself to the first half)
    if halves is not None:
        pin_process(halves[1])
    results = {f"req-{i}": RequestResult(f"req-{i}") for i in range(settings.num_requests)}
    timings: dict[str, float] = {}
    transfer = None
    try:
        devices = devices or _devices(settings, settings.decode_tp)
        t0 = time.monotonic()
        if reference is None:
            reference = run_colocated(settings, devices)
        timings["colocated_s"] = time.monotonic() - t0
        engine = _Engine(
            settings, settings.decode_layout, settings.decode_block_size, devices,
            settings.max_len,
        )
        engine.warm_up_decode()
        config = EngineConfig(engine.runner.spec, settings.decode_tp)
        transfer = TransferEngine(
            "decode", config, read_timeout_s=settings.read_timeout_s, lease_s=settings.lease_s,
            block_hashing=engine.manager.hash_identity, auth_key=_auth_key(settings),
            **_transport_options(settings),
        )
        transfer.register_cache(engine.runner.cache)
        timings["decode_ready_s"] = time.monotonic() - t_begin
        await_prefill_ready(parent, process, settings.timeout_s)
        timings["prefill_ready_s"] = time.monotonic() - t_begin
        if settings.warm_up_reads:
            t0 = time.monotonic()
            warm_up_reads(settings, parent, process, engine, transfer)
            timings["warm_up_s"] = time.monotonic() - t0
        prompts = make_prompts(settings)
        t_serve = time.monotonic()
        side = _DemoDecode(settings, engine, transfer)
        Router(settings, parent, process, prompts, results, reference, progress,
               t_serve).run(side)
        timings["serve_s"] = time.monotonic() - t_serve
        alone = None
        if process.is_alive() and settings.prefill_processes == 1:
            sample = _sample_read(results, side.samples)
            if sample is not None:
                alone = _engine_reads(transfer, parent, process,
                                      prompts[int(sample["request_id"].split("-")[1])],
                                      sample["local_ids"])
        stats = transfer.stats.summary()
    finally:
        stop_prefill(parent, process)
        if transfer is not None:
            transfer.close()
    timings["total_s"] = time.monotonic() - t_begin
    from jaxkv.demo._report import build_report

    return build_report(settings, list(results.values()), reference, alone, stats, timings)


def warm_up_prompts(settings: DemoSettings) -> list[list[list[int]]]:
    """The throwaway prompts of `warm_up_reads`, in rounds: one prompt per transfer mode the
    run uses (whole and layer-wise with ``layerwise_ab``) of ``prompt_len`` tokens, none
    sharing the run's prompts' prefix (no timed request gets a prefix-cache hit from them);
    with a ``shared_prefix_len``, a second round whose prompts share that much of the first
    round's, so that the reads of a prefix hit (fewer blocks, other programs) are warm too.

    Example:
      >>> rounds = warm_up_prompts(DemoSettings(prompt_len=8, shared_prefix_len=4,
      ...                                       layerwise_ab=True))
      >>> [len(r) for r in rounds], rounds[1][0][:4] == rounds[0][0][:4]
      ([2, 2], True)
    """
    rng = np.random.default_rng(settings.seed + 7919)
    count = 2 if settings.layerwise_ab else 1
    first = [rng.integers(0, settings.vocab_size, settings.prompt_len).tolist()
             for _ in range(count)]
    if not settings.shared_prefix_len:
        return [first]
    rest = settings.prompt_len - settings.shared_prefix_len
    return [first, [p[:settings.shared_prefix_len] + rng.integers(0, settings.vocab_size,
                                                                  rest).tolist()
                    for p in first]]


def warm_up_reads(settings: DemoSettings, conn, process, engine: _Engine, transfer) -> None:
    """Serves `warm_up_prompts` through both engines before the timed requests, round after
    round (as ``warmup-<i>``: with ``layerwise_ab`` one of each pair layer-pipelined), with a
    decode side of its own: prefill, transfer, decode.

    Raises:
      RuntimeError: a warm-up request failed (its error is named).
    """
    from jaxkv.demo._router import Router

    rounds = warm_up_prompts(settings)
    prompts = [p for prompts in rounds for p in prompts]
    warm = dataclasses.replace(settings, request_interval_s=0.0, kill_prefill_after=0)
    served = 0
    for count in (len(r) for r in rounds):
        ids = [f"warmup-{served + i}" for i in range(count)]
        results = {rid: RequestResult(rid) for rid in ids}
        Router(warm, conn, process, prompts, results, {}, None, time.monotonic()).run(
            _DemoDecode(warm, engine, transfer))
        failed = [f"{r.request_id}: {r.error}" for r in results.values() if r.status != "done"]
        if failed:
            raise RuntimeError("warm-up request failed: " + "; ".join(failed))
        served += count


def _warm_post_processing(engine, transfer, peer_meta, params, local_ids) -> None:
    """Runs the post-processing a read of `params` into `local_ids` will need, on padding ids
    only (nothing moves): compiles it ahead of the first read."""
    from jaxkv.transfer._plan import plan_read
    from jaxkv.transfer._post import apply_post_processing

    ids = np.asarray(list(local_ids), np.int64)
    if not len(ids) or peer_meta is None:
        return
    steps = []
    for rank in transfer.local_ranks:
        plan = plan_read(transfer.metadata, rank, peer_meta, ids, params.block_ids, check=False)
        steps += [dataclasses.replace(step, block_ids=np.full(len(step.block_ids), -1, np.int64))
                  for step in plan.post]
    if steps:
        cache = apply_post_processing(engine.runner.cache, steps)
        engine.runner.cache = cache
        transfer.update_cache(cache)


def _engine_reads(transfer, conn, process, prompt: list[int], local_ids: list[int],
                  repeats: int = 5, timeout_s: float = 30.0) -> dict[str, Any] | None:
    """The engine alone, without the decode loop's cadence: the prefill process publishes
    `prompt` again (a prefix-cache hit there) `repeats` times, and each time this process
    reads it into `local_ids` (the same bytes again) while polling the engine back to back.

    Returns:
      ``{"landed_ms", "confirmed_ms"}`` medians of the engine's own records of the reads
      (posted -> READs seen complete by its progress, -> the producer's confirmation),
      ``"repeats"``, and the last read's ``"bytes"`` and ``"descriptors"`` (as posted to
      NIXL); None if a publish or read failed.
    """
    landed, confirmed = [], []
    nbytes = descriptors = 0
    for k in range(repeats):
        rid = f"replay-{k}"
        conn.send(("request", rid, prompt))
        deadline = time.monotonic() + timeout_s
        message = None
        while message is None and time.monotonic() < deadline and process.is_alive():
            transfer.poll()
            if conn.poll(0.001):
                received = conn.recv()
                if received[1] == rid:
                    message = received
        if message is None or message[0] != "published":
            return None
        params = message[2]
        transfer.start_read(params, list(local_ids), read_id=rid)
        while True:
            result = transfer.poll()
            if rid in result.finished:
                break
            if any(f.request_id == rid for f in result.failed) or time.monotonic() > deadline:
                return None
        record = next(x for x in reversed(transfer.stats.records) if x.request_id == rid)
        landed.append(record.duration_s)
        confirmed.append(record.duration_s + record.confirm_s)
        nbytes, descriptors = record.bytes, record.expanded_descriptors
    return {"landed_ms": round(float(np.median(landed)) * 1e3, 3),
            "confirmed_ms": round(float(np.median(confirmed)) * 1e3, 3),
            "repeats": repeats, "bytes": nbytes, "descriptors": descriptors}


def _sample_read(results: dict[str, RequestResult], samples: dict[str, dict[str, Any]]):
    """The read the engine-alone measurement replays: the first completed request with the
    most bytes (the size `jaxkv.demo._report` summarises)."""
    done = [r for r in results.values()
            if r.status == "done" and r.bytes and r.request_id in samples]
    if not done:
        return None
    best = max(done, key=lambda r: (r.bytes, -int(r.request_id.split("-")[1])))
    return samples[best.request_id]


class _DemoDecode:
    """The decode side of the demo's own serving mode (a `jaxkv.demo._router.DecodeSide`):
    admits published requests into its `KVCacheManager` (a local prefix hit means only the
    missing blocks are read), reads their blocks with the transfer engine, decodes them in
    batches and hands finished ones back to the router.

    Attributes:
      peer_meta: the prefill engine's metadata (None until the handshake).
      samples: request id -> ``{"request_id", "remote_ids", "local_ids"}`` of each read.
      finished_reads: reads that completed.
    """

    def __init__(self, settings: DemoSettings, engine: _Engine, transfer) -> None:
        self.settings, self.engine, self.transfer = settings, engine, transfer
        self.reading: dict[str, dict[str, Any]] = {}
        self.ready: list[tuple[str, int]] = []  # (request id, first token) whose KV arrived
        self.landed: dict[str, float] = {}  # layer-wise: KV arrived, first token not yet
        self.samples: dict[str, dict[str, Any]] = {}
        self.finished_reads = 0
        self.peer_meta: Any = None
        self._peer_known = False
        self._post_warm = False

    def release(self, request_id: str) -> None:
        if self.reading.pop(request_id, None) is not None:
            self.transfer.abort_request(request_id)  # e.g. its layer-wise prefill failed
        self.landed.pop(request_id, None)
        with contextlib.suppress(Exception):  # it may hold no blocks yet
            self.engine.manager.free(request_id)

    def first_token(self, router, rid: str, first: int) -> None:
        """A layer-wise request's first token (known once its prefill ended): the request
        joins the decode batch once its KV arrived too."""
        info = self.reading.get(rid)
        if info is not None:
            info["first"] = first  # the read is still in flight
            return
        landed = self.landed.pop(rid, None)
        if landed is not None:
            r = router.results[rid]
            r.ttft_s = time.monotonic() - router.arrival[rid]
            self.ready.append((rid, first))

    def admit(self, router, rid: str, params, first: int | None) -> None:
        engine, transfer = self.engine, self.transfer
        r = router.results[rid]
        if not self._peer_known:
            t = time.monotonic()
            try:
                self.peer_meta = transfer.add_peer(params.engine_id, params.addresses)
            except Exception as error:  # noqa: BLE001 - fails this request
                router.fail(rid, f"handshake: {type(error).__name__}: {error}")
                return
            r.handshake_s = time.monotonic() - t
            self._peer_known = True
        m = engine.manager
        prompt = router.prompt(rid)
        m.add_request(rid, prompt)
        local_hit = m.get_computed_blocks(rid, max_hit_tokens=len(prompt))
        alloc = m.allocate_slots(
            rid, len(prompt) - local_hit.num_computed_tokens, local_hit, delay_caching=True
        )
        if alloc is None:
            router.fail(rid, "decode: no free blocks")
            return
        r.decode_hit_tokens = local_hit.num_computed_tokens
        r.blocks_read = len(alloc.new_block_ids[0])
        warm_s = 0.0
        if not self._post_warm:
            # Compiles the post-processing (permute / merge) now, before the first read is
            # posted, rather than inside a `poll` while other reads are in flight (the loop
            # cannot observe their completion meanwhile). Counted in this request's post
            # column.
            self._post_warm, t = True, time.monotonic()
            try:
                _warm_post_processing(engine, transfer, self.peer_meta, params,
                                      alloc.new_block_ids[0])
            except Exception as error:  # noqa: BLE001 - fails this request
                router.fail(rid, f"post-processing warm-up: {type(error).__name__}: {error}")
                return
            warm_s = time.monotonic() - t
        self.reading[rid] = {"first": first, "start": time.monotonic(), "warm_s": warm_s}
        self.samples[rid] = {"request_id": rid, "remote_ids": list(params.block_ids),
                             "local_ids": list(alloc.new_block_ids[0])}
        transfer.start_read(params, list(alloc.new_block_ids[0]))

    def advance(self, router) -> None:
        engine, transfer, results = self.engine, self.transfer, router.results
        poll = transfer.poll()
        for failed in poll.failed:
            self.reading.pop(failed.request_id, None)
            router.fail(failed.request_id, f"transfer: {failed.reason}")
        for rid in poll.finished:
            info = self.reading.pop(rid)
            self.finished_reads += 1
            r = results[rid]
            now = time.monotonic()
            record = next(
                (x for x in reversed(transfer.stats.records) if x.request_id == rid), None
            )
            if record is not None:  # the engine's own measurement of the read
                r.bytes, r.descriptors = record.bytes, record.descriptors
                r.nixl_descriptors = record.expanded_descriptors
                r.transfer_s = record.duration_s + record.confirm_s
                r.read_s, r.post_s = record.duration_s, record.post_s + info["warm_s"]
            else:
                r.transfer_s = now - info["start"]
            engine.manager.cache_blocks(rid)
            if info["first"] is None:  # layer-wise: the prefill has not ended yet
                self.landed[rid] = now
                continue
            r.ttft_s = now - router.arrival[rid]
            self.ready.append((rid, info["first"]))
        if poll.failed or poll.finished:
            router.report()
        while self.ready and engine.free_slots():
            rid, first = self.ready.pop(0)
            engine.admit(rid, len(router.prompt(rid)), first)
        done = engine.finish_ready()
        if any(s is not None for s in engine.slots):
            # While the step computes only the NIXL agent is progressed (READ data lands,
            # notifications are kept): a full `poll` could post-process a finished read on
            # the cache the step has consumed (donated); that waits for the next poll.
            done += engine.decode_step(
                transfer.progress if self.settings.poll_during_steps else None
            )
            transfer.update_cache(engine.runner.cache)  # raises if the step moved a buffer
        for rid in done:
            r = router.finish(rid, list(engine.state[rid]["tokens"]),
                              functools.partial(engine.prompt_kv, rid))
            r.status = "done"
            engine.manager.free(rid)
        if done:
            router.report()
        if not done and not any(s is not None for s in engine.slots):
            time.sleep(self.settings.poll_interval_s)
