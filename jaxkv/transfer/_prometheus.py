"""`TransferStats` for Prometheus.

Two ways, the first without any dependency:

* `prometheus_text(stats)` renders the text exposition format (serve it from any HTTP
  handler, or write it for node_exporter's textfile collector);
* `TransferStatsCollector(stats)` is a `prometheus_client` collector (optional dependency,
  ``pip install jaxkv[metrics]``): ``REGISTRY.register(TransferStatsCollector(engine.stats))``.

Both compute the metrics from the stats at scrape time (nothing to update in the loop).
Metrics (``engine`` label: the `engine_id` given):

=========================================== ========= =======================================
name                                        type      meaning
=========================================== ========= =======================================
jaxkv_transfer_requests_total               counter   reads finished
jaxkv_transfer_bytes_total                  counter   bytes read (bytes)
jaxkv_transfer_descriptors_total            counter   NIXL descriptors posted
jaxkv_transfer_reads_by_path_total{path=...} counter  reads finished per path: direct
                                                      (the plan's descriptors) or formatted
                                                      (gathered chunks)
jaxkv_transfer_formatted_chunks_total       counter   chunks gathered for peers' formatted
                                                      reads (producer)
jaxkv_transfer_duration_seconds             histogram start_read -> every READ complete (s)
jaxkv_transfer_confirm_seconds              histogram READ complete -> producer acks (s)
jaxkv_transfer_post_seconds                 histogram post-processing / staging in (s)
jaxkv_transfer_failures_total{kind=...}     counter   failed transfers / notifications /
                                                      handshakes, expired leases, malformed,
                                                      digest mismatches (kind=digest_mismatches:
                                                      producer blocks whose bytes landed wrong)
jaxkv_transfer_digest_verified_total        counter   producer blocks verified by digest
jaxkv_transfer_digest_seconds_total         counter   time computing / verifying digests (s)
jaxkv_transfer_published_requests_total     counter   requests fully published (producer)
jaxkv_transfer_staging_seconds_total        counter   producer time copying to the mirror (s)
jaxkv_transfer_last_throughput_bytes_per_second gauge bytes / duration of the last read
=========================================== ========= =======================================

Counters and histograms are the running totals of the stats (monotonic for the engine's life,
whatever `TransferStats.max_records` keeps of the individual records).
"""

from __future__ import annotations

import itertools
from typing import Any

from jaxkv.transfer._stats import BUCKETS_S

__all__ = ["BUCKETS_S", "TransferStatsCollector", "prometheus_text"]


_FAILURES = ("failed_transfers", "failed_notifications", "failed_handshakes", "expired_leases",
             "malformed_messages", "refused_messages", "digest_mismatches")


_Sample = tuple[str, dict[str, str], float]
_Family = tuple[str, str, str, list[_Sample]]


def _families(stats: Any) -> list[_Family]:
    """``(name, type, help, samples)``; samples are ``(suffix, labels, value)``."""
    records = list(stats.records)
    out: list[_Family] = [
        ("jaxkv_transfer_requests_total", "counter", "KV reads finished",
         [("", {}, float(stats.requests_total))]),
        ("jaxkv_transfer_bytes_total", "counter", "KV bytes read",
         [("", {}, float(stats.bytes_total))]),
        ("jaxkv_transfer_descriptors_total", "counter", "NIXL descriptors posted",
         [("", {}, float(stats.descriptors_total))]),
        ("jaxkv_transfer_reads_by_path_total", "counter", "KV reads finished per path",
         [("", {"path": "direct"}, float(stats.requests_total - stats.formatted_total)),
          ("", {"path": "formatted"}, float(stats.formatted_total))]),
        ("jaxkv_transfer_formatted_chunks_total", "counter",
         "chunks gathered for peers' formatted reads",
         [("", {}, float(stats.formatted_chunks_total))]),
    ]
    for name, field, text in (
        ("jaxkv_transfer_duration_seconds", "duration_s", "start_read to every READ complete"),
        ("jaxkv_transfer_confirm_seconds", "confirm_s", "READ complete to producer acks"),
        ("jaxkv_transfer_post_seconds", "post_s", "post-processing and staging to device"),
    ):
        histogram = stats.histograms[field]
        cumulative = list(itertools.accumulate(histogram.counts))
        samples = [("_bucket", {"le": repr(b)}, float(c)) for b, c in zip(BUCKETS_S, cumulative)]
        samples.append(("_bucket", {"le": "+Inf"}, float(cumulative[-1])))
        samples += [("_count", {}, float(cumulative[-1])), ("_sum", {}, float(histogram.total))]
        out.append((name, "histogram", text, samples))
    out.append(("jaxkv_transfer_failures_total", "counter", "transfer failures by kind",
                [("", {"kind": k}, float(getattr(stats, k))) for k in _FAILURES]))
    out.append(("jaxkv_transfer_published_requests_total", "counter",
                "requests fully published", [("", {}, float(stats.publications_total))]))
    out.append(("jaxkv_transfer_staging_seconds_total", "counter",
                "producer time copying blocks to the host mirror",
                [("", {}, float(stats.staged_s_total))]))
    out.append(("jaxkv_transfer_digest_verified_total", "counter",
                "producer blocks whose landed bytes matched their digest",
                [("", {}, float(stats.digest_verified))]))
    out.append(("jaxkv_transfer_digest_seconds_total", "counter",
                "time computing and verifying integrity digests",
                [("", {}, float(stats.digest_s_total))]))
    last = records[-1] if records else None
    rate = last.bytes / last.duration_s if last is not None and last.duration_s > 0 else 0.0
    out.append(("jaxkv_transfer_last_throughput_bytes_per_second", "gauge",
                "bytes / duration of the last read", [("", {}, float(rate))]))
    return out


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def prometheus_text(stats: Any, engine: str = "") -> str:
    """The stats in Prometheus' text exposition format (no dependency).

    Args:
      stats: a `TransferStats` (e.g. ``engine.stats``).
      engine: the value of the ``engine`` label.

    Returns:
      The exposition text, one ``# HELP`` / ``# TYPE`` block per metric.

    Example:
      >>> from jaxkv.transfer import TransferStats
      >>> text = prometheus_text(TransferStats(), engine="decode")
      >>> 'jaxkv_transfer_bytes_total{engine="decode"} 0.0' in text
      True
    """
    lines = []
    for name, kind, text, samples in _families(stats):
        # counters are exposed under their name (with _total), as prometheus_client does
        lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]
        for suffix, labels, value in samples:
            labels = {"engine": engine, **labels}
            rendered = ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items())
            lines.append(f"{name}{suffix}{{{rendered}}} {value!r}")
    return "\n".join(lines) + "\n"


class TransferStatsCollector:
    """A `prometheus_client` custom collector over a `TransferStats` (optional dependency).

    Args:
      stats: the stats to expose (read at every scrape).
      engine: the ``engine`` label value.

    Raises:
      ImportError: prometheus_client is not installed (``pip install jaxkv[metrics]``).

    Example:
      >>> from prometheus_client import REGISTRY  # doctest: +SKIP
      >>> REGISTRY.register(TransferStatsCollector(engine.stats, "decode"))  # doctest: +SKIP
    """

    def __init__(self, stats: Any, engine: str = ""):
        try:
            import prometheus_client.core  # noqa: F401
        except ImportError as error:
            raise ImportError(
                "TransferStatsCollector needs prometheus_client: pip install jaxkv[metrics] "
                "(prometheus_text() works without it)"
            ) from error
        self.stats = stats
        self.engine = engine

    def describe(self) -> list:
        return []  # computed at scrape time; no registration-time description

    def collect(self):
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        for name, kind, text, samples in _families(self.stats):
            if kind == "histogram":
                buckets = [(s[1]["le"], s[2]) for s in samples if s[0] == "_bucket"]
                total = next(s[2] for s in samples if s[0] == "_sum")
                family = HistogramMetricFamily(name, text, labels=["engine"])
                family.add_metric([self.engine], buckets, total)
            elif kind == "counter":
                family = CounterMetricFamily(
                    name.removesuffix("_total"), text,
                    labels=["engine", *sorted({k for s in samples for k in s[1]})],
                )
                for _, labels, value in samples:
                    family.add_metric([self.engine, *(labels[k] for k in sorted(labels))], value)
            else:
                family = GaugeMetricFamily(name, text, labels=["engine"])
                for _, _, value in samples:
                    family.add_metric([self.engine], value)
            yield family
