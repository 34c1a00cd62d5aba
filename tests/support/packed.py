"""Helpers for the packed-cache transfer tests (not a test module).

An independent reference for the stored blocks of any `KVCacheSpec` (tpu-inference's packed,
K/V-interleaved, head-dim-padded caches as well as plain ones), written with index
arithmetic on the named stored axes (never byte offsets): every value row of the global
cache ``G[layer, kv, head, token, d]`` is put at its stored index, everything else is left
as it was (padding keeps whatever it held).
"""

from __future__ import annotations

import numpy as np

from jaxkv import EngineConfig, KVCacheSpec
from support import meshes

SENTINEL = 0xA5  # every byte of a consumer cache before a read: padding must keep it


def stored_index(spec: KVCacheSpec, layer: int, kv: int, head: int, token: int) -> tuple:
    """The index, inside one stored block of the array holding (local `layer`, `kv`), of
    the value row of rank-local `head` and `token` (its last entry the head-dim slice)."""
    packing = spec.packing
    combined = 2 * head + kv if spec.kv_interleaved else head
    entry = {"L": layer, "K": kv, "H": combined, "T": token}
    index = []
    for axis in spec.block_axes():
        if axis == "D":
            index.append(slice(0, spec.head_dim))
        elif axis.islower():
            index.append(entry[axis.upper()] % packing)
        elif packing is not None and axis == spec.packed_axis:
            index.append(entry[axis] // packing)
        else:
            index.append(entry[axis])
    return tuple(index)


def fill_rank(
    config: EngineConfig,
    rank: int,
    g: np.ndarray,
    arrays: list[np.ndarray],
    block_ids,
    first_token: int = 0,
    layers: tuple[int, int] | None = None,
) -> list[np.ndarray]:
    """Writes the request's tokens (from `first_token`; only the global `layers`, if given)
    into `block_ids` of one rank's
    arrays (``[num_blocks, *block_shape(tp)]``, unsigned ints of the dtype's width, written in
    place); tokens past G are left as they were (a partly filled last block). Returns the
    boolean payload mask of each array's block."""
    tp_rank, pp_rank = config.coordinates(rank)
    l0, _ = config.layer_range(pp_rank)
    h0, h1 = config.head_range(tp_rank)
    spec = config.local_spec(pp_rank)
    t = spec.block_size
    masks = []
    for (layer_key, kv_key), array in zip(spec.array_keys(), arrays):
        mask = np.zeros(array.shape[1:], bool)
        layer_range = range(spec.num_layers) if layer_key is None else [layer_key]
        kvs = range(spec.kv_factor) if kv_key is None else [kv_key]
        for layer in layer_range:
            if layers is not None and not layers[0] <= l0 + layer < layers[1]:
                continue
            for kv in kvs:
                for h in range(h1 - h0):
                    for tok in range(t):
                        index = stored_index(spec, layer, kv, h, tok)
                        mask[index] = True
                        for i, b in enumerate(block_ids):
                            position = first_token + i * t + tok
                            if position < g.shape[3]:
                                array[(b, *index)] = g[l0 + layer, kv, h0 + h, position]
        masks.append(mask)
    return masks


def rank_arrays(config: EngineConfig, rank: int, num_blocks: int, fill) -> list[np.ndarray]:
    """One rank's arrays filled with `fill` (an int byte, or a seed for random bytes)."""
    spec = config.local_spec(config.coordinates(rank)[1])
    width = np.dtype(f"u{spec.itemsize}")
    shape = (num_blocks, *spec.block_shape(config.tp_size))
    out = []
    for index in range(spec.num_arrays):
        if isinstance(fill, tuple):  # ("random", seed)
            rng = np.random.default_rng(fill[1] + 7919 * rank + index)
            raw = rng.integers(0, 256, size=(*shape, spec.itemsize), dtype=np.uint8)
        else:
            raw = np.full((*shape, spec.itemsize), fill, np.uint8)
        out.append(raw.view(width).reshape(shape))
    return out


def global_arrays(config: EngineConfig, pp_rank: int, rank_arrays_of) -> list[np.ndarray]:
    """The global arrays of a pipeline rank's cache: its TP ranks' arrays side by side on
    the stored head axis (tpu-inference pads per rank), one copy of replicated heads."""
    spec = config.local_spec(pp_rank)
    if "H" not in spec.layout or spec.mla:
        return rank_arrays_of(config.rank(0, pp_rank))
    axis = 1 + spec.block_axes().index("H")
    shards = config.tp_size if config.tp_size <= spec.num_kv_heads else spec.num_kv_heads
    step = config.tp_size // shards
    per_rank = [rank_arrays_of(config.rank(tp, pp_rank)) for tp in range(0, config.tp_size, step)]
    return [np.concatenate(parts, axis=axis) for parts in zip(*per_rank)]


def g_cache(spec: KVCacheSpec, num_tokens: int, seed: int) -> np.ndarray:
    """``G[layer, kv, head, token, d]``: random bits as unsigned ints of the dtype's width."""
    rng = np.random.default_rng(seed)
    width = np.dtype(f"u{spec.itemsize}")
    shape = (spec.num_layers, spec.kv_factor, spec.num_kv_heads, num_tokens, spec.head_dim)
    return rng.integers(0, np.iinfo(width).max, size=shape, dtype=width, endpoint=True)


class PackedNumpyEngine:
    """Raw byte buffers of every (rank, region) of an engine of any storage (the planner
    tests' `tt.apply_plan` copies descriptors between them)."""

    def __init__(self, config: EngineConfig, num_blocks: int, fill):
        self.config, self.num_blocks = config, num_blocks
        self.arrays = {r: rank_arrays(config, r, num_blocks, fill)
                       for r in range(config.world_size)}
        self.buffers = {r: [a.reshape(-1).view(np.uint8) for a in arrays]
                        for r, arrays in self.arrays.items()}

    def write_request(self, g, block_ids, first_token: int = 0) -> dict[int, list[np.ndarray]]:
        """Writes the request into every rank; returns each rank's payload masks."""
        return {r: fill_rank(self.config, r, g, self.arrays[r], block_ids, first_token)
                for r in range(self.config.world_size)}

    def copy(self) -> dict[int, list[np.ndarray]]:
        return {r: [a.copy() for a in arrays] for r, arrays in self.arrays.items()}


def expected_rank_arrays(config: EngineConfig, rank: int, num_blocks: int, fill, g, block_ids,
                         first_token: int = 0) -> list[np.ndarray]:
    """One rank's arrays filled with `fill`, the request's tokens written into `block_ids`."""
    arrays = rank_arrays(config, rank, num_blocks, fill)
    fill_rank(config, rank, g, arrays, block_ids, first_token)
    return arrays


def make_cache(config: EngineConfig, num_blocks: int, fill, g=None, block_ids=(), mesh=None):
    """A `PagedKVCache` of pipeline rank 0 over `mesh` (TP ranks in mesh order), every rank's
    shard as `expected_rank_arrays` builds it."""
    from jaxkv import PagedKVCache

    spec = config.local_spec(0)
    arrays = global_arrays(
        config, 0,
        lambda r: (expected_rank_arrays(config, r, num_blocks, fill, g, block_ids)
                   if g is not None else rank_arrays(config, r, num_blocks, fill)),
    )
    return PagedKVCache.from_arrays(spec, [a.view(spec.dtype) for a in arrays], mesh=mesh)


def producer_main(conn, num_devices: int) -> None:
    """One process holding any number of producer engines, each on the first `tp` of
    `num_devices` CPU devices, its cache random bytes with G's tokens in the request's
    blocks. Commands: ("engine", name, spec, tp, g_seed, num_tokens, num_blocks, block_ids,
    engine_kwargs) -> side-channel address; ("pin", name, request_id, block_ids, lease_s) ->
    TransferParams; ("state", name) -> (pinned, freed); ("close", name); ("exit",)."""
    import time

    from support.processes import child_env

    child_env(num_devices)

    from jaxkv.transfer import TransferEngine

    engines: dict = {}
    freed: dict[str, list[str]] = {}
    conn.send("ready")
    try:
        while True:
            if conn.poll(0.0005):
                command = conn.recv()
                if command[0] == "exit":
                    break
                if command[0] == "engine":
                    _, name, spec, tp, g_seed, num_tokens, num_blocks, block_ids, kwargs = command
                    config = EngineConfig(spec, tp)
                    mesh = meshes.tp(tp)
                    g = g_cache(spec, num_tokens, g_seed)
                    cache = make_cache(config, num_blocks, ("random", g_seed), g, block_ids,
                                       mesh)
                    engine = TransferEngine(name, config, **kwargs)
                    engine.register_cache(cache)
                    engines[name], freed[name] = engine, []
                    conn.send(engine.address)
                elif command[0] == "pin":
                    _, name, request_id, block_ids, lease = command
                    conn.send(engines[name].publish_request(request_id, block_ids, lease))
                elif command[0] == "state":
                    conn.send((engines[command[1]].num_pinned, list(freed[command[1]])))
                elif command[0] == "close":
                    engines.pop(command[1]).close()
                    conn.send(True)
            for name, engine in engines.items():
                freed[name].extend(engine.poll().freeable)
            if not engines:
                time.sleep(0.001)
    finally:
        for engine in engines.values():
            engine.close()
