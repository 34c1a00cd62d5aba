"""The devices the tests run on: several CPU devices for the sharding tests, the GPUs JAX
sees, the CUDA id-check records (not a test module)."""

from __future__ import annotations

import os

NUM_CPU_DEVICES = 8


def force_cpu_devices(count: int = NUM_CPU_DEVICES) -> None:
    """Asks XLA for `count` host devices; must run before the JAX backend starts."""
    flag = f"--xla_force_host_platform_device_count={count}"
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {flag}".strip()


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
