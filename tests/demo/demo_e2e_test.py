"""The demo end to end: a prefill process and this (decode) process with different TP sizes,
layouts and block sizes produce the colocated run's tokens and prompt KV bytes; the CLI's
JSON report and exit code; the fault mode (prefill process killed mid-run)."""

import os

os.environ.setdefault("UCX_TLS", "tcp,sm,self")

import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

from support import platforms  # noqa: E402

platforms.force_cpu_devices()

import pytest  # noqa: E402
from absl.testing import absltest, parameterized  # noqa: E402

from jaxkv.demo import DemoSettings, run_disaggregated  # noqa: E402
from jaxkv.transfer import nixl_available  # noqa: E402

SMALL = dict(num_requests=3, prompt_len=40, max_new_tokens=4, shared_prefix_len=16,
             num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, head_dim=16,
             vocab_size=128, decode_batch=2, timeout_s=120.0)
CLI_FLAGS = [f"--{k}={v}" for k, v in SMALL.items()] + ["--progress=false"]


def run_cli(tmp_dir: str, *flags: str) -> tuple[int, dict, str]:
    path = os.path.join(tmp_dir, "report.json")
    env = dict(os.environ)
    proc = subprocess.run(
        [sys.executable, "-P", "-m", "jaxkv.demo", *CLI_FLAGS, f"--json_out={path}", *flags],
        capture_output=True, timeout=240, env=env,
    )
    with open(path) as f:
        # decoded here: text mode would turn a progress bar's "\r" into "\n"
        return proc.returncode, json.load(f), (proc.stdout + proc.stderr).decode()


@pytest.mark.skipif(not nixl_available(), reason="NIXL (nixl-cu13) is not installed")
class DisaggregatedTest(parameterized.TestCase):
    def check(self, report):
        self.assertTrue(report["tokens_match"], report["requests"])
        self.assertTrue(report["kv_bytes_match"])
        self.assertEqual(report["completed_requests"], SMALL["num_requests"])
        self.assertEqual(report["failed_requests"], 0)
        for r in report["requests"]:
            self.assertEqual(r["status"], "done")
            self.assertLen(r["tokens"], SMALL["max_new_tokens"])
            self.assertGreater(r["ttft_ms"], 0)
        # prefix caching on the prefill side: every request after the first hits the prefix
        self.assertEqual(report["prefix_cache"]["prefill_hit_tokens"],
                         (SMALL["num_requests"] - 1) * SMALL["shared_prefix_len"])
        moved = report["transfer"]
        self.assertGreater(moved["bytes"], 0)
        self.assertGreater(moved["descriptors"], 0)
        # the transfer line: the engine's own records of the requests of the largest read's
        # size (bytes and descriptors posted to NIXL); the bare-READ floor is
        # benchmarks/bench_transfer.py's
        self.assertNotIn("bare_nixl_read", moved)
        same = moved["same_size_reads"]
        sizes = [(r["bytes"], r["nixl_descriptors"]) for r in report["requests"]]
        self.assertIn((same["bytes"], same["descriptors"]), sizes)
        self.assertEqual(same["bytes"], max(r["bytes"] for r in report["requests"]))
        self.assertEqual(same["requests"], sizes.count((same["bytes"], same["descriptors"])))
        self.assertBetween(same["read_ms"], 0.0, same["transfer_ms"])
        # the engine alone: the sample request read again, polled back to back, as the
        # engine's records saw it (behaviour only: times are the machine's business)
        if report["settings"]["prefill_processes"] == 1:
            alone = same["engine_alone"]
            self.assertEqual(alone["repeats"], 5)
            self.assertBetween(alone["landed_ms"], 0.0, alone["confirmed_ms"])
            self.assertGreater(alone["landed_ms"], 0)
            self.assertEqual(alone["bytes"], same["bytes"])       # the same request's bytes
            self.assertGreater(alone["descriptors"], 0)

    @parameterized.parameters(
        # (prefill_tp, decode_tp, prefill_layout, decode_layout, prefill_bs, decode_bs)
        (2, 1, "KHTD", "THD", 8, 16),  # permute + merge
        (1, 2, "THD", "LKHTD", 16, 16),  # permute into a cross-layer cache
    )
    def test_tokens_match_colocated(self, p_tp, d_tp, p_layout, d_layout, p_bs, d_bs):
        settings = DemoSettings(prefill_tp=p_tp, decode_tp=d_tp, prefill_layout=p_layout,
                                decode_layout=d_layout, prefill_block_size=p_bs,
                                decode_block_size=d_bs, **SMALL)
        self.check(run_disaggregated(settings))

    @parameterized.parameters(
        (2, 2, "HTD", "HTD", 8, 8),
        (1, 1, "LKTHD", "KHTD", 4, 16),
        (2, 1, "LKHTD", "LKTHD", 16, 16),
    )
    @pytest.mark.slow
    def test_tokens_match_colocated_more_pairs(self, p_tp, d_tp, p_layout, d_layout, p_bs,
                                               d_bs):
        settings = DemoSettings(prefill_tp=p_tp, decode_tp=d_tp, prefill_layout=p_layout,
                                decode_layout=d_layout, prefill_block_size=p_bs,
                                decode_block_size=d_bs, dtype="float32", **SMALL)
        self.check(run_disaggregated(settings))

    def test_cli_report(self):
        # TP 2 -> 1 with a 4 -> 8 block-size merge and NHD -> HND permutation
        tmp = self.create_tempdir().full_path
        plot = os.path.join(tmp, "ttft.png")
        rc, report, output = run_cli(
            tmp, "--prefill_tp=2", "--decode_tp=1",
            "--prefill_layout=LKTHD", "--decode_layout=HTD", "--prefill_block_size=4",
            "--decode_block_size=8", "--progress=true", f"--plot_out={plot}",
        )
        self.assertEqual(rc, 0, output)
        self.assertIn(f"plot written to {plot}", output)
        with open(plot, "rb") as f:
            self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")
        # stderr is a pipe: plain progress lines, no carriage-return bar, no probing noise
        self.assertNotIn("\r", output)
        self.assertIn(f"[progress] {SMALL['num_requests']}/{SMALL['num_requests']} requests",
                      output)
        self.assertNotIn("Unable to initialize backend", output)
        self.check(report)
        self.assertIn("tokens match colocated run: True", output)
        self.assertIn("the engine alone (the same request read again, polled back to back",
                      output)
        self.assertEqual(report["settings"]["prefill_layout"], "LKTHD")
        for key in ("prefill_ms", "handshake_ms", "transfer_ms", "post_ms", "queue_ms"):
            self.assertIn(key, report["requests"][0])
        self.assertGreater(report["requests"][0]["handshake_ms"], 0)
        self.assertGreater(sum(r["post_ms"] for r in report["requests"]), 0)

    def test_cli_fault_mode(self):
        rc, report, output = run_cli(
            self.create_tempdir().full_path, "--prefill_tp=1", "--decode_tp=2",
            "--kill_prefill_after=1", "--request_interval_s=1.0", "--read_timeout_s=5",
        )
        self.assertNotEqual(rc, 0, output)
        self.assertFalse(report["tokens_match"])
        self.assertGreaterEqual(report["completed_requests"], 1)
        self.assertGreaterEqual(report["failed_requests"], 1)
        self.assertEqual(report["completed_requests"] + report["failed_requests"],
                         SMALL["num_requests"])
        for r in report["requests"]:
            if r["status"] == "done":
                self.assertTrue(r["tokens_match"])
            else:
                self.assertEqual(r["status"], "failed")
                self.assertTrue(r["error"])
        self.assertIn("failed", output)

    def test_cli_multi_process_prefill_engine(self):
        # The prefill engine is one JAX program over 2 processes (jax.distributed, one device
        # each): its scheduler in process 0, every process publishing its shards.
        rc, report, output = run_cli(
            self.create_tempdir().full_path, "--prefill_tp=2", "--prefill_processes=2",
            "--decode_tp=1",
        )
        self.assertEqual(rc, 0, output)
        self.check(report)
        self.assertIn("prefill engine of 2 processes (TP=2)", output)
        self.assertEqual(report["settings"]["prefill_processes"], 2)
        with self.assertRaisesRegex(ValueError, "prefill_processes=3 must divide"):
            DemoSettings(prefill_tp=2, prefill_processes=3)

    @parameterized.parameters(
        (["--layerwise"],),
        (["--transport=jax"],),
        (["--transport=jax", "--layerwise"],),
        (["--host_staging"],),
        (["--host_staging", "--layerwise", "--prefill_layout=LKHTD"],),
        (["--layerwise", "--pin_cpus", "--poll_interval_ms=5"],),
    )
    def test_cli_transport_flags(self, flags):
        """--layerwise (the prefill publishes before computing, one program per layer,
        each layer announced as written), --transport=jax and --host_staging: the colocated
        run's tokens and prompt KV bytes, the report naming the mode."""
        rc, report, output = run_cli(self.create_tempdir().full_path, "--prefill_tp=2",
                                     "--decode_tp=1", *flags)
        self.assertEqual(rc, 0, output)
        self.check(report)
        s = report["settings"]
        self.assertEqual(s["layerwise"], "--layerwise" in flags)
        self.assertEqual(s["transport"], "jax" if "--transport=jax" in flags else "nixl")
        self.assertEqual(s["host_staging"], "--host_staging" in flags)
        mode = "layer-pipelined (--layerwise)" if s["layerwise"] else "whole request"
        self.assertIn(f"transfer: {s['transport']}"
                      f"{', host-staged' if s['host_staging'] else ''}, {mode}", output)
        self.assertEqual(report["ttft_ms"]["requests"], SMALL["num_requests"])
        self.assertIn("TTFT (ms, 3 requests): median", output)

    @parameterized.parameters((["--host_staging"],), (["--transport=jax"],))
    def test_layerwise_megabyte_rows_from_a_two_device_step(self, flags):
        """Layers of 4 MiB per announcement (1024 tokens, 8 KV heads x 128, bf16) announced
        from inside a TP 2 step of a process with exactly 2 CPU devices, whose layers end in
        collectives: the announcements carry their rows (host staging, JAX transport) and
        the step completes, tokens and prompt KV as colocated. Negative control, run by
        hand: with the rows handed over by `io_callback` (`_on_cpu` returning False) the
        step never finished here (2 cores: its operand copy waited for the CPU client's
        threads, which the step's partitions held) and XLA aborted the prefill process."""
        rc, report, output = run_cli(
            self.create_tempdir().full_path, "--prefill_tp=2", "--decode_tp=1", "--layerwise",
            "--num_requests=1", "--prompt_len=1024", "--shared_prefix_len=0",
            "--num_kv_heads=8", "--num_heads=8", "--head_dim=128", "--d_model=256",
            "--max_new_tokens=2", *flags)
        self.assertEqual(rc, 0, output)
        self.assertTrue(report["settings"]["layerwise"])
        self.assertEqual((report["completed_requests"], report["failed_requests"]), (1, 0))
        self.assertTrue(report["tokens_match"], report["requests"])
        self.assertTrue(report["kv_bytes_match"])

    @parameterized.parameters("nixl", "jax")
    def test_layerwise_ab_reports_both_modes(self, transport):
        """--layerwise_ab: one request of each pair layer-pipelined, the other whole, in ABBA
        order (whole, layer-wise, layer-wise), in one run; both modes' TTFT reported.
        Requests 1 s apart, so later ones find the shared prefix in the decode cache and read
        only the rest (layer by layer for req-1 and req-2: the JAX transport formats the
        groups from the tail of the step's rows)."""
        rc, report, output = run_cli(
            self.create_tempdir().full_path, "--prefill_tp=2", "--decode_tp=1",
            "--layerwise_ab", f"--transport={transport}", "--request_interval_s=1")
        self.assertEqual(rc, 0, output)
        self.check(report)
        self.assertEqual([r["layerwise"] for r in report["requests"]], [False, True, True])
        by_mode = report["ttft_ms_by_mode"]
        self.assertEqual((by_mode["whole"]["requests"], by_mode["layerwise"]["requests"]),
                         (1, 2))
        self.assertTrue(any(r["layerwise"] and r["decode_hit_tokens"] > 0
                            for r in report["requests"]), report["requests"])
        self.assertIn("one request of each pair layer-pipelined, the other whole, in ABBA order "
                      "(--layerwise_ab)", output)
        self.assertRegex(output, r"layerwise: TTFT median [\d.]+ ms over 2 requests")

    @parameterized.parameters(True, False)
    def test_warm_up_reads_leave_nothing_to_compile_for_the_timed_requests(self, warm_up):
        """`warm_up_reads` (the default) serves throwaway requests first: whole and
        layer-wise, without and with a prefix hit. While the timed requests are then served
        (whole, layer-wise with a prefix hit, whole with a hit, over the JAX transport) this
        process, the consumer, compiles nothing: no formatting program, no step. The negative
        control, without the warm-up, compiles its formatting programs then."""
        from unittest import mock

        import jax
        from support import compiles

        from jaxkv.demo import _router

        serving: list[bool] = []
        original = _router.Router.run

        def run(router, side):  # counts while the timed requests (req-*) are served
            if all(rid.startswith("req-") for rid in router.results):
                serving.append(True)
            try:
                return original(router, side)
            finally:
                serving.clear()

        settings = DemoSettings(**SMALL, prefill_tp=2, decode_tp=1, layerwise_ab=True,
                                transport="jax", request_interval_s=1.0,
                                warm_up_reads=warm_up)
        jax.clear_caches()  # nothing compiled by an earlier test of this process counts
        with (mock.patch.object(_router.Router, "run", run),
              compiles.recorded(lambda: bool(serving)) as compiled):
            report = run_disaggregated(settings)
        self.check(report)
        self.assertTrue(any(r["layerwise"] and r["decode_hit_tokens"] > 0
                            for r in report["requests"]), report["requests"])
        if warm_up:
            self.assertEqual(compiled, [])
            self.assertGreater(report["timings_ms"]["warm_up_ms"], 0)
        else:
            self.assertIn("Compiling jit(_concat_rearrange)", compiled)
            self.assertNotIn("warm_up_ms", report["timings_ms"])

    def test_transport_flags_refused(self):
        with self.assertRaisesRegex(ValueError, "needs transport='nixl'"):
            DemoSettings(transport="jax", host_staging=True)
        with self.assertRaisesRegex(ValueError, "one-process prefill engine"):
            DemoSettings(layerwise=True, prefill_tp=2, prefill_processes=2)
        with self.assertRaisesRegex(ValueError, "transport must be"):
            DemoSettings(transport="ucx")
        with self.assertRaisesRegex(ValueError, "pick one"):
            DemoSettings(layerwise=True, layerwise_ab=True)
        with self.assertRaisesRegex(ValueError, "pin_cpus runs with a one-process prefill"):
            DemoSettings(pin_cpus=True, prefill_tp=2, prefill_processes=2)
        with self.assertRaisesRegex(ValueError, "poll_interval_s must be in"):
            DemoSettings(poll_interval_s=0)
        proc = subprocess.run(
            [sys.executable, "-P", "-m", "jaxkv.demo", "--layerwise",
             "--serve_with=vllm-scheduler"], capture_output=True, text=True, timeout=120)
        self.assertNotEqual(proc.returncode, 0)
        self.assertIn("run with --serve_with=jaxkv", proc.stderr)

    def test_bad_flags_are_refused(self):
        proc = subprocess.run(
            [sys.executable, "-P", "-m", "jaxkv.demo", "--prefill_block_size=16",
             "--decode_block_size=8"],
            capture_output=True, text=True, timeout=120,
        )
        self.assertNotEqual(proc.returncode, 0)
        self.assertIn("multiple of prefill_block_size", proc.stderr)


if __name__ == "__main__":
    absltest.main()
