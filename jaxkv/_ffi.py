"""Registers jaxkv's custom-call handlers with XLA (once per process)."""

from __future__ import annotations

import functools
import importlib

import jax

__all__ = ["CUSTOM_CALL_TARGETS", "ensure_registered", "registered_platforms"]

CUSTOM_CALL_TARGETS: tuple[str, ...] = (
    "jaxkv_copy_blocks",
    "jaxkv_gather_blocks",
    "jaxkv_gather_blocks_into",
    "jaxkv_scatter_blocks",
    "jaxkv_permute_blocks",
    "jaxkv_merge_blocks",
    "jaxkv_copy_block_prefix",
    "jaxkv_copy_block_prefix_in_place",
    "jaxkv_split_blocks",
    "jaxkv_concat_blocks",
)
"""Every custom-call target jaxkv registers, for each platform it was built for."""

_PLATFORM_MODULES = {"cpu": "jaxkv._ffi_cpu", "CUDA": "jaxkv._ffi_cuda"}


@functools.cache
def ensure_registered() -> tuple[str, ...]:
    """Registers the handlers of every built platform module; returns those platforms.

    The CPU module is always built; the CUDA module exists where the package was built with
    nvcc. Registering CUDA targets on a machine without a GPU is harmless.

    Raises:
      ImportError: the CPU extension module is missing (the package was not built).
    """
    platforms = []
    for platform, module_name in _PLATFORM_MODULES.items():
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            if platform == "cpu":
                raise ImportError(
                    "jaxkv's compiled extension jaxkv._ffi_cpu is missing; install jaxkv with "
                    "`pip install .` (it builds the custom calls with CMake)"
                ) from None
            continue
        for name, capsule in module.registrations().items():
            jax.ffi.register_ffi_target(name, capsule, platform=platform)
        platforms.append(platform)
    return tuple(platforms)


def registered_platforms() -> tuple[str, ...]:
    """The platforms whose handlers are registered (registering them if needed)."""
    return ensure_registered()
