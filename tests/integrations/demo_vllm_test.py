"""The demo served by vLLM's schedulers on both sides (`--serve_with=vllm-scheduler`): tokens
and prompt KV bytes equal the colocated run's."""

import importlib.util
import subprocess
import sys

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip(
        "vLLM is not installed: run scripts/test.sh --integrations (sets up .venv-vllm)",
        allow_module_level=True,
    )

from jaxkv.demo._engines import DemoSettings  # noqa: E402


@pytest.fixture(scope="module")
def report():
    from jaxkv.demo._vllm_serve import run_with_vllm_scheduler

    settings = DemoSettings(
        prefill_tp=2, decode_tp=1, prefill_layout="KHTD", decode_layout="THD",
        prefill_block_size=8, decode_block_size=16, num_requests=4, prompt_len=40,
        shared_prefix_len=32, max_new_tokens=5, num_layers=2, d_model=128, num_heads=4,
        num_kv_heads=2, head_dim=16, vocab_size=128, timeout_s=240.0,
    )
    return run_with_vllm_scheduler(settings)


def test_tokens_and_kv_equal_the_colocated_run(report):
    assert report["serve_with"] == "vllm-scheduler"
    assert report["failed_requests"] == 0, report["requests"]
    assert report["tokens_match"]
    assert all(r["kv_match"] for r in report["requests"]), report["requests"]


def test_kv_moved_through_the_connector(report):
    # The first request finds nothing cached on either side: all its blocks are read.
    first = next(r for r in report["requests"] if r["request_id"] == "req-0")
    assert first["decode_hit_tokens"] == 0
    assert first["bytes"] > 0 and first["blocks_read"] == 3
    # Later ones share a 32-token prefix: once a request's loaded blocks are cached (vLLM
    # caches them when the read finished), the decode side reads only the 8 tokens it lacks.
    for r in report["requests"]:
        assert r["decode_hit_tokens"] in (0, 32), r
        expected = first["bytes"] if r["decode_hit_tokens"] == 0 else first["bytes"] * 8 // 40
        assert r["bytes"] == expected, r


def test_cli_flag_runs_the_vllm_mode(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "jaxkv.demo", "--serve_with=vllm-scheduler", "--num_requests=2",
         "--prompt_len=24", "--shared_prefix_len=16", "--max_new_tokens=2", "--num_layers=1",
         "--progress=false", f"--json_out={tmp_path / 'r.json'}"],
        capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "vLLM's schedulers" in out.stdout and "tokens match colocated run: True" in out.stdout
