"""The `jaxkv` command: allocate a paged KV cache, run every block op through jit on the
available devices, check the bytes against numpy, and report what happened and how fast.

Example:
  jaxkv --layout=LKHTD --dtype=bfloat16 --num_blocks=512 --tp=4
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

from absl import app, flags

from jaxkv._cliutil import check_compiled_modules, quiet_startup_logging, show_module_flags_in_help

FLAGS = flags.FLAGS
_log = logging.getLogger(__name__)

flags.DEFINE_string("layout", "LKHTD", "Block layout letters or a LAYOUT_PRESETS name.")
flags.DEFINE_string("dtype", "bfloat16", "Cache element type.")
flags.DEFINE_integer("num_layers", 4, "Layers in the cache.")
flags.DEFINE_integer("num_kv_heads", 8, "KV heads of the model.")
flags.DEFINE_integer("head_dim", 128, "Elements per head.")
flags.DEFINE_integer("block_size", 16, "Tokens per block.")
flags.DEFINE_integer("num_blocks", 256, "Blocks in the cache.")
flags.DEFINE_integer("num_ids", 64, "Blocks each op moves.")
flags.DEFINE_integer("tp", 0, "Tensor-parallel size; 0 = every visible device (at most 8).")
flags.DEFINE_integer("cpu_devices", 4, "Host devices to create when running on CPU.")
flags.DEFINE_integer("iters", 5, "Timed repetitions of each op.")
flags.DEFINE_integer("seed", 0, "Seed for the cache contents and ids.")
flags.DEFINE_string("json_out", None, "Also write the report as JSON to this path.")


def _timed(fn: Callable[[], Any], iters: int) -> tuple[Any, float]:
    """Runs `fn` once to compile, then `iters` times; returns the last result and the
    median seconds."""
    import jax

    result = jax.block_until_ready(fn())
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        result = jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return result, statistics.median(times)


def _main(argv: list[str]) -> int:
    del argv
    quiet_startup_logging(bool(FLAGS["verbosity"].present))
    check_compiled_modules()
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "")
            + f" --xla_force_host_platform_device_count={FLAGS.cpu_devices}"
        ).strip()

    import jax
    import numpy as np

    from jaxkv import KVCacheSpec, PagedKVCache, __version__
    from jaxkv._ffi import registered_platforms

    spec = KVCacheSpec(
        num_layers=FLAGS.num_layers,
        num_kv_heads=FLAGS.num_kv_heads,
        head_dim=FLAGS.head_dim,
        block_size=FLAGS.block_size,
        dtype=FLAGS.dtype,
        layout=FLAGS.layout,
    )
    devices = jax.devices()
    tp = FLAGS.tp or min(len(devices), 8)
    if tp > len(devices):
        raise app.UsageError(f"--tp={tp} but only {len(devices)} devices are visible")
    mesh = jax.make_mesh((tp,), ("tp",), devices=devices[:tp])
    rng = np.random.default_rng(FLAGS.seed)

    print(f"jaxkv {__version__} on jax {jax.__version__}: {tp} x {devices[0].platform} "
          f"device(s); custom calls registered for {', '.join(registered_platforms())}")
    hosts = []
    for shape in [spec.array_shape(FLAGS.num_blocks)] * spec.num_arrays:
        raw = rng.integers(0, 256, size=(*shape, spec.itemsize), dtype=np.uint8)
        hosts.append(raw.view(spec.dtype).reshape(shape))
    cache = PagedKVCache.from_arrays(spec, hosts, mesh=mesh)
    print(f"cache: layout {spec.layout}, {spec.num_arrays} array(s) of "
          f"{cache.arrays[0].shape} {spec.dtype.name}, {cache.nbytes / 2**20:.1f} MiB, heads "
          f"sharded as {cache.partition_spec()} over tp={tp} "
          f"({spec.heads_per_rank(tp)} head(s) per rank)")
    before = cache.shard_buffers()

    n = min(FLAGS.num_ids, FLAGS.num_blocks // 2)
    permutation = rng.permutation(FLAGS.num_blocks).astype(np.int32)
    src, dst = permutation[:n], permutation[n : 2 * n]
    moved_bytes = n * spec.page_nbytes()  # every layer, K and V, all heads

    def bits(a):
        a = np.asarray(a)
        return a.view(np.dtype(f"u{a.dtype.itemsize}"))

    state = {"cache": cache}
    rows = []

    def copy_op():
        state["cache"] = state["cache"].copy_blocks(src, dst)
        return state["cache"].arrays

    _, seconds = _timed(copy_op, FLAGS.iters)
    for host in hosts:
        host[dst] = host[src]
    rows.append(("copy_blocks", seconds, 2 * moved_bytes))

    gathered, seconds = _timed(lambda: state["cache"].gather_blocks(dst), FLAGS.iters)
    gather_ok = all(np.array_equal(bits(g), bits(h[dst])) for g, h in zip(gathered, hosts))
    rows.append(("gather_blocks", seconds, 2 * moved_bytes))

    def scatter_op():
        state["cache"] = state["cache"].scatter_blocks(gathered, src)
        return state["cache"].arrays

    _, seconds = _timed(scatter_op, FLAGS.iters)
    for host in hosts:
        host[src] = host[dst]
    rows.append(("scatter_blocks", seconds, 2 * moved_bytes))

    cache = state["cache"]
    exact = gather_ok and all(
        np.array_equal(bits(a), bits(h)) for a, h in zip(cache.arrays, hosts)
    )
    try:
        cache.verify_unmoved(before)
        in_place = True
    except Exception as error:  # reported, not fatal: the bytes are still checked
        _log.warning("%s", error)
        in_place = False

    print(f"\n{'op':<16}{'blocks':>8}{'MiB moved':>12}{'median ms':>12}{'GB/s':>10}")
    for name, seconds, nbytes in rows:
        print(f"{name:<16}{n:>8}{nbytes / 2**20:>12.1f}{seconds * 1e3:>12.3f}"
              f"{nbytes / seconds / 1e9:>10.2f}")
    print(f"\nbytes match numpy reference: {exact}; cache updated in place: {in_place}")
    report = {
        "jaxkv": __version__,
        "jax": jax.__version__,
        "platform": devices[0].platform,
        "tp": tp,
        "spec": {"layout": spec.layout, "dtype": spec.dtype.name, "num_layers": spec.num_layers,
                 "num_kv_heads": spec.num_kv_heads, "head_dim": spec.head_dim,
                 "block_size": spec.block_size, "num_blocks": FLAGS.num_blocks},
        "ops": [{"op": name, "blocks": n, "bytes_read_written": nbytes,
                 "median_seconds": seconds, "gb_per_s": nbytes / seconds / 1e9}
                for name, seconds, nbytes in rows],
        "bytes_match": exact,
        "in_place": in_place,
    }
    if FLAGS.json_out:
        with open(FLAGS.json_out, "w") as out:
            json.dump(report, out, indent=2)
        print(f"report written to {FLAGS.json_out}")
    return 0 if exact and in_place else 1


def run() -> None:
    """Console-script entry point (`jaxkv`, `python -m jaxkv`)."""
    show_module_flags_in_help(__name__, __doc__)
    app.run(_main)


if __name__ == "__main__":
    run()
