"""Transfer statistics: per-transfer records, failure counters and a summary."""

from __future__ import annotations

import dataclasses

import numpy as np

__all__ = ["PublishRecord", "TransferRecord", "TransferStats", "WorkerAggregator"]


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
class TransferStats:
    """Counters and records of one engine process (`KVTransferEngine.stats`)."""

    records: list[TransferRecord] = dataclasses.field(default_factory=list)
    publications: list[PublishRecord] = dataclasses.field(default_factory=list)
    failed_transfers: int = 0
    failed_notifications: int = 0
    failed_handshakes: int = 0
    expired_leases: int = 0
    malformed_messages: int = 0
    max_records: int = 100_000

    def add(self, record: TransferRecord) -> None:
        self.records.append(record)
        if len(self.records) > self.max_records:
            del self.records[: len(self.records) - self.max_records]

    def add_publication(self, record: PublishRecord) -> None:
        self.publications.append(record)
        if len(self.publications) > self.max_records:
            del self.publications[: len(self.publications) - self.max_records]

    def merge(self, other: TransferStats) -> TransferStats:
        """Stats of two workers together (records concatenated, counters summed)."""
        out = TransferStats(
            records=self.records + other.records,
            publications=self.publications + other.publications,
        )
        for field in (
            "failed_transfers",
            "failed_notifications",
            "failed_handshakes",
            "expired_leases",
            "malformed_messages",
        ):
            setattr(out, field, getattr(self, field) + getattr(other, field))
        return out

    def summary(self) -> dict[str, float]:
        """mean / p50 / p90 / p99 of durations (ms), bytes, descriptors, MB/s, counters."""
        out: dict[str, float] = {
            "transfers": len(self.records),
            "failed_transfers": self.failed_transfers,
            "failed_notifications": self.failed_notifications,
            "failed_handshakes": self.failed_handshakes,
            "expired_leases": self.expired_leases,
            "malformed_messages": self.malformed_messages,
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
        out["bytes_total"] = float(nbytes.sum())
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
