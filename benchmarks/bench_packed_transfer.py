"""Benchmarks NIXL reads of tpu-inference's packed cache (`KVCacheSpec.for_tpu_inference`,
bf16, per-layer arrays ``[pages, page, words, 2, 128]``) registered as it is stored (values
only: phantom heads and head-dim padding never move) against the alternative the
tpu-inference connector used before, a byte-identical "word column" view (plain THD, one
"head" per 32-bit word column ``[2, 128]``, padding lanes moved with the values), side by
side in one run, producer TP 2 -> consumer TP 1, with a bare single-descriptor NIXL READ of
the same bytes as the word view (the physical limit of this machine's UCX) for scale.

The producer process holds one engine per contender; this process pulls each request with
`KVTransferEngine.start_read` / `poll` (``landed``: `TransferRecord.duration_s`, start_read ->
every READ complete). Rounds alternate the contenders (same machine load). For a head dim
that is a multiple of 128 the two register the same bytes and must plan the same
descriptors; below it the exact read needs one descriptor chunk per value row (per head,
K/V and token): the cost of never moving padding. Prints one JSON object (and writes it with
``--json_out``):

  python benchmarks/bench_packed_transfer.py --head_dims=96,128 --repeats=7 \\
      --json_out=benchmarks/results/packed_transfer_cpu.json
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

LAYERS, HEADS, PAGE = 8, 8, 16
WAIT_S = 60.0


def specs(head_dim: int):
    """The exact packed spec and the connector's word-column view of the same bytes."""
    from jaxkv import KVCacheSpec

    exact = KVCacheSpec.for_tpu_inference(LAYERS, HEADS, head_dim, PAGE, "bfloat16")
    packing = exact.packing
    view = KVCacheSpec(LAYERS, 2 * HEADS // packing, packing * exact.block_shape()[-1], PAGE,
                       "bfloat16", layout="THD", kv_factor=1)
    return {"exact_packed": exact, "word_view": view}


def random_cache(spec, tp: int, num_blocks: int, seed: int):
    import jax

    from jaxkv import PagedKVCache

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:tp]), ("tp",))
    rng = np.random.default_rng(seed)
    shape = (num_blocks, *spec.global_block_shape(tp))
    arrays = [rng.integers(0, 1 << 16, size=shape, dtype=np.uint16).view(spec.dtype)
              for _ in range(spec.num_arrays)]
    return PagedKVCache.from_arrays(spec, arrays, mesh=mesh)


def producer(conn, head_dims, num_blocks: int) -> None:
    """Engines ``{contender}-{head_dim}`` over 2 CPU devices; ("pin", name, rid, ids) ->
    TransferParams; ("exit",)."""
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=2"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from jaxkv import EngineConfig
    from jaxkv.transfer._engine import KVTransferEngine  # the core: its agent times bare READs

    engines = {}
    for head_dim in head_dims:
        for name, spec in specs(head_dim).items():
            engine = KVTransferEngine(f"{name}-{head_dim}", EngineConfig(spec, 2))
            engine.register_cache(random_cache(spec, 2, num_blocks, head_dim))
            engines[f"{name}-{head_dim}"] = engine
    conn.send({name: e.address for name, e in engines.items()})
    try:
        while True:
            if conn.poll(0.0005):
                command = conn.recv()
                if command[0] == "exit":
                    break
                _, name, rid, ids = command
                conn.send(engines[name].publish_request(rid, ids, 60.0))
            for engine in engines.values():
                engine.poll()
    finally:
        for engine in engines.values():
            engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--head_dims", default="96,128")
    parser.add_argument("--blocks", type=int, default=128, help="blocks per request")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json_out", default=None)
    args = parser.parse_args()
    head_dims = [int(h) for h in args.head_dims.split(",")]
    num_blocks = args.blocks + 16
    import jax

    from jaxkv import EngineConfig
    from jaxkv.transfer._engine import KVTransferEngine  # the core: its agent times bare READs

    ctx = multiprocessing.get_context("spawn")
    conn, child = ctx.Pipe()
    process = ctx.Process(target=producer, args=(child, head_dims, num_blocks), daemon=True)
    process.start()
    if not conn.poll(240):
        raise TimeoutError("producer did not start")
    addresses = conn.recv()
    remote = list(range(args.blocks))
    local = list(range(16, 16 + args.blocks))
    consumers = {}
    for head_dim in head_dims:
        for name, spec in specs(head_dim).items():
            engine = KVTransferEngine(f"decode-{name}-{head_dim}", EngineConfig(spec, 1))
            engine.register_cache(random_cache(spec, 1, num_blocks, 0))
            consumers[f"{name}-{head_dim}"] = engine
    del jax
    times: dict[str, list[float]] = {name: [] for name in consumers}
    records: dict[str, dict] = {}
    for round_ in range(args.repeats + 1):  # round 0: warm-up (handshake, planning)
        for name, engine in consumers.items():
            conn.send(("pin", name, f"r{round_}", remote))
            params = conn.recv()
            engine.start_read(params, local)
            deadline = time.monotonic() + WAIT_S
            done: list = []
            while not done and time.monotonic() < deadline:
                result = engine.poll()
                done = result.finished + [f.request_id for f in result.failed]
            if not done or result.failed:
                raise RuntimeError(f"{name}: read failed or timed out ({result.failed})")
            record = engine.stats.records[-1]
            if round_:
                times[name].append(record.duration_s)
            records[name] = dict(bytes=record.bytes, descriptors=record.descriptors,
                                 chunks=record.expanded_descriptors)
    # Bare NIXL READs of the word view's bytes, one contiguous descriptor per (layer array,
    # producer rank), between the same agents: the limit of this transport on this machine.
    name = f"word_view-{head_dims[0]}"
    bare = _bare_read_seconds(consumers[name], addresses[name], name, args.blocks,
                              args.repeats)
    conn.send(("exit",))
    process.join(10)
    for engine in consumers.values():
        engine.close()
    word_bytes = records[name]["bytes"]
    report: dict = {
        "benchmark": "bench_packed_transfer", "machine": platform.platform(),
        "python": sys.version.split()[0], "layers": LAYERS, "kv_heads": HEADS, "page": PAGE,
        "dtype": "bfloat16", "producer_tp": 2, "consumer_tp": 1, "blocks": args.blocks,
        "repeats": args.repeats, "bare_read_median_s": statistics.median(bare),
        "bare_read_gb_per_s": word_bytes / statistics.median(bare) / 1e9, "results": {},
    }
    for head_dim in head_dims:
        exact, view = f"exact_packed-{head_dim}", f"word_view-{head_dim}"
        ratio = statistics.median(e / v for e, v in zip(times[exact], times[view]))
        report["results"][str(head_dim)] = {
            name.split("-")[0]: dict(records[name], median_s=statistics.median(times[name]),
                                     gb_per_s=records[name]["bytes"]
                                     / statistics.median(times[name]) / 1e9)
            for name in (exact, view)
        } | {"exact_over_view_time_median_ratio": ratio}
    text = json.dumps(report, indent=2)
    print(text)
    if args.json_out:
        os.makedirs(os.path.dirname(args.json_out) or ".", exist_ok=True)
        with open(args.json_out, "w") as f:
            f.write(text + "\n")


def _bare_read_seconds(engine, address, peer_name: str, blocks: int, repeats: int
                       ) -> list[float]:
    peer = engine.add_peer(peer_name, [address])
    remote_name = next(iter(engine.agent.remote_agents))
    local_regions = engine.metadata.rank_info(0).regions
    loc, rem = [], []
    for info in peer.ranks:
        for index, region in enumerate(info.regions):
            nbytes = blocks * region.block_len
            local = local_regions[index]
            offset = 16 * local.block_len + info.rank * nbytes  # inside the local region
            assert offset + nbytes <= local.block_len * local.num_blocks
            loc.append((local.base_address + offset, nbytes, local.device_id))
            rem.append((region.base_address, nbytes, region.device_id))
    loc_rows, rem_rows = np.array(loc, np.uint64), np.array(rem, np.uint64)
    out = []
    for _ in range(repeats + 1):
        begin = time.perf_counter()
        handle = engine.agent.read(loc_rows, rem_rows, remote_name)
        deadline = time.monotonic() + WAIT_S
        while engine.agent.state(handle) != "DONE":
            if time.monotonic() > deadline:
                raise TimeoutError("bare READ did not complete")
        out.append(time.perf_counter() - begin)
        engine.agent.release(handle)
    return out[1:]


if __name__ == "__main__":
    main()
