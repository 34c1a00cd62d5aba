"""Helpers for the multi-controller tests (not a test module): a group of processes that form
one JAX program (``jax.distributed`` on localhost, gloo collectives on CPU), each driven by
commands over a pipe."""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any

import numpy as np

from jaxkv import EngineConfig, KVCacheSpec
from support import bits, processes
from support import transfer as tt

WAIT_S = 90.0


def worker_main(conn, process_id: int, num_processes: int, port: int, devices: int) -> None:
    """One process of a multi-controller group. Commands (each answered once):

    ("producer", name, spec_kwargs, tp, pp, block_ids): the engine `name` over the global mesh
      (pp == 1: the cache's heads over all devices of all processes; pp > 1: pipeline rank =
      process id, TP over this process's devices), filled from G with the request's tokens in
      `block_ids` and random bits elsewhere; answers the merged-metadata address.
    ("consumer", name, spec_kwargs, tp[, engine_kwargs]): a zeroed cache over the global mesh.
    The producer's optional 7th and 8th items: scrambled (the request's blocks hold other
    bytes until written: "jit_publish"), engine_kwargs (`KVTransferEngine` options).
    ("publish", name, request_id, block_ids or None, lease_s): process 0 gets the block ids and
      broadcasts them (`broadcast_block_ids`), every process publishes; answers the params.
    ("jit_publish", name, request_id, block_ids or None, lease_s): as "publish", layer-wise,
      then a jitted step writes the blocks and publishes them from inside (`statuses`).
    ("read", name, params, local_ids, timeout_s): `start_read` in every process.
    ("cache_ops", spec_kwargs): `PagedKVCache` ops over the global mesh, checked per shard.
    ("reregister", name): re-registers the cache and re-publishes the metadata: answers
      (merged generation, this process's generation).
    ("jit_wait", name, params, local_ids, timeout_s): `start_read`, then a jitted step waits
      for it per device: answers (each local device's ids row, each local device's status).
    ("abort", name, request_id): `abort_request` (in this process: spreads to the others).
    ("outcomes", name): (local outcomes, engine-level outcomes, num_pinned) seen so far.
    ("shards", name): this process's cache shards: [(array index, index, bytes)].
    ("exit",)
    Between commands every engine is polled (`TransferEngine.poll`).
    """
    processes.child_env(devices)
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        f"127.0.0.1:{port}", num_processes=num_processes, process_id=process_id
    )
    from jaxkv import PagedKVCache
    from jaxkv._placement import place_exactly
    from jaxkv.transfer import (
        JaxDistributed,
        StepChannel,
        TransferEngine,
        broadcast_block_ids,
    )

    engines: dict[str, Any] = {}
    good: dict[str, list] = {}
    statuses: dict[str, list] = {}
    caches: dict[str, Any] = {}
    local: dict[str, dict[str, list]] = {}
    level: dict[str, dict[str, list]] = {}
    channel = StepChannel("scheduler", timeout_s=WAIT_S)
    conn.send(("ready", process_id))
    kinds = ("finished", "failed", "freeable", "published")
    while True:
        if conn.poll(0.002):
            command = conn.recv()
            kind = command[0]
            if kind == "exit":
                break
            try:
                answer = None
                if kind in ("producer", "consumer"):
                    name, spec_kwargs, tp = command[1:4]
                    spec = KVCacheSpec(**spec_kwargs)
                    pp = command[4] if kind == "producer" else 1
                    config = EngineConfig(spec, tp, pp)
                    pp_rank = process_id if pp > 1 else 0
                    if pp > 1:
                        mesh = jax.sharding.Mesh(np.array(jax.local_devices()), ("tp",))
                    else:
                        mesh = jax.make_mesh((jax.device_count(),), ("tp",))
                    local_spec = config.local_spec(pp_rank)
                    if kind == "producer":
                        g = tt.global_cache(spec, len(command[5]) * spec.block_size, tt.G_SEED)
                        arrays = tt.global_arrays(config, pp_rank, g, command[5], tt.NUM_BLOCKS)
                        good[name] = arrays
                        if len(command) > 6 and command[6]:  # not written yet: scrambled
                            arrays = tt.layer_mix(local_spec, arrays, command[5], 0, 0)
                        cache = PagedKVCache.from_arrays(local_spec, arrays, mesh=mesh)
                    else:
                        cache = PagedKVCache.allocate(local_spec, tt.NUM_BLOCKS, mesh=mesh)
                    options = command[7] if kind == "producer" and len(command) > 7 else (
                        command[4] if kind == "consumer" and len(command) > 4 else {})
                    mc = TransferEngine(name, config, lease_s=30.0,
                                        coordinator=JaxDistributed(timeout_s=WAIT_S), **options)
                    mc.register_cache(cache, pp_rank=pp_rank)
                    mc.publish_metadata()
                    engines[name], caches[name] = mc, cache
                    local[name] = {k: [] for k in kinds}
                    level[name] = {k: [] for k in kinds}
                    answer = (
                        mc.address,
                        mc.local_ranks,
                        [(b.tp_rank, b.head_start, b.head_stop, b.process_index)
                         for b in cache.shard_buffers()],
                    )
                elif kind == "publish":
                    name, request_id, block_ids, lease = command[1:5]
                    ids = broadcast_block_ids(
                        channel, {request_id: block_ids} if process_id == 0 else None
                    )
                    answer = engines[name].publish_request(request_id, ids[request_id], lease)
                elif kind == "jit_publish":
                    # The scheduler broadcasts the ids; every process pins the request
                    # (layer-wise), then a jitted step over the global mesh writes its blocks
                    # and publishes them from inside (a callback in every process).
                    name, request_id, block_ids, lease = command[1:5]
                    mc = engines[name]
                    ids = broadcast_block_ids(
                        channel, {request_id: block_ids} if process_id == 0 else None
                    )[request_id]
                    answer = mc.publish_request(request_id, ids, lease, layerwise=True)
                    handle = mc.handle(request_id)
                    cache = mc.caches[0]
                    named = cache.sharding.named_sharding(cache.spec)
                    whole = jax.sharding.NamedSharding(named.mesh, jax.sharding.PartitionSpec())
                    dense = tuple(place_exactly(a[ids], named) for a in good[name])
                    step = jax.jit(_write_and_publish, static_argnums=0, donate_argnums=1)
                    cache, status = step(
                        mc, cache, dense, place_exactly(ids, whole),
                        place_exactly(np.int32(handle), whole),
                    )
                    mc.update_cache(cache)
                    statuses[name] = [int(np.asarray(s.data)[0]) for s in status.addressable_shards]
                elif kind == "cache_ops":
                    answer = _cache_ops(jax, PagedKVCache, command[1])
                elif kind == "reregister":  # every process: re-register, re-publish
                    mc = engines[command[1]]
                    mc.register_cache(mc.caches[0])
                    answer = (mc.publish_metadata()["kv"].generation, mc.generation)
                elif kind == "jit_wait":  # start the read, then wait inside a jitted step
                    name, params, local_ids, timeout = command[1:5]
                    mc = engines[name]
                    mc.start_read(params, local_ids, timeout)
                    cache = mc.caches[0]
                    named = cache.sharding.named_sharding(cache.spec)
                    whole = jax.sharding.NamedSharding(named.mesh, jax.sharding.PartitionSpec())
                    step = jax.jit(_wait, static_argnums=(0, 1))
                    ids, status = step(
                        mc, cache, place_exactly(np.int32(mc.handle(params.request_id)), whole),
                        place_exactly(np.asarray(local_ids, np.int32), whole),
                    )
                    answer = (
                        [np.asarray(s.data).tolist() for s in ids.addressable_shards],
                        [int(np.asarray(s.data)[0]) for s in status.addressable_shards],
                    )
                elif kind == "abort":
                    engines[command[1]].abort_request(command[2])
                elif kind == "statuses":
                    answer = statuses.get(command[1])
                elif kind == "read":
                    name, params, local_ids, timeout = command[1:5]
                    engines[name].start_read(params, local_ids, timeout)
                elif kind == "outcomes":
                    name = command[1]
                    answer = (local[name], level[name], engines[name].num_pinned)
                elif kind == "shards":
                    cache = engines[command[1]].caches[0]
                    answer = [
                        (index, shard.index, np.asarray(shard.data))
                        for index, array in enumerate(cache.arrays)
                        for shard in array.addressable_shards
                    ]
                conn.send(("ok", answer))
            except Exception as error:  # noqa: BLE001 - reported to the test
                conn.send(("error", f"{type(error).__name__}: {error}"))
        for name, mc in engines.items():
            result = mc.poll()
            for k in ("finished", "failed", "freeable"):
                local[name][k] += getattr(result.local, k)
            for k in kinds:
                level[name][k] += getattr(result, k)
    for mc in engines.values():
        mc.close()
    conn.send(("bye", process_id))
    conn.close()
    # No jax.distributed shutdown barrier: a group whose other process was killed must exit.
    os._exit(0)


def _cache_ops(jax, cache_class, spec_kwargs: dict) -> dict:
    """A cache over the global mesh in every process: wrap, copy, gather and scatter run on
    this process's shards only; each addressable shard is compared with numpy. Returns what
    this process saw (its shards' TP ranks and the mismatches found)."""
    spec = KVCacheSpec(**spec_kwargs)
    mesh = jax.make_mesh((jax.device_count(),), ("tp",))
    rng = np.random.default_rng(5)
    shape = (tt.NUM_BLOCKS, *spec.global_block_shape(jax.device_count()))
    host = [bits.random_bits(rng, shape, spec.dtype) for _ in range(spec.num_arrays)]
    cache = cache_class.from_arrays(spec, host, mesh=mesh)
    wrapped = cache_class.wrap(cache.arrays, spec, mesh)
    problems = []
    if any(a is not b for a, b in zip(wrapped.arrays, cache.arrays)):
        problems.append("wrap copied")
    src, dst = [1, 2, 3], [9, 10, 11]
    cache = wrapped.copy_blocks(src, dst)
    gathered = cache.gather_blocks([9, 0, 11])
    expected = [h.copy() for h in host]
    for e in expected:
        e[dst] = e[src]
    dense = [e[[9, 0, 11]] for e in expected]
    cache = cache.scatter_blocks([d[::-1].copy() for d in dense], [4, 5, 6])
    for e, d in zip(expected, dense):
        e[[4, 5, 6]] = d[::-1]

    def compare(name, arrays, wants):
        for index, (array, want) in enumerate(zip(arrays, wants)):
            for shard in array.addressable_shards:
                got = np.asarray(shard.data)
                if not np.array_equal(got.view(np.uint8), want[shard.index].view(np.uint8)):
                    problems.append(f"{name} array {index} shard {shard.index}")

    compare("cache", cache.arrays, expected)
    compare("gather", gathered, dense)
    return {
        "problems": problems,
        "tp_ranks": sorted({b.tp_rank for b in cache.shard_buffers()}),
        "processes": sorted({b.process_index for b in cache.shard_buffers()}),
    }


def _wait(engine, cache, handle, ids):
    from jaxkv.transfer import wait_in_jit

    return wait_in_jit(engine, handle, ids, timeout_s=60.0, cache=cache)


def _write_and_publish(engine, cache, dense, ids, handle):
    from jaxkv.transfer import publish_in_jit

    cache = cache.scatter_blocks(dense, ids)
    return cache, publish_in_jit(engine, handle, ids, cache)


class Group:
    """`num_processes` spawned processes forming one ``jax.distributed`` job."""

    def __init__(self, num_processes: int, devices: int):
        port = processes.free_port()
        self.conns, self.processes = [], []
        for pid in range(num_processes):
            process, parent = processes.spawn(worker_main, pid, num_processes, port, devices)
            self.conns.append(parent)
            self.processes.append(process)
        for conn in self.conns:
            if not conn.poll(WAIT_S):
                raise TimeoutError("a worker did not start")
            conn.recv()

    def call(self, *command, only: int | None = None, timeout: float = WAIT_S) -> list:
        """Sends `command` to every process (or only `only`); returns their answers."""
        targets = range(len(self.conns)) if only is None else [only]
        for i in targets:
            self.conns[i].send(command)
        answers = []
        for i in targets:
            if not self.conns[i].poll(timeout):
                raise TimeoutError(f"process {i} did not answer {command[0]!r}")
            status, answer = self.conns[i].recv()
            if status != "ok":
                raise RuntimeError(f"process {i}: {answer}")
            answers.append(answer)
        return answers

    def publish(
        self, name: str, request_id: str, block_ids, lease_s: float, command: str = "publish"
    ) -> Any:
        """Publishes a request in every process: only process 0 (the scheduler) is given the
        block ids, the others receive them through the step broadcast. Returns the params.
        `command`: "publish", or "jit_publish" (from inside a jitted step)."""
        for pid, conn in enumerate(self.conns):
            conn.send((command, name, request_id, block_ids if pid == 0 else None, lease_s))
        answers = [self.receive(pid) for pid in range(len(self.conns))]
        if any(a != answers[0] for a in answers):
            raise AssertionError(f"the processes returned different params: {answers}")
        return answers[0]

    def send(self, *command, only: int) -> None:
        self.conns[only].send(command)

    def receive(self, only: int, timeout: float = WAIT_S) -> Any:
        if not self.conns[only].poll(timeout):
            raise TimeoutError(f"process {only} did not answer")
        status, answer = self.conns[only].recv()
        if status != "ok":
            raise RuntimeError(f"process {only}: {answer}")
        return answer

    def wait_level(self, name: str, kind: str, request_id: str, timeout: float = WAIT_S):
        """Polls process 0's engine-level outcomes until `request_id` shows up in `kind`."""
        deadline = time.monotonic() + timeout
        while True:
            _, level, _ = self.call("outcomes", name, only=0)[0]
            found = [x for x in level[kind]
                     if (x.request_id if kind == "failed" else x) == request_id]
            if found or time.monotonic() > deadline:
                return found, level
            time.sleep(0.05)

    def kill(self, pid: int) -> None:
        self.processes[pid].kill()
        self.processes[pid].join(timeout=10)

    def close(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError, BrokenPipeError):
                conn.send(("exit",))
        for process in self.processes:
            process.join(timeout=20)
            if process.is_alive():
                process.kill()
                process.join(timeout=5)
        for conn in self.conns:
            conn.close()
