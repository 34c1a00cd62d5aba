"""Benchmarks integrity digests (`jaxkv.transfer._digest`): the same pull of one request
between two processes without digests, with ``digests="full"`` and with ``"sampled:K"``.

One producer process holds one engine per digest mode (`MODES`), this process one consumer
engine per mode (the handshake requires equal modes); all producer engines register the same
CPU cache, all consumer engines the same landing cache. Rounds alternate the modes so that
all see the same machine load. Per mode:

* ``pull_ms``: start_read -> `poll` reports the read finished (planning, READs, Done/Ack,
  the consumer's verification included), the consumer polling in a loop;
* ``land_ms``: start_read -> every READ complete (`TransferRecord.duration_s`: digests play
  no part in it);
* ``confirm_ms``: the part of the pull after the bytes landed (`TransferRecord.confirm_s`:
  the producers' Acks and the consumer's digests, which overlap the Ack round trip);
* ``publish_ms``: `publish_request` on the producer (its digests included);
* ``producer_digest_ms``: the producer's digest time alone (`TransferStats.digest_s_total`
  per publication);
* ``consumer_digest_ms``: the consumer's digest time alone (inside the pull);
* ``xxh3_floor_ms``: the physical limit, xxh3 alone over the bytes one side digests per read
  (the same number of 1 MiB blocks of the consumer's cache), measured in this process after
  the rounds.

Overheads are ratios of medians against ``off``: ``pull`` (what the consumer sees),
``pull+publish`` (the producer's digest time added, as for a request published right before
its read), each side's digest time and the growth of ``confirm_ms`` as fractions of the
``off`` pull. The READs themselves (``land_ms``) differ by a few percent between engine pairs
whatever their digests (creating the engines in the reverse order moves which pair is
fastest): digests act only after the landing (``confirm_ms``) and at publication. Prints one JSON
object (and writes it with ``--json_out``):

  python benchmarks/bench_digest.py --mib=64 --repeats=15 --transport=nixl \
      --json_out=benchmarks/results/digest_cpu.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing
import os
import platform
import statistics
import sys
import time

os.environ.setdefault("UCX_TLS", "tcp,sm,self")

import numpy as np  # noqa: E402

MODES = ("off", "full", "sampled:4", "sampled:1")


def _spec(mib: int, layout: str = "LKHTD") -> tuple[dict, int]:
    # 1 MiB blocks (16 layers x K/V x 8 heads x 16 tokens x 128 x bf16), `mib` of them: one
    # region per block with LKHTD, 32 regions of 32 KiB (one per layer and K/V) with HTD.
    spec = dict(num_layers=16, num_kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16",
                layout=layout)
    return spec, mib


def producer_main(conn, mib: int, transport: str, layout: str) -> None:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    os.environ["JAX_PLATFORMS"] = "cpu"
    from jaxkv import EngineConfig, KVCacheSpec, PagedKVCache
    from jaxkv.transfer._engine import KVTransferEngine

    spec_kwargs, blocks = _spec(mib, layout)
    spec = KVCacheSpec(**spec_kwargs)
    config = EngineConfig(spec, 1)
    rng = np.random.default_rng(0)
    engines = {}
    # One cache for every mode's engine (and one on the consumer side): the modes then differ
    # only in their digests. With a cache per mode, the pulls differed by up to 15% between
    # modes for reasons of memory placement alone.
    arrays = [rng.integers(0, 2**16, size=spec.array_shape(blocks + 1), dtype=np.uint16)
              .view(spec.dtype) for _ in spec.array_keys()]
    cache = PagedKVCache.from_arrays(spec, arrays)
    for mode in MODES:
        engine = KVTransferEngine(f"prefill-{mode.replace(':', '-')}", config,
                                  transport=transport, digests=mode, lease_s=60.0)
        engine.register_cache(cache)
        engines[mode] = engine
    conn.send({m: e.address for m, e in engines.items()})
    ids = list(range(1, blocks + 1))
    while True:
        if conn.poll(0.0002):
            command = conn.recv()
            if command[0] == "exit":
                break
            if command[0] == "pin":
                _, mode, request_id = command
                engine = engines[mode]
                before = engine.stats.digest_s_total
                t0 = time.perf_counter()
                params = engine.publish_request(request_id, ids)
                publish_s = time.perf_counter() - t0
                conn.send((params, publish_s, engine.stats.digest_s_total - before))
        for engine in engines.values():
            engine.poll()
    for engine in engines.values():
        engine.close()


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--transport", default="nixl", choices=("nixl", "jax"))
    parser.add_argument("--layout", default="LKHTD", choices=("LKHTD", "HTD"))
    parser.add_argument("--json_out", default="")
    args = parser.parse_args()
    load_start = os.getloadavg()
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    import xxhash

    from jaxkv import EngineConfig, KVCacheSpec, PagedKVCache
    from jaxkv.transfer._engine import KVTransferEngine

    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    process = ctx.Process(target=producer_main, args=(child, args.mib, args.transport, args.layout),
                          daemon=True)
    process.start()
    if not parent.poll(300):
        raise TimeoutError("the producer did not start")
    parent.recv()  # the producer's side-channel addresses (its params name them)
    spec_kwargs, blocks = _spec(args.mib, args.layout)
    spec = KVCacheSpec(**spec_kwargs)
    config = EngineConfig(spec, 1)
    consumers = {}
    landing = PagedKVCache.allocate(spec, blocks + 1)
    for mode in MODES:
        engine = KVTransferEngine(f"decode-{mode.replace(':', '-')}", config,
                                  transport=args.transport, digests=mode)
        engine.register_cache(landing)
        consumers[mode] = engine
    local_ids = list(range(1, blocks + 1))
    samples: dict[str, dict[str, list[float]]] = {
        m: {"pull_ms": [], "land_ms": [], "confirm_ms": [], "publish_ms": [],
            "producer_digest_ms": [], "consumer_digest_ms": []} for m in MODES}
    for round_ in range(args.repeats + 1):  # round 0 warms up (handshakes, compilation)
        # each round starts with the next mode: no mode always follows the same one (what a
        # mode leaves in the caches changes the next pull)
        for mode in MODES[round_ % len(MODES):] + MODES[:round_ % len(MODES)]:
            request_id = f"r{round_}"
            parent.send(("pin", mode, request_id))
            if not parent.poll(120):
                raise TimeoutError("the producer did not publish")
            params, publish_s, digest_s = parent.recv()
            engine = consumers[mode]
            before = engine.stats.digest_s_total
            t0 = time.perf_counter()
            engine.start_read(params, local_ids)
            deadline = time.monotonic() + 120
            while True:
                result = engine.poll()
                if result.failed:
                    raise RuntimeError(f"{mode}: {result.failed}")
                if result.finished:
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{mode}: the read did not finish")
            pull_s = time.perf_counter() - t0
            if round_:
                s = samples[mode]
                s["pull_ms"].append(pull_s * 1e3)
                s["land_ms"].append(engine.stats.records[-1].duration_s * 1e3)
                s["confirm_ms"].append(engine.stats.records[-1].confirm_s * 1e3)
                s["publish_ms"].append(publish_s * 1e3)
                s["producer_digest_ms"].append(digest_s * 1e3)
                s["consumer_digest_ms"].append((engine.stats.digest_s_total - before) * 1e3)
    parent.send(("exit",))
    process.join(timeout=30)
    # The physical limit: xxh3 alone over the bytes one side digests per read (the blocks of
    # the consumer's cache one by one, as the digests hash them), same process and load.
    cache = consumers[MODES[-1]].caches[0]
    views = [memoryview(np.ctypeslib.as_array((ctypes.c_uint8 * b.nbytes).from_address(
        b.address))) for b in sorted(cache.shard_buffers(), key=lambda b: b.array_index)]
    block_len = len(views[0]) // cache.num_blocks
    floor: dict[str, float] = {}
    for mode in MODES:
        if mode == "off":
            floor[mode] = 0.0
            continue
        count = blocks if mode == "full" else min(blocks, int(mode.split(":")[1]))
        times = []
        for rep in range(args.repeats):
            # other blocks each time (the 64 MiB do not fit the caches): as cold as a read's
            chosen = [local_ids[(rep * count + j) % blocks] for j in range(count)]
            t0 = time.perf_counter()
            for b in chosen:
                h = xxhash.xxh3_64()  # a block image: its bytes in every region, in order
                for view in views:
                    h.update(view[b * block_len:(b + 1) * block_len])
                h.intdigest()
            times.append((time.perf_counter() - t0) * 1e3)
        floor[mode] = statistics.median(times)
    for engine in consumers.values():
        engine.close()

    med = {m: {k: statistics.median(v) for k, v in s.items()} for m, s in samples.items()}
    for mode in MODES:
        med[mode]["xxh3_floor_ms"] = floor[mode]
    base = med["off"]
    ratios = {
        m: {
            "pull": med[m]["pull_ms"] / base["pull_ms"],
            "pull_plus_publish": (med[m]["pull_ms"] + med[m]["publish_ms"])
            / (base["pull_ms"] + base["publish_ms"]),
            "overhead_pull": med[m]["pull_ms"] / base["pull_ms"] - 1.0,
            "overhead_digests_of_pull": (med[m]["producer_digest_ms"]
                                         + med[m]["consumer_digest_ms"]) / base["pull_ms"],
            "consumer_digest_of_pull": med[m]["consumer_digest_ms"] / base["pull_ms"],
            # what the reader waits for after its bytes landed, beyond the Acks alone
            "confirm_delta_of_pull": (med[m]["confirm_ms"] - base["confirm_ms"])
            / base["pull_ms"],
            "producer_digest_of_pull": med[m]["producer_digest_ms"] / base["pull_ms"],
            "xxh3_floor_of_pull": med[m]["xxh3_floor_ms"] / base["pull_ms"],
        }
        for m in MODES
    }
    out = {
        "benchmark": "bench_digest",
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "loadavg_start": load_start,
        "python": sys.version.split()[0],
        "jax": jax.__version__,
        "numpy": np.__version__,
        "xxhash": xxhash.VERSION,
        "transport": args.transport,
        "layout": args.layout,
        "request_mib": args.mib,
        "repeats": args.repeats,
        "medians": med,
        "ratios_vs_off": ratios,
        "samples": samples,
    }
    out["loadavg_end"] = os.getloadavg()
    text = json.dumps(out, indent=1)
    print(text)
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
