"""Prometheus export of TransferStats: the dependency-free text format, parsed back by
prometheus_client's own parser when it is installed, and the collector; plus the docstring
examples of the issue-7 modules."""

from __future__ import annotations

import doctest
import importlib

from support import platforms

platforms.force_cpu_devices()

from absl.testing import absltest, parameterized  # noqa: E402

from jaxkv.transfer import TransferStats, TransferStatsCollector, prometheus_text
from jaxkv.transfer._stats import PublishRecord, TransferRecord

try:
    import prometheus_client  # noqa: F401

    HAVE_CLIENT = True
except ImportError:
    HAVE_CLIENT = False


def sample_stats() -> TransferStats:
    stats = TransferStats()
    stats.add(TransferRecord("a", 1000, 4, 4, 0.002, 0.001, 0.0))
    stats.add(TransferRecord("b", 3000, 2, 8, 0.3, 0.004, 0.02))
    stats.add_publication(PublishRecord("a", ((2, 1.0),), 0.5))
    stats.failed_transfers, stats.expired_leases = 2, 1
    return stats


def parse(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, value = line.rsplit(" ", 1)
        name, labels = name_labels.split("{", 1)
        pairs = tuple(sorted(tuple(p.split("=", 1)) for p in labels.rstrip("}").split(",")))
        out[(name, tuple((k, v.strip('"')) for k, v in pairs))] = float(value)
    return out


class PrometheusTextTest(parameterized.TestCase):
    def test_counters_monotonic_beyond_the_kept_records(self):
        stats = TransferStats(max_records=3)
        e = (("engine", ""),)
        previous = None
        for i in range(7):
            stats.add(TransferRecord(f"r{i}", 1000 * (i + 1), 2, 2, 0.002 * (i + 1), 0.001))
            stats.add_publication(PublishRecord(f"r{i}", ((2, 1.0),), 0.25))
            got = parse(prometheus_text(stats))
            if previous is not None:
                for key, value in got.items():
                    if key[0].endswith(("_total", "_count", "_sum", "_bucket")):
                        self.assertGreaterEqual(value, previous[key], key)
            previous = got
        self.assertLen(stats.records, 3)
        self.assertEqual(got[("jaxkv_transfer_requests_total", e)], 7)
        self.assertEqual(got[("jaxkv_transfer_bytes_total", e)], 1000 * 28)
        self.assertEqual(got[("jaxkv_transfer_descriptors_total", e)], 14)
        self.assertEqual(got[("jaxkv_transfer_duration_seconds_count", e)], 7)
        self.assertAlmostEqual(got[("jaxkv_transfer_duration_seconds_sum", e)], 0.002 * 28)
        le = (("engine", ""), ("le", "0.01"))
        self.assertEqual(got[("jaxkv_transfer_duration_seconds_bucket", le)], 5)  # 2..10 ms
        self.assertEqual(got[("jaxkv_transfer_published_requests_total", e)], 7)
        self.assertEqual(got[("jaxkv_transfer_staging_seconds_total", e)], 1.75)
        self.assertEqual(stats.summary()["transfers"], 7)
        merged = stats.merge(stats)
        self.assertEqual((merged.requests_total, merged.bytes_total), (14, 56000))

    def test_values(self):
        got = parse(prometheus_text(sample_stats(), engine="decode"))
        e = (("engine", "decode"),)
        self.assertEqual(got[("jaxkv_transfer_requests_total", e)], 2)
        self.assertEqual(got[("jaxkv_transfer_bytes_total", e)], 4000)
        self.assertEqual(got[("jaxkv_transfer_descriptors_total", e)], 6)
        self.assertEqual(got[("jaxkv_transfer_duration_seconds_count", e)], 2)
        self.assertAlmostEqual(got[("jaxkv_transfer_duration_seconds_sum", e)], 0.302)
        bucket = lambda le: got[("jaxkv_transfer_duration_seconds_bucket",  # noqa: E731
                                 (("engine", "decode"), ("le", le)))]
        self.assertEqual((bucket("0.001"), bucket("0.0025"), bucket("0.25"), bucket("0.5"),
                          bucket("+Inf")), (0, 1, 1, 2, 2))
        self.assertEqual(got[("jaxkv_transfer_failures_total",
                              (("engine", "decode"), ("kind", "failed_transfers")))], 2)
        self.assertEqual(got[("jaxkv_transfer_failures_total",
                              (("engine", "decode"), ("kind", "expired_leases")))], 1)
        self.assertEqual(got[("jaxkv_transfer_published_requests_total", e)], 1)
        self.assertEqual(got[("jaxkv_transfer_staging_seconds_total", e)], 0.5)
        self.assertEqual(got[("jaxkv_transfer_last_throughput_bytes_per_second", e)], 10000)

    def test_empty_stats(self):
        got = parse(prometheus_text(TransferStats()))
        self.assertEqual(got[("jaxkv_transfer_requests_total", (("engine", ""),))], 0)

    @absltest.skipUnless(HAVE_CLIENT, "prometheus_client is not installed")
    def test_client_parses_text_and_collector_agrees(self):
        from prometheus_client import CollectorRegistry, generate_latest
        from prometheus_client.parser import text_string_to_metric_families

        stats = sample_stats()
        ours = {(s.name, tuple(sorted(s.labels.items()))): s.value
                for f in text_string_to_metric_families(prometheus_text(stats, "d"))
                for s in f.samples}
        registry = CollectorRegistry()
        registry.register(TransferStatsCollector(stats, "d"))
        theirs = {(s.name, tuple(sorted(s.labels.items()))): s.value
                  for f in text_string_to_metric_families(generate_latest(registry).decode())
                  for s in f.samples if not s.name.endswith("_created")}
        self.assertEqual(ours, theirs)
        self.assertEqual(ours[("jaxkv_transfer_bytes_total", (("engine", "d"),))], 4000)

    def test_collector_without_client(self):
        if HAVE_CLIENT:
            self.skipTest("prometheus_client is installed")
        with self.assertRaisesRegex(ImportError, "jaxkv\\[metrics\\]"):
            TransferStatsCollector(TransferStats())


class DocstringExamplesTest(parameterized.TestCase):
    @parameterized.parameters("jaxkv.transfer._prometheus", "jaxkv.transfer._layout_advice",
                              "jaxkv.transfer._staging", "jaxkv.transfer._stats")
    def test_examples(self, name):
        import jaxkv
        from jaxkv import EngineConfig

        module = importlib.import_module(name)
        result = doctest.testmod(module, extraglobs={"jaxkv": jaxkv, "EngineConfig": EngineConfig},
                                 optionflags=doctest.ELLIPSIS, verbose=False)
        self.assertGreater(result.attempted, 0)
        self.assertEqual(result.failed, 0)


if __name__ == "__main__":
    absltest.main()
