"""Benchmarks layer-pipelined transfer from inside a jitted prefill step (issue 30), NIXL with
the cache registered directly, NIXL with host staging (``host_staging=True``, the only NIXL
path on TPU) and the JAX transport (``transport="jax"``), side by side in one run.

A producer process runs a jitted prefill step of `--layers` slow layers over a prompt of
`--blocks` blocks: each layer computes its hidden states (`--matmuls` dense layers over
``[tokens, --width]``), projects them to the layer's K and V, writes them into the request's
blocks of the cache (LKHTD, bfloat16) and announces the layer with `publish_layer_in_jit`
(threading the next layer's input through the announcement). With host staging the
announcement's callback receives the layer's rows and writes them into the host mirror before
announcing it. The consumer, this process, reads each layer as it is announced (one engine per
mode, registered the same way as its producer).

The JAX transport takes each announced layer's rows too: the callback hands them to the
transport, whose worker thread formats (gathers and splits) each layer group with JAX ops and
offers it while the step computes the later layers (the consumer pulls each group, here one
4 MiB layer, as it is offered). ``jax_tp2``: the same over the JAX transport from a TP 2
producer (the cache's heads split over two XLA:CPU devices, one program per step, as the
demo's prefill; read by a TP 1 consumer): its step carries no rows, the transport's worker
gathers each announced layer from the cache's memory while the step runs and formats it on a
third host device. ``direct_tp2``: NIXL direct from that TP 2 producer (each device's shard of
the cache registered; the announcements' callbacks and their data dependences span both
devices). ``jax_loop`` is what a user of the JAX transport had before:
the same layers as a Python loop of one jitted call per layer, the producer calling
`update_cache`, `publish_layers` and `poll` after each.

Contenders, alternating round by round (the machine is shared):

* ``direct`` / ``staged`` / ``jax``: layer-wise, as above;
* ``direct_whole`` / ``staged_whole`` / ``jax_whole``: the same step announcing the request
  once, with `publish_in_jit` after the last layer (what a user without pipelining picks;
  staged, the copy to the mirror happens after the step, at `update_cache`; JAX, the request
  is formatted at the first poll after the step);
* ``direct_one_layer`` / ``staged_one_layer`` / ``jax_one_layer`` / ``jax_tp2_one_layer``:
  one layer's transfer alone, outside any step: the producer announces layer 0 with
  `publish_layers` (staged: after copying it to the mirror; JAX: formatted and offered at its
  next poll) while nothing computes; time from the announcement to its arrival (the consumer's
  `TransferRecord.layer_arrival`). This is "the wire time of one layer" of the targets;
* ``jax_loop``: the JAX transport's layer-wise loop (above).

Reported per contender (medians over rounds; wall clocks of both processes, one machine):
``first_pct`` (layer 0's arrival, % of the step from its dispatch to its end),
``last_after_end_ms`` (last layer's arrival after the step ended; negative: before),
``last_after_announced_ms`` (last layer's arrival after the producer announced it),
``finished_after_end_ms`` (the consumer's poll reported the read finished, confirmations and
staging to the device included), ``first_announced_pct`` (the producer's first announcement,
% of the step), ``step_ms``; ``last_vs_one_layer``: last_after_end over the same mode's
one-layer time (targets: first_pct < 60, last_vs_one_layer <= 1.2);
``step_cpu_ms`` / ``step_idle_ms`` (the producer's CPU time during the step, all threads, and
the step's wall time minus it: pinned to one core, a transfer's work inside the step adds to
the first, waits to the second) and ``step_thread_cpu_ms`` (that CPU time per thread name:
what the step's compute threads and the transfer's threads each took); and
``finished_sooner_than_whole_ms``: how much sooner after the step the layer-wise read finished
than the whole-request one; ``finished_after_start_vs_whole``: step start -> read finished,
layer-wise over whole (median of per-round ratios; < 1: layer-wise finishes sooner).

The producer runs on one CPU and the consumer on the others (``--pin_cpus=0``: anywhere), as
on two machines: otherwise the step's compute threads delay the consumer's polls.
``--platform=gpu`` puts both processes' caches and the step on the first GPU instead (TP 1
modes only; UCX then needs its CUDA transports, which ``UCX_TLS`` gets unless set; neither
process preallocates GPU memory); make the layers heavier there (``--width``, ``--matmuls``).

  python benchmarks/bench_layerwise.py --rounds=7 \\
      --json_out=benchmarks/results/layerwise_cpu_2026-11-26.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import statistics
import sys
import time

import numpy as np

MODES = ("direct", "staged", "jax", "jax_tp2", "direct_tp2")
PRODUCER_DEVICES = 3  # the TP 2 modes' mesh of two devices, and the host device jax_tp2 formats on
HEADS, HEAD_DIM, BLOCK = 8, 128, 16


def _spec_kwargs(layers: int) -> dict:
    return dict(num_layers=layers, num_kv_heads=HEADS, head_dim=HEAD_DIM, block_size=BLOCK,
                dtype="bfloat16", layout="LKHTD")


def _write(array, ids, layer: int, kv):
    """``array.at[ids, layer].set(kv)`` on the raw bits: XLA:CPU lowers a bfloat16 scatter as
    a convert of the whole cache to float32 and back (measured here: ~16 ms per layer on the
    34 MB cache, more once announcements keep XLA from merging the layers' converts), which
    would stand in for the step's compute."""
    import jax
    import jax.numpy as jnp

    bits = jax.lax.bitcast_convert_type(array, jnp.uint16).at[ids, layer].set(
        jax.lax.bitcast_convert_type(kv, jnp.uint16))
    return jax.lax.bitcast_convert_type(bits, jnp.bfloat16)


def _make_step(engine, layers: int, blocks: int, width: int, matmuls: int, whole: bool):
    """The jitted prefill step (see the module docstring)."""
    import functools

    import jax
    import jax.numpy as jnp

    from jaxkv.transfer import publish_in_jit, publish_layer_in_jit

    tokens = blocks * BLOCK
    key = jax.random.key(0)
    weights = jax.random.normal(key, (layers, matmuls, width, width), jnp.float32) / width**0.5
    project = jax.random.normal(key, (layers, width, 2 * HEADS * HEAD_DIM), jnp.float32)

    @functools.partial(jax.jit, donate_argnums=0)
    def prefill(cache, ids, handle, inputs):
        # the weights are arguments, not constants: large ones (a GPU's layers) would be
        # embedded into the program and slow its compilation to minutes
        x, weights, project = inputs
        statuses = []
        for layer in range(layers):
            h = x
            for m in range(matmuls):  # the layer's compute
                h = jnp.tanh(h @ weights[layer, m])
            kv = (h @ project[layer]).astype(jnp.bfloat16)  # [tokens, 2 * H * D]
            kv = kv.reshape(blocks, BLOCK, 2, HEADS, HEAD_DIM).transpose(0, 2, 3, 1, 4)
            (array,) = cache.arrays
            cache = jax.tree.unflatten(jax.tree.structure(cache), [_write(array, ids, layer, kv)])
            x = h
            if not whole:
                x, status = publish_layer_in_jit(engine, handle, ids, cache, layer + 1, x)
                statuses.append(status)
        if whole:
            statuses.append(publish_in_jit(engine, handle, ids, cache))
        return cache, jnp.stack(statuses), x.sum()

    return prefill, (jnp.ones((tokens, width), jnp.float32), weights, project)


def _make_loop(engine, layers: int, blocks: int, width: int, matmuls: int, whole: bool):
    """The same layers (weights, writes) as `_make_step`, as a Python loop of one jitted call
    per layer: layer-wise, each layer is handed to the engine (`update_cache`) and announced
    (`publish_layers`) and the engine polled (the JAX transport offers the layer's group
    there) before the next layer; whole: announced once after the last layer. Returns
    ``run(request_id, ids) -> (statuses, start, end)`` (wall times of the first dispatch and
    of the last announcement)."""
    import functools

    import jax
    import jax.numpy as jnp

    tokens = blocks * BLOCK
    key = jax.random.key(0)
    weights = jax.random.normal(key, (layers, matmuls, width, width), jnp.float32) / width**0.5
    project = jax.random.normal(key, (layers, width, 2 * HEADS * HEAD_DIM), jnp.float32)
    per_layer = [(weights[k], project[k]) for k in range(layers)]

    @functools.partial(jax.jit, donate_argnums=0, static_argnums=4)
    def layer_step(cache, ids, x, wp, layer):
        w, proj = wp
        h = x
        for m in range(matmuls):
            h = jnp.tanh(h @ w[m])
        kv = (h @ proj).astype(jnp.bfloat16)
        kv = kv.reshape(blocks, BLOCK, 2, HEADS, HEAD_DIM).transpose(0, 2, 3, 1, 4)
        (array,) = cache.arrays
        cache = jax.tree.unflatten(jax.tree.structure(cache), [_write(array, ids, layer, kv)])
        return cache, h

    x0 = jnp.ones((tokens, width), jnp.float32)

    def run(request_id, ids):
        x = x0
        start = time.time()
        for layer in range(layers):
            cache, x = layer_step(engine.caches[0], ids, x, per_layer[layer], layer)
            jax.block_until_ready(cache)
            engine.update_cache(cache)
            if not whole:
                engine.publish_layers(request_id, layer + 1)
                engine.poll()
        if whole:
            engine.publish_layers(request_id, layers)
            engine.poll()
        jax.block_until_ready(x)
        return [1], start, time.time()

    for layer in range(layers):  # compile every layer's call (static layer index)
        layer_step.lower(engine.caches[0], ids_like(blocks), x0, per_layer[layer],
                         layer).compile()
    return run


def ids_like(blocks: int) -> np.ndarray:
    return np.arange(1, blocks + 1, dtype=np.int32)


def _pin(cpus: list[int] | None) -> None:
    """Keeps this process on `cpus` (None: anywhere): the producer and the consumer each get
    their own core, as on two machines, rather than the step's threads starving the consumer."""
    if cpus is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cpus)


def _thread_cpu_s() -> dict[str, float]:
    """CPU seconds (user + system) of this process's threads so far, summed per thread name
    (Linux /proc; empty elsewhere). XLA's compute threads and the transfer server's have their
    own names; Python threads (the engine's worker) are named as Python names them."""
    import threading

    ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    # Python threads by their Python names (the OS knows them by the process's)
    python_names = {t.native_id: t.name.rstrip("_0123456789") for t in threading.enumerate()}
    totals: dict[str, float] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return totals
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:  # the thread ended
            continue
        name = python_names.get(int(tid)) or stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        # fields[11], [12]: utime, stime (fields 14 and 15 of proc(5), counted from the state)
        totals[name] = totals.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / ticks
    return totals


def _progress_option(interval_ms: float | None) -> dict:
    """The producer engines' `progress_interval_s` (None: the engine's default; 0: no
    background progress thread)."""
    if interval_ms is None:
        return {}
    return {"progress_interval_s": interval_ms / 1e3 if interval_ms > 0 else None}


def _platform_env(platform_name: str, host_devices: int) -> None:
    """This process's JAX platform (before JAX starts): `host_devices` CPU devices, or the GPU
    with CPU beside it (no preallocation: two processes share the GPU)."""
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={host_devices}"
    if platform_name == "gpu":
        os.environ["JAX_PLATFORMS"] = "cuda,cpu"
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    else:
        os.environ["JAX_PLATFORMS"] = "cpu"


def producer_main(conn, args: dict) -> None:
    _pin(args["producer_cpus"])
    _platform_env(args["platform"], PRODUCER_DEVICES)
    import jax
    from jax.sharding import Mesh

    from jaxkv import EngineConfig, KVCacheSpec, PagedKVCache
    from jaxkv.transfer import TransferEngine

    spec = KVCacheSpec(**_spec_kwargs(args["layers"]))
    engines, steps = {}, {}
    ids = np.arange(1, args["blocks"] + 1, dtype=np.int32)
    for mode in args["modes"]:
        # jax_tp2 / direct_tp2: a TP 2 producer (heads split over two devices, one program per
        # step, as the demo's prefill), which leaves jax_tp2 the third device to format on (the
        # engine finds it)
        tp = 2 if mode in ("jax_tp2", "direct_tp2") else 1
        engine = TransferEngine(f"prefill-{mode}", EngineConfig(spec, tp),
                                host_staging=mode == "staged", lease_s=60.0,
                                **_progress_option(args["producer_progress_interval_ms"]),
                                transport="jax" if mode.startswith("jax") else "nixl")
        mesh = Mesh(np.array(jax.devices()[:2]), ("tp",)) if tp == 2 else None
        engine.register_cache(PagedKVCache.allocate(spec, args["blocks"] + 1, mesh=mesh))
        engines[mode] = engine
        for whole in (False, True):
            step, x = _make_step(engine, args["layers"], args["blocks"], args["width"],
                                 args["matmuls"], whole)
            compiled = step.lower(engine.caches[0], ids, np.int32(0), x).compile()
            steps[mode, whole] = (compiled, x)
        if mode == "jax":  # the loop of jitted layers (see above)
            loops = {whole: _make_loop(engine, args["layers"], args["blocks"], args["width"],
                                       args["matmuls"], whole) for whole in (False, True)}
    conn.send(os.getpid())
    while True:
        if conn.poll(0.0002):
            command = conn.recv()
            if command[0] == "exit":
                break
            mode, request_id = command[1], command[2]
            engine = engines[mode]
            if command[0] == "pin":
                params = engine.publish_request(request_id, ids.tolist(), layerwise=True)
                conn.send((params, engine.handle(request_id)))
            elif command[0] == "step" and mode == "jax" and command[4] == "loop":
                conn.send((*loops[command[3]](request_id, ids), None, None))
            elif command[0] == "step":
                compiled, x = steps[mode, command[3]]
                args_ = (engine.caches[0], ids, np.int32(engine.handle(request_id)), x)
                threads_before, cpu_before = _thread_cpu_s(), time.process_time()
                start = time.time()
                cache, statuses, out = compiled(*args_)
                jax.block_until_ready((cache, statuses, out))
                end = time.time()
                cpu = time.process_time() - cpu_before
                threads = {name: seconds - threads_before.get(name, 0.0)
                           for name, seconds in _thread_cpu_s().items()}
                engine.update_cache(cache)  # staged whole: the copy to the mirror is here
                conn.send((np.asarray(statuses).tolist(), start, end, cpu, threads))
            elif command[0] == "publish":
                engine.publish_layers(request_id, command[3])
                conn.send(None)
            elif command[0] == "published":  # the announcements' wall times, once complete
                record = [p for p in engine.stats.publications if p.request_id == request_id]
                conn.send(record[-1].layers if record else None)
        for engine in engines.values():
            engine.poll()
    for engine in engines.values():
        engine.close()


def _call(conn, *command, timeout=120.0):
    conn.send(command)
    if not conn.poll(timeout):
        raise TimeoutError(f"the producer did not answer {command[0]!r}")
    return conn.recv()


def _wait_read(engine, request_id: str, timeout: float = 60.0) -> float:
    """Polls until the read finished (wall time of that poll); raises if it failed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = engine.poll()
        if request_id in result.finished:
            return time.time()
        for failed in result.failed:
            if failed.request_id == request_id:
                raise RuntimeError(f"{request_id} failed: {failed.reason}")
        time.sleep(0.0005)  # leave the cores to the producer's step
    raise TimeoutError(f"{request_id} did not finish in {timeout} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--blocks", type=int, default=64, help="blocks of 16 tokens")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--matmuls", type=int, default=6, help="per layer (its compute)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--modes", default=",".join(MODES),
                        help="comma-separated subset of " + ", ".join(MODES))
    parser.add_argument("--producer_progress_interval_ms", type=float, default=None,
                        help="the producer engines' background progress interval (default: "
                             "the engine's; 0: no progress thread, only the step's callbacks "
                             "and the producer's polls between steps progress)")
    parser.add_argument("--json_out", default=None)
    parser.add_argument("--platform", choices=("cpu", "gpu"), default="cpu",
                        help="where the caches and the step live (gpu: JAX's first GPU)")
    parser.add_argument("--pin_cpus", type=int, default=1,
                        help="1: the producer on CPU 0, the consumer on the others (default "
                             "where there are two or more); 0: anywhere")
    args = parser.parse_args()
    args.modes = [m for m in args.modes.split(",") if m]
    if not args.modes or set(args.modes) - set(MODES):
        parser.error(f"--modes takes a subset of {', '.join(MODES)}, got {args.modes}")
    if args.platform == "gpu" and {"jax_tp2", "direct_tp2"} & set(args.modes):
        parser.error("--platform=gpu runs the TP 1 modes (direct, staged, jax) only")
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    pin = bool(args.pin_cpus) and len(cpus) >= 2
    args.producer_cpus = cpus[:1] if pin else None
    args.consumer_cpus = cpus[1:] if pin else None
    # (before NIXL loads here or in the producer, which inherits it) UCX's CUDA transports
    # only where the caches are on a GPU
    os.environ.setdefault("UCX_TLS", "tcp,sm,self,cuda_copy,cuda_ipc" if args.platform == "gpu"
                          else "tcp,sm,self")
    _platform_env(args.platform, 1)  # the consumers: TP 1 each (jax_tp2 reads TP 2 -> 1)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import jax
    from _timing import write_json

    from jaxkv import EngineConfig, KVCacheSpec, PagedKVCache
    from jaxkv.transfer import TransferEngine

    _pin(args.consumer_cpus)
    ctx = multiprocessing.get_context("spawn")
    conn, child = ctx.Pipe()
    process = ctx.Process(target=producer_main, args=(child, vars(args)), daemon=True)
    process.start()
    if not conn.poll(600):
        raise TimeoutError("the producer did not start")
    print(f"producer pid {conn.recv()}", flush=True)
    spec = KVCacheSpec(**_spec_kwargs(args.layers))
    consumers = {}
    for mode in args.modes:
        engine = TransferEngine(f"decode-{mode}", EngineConfig(spec, 1),
                                host_staging=mode == "staged",
                                transport="jax" if mode.startswith("jax") else "nixl")
        engine.register_cache(PagedKVCache.allocate(spec, args.blocks + 1))
        consumers[mode] = engine
    local = list(range(1, args.blocks + 1))
    layer_bytes = spec.cache_nbytes(args.blocks) // args.layers
    rows: dict[str, list[dict]] = {}
    count = 0

    def layered(mode: str, whole: bool, how: str = "jit") -> dict:
        nonlocal count
        count += 1
        request_id = f"req-{count}"
        engine = consumers[mode]
        params, _ = _call(conn, "pin", mode, request_id)
        engine.start_read(params, local)
        time.sleep(0.05)  # the subscription reaches the producer before the step
        conn.send(("step", mode, request_id, whole, how))
        finished = _wait_read(engine, request_id)
        statuses, start, end, cpu, threads = _recv(conn)
        if statuses != [1] * len(statuses):
            raise RuntimeError(f"announcements refused: {statuses}")
        usage = {} if cpu is None else {
            # the producer's CPU during the step (one core when pinned: the step's wall time
            # minus this is time its core idled, e.g. partitions waiting for each other)
            "step_cpu_ms": 1e3 * cpu, "step_idle_ms": 1e3 * ((end - start) - cpu),
            "step_thread_cpu_ms": {name: round(1e3 * sec, 1)
                                   for name, sec in sorted(threads.items()) if sec > 0}}
        record = engine.stats.records[-1]
        arrival = dict(record.layer_arrival)
        step = end - start
        announced = dict(_published(conn, mode, request_id))  # layer_stop -> wall time
        return {"step_ms": 1e3 * step,
                "first_announced_pct": 100 * (min(announced.values()) - start) / step,
                "first_pct": 100 * (arrival[0] - start) / step,
                "last_after_end_ms": 1e3 * (arrival[args.layers - 1] - end),
                "last_after_announced_ms": 1e3 * (arrival[args.layers - 1]
                                                  - announced[args.layers]),
                "finished_after_end_ms": 1e3 * (finished - end),
                "finished_after_start_ms": 1e3 * (finished - start),
                "arrival_pct": [round(100 * (arrival[k] - start) / step, 1)
                                for k in range(args.layers)], **usage}

    def one_layer(mode: str) -> dict:
        nonlocal count
        count += 1
        request_id = f"req-{count}"
        engine = consumers[mode]
        params, _ = _call(conn, "pin", mode, request_id)
        engine.start_read(params, local)
        time.sleep(0.05)
        _call(conn, "publish", mode, request_id, 1)
        deadline = time.monotonic() + 60
        while len(engine.poll().layers) == 0 and time.monotonic() < deadline:
            time.sleep(0.0005)
        _call(conn, "publish", mode, request_id, args.layers)
        _wait_read(engine, request_id)
        arrival = dict(engine.stats.records[-1].layer_arrival)
        announced = dict(_published(conn, mode, request_id))[1]
        return {"one_layer_ms": 1e3 * (arrival[0] - announced)}

    contenders = {}
    for mode in args.modes:
        contenders[mode] = lambda mode=mode: layered(mode, False)
        contenders[f"{mode}_whole"] = lambda mode=mode: layered(mode, True)
        contenders[f"{mode}_one_layer"] = lambda mode=mode: one_layer(mode)
    if "jax" in args.modes:
        contenders["jax_loop"] = lambda: layered("jax", False, "loop")
    for run in contenders.values():  # warm up: handshakes, first reads
        run()
    for _ in range(args.rounds):
        for name, run in contenders.items():
            rows.setdefault(name, []).append(run())
    conn.send(("exit",))
    process.join(timeout=30)
    for engine in consumers.values():
        engine.close()

    def median(name: str, key: str) -> float:
        return round(statistics.median(r[key] for r in rows[name]), 2)

    summary: dict[str, dict] = {}
    for name, runs in rows.items():
        summary[name] = {key: median(name, key) for key in runs[0]
                         if key not in ("arrival_pct", "step_thread_cpu_ms")}
        if "step_thread_cpu_ms" in runs[0]:  # per thread name, median over rounds
            names = sorted({n for r in runs for n in r["step_thread_cpu_ms"]})
            summary[name]["step_thread_cpu_ms"] = {
                n: round(statistics.median(r["step_thread_cpu_ms"].get(n, 0.0) for r in runs), 1)
                for n in names}
        if "arrival_pct" in runs[0]:
            summary[name]["arrival_pct_median"] = [
                round(statistics.median(r["arrival_pct"][k] for r in runs), 1)
                for k in range(args.layers)]
    for mode in args.modes:
        one = summary[f"{mode}_one_layer"]["one_layer_ms"]
        ratios = [r["last_after_end_ms"] / one for r in rows[mode]]
        summary[mode]["last_vs_one_layer"] = round(statistics.median(ratios), 2)
        summary[mode]["targets_met"] = {
            "first_before_60pct": summary[mode]["first_pct"] < 60,
            "last_within_1.2x_one_layer": summary[mode]["last_vs_one_layer"] <= 1.2}
        # what pipelining saves: the read finishes this much sooner after the step
        summary[mode]["finished_sooner_than_whole_ms"] = round(
            summary[f"{mode}_whole"]["finished_after_end_ms"]
            - summary[mode]["finished_after_end_ms"], 2)
        # step start -> read finished (what the consumer waits for), over the whole request's
        summary[mode]["finished_after_start_vs_whole"] = round(
            statistics.median(a["finished_after_start_ms"] / b["finished_after_start_ms"]
                              for a, b in zip(rows[mode], rows[f"{mode}_whole"])), 3)
    report = {
        "benchmark": "layerwise",
        "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "load_avg": os.getloadavg(),
        "versions": {"jax": jax.__version__, "python": platform.python_version()},
        "device": jax.devices()[0].device_kind,
        "UCX_TLS": os.environ.get("UCX_TLS"),
        "args": vars(args),
        "layer_bytes": layer_bytes,
        "request_bytes": layer_bytes * args.layers,
        "summary": summary,
        "runs": rows,
    }
    print(json.dumps(summary, indent=2))
    write_json(report, args.json_out)


def _published(conn, mode: str, request_id: str) -> tuple:
    """The producer's announcements of a request ((layer_stop, wall time) each), once it
    recorded the whole request published."""
    deadline = time.monotonic() + 60
    while (published := _call(conn, "published", mode, request_id)) is None:
        if time.monotonic() > deadline:
            raise TimeoutError("the producer never recorded the publication")
        time.sleep(0.01)
    return published


def _recv(conn, timeout: float = 120.0):
    if not conn.poll(timeout):
        raise TimeoutError("the producer's step did not return")
    return conn.recv()


if __name__ == "__main__":
    main()
