"""A producer process whose jitted prefill announces layers from inside the step, with the
controls the layer-wise failure tests need (not a test module): announcing only some layers,
several layers per announcement (`publish_layer_in_jit`'s ``layer_start``), and a gate that
holds the step after a given layer's announcement until the test lets it go (so that a test
can kill the producer or abort the request between two layers, deterministically).

The values written are those of `support.transfer.make_layered_prefill_step` (layer k's part
of array i: `slow_values` with seed `layer_seed(seed, k, i)`), so
`support.transfer.expected_layer_values` is the reference.
"""

from __future__ import annotations

import functools
import threading
import time

import numpy as np

from support import transfer as tt


def make_gated_step(engine, iters, announce=None, group=1, gate_after=None, gate=None,
                    gate_s=60.0):
    """A jitted prefill over every layer of the cache (the writes of
    `tt.make_layered_prefill_step`); after layers ``group - 1, 2 * group - 1, ...`` it
    announces the layers written so far with `publish_layer_in_jit` (``layer_start``: the
    group's first), only those below `announce` (None: all). With `gate_after` = k, after the
    announcement of layer k the step waits (a host callback, threaded into the next layer)
    until `gate` (a `threading.Event`) is set or `gate_s` passed. Returns the jitted step
    ``(cache, ids, handle, seed) -> (cache, statuses of the announcements)``."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import io_callback

    from jaxkv.transfer import after_callback, publish_layer_in_jit

    def wait(_):
        return np.int32(1 if gate.wait(gate_s) else 0)

    @functools.partial(jax.jit, donate_argnums=0)
    def prefill(cache, ids, handle, seed):
        spec = cache.spec
        x = jnp.asarray(seed, jnp.uint32)
        statuses = []
        for layer in range(spec.num_layers):
            arrays = list(cache.arrays)
            for index, ((key_layer, _), array) in enumerate(zip(cache.array_keys, arrays)):
                if key_layer is not None and key_layer != layer:
                    continue
                shape = tt.layer_part_shape(spec, array.shape, key_layer, ids.shape[0])
                values = jax.lax.bitcast_convert_type(
                    tt.slow_values(shape, x + jnp.uint32(16 * layer + index), iters), array.dtype)
                if key_layer is None:
                    where = (ids, *([slice(None)] * spec.layout.index("L")), layer)
                else:
                    where = (ids,)
                arrays[index] = array.at[where].set(values)
            cache = jax.tree.unflatten(jax.tree.structure(cache), arrays)
            stop = layer + 1
            boundary = stop % group == 0 or stop == spec.num_layers
            if boundary and (announce is None or stop <= announce):
                start = ((stop - 1) // group) * group
                x, status = publish_layer_in_jit(engine, handle, ids, cache, stop, x,
                                                 layer_start=start)
                statuses.append(status)
            if gate_after is not None and layer == gate_after:
                opened = io_callback(wait, jax.ShapeDtypeStruct((), jnp.int32), x)
                x = after_callback(x, opened)
        return cache, jnp.stack(statuses)

    return prefill


def gated_producer_main(conn, spec_kwargs: dict, tp: int, num_blocks: int, iters: int,
                        engine_kwargs=None, announce=None, group=1, gate_after=None) -> None:
    """A producer process running `make_gated_step`:
    ("pin", request_id, block_ids) -> (params, handle);
    ("prefill", handle, ids, seed) -> (statuses, wall time at dispatch, wall time at its end);
    ("prefill_abort", request_id, handle, ids, seed, layers) -> the same, the request aborted
    once `layers` layers were published (the gate holds the step there; it opens after the
    abort); ("publish", request_id, stop) -> `publish_layers` outside jit (None);
    ("published", request_id) -> `published_layers`; ("publications",) -> the PublishRecords;
    ("state",) -> (pinned, freed); ("warm",) -> a donated in-place update of the cache handed
    to `update_cache` (None). The gate waits at most 60 s."""
    gate = threading.Event()

    def handle(engine, prefill, command, freed):
        if command[0] in ("prefill", "prefill_abort"):
            if command[0] == "prefill":
                _, handle_id, ids, seed = command
            else:
                _, request_id, handle_id, ids, seed, layers = command
            gate.clear()
            args = (engine.caches[0], ids, np.int32(handle_id), np.uint32(seed))
            step = prefill.lower(*args).compile()  # not timed
            start = time.time()
            out: list = []
            # On a thread: a step with host callbacks may run in the calling thread (CPU).
            runner = threading.Thread(target=lambda: out.append(step(*args)))
            runner.start()
            if command[0] == "prefill_abort":
                deadline = time.monotonic() + 60.0
                while (engine.published_layers(request_id) or 0) < layers:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{request_id}: {layers} layers never published")
                    time.sleep(0.001)
                engine.abort_request(request_id)
                gate.set()
            runner.join(timeout=120.0)
            if not out:
                raise TimeoutError("the step did not return")
            cache, statuses = out[0]
            engine.update_cache(cache)
            conn.send((np.asarray(statuses).tolist(), start, time.time()))
        elif command[0] == "warm":  # a donated in-place update (a step before the test's)
            import jax

            engine.update_cache(jax.jit(lambda c: c, donate_argnums=0)(engine.caches[0]))
            conn.send(None)
        elif command[0] == "publish":
            engine.publish_layers(command[1], command[2])
            conn.send(None)
        elif command[0] == "published":
            conn.send(engine.published_layers(command[1]))
        elif command[0] == "publications":
            conn.send(list(engine.stats.publications))
        else:
            return False
        return True

    make = functools.partial(make_gated_step, iters=iters, announce=announce, group=group,
                             gate_after=gate_after, gate=gate)
    tt._jitted_producer_loop(conn, spec_kwargs, tp, num_blocks, engine_kwargs,
                             lambda engine: make(engine), handle,
                             lambda engine, freed: (engine.num_pinned, list(freed)))


def make_loop_step(engine, iters):
    """`tt.make_layered_prefill_step`'s writes and announcements (one per layer), as a
    `jax.lax.fori_loop` over the layers of a cache with an L axis (the layer index traced, as
    in a scanned model). Returns the jitted step ``(cache, ids, handle, seed) -> (cache,
    statuses)``."""
    import jax
    import jax.numpy as jnp

    from jaxkv.transfer import publish_layer_in_jit

    @functools.partial(jax.jit, donate_argnums=0)
    def prefill(cache, ids, handle, seed):
        spec = cache.spec
        axis = spec.layout.index("L")
        structure = jax.tree.structure(cache)

        def body(layer, carry):
            arrays, x, statuses = carry
            arrays = list(arrays)
            for index, array in enumerate(arrays):
                shape = tt.layer_part_shape(spec, array.shape, None, ids.shape[0])
                seed_k = x + jnp.uint32(16) * layer.astype(jnp.uint32) + jnp.uint32(index)
                values = jax.lax.bitcast_convert_type(
                    tt.slow_values(shape, seed_k, iters), array.dtype)
                arrays[index] = array.at[(ids, *([slice(None)] * axis), layer)].set(values)
            cache = jax.tree.unflatten(structure, arrays)
            x, status = publish_layer_in_jit(engine, handle, ids, cache, layer + 1, x)
            return tuple(cache.arrays), x, statuses.at[layer].set(status)

        arrays, _, statuses = jax.lax.fori_loop(
            0, spec.num_layers, body,
            (tuple(cache.arrays), jnp.asarray(seed, jnp.uint32),
             jnp.zeros(spec.num_layers, jnp.int32)))
        return jax.tree.unflatten(structure, list(arrays)), statuses

    return prefill


def loop_producer_main(conn, spec_kwargs: dict, tp: int, num_blocks: int, iters: int,
                       engine_kwargs=None) -> None:
    """A producer process running `make_loop_step`: ("pin", request_id, block_ids) ->
    (params, handle); ("prefill", handle, ids, seed) -> (statuses, wall time at dispatch,
    wall time once the step finished); ("publications",) -> the PublishRecords; ("state",) ->
    (pinned, freed)."""
    def handle(engine, prefill, command, freed):
        if command[0] == "publications":
            conn.send(list(engine.stats.publications))
            return True
        if command[0] != "prefill":
            return False
        _, handle_id, ids, seed = command
        args = (engine.caches[0], ids, np.int32(handle_id), np.uint32(seed))
        step = prefill.lower(*args).compile()  # not timed
        start = time.time()
        cache, statuses = step(*args)
        engine.update_cache(cache)
        conn.send((np.asarray(statuses).tolist(), start, time.time()))
        return True

    tt._jitted_producer_loop(conn, spec_kwargs, tp, num_blocks, engine_kwargs,
                             lambda engine: make_loop_step(engine, iters), handle,
                             lambda engine, freed: (engine.num_pinned, list(freed)))
