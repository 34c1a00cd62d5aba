"""Transfers triggered from inside jitted steps (two processes, real NIXL).

The producer process runs a jitted prefill step that writes a request's blocks (slowly: an
iterated LCG in a `fori_loop`) and publishes them through `publish_in_jit`; this process runs
a jitted decode step that waits for the request with `wait_in_jit` and gathers the received
blocks. The consumer subscribed before the step ran, so a publication that fired before the
write finished would have let it read zeros: the gathered bytes are compared bit for bit
with a numpy model of the write. The programs are checked too: in the lowered program the
callbacks' operands are only small int32 arrays; in the compiled one (after SPMD
partitioning, which drops optimization barriers) the publishing callback depends on the block
writes and the decode step's block reads depend on the waiting callback, by data.
"""

from __future__ import annotations

import os

os.environ.setdefault("UCX_TLS", "tcp,sm,self")

import functools  # noqa: E402
import re  # noqa: E402
import time  # noqa: E402

from support import bits, meshes, platforms, processes  # noqa: E402

platforms.force_cpu_devices()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from absl.testing import absltest, parameterized  # noqa: E402
from support import transfer as tt  # noqa: E402

from jaxkv import KVCacheSpec, PagedKVCache, ops  # noqa: E402
from jaxkv.transfer import nixl_available, wait_in_jit  # noqa: E402

NUM_BLOCKS, WAIT_S = tt.NUM_BLOCKS, tt.WAIT_S
REMOTE_IDS, LOCAL_IDS = [3, 4, 5, 9], [7, 8, 12, 13]
ITERS = 300_000  # the slow write: a few hundred ms of fori_loop on this machine
SPEC = dict(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32",
            layout="LKHTD")


class _NoEngine:
    """Stands in for an engine when only lowering (the callbacks never run)."""


def make_decode_step(engine, timeout_s=WAIT_S):
    @functools.partial(jax.jit, donate_argnums=0)
    def decode(cache, ids, handle):
        ids, status = wait_in_jit(engine, handle, ids, timeout_s=timeout_s)
        return cache, cache.gather_blocks(ids), status

    return decode


def callback_signatures(text: str) -> list[tuple[list[str], list[str]]]:
    """(operand SSA names, operand types) of every host-callback custom call."""
    out = []
    for line in text.splitlines():
        if "custom_call @" in line and "callback" in line:
            names = re.search(r"callback\(([^)]*)\)", line).group(1)
            types = re.search(r":\s*\(([^)]*)\)\s*->", line).group(1)
            out.append(([n.strip() for n in names.split(",") if n.strip()],
                        [t.strip() for t in types.split(", ")]))
    return out


def hlo_ancestors(text: str) -> tuple[dict[str, set[str]], dict[str, str]]:
    """The ENTRY computation of a compiled HLO module: per instruction, every instruction it
    depends on (transitively, through operands), and its text."""
    entry = text[text.index("\nENTRY"):].splitlines()[1:]
    operands, lines = {}, {}
    for line in entry:
        match = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = (.*)", line)
        if match:
            name, rest = match.groups()
            lines[name] = rest
            head = rest.split(", metadata=")[0].split(", calls=")[0]
            operands[name] = set(re.findall(r"%([\w.\-]+)", head)) - {name}
    closure: dict[str, set[str]] = {}

    def visit(name):
        if name not in closure:
            closure[name] = set()
            for o in operands.get(name, ()):
                closure[name] |= {o} | visit(o)
        return closure[name]

    for name in operands:
        visit(name)
    return closure, lines


def find(lines: dict[str, str], *needles: str) -> list[str]:
    return [n for n, rest in lines.items() if all(k in rest for k in needles)]


class LoweringTest(parameterized.TestCase):
    """No KV bytes in the callbacks; the publication depends on the written cache."""

    @parameterized.parameters(1, 2)
    def test_callback_operands_are_ids(self, tp):
        spec = KVCacheSpec(**SPEC)
        mesh = meshes.tp(tp)
        cache = PagedKVCache.allocate(spec, NUM_BLOCKS, mesh=mesh)
        ids = ops.pad_block_ids(REMOTE_IDS)
        cache_type = "tensor<" + "x".join(str(d) for d in cache.arrays[0].shape)
        prefill = tt.make_prefill_step(_NoEngine(), 10)
        decode = make_decode_step(_NoEngine())
        for step, args in ((prefill, (cache, ids, np.int32(1), 0)),
                           (decode, (cache, ids, np.int32(1)))):
            lowered = step.lower(*args)
            (signature,) = callback_signatures(lowered.as_text())
            _, types = signature
            self.assertLen(types, 4 if step is prefill else 1)
            for t in types:  # int32 scalars and the [8] id vector: never a KV array
                self.assertRegex(t, r"^tensor<(8x)?i32>$")
                self.assertNotIn(cache_type, t)
            closure, lines = hlo_ancestors(lowered.compile().as_text())
            callbacks = [n for n in find(lines, "custom_call_target=")
                         if re.search(r'custom_call_target="[^"]*callback', lines[n])]
            callbacks = callbacks or find(lines, "conditional(", "io_callback")
            self.assertLen(callbacks, 1, lines)
            if step is prefill:  # the publication waits for every block write
                writes = find(lines, 'custom_call_target="jaxkv_scatter_blocks"')
                self.assertTrue(writes)
                for write in writes:
                    self.assertIn(write, closure[callbacks[0]])
            else:  # every read of the received blocks waits for the callback
                reads = find(lines, 'custom_call_target="jaxkv_gather_blocks"')
                self.assertTrue(reads)
                for read in reads:
                    self.assertIn(callbacks[0], closure[read])


@pytest.mark.skipif(not nixl_available(), reason="NIXL (nixl-cu13) is not installed")
class TransferJitTest(tt.TransferTestBase):
    def start_jit_producer(self, tp, engine_kwargs=None):
        process, parent = processes.spawn(
            tt.jit_producer_main, SPEC, tp, NUM_BLOCKS, ITERS, engine_kwargs)
        self._children.append((process, parent))
        return parent

    @parameterized.parameters((1, 1), (2, 2))
    def test_jitted_prefill_publishes_jitted_decode_consumes(self, p_tp, d_tp):
        conn = self.start_jit_producer(p_tp)
        self.ready(conn)
        params, p_handle = self.call(conn, "pin", "req-jit", REMOTE_IDS)
        self.assertTrue(params.layerwise)  # readable only once the step published it
        spec = KVCacheSpec(**SPEC)
        engine, cache, _ = self.consumer(spec, d_tp)
        buffers = cache.shard_buffers()
        engine.start_read(params, LOCAL_IDS)
        for _ in range(50):  # subscribed, nothing published: nothing can arrive
            result = engine.poll()
            self.assertEqual((result.finished, result.failed), ([], []))
        conn.send(("prefill", p_handle, ops.pad_block_ids(REMOTE_IDS), 100))  # not awaited
        decode = make_decode_step(engine)
        handle = engine.handle("req-jit")
        cache, blocks, status = decode(engine.caches[0], ops.pad_block_ids(LOCAL_IDS),
                                       np.int32(handle))
        self.assertEqual(int(status), 1)
        cache.verify_unmoved(buffers)  # donated through the barrier: still registered
        engine.update_cache(cache)
        for index, got in enumerate(blocks):
            want = tt.slow_values_numpy((len(REMOTE_IDS), *got.shape[1:]), 100 + index, ITERS)
            np.testing.assert_array_equal(bits.bits(np.asarray(got))[: len(LOCAL_IDS)],
                                          want, err_msg=f"array {index}")
        self.assertFalse(np.asarray(blocks[0])[len(LOCAL_IDS):].view(np.uint32).any())
        if not conn.poll(WAIT_S):
            raise TimeoutError("the producer's step did not return")
        self.assertEqual(conn.recv(), 1)  # the callback published
        finished, failed = [], []
        deadline = time.monotonic() + WAIT_S
        while "req-jit" not in finished and time.monotonic() < deadline:
            result = engine.poll()  # what the callback found is reported here
            finished += result.finished
            failed += result.failed
        self.assertEqual((finished, failed), (["req-jit"], []))
        self.assert_freed(conn, "req-jit")

    @parameterized.parameters((True, False, 1, 1), (True, True, 1, 1), (False, True, 2, 2),
                              (True, True, 2, 1), (True, False, 1, 1, "prefill_polling"),
                              (True, False, 2, 1, "prefill_polling"))
    def test_jitted_steps_with_host_staging(self, p_staged, d_staged, p_tp, d_tp,
                                            step="prefill"):
        # Producer staged: the publishing callback only queues the publication (no JAX in a
        # callback); the producer loop's next poll() copies the written blocks (from the
        # cache handed to update_cache) to the host mirror and announces them. Consumer
        # staged: the in-jit wait answers -2 and poll() outside jit scatters the mirror to
        # the device cache. Either way the bytes are those of the slow write, bit for bit.
        # "prefill_polling": the producer polls while its step computes and once after it,
        # before update_cache: the publication must wait for the step's output (its input
        # was donated), never stage the consumed pre-step cache.
        conn = self.start_jit_producer(p_tp, dict(host_staging=p_staged))
        self.ready(conn)
        params, p_handle = self.call(conn, "pin", "req-jit", REMOTE_IDS)
        self.assertTrue(params.layerwise)
        spec = KVCacheSpec(**SPEC)
        engine, cache, _ = self.consumer(spec, d_tp, host_staging=d_staged)
        buffers = cache.shard_buffers()
        engine.start_read(params, LOCAL_IDS)
        for _ in range(50):  # subscribed, nothing published: nothing can arrive
            result = engine.poll()
            self.assertEqual((result.finished, result.failed), ([], []))
        conn.send((step, p_handle, ops.pad_block_ids(REMOTE_IDS), 100))  # not awaited
        decode = make_decode_step(engine)
        handle = engine.handle("req-jit")
        cache, blocks, status = decode(engine.caches[0], ops.pad_block_ids(LOCAL_IDS),
                                       np.int32(handle))
        cache.verify_unmoved(buffers)
        engine.update_cache(cache)
        finished, failed = [], []
        if d_staged:
            self.assertEqual(int(status), -2)  # the scatter to the device needs poll()
            self.assertFalse(np.asarray(blocks[0]).view(np.uint32).any())  # ids masked
            finished, failed = self.wait(engine, ["req-jit"])
            blocks = engine.caches[0].gather_blocks(ops.pad_block_ids(LOCAL_IDS))
        else:
            self.assertEqual(int(status), 1)
        for index, got in enumerate(blocks):
            want = tt.slow_values_numpy((len(REMOTE_IDS), *got.shape[1:]), 100 + index, ITERS)
            np.testing.assert_array_equal(bits.bits(np.asarray(got))[: len(LOCAL_IDS)],
                                          want, err_msg=f"array {index}")
        if not conn.poll(WAIT_S):
            raise TimeoutError("the producer's step did not return")
        self.assertEqual(conn.recv(), 1)  # the callback accepted the publication
        deadline = time.monotonic() + WAIT_S
        while "req-jit" not in finished and not failed and time.monotonic() < deadline:
            result = engine.poll()
            finished += result.finished
            failed += result.failed
        self.assertEqual((finished, failed), (["req-jit"], []))
        *_, staged = self.assert_freed(conn, "req-jit")
        self.assertLen(staged, 1)  # one publication (every layer at once), from poll()

    def test_wait_refuses_requests_that_need_jax(self):
        # a layout change needs post-processing (JAX): the wait says -2, poll finishes it
        spec_kwargs = dict(SPEC, layout="KHTD")
        _, conn = self.start_producer(spec_kwargs, 1)
        self.ready(conn)
        self.call(conn, "register", REMOTE_IDS + [10, 11])
        params = self.call(conn, "pin", "req-post", REMOTE_IDS + [10, 11], 30.0)
        engine, cache, config = self.consumer(KVCacheSpec(**dict(SPEC, layout="KTHD")), 1)
        engine.start_read(params, tt.LOCAL_IDS)
        decode = make_decode_step(engine, timeout_s=5.0)
        cache, _, status = decode(engine.caches[0], ops.pad_block_ids(tt.LOCAL_IDS),
                                  np.int32(engine.handle("req-post")))
        self.assertEqual(int(status), -2)
        engine.update_cache(cache)
        self.assertEqual(self.wait(engine, ["req-post"]), (["req-post"], []))
        g = tt.global_cache(KVCacheSpec(**spec_kwargs), 6 * 4, seed=tt.G_SEED)
        self.check_cache(engine.caches[0], config, g, tt.LOCAL_IDS)


if __name__ == "__main__":
    absltest.main()
