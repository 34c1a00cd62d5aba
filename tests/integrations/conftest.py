"""Environment of the integration tests, set before vLLM is imported: the offline Hugging Face
cache that scripts/setup_integrations.sh writes into the environment (the model's config.json
only), vLLM's CPU platform (not where tpu-inference is installed: its TPU platform is the one
under test there), and UCX over TCP/shared memory for NIXL."""

import importlib.util
import os
import sys

_HF_HOME = os.path.join(sys.prefix, "hf-home")
if os.path.isdir(_HF_HOME):
    os.environ.setdefault("HF_HOME", _HF_HOME)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
if importlib.util.find_spec("tpu_inference") is None:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("UCX_TLS", "tcp,sm,self")
