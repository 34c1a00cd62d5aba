"""The coordination of a multi-controller engine's processes, in one process: two
`MultiControllerEngine` / `StepChannel` objects (process 0 and 1) over an in-memory key-value
store with the semantics of ``jax.distributed``'s, their engines replaced by recorders of what
the coordination asks of them. The real thing runs in multicontroller_transfer_test."""

from __future__ import annotations

import threading
import time

import numpy as np
from absl.testing import absltest

from jaxkv import EngineConfig, KVCacheSpec
from jaxkv.transfer import (
    FailedRead,
    MultiControllerEngine,
    PollResult,
    StepChannel,
    broadcast_block_ids,
)


class Store:
    """``jax.distributed``'s key-value store: set (refused when present unless overwriting),
    blocking get with a timeout, try-get, directory get and delete (of a key and of the
    directory under it)."""

    def __init__(self):
        self.data: dict[str, bytes] = {}
        self.lock = threading.Lock()

    def key_value_set_bytes(self, key, value, allow_overwrite=False):
        with self.lock:
            if key in self.data and not allow_overwrite:
                raise RuntimeError(f"ALREADY_EXISTS: {key}")
            self.data[key] = bytes(value)

    def blocking_key_value_get_bytes(self, key, timeout_in_ms):
        deadline = time.monotonic() + timeout_in_ms / 1000
        while time.monotonic() < deadline:
            with self.lock:
                if key in self.data:
                    return self.data[key]
            time.sleep(0.001)
        raise RuntimeError(f"DEADLINE_EXCEEDED: {key}")

    def key_value_try_get_bytes(self, key):
        with self.lock:
            if key not in self.data:
                raise RuntimeError(f"NOT_FOUND: {key}")
            return self.data[key]

    def key_value_dir_get_bytes(self, key):
        with self.lock:
            return [(k, v) for k, v in self.data.items() if k.startswith(key)]

    def key_value_delete(self, key):  # the key and the directory under it
        with self.lock:
            for k in [k for k in self.data if k == key or k.startswith(key + "/")]:
                del self.data[k]


class Engine:
    """Records what the coordination asks of a process's engine; `poll` returns what the test
    queued."""

    def __init__(self):
        self.engine_id = "prefill"
        self.config = EngineConfig(KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=4,
                                               block_size=4), 2)
        self.aborted: list[str] = []
        self.queued = PollResult()

    def poll(self) -> PollResult:
        result, self.queued = self.queued, PollResult()
        return result

    def abort_request(self, request_id):
        self.aborted.append(request_id)

    def start_read(self, params, local_block_ids, timeout_s=None, *, read_id=None):
        del params, local_block_ids, timeout_s, read_id


def pair(test: absltest.TestCase, store: Store | None = None):
    """Processes 0 and 1 of one engine: (mc0, mc1, engine0, engine1)."""
    store = store or Store()
    engines = Engine(), Engine()
    mcs = [
        MultiControllerEngine(engine, client=store, process_id=pid, num_processes=2,
                              store_interval_s=0.0)
        for pid, engine in enumerate(engines)
    ]
    for mc in mcs:
        test.addCleanup(mc.close)
    return mcs[0], mcs[1], engines[0], engines[1]


class StepChannelTest(absltest.TestCase):
    def test_broadcast(self):
        store = Store()
        zero = StepChannel("s", client=store, process_id=0, window=2)
        one = StepChannel("s", client=store, process_id=1, timeout_s=1.0)
        with self.assertRaises(TimeoutError):
            one.broadcast(None, timeout_s=0)  # nothing yet: the same step is waited for again
        self.assertEqual(one.step, 0)
        table = np.arange(6, dtype=np.int64).reshape(2, 3)
        sent = zero.broadcast({"req-1": [3, 4], "table": table})
        got = one.broadcast(None)
        for value in (sent, got):
            self.assertEqual(value["req-1"], [3, 4])
            np.testing.assert_array_equal(value["table"], table)
            self.assertEqual(value["table"].dtype, np.int32)
        ids = broadcast_block_ids(zero, {"a": [1, 2]})
        self.assertEqual(broadcast_block_ids(one, None)["a"].tolist(), ids["a"].tolist())
        zero.broadcast(None)
        self.assertEqual(one.broadcast(None, timeout_s=0), None)
        # window 2: step 0's key is gone once step 2 was published
        self.assertEqual(sorted(k.rsplit("/", 1)[1] for k in store.data), ["1", "2"])
        with self.assertRaises(TimeoutError):
            one.broadcast(None, timeout_s=0.05)
        with self.assertRaisesRegex(TypeError, "int32"):
            zero.broadcast(np.array([1 << 40]))
        with self.assertRaisesRegex(TypeError, "cannot broadcast"):
            zero.broadcast(object())


class AggregationTest(absltest.TestCase):
    def test_read_finished_once_every_process_finished(self):
        mc0, mc1, engine0, engine1 = pair(self)
        engine0.queued.finished.append("r")
        self.assertEqual(mc0.poll().finished, [])
        engine1.queued.finished.append("r")
        self.assertEqual(mc1.poll().finished, [])  # only process 0 reports the engine level
        result = mc0.poll()
        self.assertEqual((result.finished, result.failed), (["r"], []))
        self.assertEqual(mc0.poll().finished, [])  # once

    def test_read_failing_in_one_process_fails_everywhere(self):
        store = Store()
        mc0, mc1, engine0, engine1 = pair(self, store)
        engine1.queued.failed.append(FailedRead("r", "a NIXL READ failed", (7, 8)))
        mc1.poll()
        # Process 0 learns of it: the read is aborted in every process, but reported failed
        # only once process 0's part ended too (no READ still writes the blocks).
        self.assertEqual(mc0.poll().failed, [])
        self.assertEqual(engine0.aborted, ["r"])
        mc0.poll()
        mc1.poll()
        self.assertEqual((engine0.aborted, engine1.aborted), (["r"], ["r"]))  # applied once
        engine0.queued.failed.append(FailedRead("r", "aborted", (7, 8, 9)))
        failed = mc0.poll().failed
        self.assertEqual([f.invalid_block_ids for f in failed], [(7, 8, 9)])
        self.assertIn("process 1: a NIXL READ failed", failed[0].reason)
        self.assertIn("process 0: aborted", failed[0].reason)
        self.assertFalse([k for k in store.data if "/abort/" in k])  # cleaned up

    def test_abort_in_any_process_reaches_every_process_and_frees_once(self):
        mc0, mc1, engine0, engine1 = pair(self)
        mc1.abort_request("p")
        self.assertEqual(engine1.aborted, ["p"])
        mc0.poll()
        self.assertEqual(engine0.aborted, ["p"])
        mc1.poll()
        self.assertEqual(engine1.aborted, ["p"])  # applied once
        engine0.queued.freeable.append("p")
        self.assertEqual(mc0.poll().freeable, [])
        engine1.queued.freeable.append("p")
        mc1.poll()
        self.assertEqual(mc0.poll().freeable, ["p"])

    def test_an_abort_before_the_read_started_stops_it(self):
        mc0, mc1, engine0, engine1 = pair(self)
        mc0.abort_request("late")
        params = type("P", (), {"request_id": "late"})()
        mc1.start_read(params, [1])
        self.assertEqual(engine1.aborted, ["late"])


if __name__ == "__main__":
    absltest.main()
