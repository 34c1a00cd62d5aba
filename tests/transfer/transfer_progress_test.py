"""The background progress thread (`progress_interval_s`, `progress_idle_s`): full rate while
something happens, backed off while a request is only pinned (a layer-wise request whose
prefill step computes for seconds: a poll every millisecond took 2-4% of a CPU-bound step on
the same core) and while a step holds the registered cache (its announcements' callbacks
progress the engine), and back at once when a layer is announced."""

from __future__ import annotations

import os

os.environ.setdefault("UCX_TLS", "tcp,sm,self")

import doctest  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from unittest import mock  # noqa: E402

from support import platforms  # noqa: E402

platforms.force_cpu_devices()

import pytest  # noqa: E402
from absl.testing import absltest  # noqa: E402
from support import transfer as tt  # noqa: E402

from jaxkv import KVCacheSpec  # noqa: E402
from jaxkv.transfer import _engine, nixl_available  # noqa: E402

SPEC_KWARGS = dict(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32",
                   layout="LKHTD")
SPEC = KVCacheSpec(**SPEC_KWARGS)


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


class _RecordingEvent(threading.Event):
    """The progress thread's wake event, recording each sleep it asks for and whether that
    sleep was cut short by the event (True) or ran its time (False), in order."""

    def __init__(self):
        super().__init__()
        self.sleeps: list[float] = []
        self.woken: list[bool] = []

    def wait(self, timeout=None):
        self.sleeps.append(timeout)
        woken = super().wait(timeout)
        self.woken.append(woken)
        return woken


@pytest.mark.skipif(not nixl_available(), reason="NIXL (nixl-cu13) is not installed")
class ProgressThreadTest(tt.TransferTestBase):
    """What the thread decides (its sleeps), not how fast a machine runs it: a busy machine
    only delays the decisions, each wait below has a generous deadline."""

    def engine_recording_sleeps(self, **kwargs):
        engine, _, _ = self.consumer(SPEC, 1, **kwargs)
        event = _RecordingEvent()
        idle, engine._wake = engine._wake, event  # the loop looks it up at every sleep
        idle.set()  # the thread may sleep on the old event until something wakes it
        return engine, event

    def keep_progress_wanted(self):
        """An active window of 10 minutes: after an announcement progress stays wanted (but
        for a step holding the cache) for the whole test."""
        window = mock.patch.object(_engine, "PROGRESS_ACTIVE_WINDOW_S", 600.0)
        window.start()
        self.addCleanup(window.stop)

    def unannounced_request(self, request_id, control="auto"):
        """A producer process (`SPEC`, TP 1) holding a layer-wise request none of whose
        layers is written or announced yet; returns its pipe and the request's params."""
        _, conn = self.start_producer(SPEC_KWARGS, 1, engine_kwargs={"control": control})
        self.ready(conn)
        self.call(conn, "register", tt.REMOTE_IDS, 0)  # no layer written yet
        return conn, self.call(conn, "pin_lw", request_id, tt.REMOTE_IDS, 30.0)

    def wait_for(self, predicate, what, timeout=30.0):
        deadline = time.monotonic() + timeout
        while not predicate():
            self.assertLess(time.monotonic(), deadline, f"timed out waiting for {what}")
            time.sleep(0.01)

    def test_backs_off_while_a_request_is_only_pinned(self):
        engine, event = self.engine_recording_sleeps(progress_interval_s=0.001,
                                                     progress_idle_s=0.05)
        sleeps = event.sleeps
        engine.publish_request("req", [0, 1, 2], layerwise=True)
        self.wait_for(lambda: sleeps[-3:] == [0.05] * 3, "three idle sleeps")
        # nothing happens: the sleeps double from the full rate up to the idle interval and
        # stay there (at the full rate they would all be 1 ms)
        backoff = [0.002, 0.004, 0.008, 0.016, 0.032, 0.05, 0.05, 0.05]
        runs = [sleeps[i:i + len(backoff)] for i in range(len(sleeps) - len(backoff) + 1)]
        self.assertIn(backoff, runs, sleeps)

    def test_an_announcement_brings_it_back_at_once(self):
        engine, event = self.engine_recording_sleeps(progress_interval_s=0.001,
                                                     progress_idle_s=60.0)
        sleeps, woken = event.sleeps, event.woken
        engine.publish_request("req", [0, 1, 2], layerwise=True)
        # in a sleep of a second or more (the doubling reaches it after ~1 s)
        self.wait_for(lambda: sleeps and sleeps[-1] >= 1.0 and len(woken) == len(sleeps) - 1,
                      "a sleep of a second or more")
        long_sleep = len(sleeps) - 1
        engine.publish_layers("req", 1)
        self.wait_for(lambda: len(sleeps) > long_sleep + 1, "the next sleep")
        # the announcement cut that sleep short (without the wake it runs its time), and the
        # thread is back at its full rate
        self.assertTrue(woken[long_sleep])
        self.assertEqual(sleeps[long_sleep + 1], 0.001)

    def test_backs_off_while_a_step_holds_the_cache(self):
        # A layer-wise step's announcements keep progress wanted (the active window, made
        # long here); while the step holds the registered cache its callbacks progress the
        # engine, so the thread backs off, and it is back at its full rate once the step's
        # output is handed over.
        import jax

        self.keep_progress_wanted()
        engine, event = self.engine_recording_sleeps(progress_interval_s=0.001,
                                                     progress_idle_s=0.05)
        sleeps = event.sleeps
        engine.publish_request("req", [0, 1, 2], layerwise=True)
        engine.publish_layers("req", 1)
        self.wait_for(lambda: sleeps[-5:] == [0.001] * 5, "five sleeps at the full rate")
        step = jax.jit(lambda cache: cache, donate_argnums=0)
        output = step(engine.caches[0])  # the step consumed the registered cache
        self.wait_for(lambda: sleeps[-3:] == [0.05] * 3, "three idle sleeps during the step")
        engine.update_cache(output)
        self.wait_for(lambda: sleeps[-5:] == [0.001] * 5, "the full rate after the step")

    def test_handing_over_a_step_output_ends_the_back_off_at_once(self):
        import jax

        self.keep_progress_wanted()
        engine, event = self.engine_recording_sleeps(progress_interval_s=0.001,
                                                     progress_idle_s=60.0)
        sleeps, woken = event.sleeps, event.woken
        engine.publish_request("req", [0, 1, 2], layerwise=True)
        engine.publish_layers("req", 1)  # progress wanted (the window) but for the step
        output = jax.jit(lambda cache: cache, donate_argnums=0)(engine.caches[0])
        self.wait_for(lambda: sleeps and sleeps[-1] >= 0.25 and len(woken) == len(sleeps) - 1,
                      "a sleep of a quarter second or more during the step")
        long_sleep = len(sleeps) - 1
        engine.update_cache(output)
        self.wait_for(lambda: len(sleeps) > long_sleep + 1, "the next sleep")
        self.assertTrue(woken[long_sleep])  # cut short by the hand-over, not run out
        self.assertEqual(sleeps[long_sleep + 1], 0.001)

    def test_sleeps_until_woken_while_nothing_is_in_flight(self):
        # Nothing pinned or read: the thread sleeps the idle interval (not a fixed tick)
        # until a publication wakes it.
        engine, event = self.engine_recording_sleeps(progress_interval_s=0.001,
                                                     progress_idle_s=60.0)
        sleeps, woken = event.sleeps, event.woken
        self.wait_for(lambda: sleeps and sleeps[-1] == 60.0, "an idle sleep")
        idle_sleep = len(sleeps) - 1
        engine.publish_request("req", [0, 1, 2])
        self.wait_for(lambda: len(sleeps) > idle_sleep + 1, "the next sleep")
        self.assertTrue(woken[idle_sleep])
        self.assertEqual(sleeps[idle_sleep + 1], 0.001)

    def test_a_read_awaiting_announcements_backs_off_until_one_arrives(self):
        # A layer-wise read whose producer has not announced a layer yet moves nothing when
        # polled (the producer's step computes): the consumer's thread backs off, and the
        # announcement (Ready, over TCP) wakes it at once; the read then lands exactly.
        # The back-off jumps straight to the idle interval here (the decision is what is
        # tested): a 60 s sleep can only be cut short, never run out, within the test.
        backoff = mock.patch.object(_engine, "next_progress_interval",
                                    lambda interval, wanted, fast, idle: fast if wanted else idle)
        backoff.start()
        self.addCleanup(backoff.stop)
        conn, params = self.unannounced_request("req")
        engine, event = self.engine_recording_sleeps(progress_interval_s=0.001,
                                                     progress_idle_s=60.0)
        sleeps, woken = event.sleeps, event.woken
        engine.start_read(params, tt.LOCAL_IDS)
        # at the full rate every sleep would be 1 ms for as long as the read is in flight
        self.wait_for(lambda: sleeps and sleeps[-1] == 60.0 and len(woken) == len(sleeps) - 1,
                      "an idle sleep while no layer is announced")
        long_sleep = len(sleeps) - 1
        self.call(conn, "layers", "req", 1)
        self.wait_for(lambda: len(woken) > long_sleep, "the idle sleep to end")
        self.assertTrue(woken[long_sleep])  # cut short by the announcement
        self.call(conn, "layers", "req", 2)
        finished, failed = self.wait(engine, ["req"])
        self.assertEqual((finished, failed), (["req"], []))
        g = tt.global_cache(SPEC, len(tt.REMOTE_IDS) * SPEC.block_size, seed=tt.G_SEED)
        self.check_cache(engine.caches[0], tt.EngineConfig(SPEC, 1), g, tt.LOCAL_IDS)

    def test_a_read_keeps_the_full_rate_where_announcements_come_by_polling(self):
        # With NIXL notifications as the control channel only a poll sees the announcement:
        # the thread never backs off while the read waits.
        self.assertEqual(self._sleeps_while_awaiting(control="nixl"), {0.001})
        self.assertIn(0.05, self._sleeps_while_awaiting(control="tcp"))

    def _sleeps_while_awaiting(self, control):
        """The distinct sleeps of a consumer's thread over 2 s of a layer-wise read that no
        layer was announced for (the thread's idle interval 50 ms)."""
        _, params = self.unannounced_request(f"req-{control}", control)
        engine, event = self.engine_recording_sleeps(progress_interval_s=0.001,
                                                     progress_idle_s=0.05, control=control)
        engine.start_read(params, tt.LOCAL_IDS)
        self.wait_for(lambda: engine._reading and all(
            s.awaiting_announcement for s in list(engine._reading.values())),
            "the read to await announcements")
        first = len(event.sleeps)
        time.sleep(2.0)
        return set(event.sleeps[first:])

    def test_never_backs_off_without_an_idle_interval(self):
        engine, event = self.engine_recording_sleeps(progress_interval_s=0.01,
                                                     progress_idle_s=None)
        sleeps = event.sleeps
        engine.publish_request("req", [0, 1, 2], layerwise=True)
        self.wait_for(lambda: len(sleeps) >= 30, "30 sleeps")
        self.assertEqual(set(sleeps), {0.01})


if __name__ == "__main__":
    absltest.main()
