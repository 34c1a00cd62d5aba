"""Benchmarks read planning at scale (`jaxkv.transfer.plan_read`, issue 29): how long one decode
rank takes to turn a request's block ids into its descriptor table, for real geometries.

Cases: vLLM-style per-layer caches (one array per layer and K/V, ``--layout``, default "HTD"),
``--layers`` x ``--heads`` KV heads x ``--head_dim``, block ``--block_size``, bf16, over the TP
pairs of ``--tp_pairs`` (producer -> consumer); prompts of ``--prompts`` tokens; block ids
contiguous (one run on both sides) and fragmented (random blocks of a ``--pool_factor`` x larger
pool on both sides: what a busy pool hands out); plus tpu-inference's packed cache
(`KVCacheSpec.for_tpu_inference`, same sizes) TP 2 -> 1. Only metadata is built (no cache
memory, no NIXL): planning is pure numpy over two `EngineMetadata`.

Timed per case (median of ``--repeats`` runs, each after one untimed warm-up run, so the
per-geometry planner and templates are cached as in an engine's steady state):

* ``plan_ms``: ``plan_read(...)`` plus its descriptor table ``plan.copies`` (int64 ``[N, 9]``):
  the planning the issue-29 target is about (< 50 ms for a 128k-token prompt of an 80-layer
  model).
* ``nixl_lists_ms``: on top of the plan, ``plan.expanded_descriptors`` for every remote rank
  read (the ``Nx3`` lists a NIXL READ is posted with when the request is not posted from
  prepared tables, which caches of this size never are).
* ``formatted_start_ms``: a formatted read's start instead (`jaxkv.transfer._formatted`):
  the plan, its 8 MiB wire chunks per producer rank and each chunk's producer-side ranges as
  its `Format` message carries them (per-block templates where the rows have that form,
  else the rows; ``formatted_message_bytes`` in all).

``bare_read_ms`` is the time a single-descriptor READ of the same bytes takes at
``--wire_gbps`` (default: the bare NIXL READ measured on this machine, 5.8 GB/s,
`bench_packed_transfer.py`, RESULTS.md), so ``plan_fraction`` = ``plan_ms / bare_read_ms``.
Prints one JSON object (and writes it with ``--json_out``):

  python benchmarks/bench_plan.py --json_out=benchmarks/results/plan_after_2026-11-26.json
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import platform
import statistics
import sys
import time

import numpy as np
from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxkv import EngineConfig, KVCacheSpec  # noqa: E402
from jaxkv.transfer._formatted import (  # noqa: E402
    DEFAULT_CHUNK_BYTES,
    block_share_chunks,
    describe_share,
    remote_half,
    template_fields,
)
from jaxkv.transfer._metadata import AgentInfo, RankInfo, RegionInfo, engine_metadata
from jaxkv.transfer._plan import plan_read

_JSON_OUT = flags.DEFINE_string("json_out", None, "Also write the JSON result to this path.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed runs per case (median reported).")
_LAYERS = flags.DEFINE_integer("layers", 80, "Model layers.")
_HEADS = flags.DEFINE_integer("heads", 8, "KV heads.")
_HEAD_DIM = flags.DEFINE_integer("head_dim", 128, "Head dim.")
_BLOCK_SIZE = flags.DEFINE_integer("block_size", 16, "Tokens per block (both engines).")
_LAYOUT = flags.DEFINE_string("layout", "HTD", "Per-layer block layout (HTD: vLLM's HND).")
_TP_PAIRS = flags.DEFINE_list("tp_pairs", ["8:4", "4:8", "2:1", "1:1"],
                              "producer:consumer TP pairs of the per-layer cases.")
_PROMPTS = flags.DEFINE_list("prompts", ["8192", "32768", "131072"], "Prompt lengths (tokens).")
_POOL_FACTOR = flags.DEFINE_integer("pool_factor", 2,
                                    "Registered blocks per engine = factor x the largest prompt.")
_PACKED = flags.DEFINE_bool("packed", True, "Also the tpu-inference packed cache, TP 2 -> 1.")
_NIXL_LISTS = flags.DEFINE_bool("nixl_lists", True, "Also time expanded_descriptors.")
_WIRE_GBPS = flags.DEFINE_float(
    "wire_gbps", 5.8, "Bare READ speed to compare with (GB/s; default: this machine's bare "
    "NIXL READ, bench_packed_transfer.py in RESULTS.md).")
_LABEL = flags.DEFINE_string("label", "", "Free text stored in the JSON (e.g. before/after).")


def fake_metadata(engine_id: str, config: EngineConfig, num_blocks: int):
    """Metadata of an engine whose regions sit at made-up addresses (planning never touches
    memory)."""
    ranks = []
    for rank in range(config.world_size):
        tp_rank, pp_rank = config.coordinates(rank)
        spec = config.local_spec(pp_rank)
        head_start, head_stop = config.head_range(tp_rank)
        layer_start = config.layer_range(pp_rank)[0]
        regions = [
            RegionInfo(
                array_index=i,
                layer=-1 if layer is None else layer + layer_start,
                kv=-1 if kv is None else kv,
                head_start=head_start,
                head_stop=head_stop,
                base_address=(rank << 44) + (i << 36),
                block_len=spec.block_nbytes(config.tp_size),
                num_blocks=num_blocks,
                device_id=tp_rank,
                memory_kind="DRAM",
            )
            for i, (layer, kv) in enumerate(spec.array_keys())
        ]
        ranks.append(RankInfo(rank=rank, agent_name=f"{engine_id}-{rank}", regions=regions))
    agents = [AgentInfo(name=f"{engine_id}-{r}", metadata=b"md")
              for r in range(config.world_size)]
    return engine_metadata(engine_id, config, ranks, agents)


def _median_ms(fn, repeats: int) -> tuple[float, list[float]]:
    fn()  # warm-up: planner, templates and allocator in their steady state
    times = []
    for _ in range(repeats):
        gc.collect()
        begin = time.perf_counter()
        fn()
        times.append((time.perf_counter() - begin) * 1e3)
    return statistics.median(times), times


def bench_case(name: str, spec_p: KVCacheSpec, spec_d: KVCacheSpec, p_tp: int, d_tp: int,
               tokens: int, fragmented: bool, num_blocks: int, repeats: int) -> dict:
    meta_p = fake_metadata("prefill", EngineConfig(spec_p, p_tp), num_blocks)
    meta_d = fake_metadata("decode", EngineConfig(spec_d, d_tp), num_blocks)
    n = -(-tokens // spec_p.block_size)
    rng = np.random.default_rng(tokens + p_tp * 10 + d_tp)
    if fragmented:
        remote = rng.permutation(num_blocks)[:n]
        local = rng.permutation(num_blocks)[:n]
    else:
        remote = np.arange(n) + 1
        local = np.arange(n) + 3

    def plan():
        return plan_read(meta_d, 0, meta_p, local, remote).copies

    def plan_and_lists():
        p = plan_read(meta_d, 0, meta_p, local, remote)
        return [p.expanded_descriptors(meta_d, meta_p, rr) for rr in p.read_ranks]

    p = plan_read(meta_d, 0, meta_p, local, remote)
    copies = p.copies
    plan_ms, plan_runs = _median_ms(plan, repeats)
    del copies
    out = {
        "case": name,
        "tp": f"{p_tp}->{d_tp}",
        "prompt_tokens": tokens,
        "blocks": n,
        "ids": "fragmented" if fragmented else "contiguous",
        "descriptors": p.num_descriptors,
        "chunks": int(p.copies[:, 6].sum()),
        "bytes": p.num_bytes,
        "read_ranks": list(p.read_ranks),
        "plan_ms": round(plan_ms, 3),
        "plan_runs_ms": [round(t, 3) for t in plan_runs],
    }
    bare_ms = p.num_bytes / (_WIRE_GBPS.value * 1e9) * 1e3
    out["bare_read_ms"] = round(bare_ms, 3)
    out["plan_fraction"] = round(plan_ms / bare_ms, 4) if bare_ms else None
    if _NIXL_LISTS.value:
        lists_ms, _ = _median_ms(plan_and_lists, repeats)
        out["nixl_lists_ms"] = round(lists_ms, 3)

    def formatted():
        # what the consumer computes to start a formatted read (`FormattedFetch`): the plan,
        # its wire chunks per producer rank (from the per-block form where the rows have it,
        # no rows built; else from the rows) and the producer-side ranges each `Format`
        # message carries
        plan = plan_read(meta_d, 0, meta_p, local, remote)
        messages = []
        for rr in plan.read_ranks:
            lens = [r.block_len for r in meta_p.rank_info(rr).regions]
            share = plan.block_share(rr)
            cut = None if share is None else block_share_chunks(share, DEFAULT_CHUNK_BYTES,
                                                                 lens)
            if cut is not None:
                for first, stop, _ in cut[0]:
                    messages.append(template_fields(cut[1], len(plan.remote_block_ids), first,
                                                    stop - first)["templates"])
                continue
            rows, bounds, templates = describe_share(plan.copies_for(rr), DEFAULT_CHUNK_BYTES,
                                                     plan.remote_block_ids, lens)
            for first, stop in bounds:
                messages.append(
                    template_fields(templates, len(plan.remote_block_ids), first,
                                    stop - first)["templates"] if templates is not None
                    else remote_half(rows[first:stop]))
        return messages

    formatted_ms, _ = _median_ms(formatted, repeats)
    out["formatted_start_ms"] = round(formatted_ms, 3)
    out["formatted_chunks"] = len(formatted())
    out["formatted_message_bytes"] = sum(len(m) for m in formatted())
    del p
    print(f"{name:10s} {out['tp']:5s} {tokens:7d} {out['ids']:10s} desc={out['descriptors']:8d} "
          f"plan={plan_ms:9.2f} ms lists={out.get('nixl_lists_ms', 0):9.2f} ms "
          f"formatted={formatted_ms:9.2f} ms ({out['formatted_message_bytes'] >> 10} KiB) "
          f"({100 * out['plan_fraction']:.2f}% of bare READ)", file=sys.stderr, flush=True)
    return out


def main(argv: list[str]) -> None:
    del argv
    import jax

    prompts = [int(p) for p in _PROMPTS.value]
    num_blocks = _POOL_FACTOR.value * -(-max(prompts) // _BLOCK_SIZE.value)
    load_before = os.getloadavg()[0]
    result: dict = {
        "benchmark": "jaxkv.transfer.plan_read",
        "label": _LABEL.value,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {
            "python": platform.python_version(),
            "jax": jax.__version__,
            "numpy": np.__version__,
            "cpus": os.cpu_count(),
            "processor": platform.processor() or platform.machine(),
            "platform": platform.platform(),
            "load_average_1m_before": load_before,
        },
        "config": {
            "layers": _LAYERS.value, "heads": _HEADS.value, "head_dim": _HEAD_DIM.value,
            "block_size": _BLOCK_SIZE.value, "dtype": "bfloat16", "layout": _LAYOUT.value,
            "registered_blocks": num_blocks, "repeats": _REPEATS.value,
            "wire_gbps": _WIRE_GBPS.value, "local_rank": 0,
            "timing": "median of repeats after one warm-up run (planner cached)",
        },
        "cases": [],
    }
    spec = KVCacheSpec(_LAYERS.value, _HEADS.value, _HEAD_DIM.value, _BLOCK_SIZE.value,
                       "bfloat16", layout=_LAYOUT.value)
    cases = []
    for pair in _TP_PAIRS.value:
        p_tp, d_tp = (int(x) for x in pair.split(":"))
        cases.append(("per_layer", spec, spec, p_tp, d_tp))
    if _PACKED.value:
        packed = KVCacheSpec.for_tpu_inference(_LAYERS.value, _HEADS.value, _HEAD_DIM.value,
                                               _BLOCK_SIZE.value, "bfloat16")
        cases.append(("packed", packed, packed, 2, 1))
    for name, spec_p, spec_d, p_tp, d_tp in cases:
        for tokens in prompts:
            for fragmented in (False, True):
                result["cases"].append(bench_case(name, spec_p, spec_d, p_tp, d_tp, tokens,
                                                  fragmented, num_blocks, _REPEATS.value))
    result["machine"]["load_average_1m_after"] = os.getloadavg()[0]
    text = json.dumps(result, indent=2)
    print(text)
    if _JSON_OUT.value:
        os.makedirs(os.path.dirname(os.path.abspath(_JSON_OUT.value)), exist_ok=True)
        with open(_JSON_OUT.value, "w") as out:
            out.write(text + "\n")


if __name__ == "__main__":
    app.run(main)
