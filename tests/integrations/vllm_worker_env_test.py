"""The vLLM connector's worker side keeps JAX to the worker before JAX starts its backends:
no GPU preallocation and only the worker's GPU, unless the user chose otherwise.

Each case runs in a fresh interpreter (JAX's backends start once per process), with torch's
CUDA device faked where a case needs one (this machine has no GPU).
"""

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
from absl.testing import absltest

if importlib.util.find_spec("vllm") is None or importlib.util.find_spec("torch") is None:
    pytest.skip(
        "vLLM is not installed: run scripts/test.sh --integrations (sets up .venv-vllm)",
        allow_module_level=True,
    )

_HERE = os.path.dirname(os.path.abspath(__file__))

# Builds a worker-side connector as vLLM does, then prints what JAX will start with.
_WORKER = """
import os, sys
from unittest import mock
import torch
import vllm_harness
from jax._src import xla_bridge
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from jaxkv.integrations.vllm import JaxKVConnector

{before}
config = vllm_harness.vllm_config("kv_consumer", 16, {{}}, 32)
with mock.patch.object(torch.cuda, "is_available", return_value=True), \\
        mock.patch.object(torch.cuda, "is_initialized", return_value=True), \\
        mock.patch.object(torch.cuda, "current_device", return_value={device}):
    JaxKVConnector(config, KVConnectorRole.{role})
print("PREALLOCATE", os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE"))
print("VISIBLE", xla_bridge.CUDA_VISIBLE_DEVICES.value)
"""


def _run(*, env_preallocate=None, before="", device=1, role="WORKER"):
    env = dict(os.environ)
    env.pop("XLA_PYTHON_CLIENT_PREALLOCATE", None)
    if env_preallocate is not None:
        env["XLA_PYTHON_CLIENT_PREALLOCATE"] = env_preallocate
    env["PYTHONPATH"] = os.pathsep.join([_HERE, os.path.dirname(_HERE)])
    script = _WORKER.format(before=textwrap.dedent(before), device=device, role=role)
    done = subprocess.run([sys.executable, "-P", "-c", script], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines()
                 if line.startswith(("PREALLOCATE ", "VISIBLE ")))
    return lines["PREALLOCATE"], lines["VISIBLE"], done.stderr


class WorkerEnvTest(absltest.TestCase):
    def test_worker_turns_off_preallocation_and_keeps_to_its_gpu(self):
        preallocate, visible, _ = _run(device=1)
        self.assertEqual(preallocate, "false")
        self.assertEqual(visible, "1")  # torch's current device

    def test_user_settings_are_kept(self):
        preallocate, visible, _ = _run(
            env_preallocate="true",
            before='import jax; jax.config.update("jax_cuda_visible_devices", "0,1")')
        self.assertEqual(preallocate, "true")
        self.assertEqual(visible, "0,1")

    def test_scheduler_side_changes_nothing(self):
        preallocate, visible, _ = _run(role="SCHEDULER")
        self.assertEqual(preallocate, "None")
        self.assertEqual(visible, "all")

    def test_a_started_gpu_backend_is_reported(self):
        # Too late: JAX's GPU backend started before the connector (faked: no GPU here); it
        # says so and sets no device.
        _, visible, stderr = _run(before="""
            import jax
            jax.devices()
            mock.patch.object(xla_bridge, "backends",
                              return_value={"cpu": None, "cuda": None}).start()
            """)
        self.assertEqual(visible, "all")
        self.assertIn("JAX's GPU backend started before the vLLM connector", stderr)

    def test_a_started_cpu_backend_is_not_reported(self):
        # A CPU-only process (vLLM's CPU platform, the tests' harness) has nothing to confine.
        _, visible, stderr = _run(before="import jax; jax.devices()")
        self.assertEqual(visible, "all")
        self.assertNotIn("backend started before", stderr)


if __name__ == "__main__":
    absltest.main()
