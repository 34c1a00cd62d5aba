"""The demo's report: a dict (written as JSON), a text table, and an optional PNG."""

from __future__ import annotations

import dataclasses
import importlib.util
import platform
import statistics
import sys
from typing import Any

__all__ = ["TTFT_SEGMENTS", "build_report", "format_report", "plot_figure", "ttft_segments",
           "write_plot"]


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


def build_report(
    settings, results, reference, engine_alone, stats: dict, timings: dict
) -> dict[str, Any]:
    """Assembles the JSON-serialisable report of a disaggregated run.

    Every transfer time in it is the transfer engine's own measurement (its records of each
    read); the bare-transport floor is `benchmarks/bench_transfer.py`'s business.

    Args:
      settings: the `DemoSettings`.
      results: the `RequestResult` of every request.
      reference: the colocated run's results (for the prefix-hit comparison).
      engine_alone: the engine-alone replay of one read (``{"landed_ms", "confirmed_ms",
        "repeats", "bytes", "descriptors"}``), or None.
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
        row["layerwise"] = settings.layer_pipelined(r.request_id)
        per_request.append(row)
    # READ throughput: bytes over the time from posting the reads to their completion (the
    # confirmation round trip and the decode loop's other work excluded as far as measured).
    read_mbps = total_bytes / read_s / 1e6 if read_s > 0 else None
    same_size = _same_size_reads(done, engine_alone)
    prompt_tokens = settings.prompt_len * settings.num_requests
    try:
        from importlib.metadata import version

        import nixl_cu13 as nixl_module  # noqa: F401

        nixl_version = version("nixl-cu13")
    except Exception:  # noqa: BLE001 - informational only
        nixl_version = None
    ttfts = [r.ttft_s * 1e3 for r in done if r.ttft_s > 0]
    by_mode: dict[str, dict[str, Any] | None] | None = None
    if settings.layerwise_ab:  # both modes in this run: each one's TTFT (and prefill)
        by_mode = {}
        for mode, pipelined in (("whole", False), ("layerwise", True)):
            rows = [r for r in done
                    if r.ttft_s > 0 and settings.layer_pipelined(r.request_id) == pipelined]
            summary = _ttft_summary([r.ttft_s * 1e3 for r in rows])
            if summary is not None:
                summary["prefill_median"] = round(
                    statistics.median(r.prefill_s * 1e3 for r in rows), 3)
            by_mode[mode] = summary
    return {
        "ttft_ms": _ttft_summary(ttfts),
        "ttft_ms_by_mode": by_mode,
        "ttft_ms_pairs": _paired_ttft(settings, done) if settings.layerwise_ab else None,
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
            "same_size_reads": same_size,
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


def _ttft_summary(ttfts_ms: list[float]) -> dict[str, Any] | None:
    """``{"requests", "median", "min", "max"}`` of TTFTs in ms, or None without any."""
    if not ttfts_ms:
        return None
    return {"requests": len(ttfts_ms), "median": round(statistics.median(ttfts_ms), 3),
            "min": round(min(ttfts_ms), 3), "max": round(max(ttfts_ms), 3)}


def _paired_ttft(settings: Any, done: list[Any]) -> dict[str, Any] | None:
    """With ``layerwise_ab``: each pair of requests (``req-2k``, ``req-2k+1``: one of each
    mode, arriving one after the other) compared, layer-wise minus whole: ``{"pairs",
    "layerwise_lower"`` (pairs whose layer-wise TTFT was lower), ``"median_ttft_diff_ms",
    "median_prefill_diff_ms"}``; None without a pair whose two requests completed. Pairs
    cancel the machine's drift over a run, which the two modes' medians do not.

    Example:
      >>> from jaxkv.demo._engines import DemoSettings, RequestResult
      >>> done = [RequestResult(f"req-{i}", status="done", ttft_s=t, prefill_s=t - 0.1)
      ...         for i, t in enumerate([2.0, 1.5, 3.4, 3.2])]
      >>> _paired_ttft(DemoSettings(layerwise_ab=True), done)["layerwise_lower"]
      1
    """
    by_id = {r.request_id: r for r in done if r.ttft_s > 0}
    diffs: list[tuple[float, float]] = []
    for index in range(0, settings.num_requests - 1, 2):
        first, second = (by_id.get(f"req-{index + j}") for j in (0, 1))
        if first is None or second is None:
            continue
        whole, layered = ((second, first) if settings.layer_pipelined(first.request_id)
                          else (first, second))
        diffs.append(((layered.ttft_s - whole.ttft_s) * 1e3,
                      (layered.prefill_s - whole.prefill_s) * 1e3))
    if not diffs:
        return None
    return {"pairs": len(diffs), "layerwise_lower": sum(d < 0 for d, _ in diffs),
            "median_ttft_diff_ms": round(statistics.median(d for d, _ in diffs), 3),
            "median_prefill_diff_ms": round(statistics.median(p for _, p in diffs), 3)}


def _median_ms(values) -> float:
    import numpy as np

    return round(float(np.median(values)) * 1e3, 3)


def _same_size_reads(done, engine_alone=None) -> dict[str, Any] | None:
    """The transfer engine's times for the requests of one read size, medians in ms: the
    size of the first completed request with the most bytes (bytes and descriptors posted to
    NIXL; the request the engine-alone replay reads again).

    ``read_ms``: reads posted -> every READ seen complete by the engine's progress (data
    landed); ``confirm_ms``: -> every producer rank acknowledged it still held the blocks;
    ``transfer_ms``: the two together (what the table's transfer column shows). With
    `engine_alone`, it is added under ``"engine_alone"``.

    Returns:
      The summary, or None when no completed request read anything.

    Example:
      >>> from jaxkv.demo._engines import RequestResult
      >>> done = [RequestResult("req-0", status="done", bytes=8, nixl_descriptors=2,
      ...                       read_s=0.002, transfer_s=0.003)]
      >>> s = _same_size_reads(done)
      >>> s["requests"], s["read_ms"], s["confirm_ms"]
      (1, 2.0, 1.0)
    """
    reads = [r for r in done if r.bytes]
    if not reads:
        return None
    largest = max(reads, key=lambda r: (r.bytes, -int(r.request_id.split("-")[1])))
    size = (largest.bytes, largest.nixl_descriptors)
    rows = [r for r in reads if (r.bytes, r.nixl_descriptors) == size]
    read_ms = _median_ms([r.read_s for r in rows])
    transfer_ms = _median_ms([r.transfer_s for r in rows])
    out: dict[str, Any] = {
        "bytes": size[0],
        "descriptors": size[1],
        "requests": len(rows),
        "read_ms": read_ms,
        "confirm_ms": _median_ms([r.transfer_s - r.read_s for r in rows]),
        "transfer_ms": transfer_ms,
        "read_MBps": size[0] / read_ms / 1e3 if read_ms > 0 else None,
        "transfer_MBps": size[0] / transfer_ms / 1e3 if transfer_ms > 0 else None,
    }
    if engine_alone:
        out["engine_alone"] = engine_alone
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
        f"transfer: {s.get('transport', 'nixl')}"
        f"{', host-staged' if s.get('host_staging') else ''}, "
        f"{_mode_name(s)}",
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
    same = t.get("same_size_reads")
    if same:
        lines.append(
            f"transfer of a {same['bytes'] / 1024:.0f} KiB read ({same['descriptors']} descs; "
            f"median of {same['requests']}; as the decode loop saw them, polling between model "
            f"steps): posted -> landed {same['read_ms']:.2f} ms ({same['read_MBps']:.0f} MB/s), "
            f"-> confirmed {same['transfer_ms']:.2f} ms ({same['transfer_MBps']:.0f} MB/s)"
        )
        alone = same.get("engine_alone")
        if alone:
            lines.append(
                f"the engine alone (the same request read again, polled back to back, median "
                f"of {alone['repeats']}): landed {alone['landed_ms']:.2f} ms, confirmed "
                f"{alone['confirmed_ms']:.2f} ms")
    p = report["prefix_cache"]
    lines.append(
        f"prefix cache: prefill hits {p['prefill_hit_tokens']}/{p['prompt_tokens']} prompt "
        f"tokens, decode-side hits {p['decode_hit_tokens']} (blocks not read)"
    )
    lines.append(
        f"requests: {report['completed_requests']} completed, {report['failed_requests']} failed;"
        f" prompt KV bytes match colocated run: {report['kv_bytes_match']}"
    )
    ttft = report.get("ttft_ms")
    if ttft:
        lines.append(f"TTFT (ms, {ttft['requests']} requests): median {ttft['median']:.1f}, "
                     f"min {ttft['min']:.1f}, max {ttft['max']:.1f} "
                     f"({_mode_name(s)})")
    for mode, summary in (report.get("ttft_ms_by_mode") or {}).items():
        if summary:
            lines.append(f"  {mode:>9}: TTFT median {summary['median']:.1f} ms over "
                         f"{summary['requests']} requests (prefill median "
                         f"{summary['prefill_median']:.1f} ms)")
    pairs = report.get("ttft_ms_pairs")
    if pairs:
        lines.append(f"  pairs: layer-wise TTFT lower in {pairs['layerwise_lower']} of "
                     f"{pairs['pairs']}, median difference {pairs['median_ttft_diff_ms']:+.1f} "
                     f"ms (prefill {pairs['median_prefill_diff_ms']:+.1f} ms)")
    lines.append(f"tokens match colocated run: {report['tokens_match']}")
    return "\n".join(lines)


def _mode_name(settings: dict[str, Any]) -> str:
    """How the run transferred its requests, for the text report."""
    if settings.get("layerwise_ab"):
        return ("one request of each pair layer-pipelined, the other whole, in ABBA order "
                "(--layerwise_ab)")
    return "layer-pipelined (--layerwise)" if settings.get("layerwise") else "whole request"


# The measured parts of a request's time to first token, in order (report keys, legend).
TTFT_SEGMENTS: tuple[tuple[str, str], ...] = (
    ("queue_ms", "queue (arrival -> prefill start)"),
    ("prefill_ms", "prefill"),
    ("handshake_ms", "handshake"),
    ("transfer_ms", "transfer (read + confirm)"),
    ("post_ms", "post-processing"),
)


def ttft_segments(request: dict[str, Any]) -> dict[str, float]:
    """One request's TTFT split into segments that add up to it, in ms.

    The measured segments are `TTFT_SEGMENTS`; ``other_ms`` is the rest of the TTFT: the
    prefill process's reply reaching the decode loop, admission, and the decode loop noticing
    the finished read between steps. A request without a TTFT (failed) gets its measured
    segments and no ``other_ms``; a rest below zero (clock rounding) counts as zero.

    Args:
      request: a row of ``report["requests"]``.

    Returns:
      ``{key: ms}`` for every key of `TTFT_SEGMENTS` and ``"other_ms"``.

    Example:
      >>> ttft_segments({"queue_ms": 1.0, "prefill_ms": 2.0, "handshake_ms": 0.0,
      ...                "transfer_ms": 3.0, "post_ms": 0.5, "ttft_ms": 7.0})["other_ms"]
      0.5
    """
    parts = {key: float(request[key]) for key, _ in TTFT_SEGMENTS}
    ttft = float(request["ttft_ms"])
    parts["other_ms"] = max(0.0, ttft - sum(parts.values())) if ttft > 0 else 0.0
    return parts


def _title(report: dict[str, Any]) -> str:
    s = report["settings"]
    platform_name = report.get("versions", {}).get("devices", "")
    return (
        f"prefill TP={s['prefill_tp']} {s['prefill_layout']} block {s['prefill_block_size']}"
        f"  ->  decode TP={s['decode_tp']} {s['decode_layout']} block "
        f"{s['decode_block_size']}  ({platform_name})\n"
        f"{s['dtype']}, {s['num_layers']} layers, {s['num_kv_heads']} KV heads x "
        f"{s['head_dim']};  {s['num_requests']} requests x {s['prompt_len']} tokens "
        f"({s['shared_prefix_len']} shared), {s['max_new_tokens']} new;  tokens match "
        f"colocated run: {report['tokens_match']}"
    )


def plot_figure(report: dict[str, Any]):
    """The demo's figure: each request's TTFT as stacked segments that add up to it (with
    its prefix-cache hits marked), and the transfer engine's times for one read size (as the
    decode loop saw them, and the engine alone reading the same request again).

    Args:
      report: a report of `build_report` (or its JSON).

    Returns:
      A `matplotlib.figure.Figure` (needs matplotlib: ``pip install jaxkv[demo]``).

    Raises:
      ValueError: the report has no requests.
    """
    from matplotlib.figure import Figure

    rows = report["requests"]
    if not rows:
        raise ValueError("the report has no requests to plot")
    fig = Figure(figsize=(13, 5.2))
    ttft_ax, transfer_ax = fig.subplots(1, 2, gridspec_kw={"width_ratios": [3, 2]})
    fig.suptitle(_title(report), fontsize=9)

    names = [r["request_id"] for r in rows]
    segments = [ttft_segments(r) for r in rows]
    bottom = [0.0] * len(rows)
    for key, label in (*TTFT_SEGMENTS, ("other_ms", "other (messages, admission, polling)")):
        values = [seg[key] for seg in segments]
        ttft_ax.bar(names, values, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values)]
    top = max(bottom) or 1.0
    for x, (r, height) in enumerate(zip(rows, bottom)):
        marks = []
        if r["prefill_hit_tokens"]:
            marks.append(f"P{r['prefill_hit_tokens']}")
        if r["decode_hit_tokens"]:
            marks.append(f"D{r['decode_hit_tokens']}")
        if r["status"] != "done":
            marks.append("failed")
        if marks:
            ttft_ax.text(x, height + 0.01 * top, "\n".join(marks), ha="center", va="bottom",
                         fontsize=7, color="crimson" if r["status"] != "done" else "black")
    ttft_ax.set_ylim(0, top * 1.15)
    ttft_ax.set_ylabel("ms")
    ttft_ax.set_title("time to first token per request (P/D: prefix-cache hit tokens on "
                      "the prefill / decode side)", fontsize=8)
    ttft_ax.tick_params(axis="x", labelrotation=45, labelsize=7)
    ttft_ax.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.14))

    same = report["transfer"].get("same_size_reads")
    if same:
        # The transfer engine's own measurements: as the decode loop saw them, and (when
        # measured) the engine alone reading the same request again.
        bars = [
            ("jaxkv: posted -> landed", same["read_ms"], same["read_MBps"]),
            ("jaxkv: -> confirmed", same["transfer_ms"], same["transfer_MBps"]),
        ]
        alone = same.get("engine_alone")
        if alone:
            bars += [
                ("engine alone: posted -> landed", alone["landed_ms"],
                 alone["bytes"] / alone["landed_ms"] / 1e3 if alone["landed_ms"] > 0 else None),
                ("engine alone: -> confirmed", alone["confirmed_ms"],
                 alone["bytes"] / alone["confirmed_ms"] / 1e3
                 if alone["confirmed_ms"] > 0 else None),
            ]
        labels = [b[0] for b in bars]
        times = [max(b[1], 1e-6) for b in bars]
        transfer_ax.barh(labels, times, color=["C3", "C3", "C7", "C7"][: len(bars)])
        transfer_ax.set_xscale("log")
        transfer_ax.invert_yaxis()
        for y, (_, ms, mbps) in enumerate(bars):
            rate = f", {mbps:.0f} MB/s" if mbps and mbps >= 10 else (
                f", {mbps:.2g} MB/s" if mbps else "")
            transfer_ax.text(max(ms, 1e-6), y, f" {ms:.3g} ms{rate}", va="center", fontsize=7)
        transfer_ax.set_xlim(min(times) / 2, max(times) * 20)
        transfer_ax.set_xlabel("ms (log scale)")
        transfer_ax.set_title(
            f"one request's read: {same['bytes'] / 1024:.0f} KiB in {same['descriptors']} "
            f"descriptors (median of {same['requests']})", fontsize=8)
        transfer_ax.tick_params(axis="y", labelsize=7)
    else:
        transfer_ax.set_axis_off()
        transfer_ax.text(0.5, 0.5, "no transfer measurement\n(no completed request read "
                         "any blocks)", ha="center", va="center", fontsize=8,
                         transform=transfer_ax.transAxes)
    fig.tight_layout()
    return fig


def write_plot(report: dict[str, Any], path: str) -> bool:
    """Writes `plot_figure` of the report as a PNG, if matplotlib is installed.

    Args:
      report: a report of `build_report`.
      path: the PNG to write.

    Returns:
      Whether the file was written (False without matplotlib or without requests).

    Example:
      >>> write_plot({"requests": []}, "/nonexistent/x.png")
      False
    """
    if importlib.util.find_spec("matplotlib") is None or not report["requests"]:
        return False
    plot_figure(report).savefig(path, dpi=110)
    return True
