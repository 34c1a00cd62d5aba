"""Benchmark of jaxkv's block ops against the physical limit and the jnp alternative.

For each op (copy, gather, scatter) on a cache of at least 256 MiB, in one process:
  * jaxkv: the custom call under jit, cache donated (in place);
  * limit: a plain copy of the same bytes (numpy `copyto` into a preallocated buffer on CPU; an
    elementwise device kernel reading and writing the same bytes on GPU);
  * jnp: the pure-jnp reference (XLA gather/scatter) under jit, cache donated.
"gather_blocks" allocates its output every call (on CPU a fresh multi-MiB buffer is
page-faulted in, and zeroed by the kernel, each time), so on CPU it is also compared with
numpy doing the same job, `np.take` into a new array; "gather_blocks (out=)" writes into a
reused, donated buffer.
Bandwidth counts bytes read + bytes written. The contenders run interleaved, round by round,
after a warm-up; reported: median GB/s of each, and the median over rounds of the per-round
time ratios (robust to background load). Writes JSON (--json_out) with machine and versions.

Usage: python benchmarks/bench_block_ops.py --json_out=benchmarks/results/block_ops_cpu.json
"""

from __future__ import annotations

import datetime
import functools
import os
import platform
import statistics

from _timing import interleaved_seconds, median_ratio, write_json
from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_integer("cache_mib", 256, "Cache size in MiB (at least 256 for recorded results).")
flags.DEFINE_float("moved_fraction", 0.25, "Fraction of the blocks each op moves.")
flags.DEFINE_string("dtype", "bfloat16", "Cache dtype.")
flags.DEFINE_integer("iters", 15, "Timed repetitions per measurement.")
flags.DEFINE_string("json_out", None, "Where to write the JSON report.")


def _stateful_step(fn, call, cache, updates, staging):
    """A no-argument step running `call(fn, cache)`; keeps the updated cache (in-place ops) or
    the reused output buffer (`updates == "out"`) for the next round."""
    state = {"cache": cache}

    def step():
        out = call(fn, state["cache"])
        if updates is True:
            state["cache"] = out
        elif updates == "out":
            staging["out"] = out
        return out

    return step


def _main(argv):
    del argv
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxkv
    from jaxkv import KVCacheSpec, ops
    from jaxkv.ops import reference

    device = jax.devices()[0]
    spec = KVCacheSpec(num_layers=4, num_kv_heads=8, head_dim=128, block_size=16,
                       dtype=FLAGS.dtype, layout="LKHTD")
    block_bytes = spec.block_nbytes()
    num_blocks = max(2, (FLAGS.cache_mib * 2**20) // block_bytes)
    moved = max(1, int(num_blocks * FLAGS.moved_fraction))
    rng = np.random.default_rng(0)
    permutation = rng.permutation(num_blocks).astype(np.int32)
    src, dst = jnp.asarray(permutation[:moved]), jnp.asarray(permutation[moved : 2 * moved])
    shape = spec.array_shape(num_blocks)
    moved_bytes = moved * block_bytes
    traffic = 2 * moved_bytes  # read + write

    def fresh_cache():
        raw = rng.integers(0, 256, size=(num_blocks, block_bytes), dtype=np.uint8)
        cache = jax.device_put(raw.view(spec.dtype).reshape(shape), device, may_alias=False)
        return jax.block_until_ready(cache)

    results = {}

    # The physical limit: a plain copy of the same bytes.
    if device.platform == "cpu":
        host_src = rng.integers(0, 256, size=moved_bytes, dtype=np.uint8)
        host_dst = np.empty_like(host_src)
        np.copyto(host_dst, host_src)  # touch the pages once
        limit_fn = lambda: np.copyto(host_dst, host_src)  # noqa: E731
        limit_name = "numpy copy"
    else:
        buffer = jax.device_put(np.zeros(moved_bytes // 2, np.uint16), device)
        negate = jax.jit(jnp.negative)
        limit_fn = lambda: negate(buffer)  # noqa: E731
        limit_name = "device elementwise copy"

    cases = {
        "copy_blocks": (
            jax.jit(lambda c, s, d: ops.copy_blocks(c, s, d, validate_ids=False),
                    donate_argnums=0),
            jax.jit(reference.copy_blocks, donate_argnums=0),
            lambda fn, c: fn(c, src, dst),
            True,
        ),
        "gather_blocks": (
            jax.jit(lambda c, i: ops.gather_blocks(c, i, validate_ids=False)),
            jax.jit(reference.gather_blocks),
            lambda fn, c: fn(c, src),
            False,
        ),
        "gather_blocks (out=)": (
            jax.jit(lambda c, i, o: ops.gather_blocks(c, i, out=o, validate_ids=False),
                    donate_argnums=2),
            None,
            lambda fn, c: fn(c, src, staging["out"]),
            "out",
        ),
        "scatter_blocks": (
            jax.jit(lambda c, b, i: ops.scatter_blocks(c, b, i, validate_ids=False),
                    donate_argnums=0),
            jax.jit(reference.scatter_blocks, donate_argnums=0),
            lambda fn, c: fn(c, blocks, dst),
            True,
        ),
    }
    blocks = jax.block_until_ready(
        jax.device_put(rng.integers(0, 256, size=(moved, block_bytes), dtype=np.uint8)
                       .view(spec.dtype).reshape((moved, *shape[1:])), device))
    staging = {"out": jnp.zeros_like(blocks)}
    for op, (custom, jnp_ref, call, updates) in cases.items():
        # Interleave the contenders round by round, so that each round's ratios compare runs
        # made under the same background load (this machine is shared and noisy).
        contenders = {limit_name: limit_fn, "jaxkv": custom}
        if jnp_ref is not None:
            contenders["jnp reference"] = jnp_ref
        if op == "gather_blocks" and device.platform == "cpu":
            # What numpy pays for the same job: a gather into a newly allocated array.
            host_cache = np.asarray(fresh_cache())
            host_ids = np.asarray(src)
            contenders["numpy take (new array)"] = functools.partial(
                np.take, host_cache, host_ids, axis=0)
        steps = {
            name: fn if name in (limit_name, "numpy take (new array)")
            else _stateful_step(fn, call, fresh_cache(), updates, staging)
            for name, fn in contenders.items()
        }
        times = interleaved_seconds(steps, FLAGS.iters)
        row = results.setdefault(op, {})
        for name, samples in times.items():
            row[name] = {"median_seconds": statistics.median(samples),
                         "gb_per_s": traffic / statistics.median(samples) / 1e9}
        row["jaxkv_vs_limit"] = median_ratio(times[limit_name], times["jaxkv"])
        if "jnp reference" in times:
            row["jaxkv_vs_jnp"] = median_ratio(times["jnp reference"], times["jaxkv"])
        if "numpy take (new array)" in times:
            row["jaxkv_vs_numpy_take"] = median_ratio(times["numpy take (new array)"],
                                                      times["jaxkv"])
        del steps

    report = {
        "benchmark": "block_ops",
        "date": datetime.date.today().isoformat(),
        "machine": {"platform": device.platform, "device": str(device.device_kind),
                    "cpu_count": os.cpu_count(), "python": platform.python_version(),
                    "processor": platform.processor() or platform.machine()},
        "versions": {"jax": jax.__version__, "jaxlib": jax.lib.__version__ if hasattr(
            jax.lib, "__version__") else None, "jaxkv": jaxkv.__version__,
                     "numpy": np.__version__},
        "setup": {"cache_bytes": num_blocks * block_bytes, "block_bytes": block_bytes,
                  "num_blocks": num_blocks, "moved_blocks": moved,
                  "traffic_bytes": traffic, "dtype": spec.dtype.name, "layout": spec.layout,
                  "iters": FLAGS.iters, "limit": limit_name},
        "results": results,
    }
    print(f"{'op':<22}{'limit GB/s':>12}{'jaxkv GB/s':>12}{'jnp GB/s':>10}"
          f"{'vs limit':>10}{'vs jnp':>8}{'vs np.take':>12}")
    for op, row in results.items():
        jnp_gbs = row.get("jnp reference", {}).get("gb_per_s", float("nan"))
        print(f"{op:<22}{row[limit_name]['gb_per_s']:>12.2f}{row['jaxkv']['gb_per_s']:>12.2f}"
              f"{jnp_gbs:>10.2f}{row['jaxkv_vs_limit']:>10.2f}"
              f"{row.get('jaxkv_vs_jnp', float('nan')):>8.2f}"
              f"{row.get('jaxkv_vs_numpy_take', float('nan')):>12.2f}")
    write_json(report, FLAGS.json_out)


if __name__ == "__main__":
    app.run(_main)
