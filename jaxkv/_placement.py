"""Bit-exact placement of arrays onto a sharding.

KV bytes must arrive unchanged, NaN payloads included. jax 0.12 canonicalises float8_e5m2 NaN
payloads when `jax.device_put` reshards an array that already lives on a device (seen on CPU:
0x7D becomes 0x7F), while host-to-device transfers and integer reshards are exact. So floating
device arrays are resharded through an unsigned-integer view of the same width.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["place_exactly"]


def place_exactly(x: Any, sharding: jax.sharding.Sharding) -> jax.Array:
    """Puts `x` (numpy or JAX array) on `sharding` without changing any bit.

    Example:
      >>> y = place_exactly(np.zeros((2, 2), np.float32), jax.devices()[0])
    """
    if not isinstance(x, jax.Array):
        host = np.asarray(x)
        if isinstance(sharding, jax.sharding.Sharding) and not sharding.is_fully_addressable:
            # Over a global mesh (multi-controller JAX) each process places only its own
            # shards: no cross-process check that the value agrees (device_put's, a
            # collective that also refuses NaN payloads as unequal).
            return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])
        return jax.device_put(host, sharding)
    if isinstance(sharding, jax.sharding.Sharding) and x.sharding.is_equivalent_to(
        sharding, x.ndim
    ):
        return x
    if not jnp.issubdtype(x.dtype, jnp.floating):
        return jax.device_put(x, sharding)
    unsigned = jnp.dtype(f"uint{8 * x.dtype.itemsize}")
    bits = jax.device_put(jax.lax.bitcast_convert_type(x, unsigned), sharding)
    return jax.lax.bitcast_convert_type(bits, x.dtype)
