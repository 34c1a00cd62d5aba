"""Independent numpy models of the reshaping ops, written from docs/data-movement.md sections 1-5,
and the engine grid of the split/concat tests (shared by the reshape_*_test suites; not a test)."""

import dataclasses

import numpy as np

from jaxkv import EngineConfig, KVCacheSpec, ops
from jaxkv._spec import SUPPORTED_DTYPES
from support import bits

SIZES = {"L": 3, "K": 2, "H": 4, "T": 8, "D": 8}


def block_shape(layout: str, sizes=None) -> tuple[int, ...]:
    sizes = {**SIZES, **(sizes or {})}
    return tuple(sizes[a] for a in layout)



# ---------------------------------------------------------------------------------------------
# Independent numpy references, token by token, from docs/data-movement.md.


def numpy_merge(cache, ids, ratio, src_layout, dst_layout):
    """docs/data-movement.md section 3: a block's bytes are `ratio` sub-blocks [src_layout, T/ratio]
    back to back; new[.., j*n + t, ..] = recv[j][.., t, ..] with the axes in dst order."""
    out = cache.copy()
    sizes = dict(zip(dst_layout, cache.shape[1:]))
    n = sizes["T"] // ratio
    sub_shape = tuple(n if a == "T" else sizes[a] for a in src_layout)
    rest_src = [a for a in src_layout if a != "T"]
    rest_dst = [a for a in dst_layout if a != "T"]
    for b in ids:
        if b < 0:
            continue
        received = cache[b].reshape(-1).reshape((ratio, *sub_shape))  # the raw bytes
        new = np.empty_like(cache[b])
        for j in range(ratio):
            for t in range(n):
                token = np.take(received[j], t, axis=src_layout.index("T"))
                token = token.transpose([rest_src.index(a) for a in rest_dst])
                index = [slice(None)] * len(dst_layout)
                index[dst_layout.index("T")] = j * n + t
                new[tuple(index)] = token
        out[b] = new
    return out


def numpy_prefix(src, dst, src_ids, dst_ids, num_tokens, layout):
    """docs/data-movement.md section 5: the first n token rows of every slab; n <= 0 or n >= T:
    all."""
    out = dst.copy()
    t_axis = layout.index("T")
    tokens = dst.shape[1 + t_axis]
    n = tokens if num_tokens <= 0 or num_tokens >= tokens else num_tokens
    for s, d in zip(src_ids, dst_ids):
        if s < 0 or d < 0:
            continue
        index = [slice(None)] * len(layout)
        index[t_axis] = slice(0, n)
        out[d][tuple(index)] = src[s][tuple(index)]
    return out



DTYPES = [d.name for d in SUPPORTED_DTYPES]
NUM_BLOCKS = 6
# Row i of every buffer moves sender block SRC_IDS[i] into receiver block DST_IDS[i]: a
# negative sender id gives a zero row (receiver block 5 becomes zero), a negative receiver id
# drops the row.
SRC_IDS = np.array([4, -1, 1, 3], np.int32)
DST_IDS = np.array([0, 5, 2, -1], np.int32)

TP_PAIRS = [(1, 2), (2, 1), (1, 4), (4, 1), (2, 4), (4, 2), (1, 8), (8, 1)]
HEADS = [1, 2, 4, 8]
# (self PP, peer PP, layers, self layers_per_pp, peer layers_per_pp): even and uneven splits.
PP_CASES = [
    (1, 2, 8, None, None), (2, 1, 8, None, None), (2, 4, 8, None, None),
    (1, 2, 7, None, None), (2, 1, 7, None, None), (2, 4, 7, None, None),
    (2, 4, 9, (6, 3), (1, 4, 2, 2)), (4, 2, 9, (1, 4, 2, 2), (6, 3)),
]


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    self_tp: int
    peer_tp: int
    heads: int = 4
    self_pp: int = 1
    peer_pp: int = 1
    layers: int = 4
    self_split: tuple | None = None
    peer_split: tuple | None = None
    mla: bool = False
    dtype: str = "bfloat16"

    def spec(self) -> KVCacheSpec:
        if self.mla:
            return KVCacheSpec.for_mla(num_layers=self.layers, latent_dim=8, block_size=2,
                                       dtype=self.dtype, layout="LKHTD")
        return KVCacheSpec(num_layers=self.layers, num_kv_heads=self.heads, head_dim=4,
                           block_size=2, dtype=self.dtype, layout="LKHTD")

    def configs(self) -> tuple[EngineConfig, EngineConfig]:
        spec = self.spec()
        return (EngineConfig(spec, self.self_tp, self.self_pp, self.self_split),
                EngineConfig(spec, self.peer_tp, self.peer_pp, self.peer_split))


def _grid() -> list[Case]:
    cases = []
    for i, (tp, heads) in enumerate((tp, h) for tp in TP_PAIRS for h in HEADS):
        cases.append(Case(f"tp{tp[0]}to{tp[1]}_h{heads}", tp[0], tp[1], heads,
                          dtype=DTYPES[i % len(DTYPES)]))
    for i, (pp, tps, heads) in enumerate(
            (pp, tps, heads) for pp in PP_CASES for tps in [(1, 1), (2, 4), (4, 1)]
            for heads in [2, 8]):
        self_pp, peer_pp, layers, self_split, peer_split = pp
        cases.append(Case(f"pp{self_pp}to{peer_pp}_l{layers}_{'x'.join(map(str, self_split or ()))}"
                          f"_tp{tps[0]}to{tps[1]}_h{heads}", tps[0], tps[1], heads, self_pp,
                          peer_pp, layers, self_split, peer_split,
                          dtype=DTYPES[(i + 1) % len(DTYPES)]))
    for i, tp in enumerate(TP_PAIRS):
        cases.append(Case(f"mla_tp{tp[0]}to{tp[1]}", tp[0], tp[1], mla=True,
                          dtype=DTYPES[(i + 2) % len(DTYPES)]))
    for i, pp in enumerate(PP_CASES[:6]):
        self_pp, peer_pp, layers, _, _ = pp
        cases.append(Case(f"mla_pp{self_pp}to{peer_pp}_l{layers}", 2, 1, self_pp=self_pp,
                          peer_pp=peer_pp, layers=layers, mla=True,
                          dtype=DTYPES[(i + 3) % len(DTYPES)]))
    return cases


GRID = _grid()
# A sample of the grid that runs through the custom calls in the fast suite; the rest is slow.
FAST = {"tp2to1_h4", "tp1to8_h4", "tp8to1_h2", "tp2to4_h8", "tp4to2_h1", "tp1to4_h2",
        "pp2to4_l7__tp2to4_h2", "pp4to2_l9_1x4x2x2_tp4to1_h8", "pp2to1_l8__tp1to1_h8",
        "mla_tp1to4", "mla_tp8to1", "mla_pp2to1_l7"}
assert {c.name for c in GRID} >= FAST, FAST - {c.name for c in GRID}


# ---------------------------------------------------------------------------------------------
# Independent models from docs/data-movement.md.


def head_range(total_heads: int, tp: int, tp_rank: int, mla: bool) -> tuple[int, int]:
    """Section 2."""
    if mla:
        return 0, 1
    if tp <= total_heads:
        per = total_heads // tp
        return tp_rank * per, (tp_rank + 1) * per
    head = tp_rank // (tp // total_heads)
    return head, head + 1


def layer_ranges(layers: int, pp: int, split) -> list[tuple[int, int]]:
    """Section 2: the first L % pp ranks get one extra layer (or an explicit split)."""
    split = split or [layers // pp + (1 if r < layers % pp else 0) for r in range(pp)]
    starts = np.cumsum([0, *split])
    return [(int(starts[r]), int(starts[r + 1])) for r in range(pp)]


def target_info(case: Case, rank: int, sender_side: bool) -> dict:
    """Section 4's targetIRanks, dup factors and buffer counts for `rank` of the self engine
    (the sender when `sender_side`, else the receiver)."""
    a = (case.self_tp, case.self_pp, case.self_split)
    b = (case.peer_tp, case.peer_pp, case.peer_split)
    (self_tp, self_pp, self_split), (peer_tp, peer_pp, peer_split) = (
        (a, b) if sender_side else (b, a))
    heads = 1 if case.mla else case.heads
    self_h = 1 if case.mla else max(1, heads // self_tp)
    peer_h = 1 if case.mla else max(1, heads // peer_tp)
    tp_rank, pp_rank = rank % self_tp, rank // self_tp
    start, stop = layer_ranges(case.layers, self_pp, self_split)[pp_rank]
    peer_pps, peer_layers = [], []
    for p, (lo, hi) in enumerate(layer_ranges(case.layers, peer_pp, peer_split)):
        if min(stop, hi) > max(start, lo):
            peer_pps.append(p)
            peer_layers.append(min(stop, hi) - max(start, lo))
    d_pp = len(peer_pps)
    if self_tp <= peer_tp:
        d_tp, first = peer_tp // self_tp, tp_rank * (peer_tp // self_tp)
    else:
        d_tp, first = 1, tp_rank // (self_tp // peer_tp)
    iranks = [pp * peer_tp + tp for tp in range(first, first + d_tp) for pp in peer_pps]
    dup = max(1, (self_h * self_tp) // (peer_h * peer_tp))
    peer_dup = max(1, (peer_h * peer_tp) // (self_h * self_tp))
    return dict(
        iranks=iranks, d_pp=d_pp, d_tp=d_tp, peer_layers=peer_layers, dup=dup,
        peer_dup=peer_dup, n_out=len(iranks) // peer_dup, hn=self_h // (d_tp // peer_dup),
        sends=tp_rank % dup == 0,
        connection_buffer=[((p // d_pp) // peer_dup) * d_pp + p % d_pp for p in range(len(iranks))],
        kept=[i * d_pp + j for i in range(d_tp) if i % peer_dup == 0 for j in range(d_pp)],
    )


def numpy_split(local: np.ndarray, ids, info: dict) -> list[np.ndarray]:
    """out[(h // Hn) * dPP + r][b, lid, kv, h % Hn] = block_b[l, kv, h]."""
    _, layers, kv, heads, tokens, dim = local.shape
    d_pp, hn = info["d_pp"], info["hn"]
    offsets = np.cumsum([0, *info["peer_layers"]])
    outs = [np.zeros((len(ids), info["peer_layers"][i % d_pp], kv, hn, tokens, dim), local.dtype)
            for i in range(info["n_out"])]
    for row, b in enumerate(ids):
        if b < 0:
            continue
        for l in range(layers):
            r = int(np.searchsorted(offsets, l, side="right")) - 1
            for h in range(heads):
                outs[(h // hn) * d_pp + r][row, l - offsets[r], :, h % hn] = local[b, l, :, h]
    return outs


def numpy_concat(local: np.ndarray, buffers, ids, info: dict) -> np.ndarray:
    """block_b[l, kv, h] = in[(h // Hn) * dPP + r][b, lid, kv, h % Hn]."""
    out = local.copy()
    _, layers, _, heads, _, _ = local.shape
    d_pp, hn = info["d_pp"], info["hn"]
    offsets = np.cumsum([0, *info["peer_layers"]])
    for row, b in enumerate(ids):
        if b < 0:
            continue
        for l in range(layers):
            r = int(np.searchsorted(offsets, l, side="right")) - 1
            for h in range(heads):
                out[b, l, :, h] = buffers[(h // hn) * d_pp + r][row, l - offsets[r], :, h % hn]
    return out


def global_cache(case: Case, seed: int) -> np.ndarray:
    spec = case.spec()
    shape = (NUM_BLOCKS, spec.num_layers, spec.kv_factor, spec.num_kv_heads, spec.block_size,
             spec.head_dim)
    return bits.random_bits(np.random.default_rng(seed), shape, spec.dtype)


def local_slice(g: np.ndarray, case: Case, tp: int, pp: int, split, rank: int) -> np.ndarray:
    tp_rank, pp_rank = rank % tp, rank // tp
    l0, l1 = layer_ranges(case.layers, pp, split)[pp_rank]
    h0, h1 = head_range(g.shape[3], tp, tp_rank, case.mla)
    return g[:, l0:l1, :, h0:h1]


def round_trip(case: Case, split_fn, concat_fn, check_split=None):
    """Every sender rank splits, buffers are routed by the plan, every receiver rank concats;
    returns {receiver rank: (result, expected)}."""
    g = global_cache(case, seed=len(case.name))
    sender_cfg, receiver_cfg = case.configs()
    delivered = {}
    for s in range(sender_cfg.world_size):
        plan = ops.plan_peers(sender_cfg, receiver_cfg, s)
        if not plan.sends:
            continue
        local = local_slice(g, case, case.self_tp, case.self_pp, case.self_split, s)
        buffers = split_fn(local, sender_cfg, receiver_cfg, s)
        if check_split is not None:
            check_split(local, buffers, s)
        for p, target in enumerate(plan.target_ranks):
            delivered[(s, target)] = buffers[plan.connection_buffers[p]]
    results = {}
    # Receiver blocks start as random bits (untouched blocks must keep them).
    rng = np.random.default_rng(99)
    for r in range(receiver_cfg.world_size):
        plan = ops.plan_peers(receiver_cfg, sender_cfg, r)
        missing = [k for k in plan.kept_ranks if (k, r) not in delivered]
        assert not missing, f"{case.name}: receiver {r} expects buffers from {missing}"
        buffers = [delivered[(k, r)] for k in plan.kept_ranks]
        wanted = local_slice(g, case, case.peer_tp, case.peer_pp, case.peer_split, r)
        initial = bits.random_bits(rng, wanted.shape, wanted.dtype)
        result = concat_fn(initial, buffers, receiver_cfg, sender_cfg, r)
        expected = initial.copy()
        for s_id, d_id in zip(SRC_IDS, DST_IDS):
            if d_id >= 0:
                expected[d_id] = wanted[s_id] if s_id >= 0 else 0
        results[r] = (np.asarray(result), expected)
    return results


