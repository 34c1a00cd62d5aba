"""The one way the tests build meshes (not a test module).

`mesh` takes the first devices JAX lists (or `devices`): a plain `jax.sharding.Mesh` (Auto
axes: shardings unknown while tracing) by default, `jax.make_mesh` with Explicit axes where
`explicit`. JAX is imported on the first call, so a spawned child can import this module
before `processes.child_env` configures its devices.
"""

from __future__ import annotations

import math


def mesh(shape, names, *, explicit: bool = False, devices=None):
    """A mesh of `shape` with axis `names` over the first devices."""
    import jax
    import numpy as np

    shape, names = tuple(shape), tuple(names)
    devices = list(jax.devices() if devices is None else devices)[: math.prod(shape)]
    if explicit:
        return jax.make_mesh(shape, names, devices=devices,
                             axis_types=(jax.sharding.AxisType.Explicit,) * len(shape))
    return jax.sharding.Mesh(np.array(devices).reshape(shape), names)


def tp(size: int, *, explicit: bool = False, devices=None):
    """A one-axis ("tp",) mesh of the first `size` devices."""
    return mesh((size,), ("tp",), explicit=explicit, devices=devices)
