"""Environment of the tpu-inference integration tests, set before JAX, vLLM or tpu-inference
is imported: JAX on CPU devices (tpu-inference's platform is TPU, its code runs on CPU), and
the same offline Hugging Face cache as the vLLM tests (tests/integrations/conftest.py)."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("UCX_TLS", "tcp,sm,self")
