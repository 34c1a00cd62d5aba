"""jaxkv's own programs run on the meshes of the arrays they are given, whatever mesh the
caller has set as context.

A serving engine sets its mesh as context for its whole step loop (tpu-inference's runner sets
a ``('data', 'model')`` mesh with `jax.set_mesh`); jaxkv's eager programs (a block op on a
concrete cache, the transfer formatter, the offload copies) are `jax.jit` programs over
`jax.shard_map` on the cache's own mesh. Traced under a foreign context mesh, JAX refuses them
("The context mesh ... should match the mesh passed to shard_map", or "incompatible devices for
jitted computation"). The programs' operands carry their shardings, so an eager call needs no
context: `jit` here clears it for the call. Inside the caller's own trace the context is left as
it is (JAX forbids changing it there, and the caller's mesh is the one that applies).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import jax

__all__ = ["jit", "no_context_mesh", "outside_trace"]


_trace_state_clean: Callable[[], bool] | None
_get_concrete_mesh: Callable[[], Any] | None
try:  # no public equivalents
    from jax._src.core import trace_state_clean as _trace_state_clean
    from jax._src.mesh import get_concrete_mesh as _get_concrete_mesh
except ImportError:  # pragma: no cover - a JAX without them: leave the context alone
    _trace_state_clean = _get_concrete_mesh = None


def outside_trace() -> bool:
    """Whether no JAX trace is in progress (an eager call, where a context mesh may be set)."""
    return _trace_state_clean is not None and bool(_trace_state_clean())


def _context_mesh_set() -> bool:
    if not jax.sharding.get_abstract_mesh().empty:
        return True
    return _get_concrete_mesh is None or not _get_concrete_mesh().empty


@contextlib.contextmanager
def no_context_mesh() -> Iterator[None]:
    """Clears the caller's context mesh for an eager call (a no-op inside a trace, and when no
    context mesh is set: the common case costs two lookups). Also a decorator
    (``@no_context_mesh()``): the transfer engine's entry points use it, since any eager JAX op
    on arrays outside the context mesh's devices fails under it.

    Example:
      >>> with no_context_mesh():
      ...     pass
    """
    if outside_trace() and _context_mesh_set():
        with jax.set_mesh(None):
            yield
    else:
        yield


def jit(fun: Callable[..., Any] | None = None, **jit_kwargs: Any) -> Any:
    """`jax.jit` whose eager calls run without the caller's context mesh.

    Use as ``jit(f, donate_argnums=0)`` or as a decorator, ``@functools.partial(jit, ...)``.

    Example:
      >>> import numpy as np
      >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
      >>> double = jit(lambda x: x * 2)
      >>> with jax.set_mesh(mesh):
      ...     int(double(np.int32(3)))
      6
    """
    if fun is None:
        return functools.partial(jit, **jit_kwargs)
    jitted = jax.jit(fun, **jit_kwargs)

    @functools.wraps(fun)
    def call(*args: Any, **kwargs: Any) -> Any:
        with no_context_mesh():
            return jitted(*args, **kwargs)

    call.lower = jitted.lower  # type: ignore[attr-defined]
    return call
