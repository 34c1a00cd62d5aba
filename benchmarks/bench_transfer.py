"""Benchmarks `jaxkv.transfer`: an end-to-end pull of one request between two processes vs a
bare NIXL READ of the same bytes as a single descriptor, side by side in one run; and the
read planner.

The producer (prefill) process holds a `PagedKVCache` (CPU memory, UCX) and pins each request;
this process (decode) pulls it with `KVTransferEngine.start_read` / `poll` (planning, posting,
completion, Done/Ack confirmation included). The bare READ uses the same two agents and moves
the same number of bytes as one contiguous descriptor. Runs alternate so that both see the
same machine load. Prints one JSON object (and writes it with ``--json_out``):

  python benchmarks/bench_transfer.py --mib=80 --repeats=10 --json_out=/tmp/bench_transfer.json
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

os.environ.setdefault("UCX_TLS", "tcp,sm,self")

import numpy as np  # noqa: E402

SPEC = dict(
    num_layers=8, num_kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16", layout="LKHTD"
)  # 0.5 MiB per block


def _producer(conn, num_blocks: int) -> None:
    import jax

    from jaxkv import EngineConfig, KVCacheSpec, PagedKVCache
    from jaxkv.transfer import KVTransferEngine

    spec = KVCacheSpec(**SPEC)
    rng = np.random.default_rng(0)
    arrays = [
        rng.integers(0, 1 << 16, spec.array_shape(num_blocks), dtype=np.uint16).view(spec.dtype)
    ]
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
    cache = PagedKVCache.from_arrays(spec, arrays, mesh=mesh)
    with KVTransferEngine("prefill", EngineConfig(spec, 1), lease_s=60.0) as engine:
        engine.register_cache(cache)
        conn.send(engine.address)
        while True:
            if conn.poll(0.0002):
                command = conn.recv()
                if command[0] == "exit":
                    break
                conn.send(engine.publish_request(command[1], command[2]))
            engine.poll()


def _wait(fn, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if fn():
            return
    raise TimeoutError("transfer did not finish")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=80, help="request size (>= 64)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--json_out", default="")
    args = parser.parse_args(argv)

    import jax

    from jaxkv import EngineConfig, KVCacheSpec, PagedKVCache
    from jaxkv.transfer import KVTransferEngine, plan_read

    spec = KVCacheSpec(**SPEC)
    block = spec.block_nbytes()
    n = max(1, (args.mib << 20) // block)
    num_blocks = 2 * n + 8
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    process = ctx.Process(target=_producer, args=(child, num_blocks), daemon=True)
    process.start()
    try:
        if not parent.poll(120):
            raise TimeoutError("producer did not start")
        address = parent.recv()
        mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
        cache = PagedKVCache.allocate(spec, num_blocks, mesh=mesh)
        engine = KVTransferEngine("decode", EngineConfig(spec, 1), read_timeout_s=60.0)
        engine.register_cache(cache)
        peer = engine.add_peer("prefill", [address])
        remote_region = peer.rank_info(0).regions[0]
        local_region = engine.metadata.rank_info(0).regions[0]
        remote_name = next(iter(engine.agent.remote_agents))
        rng = np.random.default_rng(1)
        layouts = {
            "contiguous": (np.arange(n), np.arange(n) + n),
            "fragmented": (rng.permutation(num_blocks)[:n], rng.permutation(num_blocks)[:n]),
        }
        times = {"bare_read": [], **{f"jaxkv_{k}": [] for k in layouts}}
        descriptors = {}
        nbytes = n * block
        for rep in range(args.repeats + 1):
            for name, (remote_ids, local_ids) in layouts.items():
                parent.send(("pin", f"{name}-{rep}", remote_ids.tolist()))
                params = parent.recv()
                start = time.perf_counter()
                engine.start_read(params, local_ids.tolist())
                finished = []

                def done(finished=finished):
                    result = engine.poll()
                    finished += result.finished
                    if result.failed:
                        raise RuntimeError(result.failed)
                    return finished

                _wait(done)
                if rep:
                    times[f"jaxkv_{name}"].append(time.perf_counter() - start)
                descriptors[name] = engine.stats.records[-1].descriptors
            local = np.array([[local_region.base_address, nbytes, 0]], dtype=np.uint64)
            remote = np.array([[remote_region.base_address, nbytes, 0]], dtype=np.uint64)
            start = time.perf_counter()
            handle = engine.agent.read(local, remote, remote_name)
            _wait(lambda handle=handle: engine.agent.state(handle) == "DONE")
            elapsed = time.perf_counter() - start
            engine.agent.release(handle)
            if rep:
                times["bare_read"].append(elapsed)

        # planning speed: 2048 blocks over 64 regions, no runs (worst case)
        from jaxkv.transfer._metadata import AgentInfo, RankInfo, RegionInfo, engine_metadata

        pspec = KVCacheSpec(32, 8, 128, 16, "bfloat16", layout="HTD")
        regions = [
            RegionInfo(
                array_index=i,
                layer=i // 2,
                kv=i % 2,
                head_start=0,
                head_stop=8,
                base_address=(i + 1) << 36,
                block_len=pspec.block_nbytes(),
                num_blocks=8192,
                device_id=0,
                memory_kind="DRAM",
            )
            for i in range(64)
        ]
        metas = [
            engine_metadata(
                e,
                EngineConfig(pspec, 1),
                [RankInfo(rank=0, agent_name="a", regions=regions)],
                [AgentInfo(name="a", metadata=b"m")],
            )
            for e in ("p", "d")
        ]
        plan_ids = (rng.permutation(8192)[:2048], rng.permutation(8192)[:2048])
        plan_read(metas[1], 0, metas[0], *plan_ids)
        plan_times = []
        for _ in range(20):
            start = time.perf_counter()
            plan_read(metas[1], 0, metas[0], *plan_ids)
            plan_times.append(time.perf_counter() - start)

        def summary(values):
            return {
                "median_ms": statistics.median(values) * 1e3,
                "best_ms": min(values) * 1e3,
                "median_GBps": nbytes / statistics.median(values) / 1e9,
            }

        out = {
            "bench": "bench_transfer",
            "machine": {
                "python": sys.version.split()[0],
                "platform": platform.platform(),
                "cpus": os.cpu_count(),
                "UCX_TLS": os.environ.get("UCX_TLS"),
            },
            "request": {
                "bytes": nbytes,
                "MiB": nbytes / 2**20,
                "blocks": n,
                "block_bytes": block,
                "descriptors": descriptors,
            },
            "results": {k: summary(v) for k, v in times.items()},
            "planning_2048_blocks_64_regions_ms": {
                "median": statistics.median(plan_times) * 1e3,
                "best": min(plan_times) * 1e3,
            },
            "stats": engine.stats.summary(),
        }
        bare = statistics.median(times["bare_read"])
        out["checks"] = {
            f"jaxkv_{k}_vs_bare_read": {
                "ratio": bare / statistics.median(times[f"jaxkv_{k}"]),
                "pass": bare / statistics.median(times[f"jaxkv_{k}"]) >= 0.9,
            }
            for k in layouts
        }
        out["checks"]["planning_under_5ms"] = {"pass": statistics.median(plan_times) < 0.005}
        engine.close()
    finally:
        parent.send(("exit",))
        process.join(timeout=10)
        if process.is_alive():
            process.kill()
            process.join(timeout=5)
    text = json.dumps(out, indent=2)
    print(text)
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(text + "\n")
    return out


if __name__ == "__main__":
    main()
