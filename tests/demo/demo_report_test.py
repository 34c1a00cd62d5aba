"""The demo's report and plot from synthetic runs (no model, no transfer): TTFT segments add
up to the TTFT, the figure carries the configuration, the prefix-hit marks and the transfer
panel of the engine's own read times, and `write_plot` renders a PNG."""

from support import platforms

platforms.force_cpu_devices()

import os  # noqa: E402

from absl.testing import absltest  # noqa: E402

from jaxkv.demo import DemoSettings
from jaxkv.demo._engines import RequestResult
from jaxkv.demo._report import (  # noqa: E402
    TTFT_SEGMENTS,
    build_report,
    format_report,
    plot_figure,
    ttft_segments,
    write_plot,
)

SETTINGS = DemoSettings(prefill_tp=2, decode_tp=1, prefill_layout="LKTHD",
                        decode_layout="HTD", prefill_block_size=4, decode_block_size=8,
                        num_requests=3, prompt_len=40, shared_prefix_len=16)


def synthetic_report(with_alone: bool = True, reads: bool = True) -> dict:
    """Three requests: a cold one, a prefix hit on both sides, and a failed one (`reads`
    False: the two done ones read nothing)."""
    nbytes = 10240 if reads else 0
    results = [
        RequestResult("req-0", status="done", tokens=[1, 2], bytes=nbytes, descriptors=20,
                      nixl_descriptors=40, blocks_read=3, queue_s=0.001, prefill_s=0.010,
                      handshake_s=0.017, transfer_s=0.0193, read_s=0.0125, post_s=0.0207,
                      ttft_s=0.0735, tokens_match=True, kv_match=True),
        RequestResult("req-1", status="done", tokens=[1, 3], bytes=nbytes, descriptors=20,
                      nixl_descriptors=40, blocks_read=2, prefill_hit_tokens=16,
                      decode_hit_tokens=8, queue_s=0.005, prefill_s=0.002, transfer_s=0.0167,
                      read_s=0.0121, post_s=0.0003, ttft_s=0.0661, tokens_match=True,
                      kv_match=True),
        RequestResult("req-2", status="failed", error="transfer: timed out",
                      prefill_hit_tokens=16, queue_s=0.004, prefill_s=0.002),
    ]
    alone = None
    if with_alone:
        alone = {"landed_ms": 0.08, "confirmed_ms": 0.5, "repeats": 5, "bytes": 10240,
                 "descriptors": 40}
    return build_report(SETTINGS, results, {}, alone, {}, {"total_s": 1.0})


class TtftSegmentsTest(absltest.TestCase):
    def test_segments_add_up_to_ttft(self):
        report = synthetic_report()
        for row in report["requests"][:2]:
            parts = ttft_segments(row)
            self.assertCountEqual(parts, [k for k, _ in TTFT_SEGMENTS] + ["other_ms"])
            self.assertAlmostEqual(sum(parts.values()), row["ttft_ms"], places=9)
            self.assertGreater(parts["other_ms"], 0)
        # req-1: 73.5 - (1 + 10 + 17 + 19.3 + 20.7) and 66.1 - (5 + 2 + 0 + 16.7 + 0.3)
        self.assertAlmostEqual(ttft_segments(report["requests"][0])["other_ms"], 5.5, places=6)
        self.assertAlmostEqual(ttft_segments(report["requests"][1])["other_ms"], 42.1, places=6)

    def test_failed_request_has_no_rest(self):
        parts = ttft_segments(synthetic_report()["requests"][2])
        self.assertEqual(parts["other_ms"], 0.0)
        self.assertEqual(parts["queue_ms"], 4.0)

    def test_rest_never_negative(self):
        row = {key: 2.0 for key, _ in TTFT_SEGMENTS} | {"ttft_ms": 9.0}
        self.assertEqual(ttft_segments(row)["other_ms"], 0.0)


class ReportTest(absltest.TestCase):
    """The transfer section states what the transfer engine measured (no bare-transport
    numbers: benchmarks/bench_transfer.py measures those)."""

    def test_same_size_reads_and_the_engine_alone(self):
        transfer = synthetic_report()["transfer"]
        self.assertNotIn("bare_nixl_read", transfer)
        self.assertNotIn("vs_bare", transfer)
        self.assertEqual(transfer["same_size_reads"], {
            "bytes": 10240, "descriptors": 40, "requests": 2, "read_ms": 12.3,
            "confirm_ms": 5.7, "transfer_ms": 18.0, "read_MBps": 10240 / 12.3 / 1e3,
            "transfer_MBps": 10240 / 18.0 / 1e3,
            "engine_alone": {"landed_ms": 0.08, "confirmed_ms": 0.5, "repeats": 5,
                             "bytes": 10240, "descriptors": 40}})
        self.assertIsNone(synthetic_report(reads=False)["transfer"]["same_size_reads"])

    def test_text_lines(self):
        lines = format_report(synthetic_report()).splitlines()
        self.assertIn("transfer of a 10 KiB read (40 descs; median of 2; as the decode loop saw "
                      "them, polling between model steps): posted -> landed 12.30 ms (1 MB/s), "
                      "-> confirmed 18.00 ms (1 MB/s)", lines)
        self.assertIn("the engine alone (the same request read again, polled back to back, "
                      "median of 5): landed 0.08 ms, confirmed 0.50 ms", lines)
        self.assertFalse([line for line in lines if "bare" in line])
        text = format_report(synthetic_report(with_alone=False, reads=False))
        self.assertNotIn("transfer of a", text)
        self.assertNotIn("the engine alone", text)


class PlotTest(absltest.TestCase):
    def test_figure_contents(self):
        fig = plot_figure(synthetic_report())
        title = fig.get_suptitle()
        for part in ("prefill TP=2 LKTHD block 4", "decode TP=1 HTD block 8", "bfloat16",
                     "3 requests x 40 tokens (16 shared)"):
            self.assertIn(part, title)
        ttft_ax, transfer_ax = fig.axes
        # six stacked segments per request, the bars of each request summing to its TTFT
        self.assertLen(ttft_ax.patches, 6 * 3)
        tops = [max(p.get_y() + p.get_height() for p in ttft_ax.patches if
                    abs(p.get_x() + p.get_width() / 2 - x) < 1e-9) for x in range(2)]
        self.assertAlmostEqual(tops[0], 73.5, places=6)
        self.assertAlmostEqual(tops[1], 66.1, places=6)
        marks = [t.get_text() for t in ttft_ax.texts]
        self.assertIn("P16\nD8", marks)
        self.assertIn("P16\nfailed", marks)
        self.assertLen(marks, 2)  # req-0 had no prefix hit: unmarked
        labels = [t.get_text() for t in transfer_ax.get_yticklabels()]
        self.assertEqual(labels, ["jaxkv: posted -> landed", "jaxkv: -> confirmed",
                                  "engine alone: posted -> landed",
                                  "engine alone: -> confirmed"])
        widths = [p.get_width() for p in transfer_ax.patches]
        self.assertEqual(widths[2:], [0.08, 0.5])               # the engine alone
        self.assertAlmostEqual(widths[0], 12.3, places=6)  # medians of req-0 and req-1
        self.assertAlmostEqual(widths[1], 18.0, places=6)
        texts = [t.get_text() for t in transfer_ax.texts]
        self.assertEqual(texts[2:], [" 0.08 ms, 128 MB/s", " 0.5 ms, 20 MB/s"])
        self.assertIn("10 KiB in 40 descriptors (median of 2)", transfer_ax.get_title())

    def test_without_the_engine_alone(self):
        fig = plot_figure(synthetic_report(with_alone=False))
        labels = [t.get_text() for t in fig.axes[1].get_yticklabels()]
        self.assertEqual(labels, ["jaxkv: posted -> landed", "jaxkv: -> confirmed"])

    def test_without_a_completed_read(self):
        fig = plot_figure(synthetic_report(with_alone=False, reads=False))
        self.assertFalse(fig.axes[1].axison)
        self.assertIn("no transfer measurement", fig.axes[1].texts[0].get_text())

    def test_write_plot_renders_a_png(self):
        path = os.path.join(self.create_tempdir().full_path, "demo.png")
        self.assertTrue(write_plot(synthetic_report(), path))
        with open(path, "rb") as f:
            self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")
        import matplotlib.image

        height, width, _ = matplotlib.image.imread(path).shape
        self.assertEqual((width, height), (13 * 110, round(5.2 * 110)))

    def test_no_requests(self):
        report = synthetic_report()
        report["requests"] = []
        self.assertFalse(write_plot(report, os.path.join(self.create_tempdir().full_path,
                                                         "x.png")))
        with self.assertRaisesRegex(ValueError, "no requests"):
            plot_figure(report)


if __name__ == "__main__":
    absltest.main()
