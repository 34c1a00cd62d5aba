"""Benchmarks NIXL pulls at scale over real cache geometries (issue 29): direct reads (one
descriptor per planned chunk), formatted reads (the producer gathers, one large READ per chunk
of 8 MiB, the consumer scatters; `jaxkv.transfer._formatted`) and the engine's own choice
("auto"), side by side with a bare READ of the same bytes between two registered buffers (the
physical limit of this machine's UCX), in one run.

Geometries (``--layers`` x ``--heads`` KV heads x ``--head_dim``, block ``--block_size``,
bf16 unless said): vLLM's per-layer caches (one array per layer and K/V, HND: ``layout="HTD"``),
a cross-layer cache (one array, ``"LKHTD"``), tpu-inference's packed cache
(`KVCacheSpec.for_tpu_inference`: head_dim 128 and 96, bf16 and fp8); TP pairs 1->1, 2->1,
8->4, 4->8; block ids contiguous (one run on both sides) or fragmented (random blocks of a
pool 4x the request on both sides, what a busy pool hands out). Each request moves
``--mib`` MiB in all (every consumer rank's share together); ``--sizes`` adds larger pulls
of the fragmented per-layer TP 8->4 case.

The producer engines live in a child process (8 CPU devices), the consumers in this one (8
CPU devices); rounds alternate the modes (same machine load); round 0 is a warm-up
(handshake, planning templates, pools touched). Per case and mode: ``pull_s`` (the engine's
record: start_read -> every byte in place), ``start_s`` (the `start_read` call: planning and
posting / asking), medians; ``ratio_to_bare`` = bare READ time / pull time (1.0: wire speed).
Two bare READs of the same bytes: between the registered pools (``bare_read_s``: one
descriptor per 256 MiB, memory the kernel backs with huge pages: this machine's best case)
and between the two caches' own regions, whole regions back to back (``bare_cache_read_s``:
the memory the engine reads, 4 KiB pages, without the plan's fragmentation);
``ratio_to_bare_cache`` = that time / pull time.

The formatted path's copy bound (``copy_bound``): a formatted read copies its bytes three
times (the producer's gather, the READ, the consumer's scatter) where the bare READ copies
them once. Measured in this process with the request's own plan rows (`plan_read`, every
local rank): the consumer's scatter of them from a packed buffer into its cache (what a
formatted read runs), a gather of the same rows from the cache into a packed buffer (the
producer's gather, mirrored onto this process's memory), and both at once on two threads
(``concurrency`` = their single-thread times together / the time of both at once: 2.0 where
copies scale with cores, ~1 where memory bandwidth caps them). With every copy overlapped
perfectly, a formatted pull takes at least (gather + bare cache READ + scatter) /
concurrency: ``ratio_bound`` = bare cache READ / that time, the best ``ratio_to_bare_cache``
the formatted path can reach on this machine.

  python benchmarks/bench_scale.py --json_out=benchmarks/results/scale_cpu.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import platform
import statistics
import sys
import time

os.environ.setdefault("UCX_TLS", "tcp,sm,self")

import numpy as np  # noqa: E402

WAIT_S = 300.0
MODES = ("never", "always", "auto")
POOL_BYTES = 256 << 20


def _devices_env(count: int) -> None:
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def make_spec(kind: str, layers: int, heads: int, head_dim: int, block: int, dtype: str):
    from jaxkv import KVCacheSpec

    if kind == "packed":
        return KVCacheSpec.for_tpu_inference(layers, heads, head_dim, block, dtype)
    layout = {"per_layer": "HTD", "cross_layer": "LKHTD"}[kind]
    return KVCacheSpec(layers, heads, head_dim, block, dtype, layout=layout)


def make_cache(spec, tp: int, num_blocks: int, seed: int):
    import jax

    from jaxkv import PagedKVCache

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:tp]), ("tp",))
    rng = np.random.default_rng(seed)
    shape = (num_blocks, *spec.global_block_shape(tp))
    itemsize = np.dtype(spec.dtype).itemsize
    arrays = []
    for _ in range(spec.num_arrays):
        raw = rng.integers(0, 256, size=int(np.prod(shape)) * itemsize, dtype=np.uint8)
        arrays.append(raw.view(spec.dtype).reshape(shape))
    return PagedKVCache.from_arrays(spec, arrays, mesh=mesh)


def producer(conn) -> None:
    """("engine", name, spec, tp, num_blocks) -> (address, send-pool address);
    ("pin", name, rid, ids) -> params; ("close", name); ("exit",)."""
    _devices_env(8)
    from jaxkv import EngineConfig
    from jaxkv.transfer._engine import KVTransferEngine  # the core: its pools are read

    engines: dict = {}
    conn.send("ready")
    while True:
        if conn.poll(0.0002):
            command = conn.recv()
            if command[0] == "exit":
                break
            if command[0] == "engine":
                _, name, spec, tp, num_blocks = command
                engine = KVTransferEngine(f"p-{name}", EngineConfig(spec, tp),
                                          format_pool_bytes=POOL_BYTES, lease_s=120.0)
                engine.register_cache(make_cache(spec, tp, num_blocks, 7))
                engines[name] = engine
                conn.send((engine.address, engine.transport.format_server.pool.address))
            elif command[0] == "pin":
                _, name, rid, ids = command
                conn.send(engines[name].publish_request(rid, ids, 120.0))
            elif command[0] == "close":
                engines.pop(command[1]).close()
                conn.send(True)
        for engine in engines.values():
            engine.poll()
    for engine in engines.values():
        engine.close()


def _ids(num: int, fragmented: bool, seed: int) -> tuple[list[int], list[int], int]:
    """(remote ids, local ids, pool blocks)."""
    pool = 4 * num if fragmented else num + 4
    if not fragmented:
        return list(range(num)), list(range(4, 4 + num)), pool
    rng = np.random.default_rng(seed)
    return (rng.permutation(pool)[:num].tolist(), rng.permutation(pool)[:num].tolist(), pool)


def _read_s(agent, reads: list[tuple[np.ndarray, np.ndarray]], remote_name: str,
            repeats: int) -> list[float]:
    """Seconds of `repeats` rounds (after one warm-up) of the READs ``(local, remote)``
    descriptor arrays, one after the other."""
    out = []
    for _ in range(repeats + 1):
        begin = time.perf_counter()
        for loc, rem in reads:
            handle = agent.read(loc, rem, remote_name)
            deadline = time.monotonic() + WAIT_S
            while agent.state(handle) != "DONE":
                if time.monotonic() > deadline:
                    raise TimeoutError("bare READ did not complete")
            agent.release(handle)
        out.append(time.perf_counter() - begin)
    return out[1:]


def _bare_read_s(engine, pool_address: int, nbytes: int, repeats: int) -> list[float]:
    """READs of `nbytes` from the producer's send pool into this process's receive pool,
    in descriptors of at most the pool's size (one descriptor up to 256 MiB)."""
    pool = engine.transport.receive_pool
    reads = []
    for start in range(0, nbytes, pool.nbytes):
        step = min(nbytes - start, pool.nbytes)
        reads.append((np.array([[pool.address, step, 0]], np.uint64),
                      np.array([[pool_address, step, 0]], np.uint64)))
    return _read_s(engine.agent, reads, next(iter(engine.agent.remote_agents)), repeats)


def _bare_cache_read_s(engine, peer_id: str, nbytes: int, repeats: int) -> list[float]:
    """READs of `nbytes` from the producer's cache regions into this process's cache
    regions, whole regions back to back (one descriptor per region pair, a few large ones):
    the same memory the engine reads, without the plan's fragmentation."""
    peer = engine.consumer.peers[peer_id].meta
    remote = [(r.base_address, r.block_len * r.num_blocks) for i in peer.ranks for r in i.regions]
    local = [(r.base_address, r.block_len * r.num_blocks)
             for i in engine.metadata.ranks for r in i.regions]
    loc, rem = [], []
    left, ri, li, ro, lo = nbytes, 0, 0, 0, 0
    while left > 0:
        step = min(left, remote[ri][1] - ro, local[li][1] - lo)
        loc.append((local[li][0] + lo, step, 0))
        rem.append((remote[ri][0] + ro, step, 0))
        left, ro, lo = left - step, ro + step, lo + step
        if ro == remote[ri][1]:
            ri, ro = ri + 1, 0
        if lo == local[li][1]:
            li, lo = li + 1, 0
    reads = [(np.array(loc, np.uint64), np.array(rem, np.uint64))]
    return _read_s(engine.agent, reads, next(iter(engine.agent.remote_agents)), repeats)


def _median_s(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):  # round 0 warms up
        begin = time.perf_counter()
        fn()
        times.append(time.perf_counter() - begin)
    return statistics.median(times[1:])


def copy_bound(engine, peer_id: str, local: list[int], remote: list[int], bare_cache_s: float,
               repeats: int) -> dict:
    """The formatted path's best case on this machine (see the module docstring), from the
    request's own plan rows (`plan_read`, every local rank): the consumer's scatter of them
    out of a packed buffer into its cache (`scatter_rows`, what a formatted read runs), a
    gather of the same rows out of the cache into a packed buffer (the producer's gather, its
    rows mirrored onto this process's memory), and both at once on two threads."""
    from jaxkv import _ffi_cpu
    from jaxkv.transfer._formatted import scatter_rows, wire_offsets
    from jaxkv.transfer._plan import COPY_COLUMNS, plan_read

    region, offset, length, count, stride = (COPY_COLUMNS.index(c) for c in (
        "local_region", "local_offset", "length", "count", "local_stride"))

    peer = engine.consumer.peers[peer_id].meta
    shares = []
    for info in engine.metadata.ranks:
        rows = plan_read(engine.metadata, info.rank, peer, local, remote).copies
        if len(rows):
            regions = [(r.base_address, r.block_len * r.num_blocks) for r in info.regions]
            shares.append((rows, regions))
    nbytes = sum(wire_offsets(rows[:, length], rows[:, count])[1] for rows, _ in shares)
    gather_into, scatter_from = np.ones(nbytes, np.uint8), np.ones(nbytes, np.uint8)

    def copies(buffer: np.ndarray, gather: bool):
        out, start = [], 0
        for rows, regions in shares:
            offsets, size = wire_offsets(rows[:, length], rows[:, count])
            address = buffer.ctypes.data + start
            cache = (np.array([r[0] for r in regions], np.uint64),
                     np.array([r[1] for r in regions], np.int64))
            packed = (np.array([address], np.uint64), np.array([size], np.int64))
            # The gather's `copy_rows` table is made here, not by `gather_rows`: timed both
            # at once, the gather must run on a native thread (`RowCopy`); a Python thread
            # would share the GIL with the scatter's table making, which the producer, in
            # its own process, does not (tried: it measured concurrency ~1.1, not a bound).
            if gather:  # cache rows -> packed, back to back (`copy_rows`' columns)
                table = np.empty((len(rows), 8), np.int64)
                table[:, 0], table[:, 1] = rows[:, region], rows[:, offset]
                table[:, 2], table[:, 3] = 0, offsets
                table[:, 4], table[:, 5] = rows[:, length], rows[:, count]
                table[:, 6], table[:, 7] = rows[:, stride], rows[:, length]
                out.append((*cache, *packed, table))
            else:
                out.append((rows, regions, address, size))
            start += size
        return out

    gathers, scatters = copies(gather_into, True), copies(scatter_from, False)

    def gather():
        for args in gathers:
            _ffi_cpu.copy_rows(*args)

    def scatter():
        for rows, regions, address, size in scatters:
            scatter_rows(rows, regions, address, size)

    gather_s = _median_s(gather, repeats)
    scatter_s = _median_s(scatter, repeats)

    def both():
        running = [_ffi_cpu.RowCopy(*args) for args in gathers]
        running += [scatter_rows(rows, regions, address, size, background=True)
                    for rows, regions, address, size in scatters]
        for copy in running:
            if not copy.wait(WAIT_S):
                raise TimeoutError("a row copy did not finish")

    both_s = _median_s(both, repeats)
    concurrency = (gather_s + scatter_s) / both_s
    bound_s = max((gather_s + bare_cache_s + scatter_s) / concurrency,
                  gather_s, bare_cache_s, scatter_s)
    return dict(gather_s=gather_s, scatter_s=scatter_s, both_at_once_s=both_s,
                concurrency=concurrency, bound_s=bound_s, ratio_bound=bare_cache_s / bound_s)


def run_case(conn, case: dict, repeats: int) -> dict:
    from jaxkv import EngineConfig
    from jaxkv.transfer._engine import KVTransferEngine

    spec_p = make_spec(case["kind"], case["layers"], case["heads"], case["head_dim"],
                       case["block"], case["dtype"])
    bytes_per_block = spec_p.cache_nbytes(1) if case["kind"] != "packed" else \
        spec_p.payload_nbytes(1) * spec_p.num_arrays
    num = max(1, int(case["mib"] * (1 << 20) // bytes_per_block))
    remote, local, pool_blocks = _ids(num, case["fragmented"], 3)
    name = case["name"]
    conn.send(("engine", name, spec_p, case["p_tp"], pool_blocks))
    address, send_pool = conn.recv()
    engine = KVTransferEngine(f"d-{name}", EngineConfig(spec_p, case["c_tp"]),
                              format_pool_bytes=POOL_BYTES, read_timeout_s=WAIT_S)
    engine.register_cache(make_cache(spec_p, case["c_tp"], pool_blocks, 11))
    if case.get("chunk_mib"):
        engine.transport.chunk_bytes = int(case["chunk_mib"] * (1 << 20))
    times: dict[str, list[float]] = {m: [] for m in MODES}
    starts: dict[str, list[float]] = {m: [] for m in MODES}
    paths: dict[str, str] = {}
    record = None
    for round_ in range(repeats + 1):
        for mode in MODES:
            engine.consumer.formatted_reads = mode  # = KVTransferEngine(formatted_reads=mode)
            rid = f"{mode}-{round_}"
            conn.send(("pin", name, rid, remote))
            params = conn.recv()
            begin = time.perf_counter()
            engine.start_read(params, local)
            started = time.perf_counter() - begin
            deadline = time.monotonic() + WAIT_S
            done: list = []
            while not done and time.monotonic() < deadline:
                result = engine.poll()
                done = result.finished + [f.request_id for f in result.failed]
            if not done or result.failed:
                raise RuntimeError(f"{name} {mode}: read failed or timed out ({result.failed})")
            record = engine.stats.records[-1]
            paths[mode] = record.path
            if round_:
                times[mode].append(record.duration_s)
                starts[mode].append(started)
    assert record is not None
    nbytes = record.bytes
    bare = _bare_read_s(engine, send_pool, nbytes, repeats)
    bare_cache = _bare_cache_read_s(engine, f"p-{name}", nbytes, repeats)
    bound = copy_bound(engine, f"p-{name}", local, remote, statistics.median(bare_cache),
                       repeats)
    direct = [r.expanded_descriptors for r in engine.stats.records if r.path == "direct"]
    engine.close()
    conn.send(("close", name))
    conn.recv()
    bare_s, cache_s = statistics.median(bare), statistics.median(bare_cache)
    out = dict(case, blocks=num, bytes=nbytes, bare_read_s=bare_s,
               bare_gb_per_s=nbytes / bare_s / 1e9, bare_cache_read_s=cache_s,
               bare_cache_gb_per_s=nbytes / cache_s / 1e9,
               direct_chunks=direct[-1] if direct else None, copy_bound=bound)
    for mode in MODES:
        pull = statistics.median(times[mode])
        out[mode] = dict(path=paths[mode], pull_s=pull, start_s=statistics.median(starts[mode]),
                         gb_per_s=nbytes / pull / 1e9, ratio_to_bare=bare_s / pull,
                         ratio_to_bare_cache=cache_s / pull,
                         start_fraction=statistics.median(starts[mode]) / pull)
    return out


def cases(args) -> list[dict]:
    base = dict(layers=args.layers, heads=args.heads, head_dim=args.head_dim,
                block=args.block_size, dtype="bfloat16", mib=args.mib)
    out = []
    for p_tp, c_tp in ((1, 1), (2, 1), (8, 4), (4, 8)):
        for fragmented in (False, True):
            out.append(dict(base, kind="per_layer", p_tp=p_tp, c_tp=c_tp, fragmented=fragmented))
    for p_tp, c_tp in ((2, 1), (8, 4)):
        out.append(dict(base, kind="cross_layer", p_tp=p_tp, c_tp=c_tp, fragmented=True))
    for head_dim, dtype in ((128, "bfloat16"), (96, "bfloat16"), (128, "float8_e4m3fn")):
        for fragmented in (False, True):
            out.append(dict(base, kind="packed", head_dim=head_dim, dtype=dtype, p_tp=2, c_tp=1,
                            fragmented=fragmented))
    for mib in args.sizes:
        out.append(dict(base, kind="per_layer", p_tp=8, c_tp=4, fragmented=True, mib=mib))
    for case in out:
        case["name"] = (f"{case['kind']}-hd{case['head_dim']}-{case['dtype']}-tp{case['p_tp']}to"
                        f"{case['c_tp']}-{'frag' if case['fragmented'] else 'contig'}-"
                        f"{case['mib']}MiB")
    return [c for c in out if not args.only or any(o in c["name"] for o in args.only)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head_dim", type=int, default=128)
    parser.add_argument("--block_size", type=int, default=16)
    parser.add_argument("--mib", type=int, default=64, help="MiB per request (all ranks)")
    parser.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",") if x],
                        default=[256], help="larger pulls of the per-layer 8->4 case (MiB)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", type=lambda s: [x for x in s.split(",") if x], default=[])
    parser.add_argument("--json_out", default=None)
    args = parser.parse_args()
    _devices_env(8)
    ctx = multiprocessing.get_context("spawn")
    conn, child = ctx.Pipe()
    process = ctx.Process(target=producer, args=(child,), daemon=True)
    process.start()
    if not conn.poll(240) or conn.recv() != "ready":
        raise TimeoutError("producer did not start")
    import jax

    results = []
    for case in cases(args):
        result = run_case(conn, case, args.repeats)
        results.append(result)
        print(json.dumps({k: result[k] for k in ("name", "bytes", "bare_gb_per_s",
                                                 "bare_cache_gb_per_s")}
                         | {m: (result[m]["path"], round(result[m]["ratio_to_bare"], 3),
                                round(result[m]["ratio_to_bare_cache"], 3))
                            for m in MODES}
                         | {"ratio_bound": round(result["copy_bound"]["ratio_bound"], 3)}),
                         flush=True)
    conn.send(("exit",))
    process.join(30)
    report = {
        "benchmark": "bench_scale", "date": datetime.date.today().isoformat(),
        "machine": platform.platform(), "cpus": os.cpu_count(),
        "python": sys.version.split()[0], "jax": jax.__version__,
        "load_average": os.getloadavg(), "repeats": args.repeats, "results": results,
    }
    text = json.dumps(report, indent=2)
    if args.json_out:
        os.makedirs(os.path.dirname(args.json_out) or ".", exist_ok=True)
        with open(args.json_out, "w") as f:
            f.write(text + "\n")
    else:
        print(text)


if __name__ == "__main__":
    main()
