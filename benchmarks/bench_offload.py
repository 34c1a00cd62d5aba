"""Benchmark of jaxkv's offload tiers against plain copies of the same bytes, in one run.

Host tier: `OffloadManager.offload` (device blocks -> host slots) and `onboard` (host slots ->
device blocks), each one `copy_block_prefix` custom call per cache array, against numpy copying
the same blocks between two preallocated arrays (``dst[slots] = src[ids]``).

File tier: `write_file` (host slots -> one file per block: header, payload, checksum, optional
fsync, rename), `read_file` (file -> host slots, checksum verified; its future waited for at
once) and `read_file_now` (the same read on the calling thread), for each payload backend
(NIXL's POSIX backend, plain files), against plain Python file I/O of the same bytes (open, write
the numpy block, [fsync,] close / open, readinto, close). Written blocks get fresh hashes every
round (content-addressed: a repeated hash is not rewritten), and the size budget holds two rounds,
so evictions (unlinks) are part of the measured writes. The files live in --directory (default:
a temporary directory; the page cache makes reads memory-speed).

The contenders run interleaved, round by round (benchmarks/_timing.py); reported: median GB/s
(bytes of the blocks moved, counted once) and the median over rounds of the time ratio
jaxkv / plain (< 1.25 meets the >= 0.8x throughput target).

Usage: python benchmarks/bench_offload.py --json_out=benchmarks/results/offload_cpu.json
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shutil
import statistics
import tempfile

from _timing import interleaved_seconds, median_ratio, write_json
from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_integer("block_kib", 512, "Bytes of one block (all layers, K and V), in KiB.")
flags.DEFINE_integer("host_blocks", 64, "Blocks moved per host-tier call.")
flags.DEFINE_integer("file_blocks", 16, "Blocks moved per file-tier call.")
flags.DEFINE_integer("iters", 10, "Timed rounds.")
flags.DEFINE_string("directory", None, "Where the file tier writes (default: a temp dir).")
flags.DEFINE_string("json_out", None, "Where to write the JSON report.")

TARGET_RATIO = 1.25  # jaxkv time / plain time <= 1.25  <=>  throughput >= 0.8x.


def _main(argv):
    del argv
    import jax
    import numpy as np

    from jaxkv import KVCacheSpec, PagedKVCache
    from jaxkv.offload import FileTier, OffloadManager
    from jaxkv.transfer import nixl_available

    # LKHTD bfloat16, 8 layers x 8 heads x 128 x block_size: block_kib KiB per block.
    block_size = FLAGS.block_kib * 1024 // (8 * 2 * 8 * 128 * 2)
    spec = KVCacheSpec(num_layers=8, num_kv_heads=8, head_dim=128, block_size=block_size,
                       dtype="bfloat16", layout="LKHTD")
    block_nbytes = spec.block_nbytes()
    num_blocks = 2 * FLAGS.host_blocks + 1
    rng = np.random.default_rng(0)
    data = rng.integers(0, 2**16, spec.array_shape(num_blocks), dtype=np.uint16).view(spec.dtype)
    cache = PagedKVCache.from_arrays(spec, [data])
    n = FLAGS.host_blocks
    ids = rng.permutation(num_blocks)[:n].astype(np.int32)
    slots = rng.permutation(n).astype(np.int32)
    results: dict = {"host": {}, "file": {}}
    checks: dict = {}

    # ---- host tier
    offloader = OffloadManager(cache, n)
    state = {"cache": cache}
    np_src = np.asarray(data).copy()
    np_dst = np.zeros((n, *np_src.shape[1:]), np_src.dtype)

    def offload():
        offloader.offload(state["cache"], ids, slots)
        return offloader.pool.arrays

    def onboard():
        state["cache"] = offloader.onboard(state["cache"], slots, ids)
        return state["cache"].arrays

    def numpy_offload():
        np_dst[slots] = np_src[ids]

    def numpy_onboard():
        np_src[ids] = np_dst[slots]

    times = interleaved_seconds({"offload": offload, "numpy_offload": numpy_offload,
                                 "onboard": onboard, "numpy_onboard": numpy_onboard},
                                FLAGS.iters)
    moved = n * block_nbytes
    for op in ("offload", "onboard"):
        ratio = median_ratio(times[op], times[f"numpy_{op}"])
        results["host"][op] = {
            "blocks": n, "mib": moved / 2**20,
            "jaxkv_gbps": moved / statistics.median(times[op]) / 1e9,
            "numpy_gbps": moved / statistics.median(times[f"numpy_{op}"]) / 1e9,
            "time_ratio_vs_numpy": ratio, "throughput_vs_numpy": 1 / ratio,
        }
        checks[f"host_{op}_ge_0.8x"] = ratio <= TARGET_RATIO
    offloader.wait()
    pool_bytes = np.asarray(offloader.pool.arrays[0])
    checks["host_bytes_match"] = bool(
        (pool_bytes[slots].view(np.uint16) == np.asarray(data)[ids].view(np.uint16)).all())

    # ---- file tier
    root = FLAGS.directory or tempfile.mkdtemp(prefix="jaxkv-bench-offload-")
    m = FLAGS.file_blocks
    backends = ["nixl", "files"] if nixl_available() else ["files"]
    plain_dir = os.path.join(root, "plain")
    os.makedirs(plain_dir, exist_ok=True)
    plain_blocks = [np_src[i].copy() for i in range(m)]
    plain_outs = [np.empty_like(block) for block in plain_blocks]
    for durable in (False, True):
        for backend in backends:
            tier = FileTier(os.path.join(root, f"{backend}-{durable}"), spec=spec,
                            model_id="bench", capacity_bytes=2 * m * (block_nbytes + 4096),
                            backend=backend, durable=durable, create=True)
            manager = OffloadManager(state["cache"], m, file_tier=tier)
            manager.offload(state["cache"], np.arange(m), np.arange(m))
            manager.wait()
            counter = {"round": 0}
            read_slots = np.arange(m)

            def tier_write(counter=counter, manager=manager):
                counter["round"] += 1
                hashes = [b"r%d-b%d" % (counter["round"], i) for i in range(m)]
                counter["last"] = hashes
                return manager.write_file(np.arange(m), hashes).result(120)

            def tier_read(counter=counter, manager=manager, read_slots=read_slots):
                return manager.read_file(counter["last"], read_slots).result(120)

            def tier_read_now(counter=counter, manager=manager, read_slots=read_slots):
                return manager.read_file_now(counter["last"], read_slots)

            def plain_write(durable=durable):
                for i, block in enumerate(plain_blocks):
                    with open(os.path.join(plain_dir, f"{i}.bin"), "wb") as handle:
                        handle.write(block)
                        if durable:
                            handle.flush()
                            os.fsync(handle.fileno())

            def plain_read():
                for i in range(m):
                    with open(os.path.join(plain_dir, f"{i}.bin"), "rb") as handle:
                        handle.readinto(plain_outs[i])

            # Each read is the first read of blocks just written (as in a real tier), so the
            # two jaxkv reads get a write (and the plain reads a plain write) each.
            times = interleaved_seconds({"write": tier_write, "plain_write": plain_write,
                                         "read": tier_read, "plain_read": plain_read,
                                         "write_again": tier_write,
                                         "plain_write_again": plain_write,
                                         "read_now": tier_read_now,
                                         "plain_read_again": plain_read},
                                        FLAGS.iters)
            moved = m * block_nbytes
            key = f"{backend}{'_fsync' if durable else ''}"
            entry = {"backend": tier.backend, "durable": durable, "blocks": m,
                     "mib": moved / 2**20}
            for op in ("write", "read", "read_now"):
                plain_op = "plain_read_again" if op == "read_now" else f"plain_{op}"
                ratio = median_ratio(times[op], times[plain_op])
                entry[op] = {
                    "jaxkv_gbps": moved / statistics.median(times[op]) / 1e9,
                    "plain_gbps": moved / statistics.median(times[plain_op]) / 1e9,
                    "time_ratio_vs_plain": ratio, "throughput_vs_plain": 1 / ratio,
                }
                checks[f"file_{key}_{op}_ge_0.8x"] = ratio <= TARGET_RATIO
            entry["stats"] = vars(tier.stats).copy()
            results["file"][key] = entry
            checks[f"file_{key}_reads_verified"] = tier.stats.corrupt == 0 and all(
                manager.read_file(counter["last"], read_slots).result(120))
            manager.close()
    if FLAGS.directory is None:
        shutil.rmtree(root, ignore_errors=True)

    import importlib.metadata as metadata

    def version(name):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    report = {
        "benchmark": "bench_offload",
        "date": datetime.date.today().isoformat(),
        "machine": {"platform": jax.devices()[0].platform, "cpu_count": os.cpu_count(),
                    "python": platform.python_version(),
                    "processor": platform.processor() or platform.machine()},
        "versions": {"jax": jax.__version__, "numpy": np.__version__,
                     "nixl": version("nixl-cu13")},
        "config": {"block_bytes": block_nbytes, "layout": spec.layout, "dtype": "bfloat16",
                   "host_blocks": n, "file_blocks": m, "iters": FLAGS.iters},
        "host": results["host"], "file": results["file"], "checks": checks,
        "all_targets_pass": all(v for k, v in checks.items()),
    }
    print(f"block {block_nbytes / 2**10:.0f} KiB; host tier {n} blocks per call, file tier "
          f"{m} blocks per call; {FLAGS.iters} interleaved rounds, medians")
    print(f"{'op':34s} {'jaxkv GB/s':>10s} {'plain GB/s':>10s} {'throughput':>10s}")
    for op, r in results["host"].items():
        print(f"{'host ' + op + ' vs numpy copy':34s} {r['jaxkv_gbps']:10.2f} "
              f"{r['numpy_gbps']:10.2f} {r['throughput_vs_numpy']:9.2f}x")
    for key, entry in results["file"].items():
        for op in ("write", "read", "read_now"):
            r = entry[op]
            print(f"{'file ' + key + ' ' + op:34s} {r['jaxkv_gbps']:10.2f} "
                  f"{r['plain_gbps']:10.2f} {r['throughput_vs_plain']:9.2f}x")
    print("checks:", json.dumps(checks))
    write_json(report, FLAGS.json_out)


if __name__ == "__main__":
    app.run(_main)
