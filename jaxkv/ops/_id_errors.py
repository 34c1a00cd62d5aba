"""The loud end of the CUDA custom calls' device-side id checks.

The CUDA custom calls never wait for the GPU, so traced ids (inside the caller's jit) are
checked by small kernels on the device: an op whose ids fail writes no cache block, and the
failure is OR-ed into a per-device record (``jaxkv._ffi_cuda.take_id_errors``). Concrete ids
(eager calls) never get there: they are checked in Python before the call. `check_id_errors`
reads the records and raises, so a serving loop can turn a refused op into an error at a point
where one synchronisation is acceptable.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable

import jax

__all__ = ["check_id_errors"]

# The record's bits (jaxkv._ffi_cuda.ID_*), as the CPU custom calls word the same failures.
_FAILURES = (
    ("ID_OUT_OF_RANGE", "an id out of range for its buffer"),
    ("ID_REPEATED", "a written block listed twice"),
    ("ID_SHARED", "a block both read and written by an in-place copy"),
)


def _cuda_devices(devices: Iterable[jax.Device] | None) -> list[jax.Device]:
    """The devices of `devices` (default: every local GPU) whose ops run jaxkv's CUDA custom
    calls; none without a CUDA module, on ROCm, or without a GPU."""
    from jaxkv.ops._dispatch import custom_calls_run_on

    if devices is None:
        try:
            devices = jax.local_devices(backend="gpu")
        except RuntimeError:  # no GPU backend in this process
            return []
    gpus = [d for d in devices if d.platform in ("gpu", "cuda")]
    return gpus if gpus and custom_calls_run_on("gpu") else []


def check_id_errors(devices: Iterable[jax.Device] | None = None) -> None:
    """Raises if a jaxkv op on a GPU refused its traced ids since the last check.

    On CUDA, ops traced inside your jit with ``validate_ids=True`` check their ids on the
    device without waiting for it: an op whose ids fail (out of range, a written block listed
    twice, a block both read and written) writes no cache block, and the failure is recorded
    per device instead of raised. This reads and clears those records, so call it where one
    synchronisation is acceptable (after a step, in a periodic health check, in tests). Eager
    calls and the other platforms need no check: they raise from the op itself (see
    docs/backends.md, "Ids on CUDA").

    Args:
      devices: the devices to check; default every local GPU. Devices that do not run jaxkv's
        CUDA custom calls (CPU, TPU, ROCm, a build without the CUDA module) are skipped.

    Raises:
      jax.errors.JaxRuntimeError: the record of a device holds failures, naming the device
        and the kinds of failure (the record holds no op name or id: the ops refused since the
        last check wrote nothing). Every device given is read and cleared first.

    Example:
      >>> from jaxkv import ops
      >>> ops.check_id_errors()  # on CPU: nothing is recorded, nothing to raise
    """
    cuda = _cuda_devices(devices)
    if not cuda:
        return
    _ffi_cuda = importlib.import_module("jaxkv._ffi_cuda")  # built only with nvcc

    # Read every device before raising, so that each record is cleared by this check.
    found = [(device, int(_ffi_cuda.take_id_errors(device.local_hardware_id)))
             for device in cuda]
    failed = [(device, bits) for device, bits in found if bits]
    if not failed:
        return
    parts = []
    for device, bits in failed:
        kinds = [text for name, text in _FAILURES if bits & getattr(_ffi_cuda, name)]
        parts.append(f"{device}: {'; '.join(kinds) or f'failure bits {bits:#x}'}")
    raise jax.errors.JaxRuntimeError(
        "jaxkv.ops: since the last check, ops traced with validate_ids=True refused their ids "
        f"on the GPU ({', '.join(parts)}); each such op wrote no cache block. Check the ids "
        "your jitted step passes (eager calls name the offending id).")
