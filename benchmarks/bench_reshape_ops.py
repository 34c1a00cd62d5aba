"""Benchmark of jaxkv's reshaping ops against the physical limit, the jnp reference and vLLM's
torch way.

For each op, on at least 256 MiB of blocks (`--moved_mib`), in one process:
  * jaxkv: the custom call under jit, cache (or staging buffers) donated, so in place;
  * limit: a plain copy of the same bytes (numpy `copyto` into a preallocated buffer on CPU; an
    elementwise device kernel reading and writing the same bytes on GPU); for an op returning
    new buffers, also the copy into a newly allocated numpy array (the kernel must fault in and
    zero fresh pages either way);
  * jnp: the pure-jnp reference (`jaxkv.ops.reference`: gather, transpose, scatter) under jit,
    cache donated;
  * torch (permute and merge, CPU): vLLM's post-processing, ``index_select`` -> ``permute`` ->
    ``index_copy_`` on a torch tensor of the same bytes (skipped, with a note, without torch).
Ops:
  * permute_blocks: vLLM FlashAttention blocks ``[T, H, D]`` received as ``HTD`` -> ``THD``;
  * merge_blocks: the same blocks, 2 sender blocks of T/2 tokens each (``HTD`` -> ``THD``);
  * copy_block_prefix: cross-layer ``LKHTD`` blocks, first half of the tokens, inside one cache;
  * split_for_peers: cross-layer blocks of a TP=1 sender into the 2 buffers of a TP=2 receiver,
    into reused staging buffers (``out=``) and into new buffers;
  * concat_from_peers: the inverse, 2 TP=2 buffers into a TP=1 receiver cache.
Bandwidth counts bytes read + bytes written of what the op moves. The contenders run
interleaved, round by round, after a warm-up, in two phases (jaxkv with the limits, then jaxkv
with the jnp and torch alternatives); reported: median GB/s of each, and the median over
rounds of the per-round time ratios (robust to background load). Writes JSON (--json_out).

Usage: python benchmarks/bench_reshape_ops.py --json_out=benchmarks/results/reshape_ops_cpu.json
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics

from _timing import interleaved_seconds, median_ratio, write_json
from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_integer("moved_mib", 256, "MiB of blocks each op processes (>= 256 for records).")
flags.DEFINE_float("spare_fraction", 0.25, "Extra blocks in the cache beyond the moved ones.")
flags.DEFINE_string("dtype", "bfloat16", "Cache dtype.")
flags.DEFINE_integer("iters", 10, "Timed rounds per op.")
flags.DEFINE_list("ops", ["permute_blocks", "merge_blocks", "copy_block_prefix",
                          "split_for_peers", "split_for_peers (new buffers)",
                          "concat_from_peers"], "Ops to run.")
flags.DEFINE_bool("torch", True, "Include the torch contender where it applies.")
flags.DEFINE_string("json_out", None, "Where to write the JSON report.")


def _main(argv):
    del argv
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxkv
    from jaxkv import EngineConfig, KVCacheSpec, ops
    from jaxkv.ops import reference

    try:
        import torch
    except ImportError:
        torch = None
    device = jax.devices()[0]
    on_cpu = device.platform == "cpu"
    use_torch = FLAGS.torch and torch is not None and on_cpu
    notes = []
    if FLAGS.torch and not use_torch:
        notes.append("torch column skipped: " + ("torch is not installed" if torch is None
                                                 else "CPU torch only, device is not a CPU"))
    rng = np.random.default_rng(0)
    moved_bytes_target = FLAGS.moved_mib * 2**20

    def random_cache(shape, dtype):
        dtype = np.dtype(dtype)
        raw = rng.integers(0, 256, size=int(np.prod(shape)) * dtype.itemsize, dtype=np.uint8)
        return raw.view(dtype).reshape(shape)

    def on_device(host):
        return jax.block_until_ready(jax.device_put(host, device, may_alias=False))

    def limit_for(nbytes):
        if on_cpu:
            src = rng.integers(0, 256, size=nbytes, dtype=np.uint8)
            dst = np.empty_like(src)
            np.copyto(dst, src)  # touch the pages once
            return "numpy copy", lambda: np.copyto(dst, src)
        buffer = jax.device_put(np.zeros(nbytes // 2, np.uint16), device)
        negate = jax.jit(jnp.negative)
        return "device elementwise copy", lambda: negate(buffer)

    def fresh_limit_for(nbytes):
        """The same copy into newly allocated memory, as an op returning new buffers does."""
        if on_cpu:
            src = rng.integers(0, 256, size=nbytes, dtype=np.uint8)
            return "numpy copy (new array)", lambda: src.copy()
        buffer = jax.device_put(np.zeros(nbytes // 2, np.uint16), device)
        negate = jax.jit(jnp.negative)
        return "device elementwise copy (new array)", lambda: negate(buffer)

    # vLLM FlashAttention blocks [T, H, D] (one layer, K or V), received as HTD.
    vllm_spec = KVCacheSpec(num_layers=1, num_kv_heads=8, head_dim=128, block_size=16,
                            dtype=FLAGS.dtype, layout="THD")
    # TensorRT-LLM cross-layer blocks [L, K, H, T, D].
    trt_spec = KVCacheSpec(num_layers=4, num_kv_heads=8, head_dim=128, block_size=16,
                           dtype=FLAGS.dtype, layout="LKHTD")

    def block_ids(spec, tp=1):
        block = spec.block_nbytes(tp)
        moved = max(1, moved_bytes_target // block)
        total = moved + max(1, int(moved * FLAGS.spare_fraction))
        return total, np.sort(rng.permutation(total)[:moved]).astype(np.int32)

    def torch_rearrange(src_layout, dst_layout, ratio, shape):
        """vLLM's way: index_select -> (view, permute) -> index_copy_."""
        dst_sizes = dict(zip(dst_layout, shape))
        src_shape = [ratio] + [dst_sizes[a] // ratio if a == "T" else dst_sizes[a]
                               for a in src_layout]
        order = []
        for axis in dst_layout:
            order += [1, 2 + src_layout.index("T")] if axis == "T" else [2 + src_layout.index(axis)]

        def run(cache, index):
            blocks = cache.index_select(0, index)
            n = blocks.shape[0]
            merged = blocks.view(n, *src_shape).permute(0, *order).reshape(blocks.shape)
            cache.index_copy_(0, index, merged)
            return cache

        return run

    results = {}
    setups = {}
    for op in FLAGS.ops:
        if op in ("permute_blocks", "merge_blocks"):
            spec = vllm_spec
            total, ids = block_ids(spec)
            shape = spec.array_shape(total)
            ratio = 1 if op == "permute_blocks" else 2
            fn = (lambda c, i: ops.permute_blocks(c, i, "HTD", "THD", validate_ids=False)) \
                if ratio == 1 else \
                (lambda c, i: ops.merge_blocks(c, i, 2, "HTD", "THD", validate_ids=False))
            ref = (lambda c, i: reference.permute_blocks(c, i, "HTD", "THD")) if ratio == 1 else \
                (lambda c, i: reference.merge_blocks(c, i, 2, "HTD", "THD"))
            host = random_cache(shape, spec.dtype)
            traffic = 2 * len(ids) * spec.block_nbytes()
            setups[op] = dict(
                traffic=traffic, host=host, args=(jnp.asarray(ids),), donate=0,
                jaxkv=jax.jit(fn, donate_argnums=0), jnp=jax.jit(ref, donate_argnums=0),
                torch=torch_rearrange("HTD", "THD", ratio, spec.block_shape()) if use_torch
                else None, torch_ids=ids,
                setup=dict(layout="HTD -> THD", ratio=ratio, block_bytes=spec.block_nbytes(),
                           num_blocks=total, moved_blocks=len(ids)))
        elif op == "copy_block_prefix":
            spec = trt_spec
            total, _ = block_ids(spec)
            total = 2 * (total // 2)
            perm = rng.permutation(total).astype(np.int32)
            moved = min(total // 2, moved_bytes_target // spec.block_nbytes())
            src, dst = perm[:moved], perm[total // 2: total // 2 + moved]
            tokens = spec.block_size // 2
            host = random_cache(spec.array_shape(total), spec.dtype)
            fn = jax.jit(lambda c, s, d, n=tokens: ops.copy_block_prefix(
                c, c, s, d, n, "LKHTD", validate_ids=False), donate_argnums=0)
            ref = jax.jit(lambda c, s, d, n=tokens: reference.copy_block_prefix(
                c, c, s, d, n, "LKHTD"), donate_argnums=0)
            traffic = 2 * moved * spec.block_nbytes() * tokens // spec.block_size
            setups[op] = dict(
                traffic=traffic, host=host, args=(jnp.asarray(src), jnp.asarray(dst)), donate=0,
                jaxkv=fn, jnp=ref, torch=None,
                setup=dict(layout="LKHTD", num_tokens=tokens, block_size=spec.block_size,
                           block_bytes=spec.block_nbytes(), num_blocks=total, moved_blocks=moved))
        elif op.startswith("split_for_peers"):
            spec = trt_spec
            sender, receiver = EngineConfig(spec, 1), EngineConfig(spec, 2)
            total, ids = block_ids(spec)
            plan = ops.plan_peers(sender, receiver, 0)
            host = random_cache(spec.array_shape(total), spec.dtype)
            traffic = 2 * len(ids) * spec.block_nbytes()
            fresh = op.endswith("(new buffers)")
            if fresh:
                fn = jax.jit(lambda c, i, s=sender, r=receiver: ops.split_for_peers(
                    c, i, s, r, 0, validate_ids=False))
            else:
                fn = jax.jit(lambda c, i, o, s=sender, r=receiver: ops.split_for_peers(
                    c, i, s, r, 0, out=o, validate_ids=False), donate_argnums=2)
            ref = jax.jit(lambda c, i, s=sender, r=receiver: reference.split_for_peers(
                c, i, s, r, 0))
            setups[op] = dict(
                traffic=traffic, host=host, args=(jnp.asarray(ids),), donate=None,
                staging=None if fresh else plan.buffer_shapes(len(ids)),
                jaxkv=fn, jnp=None if not fresh else ref, torch=None,
                setup=dict(sender_tp=1, receiver_tp=2, buffers=plan.num_buffers,
                           block_bytes=spec.block_nbytes(), num_blocks=total,
                           moved_blocks=len(ids), new_buffers=fresh))
        elif op == "concat_from_peers":
            spec = trt_spec
            sender, receiver = EngineConfig(spec, 2), EngineConfig(spec, 1)
            total, ids = block_ids(spec)
            plan = ops.plan_peers(receiver, sender, 0)
            buffers = [on_device(random_cache(s, spec.dtype))
                       for s in plan.buffer_shapes(len(ids))]
            host = random_cache(spec.array_shape(total), spec.dtype)
            traffic = 2 * len(ids) * spec.block_nbytes()
            fn = jax.jit(lambda c, i, b, s=sender, r=receiver: ops.concat_from_peers(
                c, b, i, r, s, 0, validate_ids=False), donate_argnums=0)
            ref = jax.jit(lambda c, i, b, s=sender, r=receiver: reference.concat_from_peers(
                c, b, i, r, s, 0), donate_argnums=0)
            setups[op] = dict(
                traffic=traffic, host=host, args=(jnp.asarray(ids), buffers), donate=0,
                jaxkv=fn, jnp=ref, torch=None,
                setup=dict(sender_tp=2, receiver_tp=1, buffers=plan.num_buffers,
                           block_bytes=spec.block_nbytes(), num_blocks=total,
                           moved_blocks=len(ids)))
        else:
            raise app.UsageError(f"unknown op {op!r}")

    def run(op, s):
        """Times op `op` of setup `s` into `results[op]`; its caches and buffers are freed on
        return, before the next op allocates its own."""
        limit_name, limit_fn = limit_for(s["traffic"] // 2)
        contenders = {limit_name: None, "jaxkv": s["jaxkv"]}
        fresh_limit_name = None
        if s["setup"].get("new_buffers"):
            fresh_limit_name, fresh_limit_fn = fresh_limit_for(s["traffic"] // 2)
            contenders[fresh_limit_name] = None
        if s["jnp"] is not None:
            contenders["jnp reference"] = s["jnp"]
        if s.get("torch") is not None:
            contenders["torch (vLLM)"] = s["torch"]
        state = {}
        for name in contenders:
            if name in (limit_name, fresh_limit_name):
                continue
            if name == "torch (vLLM)":
                t = torch.from_numpy(s["host"].view(np.uint16) if s["host"].dtype.itemsize == 2
                                     else s["host"]).clone()
                if s["host"].dtype.name == "bfloat16":
                    t = t.view(torch.bfloat16)
                state[name] = dict(cache=t, index=torch.from_numpy(s["torch_ids"]).long())
            else:
                state[name] = dict(cache=on_device(s["host"]))
                if s.get("staging") is not None:
                    state[name]["out"] = [jnp.zeros(shape, s["host"].dtype)
                                          for shape in s["staging"]]

        def step_for(name):
            if name == limit_name:
                return limit_fn
            if name == fresh_limit_name:
                return fresh_limit_fn
            st = state[name]
            fn = contenders[name]
            if name == "torch (vLLM)":
                return lambda: fn(st["cache"], st["index"])

            def step():
                if "out" in st:
                    st["out"] = fn(st["cache"], *s["args"], st["out"])
                    return st["out"]
                out = fn(st["cache"], *s["args"])
                if s["donate"] == 0:
                    st["cache"] = out
                return out

            return step

        steps = {name: step_for(name) for name in contenders}
        # Two phases: jaxkv against the copy limit(s), then jaxkv against the alternatives.
        # Running the slow alternatives in the same rounds perturbed the next jaxkv runs on the
        # 2-core VM (after the jnp reference, an XLA scatter over another 320 MiB cache, the
        # next token-prefix copies took up to 2x as long for ~100 ms while numpy copies did
        # not; no thread was busy meanwhile), which is a property of the neighbour, not of the
        # op. The JSON keeps both phases' jaxkv times.
        limits = [limit_name] + ([fresh_limit_name] if fresh_limit_name else [])
        times = interleaved_seconds({n: steps[n] for n in [*limits, "jaxkv"]}, FLAGS.iters)
        others = [n for n in steps if n not in limits and n != "jaxkv"]
        alt_times = interleaved_seconds({n: steps[n] for n in ["jaxkv", *others]}, FLAGS.iters) \
            if others else {}
        row = {"setup": s["setup"], "traffic_bytes": s["traffic"], "limit": limit_name}
        if alt_times:
            row["jaxkv (alternatives phase)"] = {
                "median_seconds": statistics.median(alt_times["jaxkv"]),
                "gb_per_s": s["traffic"] / statistics.median(alt_times["jaxkv"]) / 1e9}
        times = {**{n: alt_times[n] for n in others}, **times}
        for name, samples in times.items():
            row[name] = {"median_seconds": statistics.median(samples),
                         "gb_per_s": s["traffic"] / statistics.median(samples) / 1e9}
        row["jaxkv_vs_limit"] = median_ratio(times[limit_name], times["jaxkv"])
        if fresh_limit_name is not None:
            row["fresh_limit"] = fresh_limit_name
            row["jaxkv_vs_fresh_limit"] = median_ratio(times[fresh_limit_name], times["jaxkv"])
        for other, key in (("jnp reference", "jaxkv_vs_jnp"), ("torch (vLLM)", "jaxkv_vs_torch")):
            if other in alt_times:
                row[key] = median_ratio(alt_times[other], alt_times["jaxkv"])
        results[op] = row
        print(f"{op:<32} limit {row[limit_name]['gb_per_s']:6.2f} GB/s  jaxkv "
              f"{row['jaxkv']['gb_per_s']:6.2f} GB/s  vs limit {row['jaxkv_vs_limit']:.2f}  "
              f"vs jnp {row.get('jaxkv_vs_jnp', float('nan')):6.2f}  "
              f"vs torch {row.get('jaxkv_vs_torch', float('nan')):6.2f}"
              + (f"  vs {fresh_limit_name} {row['jaxkv_vs_fresh_limit']:.2f}"
                 if fresh_limit_name else ""), flush=True)

    for op, s in setups.items():
        run(op, s)

    report = {
        "benchmark": "reshape_ops",
        "date": datetime.date.today().isoformat(),
        "machine": {"platform": device.platform, "device": str(device.device_kind),
                    "cpu_count": os.cpu_count(), "python": platform.python_version(),
                    "processor": platform.processor() or platform.machine()},
        "versions": {"jax": jax.__version__, "jaxkv": jaxkv.__version__,
                     "numpy": np.__version__,
                     "torch": torch.__version__ if torch is not None else None},
        "setup": {"moved_mib": FLAGS.moved_mib, "dtype": FLAGS.dtype, "iters": FLAGS.iters},
        "notes": notes,
        "results": results,
    }
    for note in notes:
        print("note:", note)
    write_json(report, FLAGS.json_out)


if __name__ == "__main__":
    app.run(_main)
