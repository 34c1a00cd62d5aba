"""Triggering transfers from inside jitted step functions.

A serving loop runs its prefill and decode steps as jitted programs. These two functions let
such a program publish the blocks it just wrote and wait for blocks being received, through a
host callback (``jax.experimental.io_callback``) whose operands are only a request handle
(`KVTransferEngine.handle`), block ids and a layer count: small int32 arrays. KV bytes never
go through the callback (on a GPU, callback operands are copied to host and the stream is
synchronised; NIXL reads the registered cache buffers directly instead).

Ordering is by data dependence, not by callback ordering: the operands of the publishing
callback go through ``lax.optimization_barrier`` together with the written cache, so XLA can
only compute them, hence run the callback, after the computation that produced the cache
(the block writes). On a GPU the callback's device-to-host copy of its operands is enqueued
after those writes on the same stream and synchronised before the callback runs. The waiting
callback's result goes through a barrier with the cache the same way, so every read of the
returned cache is scheduled after the wait returned. (``ordered=True`` callbacks would only
order callbacks among themselves, and are refused in multi-device programs.)

Pass the cache with ``donate_argnums`` so that it stays in its registered buffers.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

__all__ = ["publish_in_jit", "wait_in_jit"]


def _publish_callback(engine: Any, handle, block_ids, layer_stop) -> np.ndarray:
    return np.int32(engine._callback_publish(int(handle), np.asarray(block_ids), int(layer_stop)))


def _wait_callback(engine: Any, timeout_s: float, handle) -> np.ndarray:
    return np.int32(engine._callback_wait(int(handle), timeout_s))


def publish_in_jit(
    engine: Any,
    handle: Any,
    block_ids: Any,
    written: Any,
    layer_stop: Any = -1,
) -> Any:
    """Publishes blocks written by the enclosing jitted computation (call inside `jax.jit`).

    The request must have been published with ``engine.publish_request(request_id, ids,
    layerwise=True)`` (which pins the blocks and returns the params for the consumer) and its
    handle taken with ``engine.handle(request_id)``. The callback declares layers
    ``[0, layer_stop)`` written (``-1``: every layer) once `written` is computed.

    Args:
      engine: the producer `KVTransferEngine` (closed over: not an operand).
      handle: int32 scalar, the request's `KVTransferEngine.handle`.
      block_ids: int32 ``[n]`` block ids written (negative ids are padding; must equal the
        published ids; empty: not checked).
      written: the pytree (the updated cache) whose computation must finish first.
      layer_stop: int32 scalar, one past the last written global layer, or -1 for all.

    Returns:
      An int32 scalar: 1 published, 0 refused (unknown handle, other ids: the request is
      aborted; logged). Return it from the step (or use it) so the call is not dropped.

    Raises:
      TypeError: from JAX, for operands that are not integer arrays.

    Example:
      >>> @functools.partial(jax.jit, donate_argnums=0)  # doctest: +SKIP
      ... def prefill(cache, blocks, ids, handle):
      ...     cache = cache.scatter_blocks(blocks, ids)
      ...     return cache, publish_in_jit(engine, handle, ids, cache)
    """
    import jax
    import jax.numpy as jnp
    from jax.experimental import io_callback

    handle = jnp.asarray(handle, jnp.int32).reshape(())
    ids = jnp.asarray(block_ids, jnp.int32).reshape(-1)
    stop = jnp.asarray(layer_stop, jnp.int32).reshape(())
    # The barrier makes the callback's operands depend on `written`: see the module docstring.
    handle, ids, stop, _ = jax.lax.optimization_barrier((handle, ids, stop, written))
    return io_callback(
        functools.partial(_publish_callback, engine),
        jax.ShapeDtypeStruct((), jnp.int32),
        handle,
        ids,
        stop,
    )


def wait_in_jit(engine: Any, handle: Any, cache: Any, timeout_s: float = 30.0) -> tuple[Any, Any]:
    """Waits inside a jitted step until a request's blocks arrived (call inside `jax.jit`).

    The read must have been started outside jit (`KVTransferEngine.start_read`); the callback
    drives the engine (no JAX inside it) until the request finished, failed or `timeout_s`
    passed. Requests that need JAX work after their reads (layout / block-size
    post-processing, host staging) cannot finish inside a callback: the status says so and
    the caller falls back to `poll` outside jit.

    Args:
      engine: the consumer `KVTransferEngine` (closed over).
      handle: int32 scalar, the request's `KVTransferEngine.handle`.
      cache: the cache the step reads the received blocks from.
      timeout_s: the longest the callback blocks.

    Returns:
      ``(cache, status)``: the cache ordered after the wait (read the blocks from this one),
      and an int32 scalar: 1 finished, 0 failed (blocks invalid), -1 timed out, -2 needs
      `poll` outside jit. Finished / failed requests are also reported by the next `poll`.

    Example:
      >>> @functools.partial(jax.jit, donate_argnums=0)  # doctest: +SKIP
      ... def decode(cache, ids, handle):
      ...     cache, status = wait_in_jit(engine, handle, cache)
      ...     return cache, cache.gather_blocks(ids), status
    """
    import jax
    import jax.numpy as jnp
    from jax.experimental import io_callback

    handle = jnp.asarray(handle, jnp.int32).reshape(())
    status = io_callback(
        functools.partial(_wait_callback, engine, float(timeout_s)),
        jax.ShapeDtypeStruct((), jnp.int32),
        handle,
    )
    cache, status = jax.lax.optimization_barrier((cache, status))
    return cache, status
