"""A seeded randomized lifecycle campaign over real transfer engines (issue 35, part 1); shared
by `tests/transfer_campaign_test.py` (a short seed budget) and `benchmarks/campaign.py` (the
long mode). Not a test module.

A producer process (`producer_main`: a real `KVTransferEngine`, TP 2 over two CPU devices, a
`KVCacheManager` allocating its blocks and freeing them when `poll` reports them freeable, as
a serving loop does) and a consumer engine in this process (TP 1, its own `KVCacheManager`
allocating destination blocks) run a random schedule of lifecycles drawn from a seed
(`Campaign.run`; the events: `EVENTS`, one ``event_<name>`` method each). Every block a
producer request holds is written, before it is published, with values known from the
request's number alone (`block_values`), so every finished read is checked bit for bit.
Invariants (`Campaign.violations` lists every breach):

- every read ends `finished` with bit-exact blocks or `failed` with exactly its local blocks
  reported invalid; it never finishes with wrong bytes, is never reported twice, never hangs
  (each has a deadline), and reads that nothing disturbed finish;
- both managers hold exactly the blocks the schedule still owns (`num_free_blocks` + owned ==
  usable blocks, checked after every lifecycle on the consumer and on every state query on
  the producer), the producer never frees a request twice or one it does not hold, a full
  pool always drains again, and after quiescence the producer pins nothing and both pools are
  whole (0 stranded);
- the producer's and consumer's RSS, threads and file descriptors are sampled; their slopes
  after warm-up are reported (`Campaign.report`) and bounded generously by the callers;
- with integrity digests (``digests="full"``), a "corrupt" event flips one byte of a
  request's first block in the producer's registered memory after publication: its read must
  fail naming the digest with exactly the local block that received it invalid (never finish).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from support import meshes, processes

SPEC_KWARGS: dict[str, Any] = dict(
    num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32", layout="LKHTD"
)
PRODUCER_TP = 2
CONSUMER_TP = 1
PRODUCER_BLOCKS = 33  # 32 usable (block 0 is the manager's null block)
CONSUMER_BLOCKS = 49
MAX_REQUEST_BLOCKS = 5
LONG_LEASE_S = 30.0
SHORT_LEASE_S = 0.4
CALL_TIMEOUT_S = 60.0
START_TIMEOUT_S = 180.0

# Events of one lifecycle and their weights. "kill" is further capped by `max_kills`.
EVENTS = {
    "read": 6,
    "double_read": 2,
    "consumer_abort_before": 1,
    "consumer_abort_during": 1,
    "consumer_abort_after": 1,
    "producer_abort_before": 1,
    "producer_abort_during": 1,
    "lease_expiry": 1,
    "pool_pressure": 1,
    "kill": 1,
    "stop": 1,
    "corrupt": 1,  # only with digests="full" (else drawn as "read")
}
STOP_READ_TIMEOUT_S = 1.0  # the read's deadline in a "stop" event; the producer stops longer
STOP_S = 1.5
KILL_READ_TIMEOUT_S = 2.0  # the deadline of the read a "kill" event interrupts


def block_values(number: int, num_blocks: int, block_shape: tuple[int, ...]) -> np.ndarray:
    """The uint32 bits producer request `number` holds in its blocks: ``[num_blocks,
    *block_shape]``, distinct per request, block and element; finite float32 values (bit 30
    clear: no inf/NaN; bit 23 set: no denormals)."""
    size = int(np.prod(block_shape))
    x = np.arange(num_blocks * size, dtype=np.uint64) + np.uint64(number) * np.uint64(1 << 24)
    x = (x * np.uint64(0x9E3779B1) + np.uint64(0x7F4A7C15)) & np.uint64(0xFFFFFFFF)
    x ^= x >> np.uint64(15)
    x = (x * np.uint64(0x85EBCA77)) & np.uint64(0xFFFFFFFF)
    x ^= x >> np.uint64(13)
    x = (x & np.uint64(0xBFFFFFFF)) | np.uint64(0x00800000)
    return x.astype(np.uint32).reshape(num_blocks, *block_shape)


def array_values(number: int, num_blocks: int, index: int, block_shape) -> np.ndarray:
    """`block_values` of cache array `index` (each array gets its own values)."""
    return block_values(number * 8 + index, num_blocks, tuple(block_shape))


def process_resources() -> tuple[float, int, int]:
    """(RSS MiB, threads, open file descriptors) of this process, from /proc."""
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / (1 << 20)
    return rss, len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd"))


def request_tokens(number: int, num_blocks: int, block_size: int) -> list[int]:
    """A prompt unique to request `number` (no prefix hits between requests)."""
    return [number * 64 + i for i in range(num_blocks * block_size)]


# -- the producer process --------------------------------------------------------------------


def producer_main(conn, transport: str, engine_kwargs: dict) -> None:
    """A producer engine process serving commands from `conn` while it polls its engine and
    frees, in its `KVCacheManager`, every request the engine reports freeable:
    ("publish", number, num_blocks, lease_s, expected_reads[, corrupt]) -> TransferParams, or
    None when the pool is full (the values of `array_values` written into the request's
    blocks first; `corrupt`: then one byte of its first block flipped in the registered
    memory, after publication);
    ("abort", request_id) -> True; ("abort_stall", request_id, seconds) -> True, then that
    long without polling; ("state",) -> dict (pinned, free blocks, owned blocks,
    freed ids, violations, resources); ("exit",)."""

    processes.child_env(PRODUCER_TP)

    from jaxkv import EngineConfig, KVCacheSpec, PagedKVCache
    from jaxkv.blocks import KVCacheManager
    from jaxkv.transfer._engine import KVTransferEngine  # the core: tests reach into it

    spec = KVCacheSpec(**SPEC_KWARGS)
    config = EngineConfig(spec, PRODUCER_TP)
    mesh = meshes.tp(PRODUCER_TP)
    manager = KVCacheManager(PRODUCER_BLOCKS, spec.block_size, enable_caching=True)
    owned: dict[str, int] = {}
    freed: list[str] = []
    violations: list[str] = []
    with KVTransferEngine("prefill", config, transport=transport, **engine_kwargs) as engine:
        engine.register_cache(PagedKVCache.allocate(spec, PRODUCER_BLOCKS, mesh=mesh))
        conn.send(("ready", engine.address))
        while True:
            if conn.poll(0.0005):
                command = conn.recv()
                kind = command[0]
                if kind == "exit":
                    break
                if kind == "publish":
                    _, number, count, lease, reads, *corrupt = command
                    rid = f"p{number}"
                    manager.add_request(rid, request_tokens(number, count, spec.block_size))
                    alloc = manager.allocate_slots(rid, count * spec.block_size,
                                                   manager.get_computed_blocks(rid))
                    if alloc is None:
                        manager.free(rid)
                        conn.send(None)
                        continue
                    ids = list(alloc.new_block_ids[0])
                    cache = engine.caches[0]
                    dense = [
                        array_values(number, count, index, a.shape[1:]).view(a.dtype)
                        for index, a in enumerate(cache.arrays)
                    ]
                    cache = cache.scatter_blocks(dense, np.asarray(ids, np.int32))
                    engine.update_cache(cache)
                    owned[rid] = len(ids)
                    params = engine.publish_request(rid, ids, lease, expected_reads=reads)
                    if corrupt and corrupt[0]:
                        _flip_after_publication(engine, ids[0])
                    conn.send(params)
                elif kind == "abort":
                    engine.abort_request(command[1])
                    conn.send(True)
                elif kind == "abort_stall":  # abort, then no poll for a while: what arrives
                    engine.abort_request(command[1])  # meanwhile meets the next poll
                    conn.send(True)  # with the request aborted but not yet released
                    time.sleep(command[2])
                elif kind == "state":
                    conn.send(dict(
                        pinned=engine.num_pinned, free=manager.num_free_blocks,
                        owned=sum(owned.values()), usable=PRODUCER_BLOCKS - 1,
                        freed=list(freed), violations=list(violations),
                        resources=process_resources(),
                        transport_errors=list(getattr(engine.transport, "errors", ())),
                    ))
                    freed.clear()
            for rid in engine.poll().freeable:
                if owned.pop(rid, None) is None:
                    violations.append(f"producer: {rid} reported freeable but not held")
                    continue
                manager.free(rid)
                freed.append(rid)


def _flip_after_publication(engine, block_id: int) -> None:
    """Inverts one byte of block `block_id` of cache array 0 on the first device, in the
    memory peers read (the host mirror with host staging, else the cache's own buffer)."""
    import ctypes

    entry = engine._registry.caches[0]  # noqa: SLF001 - the campaign corrupts registered memory
    buffer = next(b for b in entry.cache.shard_buffers() if b.array_index == 0)
    address = (entry.mirror.address(0, buffer.device.id) if entry.mirror is not None
               else buffer.address)
    block_len = buffer.nbytes // entry.cache.num_blocks
    byte = ctypes.c_uint8.from_address(address + block_id * block_len + 11)
    byte.value ^= 0xFF


class Producer:
    """A `producer_main` process (spawned) and its pipe."""

    def __init__(self, transport: str, engine_kwargs: dict):
        self.process, self.conn = processes.spawn(producer_main, transport, engine_kwargs)
        if not self.conn.poll(START_TIMEOUT_S):
            self.kill()
            raise TimeoutError("the producer did not start")
        self.address = self.conn.recv()[1]

    def call(self, *command, timeout_s: float = CALL_TIMEOUT_S):
        """Sends `command`, returns the answer (TimeoutError after `timeout_s`)."""
        self.conn.send(command)
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"the producer did not answer {command[0]!r}")
        return self.conn.recv()

    def signal(self, number: int) -> None:
        """Sends a signal (SIGSTOP, SIGCONT) to the process."""
        pid = self.process.pid
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, number)

    def kill(self) -> None:
        """SIGKILL, reaped."""
        pid = self.process.pid
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.process.join(10)
        self.conn.close()

    def close(self) -> None:
        """Asks it to exit; kills it if it does not."""
        if self.process.is_alive():
            with contextlib.suppress(OSError):
                self.conn.send(("exit",))
            self.process.join(20)
        if self.process.is_alive():
            self.kill()
        else:
            self.conn.close()


# -- the campaign (consumer side, in this process) -------------------------------------------


@dataclass
class Read:
    """One consumer read in flight."""

    read_id: str
    number: int  # the producer request's number
    local_ids: list[int]
    expect: str  # "finish", "fail", "either" or "corrupt" (a digest catches its first block)
    deadline: float
    incarnation: int
    abort_after: bool = False
    started: float = field(default_factory=time.monotonic)


@dataclass
class Counters:
    """What a campaign saw."""

    lifecycles: int = 0
    events: dict[str, int] = field(default_factory=dict)
    finished: int = 0
    failed: dict[str, int] = field(default_factory=dict)  # by cause
    pool_full: int = 0
    kills: int = 0
    stops: int = 0
    event_s: dict[str, float] = field(default_factory=dict)  # wall seconds per event kind
    published: int = 0
    corruptions_caught: int = 0  # corrupted reads failed by their digests


def _cause(reason: str) -> str:
    """A short cause for a failure reason (the counters' key)."""
    lowered = reason.lower()
    if "was freed before this read" in lowered:
        return "freed_before_read"
    for key in ("aborted", "released", "expired", "timed out", "timeout", "refused",
                "connection", "handshake", "unreachable", "closed", "dead", "lost"):
        if key in lowered:
            return key.replace(" ", "_")
    return reason.split(":")[0][:40]


def _slope(samples: list[tuple[int, float]]) -> float | None:
    """Least-squares slope (per 1,000 lifecycles) of ``(lifecycle, value)`` samples after the
    first quarter (warm-up); None with fewer than 3."""
    samples = samples[len(samples) // 4:]
    if len(samples) < 3:
        return None
    x = np.array([s[0] for s in samples], float)
    y = np.array([s[1] for s in samples], float)
    if np.ptp(x) == 0:
        return None
    return float(np.polyfit(x, y, 1)[0] * 1000)


class Campaign:
    """Drives one transport's producer (restarted after each kill) and a consumer engine
    through seeded random lifecycles (`run`), recording violations of the invariants."""

    def __init__(self, transport: str, *, read_timeout_s: float = 5.0, window: int = 3,
                 max_kills: int = 1, max_stops: int = 1, sample_every: int = 10,
                 producer_kwargs: dict | None = None, digests: str = "off"):

        from jaxkv import EngineConfig, KVCacheSpec, PagedKVCache
        from jaxkv.blocks import KVCacheManager
        from jaxkv.transfer._engine import KVTransferEngine  # the core: tests reach into it

        self.transport = transport
        self.read_timeout_s = read_timeout_s
        self.window = window
        self.max_kills = max_kills
        self.max_stops = max_stops
        self.sample_every = sample_every
        self.spec = KVCacheSpec(**SPEC_KWARGS)
        self.engine_kwargs = dict(read_timeout_s=read_timeout_s)
        self.digests = digests
        self.engine = KVTransferEngine("decode", EngineConfig(self.spec, CONSUMER_TP),
                                       transport=transport, read_timeout_s=read_timeout_s,
                                       digests=digests)
        mesh = meshes.tp(CONSUMER_TP)
        self.engine.register_cache(PagedKVCache.allocate(self.spec, CONSUMER_BLOCKS, mesh=mesh))
        self.manager = KVCacheManager(CONSUMER_BLOCKS, self.spec.block_size,
                                      enable_caching=False)
        self.owned: dict[str, int] = {}  # consumer requests (read ids) -> blocks held
        self.producer_kwargs = dict(producer_kwargs or {}, digests=digests)
        self.producer = Producer(transport, self.producer_kwargs)
        self.incarnation = 0
        self.published: set[str] = set()  # this incarnation's requests not yet freed
        self.reads: dict[str, Read] = {}
        self.done: set[str] = set()  # read ids reported once (a second report is a breach)
        self.violations: list[str] = []
        self.read_s: list[float] = []  # how long each read took (start to outcome)
        self.counters = Counters()
        self.number = 0
        self.producer_samples: list[tuple[int, int, tuple]] = []
        self.consumer_samples: list[tuple[int, tuple]] = []
        self.started = time.monotonic()

    # -- plumbing --------------------------------------------------------------------------

    def violation(self, text: str) -> None:
        self.violations.append(text)
        if os.environ.get("JAXKV_CAMPAIGN_DEBUG"):
            print(f"VIOLATION: {text}", flush=True)

    def close(self) -> None:
        """Stops the producer and the consumer engine."""
        self.producer.close()
        self.engine.close()

    def publish(self, count: int, lease: float, reads: int = 1, *, retry_s: float = 20.0,
                corrupt: bool = False):
        """Publishes a new producer request of `count` blocks; pumps while the pool is full
        (a pool that never drains is a violation). Returns (number, params) or None."""
        deadline = time.monotonic() + retry_s
        while True:
            self.number += 1
            number = self.number
            params = self.producer.call("publish", number, count, lease, reads, corrupt)
            if params is not None:
                self.published.add(f"p{number}")
                self.counters.published += 1
                return number, params
            self.counters.pool_full += 1
            if time.monotonic() > deadline:
                self.violation(f"producer pool full for {retry_s} s: blocks stranded?")
                return None
            self.pump(len(self.reads))  # one pass: handles what ended
            self.producer_state()  # drains its freed list
            time.sleep(0.01)

    def allocate_local(self, read_id: str, count: int) -> list[int] | None:
        """Destination blocks for a read (None: the consumer pool is full)."""
        self.manager.add_request(read_id, list(range(count * self.spec.block_size)))
        alloc = self.manager.allocate_slots(read_id, count * self.spec.block_size)
        if alloc is None:
            self.manager.free(read_id)
            return None
        self.owned[read_id] = count
        return list(alloc.new_block_ids[0])

    def release_local(self, read_id: str) -> None:
        self.manager.free(read_id)
        del self.owned[read_id]

    def start_read(self, number: int, params, count: int, expect: str, *,
                   read_id: str | None = None, abort_after: bool = False,
                   timeout_s: float | None = None) -> Read | None:
        """Allocates destination blocks (pumping while the consumer pool is full) and starts a
        read of producer request `number`."""
        read_id = read_id or f"p{number}"
        deadline = time.monotonic() + 20.0
        local = self.allocate_local(read_id, count)
        while local is None:
            if time.monotonic() > deadline:
                self.violation("consumer pool full for 20 s: blocks stranded?")
                return None
            self.pump(0)
            local = self.allocate_local(read_id, count)
        timeout = self.read_timeout_s if timeout_s is None else timeout_s
        read = Read(read_id, number, local, expect, time.monotonic() + timeout + 15.0,
                    self.incarnation, abort_after)
        self.reads[read_id] = read
        self.engine.start_read(params, local, timeout_s, read_id=read_id)
        return read

    def check_bits(self, read: Read) -> bool:
        cache = self.engine.caches[0]
        ids = np.asarray(read.local_ids)
        for index, array in enumerate(cache.arrays):
            got = np.asarray(array)[ids].view(np.uint32)
            want = array_values(read.number, len(ids), index, array.shape[1:])
            if not np.array_equal(got, want):
                bad = int(np.sum(np.any((got != want).reshape(len(ids), -1), axis=1)))
                self.violation(f"{read.read_id}: finished with wrong bytes in array {index} "
                               f"({bad} of {len(ids)} blocks differ)")
                return False
        return True

    def pump(self, target: int, timeout_s: float = 120.0) -> None:
        """Polls the consumer engine, checking each outcome, until at most `target` reads
        are in flight (reads past their deadline are violations: hangs)."""
        end = time.monotonic() + timeout_s
        while True:
            result = self.engine.poll()
            for read_id in result.finished:
                self.outcome(read_id, None)
            for failure in result.failed:
                self.outcome(failure.request_id, failure)
            now = time.monotonic()
            for read in list(self.reads.values()):
                if now > read.deadline:
                    state = self.engine.consumer.reading.get(read.read_id)
                    self.violation(f"{read.read_id}: neither finished nor failed by its "
                                   f"deadline (hang); engine: "
                                   f"{self._describe(state)}")
                    if state is None:  # lost: forgotten, never reported
                        del self.reads[read.read_id]
                        self.done.add(read.read_id)
                        self.release_local(read.read_id)
                    else:
                        self.engine.abort_request(read.read_id)
                        read.deadline = now + 10.0
            if len(self.reads) <= target or now > end:
                if len(self.reads) > target:
                    self.violation(f"pump: {len(self.reads)} reads still in flight")
                return
            time.sleep(0.0005)

    @staticmethod
    def _describe(state) -> str:
        if state is None:
            return "not reading it"
        fields = ("state", "error", "done_at", "acks", "expected_acks", "deadline", "handles")
        return ", ".join(f"{f}={getattr(state, f, '?')!r}" for f in fields)

    def outcome(self, read_id: str, failure) -> None:
        read = self.reads.pop(read_id, None)
        if read is None:
            self.violation(f"{read_id}: reported {'failed' if failure else 'finished'} "
                           f"{'again' if read_id in self.done else 'but never started'}")
            return
        self.done.add(read_id)
        took = time.monotonic() - read.started
        self.read_s.append(took)
        if os.environ.get("JAXKV_CAMPAIGN_DEBUG") and took > 1.0:
            print(f"slow read {read_id} ({read.expect}): {took:.2f} s, "
                  f"{failure.reason if failure else 'finished'}", flush=True)
        if failure is None:
            self.counters.finished += 1
            if read.expect == "fail":
                self.violation(f"{read_id}: finished, but its producer request was aborted "
                               "before the read")
            if read.expect == "corrupt":
                self.violation(f"{read_id}: finished although its producer block was "
                               "corrupted after publication (digests missed it)")
                self.release_local(read_id)
                return
            self.check_bits(read)
            if read.abort_after:  # an abort after the end: a no-op, nothing reported later
                self.engine.abort_request(read_id)
        else:
            cause = _cause(failure.reason)
            self.counters.failed[cause] = self.counters.failed.get(cause, 0) + 1
            if read.expect == "finish":
                self.violation(f"{read_id}: failed although nothing disturbed it: "
                               f"{failure.reason}")
            if read.expect == "corrupt":
                if "digest" not in failure.reason.lower():
                    self.violation(f"{read_id}: corrupted, failed for another reason: "
                                   f"{failure.reason}")
                elif list(failure.invalid_block_ids) != [read.local_ids[0]]:
                    self.violation(f"{read_id}: corrupted first block, invalid blocks "
                                   f"{sorted(failure.invalid_block_ids)}, expected "
                                   f"[{read.local_ids[0]}]")
                else:
                    self.counters.corruptions_caught += 1
            elif sorted(failure.invalid_block_ids) != sorted(read.local_ids):
                self.violation(f"{read_id}: failed with invalid blocks "
                               f"{sorted(failure.invalid_block_ids)}, read into "
                               f"{sorted(read.local_ids)}")
        self.release_local(read_id)

    def check_consumer_pool(self) -> None:
        owned = sum(self.owned.values())
        if self.manager.num_free_blocks + owned != CONSUMER_BLOCKS - 1:
            self.violation(f"consumer pool: {self.manager.num_free_blocks} free + {owned} "
                           f"owned != {CONSUMER_BLOCKS - 1}")

    def producer_state(self) -> dict:
        state = self.producer.call("state")
        for rid in state["freed"]:
            self.published.discard(rid)
        if os.environ.get("JAXKV_CAMPAIGN_DEBUG") and state["transport_errors"]:
            print(f"producer transport errors: {state['transport_errors'][-3:]}", flush=True)
        for text in state["violations"]:
            if text not in self.violations:
                self.violation(text)
        if state["free"] + state["owned"] != state["usable"]:
            self.violation(f"producer pool: {state['free']} free + {state['owned']} owned != "
                           f"{state['usable']}")
        return state

    def restart_producer(self) -> None:
        """SIGKILLs the producer and starts a new one; its reads may now fail."""
        self.producer.kill()
        self.counters.kills += 1
        for read in self.reads.values():
            if read.incarnation == self.incarnation and read.expect == "finish":
                read.expect = "either"
        self.published.clear()
        self.incarnation += 1
        self.producer = Producer(self.transport, self.producer_kwargs)

    # -- the schedule ----------------------------------------------------------------------

    def run(self, seed: int, lifecycles: int, *, kill_until: float = 0.5,
            progress_every: int = 0, max_wall_s: float | None = None) -> None:
        """`lifecycles` random lifecycles from `seed` (the first ones every event once, in a
        seeded order; kills only in the first `kill_until` fraction, so that the last
        producer runs long enough to measure), then quiescence and the final checks.
        `max_wall_s`: stops drawing lifecycles after that long (`counters.lifecycles` says
        how many ran)."""
        stop_at = None if max_wall_s is None else time.monotonic() + max_wall_s
        rng = np.random.default_rng(seed)
        names = list(EVENTS)
        weights = np.array([EVENTS[n] for n in names], float)
        odds = weights / weights.sum()
        kills = stops = 0
        first = [str(n) for n in rng.permutation(names)]  # every event at least once
        for i in range(lifecycles):
            if stop_at is not None and time.monotonic() > stop_at:
                break
            name = first[i] if i < len(first) else str(rng.choice(names, p=odds))
            if name == "kill" and (kills >= self.max_kills or i >= kill_until * lifecycles):
                name = "read"
            if name == "stop" and stops >= self.max_stops:
                name = "read"
            if name == "corrupt" and self.digests != "full":
                name = "read"
            kills += name == "kill"
            stops += name == "stop"
            self.counters.events[name] = self.counters.events.get(name, 0) + 1
            self.counters.lifecycles += 1
            if os.environ.get("JAXKV_CAMPAIGN_DEBUG"):
                print(f"lifecycle {i}: {name}; in flight {sorted(self.reads)}", flush=True)
            began = time.monotonic()
            getattr(self, f"event_{name}")(rng)
            self.pump(int(rng.integers(0, self.window + 1)))
            spent = self.counters.event_s
            spent[name] = spent.get(name, 0.0) + time.monotonic() - began
            self.check_consumer_pool()
            if progress_every and (i + 1) % progress_every == 0:
                print(f"campaign {self.transport} seed {seed}: {i + 1}/{lifecycles} "
                      f"lifecycles, {len(self.violations)} violations, "
                      f"{time.monotonic() - self.started:.0f} s", file=sys.stderr, flush=True)
            if self.counters.lifecycles % self.sample_every == 0:
                state = self.producer_state()
                self.producer_samples.append(
                    (self.counters.lifecycles, self.incarnation, state["resources"]))
                self.consumer_samples.append((self.counters.lifecycles, process_resources()))
        self.quiesce()

    def quiesce(self, timeout_s: float = 60.0) -> None:
        """Waits for every read and every producer pin to end; checks both pools whole."""
        self.pump(0)
        for read_id in list(self.owned):
            self.violation(f"{read_id}: consumer blocks still owned after its read ended")
            self.release_local(read_id)
        deadline = time.monotonic() + timeout_s
        while True:
            state = self.producer_state()
            self.pump(len(self.reads))
            if (state["pinned"] == 0 and not self.published) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        if state["pinned"] or self.published:
            self.violation(f"after quiescence the producer pins {state['pinned']} requests; "
                           f"never freed: {sorted(self.published)[:10]}")
        if state["free"] != state["usable"]:
            self.violation(f"after quiescence the producer pool has {state['free']} of "
                           f"{state['usable']} blocks free (stranded)")
        if self.manager.num_free_blocks != CONSUMER_BLOCKS - 1:
            self.violation(f"after quiescence the consumer pool has "
                           f"{self.manager.num_free_blocks} of {CONSUMER_BLOCKS - 1} free")
        if self.engine.num_reading:
            self.violation(f"after quiescence the consumer reads {self.engine.num_reading}")

    def _count(self, rng) -> int:
        return int(rng.integers(1, MAX_REQUEST_BLOCKS + 1))

    def event_read(self, rng) -> None:
        count = self._count(rng)
        got = self.publish(count, LONG_LEASE_S)
        if got:
            self.start_read(got[0], got[1], count, "finish")

    def event_corrupt(self, rng) -> None:
        # one byte of the request's first block flipped in the producer's registered memory
        # after publication: only the digest can tell
        count = self._count(rng)
        got = self.publish(count, LONG_LEASE_S, corrupt=True)
        if got:
            self.start_read(got[0], got[1], count, "corrupt")

    def event_double_read(self, rng) -> None:
        count = self._count(rng)
        got = self.publish(count, LONG_LEASE_S, reads=2)
        if got:
            for suffix in ("a", "b"):
                self.start_read(got[0], got[1], count, "finish", read_id=f"p{got[0]}/{suffix}")

    def event_consumer_abort_before(self, rng) -> None:
        # the consumer's request is aborted before it reads: the producer's lease frees it
        got = self.publish(self._count(rng), SHORT_LEASE_S)
        if got:
            self.engine.abort_request(f"p{got[0]}")  # nothing in flight: a no-op

    def event_consumer_abort_during(self, rng) -> None:
        count = self._count(rng)
        got = self.publish(count, LONG_LEASE_S)
        if got:
            read = self.start_read(got[0], got[1], count, "either")
            if read and rng.random() < 0.5:
                self.pump(len(self.reads))  # sometimes after some progress
            if read:
                self.engine.abort_request(read.read_id)

    def event_consumer_abort_after(self, rng) -> None:
        count = self._count(rng)
        got = self.publish(count, LONG_LEASE_S)
        if got:
            self.start_read(got[0], got[1], count, "finish", abort_after=True)

    def event_producer_abort_before(self, rng) -> None:
        count = self._count(rng)
        got = self.publish(count, LONG_LEASE_S)
        if got:
            self.producer.call("abort", f"p{got[0]}")
            self.start_read(got[0], got[1], count, "fail")

    def event_producer_abort_during(self, rng) -> None:
        count = self._count(rng)
        got = self.publish(count, LONG_LEASE_S)
        if got:
            self.start_read(got[0], got[1], count, "either")
            if rng.random() < 0.5:
                self.pump(len(self.reads))
            self.producer.call("abort", f"p{got[0]}")
            # the freed blocks are reused at once: a read still landing would see new bytes
            self.event_read(rng)

    def event_lease_expiry(self, rng) -> None:
        self.publish(self._count(rng), SHORT_LEASE_S)

    def event_pool_pressure(self, rng) -> None:
        """Publishes until the producer's pool is full (evicting cached free blocks on the
        way), then reads them all."""
        published = []
        for _ in range(PRODUCER_BLOCKS):
            count = self._count(rng)
            self.number += 1
            params = self.producer.call("publish", self.number, count, LONG_LEASE_S, 1)
            if params is None:
                self.counters.pool_full += 1
                break
            self.published.add(f"p{self.number}")
            self.counters.published += 1
            published.append((self.number, params, count))
        for number, params, count in published:
            self.start_read(number, params, count, "finish")

    def event_kill(self, rng) -> None:
        count = self._count(rng)
        got = self.publish(count, LONG_LEASE_S)
        if got:
            self.start_read(got[0], got[1], count, "either", timeout_s=KILL_READ_TIMEOUT_S)
            if rng.random() < 0.5:
                self.pump(len(self.reads))
        self.restart_producer()

    def event_stop(self, rng) -> None:
        """SIGSTOPs the producer past the read's deadline while it is read, then SIGCONTs
        it: the read ends by its deadline (finished if it got through before the stop, else
        failed), and the producer, resumed, releases the request."""
        self.pump(0)  # no other read in flight: only this one may fail
        count = self._count(rng)
        got = self.publish(count, LONG_LEASE_S)
        if not got:
            return
        read = self.start_read(got[0], got[1], count, "either", timeout_s=STOP_READ_TIMEOUT_S)
        self.counters.stops += 1
        self.producer.signal(signal.SIGSTOP)
        try:
            end = time.monotonic() + STOP_S
            while time.monotonic() < end:
                self.pump(len(self.reads))
                time.sleep(0.005)
        finally:
            self.producer.signal(signal.SIGCONT)
        if read is not None and read.read_id in self.reads:
            self.violation(f"{read.read_id}: still in flight {STOP_S} s after its producer "
                           f"stopped (its deadline: {STOP_READ_TIMEOUT_S} s)")

    # -- the report ------------------------------------------------------------------------

    def report(self) -> dict:
        """Counters, violations and resource slopes (per 1,000 lifecycles, after warm-up;
        the producer's over its last incarnation)."""
        last = [s for s in self.producer_samples if s[1] == self.incarnation]
        slopes = {}
        for index, name in enumerate(("rss_mib", "threads", "fds")):
            slopes[f"producer_{name}"] = _slope([(s[0], s[2][index]) for s in last])
            slopes[f"consumer_{name}"] = _slope(
                [(s[0], s[1][index]) for s in self.consumer_samples])
        c = self.counters
        return dict(
            transport=self.transport, lifecycles=c.lifecycles, events=dict(c.events),
            event_s={k: round(v, 2) for k, v in c.event_s.items()},
            published=c.published, reads_finished=c.finished, reads_failed_by_cause=c.failed,
            digests=self.digests, corruptions_caught=c.corruptions_caught,
            pool_full=c.pool_full, producer_kills=c.kills, producer_stops=c.stops,
            invariant_violations=len(self.violations), violations=self.violations[:50],
            slopes_per_1000_lifecycles=slopes,
            producer_resources_last=last[-1][2] if last else None,
            consumer_resources_last=(self.consumer_samples[-1][1]
                                     if self.consumer_samples else None),
            wall_s=round(time.monotonic() - self.started, 2),
        )
