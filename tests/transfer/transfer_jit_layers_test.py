"""Layer-wise publishing from inside a jitted step (`publish_layer_in_jit`).

The producer's jitted prefill computes the layers one after the other (a slow, exactly
reproducible write per layer) and announces each as soon as it is written; the next layer's
input is threaded through the announcement. Checked: in the compiled program (TP 1 and TP 2)
the callbacks form a chain by data and XLA adds no copy of the cache (the old per-layer
`publish_in_jit` made it copy the cache arrays); over real NIXL, the consumer's first layer
arrives before the producer's step ends, the layers are announced in order, and the bytes
are those of the write, bit for bit.
"""

from __future__ import annotations

import os

os.environ.setdefault("UCX_TLS", "tcp,sm,self")

import re  # noqa: E402
import time  # noqa: E402
import types  # noqa: E402

from support import bits, meshes, platforms, processes  # noqa: E402

platforms.force_cpu_devices()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from absl.testing import absltest, parameterized  # noqa: E402
from support import transfer as tt  # noqa: E402

from jaxkv import KVCacheSpec, PagedKVCache  # noqa: E402
from jaxkv.transfer import nixl_available  # noqa: E402

NUM_BLOCKS, WAIT_S = tt.NUM_BLOCKS, tt.WAIT_S
REMOTE_IDS, LOCAL_IDS = [3, 4, 5, 9], [7, 8, 12, 13]
ITERS = 600_000  # per layer part: the slow write (~100 ms per layer at TP 2 here)
SEED = 1000


def spec_kwargs(layout: str) -> dict:
    return dict(num_layers=4, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32",
                layout=layout)


class _NoEngine:
    """Stands in for an engine when only compiling (the callbacks never run)."""


def compiled(layout: str, tp: int, naive: bool) -> tuple[str, PagedKVCache]:
    spec = KVCacheSpec(**spec_kwargs(layout))
    mesh = meshes.tp(tp)
    cache = PagedKVCache.allocate(spec, NUM_BLOCKS, mesh=mesh)
    step = tt.make_layered_prefill_step(_NoEngine(), 10, naive=naive)
    ids = np.asarray(REMOTE_IDS, np.int32)
    text = step.lower(cache, ids, np.int32(1), np.uint32(SEED)).compile().as_text()
    return text, cache


def entry_instructions(text: str) -> dict[str, tuple[str, set[str]]]:
    """ENTRY instructions of a compiled HLO module: name -> (text, operand names)."""
    out = {}
    for line in text[text.index("\nENTRY"):].splitlines()[1:]:
        match = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = (.*)", line)
        if match:
            name, rest = match.groups()
            head = rest.split(", metadata=")[0].split(", calls=")[0]
            out[name] = (rest, set(re.findall(r"%([\w.\-]+)", head)) - {name})
    return out


def callback_computations(text: str) -> set[str]:
    """Computations that call a host callback (under SPMD a callback runs in a conditional
    branch, on one device)."""
    out, current = set(), None
    for line in text.splitlines():
        if line[:1] not in ("", " ", "}"):  # a computation's header (ENTRY's too)
            header = re.match(r"^%([\w.\-]+) ", line)
            current = header.group(1) if header else None
        elif "python_cpu_callback" in line and current is not None:
            out.add(current)
    return out


def callback_ancestry(text: str) -> dict[str, int]:
    """Per host-callback site of ENTRY, how many other callback sites it depends on (by data,
    transitively)."""
    instructions = entry_instructions(text)
    hosts = callback_computations(text)
    callbacks = [n for n, (rest, _) in instructions.items()
                 if "python_cpu_callback" in rest or set(re.findall(r"%([\w.\-]+)", rest)) & hosts]
    ancestors: dict[str, set[str]] = {}

    def visit(name):
        if name not in ancestors:
            ancestors[name] = set()
            for operand in instructions.get(name, ("", ()))[1]:
                ancestors[name] |= {operand} | visit(operand)
        return ancestors[name]

    return {name: len(set(callbacks) & visit(name)) for name in callbacks}


def cache_copies(text: str, cache: PagedKVCache) -> list[str]:
    """Copy instructions whose shape is a (per-device) cache array's."""
    shapes = {",".join(map(str, a.sharding.shard_shape(a.shape))) for a in cache.arrays}
    out = []
    for name, (rest, _) in entry_instructions(text).items():
        match = re.match(r"\w+\[([\d,]*)\]\{[^}]*\} copy(?:-start)?\(", rest)
        if match and match.group(1) in shapes:
            out.append(name)
    return out


class LayeredLoweringTest(parameterized.TestCase):
    @parameterized.parameters(("LKHTD", 1), ("LKHTD", 2), ("KHTD", 2), ("HTD", 1), ("HTD", 2))
    def test_chain_of_callbacks_without_copies(self, layout, tp):
        text, cache = compiled(layout, tp, naive=False)
        self.assertEqual(cache_copies(text, cache), [])
        earlier = callback_ancestry(text)
        self.assertLen(earlier, cache.spec.num_layers)
        # Each callback depends (through the next layer's writes) on every earlier one: a
        # total order by data, so they run in layer order, each before the next layer.
        self.assertEqual(sorted(earlier.values()), list(range(cache.spec.num_layers)))

    @parameterized.parameters(("LKHTD", 1), ("KHTD", 2))
    def test_per_layer_publish_callbacks_copy_the_cache(self, layout, tp):
        # Why publish_layer_in_jit exists: with nothing threaded through the announcements,
        # XLA keeps each token's read apart from the later in-place writes by copying.
        text, cache = compiled(layout, tp, naive=True)
        self.assertNotEqual(cache_copies(text, cache), [])
        self.assertEqual(sorted(callback_ancestry(text).values()), [0] * cache.spec.num_layers)

    def test_publish_in_jit_refuses_a_partial_layer_stop(self):
        # ... so publish_in_jit, the whole-request call, refuses to be used per layer.
        from jaxkv.transfer import publish_in_jit

        engine = _NoEngine()
        engine.config = types.SimpleNamespace(spec=KVCacheSpec(**spec_kwargs("LKHTD")))
        cache = PagedKVCache.allocate(engine.config.spec, NUM_BLOCKS)
        ids = np.asarray(REMOTE_IDS, np.int32)
        for stop in (1, 3, np.int32(2)):
            with self.assertRaisesRegex(ValueError, "publish_layer_in_jit"):
                jax.jit(lambda c, stop=stop: publish_in_jit(engine, 1, ids, c, stop)).lower(cache)
        with self.assertRaisesRegex(ValueError, "publish_layer_in_jit"):  # a traced stop
            jax.jit(lambda c, s: publish_in_jit(engine, 1, ids, c, s)).lower(cache, np.int32(4))
        for stop in (-1, 4):  # the whole request: fine
            jax.jit(lambda c, stop=stop: publish_in_jit(engine, 1, ids, c, stop)).lower(cache)


@pytest.mark.skipif(not nixl_available(), reason="NIXL (nixl-cu13) is not installed")
class LayeredTransferTest(tt.TransferTestBase):
    def start_layered_producer(self, layout, tp, iters, engine_kwargs=None):
        process, parent = processes.spawn(
            tt.layered_producer_main, spec_kwargs(layout), tp, NUM_BLOCKS, iters, engine_kwargs)
        self._children.append((process, parent))
        return parent

    @parameterized.parameters(
        # (layout, producer TP, iterations, producer host staging): staged, each layer's rows
        # go to its announcement's callback, which writes them into the host mirror
        ("LKHTD", 1, 4 * ITERS, False), ("KHTD", 2, ITERS, False),
        ("LKHTD", 1, 4 * ITERS, True), ("KHTD", 2, ITERS, True), ("HTD", 2, ITERS, True))
    def test_first_layer_arrives_before_the_step_ends(self, layout, p_tp, iters, staging):
        conn = self.start_layered_producer(layout, p_tp, iters, {"host_staging": staging})
        self.ready(conn)
        params, p_handle = self.call(conn, "pin", "req-layers", REMOTE_IDS)
        spec = KVCacheSpec(**spec_kwargs(layout))
        engine, _, _ = self.consumer(spec, 1)
        engine.start_read(params, LOCAL_IDS)
        conn.send(("prefill", p_handle, np.asarray(REMOTE_IDS, np.int32), SEED))
        finished, failed, progress = [], [], []
        deadline = time.monotonic() + WAIT_S
        while "req-layers" not in finished and not failed and time.monotonic() < deadline:
            result = engine.poll()
            finished += result.finished
            failed += result.failed
            if "req-layers" in result.layers:
                progress.append(result.layers["req-layers"])
        self.assertEqual((finished, [f.reason for f in failed]), (["req-layers"], []))
        if not conn.poll(WAIT_S):
            raise TimeoutError("the producer's step did not return")
        statuses, step_start, step_end = conn.recv()
        self.assertEqual(statuses, [1] * spec.num_layers)  # every announcement accepted
        (publication,) = self.call(conn, "publications")
        stops = [stop for stop, _ in publication.layers]
        times = [t for _, t in publication.layers]
        self.assertEqual(stops, list(range(1, spec.num_layers + 1)))  # one by one, in order
        self.assertEqual(times, sorted(times))
        arrival = dict(engine.stats.records[-1].layer_arrival)
        self.assertEqual(sorted(arrival), list(range(spec.num_layers)))
        self.assertLess(arrival[0], step_end)  # read while the producer was still computing
        self.assertEqual(progress, sorted(progress))
        for layer in range(spec.num_layers):  # never before it was announced
            self.assertGreaterEqual(arrival[layer], times[layer])
        got = engine.caches[0].gather_blocks(np.asarray(LOCAL_IDS, np.int32))
        want = tt.expected_layer_values(spec, engine.caches[0].array_keys,
                                        [a.shape for a in engine.caches[0].arrays],
                                        len(LOCAL_IDS), SEED, iters)
        for index, (g, w) in enumerate(zip(got, want)):
            np.testing.assert_array_equal(bits.bits(np.asarray(g)), w,
                                          err_msg=f"array {index}")
        # A callback that runs after every consumer confirmed and the producer freed the
        # request (e.g. a redundant last announcement): accepted quietly, no error logged.
        deadline = time.monotonic() + WAIT_S
        while "req-layers" not in self.call(conn, "state")[1]:
            self.assertLess(time.monotonic(), deadline, "the producer never freed the request")
        self.assertEqual(
            self.call(conn, "late", p_handle, REMOTE_IDS, spec.num_layers), (1, [])
        )
        print(f"{layout} tp={p_tp} staging={staging}: step "
              f"{1e3 * (step_end - step_start):.0f} ms, layer 0 arrived "
              f"{1e3 * (step_end - arrival[0]):.0f} ms before its end")


if __name__ == "__main__":
    absltest.main()
