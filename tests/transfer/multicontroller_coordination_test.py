"""The coordination of a multi-controller engine's processes, in one process: two
`MultiControllerEngine` / `StepChannel` objects (process 0 and 1) over an in-memory key-value
store with the semantics of ``jax.distributed``'s, their engines replaced by recorders of what
the coordination asks of them. The real thing runs in multicontroller_transfer_test."""

from __future__ import annotations

import threading
import time

import numpy as np
from absl.testing import absltest
from support import transfer as tt

from jaxkv import EngineConfig, KVCacheSpec
from jaxkv.transfer import FailedRead, PollResult, StepChannel, TransferParams, broadcast_block_ids
from jaxkv.transfer._metadata import AgentInfo, MetadataError, RankInfo, engine_metadata
from jaxkv.transfer._multicontroller import MultiControllerEngine  # the coordination state machine
from jaxkv.transfer._side_channel import fetch_metadata


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
    """Records what the coordination asks of a process's engine (TP rank `pid` of a TP 2
    engine); `poll` returns what the test queued."""

    def __init__(self, pid: int = 0):
        self.engine_id = "prefill"
        self.deployment_key = None  # no key: process 0 serves plain metadata on loopback
        self.config = EngineConfig(KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=4,
                                               block_size=4), 2)
        self.pid = pid
        self.generation = 1000 + pid  # each process starts with its own
        self.aborted: list[str] = []
        self.pinned: list[str] = []
        self.refuse = False
        self.queued = PollResult()

    @property
    def metadata(self):
        rank = RankInfo(rank=self.pid, agent_name=f"agent-{self.pid}",
                        regions=tt.fake_regions(self.config, self.pid, 16))
        return engine_metadata(self.engine_id, self.config, [rank],
                               [AgentInfo(name=f"agent-{self.pid}", metadata=b"md")],
                               self.generation)

    def adopt_generation(self, generation):
        self.generation = generation

    def publish_request(self, request_id, block_ids, lease_s=None, *, layerwise=False,
                        expected_reads=1):
        if self.refuse:
            raise ValueError("no such blocks")
        self.pinned.append(request_id)
        return TransferParams(self.engine_id, [("127.0.0.1", 1)], request_id,
                              list(block_ids), 30.0, self.generation, layerwise)

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
    engines = Engine(0), Engine(1)
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


def both(call0, call1):
    """Runs two processes' calls at once (each may wait for the other); returns both
    results (an exception as the result)."""
    out = [None, None]

    def run(i, call):
        try:
            out[i] = call()
        except Exception as error:  # noqa: BLE001 - returned to the test
            out[i] = error

    thread = threading.Thread(target=run, args=(1, call1))
    thread.start()
    run(0, call0)
    thread.join(timeout=30)
    return out


class PublicationTest(absltest.TestCase):
    def test_metadata_merged_under_one_generation(self):
        mc0, mc1, engine0, engine1 = pair(self)
        meta0, meta1 = both(mc0.publish_metadata, mc1.publish_metadata)
        self.assertEqual(meta0, meta1)
        self.assertEqual([r.rank for r in meta0.ranks], [0, 1])
        self.assertEqual(meta0.generation, 1000)  # process 0's, adopted by every process
        self.assertEqual((engine0.generation, engine1.generation), (1000, 1000))
        self.assertEqual(mc1.address, mc0.address)
        # served by process 0: what a consumer fetches
        self.assertEqual(fetch_metadata(mc0.address, "prefill"), meta0)
        # a re-publication gets a new generation, in every process
        meta0, meta1 = both(mc0.publish_metadata, mc1.publish_metadata)
        self.assertEqual((meta0.generation, engine1.generation), (1001, 1001))

    def test_a_rank_nobody_registered_is_refused(self):
        mc0, mc1, engine0, engine1 = pair(self)
        engine1.pid = 0  # both processes claim rank 0; rank 1 is missing
        mc1.timeout_s = 0.5
        error0, error1 = both(mc0.publish_metadata, mc1.publish_metadata)
        self.assertIsInstance(error0, MetadataError)
        self.assertIn("no process publishes ranks [1]", str(error0))
        self.assertIsInstance(error1, TimeoutError)  # bounded: no merged metadata came

    def test_publication_failing_in_one_process_aborts_everywhere(self):
        mc0, mc1, engine0, engine1 = pair(self)
        both(mc0.publish_metadata, mc1.publish_metadata)
        params, _ = both(lambda: mc0.publish_request("ok", [1, 2]),
                         lambda: mc1.publish_request("ok", [1, 2]))
        self.assertEqual([tuple(a) for a in params.addresses], [mc0.address])
        engine1.refuse = True
        error0, error1 = both(lambda: mc0.publish_request("bad", [3]),
                              lambda: mc1.publish_request("bad", [3]))
        self.assertIsInstance(error1, ValueError)
        self.assertIsInstance(error0, RuntimeError)
        self.assertIn("process 1 could not publish 'bad': ValueError: no such blocks",
                      str(error0))
        self.assertEqual(engine0.aborted, ["bad"])
        mc1.poll()
        self.assertEqual(engine1.aborted, ["bad"])
        # a later publication of the same id is not confused with the failed one
        engine1.refuse = False
        params, _ = both(lambda: mc0.publish_request("bad", [3]),
                         lambda: mc1.publish_request("bad", [3]))
        self.assertEqual(params.request_id, "bad")

    def test_a_process_that_does_not_publish_times_out(self):
        mc0, mc1, engine0, engine1 = pair(self)
        both(mc0.publish_metadata, mc1.publish_metadata)
        mc0.timeout_s = 0.2
        with self.assertRaisesRegex(TimeoutError, "publication of 'lonely' by process 1"):
            mc0.publish_request("lonely", [1])
        self.assertEqual(engine0.aborted, ["lonely"])


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
