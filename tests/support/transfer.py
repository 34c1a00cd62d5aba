"""Helpers for the jaxkv.transfer tests (not a test module).

`NumpyEngine` holds an engine's cache as raw byte buffers per (rank, region), filled from a
global token-indexed cache ``G[layer, kv, head, position, d]`` by independent layout math, so
that a `ReadPlan`'s byte copies can be simulated and checked bit for bit.
"""

from __future__ import annotations

import logging
import time

import numpy as np
from absl.testing import parameterized

from jaxkv import EngineConfig, KVCacheSpec
from jaxkv.transfer._metadata import AgentInfo, RankInfo, RegionInfo, engine_metadata
from support import bits, meshes, processes

REGION_STRIDE = 1 << 36  # fake base addresses: rank * 2^44 + region * 2^36


def fake_regions(config: EngineConfig, rank: int, num_blocks: int) -> list[RegionInfo]:
    tp_rank, pp_rank = config.coordinates(rank)
    local = config.local_spec(pp_rank)
    layer_start, _ = config.layer_range(pp_rank)
    h0, h1 = config.head_range(tp_rank)
    out = []
    for index, (layer, kv) in enumerate(local.array_keys()):
        out.append(
            RegionInfo(
                array_index=index,
                layer=-1 if layer is None else layer + layer_start,
                kv=-1 if kv is None else kv,
                head_start=h0,
                head_stop=h1,
                base_address=(rank << 44) + index * REGION_STRIDE,
                block_len=local.block_nbytes(config.tp_size),
                num_blocks=num_blocks,
                device_id=0,
                memory_kind="DRAM",
            )
        )
    return out


def fake_metadata(engine_id: str, config: EngineConfig, num_blocks: int, generation: int = 0):
    ranks = [
        RankInfo(rank=r, agent_name=f"{engine_id}-{r}", regions=fake_regions(config, r, num_blocks))
        for r in range(config.world_size)
    ]
    agents = [AgentInfo(name=f"{engine_id}-{r}", metadata=b"md") for r in range(config.world_size)]
    return engine_metadata(engine_id, config, ranks, agents, generation)


def global_cache(spec: KVCacheSpec, num_tokens: int, seed: int = 0) -> np.ndarray:
    """``G[layer, kv, head, position, d]`` as unsigned ints of the dtype's width, random bits."""
    rng = np.random.default_rng(seed)
    width = np.dtype(f"u{spec.itemsize}")
    shape = (spec.num_layers, spec.kv_factor, spec.num_kv_heads, num_tokens, spec.head_dim)
    return rng.integers(0, np.iinfo(width).max, size=shape, dtype=width, endpoint=True)


class NumpyEngine:
    """Raw byte buffers of every (rank, region) of an engine."""

    def __init__(self, config: EngineConfig, num_blocks: int, seed: int = 1):
        self.config = config
        self.spec = config.spec
        self.num_blocks = num_blocks
        rng = np.random.default_rng(seed)
        self.buffers: dict[int, list[np.ndarray]] = {}
        for rank in range(config.world_size):
            regions = fake_regions(config, rank, num_blocks)
            self.buffers[rank] = [
                rng.integers(0, 256, size=r.block_len * num_blocks, dtype=np.uint8) for r in regions
            ]

    def _rank_blocks(self, rank: int, g_slice: np.ndarray) -> list[np.ndarray]:
        """Splits ``[blocks, L_local, K, H_rank, T, D]`` (uint) into per-region block arrays in
        the layout's order."""
        layout = self.spec.layout
        letters = "LKHTD"
        out = []
        local = self.config.local_spec(self.config.coordinates(rank)[1])
        for layer, kv in local.array_keys():
            x = g_slice
            axes = list(letters)
            for letter, index in (("L", layer), ("K", kv), ("H", None if "H" in layout else 0)):
                if index is not None:
                    x = np.take(x, index, axis=1 + axes.index(letter))
                    axes.remove(letter)
            perm = [0] + [1 + axes.index(a) for a in layout]
            out.append(np.ascontiguousarray(np.transpose(x, perm)))
        return out

    def slice_of(
        self, rank: int, g: np.ndarray, first_token: int, num_blocks: int
    ) -> list[np.ndarray]:
        """What `rank`'s blocks holding tokens ``[first_token, ...)`` must contain (per region,
        ``[num_blocks, *block_shape]``), from G by independent indexing."""
        tp_rank, pp_rank = self.config.coordinates(rank)
        l0, l1 = self.config.layer_range(pp_rank)
        h0, h1 = self.config.head_range(tp_rank)
        t = self.spec.block_size
        tokens = g[l0:l1, :, h0:h1, first_token : first_token + num_blocks * t, :]
        pad = num_blocks * t - tokens.shape[3]
        if pad:
            tokens = np.concatenate(
                [tokens, np.zeros((*tokens.shape[:3], pad, tokens.shape[4]), tokens.dtype)], axis=3
            )
        # [L, K, H, blocks*T, D] -> [blocks, L, K, H, T, D]
        blocks = tokens.reshape(*tokens.shape[:3], num_blocks, t, tokens.shape[4])
        blocks = np.moveaxis(blocks, 3, 0)
        return self._rank_blocks(rank, blocks)

    def write_request(self, g: np.ndarray, block_ids, first_token: int = 0) -> None:
        """Stores the request's tokens (from `first_token`) into `block_ids` on every rank."""
        ids = np.asarray(block_ids)
        for rank in range(self.config.world_size):
            for region, blocks in zip(
                self.buffers[rank], self.slice_of(rank, g, first_token, len(ids))
            ):
                view = region.reshape(self.num_blocks, -1)
                view[ids] = blocks.reshape(len(ids), -1).view(np.uint8)

    def region_blocks(self, rank: int, region: int, block_ids) -> np.ndarray:
        return self.buffers[rank][region].reshape(self.num_blocks, -1)[
            np.asarray(block_ids, dtype=np.int64)
        ]


def apply_plan(plan, local: NumpyEngine, remote: NumpyEngine) -> None:
    """Simulates a plan: every descriptor's bytes, chunk by chunk, then the post-processing."""
    dst = local.buffers[plan.local_rank]
    for rr, rg, ro, lg, lo, length, count, rs, ls in plan.copies.tolist():
        src = remote.buffers[rr][rg]
        for c in range(count):
            a, b = ro + c * rs, lo + c * ls
            assert a + length <= src.size and b + length <= dst[lg].size, "descriptor out of bounds"
            dst[lg][b : b + length] = src[a : a + length]
    for step in plan.post:
        view = dst[step.region].reshape(local.num_blocks, -1)
        assert view.shape[1] == step.block_nbytes
        view[step.block_ids] = step.rearrange(view[step.block_ids])


def apply_rows(
    local_rows: np.ndarray, remote_rows: np.ndarray, local: NumpyEngine, remote: NumpyEngine
) -> None:
    """Simulates ``Nx3`` ``(address, length, device)`` descriptor pairs between `fake_regions`
    (an address names its rank, region and offset: `REGION_STRIDE`)."""

    def where(address: int) -> tuple[int, int, int]:
        return address >> 44, (address >> 36) & 0xFF, address & (REGION_STRIDE - 1)

    assert local_rows.shape == remote_rows.shape, (local_rows.shape, remote_rows.shape)
    for (la, length, _), (ra, r_length, _) in zip(local_rows.tolist(), remote_rows.tolist()):
        assert length == r_length, "a descriptor pair of unequal lengths"
        lr, lg, lo = where(la)
        rr, rg, ro = where(ra)
        src, dst = remote.buffers[rr][rg], local.buffers[lr][lg]
        assert ro + length <= src.size and lo + length <= dst.size, "descriptor out of bounds"
        dst[lo : lo + length] = src[ro : ro + length]


# -- real transfers: a producer engine in a child process ------------------------------------


def global_arrays(
    config: EngineConfig,
    pp_rank: int,
    g: np.ndarray,
    block_ids,
    num_blocks: int,
    seed: int = 3,
    first_token: int = 0,
) -> list[np.ndarray]:
    """The global (all heads) arrays of one pipeline rank's cache: random bits everywhere, the
    request's tokens from G in `block_ids`."""
    local = config.local_spec(pp_rank)
    l0, l1 = config.layer_range(pp_rank)
    full = EngineConfig(local, 1)
    engine = NumpyEngine(full, num_blocks, seed=seed)
    engine.write_request(g[l0:l1], block_ids, first_token)
    width = np.dtype(f"u{local.itemsize}")
    return [
        buf.view(width).reshape(local.array_shape(num_blocks)).view(local.dtype)
        for buf in engine.buffers[0]
    ]


def packed_arrays(spec, tp, g, block_ids, num_blocks, seed, first_token=0):
    """A packed (tpu-inference) cache's global arrays, built with numpy from the spec's own
    `combined_head` map: random sentinel bits everywhere (phantom heads and padded lanes
    included), the values of G's tokens from `first_token` on in `block_ids`."""
    width = np.dtype(f"u{spec.itemsize}")
    rng = np.random.default_rng(seed)
    shape = (num_blocks, *spec.global_block_shape(tp))
    per = spec.heads_per_rank(tp)
    words = spec.block_shape(tp)[1]
    out = []
    for layer in range(spec.num_layers):
        a = rng.integers(0, np.iinfo(width).max, size=shape, dtype=width, endpoint=True)
        for j, b in enumerate(block_ids):
            t0 = first_token + j * spec.block_size
            t1 = min(t0 + spec.block_size, g.shape[3])
            if t1 <= t0:
                continue
            for h in range(spec.num_kv_heads):
                rank, local = divmod(h, per)
                for kv in range(2):
                    word, pos = spec.combined_head(local, kv)
                    a[b, : t1 - t0, rank * words + word, pos, : spec.head_dim] = (
                        g[layer, kv, h, t0:t1])
        out.append(a.view(spec.dtype))
    return out


def expected_arrays(
    config: EngineConfig, pp_rank: int, g: np.ndarray, block_ids, first_token: int = 0
) -> list[np.ndarray]:
    """What the request's blocks of each global array must hold (uint view), from G."""
    local = config.local_spec(pp_rank)
    l0, l1 = config.layer_range(pp_rank)
    engine = NumpyEngine.__new__(NumpyEngine)
    engine.config, engine.spec = EngineConfig(local, 1), local
    return engine.slice_of(0, g[l0:l1], first_token, len(block_ids))


def rank_arrays(
    config: EngineConfig,
    tp_rank: int,
    pp_rank: int,
    g: np.ndarray,
    block_ids,
    num_blocks: int,
    seed: int = 3,
) -> list[np.ndarray]:
    """One TP rank's arrays (its heads only) of pipeline rank `pp_rank`'s cache: random bits
    everywhere, the request's tokens from G in `block_ids`."""
    local = config.local_spec(pp_rank)
    l0, l1 = config.layer_range(pp_rank)
    engine = NumpyEngine(EngineConfig(local, config.tp_size), num_blocks, seed=seed)
    engine.write_request(g[l0:l1], block_ids)
    rank_spec = local if local.mla else local.replace(num_kv_heads=config.heads_per_rank)
    width = np.dtype(f"u{local.itemsize}")
    return [
        buf.view(width).reshape(rank_spec.array_shape(num_blocks)).view(local.dtype)
        for buf in engine.buffers[tp_rank]
    ]


def producer_main(
    conn,
    spec_kwargs: dict,
    tp: int,
    pp_rank: int,
    pp: int,
    num_blocks: int,
    g_seed: int,
    num_tokens: int,
    engine_kwargs: dict,
    tp_rank: int | None = None,
) -> None:
    """A producer engine process: holds pipeline rank `pp_rank`'s cache over `tp` CPU devices
    (or, with `tp_rank`, only that TP rank's shard on one device: one process per rank),
    filled from G for every published request; serves commands from `conn`:
    ("register", block_ids) -> address (cache filled with G's tokens in block_ids);
    ("pin", request_id, block_ids, lease_s[, expected_reads]) -> TransferParams;
    ("slow", seconds) -> sleep that long between polls; ("pause", seconds) -> stop polling;
    ("abort", request_id); ("state",) -> (pinned, freed, stats summary); ("exit",).
    Layer-wise: ("register", block_ids, written) -> the request's layers >= `written` hold
    scrambled bytes; ("pin_lw", request_id, block_ids, lease_s) -> TransferParams (layer-wise);
    ("layers", request_id, stop) -> writes layers [.., stop) correctly, then publishes them;
    ("publications",) -> the engine's PublishRecords; ("pool",) -> bytes its formatted-read
    send pool holds; ("donate",) -> a jitted step consumes (donates) the registered cache,
    its output held back; ("adopt",) -> hands that output over (`update_cache`)."""
    processes.child_env(1 if tp_rank is not None else max(tp, 1))
    import time

    from jaxkv import PagedKVCache
    from jaxkv.transfer._engine import KVTransferEngine  # the core: the test reads .agent

    spec = KVCacheSpec(**spec_kwargs)
    config = EngineConfig(spec, tp, pp)
    g = global_cache(spec, num_tokens, seed=g_seed)
    mesh = meshes.tp(1 if tp_rank is not None else tp)
    freed: list[str] = []
    idle = 0.0  # seconds between polls ("slow": a producer that serves reads slowly)
    with KVTransferEngine("prefill", config, **engine_kwargs) as engine:
        cache = None
        conn.send(("ready", engine.address))
        while True:
            if conn.poll(0.0005):
                command = conn.recv()
                if command[0] == "exit":
                    break
                if command[0] == "register":
                    written = command[2] if len(command) > 2 else None
                    if tp_rank is None:
                        arrays = global_arrays(config, pp_rank, g, command[1], num_blocks)
                        spec_r = config.local_spec(pp_rank)
                    else:
                        arrays = rank_arrays(config, tp_rank, pp_rank, g, command[1], num_blocks)
                        spec_r = config.local_spec(pp_rank)
                        if not spec_r.mla:
                            spec_r = spec_r.replace(num_kv_heads=config.heads_per_rank)
                    good, ids = arrays, list(command[1])
                    l0 = config.layer_range(pp_rank)[0]
                    if written is not None:
                        arrays = layer_mix(spec_r, good, ids, l0, written)
                    cache = PagedKVCache.from_arrays(spec_r, arrays, mesh=mesh)
                    engine.register_cache(cache, pp_rank=pp_rank, tp_rank=tp_rank)
                    conn.send(engine.address)
                elif command[0] == "pin_lw":
                    _, request_id, block_ids, lease = command
                    conn.send(engine.publish_request(request_id, block_ids, lease, layerwise=True))
                elif command[0] == "layers":
                    _, request_id, stop = command
                    mixed = layer_mix(spec_r, good, ids, l0, stop)
                    dense = [a[np.asarray(ids)] for a in mixed]
                    cache = engine.caches[0].scatter_blocks(dense, np.asarray(ids, np.int32))
                    engine.update_cache(cache)
                    engine.publish_layers(request_id, stop)
                    conn.send(True)
                elif command[0] == "publications":
                    conn.send(list(engine.stats.publications))
                elif command[0] == "donate":  # a step consumes the cache, output held back
                    import jax

                    held = jax.jit(lambda c: c, donate_argnums=0)(engine.caches[0])
                    conn.send(all(a.is_deleted() for a in engine.caches[0].arrays))
                elif command[0] == "adopt":  # ... and hands it over
                    engine.update_cache(held)
                    conn.send(True)
                elif command[0] == "pool":  # bytes held for formatted reads (send pool)
                    server = engine.transport.format_server
                    conn.send(-1 if server is None else server.held_bytes)
                elif command[0] == "pin":
                    _, request_id, block_ids, lease, *reads = command
                    conn.send(
                        engine.publish_request(
                            request_id, block_ids, lease, expected_reads=reads[0] if reads else 1
                        )
                    )
                elif command[0] == "pause":  # stop polling (no acks, no lease upkeep)
                    time.sleep(command[1])
                    conn.send(True)
                elif command[0] == "slow":
                    idle = command[1]
                    conn.send(True)
                elif command[0] == "abort":
                    engine.abort_request(command[1])
                    conn.send(True)
                elif command[0] == "state":
                    conn.send(
                        (
                            engine.num_pinned,
                            list(freed),
                            engine.stats.summary(),
                            engine.agent.num_registrations,
                        )
                    )
            result = engine.poll()
            freed.extend(result.freeable)
            time.sleep(idle)


def layer_mix(spec: KVCacheSpec, good, block_ids, layer_start: int, written: int) -> list:
    """`good` arrays where the global layers >= `written` of `block_ids` are scrambled
    (bitwise not): what a producer holds before prefill wrote those layers."""
    ids = np.asarray(block_ids, dtype=np.int64)
    out = []
    for (layer, _), array in zip(spec.array_keys(), good):
        width = np.dtype(f"u{spec.itemsize}")
        u = np.array(array).view(width)
        if layer is not None:
            if layer + layer_start >= written:
                u[ids] = ~u[ids]
        elif "L" in spec.layout:
            axis = 1 + spec.layout.index("L")
            first = max(0, written - layer_start)
            index = [slice(None)] * u.ndim
            index[axis] = slice(first, None)
            block = u[ids]
            block[tuple(index)] = ~block[tuple(index)]
            u[ids] = block
        out.append(u.view(array.dtype))
    return out


# -- test base for real transfers ------------------------------------------------------------

NUM_BLOCKS = 16
REMOTE_IDS = [3, 4, 5, 9, 10, 2]
LOCAL_IDS = [7, 8, 9, 12, 13, 14]
G_SEED = 11
WAIT_S = 60.0


def receive_messages(channel, count, timeout=5.0):
    """Up to `count` messages a `ControlChannel` received within `timeout` seconds."""
    got = []
    deadline = time.monotonic() + timeout
    while len(got) < count and time.monotonic() < deadline:
        got += channel.receive()
        time.sleep(0.001)
    return got


class TransferTestBase(parameterized.TestCase):
    """Spawns producer processes (`producer_main`) and consumer engines; cleans both up."""

    def setUp(self):
        super().setUp()
        self._children = []
        self._engines = []

    def tearDown(self):
        for engine in self._engines:
            engine.close()
        for process, conn in self._children:
            processes.stop(process, conn)
        super().tearDown()

    def start_producer(
        self, spec_kwargs, tp, pp_rank=0, pp=1, engine_kwargs=None, tp_rank=None, num_tokens=None
    ):
        process, parent = processes.spawn(
            producer_main, spec_kwargs, tp, pp_rank, pp, NUM_BLOCKS, G_SEED,
            num_tokens or len(REMOTE_IDS) * spec_kwargs["block_size"], engine_kwargs or {}, tp_rank,
        )
        self._children.append((process, parent))
        return process, parent

    @staticmethod
    def call(conn, *command, timeout=WAIT_S):
        conn.send(command)
        if not conn.poll(timeout):
            raise TimeoutError(f"producer did not answer {command[0]!r}")
        return conn.recv()

    @staticmethod
    def ready(conn):
        if not conn.poll(WAIT_S):
            raise TimeoutError("producer did not start")
        return conn.recv()

    def consumer(self, spec, tp, pp=1, pp_rank=0, **kwargs):
        from jaxkv import PagedKVCache
        from jaxkv.transfer._engine import KVTransferEngine  # the core: tests reach into it

        config = EngineConfig(spec, tp, pp)
        engine = KVTransferEngine("decode", config, **kwargs)
        self._engines.append(engine)
        cache = PagedKVCache.allocate(config.local_spec(pp_rank), NUM_BLOCKS, mesh=meshes.tp(tp))
        engine.register_cache(cache, pp_rank=pp_rank)
        return engine, cache, config

    def assert_freed(self, conn, request_id, timeout=WAIT_S):
        """Polls a producer process's state until it freed something; asserts it freed exactly
        `request_id` and pins nothing. Returns the last state tuple."""
        deadline = time.monotonic() + timeout
        while True:
            state = self.call(conn, "state")
            if state[1] or time.monotonic() >= deadline:
                break
        self.assertEqual((state[0], state[1]), (0, [request_id]))
        return state

    @staticmethod
    def wait(engine, request_ids, timeout=WAIT_S):
        finished, failed = [], []
        deadline = time.monotonic() + timeout
        pending = set(request_ids)
        while pending and time.monotonic() < deadline:
            result = engine.poll()
            finished += result.finished
            failed += result.failed
            pending -= set(result.finished) | {f.request_id for f in result.failed}
        if pending:
            raise TimeoutError(f"requests {sorted(pending)} neither finished nor failed")
        return finished, failed

    def check_cache(self, cache, config, g, local_ids, pp_rank=0, first_token=0, arrays=None):
        """Every array of `cache` (or those of `arrays`) holds `g`'s blocks at `local_ids`,
        bit for bit, and zeros elsewhere."""
        expected = expected_arrays(config, pp_rank, g, local_ids, first_token)
        ids = np.asarray(local_ids)
        others = np.setdiff1d(np.arange(NUM_BLOCKS), ids)
        for index, (array, want) in enumerate(zip(cache.arrays, expected)):
            if arrays is not None and index not in arrays:
                continue
            got = bits.bits(np.asarray(array))
            np.testing.assert_array_equal(got[ids], want, err_msg=f"array {index}")
            self.assertFalse(got[others].any(), f"array {index}: other blocks changed")


# -- jitted steps that publish / consume (transfer_jit_test) ---------------------------------


def slow_values(shape, seed, iters):
    """uint32 values from an LCG iterated `iters` times over an iota (jnp, inside jit): a
    deliberately slow, exactly reproducible write."""
    import jax
    import jax.numpy as jnp

    x = jnp.arange(int(np.prod(shape)), dtype=jnp.uint32) + jnp.uint32(seed)

    def body(_, x):
        return x * jnp.uint32(1664525) + jnp.uint32(1013904223)

    x = jax.lax.fori_loop(0, iters, body, x)
    return (x ^ (x >> 16)).reshape(shape)


def slow_values_numpy(shape, seed, iters):
    """`slow_values` in numpy (the reference)."""
    x = np.arange(int(np.prod(shape)), dtype=np.uint64) + np.uint64(seed)
    # x_k = a^k x + c (a^k - 1) / (a - 1) mod 2^32, by repeated squaring of the affine map
    a, c = np.uint64(1664525), np.uint64(1013904223)
    mask = np.uint64(0xFFFFFFFF)
    ra, rc = np.uint64(1), np.uint64(0)
    k = iters
    while k:
        if k & 1:
            ra, rc = (a * ra) & mask, (a * rc + c) & mask
        a, c = (a * a) & mask, (a * c + c) & mask
        k >>= 1
    x = (ra * x + rc) & mask
    x = x ^ (x >> np.uint64(16))
    return x.astype(np.uint32).reshape(shape)


def make_prefill_step(engine, iters):
    """A jitted prefill step: writes `slow_values` into the request's blocks of every cache
    array (float32 bit patterns), then publishes them with `publish_in_jit`."""
    import functools

    import jax

    from jaxkv.transfer import publish_in_jit

    @functools.partial(jax.jit, donate_argnums=0)
    def prefill(cache, ids, handle, seed):
        blocks = []
        for index, array in enumerate(cache.arrays):
            values = slow_values((ids.shape[0], *array.shape[1:]), seed + index, iters)
            blocks.append(jax.lax.bitcast_convert_type(values, array.dtype))
        cache = cache.scatter_blocks(blocks, ids)
        return cache, publish_in_jit(engine, handle, ids, cache)

    return prefill


def jit_producer_main(
    conn, spec_kwargs: dict, tp: int, num_blocks: int, iters: int, engine_kwargs=None
) -> None:
    """A producer process whose prefill step is jitted and publishes from inside jit:
    ("pin", request_id, block_ids) -> (params, handle); ("prefill", handle, padded_ids, seed)
    -> the callback's status (after the step finished); ("prefill_polling", ...) the same,
    polling the engine while the step computes and once after it; ("state",) -> (pinned,
    freed, stats summary, staging seconds per publication). `engine_kwargs` go to the
    `TransferEngine` (e.g. ``host_staging=True``: the callback defers the copy to the host
    mirror until the step's output was handed to `update_cache`)."""
    import time

    def handle(engine, prefill, command, freed):
        if command[0] not in ("prefill", "prefill_polling"):
            return False
        _, handle_id, ids, seed = command
        cache, status = prefill(engine.caches[0], ids, np.int32(handle_id), seed)
        if command[0] == "prefill_polling":
            # serves transfers while the step computes (as the demo does), and once more
            # after it, before its output is handed over
            while not all(a.is_ready() for a in cache.arrays):
                freed.extend(engine.poll().freeable)
                time.sleep(0.001)
            freed.extend(engine.poll().freeable)
        engine.update_cache(cache)
        conn.send(int(status))
        return True

    def state(engine, freed):
        staged = [p.staged_s for p in engine.stats.publications]
        return (engine.num_pinned, list(freed), engine.stats.summary(), staged)

    _jitted_producer_loop(conn, spec_kwargs, tp, num_blocks, engine_kwargs,
                          lambda engine: make_prefill_step(engine, iters), handle, state)


def _jitted_producer_loop(conn, spec_kwargs, tp, num_blocks, engine_kwargs, make_step,
                          handle, state) -> None:
    """The process loop the jitted producers share: one engine and cache, then commands
    ("pin", request_id, block_ids) -> (params, handle), ("state",) -> ``state(engine, freed)``,
    ("exit",); anything else goes to ``handle(engine, step, command, freed)`` (True: done)."""
    # Over the JAX transport a TP > 1 producer gets one host device beside its mesh, where
    # it formats the layers its step announces (`JaxTransport.reads_step_memory`).
    jax_transport = (engine_kwargs or {}).get("transport") == "jax"
    processes.child_env(tp + int(jax_transport and tp > 1))

    from jaxkv import PagedKVCache
    from jaxkv.transfer import TransferEngine

    spec = KVCacheSpec(**spec_kwargs)
    config = EngineConfig(spec, tp)
    mesh = meshes.tp(tp)
    freed: list[str] = []
    with TransferEngine("prefill", config, **(engine_kwargs or {})) as engine:
        cache = PagedKVCache.allocate(spec, num_blocks, mesh=mesh)
        engine.register_cache(cache)
        step = make_step(engine)
        conn.send(("ready", engine.address))
        while True:
            if conn.poll(0.0005):
                command = conn.recv()
                if command[0] == "exit":
                    break
                if command[0] == "pin":
                    params = engine.publish_request(command[1], command[2], layerwise=True)
                    conn.send((params, engine.handle(command[1])))
                elif command[0] == "state":
                    conn.send(state(engine, freed))
                elif not handle(engine, step, command, freed):
                    raise ValueError(f"unknown command {command[0]!r}")
            freed.extend(engine.poll().freeable)


# -- cache groups (transfer_groups_test) -----------------------------------------------------


def groups_producer_main(conn, group_specs: dict, tp: int, num_blocks: int, block_ids: dict):
    """A producer with one cache per group (`TransferEngine` with groups), group `i`'s cache
    filled from its own G (seed ``G_SEED + i``) in ``block_ids[group]``:
    ("pin", request_id, lease_s[, expected_reads]) -> TransferParams; ("state",) -> freed
    request ids."""
    processes.child_env(tp)

    from jaxkv import PagedKVCache
    from jaxkv.transfer import TransferEngine

    mesh = meshes.tp(tp)
    configs = {g: EngineConfig(KVCacheSpec(**kw), tp) for g, kw in group_specs.items()}
    freed: list[str] = []
    with TransferEngine("prefill", configs) as engine:
        for i, (group, config) in enumerate(configs.items()):
            ids = block_ids[group]
            g = global_cache(config.spec, len(ids) * config.spec.block_size, seed=G_SEED + i)
            arrays = global_arrays(config, 0, g, ids, num_blocks)
            engine.register_cache(PagedKVCache.from_arrays(config.spec, arrays, mesh=mesh),
                                  group=group)
        conn.send(("ready", engine.addresses))
        while True:
            if conn.poll(0.0005):
                command = conn.recv()
                if command[0] == "exit":
                    break
                if command[0] == "pin":
                    reads = command[3] if len(command) > 3 else 1
                    conn.send(
                        engine.publish_request(
                            command[1], block_ids, command[2], expected_reads=reads
                        )
                    )
                elif command[0] == "state":
                    conn.send(list(freed))
            freed.extend(engine.poll().freeable)


# -- layer-wise publishing from inside a jitted step (transfer_jit_layers_test) -------------


def layer_part_shape(spec: KVCacheSpec, array_shape, layer_key, rows: int) -> tuple:
    """Shape of one layer's part of `rows` blocks of an array (its L axis dropped if any)."""
    block = list(array_shape[1:])
    if layer_key is None:
        del block[spec.layout.index("L")]
    return (rows, *block)


def layer_seed(seed: int, layer: int, index: int) -> int:
    return seed + 16 * layer + index


def make_layered_prefill_step(engine, iters, naive=False):
    """A jitted prefill step over every layer of the cache: layer k writes `slow_values`
    (seed `layer_seed(seed, k, array index)`) into its part of the request's blocks, then
    announces layers ``[0, k + 1)`` with `publish_layer_in_jit`, threading the next layer's
    input (the seed) through it. ``naive``: `publish_in_jit` per layer, nothing threaded (what
    the engine offered before: copies and no order)."""
    import functools

    import jax
    import jax.numpy as jnp

    from jaxkv.transfer import publish_layer_in_jit
    from jaxkv.transfer._jit import _publish

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
                shape = layer_part_shape(spec, array.shape, key_layer, ids.shape[0])
                values = jax.lax.bitcast_convert_type(
                    slow_values(shape, x + jnp.uint32(16 * layer + index), iters), array.dtype
                )
                if key_layer is None:
                    axis = spec.layout.index("L")
                    where = (ids, *([slice(None)] * axis), layer)
                else:
                    where = (ids,)
                arrays[index] = array.at[where].set(values)
            cache = jax.tree.unflatten(jax.tree.structure(cache), arrays)
            if naive:  # the per-layer callback without threading (what publish_in_jit refuses)
                status = _publish(engine, handle, ids, cache, layer + 1)
            else:
                x, status = publish_layer_in_jit(engine, handle, ids, cache, layer + 1, x)
            statuses.append(status)
        return cache, jnp.stack(statuses)

    return prefill


def expected_layer_values(spec: KVCacheSpec, array_keys, array_shapes, rows, seed, iters):
    """Per array, what `make_layered_prefill_step` wrote into its `rows` blocks (uint view)."""
    out = []
    for index, ((key_layer, _), shape) in enumerate(zip(array_keys, array_shapes)):
        if key_layer is not None:
            part = layer_part_shape(spec, shape, key_layer, rows)
            out.append(slow_values_numpy(part, layer_seed(seed, key_layer, index), iters))
            continue
        axis = 1 + spec.layout.index("L")
        layers = [
            slow_values_numpy(layer_part_shape(spec, shape, None, rows),
                              layer_seed(seed, layer, index), iters)
            for layer in range(spec.num_layers)
        ]
        out.append(np.stack(layers, axis=axis))
    return out


def layered_producer_main(
    conn, spec_kwargs: dict, tp: int, num_blocks: int, iters: int, engine_kwargs=None
) -> None:
    """A producer process whose jitted prefill announces each layer from inside the step:
    ("pin", request_id, block_ids) -> (params, handle); ("prefill", handle, ids, seed) ->
    (statuses, wall time at dispatch, wall time once the step finished); ("publications",)
    -> the PublishRecords; ("state",) -> (pinned, freed); ("late", handle, ids, stop) -> the
    publishing callback run now: (its status, the ERROR messages it logged)."""
    import time

    def handle(engine, prefill, command, freed):
        if command[0] == "prefill":
            _, handle_id, ids, seed = command
            args = (engine.caches[0], ids, np.int32(handle_id), np.uint32(seed))
            step = prefill.lower(*args).compile()  # not timed
            start = time.time()
            cache, statuses = step(*args)
            engine.update_cache(cache)
            conn.send((np.asarray(statuses).tolist(), start, time.time()))
        elif command[0] == "publications":
            conn.send(list(engine.stats.publications))
        elif command[0] == "late":  # a callback that runs after the request was freed
            _, handle_id, ids, stop = command
            errors = _ErrorRecords()
            logging.getLogger("jaxkv.transfer").addHandler(errors)
            try:
                status = engine._callback_publish(handle_id, np.asarray(ids), stop)
            finally:
                logging.getLogger("jaxkv.transfer").removeHandler(errors)
            conn.send((status, errors.messages))
        else:
            return False
        return True

    _jitted_producer_loop(conn, spec_kwargs, tp, num_blocks, engine_kwargs,
                          lambda engine: make_layered_prefill_step(engine, iters), handle,
                          lambda engine, freed: (engine.num_pinned, list(freed)))


class _ErrorRecords(logging.Handler):
    """Collects the messages of ERROR records."""

    def __init__(self):
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())
