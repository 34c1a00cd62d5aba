"""Benchmark of jaxkv's Pallas TPU kernels, ready to run unchanged on a TPU host.

On TPU (``jax.default_backend() == "tpu"``), for a tpu-inference-shaped cache (one array per
layer ``[pages, page_size, combined_heads // packing, packing, 128]``, bf16) of at least
256 MiB, in one process, interleaved round by round:
  * limit: a device copy of the same number of bytes (XLA copy of a contiguous array);
  * jaxkv: `gather_blocks` / `scatter_blocks` / `copy_blocks` through the Pallas kernels
    (forced with ``jaxkv.ops.implementation("pallas")``), cache donated;
  * tpu-inference's approach: gather with ``cache.at[ids].get()`` (XLA gather) and insert with
    a chunked DMA kernel (runs of consecutive destination pages merged into one DMA each, all
    started on one semaphore, then all waited), written here after its description.
Bandwidth counts bytes read + written; target: jaxkv >= 0.85x the limit. Reported: median GB/s
and the median over rounds of per-round time ratios.

Anywhere else (this project has no TPU) it only checks correctness: every contender runs in
Pallas's TPU interpret mode on small shapes and is compared bit for bit with numpy. No timing is
taken or claimed there.

Usage: python benchmarks/bench_tpu_ops.py --json_out=benchmarks/results/tpu_ops_<backend>.json
"""

from __future__ import annotations

import datetime
import platform
import statistics

from _timing import interleaved_seconds, median_ratio, write_json
from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_integer("cache_mib", 512, "TPU mode: total cache size in MiB (>= 256).")
flags.DEFINE_float("moved_fraction", 0.25, "Fraction of the pages each op moves.")
flags.DEFINE_integer("iters", 20, "TPU mode: timed rounds.")
flags.DEFINE_string("json_out", None, "Where to write the JSON report.")
flags.DEFINE_bool("force_smoke", False, "Run the correctness smoke even on a TPU.")
flags.DEFINE_bool("dry_run", False, "Off TPU: run the timed mode's code path in interpret mode "
                  "on a tiny cache (64 pages, at most 3 rounds; checks that it runs and that "
                  "its programs are exact; its numbers mean nothing).")


def chunked_insert(cache, blocks, starts, dst_starts, sizes, num_chunks, *, interpret):
    """tpu-inference-style insert: DMA ``blocks[starts[i] : starts[i] + sizes[i]]`` to
    ``cache[dst_starts[i] : ...]`` for ``i < num_chunks``; every DMA shares one semaphore;
    all are started, then all waited. Chunk sizes are dynamic (SMEM scalars)."""
    import jax
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    def kernel(count_ref, src_ref, dst_ref, size_ref, blocks_ref, _, out_ref, sem):
        def copy(i):
            return pltpu.make_async_copy(
                blocks_ref.at[pl.ds(src_ref[i], size_ref[i])],
                out_ref.at[pl.ds(dst_ref[i], size_ref[i])], sem)

        def start(i, carry):
            copy(i).start()
            return carry

        def wait(i, carry):
            copy(i).wait()
            return carry

        jax.lax.fori_loop(0, count_ref[0], start, 0)
        jax.lax.fori_loop(0, count_ref[0], wait, 0)

    any_spec = pl.BlockSpec(memory_space=getattr(pl, "ANY", None) or pltpu.HBM)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(cache.shape, cache.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4, grid=(1,), in_specs=[any_spec, any_spec],
            out_specs=any_spec, scratch_shapes=[pltpu.SemaphoreType.DMA(())]),
        input_output_aliases={5: 0},
        interpret=pltpu.InterpretParams() if interpret else False,
    )(num_chunks, starts, dst_starts, sizes, blocks, cache)


def chunks_of(ids):
    """Runs of consecutive ids: (row starts, id starts, lengths) as int32 arrays."""
    import numpy as np

    starts, dst, sizes = [], [], []
    for row, block in enumerate(ids):
        if sizes and block == dst[-1] + sizes[-1]:
            sizes[-1] += 1
        else:
            starts.append(row)
            dst.append(int(block))
            sizes.append(1)
    as32 = lambda x: np.asarray(x, np.int32)  # noqa: E731
    return as32(starts), as32(dst), as32(sizes), as32([len(sizes)])


def _ids(num_pages, moved, seed):
    import numpy as np

    rng = np.random.default_rng(seed)
    # Pages of a request tend to be allocated in runs: runs of 1-8 consecutive pages.
    ids, taken = [], set()
    while len(ids) < moved:
        start = int(rng.integers(0, num_pages - 8))
        run = [p for p in range(start, start + int(rng.integers(1, 9))) if p not in taken]
        run = run[: moved - len(ids)]
        ids += run
        taken.update(run)
    return np.asarray(ids, np.int32)


def numpy_merge(host, ids, ratio, src, dst, mask):
    """Each listed block's bytes read as ``[ratio, *src axes (T / ratio tokens)]``, written in
    `dst` order, padding (False in `mask`) zeroed: the reference for the packed rewrite."""
    import numpy as np

    out = host.copy()
    sizes = dict(zip(dst, host.shape[1:]))
    sizes["T"] //= ratio
    names = ["R", *src]
    order = [x for a in dst for x in (("R", "T") if a == "T" else (a,))]
    for b in ids:
        block = host[b].reshape([ratio] + [sizes[a] for a in src])
        block = block.transpose([names.index(x) for x in order]).reshape(host.shape[1:])
        out[b] = np.where(mask, block, np.zeros((), block.dtype))
    return out


def _smoke(report):
    """Interpret mode on small shapes: every contender against numpy, bit for bit."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxkv

    spec = jaxkv.KVCacheSpec.for_tpu_inference(1, num_kv_heads=2, head_dim=128, page_size=8,
                                               dtype="bfloat16")
    pages = 16
    rng = np.random.default_rng(0)
    host = rng.integers(0, 1 << 16, size=(pages, *spec.block_shape()), dtype=np.uint16)
    host = host.view(jnp.bfloat16)
    ids = _ids(pages, 6, 1)
    dst = np.setdiff1d(np.arange(pages), ids)[:6].astype(np.int32)
    checks = {}
    with jaxkv.ops.implementation("pallas"):
        got = jaxkv.ops.gather_blocks(jnp.asarray(host), ids)
        checks["jaxkv gather (pallas interpret)"] = np.array_equal(
            np.asarray(got).view(np.uint16), host[ids].view(np.uint16))
        blocks = np.asarray(got)
        expected = host.copy()
        expected[dst] = blocks
        out = jaxkv.ops.scatter_blocks(jnp.asarray(host), jnp.asarray(blocks), dst)
        checks["jaxkv scatter (pallas interpret)"] = np.array_equal(
            np.asarray(out).view(np.uint16), expected.view(np.uint16))
        out = jaxkv.ops.copy_blocks(jnp.asarray(host), ids, dst)
        checks["jaxkv copy (pallas interpret)"] = np.array_equal(
            np.asarray(out).view(np.uint16), expected.view(np.uint16))
        # The packed rewrite: head-major sender pages of half the page size into
        # tpu-inference's token-major blocks, phantom heads and padded lanes zeroed.
        packed = jaxkv.KVCacheSpec.for_tpu_inference(1, num_kv_heads=3, head_dim=64,
                                                     page_size=8, dtype="float8_e4m3fn")
        raw = rng.integers(0, 256, size=(pages, *packed.block_shape()), dtype=np.uint8)
        merged = jaxkv.ops.merge_blocks(
            jnp.asarray(raw.view(packed.dtype)), ids, 2, "HhTD", packed.stored_layout,
            packed_size=packed.axis_sizes()["H"], head_dim=packed.head_dim)
        checks["jaxkv packed merge (pallas interpret)"] = np.array_equal(
            np.asarray(merged).view(np.uint8),
            numpy_merge(raw, ids, 2, "HhTD", "THhD", packed.payload_mask()))
    gathered = jax.jit(lambda c, i: c.at[i].get())(jnp.asarray(host), ids)
    checks["cache.at[ids].get()"] = np.array_equal(np.asarray(gathered).view(np.uint16),
                                                   host[ids].view(np.uint16))
    chunks = chunks_of(dst)
    inserted = jax.jit(lambda c, b, *ch: chunked_insert(c, b, *ch, interpret=True))(
        jnp.asarray(host), jnp.asarray(blocks), *chunks)
    checks["chunked DMA insert (interpret)"] = np.array_equal(
        np.asarray(inserted).view(np.uint16), expected.view(np.uint16))
    report.update(mode="correctness smoke (Pallas TPU interpret mode; no timing)",
                  block_shape=list(spec.block_shape()), checks=checks)
    for name, ok in checks.items():
        print(f"{name:40s} {'exact' if ok else 'MISMATCH'}")
    if not all(checks.values()):
        raise SystemExit("a contender differs from numpy")


def _timed(report):
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxkv

    spec = jaxkv.KVCacheSpec.for_tpu_inference(1, num_kv_heads=8, head_dim=128, page_size=32,
                                               dtype="bfloat16")
    block_bytes = spec.block_nbytes()
    pages = max(64, (FLAGS.cache_mib << 20) // block_bytes)
    iters = FLAGS.iters
    if FLAGS.dry_run:  # interpret mode: a tiny cache and a few rounds
        pages, iters = 64, min(iters, 3)
    moved = max(8, int(pages * FLAGS.moved_fraction) // 2 * 2)
    ids = _ids(pages, moved, 1)
    dst = np.setdiff1d(np.arange(pages), ids)
    dst = dst[np.random.default_rng(2).permutation(dst.size)[:moved]].astype(np.int32)
    dst_sorted = np.sort(dst)
    interpret = jax.default_backend() != "tpu"
    cache = jnp.zeros((pages, *spec.block_shape()), spec.dtype)
    blocks = jnp.ones((moved, *spec.block_shape()), spec.dtype)
    flat = jnp.zeros((moved * block_bytes // 2,), jnp.bfloat16)
    moved_bytes = 2 * moved * block_bytes  # read + write
    state = {"cache": cache}

    copy_limit = jax.jit(lambda x: x.copy())
    # Traced (on first call) inside the implementation("pallas") block below.
    gather = jax.jit(lambda c, i: jaxkv.ops.gather_blocks(c, i))
    scatter = jax.jit(lambda c, b, i: jaxkv.ops.scatter_blocks(c, b, i), donate_argnums=0)
    copy = jax.jit(lambda c, s, d: jaxkv.ops.copy_blocks(c, s, d), donate_argnums=0)
    xla_get = jax.jit(lambda c, i: c.at[i].get())
    insert = jax.jit(lambda c, b, *ch: chunked_insert(c, b, *ch, interpret=interpret),
                     donate_argnums=0)
    chunks = [jnp.asarray(x) for x in chunks_of(dst_sorted)]
    ids_d, dst_d, dst_sorted_d = jnp.asarray(ids), jnp.asarray(dst), jnp.asarray(dst_sorted)

    def stateful(fn, *args):
        def step():
            state["cache"] = fn(state["cache"], *args)
            return state["cache"]
        return step

    # The packed rewrite (head-major sender pages of half the page size into token-major
    # blocks, padding zeroed) against the same rewrite by XLA (the jnp reference), compiled
    # under its implementation here: the implementation is fixed when tracing.
    heads = spec.axis_sizes()["H"]

    def merge_fn(c, i):
        return jaxkv.ops.merge_blocks(c, i, 2, "HhTD", spec.stored_layout, packed_size=heads,
                                      head_dim=spec.head_dim, validate_ids=False)

    with jaxkv.ops.implementation("reference"):
        xla_merge = jax.jit(merge_fn, donate_argnums=0).lower(cache, ids_d).compile()
    merge = jax.jit(merge_fn, donate_argnums=0)

    with jaxkv.ops.implementation("pallas"):
        steps = {
            "limit: device copy": lambda: copy_limit(flat),
            "jaxkv gather": lambda: gather(state["cache"], ids_d),
            "cache.at[ids].get()": lambda: xla_get(state["cache"], ids_d),
            "jaxkv scatter": stateful(scatter, blocks, dst_sorted_d),
            "chunked DMA insert": stateful(insert, blocks, *chunks),
            "jaxkv copy": stateful(copy, ids_d, dst_d),
            "jaxkv packed merge": stateful(merge, ids_d),
            "XLA packed merge (jnp)": stateful(xla_merge, ids_d),
        }
        times = interleaved_seconds(steps, iters)
        # The compiled programs just timed, on random bytes, against numpy (on a TPU this is
        # the only check of the compiled kernels).
        checks = _verify(spec, pages, dict(gather=gather, xla_get=xla_get, scatter=scatter,
                                           insert=insert, copy=copy, merge=merge,
                                           xla_merge=xla_merge),
                         ids, dst, dst_sorted, chunks)
    limit = times["limit: device copy"]
    results = {}
    for name, seconds in times.items():
        results[name] = dict(
            median_gbps=moved_bytes / statistics.median(seconds) / 1e9,
            vs_limit=1 / median_ratio(seconds, limit),
        )
        if name.startswith("jaxkv") and not interpret:
            results[name]["meets_target"] = results[name]["vs_limit"] >= 0.85
        print(f"{name:24s} {results[name]['median_gbps']:8.1f} GB/s  "
              f"{results[name]['vs_limit']:.2f}x of the device copy")
    mode = "dry run (interpret mode; not a timing)" if interpret else "timed on TPU"
    report.update(mode=mode, pages=int(pages), moved_pages=int(moved), rounds=int(iters),
                  block_bytes=int(block_bytes), results=results, target="jaxkv >= 0.85x limit",
                  checks=checks)
    for name, ok in checks.items():
        print(f"{name:40s} {'exact' if ok else 'MISMATCH'}")
    if not all(checks.values()):
        raise SystemExit("a timed program differs from numpy")


def _verify(spec, pages, fns, ids, dst, dst_sorted, chunks):
    """Runs the timed programs once on random bytes and compares with numpy, bit for bit."""
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(3)
    shape = (pages, *spec.block_shape())
    host = rng.integers(0, 1 << 16, size=shape, dtype=np.uint16)
    blocks = rng.integers(0, 1 << 16, size=(len(ids), *shape[1:]), dtype=np.uint16)

    def device(x):
        return jnp.asarray(x.view(jnp.bfloat16))

    def same(got, want):
        return bool(np.array_equal(np.asarray(got).view(np.uint16), want))

    scattered = host.copy()
    scattered[dst_sorted] = blocks
    copied = host.copy()
    copied[dst] = host[ids]
    checks = {
        "jaxkv gather": same(fns["gather"](device(host), jnp.asarray(ids)), host[ids]),
        "cache.at[ids].get()": same(fns["xla_get"](device(host), jnp.asarray(ids)), host[ids]),
        "jaxkv scatter": same(fns["scatter"](device(host), device(blocks),
                                             jnp.asarray(dst_sorted)), scattered),
        "chunked DMA insert": same(fns["insert"](device(host), device(blocks), *chunks),
                                   scattered),
        "jaxkv copy": same(fns["copy"](device(host), jnp.asarray(ids), jnp.asarray(dst)),
                           copied),
    }
    merged = numpy_merge(host, ids, 2, "HhTD", spec.stored_layout, spec.payload_mask())
    checks["jaxkv packed merge"] = same(fns["merge"](device(host), jnp.asarray(ids)), merged)
    checks["XLA packed merge (jnp)"] = same(fns["xla_merge"](device(host), jnp.asarray(ids)),
                                            merged)
    return {f"{name} (timed program)": ok for name, ok in checks.items()}


def _main(argv):
    del argv
    import jax

    import jaxkv

    backend = jax.default_backend()
    report = dict(
        benchmark="bench_tpu_ops", backend=backend, devices=[str(d) for d in jax.devices()],
        jax=jax.__version__, jaxkv=jaxkv.__version__, python=platform.python_version(),
        machine=platform.machine(), date=datetime.date.today().isoformat(),
    )
    if (backend == "tpu" and not FLAGS.force_smoke) or FLAGS.dry_run:
        _timed(report)
    else:
        _smoke(report)
    write_json(report, FLAGS.json_out)


if __name__ == "__main__":
    app.run(_main)
