"""Layer-wise publishing from inside a jitted step (`publish_layer_in_jit`).

The producer's jitted prefill computes the layers one after the other (a slow, exactly
reproducible write per layer) and announces each as soon as it is written; the next layer's
input is threaded through the announcement. Checked: in the compiled program (TP 1 and TP 2)
the callbacks form a chain by data and XLA adds no copy of the cache (the old per-layer
`publish_in_jit` made it copy the cache arrays); over real NIXL, the consumer's first layer
arrives before the producer's step ends, the layers are announced in order, and the bytes
are those of the write, bit for bit. With host staging (the producer's NIXL reads a host
mirror) the same holds: each announcement's callback takes its layer's rows (the compiled
program gathers the request's rows of one layer per callback and copies no cache array) and
writes them into the mirror before announcing. Failures between layers (`LayeredFailureTest`,
direct and staged): unannounced layers are never read, a producer killed or a request aborted
between layers fails the read with every block invalid and only announced layers landed.
Negative control, run by hand: with the staged rows disabled (the engine's `_layer_rows_span`
returning None) the staged first-layer and killed-producer tests fail.
"""

from __future__ import annotations

import os

os.environ.setdefault("UCX_TLS", "tcp,sm,self")

import re  # noqa: E402
import time  # noqa: E402
import types  # noqa: E402
from unittest import mock  # noqa: E402

from support import bits, layerwise, meshes, platforms, processes  # noqa: E402

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


class _StagedNoEngine:
    """Stands in for a host-staged engine when only compiling: its one cache holds every
    layer, so each announcement's callback takes its layer's rows."""

    def __init__(self, num_layers: int):
        self.num_layers = num_layers

    def _layer_rows_span(self, written):
        return 0, self.num_layers, ""


def compiled(layout: str, tp: int, naive: bool, staged: bool = False
             ) -> tuple[str, PagedKVCache]:
    spec = KVCacheSpec(**spec_kwargs(layout))
    mesh = meshes.tp(tp)
    cache = PagedKVCache.allocate(spec, NUM_BLOCKS, mesh=mesh)
    engine = _StagedNoEngine(spec.num_layers) if staged else _NoEngine()
    step = tt.make_layered_prefill_step(engine, 10, naive=naive)
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


def callback_operand_shapes(text: str) -> list[list[str]]:
    """Per host-callback custom call (in any computation), the shapes of its operands (a
    CPU zero-copy callback's leading flag, "is this the first device", left out)."""
    out = []
    for line in text.splitlines():
        if "python_cpu_callback" in line and "operand_layout_constraints={" in line:
            operands = line.split("operand_layout_constraints={", 1)[1].split("}, ", )
            shapes = re.findall(r"\w+\[[\d,]*\]", ",".join(
                o for o in operands if not o.startswith(("custom_call", "api_version"))))
            if "xla_buffer_python_cpu_callback" in line and shapes[:1] == ["pred[]"]:
                shapes = shapes[1:]
            out.append(shapes)
    return out


def copies_anywhere(text: str, cache: PagedKVCache) -> list[str]:
    """Copy instructions of any computation (loop bodies too) whose shape is a (per-device)
    cache array's."""
    shapes = {",".join(map(str, a.sharding.shard_shape(a.shape))) for a in cache.arrays}
    found = re.findall(r"%([\w.\-]+) = \w+\[([\d,]*)\]\{[^}]*\} copy(?:-start)?\(", text)
    return [name for name, shape in found if shape in shapes]


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

    @parameterized.parameters(("LKHTD", 1), ("LKHTD", 2), ("KHTD", 2), ("HTD", 1), ("HTD", 2))
    def test_staged_chain_carries_layer_rows_without_copies(self, layout, tp):
        # Host staging: each announcement's callback takes its layer's rows of the request
        # (to write them into the host mirror from inside the step): still no copy of a
        # cache array, still a chain, and no operand is a cache array (only 4 blocks' rows
        # of one layer, gathered to the callback's device).
        text, cache = compiled(layout, tp, naive=False, staged=True)
        self.assert_rows_chain(text, cache)

    @parameterized.parameters(("LKHTD", 1), ("KHTD", 1), ("HTD", 1), ("KHTD", 2))
    def test_jax_transport_chain_carries_layer_rows_without_copies(self, layout, tp):
        # A real producer engine over the JAX transport: its announcements carry their
        # layer's rows too (its worker formats and offers them while the step runs), with
        # the same compiled shape. Control: the same step of a NIXL engine that reads the
        # cache directly carries no rows (handle, ids, stop and the token only). A cache
        # over several XLA:CPU devices carries none either: the transport gathers the
        # announced layers from the step's memory and formats them on a device outside the
        # mesh (no pull of the mesh's buffers completes before the step ends); without such
        # a device it warns and formats them after the step.
        from jaxkv import EngineConfig
        from jaxkv.transfer import jax_transfer_available
        from jaxkv.transfer._engine import KVTransferEngine
        from jaxkv.transfer._jax_transport import JaxTransport

        if not jax_transfer_available():
            self.skipTest("this jax has no jax.experimental.transfer")
        spec = KVCacheSpec(**spec_kwargs(layout))
        cache = PagedKVCache.allocate(spec, NUM_BLOCKS, mesh=meshes.tp(tp))
        args = (cache, np.asarray(REMOTE_IDS, np.int32), np.int32(1), np.uint32(SEED))
        with KVTransferEngine("prefill", EngineConfig(spec, tp), transport="jax") as engine:
            engine.register_cache(cache)
            text = tt.make_layered_prefill_step(engine, 10).lower(*args).compile().as_text()
            if tp > 1:
                with mock.patch.object(JaxTransport, "format_device", return_value=None), \
                        self.assertLogs("jaxkv.transfer._jit", "WARNING") as logs:
                    alone = tt.make_layered_prefill_step(engine, 10).lower(
                        *args).compile().as_text()
                self.assertIn("no other XLA:CPU device", logs.output[0])
                self.assertEqual(cache_copies(alone, cache), [])
                self.assertEqual([len(s) for s in callback_operand_shapes(alone)],
                                 [4] * spec.num_layers)
        if tp == 1:
            self.assert_rows_chain(text, cache)
        else:
            self.assertEqual(cache_copies(text, cache), [])
            self.assertEqual([len(s) for s in callback_operand_shapes(text)],
                             [4] * spec.num_layers)
        if nixl_available():
            with KVTransferEngine("prefill", EngineConfig(spec, tp)) as engine:
                engine.register_cache(cache)
                text = tt.make_layered_prefill_step(engine, 10).lower(*args).compile().as_text()
            self.assertEqual([len(s) for s in callback_operand_shapes(text)],
                             [4] * spec.num_layers)

    def assert_rows_chain(self, text, cache):
        """No copy of a cache array, the callbacks a chain by data, each carrying only its
        layer's rows of the request (4 blocks, gathered to the callback's device)."""
        self.assertEqual(cache_copies(text, cache), [])
        earlier = callback_ancestry(text)
        self.assertEqual(sorted(earlier.values()), list(range(cache.spec.num_layers)))
        spec = cache.spec
        per_layer = [list(a.shape[1:]) for a in cache.arrays]
        if "L" in spec.layout:  # the rows of one layer: the L axis is 1 long
            axis = spec.layout.index("L")
            per_layer = [s[:axis] + [1] + s[axis + 1:] for s in per_layer]
        arrays_per_layer = len(cache.arrays) // (1 if "L" in spec.layout else spec.num_layers)
        row = f"u32[{','.join(map(str, [len(REMOTE_IDS), *per_layer[0]]))}]"
        sites = callback_operand_shapes(text)
        self.assertLen(sites, spec.num_layers)
        whole = {f"f32[{','.join(map(str, a.shape))}]" for a in cache.arrays}
        for shapes in sites:  # handle, ids, stop, start, then the layer's rows
            self.assertEqual(shapes[4:], [row] * arrays_per_layer, shapes)
            self.assertFalse(set(shapes) & whole)

    @parameterized.parameters(("LKHTD", 1), ("LKHTD", 2), ("LKTHD", 2))
    def test_staged_layer_loop_carries_rows_without_copies(self, layout, tp):
        # A loop over the layers (fori_loop: the layer index, so the stop, traced), cache
        # with an L axis: the callback in the loop body takes one layer's rows (one gather by
        # the traced index), and nothing anywhere copies a cache array.
        spec = KVCacheSpec(**spec_kwargs(layout))
        cache = PagedKVCache.allocate(spec, NUM_BLOCKS, mesh=meshes.tp(tp))
        step = layerwise.make_loop_step(_StagedNoEngine(spec.num_layers), 10)
        ids = np.asarray(REMOTE_IDS, np.int32)
        text = step.lower(cache, ids, np.int32(1), np.uint32(SEED)).compile().as_text()
        self.assertEqual(copies_anywhere(text, cache), [])
        (shapes,) = callback_operand_shapes(text)  # one site: the loop body's
        axis = spec.layout.index("L")
        block = list(cache.arrays[0].shape[1:])
        block[axis] = 1
        self.assertEqual(shapes[4:], [f"u32[{','.join(map(str, [len(ids), *block]))}]"])
        # (a loop body runs whole before the next iteration, so its callback precedes the
        # next layer's writes anyway.) The detector's negative control: it finds the copies
        # of the unrolled per-layer publish_in_jit step.
        self.assertNotEqual(copies_anywhere(compiled(layout, tp, naive=True)[0], cache), [])

    def test_staged_fallbacks_warn(self):
        from jaxkv.transfer import publish_layer_in_jit

        ids = np.asarray(REMOTE_IDS, np.int32)
        spec = KVCacheSpec(**spec_kwargs("KHTD"))  # an array per layer
        cache = PagedKVCache.allocate(spec, NUM_BLOCKS)
        engine = _StagedNoEngine(spec.num_layers)

        def step(c, stop):
            return publish_layer_in_jit(engine, 1, ids, c, stop, stop)[1]

        with self.assertLogs("jaxkv.transfer._jit", "WARNING") as logs:
            text = jax.jit(step).lower(cache, np.int32(1)).compile().as_text()
        self.assertIn("a traced layer_stop and a layout with an array per layer",
                      logs.output[0])
        self.assertEqual([len(s) for s in callback_operand_shapes(text)], [4])  # the token
        with self.assertRaisesRegex(ValueError, r"layers \[4, 5\) are not layers"):
            jax.jit(lambda c: publish_layer_in_jit(engine, 1, ids, c, 5, 0)[1]).lower(cache)
        with self.assertRaisesRegex(ValueError, "layer_start needs a Python int"):
            jax.jit(lambda c, s: publish_layer_in_jit(engine, 1, ids, c, s, 0, layer_start=0)[1]
                    ).lower(cache, np.int32(1))
        staged_elsewhere = types.SimpleNamespace(
            _layer_rows_span=lambda written: (0, spec.num_layers, "several caches"))
        with self.assertLogs("jaxkv.transfer._jit", "WARNING") as logs:
            jax.jit(lambda c: publish_layer_in_jit(staged_elsewhere, 1, ids, c, 1, 0)[1]
                    ).lower(cache)
        self.assertIn("several caches, so the layers reach the host mirror (host staging) or the "
                      "JAX transport only after",
                      logs.output[0])

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


def engine_kwargs(mode: str) -> dict:
    """The engines' arguments of a path: NIXL reading the cache ("direct"; "formatted": the
    producer gathers each layer's share into its send pool), NIXL reading a host mirror
    ("staged"), the JAX transport ("jax")."""
    return {"direct": {}, "formatted": {}, "staged": {"host_staging": True},
            "jax": {"transport": "jax"}}[mode]


def consumer_kwargs(mode: str) -> dict:
    """The consumer's: registered directly on NIXL (landed bytes are in its cache at once;
    "formatted": every read formatted, however small); over the JAX transport one layer per
    group (the test's layers are a few KiB)."""
    if mode == "formatted":
        return {"formatted_reads": "always"}
    return ({"transport": "jax", "jax_transport_options": {"layer_group_bytes": 1}}
            if mode == "jax" else {})


def path_available(mode: str) -> bool:
    from jaxkv.transfer import jax_transfer_available

    return jax_transfer_available() if mode == "jax" else nixl_available()


class _Paths(tt.TransferTestBase):
    def warm_up(self, conn, engine, held=0):
        """Two requests through a producer process and `engine` first, read as the test
        reads (the last ``len(LOCAL_IDS) - held`` blocks): the JAX transport compiles each
        geometry's formatting program on both sides at its first use (as a server's warm-up
        does); a producer over several CPU devices formats a step's layers on another
        device only once a step updated its cache in place (the second)."""
        for round_ in range(2):
            request = f"req-warm-up-{round_}"
            params, handle = self.call(conn, "pin", request, REMOTE_IDS)
            engine.start_read(params, LOCAL_IDS[held:])
            # other values than the test's request: its read must overwrite every byte
            conn.send(("prefill", handle, np.asarray(REMOTE_IDS, np.int32), SEED + 1))
            self.assertEqual(self.wait(engine, [request]), ([request], []))
            if not conn.poll(WAIT_S):
                raise TimeoutError("the producer's step did not return")
            conn.recv()
            deadline = time.monotonic() + WAIT_S
            while (state := self.call(conn, "state"))[1][-1:] != [request]:
                self.assertLess(time.monotonic(), deadline, f"{request} was never freed")
            self.assertEqual(state[0], 0)  # nothing pinned


@pytest.mark.skipif(not nixl_available(), reason="NIXL (nixl-cu13) is not installed")
class LayeredTransferTest(_Paths):
    def start_layered_producer(self, layout, tp, iters, engine_kwargs=None):
        process, parent = processes.spawn(
            tt.layered_producer_main, spec_kwargs(layout), tp, NUM_BLOCKS, iters, engine_kwargs)
        self._children.append((process, parent))
        return parent

    @parameterized.parameters(
        # (layout, producer TP, iterations, path): staged, each layer's rows go to its
        # announcement's callback, which writes them into the host mirror; jax, to the JAX
        # transport, whose worker formats and offers them while the step runs
        ("LKHTD", 1, 4 * ITERS, "direct"), ("KHTD", 2, ITERS, "direct"),
        ("LKHTD", 1, 4 * ITERS, "staged"), ("KHTD", 2, ITERS, "staged"),
        ("HTD", 2, ITERS, "staged"), ("LKHTD", 1, 4 * ITERS, "jax"),
        ("KHTD", 1, 4 * ITERS, "jax"), ("HTD", 2, ITERS, "jax"),
        # the consumer holds the request's first 2 blocks (a prefix-cache hit) and reads
        # the rest: over the JAX transport the groups are formatted from the tail of the
        # rows the step's announcements carried (one device), or of the blocks gathered
        # from the step's memory (two CPU devices: the step takes no rows)
        ("KHTD", 2, ITERS, "jax", 2), ("LKHTD", 1, 4 * ITERS, "jax", 2),
        ("KHTD", 2, ITERS, "direct", 2), ("KHTD", 2, ITERS, "staged", 2),
        # formatted: the producer gathers each announced layer's share from the registered
        # cache the step writes in place, as direct reads READ it, before the step ends
        ("LKHTD", 1, 4 * ITERS, "formatted"), ("KHTD", 2, ITERS, "formatted"),
        ("HTD", 2, ITERS, "formatted", 2))
    def test_first_layer_arrives_before_the_step_ends(self, layout, p_tp, iters, mode,
                                                      held=0):
        if not path_available(mode):
            self.skipTest(f"{mode} is not available")
        conn = self.start_layered_producer(layout, p_tp, iters, engine_kwargs(mode))
        self.ready(conn)
        spec = KVCacheSpec(**spec_kwargs(layout))
        engine, _, _ = self.consumer(spec, 1, **consumer_kwargs(mode))
        if mode == "jax":
            self.warm_up(conn, engine, held)
        held_before = [bits.bits(np.asarray(a)) for a in
                       engine.caches[0].gather_blocks(np.asarray(LOCAL_IDS[:held], np.int32))]
        params, p_handle = self.call(conn, "pin", "req-layers", REMOTE_IDS)
        engine.start_read(params, LOCAL_IDS[held:])
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
        publication = self.call(conn, "publications")[-1]
        self.assertEqual(publication.request_id, "req-layers")
        stops = [stop for stop, _ in publication.layers]
        times = [t for _, t in publication.layers]
        self.assertEqual(stops, list(range(1, spec.num_layers + 1)))  # one by one, in order
        self.assertEqual(times, sorted(times))
        arrival = dict(engine.stats.records[-1].layer_arrival)
        self.assertEqual(sorted(arrival), list(range(spec.num_layers)))
        if mode in ("direct", "formatted"):
            self.assertEqual(engine.stats.records[-1].path, mode)
        # read while the producer was computing (JAX transport, a producer over two CPU
        # devices: its groups gathered from the step's memory and formatted on a third)
        self.assertLess(arrival[0], step_end)
        self.assertEqual(progress, sorted(progress))
        for layer in range(spec.num_layers):  # never before it was announced
            self.assertGreaterEqual(arrival[layer], times[layer])
        got = engine.caches[0].gather_blocks(np.asarray(LOCAL_IDS, np.int32))
        want = tt.expected_layer_values(spec, engine.caches[0].array_keys,
                                        [a.shape for a in engine.caches[0].arrays],
                                        len(LOCAL_IDS), SEED, iters)
        for index, (g, w, before) in enumerate(zip(got, want, held_before)):
            g = bits.bits(np.asarray(g))
            np.testing.assert_array_equal(g[held:], w[held:], err_msg=f"array {index}")
            np.testing.assert_array_equal(g[:held], before,
                                          err_msg=f"array {index}: a held block was written")
        # A callback that runs after every consumer confirmed and the producer freed the
        # request (e.g. a redundant last announcement): accepted quietly, no error logged.
        deadline = time.monotonic() + WAIT_S
        while "req-layers" not in self.call(conn, "state")[1]:
            self.assertLess(time.monotonic(), deadline, "the producer never freed the request")
        self.assertEqual(
            self.call(conn, "late", p_handle, REMOTE_IDS, spec.num_layers), (1, [])
        )
        print(f"{layout} tp={p_tp} {mode}: step "
              f"{1e3 * (step_end - step_start):.0f} ms, layer 0 arrived "
              f"{1e3 * (step_end - arrival[0]):.0f} ms before its end")


    @parameterized.parameters(("LKHTD", 1, "staged"), ("LKTHD", 2, "staged"),
                              ("LKHTD", 1, "direct"), ("LKHTD", 1, "jax"))
    def test_layer_loop_arrives_before_the_step_ends(self, layout, p_tp, mode):
        # The layers as a fori_loop (a traced layer index): staged (and over the JAX
        # transport), each iteration's callback takes its layer's rows too.
        if not path_available(mode):
            self.skipTest(f"{mode} is not available")
        process, conn = processes.spawn(
            layerwise.loop_producer_main, spec_kwargs(layout), p_tp, NUM_BLOCKS, ITERS,
            engine_kwargs(mode))
        self._children.append((process, conn))
        self.ready(conn)
        spec = KVCacheSpec(**spec_kwargs(layout))
        engine, _, _ = self.consumer(spec, 1, **consumer_kwargs(mode))
        if mode == "jax":
            self.warm_up(conn, engine)
        params, p_handle = self.call(conn, "pin", "req-loop", REMOTE_IDS)
        engine.start_read(params, LOCAL_IDS)
        conn.send(("prefill", p_handle, np.asarray(REMOTE_IDS, np.int32), SEED))
        finished, failed = self.wait(engine, ["req-loop"])
        self.assertEqual((finished, failed), (["req-loop"], []))
        if not conn.poll(WAIT_S):
            raise TimeoutError("the producer's step did not return")
        statuses, _, step_end = conn.recv()
        self.assertEqual(statuses, [1] * spec.num_layers)
        publication = self.call(conn, "publications")[-1]
        self.assertEqual([stop for stop, _ in publication.layers],
                         list(range(1, spec.num_layers + 1)))
        arrival = dict(engine.stats.records[-1].layer_arrival)
        self.assertLess(arrival[0], step_end)
        got = engine.caches[0].gather_blocks(np.asarray(LOCAL_IDS, np.int32))
        want = tt.expected_layer_values(spec, engine.caches[0].array_keys,
                                        [a.shape for a in engine.caches[0].arrays],
                                        len(LOCAL_IDS), SEED, ITERS)
        for index, (g, w) in enumerate(zip(got, want)):
            np.testing.assert_array_equal(bits.bits(np.asarray(g)), w, err_msg=f"array {index}")


@pytest.mark.skipif(not nixl_available(), reason="NIXL (nixl-cu13) is not installed")
class LayeredFailureTest(_Paths):
    """Layers announced from inside the step when the rest never comes: a step that
    announces only some layers, a producer killed between two layers, a request aborted
    between two layers; directly registered and host-staged producers. The consumer
    (registered directly, so landed bytes are in its cache at once) must never report more
    layers than were announced, every layer it reports is bit exact, the unannounced ones
    untouched, and a read that cannot finish fails with its blocks invalid."""

    NUM_LAYERS = 4

    def spec_kwargs(self):
        return dict(spec_kwargs("LKHTD"), num_layers=self.NUM_LAYERS)

    def start(self, mode, **kwargs):
        # "jax_tp2": the JAX transport from a producer over two CPU devices, which gathers
        # the announced layers from the step's memory (once a step updated its cache in
        # place: "warm") and formats them on a third device
        tp, mode = (2, "jax") if mode == "jax_tp2" else (1, mode)
        if not path_available(mode):
            self.skipTest(f"{mode} is not available")
        process, conn = processes.spawn(
            layerwise.gated_producer_main, self.spec_kwargs(), tp, NUM_BLOCKS, ITERS // 4,
            engine_kwargs(mode), *[kwargs.get(k) for k in ("announce",)],
            kwargs.get("group", 1), kwargs.get("gate_after"))
        self._children.append((process, conn))
        self.ready(conn)
        if tp > 1:
            self.call(conn, "warm")
        params, handle = self.call(conn, "pin", "req", REMOTE_IDS)
        spec = KVCacheSpec(**self.spec_kwargs())
        engine, _, _ = self.consumer(spec, 1, read_timeout_s=4.0, **consumer_kwargs(mode))
        engine.start_read(params, LOCAL_IDS)
        return process, conn, handle, engine, spec

    def poll_until(self, engine, seen, predicate, what, timeout=WAIT_S):
        deadline = time.monotonic() + timeout
        while not predicate(seen):
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out waiting for {what}: {seen}")
            result = engine.poll()
            seen["finished"] += result.finished
            seen["failed"] += result.failed
            seen["progress"] = max(seen["progress"], result.layers.get("req", 0))
        return seen

    def check_layers(self, engine, spec, landed, announced=None):
        """Layers < `landed` of the local blocks hold the step's bytes, layers >= `announced`
        (default: `landed`) zeros; those in between (announced, their landing not reported
        before the request failed) hold each element as the step wrote it or still zero."""
        announced = landed if announced is None else announced
        cache = engine.caches[0]
        got = bits.bits(np.asarray(cache.arrays[0]))[LOCAL_IDS]
        (want,) = tt.expected_layer_values(spec, cache.array_keys, [cache.arrays[0].shape],
                                           len(LOCAL_IDS), SEED, ITERS // 4)
        axis = spec.layout.index("L") + 1
        for layer in range(spec.num_layers):
            g, w = np.take(got, layer, axis=axis), np.take(want, layer, axis=axis)
            if layer < landed:
                np.testing.assert_array_equal(g, w, err_msg=f"layer {layer}")
            elif layer < announced:
                self.assertTrue(((g == w) | (g == 0)).all(), f"layer {layer}: foreign bytes")
            else:
                self.assertFalse(g.any(), f"layer {layer} was never announced, yet written")
        return got

    @staticmethod
    def fresh():
        return {"finished": [], "failed": [], "progress": 0}  # progress: most layers landed

    @parameterized.parameters("direct", "formatted", "staged", "jax", "jax_tp2")
    def test_unannounced_layers_are_never_read(self, mode):
        # The step announces layers 0-1 (two per announcement: layer_start=0) and writes all
        # four; 2-3 are announced only later, outside jit.
        _, conn, handle, engine, spec = self.start(mode, announce=2, group=2)
        conn.send(("prefill", handle, np.asarray(REMOTE_IDS, np.int32), SEED))
        seen = self.poll_until(engine, self.fresh(), lambda s: s["progress"] >= 2,
                               "layers 0-1")
        if not conn.poll(WAIT_S):
            raise TimeoutError("the producer's step did not return")
        statuses, _, _ = conn.recv()
        self.assertEqual(statuses, [1])  # one announcement: layers [0, 2)
        end = time.monotonic() + 1.0  # the step is over: nothing else may arrive
        self.poll_until(engine, seen, lambda s: time.monotonic() > end, "a second")
        self.assertEqual((seen["progress"], seen["finished"], seen["failed"]), (2, [], []))
        self.check_layers(engine, spec, 2)
        self.call(conn, "publish", "req", spec.num_layers)  # outside jit: the rest
        self.poll_until(engine, seen, lambda s: s["finished"] or s["failed"], "the request")
        self.assertEqual((seen["finished"], seen["failed"]), (["req"], []))
        self.check_layers(engine, spec, spec.num_layers)
        (publication,) = self.call(conn, "publications")
        self.assertEqual([stop for stop, _ in publication.layers], [2, spec.num_layers])

    @parameterized.parameters("direct", "formatted", "staged", "jax", "jax_tp2")
    def test_producer_killed_between_layers(self, mode):
        # The step holds after announcing layers 0-1; the producer dies there.
        process, conn, handle, engine, spec = self.start(mode, gate_after=1)
        conn.send(("prefill", handle, np.asarray(REMOTE_IDS, np.int32), SEED))
        seen = self.poll_until(engine, self.fresh(), lambda s: s["progress"] >= 2,
                               "layers 0-1")
        process.kill()
        process.join(timeout=WAIT_S)
        self.poll_until(engine, seen, lambda s: s["finished"] or s["failed"], "the failure")
        self.assertEqual(seen["finished"], [])
        (failed,) = seen["failed"]
        self.assertEqual(failed.invalid_block_ids, tuple(sorted(LOCAL_IDS)))
        self.assertEqual(seen["progress"], 2)  # never a layer that was not announced
        self.check_layers(engine, spec, 2)
        self.assertEqual(engine.num_reading, 0)

    @parameterized.parameters("direct", "formatted", "staged", "jax", "jax_tp2")
    def test_abort_between_layers(self, mode):
        # The producer aborts the request while the step holds after layers 0-1: the later
        # announcements are refused (status 0), nothing more is announced or read.
        _, conn, handle, engine, spec = self.start(mode, gate_after=1)
        conn.send(("prefill_abort", "req", handle, np.asarray(REMOTE_IDS, np.int32), SEED, 2))
        seen = self.poll_until(engine, self.fresh(), lambda s: s["finished"] or s["failed"],
                               "the failure")
        if not conn.poll(WAIT_S):
            raise TimeoutError("the producer's step did not return")
        statuses, _, _ = conn.recv()
        self.assertEqual(statuses, [1, 1, 0, 0])
        self.assertEqual(seen["finished"], [])
        (failed,) = seen["failed"]
        self.assertEqual(failed.invalid_block_ids, tuple(sorted(LOCAL_IDS)))
        self.assertLessEqual(seen["progress"], 2)
        # Layers 0-1 were announced: a read of them may land while the abort travels (its
        # landing reported or not before the failure); nothing changes after the failure.
        got = self.check_layers(engine, spec, seen["progress"], announced=2)
        end = time.monotonic() + 0.5
        self.poll_until(engine, seen, lambda s: time.monotonic() > end, "half a second")
        np.testing.assert_array_equal(
            self.check_layers(engine, spec, seen["progress"], announced=2), got)
        self.assertIsNone(self.call(conn, "published", "req"))
        self.assert_freed(conn, "req")
        self.assertEqual(self.call(conn, "publications"), [])  # never complete


if __name__ == "__main__":
    absltest.main()
