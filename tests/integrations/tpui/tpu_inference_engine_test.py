"""P/D end to end through real tpu-inference engines (vllm-tpu / tpu-inference 0.32 on JAX's
CPU devices, `jaxkv.demo._tpu_inference_cpu`) serving a real model forward (a tiny Llama with
seeded random weights, float32), jaxkv's ``TPUConnector`` moving the prompt KV between a
prefill engine at TP 2 (two JAX CPU devices) with 16-token pages and a decode engine at TP 1
with 32-token pages, over NIXL and over the JAX transport (`jax.experimental.transfer`,
whose reads all failed inside tpu-inference's runner before jaxkv's programs ignored the
runner's context mesh).

Every P/D run is compared with a single instance (tokens equal) and the decode side's cache
with the producer's (every prompt row bit for bit, K/V interleaved and packed as tpu-inference
stores them), and carries a negative control that must change the tokens (two requests'
transfer params swapped). Engines start once and serve every scenario."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

if importlib.util.find_spec("tpu_inference") is None:
    pytest.skip("tpu-inference is not installed: run scripts/test.sh --integrations="
                "tpu-inference (sets up .venv-tpui)", allow_module_level=True)

import real_engine_harness as rh  # noqa: E402
from absl.testing import absltest, parameterized  # noqa: E402

from jaxkv.demo._real_engines import received_parts  # noqa: E402
from jaxkv.transfer import nixl_available  # noqa: E402
from jaxkv.transfer._jax_transport import jax_transfer_available  # noqa: E402

BACKEND = "tpu-inference"
MAX_TOKENS = 8
TRANSPORTS = [t for t, ok in (("nixl", nixl_available()), ("jax", jax_transfer_available()))
              if ok]
if not TRANSPORTS:
    pytest.skip("neither NIXL nor JAX's transfer server is available", allow_module_level=True)


class TpuInferenceEngineTest(rh.EnginesTestCase):
    @classmethod
    def make_engines(cls, model_dir, port):
        cls.pairs = {}
        engines = []
        for i, transport in enumerate(TRANSPORTS):
            producer = rh.Engine(BACKEND, model_dir, 1, "kv_producer", f"prefill-{transport}",
                                 port + 2 * i, 16, tp=2, transport=transport)
            consumer = rh.Engine(BACKEND, model_dir, 1, "kv_consumer", f"decode-{transport}",
                                 port + 2 * i + 1, 32, transport=transport)
            cls.pairs[transport] = (producer, consumer)
            engines += [producer, consumer]
        cls.single = rh.Engine(BACKEND, model_dir, 1, None, block_size=32)
        return [*engines, cls.single]

    def pd(self, transport, prompts, transform=None):
        producer, consumer = self.pairs[transport]
        prefilled = producer.call("prefill", prompts)
        params = [p for p, _ in prefilled]
        if transform is not None:
            params = transform(params)
        return [kv for _, kv in prefilled], consumer.call("generate", prompts, params, MAX_TOKENS)

    def assert_rows_exact(self, got, want, start, num_tokens):
        # the last prompt token is recomputed by vLLM on the decode side
        for a, b in zip(received_parts(BACKEND, got, start, num_tokens - 1),
                        received_parts(BACKEND, want, start, num_tokens - 1)):
            np.testing.assert_array_equal(a, b)

    @parameterized.parameters(*TRANSPORTS)
    def test_decode_equals_a_single_instance_and_rows_are_exact(self, transport):
        prompts = rh.prompts_of([40, 70, 97], seed=10 + len(transport))
        single = self.single.call("generate", prompts, None, MAX_TOKENS)
        kvs, results = self.pd(transport, prompts)
        for prompt, want, got, kv in zip(prompts, single, results, kvs):
            n = len(prompt)
            self.assertEqual(got["kv_transfer_params"],
                             {"jaxkv_load": {"status": "loaded", "remote_tokens": n,
                                             "local_hit_tokens": 0}})
            self.assert_rows_exact(got["prompt_kv"], kv, 0, n)
            self.assertEqual(got["tokens"], want["tokens"])

    @parameterized.parameters(*TRANSPORTS)
    def test_swapped_params_change_the_tokens(self, transport):
        prompts = rh.prompts_of([48, 48, 48, 48], seed=20 + len(transport))
        single = self.single.call("generate", prompts, None, MAX_TOKENS)
        _, swapped = self.pd(transport, prompts[:2], transform=lambda p: p[::-1])
        for want, got in zip(single[:2], swapped):
            self.assertEqual(got["kv_transfer_params"]["jaxkv_load"]["status"], "loaded")
            self.assertNotEqual(got["tokens"], want["tokens"])
        _, right = self.pd(transport, prompts[2:])  # fresh prompts: nothing cached wrong
        self.assertEqual([r["tokens"] for r in right], [s["tokens"] for s in single[2:]])

    @parameterized.parameters(*TRANSPORTS)
    def test_partial_prefix_hit_reads_only_the_tail(self, transport):
        shared = rh.prompts_of([64], seed=30 + len(transport))[0]
        first = shared + rh.prompts_of([20], seed=31)[0]
        second = shared + rh.prompts_of([37], seed=32)[0]
        _, consumer = self.pairs[transport]
        consumer.call("generate", [first], None, 1)  # the decode engine caches the prefix
        self.single.call("generate", [first], None, 1)
        want = self.single.call("generate", [second], None, MAX_TOKENS)[0]
        kvs, results = self.pd(transport, [second])
        got = results[0]
        self.assertEqual(got["kv_transfer_params"]["jaxkv_load"],
                         {"status": "loaded", "remote_tokens": len(second) - 64,
                          "local_hit_tokens": 64})
        self.assert_rows_exact(got["prompt_kv"], kvs[0], 64, len(second))
        self.assertEqual(got["tokens"], want["tokens"])


if __name__ == "__main__":
    absltest.main()
