"""Environment of the tpu-inference integration tests, set before JAX, vLLM or tpu-inference
is imported: JAX on CPU devices (tpu-inference's platform is TPU, its code runs on CPU here),
UCX over TCP/shared memory for NIXL. Only where tpu-inference is installed: elsewhere these
tests skip and the rest of the suite keeps its own platform. (This directory is not named
tpu_inference: pytest puts tests/integrations on sys.path, where a tpu_inference directory
would import as a namespace package of that name.)"""

import importlib.util
import os

if importlib.util.find_spec("tpu_inference") is not None:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("UCX_TLS", "tcp,sm,self")
