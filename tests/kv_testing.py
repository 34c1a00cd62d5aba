"""Helpers shared by the jaxkv test suites (not a test module)."""

from __future__ import annotations

import os

import numpy as np

NUM_CPU_DEVICES = 8


def force_cpu_devices(count: int = NUM_CPU_DEVICES) -> None:
    """Asks XLA for `count` host devices; must run before the JAX backend starts."""
    flag = f"--xla_force_host_platform_device_count={count}"
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {flag}".strip()


def random_bits(rng: np.random.Generator, shape: tuple[int, ...], dtype) -> np.ndarray:
    """An array of `dtype` filled with random bit patterns (NaN payloads included), so that a
    byte copy is checked on every bit."""
    dtype = np.dtype(dtype)
    raw = rng.integers(0, 256, size=(*shape, dtype.itemsize), dtype=np.uint8)
    return raw.view(dtype).reshape(shape)


def bits(array) -> np.ndarray:
    """The raw bits of an array as unsigned integers of the same width."""
    array = np.asarray(array)
    return array.view(np.dtype(f"u{array.dtype.itemsize}"))


def numpy_copy_blocks(cache: np.ndarray, src, dst) -> np.ndarray:
    """Independent reference: copy pairs with both ids non-negative, reading the old cache."""
    out = cache.copy()
    for s, d in zip(src, dst):
        if s >= 0 and d >= 0:
            out[d] = cache[s]
    return out


def numpy_gather_blocks(cache: np.ndarray, ids) -> np.ndarray:
    out = np.zeros((len(ids), *cache.shape[1:]), cache.dtype)
    for i, block in enumerate(ids):
        if block >= 0:
            out[i] = cache[block]
    return out


def numpy_scatter_blocks(cache: np.ndarray, blocks: np.ndarray, ids) -> np.ndarray:
    out = cache.copy()
    for i, block in enumerate(ids):
        if block >= 0:
            out[block] = blocks[i]
    return out


def assert_same_values(actual, expected) -> None:
    """Bit-equal, except that any NaN matches any NaN. For XLA's own gather/scatter, which may
    canonicalise NaN payloads (seen for bfloat16 on CPU); jaxkv's custom calls are compared
    with `bits` instead."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    same = bits(actual) == bits(expected)
    if not np.issubdtype(actual.dtype, np.integer):
        nan_a = np.isnan(actual.astype(np.float32))
        nan_e = np.isnan(expected.astype(np.float32))
        same |= nan_a & nan_e
    mismatches = np.argwhere(~same)
    assert mismatches.size == 0, f"{len(mismatches)} mismatches, first at {mismatches[0].tolist()}"


def gpus() -> list:
    """The GPUs JAX sees (empty without a CUDA backend); CUDA test modules skip on [].

    Raises:
      RuntimeError: ``JAXKV_EXPECT_GPU=1`` and JAX sees no GPU (a GPU run whose jaxlib lacks
        its CUDA plugin must fail, not skip every GPU test and report green).
    """
    import os

    import jax

    try:
        found = jax.devices("gpu")
    except RuntimeError as error:
        found, reason = [], str(error)
    else:
        reason = ""
    if not found and os.environ.get("JAXKV_EXPECT_GPU") == "1":
        raise RuntimeError(
            "JAXKV_EXPECT_GPU=1 but JAX sees no GPU (install the jax CUDA plugin matching the "
            f"toolkit, e.g. jax[cuda12] or jax[cuda13]): {reason or jax.devices()}")
    return found


def take_cuda_id_errors(device) -> int:
    """The id-check failures recorded on GPU `device` (a jax.Device) since the last call, then
    cleared: an OR of jaxkv._ffi_cuda.ID_OUT_OF_RANGE / ID_REPEATED / ID_SHARED, 0 when none.
    With validate_ids, the CUDA custom calls check traced ids on the device and record a
    failure there instead of raising (an op whose ids fail writes no cache block). Waits for
    the device."""
    from jaxkv import _ffi_cuda

    return int(_ffi_cuda.take_id_errors(device.local_hardware_id))
