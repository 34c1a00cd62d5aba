"""Triggering transfers from inside jitted step functions.

A serving loop runs its prefill and decode steps as jitted programs. These two functions let
such a program publish the blocks it just wrote and wait for blocks being received, through a
host callback (``jax.experimental.io_callback``) whose operands are only a request handle
(`TransferEngine.handle`), block ids and a layer count: small int32 arrays. KV bytes go
through the callback only with host staging (below); otherwise never (on a GPU, callback
operands are copied to host and the stream is synchronised; NIXL reads the registered cache
buffers directly instead).

Ordering is by data dependence, never by barriers or callback ordering: XLA drops
``optimization_barrier`` after SPMD partitioning without leaving control dependencies (seen in
the compiled program of a two-device step: the callback and the block writes were independent
instructions), and ``ordered=True`` only orders callbacks among themselves. So:

* the publishing callback takes one more int32 scalar, a *token* computed from the written
  cache: the sum of the bits of a few elements of every array (one per KV head, so every shard of a
  head-sharded cache contributes through the reduction). It cannot be computed before every
  block write finished, so neither can the callback run; its value is ignored. On a GPU the
  callback's operand copy is enqueued after those writes and synchronised before it runs.
* the waiting callback's status masks the block ids the step reads the received blocks with
  (``-1`` unless finished): every op that uses the returned ids is data dependent on the wait.
* layer by layer (`publish_layer_in_jit`), both directions: layer k's callback depends on
  layer k's writes (the token), and the next layer's input depends on the callback's status
  (`after_callback`), so layer k is announced before layer k+1 is computed, the callbacks run
  in layer order (each depends on the previous one) under SPMD as well, and XLA needs no copy
  of the cache: every later write of a buffer the token read is ordered after the read.

Host staging (``host_staging=True``: NIXL reads a host mirror of the cache, the only NIXL path
on TPU): `publish_layer_in_jit` passes the request's rows of the announced layers (gathered
from `written` after their writes: ``[blocks, ...]`` of one layer, bit-cast to unsigned ints,
gathered to the callback's device under SPMD) as the callback's operands, in place of the
token: the operand copy to host is the device -> host copy of the layer, ordered after its
writes by data, and the callback writes the rows into the mirror (`HostMirror.write_rows`)
before it announces the layer. A layer so reaches the wire while the step computes the later
ones, and is announced only once its bytes are in the mirror. The compiled step gains one
gather of the request's rows per announcement, no copy of a cache array.

The JAX transport (``transport="jax"``) takes the same rows: the callback copies them to host
memory and hands them to the transport, whose worker thread formats and offers each layer
group from them while the step computes the later layers (no JAX runs in the callback).

Pass the cache with ``donate_argnums`` so that it stays in its registered buffers, and hand
the step's output to `TransferEngine.update_cache`: with host staging, a publication from
inside a step that carried no rows (`publish_in_jit`, or `publish_layer_in_jit` where rows
cannot be taken: see there) is copied to the host mirror from that output (the step's input
was donated), by the first `poll` or `update_cache` after it.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import numpy as np

__all__ = [
    "HandleTable",
    "after_callback",
    "publish_in_jit",
    "publish_layer_in_jit",
    "wait_in_jit",
    "written_token",
]

_log = logging.getLogger(__name__)
_NEVER = -(1 << 30)  # a status no callback returns (keeps `after_callback`'s select unfoldable)


def _publish_callback(engine: Any, handle, block_ids, layer_stop, token) -> np.int32:
    del token  # only orders the callback after the writes
    return np.int32(engine._callback_publish(int(handle), np.asarray(block_ids), int(layer_stop)))


def _wait_callback(engine: Any, timeout_s: float, handle) -> np.int32:
    return np.int32(engine._callback_wait(int(handle), timeout_s))


def written_token(written: Any) -> Any:
    """An int32 scalar that depends on every array of `written` (a `PagedKVCache` or any
    pytree of arrays): the wrapping sum of the bits of a few elements (index 0 on every axis but the
    KV-head axis of a cache's arrays). Cheap, and not foldable by XLA.

    Example:
      >>> token = written_token(cache)  # doctest: +SKIP
    """
    import jax
    import jax.numpy as jnp

    head_axis = None
    if hasattr(written, "spec") and hasattr(written, "arrays"):
        axes = written.spec.block_axes()  # stored axes: a packed axis is two of them
        head_axis = 1 + axes.index("H") if "H" in axes else None
        leaves = list(written.arrays)
    else:
        leaves = jax.tree.leaves(written)
    acc = jnp.uint32(0)
    for leaf in leaves:
        index = tuple(slice(None) if axis == head_axis else 0 for axis in range(leaf.ndim))
        x = jnp.asarray(leaf)[index].reshape(-1)
        width = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]
        bits = jax.lax.bitcast_convert_type(x, width).astype(jnp.uint32)
        acc = acc + jnp.sum(bits, dtype=jnp.uint32)  # an add all-reduce across shards
    return jax.lax.bitcast_convert_type(acc, jnp.int32)


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
    handle taken with ``engine.handle(request_id)``. The callback declares every layer written
    once `written` is computed. To announce layers one by one while the step computes the
    later ones, use `publish_layer_in_jit`: it threads the next layer's input through the
    announcement, which orders the layers and keeps XLA from copying the cache (called per
    layer, this function would copy the whole cache at every layer and overlap nothing, so it
    refuses a partial `layer_stop`).

    Args:
      engine: the producer `TransferEngine` (closed over: not an operand).
      handle: int32 scalar, the request's `TransferEngine.handle`.
      block_ids: int32 ``[n]`` block ids written (negative ids are padding; must equal the
        published ids; empty: not checked).
      written: the updated cache (or pytree) whose computation must finish first.
      layer_stop: -1 (every layer) or the engine's number of layers, as Python ints.

    Returns:
      An int32 scalar: 1 published, 0 refused (unknown handle, other ids: the request is
      aborted; logged). Return it from the step (or use it) so the call is not dropped.
      Multi-controller engines: int32 ``[devices]`` sharded over the cache's mesh (one
      callback per device; a process publishes once all of its devices' writes are done).

    Raises:
      ValueError: a `layer_stop` that declares only some layers (use `publish_layer_in_jit`).
      TypeError: from JAX, for operands that are not integer arrays.

    Example:
      >>> @functools.partial(jax.jit, donate_argnums=0)  # doctest: +SKIP
      ... def prefill(cache, blocks, ids, handle):
      ...     cache = cache.scatter_blocks(blocks, ids)
      ...     return cache, publish_in_jit(engine, handle, ids, cache)
    """
    processes = _coordination_of(engine)
    whole = isinstance(layer_stop, (int, np.integer)) and not isinstance(layer_stop, bool) and (
        layer_stop == -1 or layer_stop == engine.config.spec.num_layers)
    if not whole:
        raise ValueError(
            f"publish_in_jit declares the whole request written (layer_stop -1), got "
            f"layer_stop={layer_stop!r}; to announce layers from inside the step call "
            "publish_layer_in_jit(engine, handle, block_ids, written, layer_stop, next_input) "
            "after each layer: per layer, publish_in_jit makes XLA copy the whole cache and "
            "overlaps nothing")
    if processes is not None:
        return processes.publish_in_jit(handle, block_ids, written)
    return _publish(engine, handle, block_ids, written, -1)


def _coordination_of(engine: Any) -> Any:
    """The process coordination of a multi-controller `TransferEngine` (None otherwise): a
    plain ``io_callback`` in a multi-process program runs in one process only, so such an
    engine's callbacks are issued per device (inside ``shard_map``)."""
    from jaxkv.transfer._transfer_engine import TransferEngine

    return engine._coordination() if isinstance(engine, TransferEngine) else None


def _publish(engine: Any, handle: Any, block_ids: Any, written: Any, layer_stop: Any) -> Any:
    """The publishing callback, ordered after `written`'s computation."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import io_callback

    handle = jnp.asarray(handle, jnp.int32).reshape(())
    ids = jnp.asarray(block_ids, jnp.int32).reshape(-1)
    stop = jnp.asarray(layer_stop, jnp.int32).reshape(())
    return io_callback(
        functools.partial(_publish_callback, engine),
        jax.ShapeDtypeStruct((), jnp.int32),
        handle,
        ids,
        stop,
        written_token(written),  # the data dependence on the writes (module docstring)
    )


def after_callback(tree: Any, status: Any) -> Any:
    """`tree` (any pytree of arrays) with the same values, data dependent on `status`.

    An elementwise select on a condition that never holds (`status` equal to a value no
    callback returns): XLA cannot fold it, so every op using the result runs after the
    callback that produced `status`. Costs one pass over `tree` (pass activations, not the
    cache).

    Example:
      >>> x = after_callback(x, status)  # doctest: +SKIP
    """
    import jax
    import jax.numpy as jnp

    never = jnp.asarray(status, jnp.int32).reshape(()) == _NEVER
    return jax.tree.map(lambda x: jnp.where(never, jnp.zeros_like(x), x), tree)


def publish_layer_in_jit(
    engine: Any,
    handle: Any,
    block_ids: Any,
    written: Any,
    layer_stop: Any,
    next_input: Any,
    *,
    layer_start: int | None = None,
) -> tuple[Any, Any]:
    """Announces layers ``[0, layer_stop)`` of a request from inside a jitted step, between two
    layers: after `written` (the cache with this layer's writes) is computed and before the
    next layer can start (it must use the returned `next_input`).

    Call it after each layer's KV write (the request published with ``layerwise=True``); the
    consumer reads layer k while the step computes the later ones. See the module docstring
    for the ordering; no copy of the cache is added.

    Host staging (``host_staging=True``, NIXL's only path on TPU) and the JAX transport:
    the callback's operands also carry the request's rows of the announced layers
    ``[layer_start, layer_stop)`` (gathered from `written` after their writes: the layer's
    bytes of the request's blocks, not the cache); the callback writes them into the host
    mirror before it announces the layers (staging), or hands them to the JAX transport,
    which formats and offers them from a worker thread, so they are readable while the step
    computes the later ones. This needs `written` to be the registered `PagedKVCache` (the
    only one of the engine), and a Python int `layer_stop` unless the layout has an L axis
    (then a traced one, as in a loop over the layers, announces one layer per call);
    otherwise (an array per layer with a traced stop, only some arrays, several caches) the
    layers reach the mirror (or the JAX transport) only from the step's output, at the first
    `poll` / `update_cache` after the step (warned at trace time). A
    layer missing before `layer_start` (an earlier announcement that could not carry its
    rows) is staged from the output too, with the layers after it: a layer is announced only
    once its bytes are in the mirror.

    Args:
      engine, handle, block_ids: as for `publish_in_jit`.
      written: the cache after this layer's writes (or only the arrays written).
      layer_stop: int32 scalar (or int), one past the last written global layer.
      next_input: the next layer's input (pytree of arrays, e.g. hidden states).
      layer_start: with rows: the first global layer this call announces (its rows go
        to the callback); default ``layer_stop - 1``, one layer per call. Pass it (with a
        Python int `layer_stop`) when announcing several layers at once.

    Returns:
      ``(next_input, status)``: the same values, data dependent on the callback; status as
      `publish_in_jit` returns it.

    Raises:
      NotImplementedError: a multi-controller engine.
      ValueError: (host staging) a `layer_start` outside ``[first layer of the cache,
        layer_stop)``, a `layer_stop` past the cache's last layer, or a `layer_start` with a
        traced `layer_stop`.

    Example:
      >>> for layer in range(num_layers):  # doctest: +SKIP
      ...     x, cache = layer_fn(layer, x, cache)
      ...     x, ok = publish_layer_in_jit(engine, handle, ids, cache, layer + 1, x)
    """
    if _coordination_of(engine) is not None:
        raise NotImplementedError(
            "publish_layer_in_jit on a multi-controller engine: announce the whole request "
            "with publish_in_jit after the step, or publish_layers outside jit")
    rows = _announced_rows(engine, block_ids, written, layer_start, layer_stop)
    if rows is None:
        status = _publish(engine, handle, block_ids, written, layer_stop)
    else:
        start, parts, mesh = rows
        status = _publish_rows(engine, handle, block_ids, layer_stop, start, parts, mesh)
    return after_callback(next_input, status), status


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _announced_rows(
    engine: Any, block_ids: Any, written: Any, layer_start: int | None, layer_stop: Any
) -> tuple[Any, list[Any], Any] | None:
    """Host staging, or a transport that takes layer rows (the JAX transport): ``(first
    global layer (an int, or an int32 scalar for a traced stop), per array of `written` its
    request rows of the announced layers as unsigned ints, or None, the cache's mesh (None:
    one device))`` for the announcement's callback, or None when the engine needs no rows or
    they cannot be taken (then the layers are served from the step's output, warned)."""
    import jax
    import jax.numpy as jnp

    span_of = getattr(engine, "_layer_rows_span", None)
    span = span_of(written) if span_of is not None else None
    if span is None:  # not host-staged
        return None
    if span[2]:
        _log.warning("publish_layer_in_jit: %s, so the layers reach the host mirror (host "
                     "staging) or the JAX transport only after the step", span[2])
        return None
    axes = written.spec.block_axes()
    axis = axes.index("L") if "L" in axes else None
    traced = not _is_int(layer_stop)
    if traced:
        # A loop over layers (scan / fori_loop): one layer per call, cross-layer arrays only
        # (an array per layer cannot be picked by a traced index without touching them all).
        if layer_start is not None:
            raise ValueError("publish_layer_in_jit: layer_start needs a Python int layer_stop "
                             "(a traced layer_stop announces one layer per call)")
        if axis is None:
            _log.warning("publish_layer_in_jit: a traced layer_stop and a layout with an array "
                         "per layer, so the layers reach the host mirror (host staging) or "
                         "the JAX transport only after the step (pass a Python int, or use a "
                         "layout with L)")
            return None
        start: Any = jnp.asarray(layer_stop, jnp.int32).reshape(()) - 1
        lo: Any = start - span[0]
        hi: Any = None
    else:
        stop = int(layer_stop)
        start = stop - 1 if layer_start is None else int(layer_start)
        if not span[0] <= start < stop <= span[1]:
            raise ValueError(
                f"publish_layer_in_jit: layers [{start}, {stop}) are not layers of the "
                f"registered cache ([{span[0]}, {span[1]}))")
        lo, hi = start - span[0], stop - span[0]
    ids = jnp.maximum(jnp.asarray(block_ids, jnp.int32).reshape(-1), 0)  # -1: padding rows
    sharding = getattr(written, "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    rows: list[Any] = []
    for (layer, _), array in zip(written.array_keys, written.arrays):
        if layer is None and axis is not None and traced:
            # one gather of the request's rows of layer `lo` (the L axis kept, 1 long)
            part = array[(ids,) + tuple(lo if a == axis else slice(None)
                                        for a in range(len(axes)))]
            part = jnp.expand_dims(part, 1 + axis)
        elif layer is None and axis is not None:  # only these layers of a cross-layer array
            part = array[(ids,) + tuple(slice(lo, hi) if a == axis else slice(None)
                                        for a in range(len(axes)))]
        elif layer is not None and lo <= layer < hi:
            part = array[ids]
        else:
            rows.append(None)
            continue
        width = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[part.dtype.itemsize]
        part = jax.lax.bitcast_convert_type(part, width)  # bits as they are
        if mesh is not None and mesh.size > 1:
            # The callback runs on one device: gather the (head-sharded) rows explicitly,
            # rather than leave SPMD to rematerialise them (it warns).
            part = jax.lax.with_sharding_constraint(
                part, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
        rows.append(part)
    return start, rows, mesh


def _publish_rows_callback(engine: Any, present: tuple[bool, ...], handle, block_ids,
                           layer_stop, start, *parts) -> np.int32:
    it = iter(parts)
    rows = [np.asarray(next(it)) if here else None for here in present]
    return np.int32(engine._callback_publish(int(handle), np.asarray(block_ids),
                                             int(layer_stop), (int(start), rows)))


def _publish_rows(engine: Any, handle: Any, block_ids: Any, layer_stop: Any, start: Any,
                  rows: list[Any], mesh: Any = None) -> Any:
    """The publishing callback with the announced layers' rows as operands: they depend on
    the layers' writes, so the callback runs after them (no token needed). `mesh`: the
    cache's mesh (the rows are replicated over it)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import io_callback

    present = tuple(r is not None for r in rows)
    callback = functools.partial(_publish_rows_callback, engine, present)
    operands = (jnp.asarray(handle, jnp.int32).reshape(()),
                jnp.asarray(block_ids, jnp.int32).reshape(-1),
                jnp.asarray(layer_stop, jnp.int32).reshape(()),
                jnp.asarray(start, jnp.int32).reshape(()),
                *[r for r in rows if r is not None])
    if _on_cpu(mesh):
        return _cpu_callback(callback, operands, mesh)
    return io_callback(callback, jax.ShapeDtypeStruct((), jnp.int32), *operands)


def _on_cpu(mesh: Any) -> bool:
    """Whether the step runs on CPU devices (the mesh's, else the default backend's): the
    one place that picks the rows callback's kind (`_cpu_callback` there), and whether the
    JAX transport takes rows at all (`KVTransferEngine._layer_rows_span`)."""
    import jax

    devices = getattr(mesh, "devices", None)
    if devices is not None:
        return all(d.platform == "cpu" for d in np.asarray(devices).flat)
    return jax.default_backend() == "cpu"


def steps_hold_buffers(cache: Any) -> bool:
    """Whether `cache` spans several XLA:CPU devices: there a `jax.experimental.transfer`
    pull (and any array made for one) of those devices waits for the step that runs on them
    (measured: a one-device step lets the JAX transport's pulls through, a step over two
    devices does not; a device outside the step's mesh is served during it)."""
    mesh = cache.sharding.mesh
    return mesh.size > 1 and _on_cpu(mesh)


def _cpu_callback(callback: Any, operands: tuple[Any, ...], mesh: Any) -> Any:
    """``callback(*numpy operands) -> int`` run once per step on CPU, its operands handed
    over without a copy (`jax.experimental.buffer_callback`).

    Why not `io_callback` there: it first copies its operands into new CPU arrays
    (`device_put`), a copy XLA:CPU runs on the client's thread pool for large operands (a
    layer's rows), and a multi-device step can hold every thread of that pool (a partition
    waits in a collective for the partition that runs the callback): the step then never
    finishes (seen with a TP 2 step on 2 cores). Under a mesh of several devices the rows
    are replicated and the callback would run on each device: it runs inside `shard_map` and
    only the first device calls `callback` (the others return 1)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental.buffer_callback import buffer_callback

    def run(ctx: Any, out: Any, first: Any, *args: Any) -> None:
        del ctx
        status = callback(*(np.asarray(a) for a in args)) if bool(np.asarray(first)) else 1
        np.asarray(out)[...] = np.int32(status)

    call = buffer_callback(run, jax.ShapeDtypeStruct((), jnp.int32))
    if mesh is None or mesh.size == 1:
        return call(jnp.bool_(True), *operands)
    from jax.sharding import PartitionSpec

    names = tuple(mesh.axis_names)

    def per_device(*args: Any) -> Any:
        return call(jax.lax.axis_index(names) == 0, *args)

    replicated = (PartitionSpec(),) * len(operands)
    return jax.shard_map(per_device, mesh=mesh, in_specs=replicated,
                         out_specs=PartitionSpec(), check_vma=False)(*operands)


def wait_in_jit(
    engine: Any, handle: Any, block_ids: Any, timeout_s: float = 30.0, cache: Any = None
) -> tuple[Any, Any]:
    """Waits inside a jitted step until a request's blocks arrived (call inside `jax.jit`).

    The read must have been started outside jit (`TransferEngine.start_read`); the callback
    drives the engine (no JAX inside it) until the request finished, failed or `timeout_s`
    passed. Requests that need JAX work after their reads (layout / block-size
    post-processing, host staging) cannot finish inside a callback: the status says so and
    the caller falls back to `poll` outside jit.

    Args:
      engine: the consumer `TransferEngine` (closed over).
      handle: int32 scalar, the request's `TransferEngine.handle`.
      block_ids: int32 ``[n]`` local block ids the step reads the received blocks with.
      timeout_s: the longest the callback blocks.
      cache: multi-controller engines only: the registered `PagedKVCache` (its mesh places
        one callback per device; each device waits for its own process's part).

    Returns:
      ``(block_ids, status)``: the ids to read with (data dependent on the wait, so every op
      using them runs after it; all ``-1``, i.e. skipped, unless the request finished), and
      an int32 scalar: 1 finished, 0 failed (blocks invalid), -1 timed out, -2 needs `poll`
      outside jit. Finished / failed requests are also reported by the next `poll`.
      Multi-controller engines: sharded over the cache's mesh, ids ``[devices, n]`` and
      status ``[devices]`` (row ``d`` for device ``d``: use it inside the step's
      ``shard_map``).

    Example:
      >>> @functools.partial(jax.jit, donate_argnums=0)  # doctest: +SKIP
      ... def decode(cache, ids, handle):
      ...     ids, status = wait_in_jit(engine, handle, ids)
      ...     return cache, cache.gather_blocks(ids), status
    """
    import jax
    import jax.numpy as jnp
    from jax.experimental import io_callback

    processes = _coordination_of(engine)
    if processes is not None:
        if cache is None:
            raise ValueError("wait_in_jit on a multi-controller engine needs the registered "
                             "cache (its mesh places the per-device callbacks)")
        return processes.wait_in_jit(handle, block_ids, cache, timeout_s)
    handle = jnp.asarray(handle, jnp.int32).reshape(())
    ids = jnp.asarray(block_ids, jnp.int32).reshape(-1)
    status = io_callback(
        functools.partial(_wait_callback, engine, float(timeout_s)),
        jax.ShapeDtypeStruct((), jnp.int32),
        handle,
    )
    return jnp.where(status == 1, ids, -1), status


class HandleTable:
    """Small positive ints naming request ids inside jitted code (host callbacks carry ids,
    not strings); at most `capacity` are remembered (the oldest forgotten first).

    Example:
      >>> table = HandleTable()
      >>> h = table.handle("req-1")
      >>> (h, table.handle("req-1"), table.get(h), table.get(h + 1))
      (1, 1, 'req-1', None)
    """

    def __init__(self, capacity: int = 1 << 16):
        self._capacity = capacity
        self._requests: dict[int, str] = {}
        self._handles: dict[str, int] = {}
        self._next = 1

    def handle(self, request_id: str) -> int:
        """The handle of `request_id` (a new one the first time)."""
        handle = self._handles.get(request_id)
        if handle is None:
            handle = self._next
            self._next = self._next % ((1 << 31) - 2) + 1
            old = self._requests.pop(handle, None)
            if old is not None:
                self._handles.pop(old, None)
            self._requests[handle] = request_id
            self._handles[request_id] = handle
            while len(self._requests) > self._capacity:
                oldest = next(iter(self._requests))
                self._handles.pop(self._requests.pop(oldest), None)
        return handle

    def get(self, handle: int) -> str | None:
        """The request id of `handle`, or None."""
        return self._requests.get(int(handle))

    def __getitem__(self, handle: int) -> str:
        return self._requests[int(handle)]

