#!/usr/bin/env bash
# GPU validation in one run: the CUDA tests, the GPU transfer test, the GPU modes of the op,
# transfer and layer-wise benchmarks, and the demo on one GPU, each step under its own time
# limit, every log and JSON report in OUT_DIR (summary.txt: one line per step with its exit
# status and seconds). On an H200 the first five steps took 2 minutes; the limits add up to
# 17 minutes (where a machine is lent for less, run the steps in groups with STEPS).
#
# Usage: [STEPS=a,b] scripts/gpu_validate.sh OUT_DIR [PYTHON]
#   STEPS: run only these steps (names as in summary.txt; default every step), e.g. to rerun
#   what failed.
#   PYTHON (default python3) must import jaxkv with its CUDA module (`scripts/setup.sh` builds
#   it where nvcc is found; `scripts/check_cuda_build.sh` checks it) and a JAX that sees the GPU
#   (`scripts/cuda_plugin.sh` names the plugin); NIXL (nixl-cu13) for the transfer steps.
#   Runs from the repository root. A step that fails does not stop the later ones; the script
#   exits non-zero if any step failed.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:?usage: scripts/gpu_validate.sh OUT_DIR [PYTHON]}"
PY="${2:-python3}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
cd "$ROOT"
STATUS=0

# step NAME LIMIT_S COMMAND...: runs COMMAND with its output in OUT/NAME.log.
step() {
  local name="$1" limit="$2" start rc
  shift 2
  if [[ -n "${STEPS:-}" && ",$STEPS," != *",$name,"* ]]; then
    return
  fi
  start=$SECONDS
  echo "[gpu-validate] $name (limit ${limit}s)"
  timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  echo "$name rc=$rc $((SECONDS - start))s" | tee -a "$OUT/summary.txt"
  [[ $rc -eq 0 ]] || STATUS=1
  tail -n 5 "$OUT/$name.log"
}

step environment 60 bash -c "nvidia-smi; nvcc --version 2>/dev/null | tail -n 2; '$PY' - <<'PY'
import sys, jax, jaxlib
print('python', sys.version.split()[0], 'jax', jax.__version__, 'jaxlib', jaxlib.__version__)
print('devices', jax.devices())
import jaxkv._ffi_cuda as cuda
from jaxkv._ffi import CUSTOM_CALL_TARGETS, ensure_registered
assert set(cuda.registrations()) == set(CUSTOM_CALL_TARGETS), sorted(cuda.registrations())
print('registered platforms', sorted(ensure_registered()))
from jaxkv.transfer import nixl_available
print('nixl', nixl_available())
PY"

# The CUDA custom calls against numpy and the jnp reference (tests/ops), then real NIXL
# transfers between two processes on the one GPU (tests/transfer/gpu_transfer_test.py).
export JAX_PLATFORMS=cuda,cpu JAXKV_EXPECT_GPU=1
step cuda_tests 200 "$PY" -P -m pytest -p no:cacheprovider -q -rs \
  tests/ops/cuda_test.py tests/ops/reshape_cuda_test.py tests/ops/cuda_paths_test.py \
  tests/integrations/torch_cuda_test.py
step transfer_tests 120 "$PY" -P -m pytest -p no:cacheprovider -q -rs \
  tests/transfer/gpu_transfer_test.py

# Benchmarks on the GPU (jax.devices()[0]): against a device-to-device copy of the same bytes
# and the jnp reference (and torch where bench_reshape_ops has it), interleaved.
step bench_block_ops 80 "$PY" benchmarks/bench_block_ops.py --json_out="$OUT/block_ops_gpu.json"
step bench_reshape_ops 100 "$PY" benchmarks/bench_reshape_ops.py \
  --json_out="$OUT/reshape_ops_gpu.json"
# A pull between two processes on the one GPU against a bare READ of the same bytes.
step bench_transfer 80 env UCX_TLS="${UCX_TLS:-tcp,sm,self,cuda_copy,cuda_ipc}" \
  XLA_PYTHON_CLIENT_PREALLOCATE=false "$PY" benchmarks/bench_transfer.py --mib=256 --repeats=5 \
  --json_out="$OUT/transfer_gpu.json"
# Layer-pipelined pulls from a jitted prefill step on the GPU (NIXL direct from VRAM, through
# pinned-host mirrors, the JAX transport), layers heavy enough to take milliseconds there.
step bench_layerwise 150 "$PY" benchmarks/bench_layerwise.py --platform=gpu \
  --modes=direct,staged,jax --width=2048 --matmuls=12 --rounds=3 --pin_cpus=0 \
  --json_out="$OUT/layerwise_gpu.json"
# The disaggregated demo on the one GPU (prefill and decode processes, TP 1 each): tokens and
# KV bytes must match the single-engine reference (its exit status).
step demo 240 "$PY" -m jaxkv.demo --backend=auto --prefill_tp=1 --decode_tp=1 --progress=false \
  --json_out="$OUT/demo_gpu.json"
exit "$STATUS"
