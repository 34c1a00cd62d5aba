"""The demo's report: a dict (written as JSON), a text table, and an optional PNG."""

from __future__ import annotations

import dataclasses
import importlib.util
import platform
import sys
from typing import Any

__all__ = ["build_report", "format_report", "write_plot"]


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


def build_report(
    settings, results, reference, bare, stats: dict, timings: dict
) -> dict[str, Any]:
    """Assembles the JSON-serialisable report of a disaggregated run.

    Args:
      settings: the `DemoSettings`.
      results: the `RequestResult` of every request.
      reference: the colocated run's results (for the prefix-hit comparison).
      bare: the bare NIXL READ measurement (or None).
      stats: the decode transfer engine's `stats.summary()`.
      timings: phase durations in seconds.

    Returns:
      The report; ``tokens_match`` is True only when every request finished and every
      generated token equals the colocated run's.

    Example:
      >>> from jaxkv.demo._engines import DemoSettings, RequestResult
      >>> r = build_report(DemoSettings(num_requests=1), [RequestResult("req-0")], {}, None,
      ...                  {}, {})
      >>> r["tokens_match"], r["failed_requests"]
      (False, 1)
    """
    import jax

    done = [r for r in results if r.status == "done"]
    failed = [r for r in results if r.status != "done"]
    total_bytes = sum(r.bytes for r in done)
    read_s = sum(r.read_s for r in done)
    per_request = []
    for r in results:
        row = dataclasses.asdict(r)
        for key in list(row):
            if key.endswith("_s"):
                row[key[:-2] + "_ms"] = _ms(row.pop(key))
        per_request.append(row)
    # READ throughput: bytes over the time from posting the reads to their completion (the
    # confirmation round trip and the decode loop's other work excluded as far as measured).
    read_mbps = total_bytes / read_s / 1e6 if read_s > 0 else None
    like = _like_for_like(done, bare)
    prompt_tokens = settings.prompt_len * settings.num_requests
    try:
        from importlib.metadata import version

        import nixl_cu13 as nixl_module  # noqa: F401

        nixl_version = version("nixl-cu13")
    except Exception:  # noqa: BLE001 - informational only
        nixl_version = None
    return {
        "tokens_match": bool(results) and not failed and all(r.tokens_match for r in done),
        "kv_bytes_match": bool(done) and all(r.kv_match for r in done),
        "completed_requests": len(done),
        "failed_requests": len(failed),
        "settings": dataclasses.asdict(settings),
        "versions": {
            "python": sys.version.split()[0],
            "jax": jax.__version__,
            "numpy": __import__("numpy").__version__,
            "nixl": nixl_version,
            "platform": platform.platform(),
            "devices": str(jax.devices()[0].platform),
        },
        "transfer": {
            "bytes": total_bytes,
            "descriptors": sum(r.descriptors for r in done),
            "blocks_read": sum(r.blocks_read for r in done),
            "read_MBps": read_mbps,
            "bare_nixl_read": bare,
            "vs_bare": (
                read_mbps / bare["one_descriptor"]["MBps"]
                if (bare and read_mbps and "one_descriptor" in bare) else None
            ),
            "like_for_like": like,
            "engine_stats": stats,
        },
        "prefix_cache": {
            "prompt_tokens": prompt_tokens,
            "prefill_hit_tokens": sum(r.prefill_hit_tokens for r in results),
            "decode_hit_tokens": sum(r.decode_hit_tokens for r in results),
            "colocated_hit_tokens": sum(
                v.get("prefill_hit_tokens", 0) for v in (reference or {}).values()
            ),
        },
        "timings_ms": {k.removesuffix("_s") + "_ms": _ms(v) for k, v in timings.items()},
        "requests": per_request,
    }


def _median_ms(values) -> float:
    import numpy as np

    return round(float(np.median(values)) * 1e3, 3)


def _like_for_like(done, bare) -> dict[str, Any] | None:
    """jaxkv's transfer time of the requests of the bare READ's size (bytes and descriptors
    posted to NIXL) next to the bare READ of the same descriptors, medians in ms.

    ``read_ms``: reads posted -> every READ seen complete by the decode loop (data landed);
    ``confirm_ms``: -> every producer rank acknowledged it still held the blocks;
    ``transfer_ms``: the two together (what the table's transfer column shows)."""
    if not bare or "same_descriptors" not in bare:
        return None
    same = bare["same_descriptors"]
    rows = [
        r for r in done
        if (r.bytes, r.nixl_descriptors) == (same["bytes"], same["descriptors"])
    ]
    if not rows:
        return None
    read_ms = _median_ms([r.read_s for r in rows])
    transfer_ms = _median_ms([r.transfer_s for r in rows])
    bare_ms = same["median_s"] * 1e3
    out = {
        "bytes": same["bytes"],
        "descriptors": same["descriptors"],
        "requests": len(rows),
        "read_ms": read_ms,
        "confirm_ms": _median_ms([r.transfer_s - r.read_s for r in rows]),
        "transfer_ms": transfer_ms,
        "read_MBps": same["bytes"] / read_ms / 1e3 if read_ms > 0 else None,
        "transfer_MBps": same["bytes"] / transfer_ms / 1e3 if transfer_ms > 0 else None,
        "bare_same_descriptors_ms": round(bare_ms, 3),
        "bare_same_descriptors_MBps": same["MBps"],
        "read_vs_bare": read_ms / bare_ms if bare_ms > 0 else None,
        "transfer_vs_bare": transfer_ms / bare_ms if bare_ms > 0 else None,
    }
    one = bare.get("one_descriptor")
    if one:
        out["bare_one_descriptor_ms"] = round(one["median_s"] * 1e3, 3)
        out["bare_one_descriptor_bytes"] = one["bytes"]
        out["bare_one_descriptor_MBps"] = one["MBps"]
    return out


def format_report(report: dict[str, Any]) -> str:
    """The report as the text a person reads at the end of a run.

    Example:
      >>> from jaxkv.demo._engines import DemoSettings, RequestResult
      >>> text = format_report(build_report(DemoSettings(num_requests=1),
      ...                      [RequestResult("req-0")], {}, None, {}, {}))
      >>> "tokens match colocated run: False" in text
      True
    """
    s = report["settings"]
    lines = [
        f"prefill: TP={s['prefill_tp']} layout {s['prefill_layout']} "
        f"block {s['prefill_block_size']}"
        f"  ->  decode: TP={s['decode_tp']} layout {s['decode_layout']} block "
        f"{s['decode_block_size']}   ({s['dtype']}, {s['num_layers']} layers, "
        f"{s['num_kv_heads']} KV heads x {s['head_dim']})",
        "",
        f"{'request':<8} {'status':<6} {'hit P/D':>9} {'queue':>7} {'prefill':>8} "
        f"{'handshk':>8} {'transfer':>9} {'post':>6} {'TTFT':>8}  {'blocks':>6} {'KiB':>7} "
        f"{'descs':>5}  match",
    ]
    for r in report["requests"]:
        match = {True: "yes", False: "NO", None: "-"}[r["tokens_match"]]
        lines.append(
            f"{r['request_id']:<8} {r['status']:<6} {r['prefill_hit_tokens']:>4}/"
            f"{r['decode_hit_tokens']:<4} {r['queue_ms']:>7.1f} {r['prefill_ms']:>8.1f} "
            f"{r['handshake_ms']:>8.1f} {r['transfer_ms']:>9.1f} {r['post_ms']:>6.1f} "
            f"{r['ttft_ms']:>8.1f}  {r['blocks_read']:>6} {r['bytes'] / 1024:>7.1f} "
            f"{r['descriptors']:>5}  {match}"
        )
        if r["status"] != "done":
            lines.append(f"         ^ {r['error']}")
    lines.append("(times in ms; hit P/D: prompt tokens found in the prefill / decode prefix cache)")
    t = report["transfer"]
    lines.append("")
    lines.append(
        f"moved {t['bytes'] / 2**20:.2f} MiB in {t['descriptors']} descriptors "
        f"({t['blocks_read']} decode blocks)"
    )
    like = t.get("like_for_like")
    if like:
        lines.append(
            f"transfer of a {like['bytes'] / 1024:.0f} KiB read ({like['descriptors']} descs; "
            f"median of {like['requests']}): posted -> landed {like['read_ms']:.2f} ms "
            f"({like['read_MBps']:.0f} MB/s), -> confirmed {like['transfer_ms']:.2f} ms "
            f"({like['transfer_MBps']:.0f} MB/s)"
        )
        line = (
            f"bare NIXL READ, same {like['descriptors']} descs: "
            f"{like['bare_same_descriptors_ms']:.2f} ms ({like['bare_same_descriptors_MBps']:.0f}"
            f" MB/s; jaxkv landed {like['read_vs_bare']:.1f}x, confirmed "
            f"{like['transfer_vs_bare']:.1f}x its time)"
        )
        if "bare_one_descriptor_ms" in like:
            size = like["bare_one_descriptor_bytes"]
            line += (
                f"; {'the same bytes' if size == like['bytes'] else f'{size / 1024:.0f} KiB'}"
                f" as 1 desc: {like['bare_one_descriptor_ms']:.2f} ms "
                f"({like['bare_one_descriptor_MBps']:.0f} MB/s)"
            )
        lines.append(line)
    p = report["prefix_cache"]
    lines.append(
        f"prefix cache: prefill hits {p['prefill_hit_tokens']}/{p['prompt_tokens']} prompt "
        f"tokens, decode-side hits {p['decode_hit_tokens']} (blocks not read)"
    )
    lines.append(
        f"requests: {report['completed_requests']} completed, {report['failed_requests']} failed;"
        f" prompt KV bytes match colocated run: {report['kv_bytes_match']}"
    )
    lines.append(f"tokens match colocated run: {report['tokens_match']}")
    return "\n".join(lines)


def write_plot(report: dict[str, Any], path: str) -> bool:
    """Writes a stacked bar chart of each request's TTFT split, if matplotlib is installed.

    Returns:
      Whether the file was written (False without matplotlib).

    Example:
      >>> isinstance(write_plot({"requests": []}, "/nonexistent/x.png"), bool) or True
      True
    """
    if importlib.util.find_spec("matplotlib") is None:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["requests"]
    if not rows:
        return False
    names = [r["request_id"] for r in rows]
    fig, ax = plt.subplots(figsize=(8, 4))
    bottom = [0.0] * len(rows)
    for key in ("queue_ms", "prefill_ms", "handshake_ms", "transfer_ms", "post_ms"):
        values = [r[key] for r in rows]
        ax.bar(names, values, bottom=bottom, label=key[:-3])
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_ylabel("ms")
    ax.set_title("time to first token, per request")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True
