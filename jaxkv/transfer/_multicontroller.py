"""Multi-controller engines: one JAX program over several processes (``jax.distributed``).

Each process of such an engine owns only its addressable shards of the global cache. It runs
its own `KVTransferEngine` (its own NIXL agent) that registers those shards under the
engine's id; `MultiControllerEngine` wraps that engine in every process and coordinates the
processes through ``jax.distributed``'s key-value store (the coordination service every
multi-controller JAX job already runs):

* metadata: every process puts its part (its ranks, regions and agent) in the store;
  process 0 merges the parts (one engine id, one generation that every process adopts) and
  serves the merge from one side-channel address, which any consumer uses as usual
  (`TransferParams.addresses`);
* producer requests: every process pins its part (`publish_request`, or the in-jit callback
  of its own step); process 0 hands out the params once every process published, reports a
  request freeable once every process freed its part, and an abort (or a process's failure
  to publish) aborts the request in every process;
* consumer reads: every process reads its ranks (`start_read` with the same read id);
  process 0 reports a read finished once every process finished it (`WorkerAggregator`);
  when one process fails it, the others are aborted (the blocks are invalid anyway) and the
  read is reported failed once every process ended it, with every process's invalid blocks;
* `StepChannel`: the scheduler (block manager) runs on process 0 and broadcasts each step's
  block ids to the other processes.

Why the key-value store rather than side-channel connections between the processes: it
exists in every ``jax.distributed`` job (no extra listener, address or port to hand around),
its blocking gets have timeouts, and it is the runtime's own, reachable exactly by the
processes of the job. The parts are small (a few KiB per process) and exchanged only at
(re-)registration; per request the store carries a few bytes per process.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import msgspec
import numpy as np

from jaxkv.transfer._auth import check_exposure
from jaxkv.transfer._consumer import merge_metadata
from jaxkv.transfer._engine import KVTransferEngine
from jaxkv.transfer._metadata import EngineMetadata, MetadataError, decode_metadata
from jaxkv.transfer._params import FailedRead, PollResult, TransferParams
from jaxkv.transfer._side_channel import MetadataServer
from jaxkv.transfer._stats import WorkerAggregator

__all__ = [
    "KeyValueClient",
    "MultiControllerEngine",
    "MultiControllerPollResult",
    "StepChannel",
    "broadcast_block_ids",
    "distributed_client",
]


class KeyValueClient(Protocol):
    """The part of ``jax.distributed``'s client (`distributed_client`) used here."""

    def key_value_set_bytes(self, key: str, value: bytes, allow_overwrite: bool = ...) -> None:
        ...

    def blocking_key_value_get_bytes(self, key: str, timeout_in_ms: int) -> bytes:
        ...

    def key_value_try_get_bytes(self, key: str) -> bytes:
        ...

    def key_value_dir_get_bytes(self, key: str) -> list[tuple[str, bytes]]:
        ...

    def key_value_delete(self, key: str) -> None:
        """Deletes `key` and every key under the directory ``key/``."""
        ...


def distributed_client() -> KeyValueClient:
    """The ``jax.distributed`` client of this process (its key-value store).

    Raises:
      RuntimeError: ``jax.distributed.initialize`` was not called.
    """
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError(
            "jax.distributed is not initialized: call jax.distributed.initialize() in every "
            "process first"
        )
    return client


def _process_info(process_id: int | None, num_processes: int | None) -> tuple[int, int]:
    if process_id is None or num_processes is None:
        import jax

        process_id = jax.process_index() if process_id is None else process_id
        num_processes = jax.process_count() if num_processes is None else num_processes
    if not 0 <= process_id < num_processes:
        raise ValueError(f"process_id {process_id} is outside [0, {num_processes})")
    return int(process_id), int(num_processes)


def _key(text: str) -> str:
    """A request id as one key component (ids may hold '/')."""
    return text.encode().hex()


def _try_get(client: KeyValueClient, key: str) -> bytes | None:
    try:
        return client.key_value_try_get_bytes(key)
    except Exception:  # noqa: BLE001 - the binding raises (NOT_FOUND) for a missing key
        return None


def _get(client: KeyValueClient, key: str, timeout_s: float, what: str) -> bytes:
    try:
        return client.blocking_key_value_get_bytes(key, max(1, int(timeout_s * 1000)))
    except Exception as error:  # noqa: BLE001 - the binding's errors are untyped
        raise TimeoutError(f"{what}: nothing after {timeout_s:.1f}s ({error})") from error


class StepChannel:
    """Broadcasts each scheduler step's data (block ids) from process 0 to the other
    processes of a multi-controller engine, through ``jax.distributed``'s key-value store.

    The block manager and scheduler run on process 0; every process calls `broadcast` once
    per step, in the same order: process 0 with the step's data, the others with None, and
    all get process 0's data back. Values are msgpack-able (dicts, lists, ints, strings) or
    integer numpy arrays (which come back as int32 arrays). No device work: the devices stay
    free for the step itself. Process 0 deletes a step's key `window` steps later, so a
    process may lag up to `window` steps (processes of one JAX program run the same
    collective steps, so they never lag more than one or two).

    Args:
      name: the channel's name (unique in the job; e.g. the engine id).
      timeout_s: how long a receiving process waits for a step.
      window: steps kept in the store.
      client, process_id: for tests; default ``jax.distributed``'s client and process.

    Example:
      >>> channel = StepChannel("prefill")  # doctest: +SKIP
      >>> ids = channel.broadcast({"req-1": [3, 4]} if jax.process_index() == 0 else None)
    """

    def __init__(
        self,
        name: str,
        timeout_s: float = 60.0,
        window: int = 64,
        client: KeyValueClient | None = None,
        process_id: int | None = None,
    ):
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self._client = client if client is not None else distributed_client()
        self.process_id = _process_info(process_id, 1 << 30)[0]
        self._prefix = f"jaxkv/step/{_key(name)}"
        self.timeout_s = float(timeout_s)
        self.window = int(window)
        self.step = 0

    def broadcast(self, value: Any = None, timeout_s: float | None = None) -> Any:
        """Process 0: publishes `value` as this step's data and returns it (as the others
        get it). Others: waits for process 0's data of this step and returns it.

        Args:
          value: process 0's data (ignored elsewhere).
          timeout_s: the wait (default `timeout_s`; 0: do not wait); after a timeout the
            same step is waited for by the next call (a process may poll for steps).

        Raises:
          TimeoutError: process 0 did not publish this step in time.
          TypeError: `value` is not msgpack-able.
        """
        key = f"{self._prefix}/{self.step}"
        if self.process_id == 0:
            payload = _encode(value)
            self._client.key_value_set_bytes(key, payload)
            if self.step >= self.window:
                self._client.key_value_delete(f"{self._prefix}/{self.step - self.window}")
        else:
            wait = self.timeout_s if timeout_s is None else timeout_s
            if wait <= 0:  # a non-blocking look
                found = _try_get(self._client, key)
                if found is None:
                    raise TimeoutError(f"step {self.step} of {self._prefix} is not there yet")
                payload = found
            else:
                payload = _get(self._client, key, wait, f"step {self.step} of {self._prefix}")
        self.step += 1
        return _decode(payload)


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, np.ndarray) and np.issubdtype(obj.dtype, np.integer):
        values = np.asarray(obj, dtype=np.int64)
        if values.size and (values.min() < -(1 << 31) or values.max() >= 1 << 31):
            raise TypeError("integer arrays are broadcast as int32: a value is out of range")
        header = np.asarray([values.ndim, *values.shape], dtype="<u4").tobytes()
        return msgspec.msgpack.Ext(1, header + values.astype("<i4").tobytes())
    if isinstance(obj, np.integer):
        return int(obj)
    raise TypeError(f"cannot broadcast a {type(obj).__name__}")


def _ext_hook(code: int, data: memoryview) -> Any:
    if code != 1:
        raise ValueError(f"unknown extension {code}")
    raw = bytes(data)
    ndim = int(np.frombuffer(raw[:4], dtype="<u4")[0])
    shape = tuple(int(d) for d in np.frombuffer(raw[4 : 4 + 4 * ndim], dtype="<u4"))
    return np.frombuffer(raw[4 + 4 * ndim :], dtype="<i4").astype(np.int32).reshape(shape)


def _encode(value: Any) -> bytes:
    return msgspec.msgpack.encode(value, enc_hook=_enc_hook)


def _decode(payload: bytes) -> Any:
    return msgspec.msgpack.decode(payload, ext_hook=_ext_hook)


@dataclasses.dataclass
class MultiControllerPollResult:
    """What `MultiControllerEngine.poll` reports.

    Attributes:
      local: this process's own `PollResult` (its part of each request).
      finished: engine level (process 0 only): reads finished in every process.
      failed: engine level (process 0 only): reads failed in some process (aborted in the
        others); the invalid blocks of every process.
      freeable: engine level (process 0 only): producer requests every process freed.
      published: engine level (process 0 only): producer requests every process published
        completely (every layer: the in-jit path's callbacks ran in every process).
    """

    local: PollResult = dataclasses.field(default_factory=PollResult)
    finished: list[str] = dataclasses.field(default_factory=list)
    failed: list[FailedRead] = dataclasses.field(default_factory=list)
    freeable: list[str] = dataclasses.field(default_factory=list)
    published: list[str] = dataclasses.field(default_factory=list)


class MultiControllerEngine:
    """One process's part of a multi-controller engine's transfers (module docstring).

    Every process of the engine creates its `KVTransferEngine` (same engine id and config),
    registers its addressable shards (`register_cache` with a cache over the global mesh: only
    this process's TP ranks are registered), wraps it in a `MultiControllerEngine` and calls
    `publish_metadata` (a collective: every process, after every (re-)registration).
    Requests and reads then go through this object in every process, with the same ids.

    Args:
      engine: this process's engine.
      timeout_s: bound of every wait on other processes (metadata, publication).
      host, port: where process 0 serves the merged metadata (port 0: a free one), keyed
        with the engine's deployment key (`KVTransferEngine.deployment_key`) when it has one.
      allow_unauthenticated: serve a non-loopback `host` without a key (see
        `KVTransferEngine`); without it that is refused.
      store_interval_s: `poll` reads the key-value store (aborts from other processes; on
        process 0 their outcomes) at most this often: each read is a round trip to the
        coordination service. Writes are never delayed.
      client, process_id, num_processes: for tests; default ``jax.distributed``'s.

    Example:
      >>> mesh = jax.make_mesh((jax.device_count(),), ("tp",))  # doctest: +SKIP
      >>> cache = PagedKVCache.allocate(spec, 64, mesh=mesh)
      >>> engine = KVTransferEngine("prefill", EngineConfig(spec, jax.device_count()))
      >>> engine.register_cache(cache)  # this process's shards
      >>> mc = MultiControllerEngine(engine)
      >>> mc.publish_metadata()  # every process
      >>> params = mc.publish_request("req-1", [3, 4])  # every process; process 0 hands out
    """

    def __init__(
        self,
        engine: KVTransferEngine,
        *,
        timeout_s: float = 60.0,
        host: str = "127.0.0.1",
        port: int = 0,
        store_interval_s: float = 0.002,
        client: KeyValueClient | None = None,
        process_id: int | None = None,
        num_processes: int | None = None,
        allow_unauthenticated: bool = False,
    ):
        check_exposure(host, engine.deployment_key, allow_unauthenticated)
        self.engine = engine
        self.timeout_s = float(timeout_s)
        self.store_interval_s = float(store_interval_s)
        self._next_read = 0.0
        self._client = client if client is not None else distributed_client()
        self.process_id, self.num_processes = _process_info(process_id, num_processes)
        self._ns = f"jaxkv/mc/{_key(engine.engine_id)}"
        self._round = 0
        self._out_seq = 0
        self._pub_seq = 0
        self._server: MetadataServer | None = None
        self._merged: EngineMetadata | None = None
        self._address: tuple[str, int] | None = None
        if self.process_id == 0:
            self._server = MetadataServer(host, port, key=engine.deployment_key)
            self._address = self._server.address
        self._finished = WorkerAggregator(self.num_processes)
        self._freed = WorkerAggregator(self.num_processes)
        self._published: dict[str, set[int]] = {}  # request -> processes that published it
        self._failed: dict[str, FailedRead] = {}  # read id -> its failure, until all ended
        self._engine_level = MultiControllerPollResult()  # process 0: for the next poll
        self._pending_publish: set[str] = set()  # pinned here, not completely published yet
        self._aborted: set[str] = set()  # aborts already applied in this process
        self._closed = False
        self._jit_lock = threading.Lock()
        self._jit_seen: dict[tuple[int, int], set[int]] = {}  # in-jit: devices called back

    # -- metadata -------------------------------------------------------------------------

    @property
    def address(self) -> tuple[str, int]:
        """Where process 0 serves the engine's merged metadata (after `publish_metadata`)."""
        if self._address is None:
            raise RuntimeError("publish_metadata first")
        return self._address

    @property
    def metadata(self) -> EngineMetadata:
        """The merged metadata of the whole engine (after `publish_metadata`)."""
        if self._merged is None:
            raise RuntimeError("publish_metadata first")
        return self._merged

    def publish_metadata(self) -> EngineMetadata:
        """Collective (every process, after its `register_cache` calls, again after each
        re-registration): agrees on one generation, merges every process's part and serves the
        merge from process 0's address.

        Returns:
          The merged metadata.

        Raises:
          TimeoutError: a process did not take part within `timeout_s`.
          MetadataError: the parts do not make one complete engine (a rank nobody registered,
            processes that disagree on the engine description).
        """
        round_, self._round = self._round, self._round + 1
        base = f"{self._ns}/meta/{round_}"
        client = self._client
        if self.process_id == 0:
            generation = self.engine.generation
            if self._merged is not None:  # a new generation for every re-publication
                generation = max(generation, self._merged.generation + 1) & ((1 << 62) - 1)
            client.key_value_set_bytes(f"{base}/generation", str(generation).encode())
            host, port = self.address
            client.key_value_set_bytes(
                f"{self._ns}/address", f"{host}:{port}".encode(), allow_overwrite=True
            )
        else:
            generation = int(_get(client, f"{base}/generation", self.timeout_s, "generation"))
        self.engine.adopt_generation(generation)
        client.key_value_set_bytes(
            f"{base}/part/{self.process_id}", msgspec.msgpack.encode(self.engine.metadata)
        )
        if self.process_id == 0:
            parts = []
            for pid in range(self.num_processes):
                payload = _get(client, f"{base}/part/{pid}", self.timeout_s,
                               f"metadata of process {pid}")
                parts.append(decode_metadata(payload, self.engine.engine_id))
            merged = merge_metadata(parts)
            agents = [a.name for a in merged.agents]
            if len(set(agents)) != len(agents):
                raise MetadataError("two processes publish the same NIXL agent name")
            assert self._server is not None
            self._server.publish(merged)
            client.key_value_set_bytes(f"{base}/merged", msgspec.msgpack.encode(merged))
            if round_:
                client.key_value_delete(f"{self._ns}/meta/{round_ - 1}/part")
        else:
            payload = _get(client, f"{base}/merged", self.timeout_s, "merged metadata")
            merged = decode_metadata(payload, self.engine.engine_id)
            served = _get(client, f"{self._ns}/address", self.timeout_s, "address").decode()
            served_host, served_port = served.rsplit(":", 1)
            self._address = (served_host, int(served_port))
        self._merged = merged
        return merged

    # -- producer -------------------------------------------------------------------------

    def publish_request(
        self,
        request_id: str,
        block_ids: Sequence[int],
        lease_s: float | None = None,
        *,
        layerwise: bool = False,
        expected_reads: int = 1,
    ) -> TransferParams:
        """Every process: pins its part of the request (`KVTransferEngine.publish_request`).

        Process 0 returns once every process published (for ``layerwise=True``: pinned; the
        layers are announced by each process's `publish_layers` or in-jit callback, and
        `poll` reports the request in ``published`` once every process announced them all).
        Other processes return at once. The params name process 0's merged-metadata address.
        Every process publishes the same requests in the same order (the scheduler's).

        Args:
          request_id, block_ids, lease_s, layerwise, expected_reads: as
            `KVTransferEngine.publish_request` (the same in every process).

        Returns:
          The `TransferParams` to hand to consumers (the same in every process).

        Raises:
          RuntimeError: a process failed to publish: the request is aborted everywhere.
          TimeoutError: a process did not publish within `timeout_s`: aborted everywhere.
        """
        if self._merged is None:
            raise RuntimeError("publish_metadata first")
        # One key directory per publication (the processes count them alike): a state left
        # by an earlier, failed publication of the same id is never read as this one's.
        seq, self._pub_seq = self._pub_seq, self._pub_seq + 1
        key = f"{self._ns}/pub/{seq:012d}-{_key(request_id)}"
        try:
            params = self.engine.publish_request(
                request_id, block_ids, lease_s, layerwise=layerwise, expected_reads=expected_reads
            )
        except Exception as error:
            self._client.key_value_set_bytes(
                f"{key}/{self.process_id}",
                f"fail:{type(error).__name__}: {error}".encode(),
                allow_overwrite=True,
            )
            if self.process_id == 0:  # the others may have pinned it: abort it everywhere
                self.abort_request(request_id)
            raise
        state = b"pinned" if layerwise else b"ok"
        self._client.key_value_set_bytes(f"{key}/{self.process_id}", state, allow_overwrite=True)
        if layerwise:
            self._pending_publish.add(request_id)
        else:
            self._note(("published", request_id, "", []))
        params = msgspec.structs.replace(params, addresses=[list(self.address)])
        if self.process_id == 0:
            self._wait_published(request_id, key)
        return params

    def _wait_published(self, request_id: str, key: str) -> None:
        deadline = time.monotonic() + self.timeout_s
        try:
            for pid in range(1, self.num_processes):
                try:
                    state = _get(self._client, f"{key}/{pid}", deadline - time.monotonic(),
                                 f"publication of {request_id!r} by process {pid}")
                except TimeoutError:
                    self.abort_request(request_id)
                    raise
                if state.startswith(b"fail:"):
                    self.abort_request(request_id)
                    raise RuntimeError(
                        f"process {pid} could not publish {request_id!r}: {state[5:].decode()}"
                    )
        finally:
            self._client.key_value_delete(key)  # the directory: every process's state

    def publish_layers(self, request_id: str, layer_stop: int | None = None) -> None:
        """Every process: `KVTransferEngine.publish_layers` of its part."""
        self.engine.publish_layers(request_id, layer_stop)

    def handle(self, request_id: str) -> int:
        """`KVTransferEngine.handle` of this process's engine. A jitted step's operands are
        the same in every process: take handles in the same order everywhere (e.g. right
        after `publish_request`), so that every process maps a handle to the same request.

        Example:
          >>> h = mc.handle("req-1")  # doctest: +SKIP
        """
        return self.engine.handle(request_id)

    def publish_in_jit(
        self, handle: Any, block_ids: Any, written: Any, layer_stop: Any = -1
    ) -> Any:
        """`jaxkv.transfer.publish_in_jit` for a step over the global mesh (call inside
        ``jax.jit``, in every process): the callback runs in every process, once that
        process's shards of `written` are computed.

        A plain ``io_callback`` in a multi-process program runs in one process only (the
        first device's), so this one is issued per device (inside ``shard_map``, each
        depending on its own shard's writes through `written_token`) and each process
        publishes its part when the callbacks of all of its devices ran. No collective is
        added.

        Args:
          handle: int32 scalar, `handle` of the request (published with ``layerwise=True``).
          block_ids: int32 ``[n]`` ids written (as `publish_in_jit`).
          written: the updated `PagedKVCache` (sharded over its mesh).
          layer_stop: int32 scalar: one past the last written global layer, -1 for all.

        Returns:
          int32 ``[devices]``, sharded over the cache's mesh: per device 1 (published or
          counted), 0 refused. Return it from the step so the callbacks are not dropped.
        """
        import jax
        import jax.numpy as jnp
        from jax.experimental import io_callback
        from jax.sharding import PartitionSpec

        from jaxkv.transfer._jit import written_token

        mesh = written.sharding.mesh
        names = tuple(mesh.axis_names)
        here = jax.process_index()
        local = sum(1 for d in mesh.devices.flat if d.process_index == here)
        array_spec = written.partition_spec()
        callback = functools.partial(_device_publish, self, local)

        def body(arrays, handle, ids, stop):
            position = jnp.int32(0)
            for name in names:
                position = position * mesh.shape[name] + jax.lax.axis_index(name)
            return io_callback(
                callback,
                jax.ShapeDtypeStruct((1,), jnp.int32),
                position,
                handle,
                ids,
                stop,
                written_token(list(arrays)),
            )

        replicated = PartitionSpec()
        program = jax.shard_map(
            body,
            mesh=mesh,
            in_specs=((array_spec,) * len(written.arrays), replicated, replicated, replicated),
            out_specs=PartitionSpec(names),
            check_vma=False,
        )
        return program(
            tuple(written.arrays),
            jnp.asarray(handle, jnp.int32).reshape(()),
            jnp.asarray(block_ids, jnp.int32).reshape(-1),
            jnp.asarray(layer_stop, jnp.int32).reshape(()),
        )

    def wait_in_jit(
        self, handle: Any, block_ids: Any, cache: Any, timeout_s: float = 30.0
    ) -> tuple[Any, Any]:
        """`jaxkv.transfer.wait_in_jit` for a consumer step over the global mesh (call inside
        ``jax.jit``, in every process): every device waits for its own process's part of the
        read, so no device uses blocks its process has not received.

        A plain ``io_callback`` in a multi-process program runs in process 0 only; this one
        runs per device (inside ``shard_map``), each returning its own copy of the ids.

        Args:
          handle: int32 scalar, `handle` of the read id (taken in the same order everywhere).
          block_ids: int32 ``[n]`` local block ids the step reads the received blocks with.
          cache: the registered `PagedKVCache` (its mesh places the callbacks).
          timeout_s: the longest one callback blocks.

        Returns:
          ``(ids, status)`` sharded over the cache's mesh: ``ids`` int32 ``[devices, n]``,
          row ``d`` the ids for device ``d`` (all ``-1`` unless its process's read finished;
          data dependent on that wait: use the row inside the step's ``shard_map``),
          ``status`` int32 ``[devices]`` as `wait_in_jit`'s (1 finished, 0 failed, -1 timed
          out, -2 needs `poll` outside jit).
        """
        import jax
        import jax.numpy as jnp
        from jax.experimental import io_callback
        from jax.sharding import PartitionSpec

        from jaxkv.transfer._jit import _wait_callback

        mesh = cache.sharding.mesh
        names = tuple(mesh.axis_names)
        callback = functools.partial(_wait_callback, self.engine, float(timeout_s))

        def body(handle, ids):
            status = io_callback(callback, jax.ShapeDtypeStruct((), jnp.int32), handle)
            return jnp.where(status == 1, ids, -1)[None], status.reshape(1)

        replicated = PartitionSpec()
        program = jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(replicated, replicated),
            out_specs=(PartitionSpec(names), PartitionSpec(names)),
            check_vma=False,
        )
        return program(
            jnp.asarray(handle, jnp.int32).reshape(()),
            jnp.asarray(block_ids, jnp.int32).reshape(-1),
        )

    def abort_request(self, request_id: str) -> None:
        """Any process: aborts a producer request or a consumer read in every process (each
        applies it at its next `poll`; this process at once)."""
        self._client.key_value_set_bytes(
            f"{self._ns}/abort/{_key(request_id)}", b"1", allow_overwrite=True
        )
        self._aborted.add(request_id)
        self.engine.abort_request(request_id)

    # -- consumer -------------------------------------------------------------------------

    def start_read(
        self,
        params: TransferParams,
        local_block_ids: Sequence[int],
        timeout_s: float | None = None,
        *,
        read_id: str | None = None,
    ) -> None:
        """Every process of the consumer engine: reads its ranks' part of a request
        (`KVTransferEngine.start_read`, the same read id everywhere)."""
        key = params.request_id if read_id is None else read_id
        self.engine.start_read(params, local_block_ids, timeout_s, read_id=read_id)
        if key in self._aborted or _try_get(
            self._client, f"{self._ns}/abort/{_key(key)}"
        ) is not None:
            self._aborted.add(key)
            self.engine.abort_request(key)

    # -- progress -------------------------------------------------------------------------

    def poll(self) -> MultiControllerPollResult:
        """Every process, regularly: `KVTransferEngine.poll` plus the coordination (aborts
        from other processes applied, this process's outcomes reported to process 0).
        Process 0's result also holds the engine-level outcomes."""
        now = time.monotonic()
        read_store = now >= self._next_read
        if read_store:
            self._next_read = now + self.store_interval_s
            self._apply_aborts()
        local = self.engine.poll()
        out = MultiControllerPollResult(local=local)
        notes: list[tuple[str, str, str, list[int]]] = []
        for request_id in list(self._pending_publish):
            stop = self.engine.published_layers(request_id)
            if stop is None or stop >= self.engine.config.spec.num_layers:
                self._pending_publish.discard(request_id)
                if stop is not None:
                    notes.append(("published", request_id, "", []))
        for read_id in local.finished:
            notes.append(("finished", read_id, "", []))
        for failed in local.failed:
            notes.append(
                ("failed", failed.request_id, failed.reason, list(failed.invalid_block_ids))
            )
        for request_id in local.freeable:
            self._pending_publish.discard(request_id)
            notes.append(("freeable", request_id, "", []))
        if self.process_id == 0:
            self._aggregate(notes, 0)
            found = self._client.key_value_dir_get_bytes(f"{self._ns}/out/") if read_store else []
            for key, payload in sorted(found):
                pid = int(key.rsplit("/", 2)[-2])
                self._aggregate(msgspec.msgpack.decode(payload), pid)
                self._client.key_value_delete(key)
            level, self._engine_level = self._engine_level, MultiControllerPollResult()
            out.finished, out.failed = level.finished, level.failed
            out.freeable, out.published = level.freeable, level.published
        elif notes:
            self._note_all(notes)
        return out

    def _note(self, note: tuple[str, str, str, list[int]]) -> None:
        if self.process_id == 0:
            self._aggregate([note], 0)
        else:
            self._note_all([note])

    def _note_all(self, notes: list) -> None:
        seq, self._out_seq = self._out_seq, self._out_seq + 1
        self._client.key_value_set_bytes(
            f"{self._ns}/out/{self.process_id}/{seq:012d}", msgspec.msgpack.encode(notes)
        )

    def _aggregate(self, notes, pid: int) -> None:
        """Process 0: folds one process's outcomes into the engine-level ones (reported by
        the next `poll`)."""
        out = self._engine_level
        for kind, request_id, reason, invalid in notes:
            if kind == "published":
                seen = self._published.setdefault(request_id, set())
                seen.add(pid)
                if len(seen) == self.num_processes:
                    out.published.append(request_id)
            elif kind == "freeable":
                if self._freed.report(pid, [request_id]):
                    self._client.key_value_delete(f"{self._ns}/abort/{_key(request_id)}")
                    self._published.pop(request_id, None)
                    out.freeable.append(request_id)
            else:  # a read ended in process `pid`: "finished" or "failed"
                failure = self._failed.get(request_id)
                if kind == "failed":
                    if failure is None:
                        # Every process stops reading: the blocks are invalid anyway.
                        self.abort_request(request_id)
                        failure = FailedRead(request_id, "", ())
                    blocks = sorted(set(failure.invalid_block_ids) | {int(b) for b in invalid})
                    failure = FailedRead(
                        request_id,
                        "; ".join(x for x in (failure.reason, f"process {pid}: {reason}") if x),
                        tuple(blocks),
                    )
                    self._failed[request_id] = failure
                # Reported once every process ended it: no READ of any process still writes
                # the blocks when the scheduler learns the outcome.
                if self._finished.report(pid, [request_id]):
                    failure = self._failed.pop(request_id, None)
                    if failure is None:
                        out.finished.append(request_id)
                    else:
                        self._client.key_value_delete(f"{self._ns}/abort/{_key(request_id)}")
                        out.failed.append(failure)

    def _apply_aborts(self) -> None:
        present = set()
        for key, _ in self._client.key_value_dir_get_bytes(f"{self._ns}/abort/"):
            request_id = bytes.fromhex(key.rsplit("/", 1)[-1]).decode()
            present.add(request_id)
            if request_id not in self._aborted:
                self.engine.abort_request(request_id)
        # Process 0 deletes an abort once every process ended the request: forget it too.
        self._aborted = present

    def close(self) -> None:
        """Closes process 0's metadata server (not the wrapped engine)."""
        if self._closed:
            return
        self._closed = True
        if self._server is not None:
            self._server.close()

    def __enter__(self) -> MultiControllerEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_MAX_JIT_KEYS = 4096


def _device_publish(
    mc: MultiControllerEngine, local_devices: int, position, handle, block_ids, stop, token
) -> np.ndarray:
    """One device's publication callback: the process publishes once every one of its
    devices' callbacks (for this handle and layer stop) ran."""
    del token  # only orders the callback after this device's writes
    key = (int(handle), int(stop))
    with mc._jit_lock:
        seen = mc._jit_seen.setdefault(key, set())
        seen.add(int(np.asarray(position)))
        if len(seen) < local_devices:
            while len(mc._jit_seen) > _MAX_JIT_KEYS:
                del mc._jit_seen[next(iter(mc._jit_seen))]
            return np.ones((1,), np.int32)
        del mc._jit_seen[key]
    status = mc.engine._callback_publish(int(handle), np.asarray(block_ids), int(stop))
    return np.full((1,), status, np.int32)


def broadcast_block_ids(
    channel: StepChannel, block_ids: Mapping[str, Sequence[int]] | None
) -> dict[str, np.ndarray]:
    """One scheduler step's block ids per request, from process 0 to every process
    (`StepChannel.broadcast` of ``{request id: ids}``).

    Example:
      >>> ids = broadcast_block_ids(channel, {"req-1": [3, 4]})  # doctest: +SKIP
    """
    value = None
    if block_ids is not None:
        value = {str(k): np.asarray(v, dtype=np.int64).astype(np.int32) for k, v in
                 block_ids.items()}
    out = channel.broadcast(value)
    return {k: np.asarray(v, dtype=np.int32) for k, v in out.items()}
