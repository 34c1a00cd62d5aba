"""Transfer statistics: per-transfer records, failure counters and a summary."""

from __future__ import annotations

import bisect
import dataclasses

import numpy as np

__all__ = ["BUCKETS_S", "PublishRecord", "TransferRecord", "TransferStats", "WorkerAggregator"]

BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
             10.0, 30.0)
"""Histogram bucket upper bounds (seconds) of the running totals (and of Prometheus)."""

HISTOGRAM_FIELDS = ("duration_s", "confirm_s", "post_s")


@dataclasses.dataclass(frozen=True)
class TransferRecord:
    """One finished read of one request by one local rank set (a process)."""

    request_id: str
    bytes: int
    descriptors: int
    expanded_descriptors: int
    duration_s: float  # start_read -> every READ complete
    confirm_s: float  # READ complete -> every producer rank acknowledged
    post_s: float = 0.0  # post-processing (layout / block-size fix; host staging -> device)
    layer_arrival: tuple[tuple[int, float], ...] = ()  # layer-wise: (global layer, wall time)
    started_at: float = 0.0  # wall time (time.time()) of start_read
    path: str = "direct"  # "direct" (the plan's descriptors) or "formatted" (gathered chunks)


@dataclasses.dataclass(frozen=True)
class PublishRecord:
    """One request fully published by a producer process.

    Attributes:
      request_id: the request.
      layers: ``(layer_stop, wall time)`` of each announcement (one for a request published
        whole; one per `publish_layers` call for a layer-wise one).
      staged_s: time spent copying its blocks to the host mirror (host staging).
    """

    request_id: str
    layers: tuple[tuple[int, float], ...]
    staged_s: float = 0.0


@dataclasses.dataclass
class _Histogram:
    """Running counts per `BUCKETS_S` bound (not cumulative; the last one is +Inf) and sum."""

    counts: list[int] = dataclasses.field(default_factory=lambda: [0] * (len(BUCKETS_S) + 1))
    total: float = 0.0

    def add(self, value: float) -> None:
        self.counts[bisect.bisect_left(BUCKETS_S, value)] += 1
        self.total += value

    def merged(self, other: _Histogram) -> _Histogram:
        return _Histogram([a + b for a, b in zip(self.counts, other.counts)],
                          self.total + other.total)


@dataclasses.dataclass
class TransferStats:
    """Counters and records of one engine process (`KVTransferEngine.stats`).

    `records` / `publications` keep the last `max_records` of each (for summaries and
    inspection); the ``*_total`` fields and `histograms` are running totals over the
    engine's life (monotonic: what Prometheus counters expose).
    """

    records: list[TransferRecord] = dataclasses.field(default_factory=list)
    publications: list[PublishRecord] = dataclasses.field(default_factory=list)
    failed_transfers: int = 0
    failed_notifications: int = 0
    failed_handshakes: int = 0
    expired_leases: int = 0
    malformed_messages: int = 0
    refused_messages: int = 0  # control messages from a sender that may not act on them
    # Integrity digests (`jaxkv.transfer._digest`): producer block images whose landed bytes
    # did not match the producer's digest (each fails its read), images verified, and the
    # seconds spent digesting (producer: at publication; consumer: verifying landed bytes).
    digest_mismatches: int = 0
    digest_verified: int = 0
    digest_s_total: float = 0.0
    max_records: int = 100_000
    requests_total: int = 0
    bytes_total: int = 0
    descriptors_total: int = 0
    formatted_total: int = 0  # reads that went formatted (`jaxkv.transfer._formatted`)
    formatted_chunks_total: int = 0  # producer: chunks gathered for formatted reads
    publications_total: int = 0
    staged_s_total: float = 0.0
    histograms: dict[str, _Histogram] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        for field in HISTOGRAM_FIELDS:
            self.histograms.setdefault(field, _Histogram())
        # Records given to the constructor count once (unless totals were given too).
        if self.records and not self.requests_total:
            for record in self.records:
                self._count(record)
        if self.publications and not self.publications_total:
            self.publications_total = len(self.publications)
            self.staged_s_total = sum(p.staged_s for p in self.publications)

    def _count(self, record: TransferRecord) -> None:
        self.requests_total += 1
        self.bytes_total += record.bytes
        self.descriptors_total += record.descriptors
        self.formatted_total += record.path == "formatted"
        for field in HISTOGRAM_FIELDS:
            self.histograms[field].add(getattr(record, field))

    def add(self, record: TransferRecord) -> None:
        self._count(record)
        self.records.append(record)
        if len(self.records) > self.max_records:
            del self.records[: len(self.records) - self.max_records]

    def add_publication(self, record: PublishRecord) -> None:
        self.publications_total += 1
        self.staged_s_total += record.staged_s
        self.publications.append(record)
        if len(self.publications) > self.max_records:
            del self.publications[: len(self.publications) - self.max_records]

    def merge(self, other: TransferStats) -> TransferStats:
        """Stats of two workers together (records concatenated, counters summed)."""
        out = TransferStats(
            records=self.records + other.records,
            publications=self.publications + other.publications,
            requests_total=self.requests_total + other.requests_total,
            publications_total=self.publications_total + other.publications_total,
            max_records=max(self.max_records, other.max_records),
        )
        for field in (
            "failed_transfers",
            "failed_notifications",
            "failed_handshakes",
            "expired_leases",
            "malformed_messages",
            "refused_messages",
            "digest_mismatches",
            "digest_verified",
            "digest_s_total",
            "bytes_total",
            "descriptors_total",
            "formatted_total",
            "formatted_chunks_total",
            "staged_s_total",
        ):
            setattr(out, field, getattr(self, field) + getattr(other, field))
        out.histograms = {
            f: self.histograms[f].merged(other.histograms[f]) for f in HISTOGRAM_FIELDS
        }
        return out

    def summary(self) -> dict[str, float]:
        """mean / p50 / p90 / p99 of durations (ms), bytes, descriptors, MB/s, counters."""
        out: dict[str, float] = {
            "transfers": self.requests_total,
            "failed_transfers": self.failed_transfers,
            "failed_notifications": self.failed_notifications,
            "failed_handshakes": self.failed_handshakes,
            "expired_leases": self.expired_leases,
            "malformed_messages": self.malformed_messages,
            "refused_messages": self.refused_messages,
            "digest_mismatches": self.digest_mismatches,
            "digest_verified": self.digest_verified,
        }
        if not self.records:
            return out
        dur = np.array([r.duration_s for r in self.records])
        total = np.array([r.duration_s + r.confirm_s + r.post_s for r in self.records])
        nbytes = np.array([r.bytes for r in self.records], dtype=np.float64)
        for name, values in (
            ("duration_ms", dur * 1e3),
            ("total_ms", total * 1e3),
            ("post_ms", np.array([r.post_s for r in self.records]) * 1e3),
            ("descriptors", np.array([r.descriptors for r in self.records])),
        ):
            out[f"{name}_mean"] = float(values.mean())
            for q in (50, 90, 99):
                out[f"{name}_p{q}"] = float(np.percentile(values, q))
        out["bytes_total"] = float(self.bytes_total)
        out["MBps"] = float(nbytes.sum() / max(dur.sum(), 1e-12) / 1e6)
        return out


class WorkerAggregator:
    """Engine-level completion: a request is finished only when every worker reported it.

    Example:
      >>> agg = WorkerAggregator(num_workers=2)
      >>> agg.report(0, ["a"]), agg.report(1, ["a", "b"]), agg.report(0, ["b"])
      ([], ['a'], ['b'])
    """

    def __init__(self, num_workers: int):
        self.num_workers = num_workers
        self._seen: dict[str, set[int]] = {}

    def report(self, worker: int, request_ids) -> list[str]:
        done = []
        for request_id in request_ids:
            workers = self._seen.setdefault(request_id, set())
            workers.add(worker)
            if len(workers) == self.num_workers:
                del self._seen[request_id]
                done.append(request_id)
        return done

    @property
    def pending(self) -> int:
        return len(self._seen)
