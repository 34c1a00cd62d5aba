"""The demo's core: paged attention through every cache layout, the model against a dense
(no cache) reference, TP-independence of the KV bits, and the colocated engine."""

import threading
import time

from support import bits, platforms

platforms.force_cpu_devices()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl.testing import absltest, parameterized  # noqa: E402

from jaxkv import KVCacheSpec  # noqa: E402
from jaxkv.demo import DemoSettings, run_colocated
from jaxkv.demo._attention import (
    attend,  # noqa: E402
    read_pages,
    write_tokens,
)
from jaxkv.demo._engines import RequestResult, make_prompts, wait_ready  # noqa: E402
from jaxkv.demo._model import (  # noqa: E402
    ModelConfig,
    ModelRunner,
    _linear,
    _norm,
    _per_head,
    _rope,
    _weights,
    init_params,
    make_mesh,
    quantize_params,
)

SMALL = ModelConfig(vocab_size=128, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2,
                    head_dim=16, ffn_dim=128, seed=3)


def dense_logits(config: ModelConfig, tokens: np.ndarray, max_len: int) -> np.ndarray:
    """Independent of the cache: the whole sequence at once, contiguous K/V in float32 (no
    paging, no scatter, no TP), the model's own layers; keys padded to `max_len` slots as
    the paged model's attention sees them."""
    p = {k: jnp.asarray(v) for k, v in quantize_params(init_params(config)).items()}
    n = len(tokens)
    pos = jnp.arange(n)
    x = p["embed"][tokens]
    for layer in range(config.num_layers):
        h = _norm(x, p["attn_norm"][layer])
        q = _rope(_per_head(h, *_weights(p, "wq", layer)), pos, config.rope_theta)  # [Hq, n, D]
        k = _rope(_per_head(h, *_weights(p, "wk", layer)), pos, config.rope_theta)
        v = _per_head(h, *_weights(p, "wv", layer))
        pad = ((0, 0), (0, max_len - n), (0, 0))
        o = attend(jnp.transpose(q, (1, 0, 2))[None], jnp.pad(k, pad)[None],
                   jnp.pad(v, pad)[None], pos[None])[0]
        x = x + _linear(o.reshape(n, -1), *_weights(p, "wo", layer))
        h = _norm(x, p["mlp_norm"][layer])
        up = _linear(h, *_weights(p, "w_up", layer))
        x = x + _linear(jax.nn.silu(_linear(h, *_weights(p, "w_gate", layer))) * up,
                        *_weights(p, "w_down", layer))
    return np.asarray(_linear(_norm(x, p["final_norm"]), *_weights(p, "unembed")))


class PagedKVTest(parameterized.TestCase):
    @parameterized.parameters("LKHTD", "LKTHD", "KHTD", "KTHD", "HTD", "THD")
    def test_write_then_read_pages_bits(self, layout):
        spec = KVCacheSpec(num_layers=2, num_kv_heads=3, head_dim=4, block_size=4,
                           dtype="bfloat16", layout=layout)
        # finite values: a jnp scatter into bfloat16 canonicalises NaN payloads (the model
        # only scatters into a dense copy; the cache itself is written by scatter_blocks)
        def finite(rng, shape):
            return rng.standard_normal(shape).astype(spec.dtype)

        arrays = [jnp.asarray(finite(np.random.default_rng(0), spec.array_shape(8)))
                  for _ in range(spec.num_arrays)]
        table = np.array([[5, 2, 7]])
        values = finite(np.random.default_rng(1), (10, 3, 4))  # tokens 0..9
        blocks = table[0, np.arange(10) // 4]
        arrays = write_tokens(arrays, spec, 1, 1, jnp.asarray(values), jnp.asarray(blocks),
                              jnp.asarray(np.arange(10) % 4))
        pages = np.asarray(read_pages(arrays, spec, 1, 1, jnp.asarray(table)))  # [1, H, 12, D]
        bits.assert_bits(pages[0, :, :10], values.transpose(1, 0, 2))
        # the other layer / K are untouched: compare with a read before any write
        fresh = [jnp.asarray(finite(np.random.default_rng(0), spec.array_shape(8)))
                 for _ in range(spec.num_arrays)]
        for layer, kv in ((0, 0), (0, 1), (1, 0)):
            np.testing.assert_array_equal(
                bits.bits(np.asarray(read_pages(arrays, spec, layer, kv, jnp.asarray(table)))),
                bits.bits(np.asarray(read_pages(fresh, spec, layer, kv, jnp.asarray(table)))),
            )

    def test_padding_tokens_are_dropped(self):
        spec = SMALL.kv_spec(4, "THD", "float32")
        runner = ModelRunner(SMALL, spec, make_mesh(jax.devices()[:1]), 8, 16)
        before = [bits.bits(np.asarray(a)).copy() for a in runner.cache.arrays]
        runner.run(np.zeros((2, 4), np.int32), np.full((2, 4), -1, np.int32), [[1, 2], [3]])
        for a, b in zip(runner.cache.arrays, before):
            np.testing.assert_array_equal(bits.bits(np.asarray(a)), b)


class ModelTest(parameterized.TestCase):
    @parameterized.parameters(("THD", 4, 1), ("LKHTD", 8, 2), ("KHTD", 16, 2))
    def test_paged_prefill_and_decode_match_dense(self, layout, block_size, tp):
        prompt = np.random.default_rng(1).integers(0, SMALL.vocab_size, 21)
        spec = SMALL.kv_spec(block_size, layout, "float32")
        runner = ModelRunner(SMALL, spec, make_mesh(jax.devices()[:tp]), 16, 32)
        table = list(range(3, 3 + 32 // block_size))
        # prefill 13 tokens, then 8 more one at a time (decode), in a batch of 2 slots
        _, logits = runner.run([prompt[:13]], [np.arange(13)], [table])
        got = [logits[0]]
        for t in range(13, 21):
            _, step = runner.run([[prompt[t]], [0]], [[t], [-1]], [table, []])
            got.append(step[0])
        want = dense_logits(SMALL, prompt, 32)
        # float32 cache, the same layers: equal up to XLA's rewrites of two different graphs
        np.testing.assert_allclose(np.concatenate(got), want, rtol=1e-5, atol=1e-5)

    def test_prompt_kv_bits_do_not_depend_on_tp_layout_or_chunking(self):
        # Every reduction of the model is exact (integer sums, maxima), so a token's KV bits
        # depend on neither the chunk it was computed in (its width, its padding, its other
        # rows) nor the TP size or layout. Float sums failed this on XLA:CPU: the chunkings
        # below gave a 1-ulp difference in a bfloat16 element (on AMD at widths < 64, on an
        # AVX-512 Intel CPU also at 64 and up).
        prompt = np.random.default_rng(2).integers(0, SMALL.vocab_size, 70)
        results = []
        for tp, layout, block_size, cuts, pad in (
            (1, "THD", 8, [], 0),
            (2, "LKHTD", 16, [16], 0),
            (2, "HTD", 8, [32], 5),
            (1, "KTHD", 16, [64], 0),
            (1, "THD", 8, [56], 0),
            (2, "KHTD", 8, [8, 16, 24, 32, 40, 48, 56, 64], 3),
            (1, "THD", 8, list(range(1, 70)), 0),  # one token per step, as decode does
        ):
            spec = SMALL.kv_spec(block_size, layout, "bfloat16")
            runner = ModelRunner(SMALL, spec, make_mesh(jax.devices()[:tp]), 16, 128)
            table = list(range(1, 1 + -(-70 // block_size)))
            bounds = [0, *cuts, 70]
            for a, b in zip(bounds, bounds[1:]):
                width = b - a + pad
                toks = np.zeros((1, width), np.int32)
                pos = np.full((1, width), -1, np.int32)
                toks[0, : b - a], pos[0, : b - a] = prompt[a:b], np.arange(a, b)
                runner.run(toks, pos, [table])
            results.append(bits.bits(runner.prompt_kv(table, 70)))
        for other in results[1:]:
            np.testing.assert_array_equal(other, results[0])

    def test_logits_do_not_depend_on_the_other_rows_of_the_batch(self):
        spec = SMALL.kv_spec(8, "THD", "float32")
        prompts = np.random.default_rng(4).integers(0, SMALL.vocab_size, (3, 24))
        logits = {}
        for batch in ([0], [0, 1, 2], [2, 0]):
            runner = ModelRunner(SMALL, spec, make_mesh(jax.devices()[:1]), 16, 32)
            tables = [[1 + 4 * row + i for i in range(3)] for row in batch]
            pos = np.tile(np.arange(24), (len(batch), 1))
            _, out = runner.run(prompts[batch], pos, tables)
            logits[tuple(batch)] = {row: bits.bits(out[i]) for i, row in enumerate(batch)}
        for batch, rows in logits.items():
            np.testing.assert_array_equal(rows[0], logits[(0,)][0], err_msg=str(batch))
        np.testing.assert_array_equal(logits[(2, 0)][2], logits[(0, 1, 2)][2])

    def test_tokens_depend_on_the_cache(self):
        # The comparison is only meaningful if wrong KV changes the greedy tokens.
        settings = DemoSettings(num_requests=1, prompt_len=24, max_new_tokens=6,
                                shared_prefix_len=0, num_layers=2, d_model=64, num_heads=4,
                                num_kv_heads=2, head_dim=16, vocab_size=128, decode_tp=1)
        model = settings.model()
        spec = model.kv_spec(8, "THD", "float32")
        prompt = np.asarray(make_prompts(settings)[0])
        outs = []
        for corrupt in (False, True):
            runner = ModelRunner(model, spec, make_mesh(jax.devices()[:1]), 16, settings.max_len)
            table = [1, 2, 3, 4]
            toks, _ = runner.run([np.pad(prompt, (0, 40))], [np.pad(np.arange(24), (0, 40),
                                 constant_values=-1)], [table])
            if corrupt:  # zero the first block's KV
                runner.cache = runner.cache.scatter_blocks(
                    [jnp.zeros((1, *a.shape[1:]), a.dtype) for a in runner.cache.arrays], [1])
            seq = [int(toks[0, 23])]
            for t in range(24, 29):
                nxt, _ = runner.run([[seq[-1]]], [[t]], [table])
                seq.append(int(nxt[0, 0]))
            outs.append(seq)
        self.assertNotEqual(outs[0][1:], outs[1][1:])


class ColocatedTest(absltest.TestCase):
    def test_colocated_is_deterministic(self):
        settings = DemoSettings(num_requests=3, prompt_len=40, max_new_tokens=4,
                                shared_prefix_len=16, num_layers=2, decode_tp=2,
                                decode_batch=2)
        a = run_colocated(settings)
        b = run_colocated(settings)
        self.assertEqual(sorted(a), ["req-0", "req-1", "req-2"])
        for rid in a:
            self.assertLen(a[rid]["tokens"], 4)
            self.assertEqual(a[rid]["tokens"], b[rid]["tokens"])
            np.testing.assert_array_equal(bits.bits(a[rid]["kv"]), bits.bits(b[rid]["kv"]))
        self.assertEqual(a["req-1"]["prefill_hit_tokens"], 16)


class StepPollingTest(absltest.TestCase):
    """A step dispatched asynchronously while the caller polls gives the blocking result."""

    def test_dispatch_then_wait_ready_equals_run(self):
        spec = SMALL.kv_spec(8, "THD", "bfloat16")
        mesh = make_mesh(jax.devices()[:1])
        tokens = [[5, 7, 9, 11] + [0] * 60]
        positions = [[0, 1, 2, 3] + [-1] * 60]
        a = ModelRunner(SMALL, spec, mesh, num_blocks=8, max_len=64)
        b = ModelRunner(SMALL, spec, mesh, num_blocks=8, max_len=64)
        expected, _ = a.run(tokens, positions, [[1]])
        calls = []
        next_tokens, _ = b.dispatch(tokens, positions, [[1]])
        wait_ready([next_tokens, *b.cache.arrays], lambda: calls.append(1))
        np.testing.assert_array_equal(np.asarray(next_tokens), expected)
        self.assertGreaterEqual(len(calls), 1)  # polled at least once before returning
        np.testing.assert_array_equal(bits.bits(np.asarray(a.cache.arrays[0])),
                                      bits.bits(np.asarray(b.cache.arrays[0])))

    def test_wait_ready_times_out(self):
        release = threading.Event()
        self.addCleanup(release.set)

        class NeverReady:
            def block_until_ready(self):
                release.wait(60)

        with self.assertRaises(TimeoutError):
            wait_ready([NeverReady()], lambda: None, timeout_s=-1.0)

    def test_wait_ready_sees_the_end_at_once_and_polls_every_interval(self):
        # The step "ends" at the third poll: wait_ready polls exactly three times and returns
        # without sleeping out its (long) interval.
        ended = threading.Event()
        calls = []

        class EndsAtTheThirdPoll:
            def block_until_ready(self):
                ended.wait(60)

        def poll():
            calls.append(time.monotonic())
            if len(calls) == 3:
                ended.set()

        wait_ready([EndsAtTheThirdPoll()], poll, interval_s=0.05)
        self.assertEqual(len(calls), 3)
        ended.clear()
        calls.clear()

        def first_poll_ends_it():
            calls.append(1)
            ended.set()

        start = time.monotonic()
        wait_ready([EndsAtTheThirdPoll()], first_poll_ends_it, interval_s=60.0)
        self.assertEqual(len(calls), 1)
        self.assertLess(time.monotonic() - start, 30.0)  # not the 60 s interval

    def test_wait_ready_raises_what_the_step_raised(self):
        class Failed:
            def block_until_ready(self):
                raise RuntimeError("the step failed")

        with self.assertRaisesRegex(RuntimeError, "the step failed"):
            wait_ready([Failed()], lambda: None, interval_s=0.01)


class DocstringExamplesTest(parameterized.TestCase):
    @parameterized.parameters("jaxkv.demo._router", "jaxkv.demo._engines", "jaxkv.demo._report")
    def test_examples(self, module_name):
        import doctest
        import importlib

        result = doctest.testmod(importlib.import_module(module_name), verbose=False)
        self.assertGreater(result.attempted, 0)
        self.assertEqual(result.failed, 0)


class SameSizeReadsReportTest(absltest.TestCase):
    def test_medians_of_requests_of_the_largest_reads_size(self):
        from jaxkv.demo._report import _same_size_reads

        done = [
            RequestResult("req-0", status="done", bytes=4096, nixl_descriptors=4, read_s=0.004,
                          transfer_s=0.006),
            RequestResult("req-1", status="done", bytes=4096, nixl_descriptors=4, read_s=0.002,
                          transfer_s=0.004),
            RequestResult("req-2", status="done", bytes=4096, nixl_descriptors=4, read_s=0.003,
                          transfer_s=0.008),
            RequestResult("req-3", status="done", bytes=4096, descriptors=1, read_s=0.5,
                          transfer_s=0.5),  # other descriptors: not compared
            RequestResult("req-4", status="done", bytes=1024, nixl_descriptors=1, read_s=0.5,
                          transfer_s=0.5),  # a smaller read: not compared
        ]
        alone = {"landed_ms": 1.0, "confirmed_ms": 2.0, "repeats": 5, "bytes": 4096,
                 "descriptors": 4}
        same = _same_size_reads(done, alone)
        self.assertEqual((same["bytes"], same["descriptors"]), (4096, 4))  # req-0's size
        self.assertEqual(same["requests"], 3)
        self.assertEqual(same["read_ms"], 3.0)
        self.assertEqual(same["transfer_ms"], 6.0)
        self.assertEqual(same["confirm_ms"], 2.0)
        self.assertAlmostEqual(same["read_MBps"], 4096 / 3.0 / 1e3)
        self.assertAlmostEqual(same["transfer_MBps"], 4096 / 6.0 / 1e3)
        self.assertIs(same["engine_alone"], alone)
        self.assertNotIn("engine_alone", _same_size_reads(done))
        # the size is the largest read's, ties going to the first request
        bigger = RequestResult("req-9", status="done", bytes=8192, nixl_descriptors=2,
                               read_s=0.001, transfer_s=0.002)
        self.assertEqual(_same_size_reads([*done, bigger])["requests"], 1)
        self.assertEqual(_same_size_reads([*done, bigger])["bytes"], 8192)
        self.assertIsNone(_same_size_reads([]))
        self.assertIsNone(_same_size_reads([RequestResult("req-0", status="done")]))


class RouterDeadlineTest(absltest.TestCase):
    def test_the_serving_deadline_counts_from_the_last_arrival(self):
        """A prefill side that never answers: the requests fail `timeout_s` after the last
        one arrived, not after the first (a schedule longer than `timeout_s` is served)."""
        from jaxkv.demo._router import Router

        class Pipe:
            def __init__(self):
                self.sent = []

            def send(self, message):
                self.sent.append((message[1], time.monotonic()))

            def poll(self, timeout=0):
                return False

        class Alive:
            exitcode = None

            def is_alive(self):
                return True

        class Side:
            finished_reads = 0

            def advance(self, router):
                time.sleep(0.005)

            def release(self, request_id):
                pass

        settings = DemoSettings(num_requests=3, request_interval_s=0.4, timeout_s=0.3)
        results = {f"req-{i}": RequestResult(f"req-{i}") for i in range(3)}
        pipe, start = Pipe(), time.monotonic()
        Router(settings, pipe, Alive(), [[1], [2], [3]], results, {}, None, start).run(Side())
        elapsed = time.monotonic() - start
        self.assertEqual([rid for rid, _ in pipe.sent], ["req-0", "req-1", "req-2"])
        self.assertGreaterEqual(pipe.sent[-1][1] - start, 0.8)  # req-2 arrived at 0.8 s
        self.assertGreaterEqual(elapsed, 0.8 + 0.3)  # failed only 0.3 s after that
        self.assertEqual({r.status for r in results.values()}, {"failed"})
        self.assertEqual({r.error for r in results.values()},
                         {"timed out 0.3s after the last request arrived"})


class PairedTtftReportTest(absltest.TestCase):
    def test_pairs_compare_each_mode_with_its_partner_in_abba_order(self):
        """``--layerwise_ab``: req-0/req-1 (whole, layer-wise), req-2/req-3 (layer-wise,
        whole), ...; a pair missing a request is left out; differences are layer-wise minus
        whole, whichever ran first."""
        from jaxkv.demo._report import _paired_ttft

        ttft = {0: 9.0, 1: 8.5, 2: 7.0, 3: 7.25, 4: 5.0, 5: 5.5, 6: 4.0}  # req-7 failed
        done = [RequestResult(f"req-{i}", status="done", ttft_s=t, prefill_s=t - 0.125 * i)
                for i, t in ttft.items()]
        settings = DemoSettings(num_requests=8, layerwise_ab=True)
        self.assertEqual(
            [settings.layer_pipelined(f"req-{i}") for i in range(8)],
            [False, True, True, False, False, True, True, False])
        pairs = _paired_ttft(settings, done)
        # layer-wise minus whole, TTFT: -0.5, -0.25, +0.5 s; prefill (0.125 s less per
        # index): -0.625, -0.125, +0.375 s
        self.assertEqual(pairs, {"pairs": 3, "layerwise_lower": 2,
                                 "median_ttft_diff_ms": -250.0,
                                 "median_prefill_diff_ms": -125.0})
        self.assertIsNone(_paired_ttft(settings, done[:1]))


if __name__ == "__main__":
    absltest.main()
