"""The background progress thread (`progress_interval_s`, `progress_idle_s`): full rate while
something happens, backed off while a request is only pinned (a layer-wise request whose
prefill step computes for seconds: a poll every millisecond took 2-4% of a CPU-bound step on
the same core), and back at once when a layer is announced."""

from __future__ import annotations

import os

os.environ.setdefault("UCX_TLS", "tcp,sm,self")

import doctest  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

from support import platforms  # noqa: E402

platforms.force_cpu_devices()

import pytest  # noqa: E402
from absl.testing import absltest  # noqa: E402
from support import transfer as tt  # noqa: E402

from jaxkv import KVCacheSpec  # noqa: E402
from jaxkv.transfer import _engine, nixl_available  # noqa: E402

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32",
                   layout="LKHTD")


class NextIntervalTest(absltest.TestCase):
    def test_doubles_up_to_the_idle_interval_and_drops_when_wanted(self):
        fast, idle = 0.001, 0.01
        seen, interval = [], fast
        for _ in range(6):
            interval = _engine.next_progress_interval(interval, False, fast, idle)
            seen.append(interval)
        self.assertEqual(seen, [0.002, 0.004, 0.008, 0.01, 0.01, 0.01])
        self.assertEqual(_engine.next_progress_interval(idle, True, fast, idle), fast)

    def test_docstring_example(self):
        finder = doctest.DocTestFinder()
        runner = doctest.DocTestRunner()
        (test,) = finder.find(_engine.next_progress_interval, globs=vars(_engine))
        self.assertGreater(len(test.examples), 0)
        self.assertEqual(runner.run(test).failed, 0)

    def test_a_non_positive_idle_interval_is_refused(self):
        with self.assertRaisesRegex(ValueError, "progress_idle_s must be > 0"):
            _engine.KVTransferEngine("p", tt.EngineConfig(SPEC, 1), progress_idle_s=0.0)


@pytest.mark.skipif(not nixl_available(), reason="NIXL (nixl-cu13) is not installed")
class ProgressThreadTest(tt.TransferTestBase):
    def engine_counting_polls(self, **kwargs):
        """A producer engine whose background polls are time-stamped (the loop calls
        `_poll`; the caller never polls here)."""
        engine, _, _ = self.consumer(SPEC, 1, **kwargs)
        stamps: list[float] = []
        lock = threading.Lock()
        poll = engine._poll

        def counted(allow_jax):
            with lock:
                stamps.append(time.monotonic())
            return poll(allow_jax)

        engine._poll = counted
        return engine, stamps

    def test_backs_off_while_a_request_is_only_pinned(self):
        engine, stamps = self.engine_counting_polls(progress_interval_s=0.001,
                                                    progress_idle_s=0.05)
        engine.publish_request("req", [0, 1, 2], layerwise=True)
        time.sleep(0.3)  # past the active window: backed off by now
        start = time.monotonic()
        time.sleep(1.0)
        polls = sum(start <= t < start + 1.0 for t in stamps)
        # at most one poll per 50 ms (20 in the second; a busy machine polls less, never
        # more); at the full rate it would be up to 1000
        self.assertLessEqual(polls, 22)
        self.assertGreater(polls, 0)  # it still polls (leases, late messages)

    def test_an_announcement_brings_it_back_at_once(self):
        engine, stamps = self.engine_counting_polls(progress_interval_s=0.001,
                                                    progress_idle_s=30.0)
        engine.publish_request("req", [0, 1, 2], layerwise=True)
        # backed off: sleeps of 2, 4, ... 2048 ms end ~4.1 s in, the next (4096 ms) runs on
        # past 8 s
        time.sleep(5.0)
        before = len(stamps)
        engine.publish_layers("req", 1)
        deadline = time.monotonic() + 1.5
        while len(stamps) == before and time.monotonic() < deadline:
            time.sleep(0.01)
        self.assertGreater(len(stamps), before, "no poll within 1.5 s of the announcement")
        # and at the full rate (1 ms) for the active window (50 ms) after it
        time.sleep(0.1)
        self.assertGreaterEqual(len(stamps) - before, 3)

    def test_never_backs_off_without_an_idle_interval(self):
        engine, stamps = self.engine_counting_polls(progress_interval_s=0.01,
                                                    progress_idle_s=None)
        engine.publish_request("req", [0, 1, 2], layerwise=True)
        time.sleep(0.3)
        start = time.monotonic()
        time.sleep(1.0)
        polls = sum(start <= t < start + 1.0 for t in stamps)
        # every 10 ms: about 100 (more than the backed-off engine's bound even when busy)
        self.assertGreater(polls, 22)


if __name__ == "__main__":
    absltest.main()
