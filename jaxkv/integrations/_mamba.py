"""State-space (Mamba) KV cache groups of vLLM's hybrid models, as jaxkv cache groups.

vLLM gives the Mamba layers of a hybrid model (Jamba, Nemotron-H, Granite 4, Qwen3-Next) a
KV cache group of their own (``MambaSpec``): a block holds a request's recurrent *state*
(one conv state and one SSM state per layer), not tokens. A request's running state is one
block; vLLM's NIXL connector moves exactly that block (after dropping the speculative
decoding scratch blocks vLLM appends, `clip_state_blocks`).

Tensor parallelism shards every state by channels or heads, contiguously per rank, but the
conv state concatenates several projections that are each sharded on their own (Mamba2:
``x | B | C``; GDN: ``Q | K | V``): rank ``r`` holds ``x_r | B_r | C_r``, so the conv state is
not one head-sharded array. jaxkv therefore describes each such piece as its own
*state component*, an array whose head axis TP shards contiguously (``KVCacheSpec`` with
one-block "tokens": ``block_size=1``, ``kv_factor=1``): the conv projections as channel heads
of ``conv_rows`` elements (vLLM's "DS" conv layout ``[dim, rows]``), the SSM state as its heads.
Each component is one cache group of the worker's `jaxkv.transfer.TransferEngine`, so a
request's state moves beside its attention blocks, bit exact, between any TP sizes that
divide the heads (as vLLM's NIXL connector reads conv state in three pieces).

This module imports neither vLLM nor JAX: both connector sides use it (the scheduler to
name the components' side channels, the worker to build their specs).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from jaxkv._spec import KVCacheSpec

__all__ = [
    "StateComponent",
    "clip_state_blocks",
    "component_group_name",
    "components_of",
    "split_state",
    "state_components",
    "state_specs",
]


@dataclasses.dataclass(frozen=True)
class StateComponent:
    """One array of a Mamba layer's state, as jaxkv moves it.

    Attributes:
      name: ``"conv_x"``, ``"conv_b"``, ``"conv_c"`` (Mamba2), ``"conv_q"``, ``"conv_k"``,
        ``"conv_v"`` (GDN), ``"conv"`` (Mamba1), ``"ssm"``, or ``"state<i>"`` (other types).
      state: which of the ``MambaSpec.shapes`` it is part of (0: conv, 1: SSM).
      heads: units TP shards, over the whole model (per-rank count times TP size); 1 for a
        replicated state.
      head_size: elements per unit.
      dtype: the element type's name.
      replicated: every TP rank holds the whole state (vLLM's ``tp_replicated``).

    Example:
      >>> StateComponent("ssm", 1, 8, 64, "float32").spec(num_layers=2).block_shape(tp_size=2)
      (2, 4, 1, 64)
    """

    name: str
    state: int
    heads: int
    head_size: int
    dtype: str
    replicated: bool = False

    def spec(self, num_layers: int, layout: str = "LHTD") -> KVCacheSpec:
        """The `jaxkv.KVCacheSpec` of this component for `num_layers` layers: one state per
        block (``block_size=1``), heads sharded by TP (a replicated state: one MLA-like head
        on every rank).

        Args:
          num_layers: the group's layers.
          layout: the block layout (``H``, ``T`` and ``D`` in it; ``K`` is absent).
        """
        if self.replicated:
            return KVCacheSpec(num_layers, 1, self.heads * self.head_size, 1, self.dtype,
                               layout.replace("H", ""), kv_factor=1, mla=True)
        return KVCacheSpec(num_layers, self.heads, self.head_size, 1, self.dtype, layout,
                           kv_factor=1)


def _name(dtype: Any) -> str:
    """A dtype's name (torch ``torch.float16`` -> ``"float16"``, numpy's as is)."""
    text = str(dtype)
    return text.removeprefix("torch.")


def _mamba_type(mamba_type: Any) -> str:
    """vLLM's ``MambaAttentionBackendEnum`` member (or its name) as a lowercase name."""
    name = getattr(mamba_type, "name", None) or str(mamba_type)
    return name.rsplit(".", 1)[-1].lower()


def state_components(
    mamba_type: Any,
    shapes: Sequence[Sequence[int]],
    dtypes: Sequence[Any],
    tp_size: int,
    tp_replicated: bool = False,
) -> tuple[StateComponent, ...]:
    """The state components of one Mamba layer of vLLM's ``MambaSpec`` (per-rank shapes).

    Args:
      mamba_type: ``MambaSpec.mamba_type`` (``MAMBA1``, ``MAMBA2``, ``GDN_ATTN`` are split
        into their projections; any other type: one component per state, its first axis the
        heads).
      shapes: ``MambaSpec.shapes``: per state, its shape on one TP rank; the conv state in
        vLLM's "DS" layout ``(dim, rows)``.
      dtypes: ``MambaSpec.dtypes`` (one for all states, or one per state).
      tp_size: the engine's TP size (the shapes are one rank's).
      tp_replicated: every rank holds the whole state (``MambaSpec.tp_replicated``).

    Returns:
      The components, conv projections first.

    Raises:
      ValueError: shapes that do not decompose as the type's projections.

    Example:
      >>> [(c.name, c.heads, c.head_size) for c in
      ...  state_components("MAMBA2", [(24, 3), (2, 8, 4)], ["float16", "float32"], 2)]
      [('conv_x', 4, 24), ('conv_b', 8, 3), ('conv_c', 8, 3), ('ssm', 4, 32)]
    """
    shapes = [tuple(int(d) for d in s) for s in shapes]
    dtypes = [_name(d) for d in dtypes]
    if not shapes:
        raise ValueError("a Mamba state of no arrays")
    if len(dtypes) == 1:
        dtypes = dtypes * len(shapes)
    if len(dtypes) != len(shapes):
        raise ValueError(f"{len(shapes)} state shapes but {len(dtypes)} dtypes")
    if tp_replicated:
        return tuple(
            StateComponent(f"state{i}", i, 1, math.prod(s), dtypes[i], replicated=True)
            for i, s in enumerate(shapes)
        )
    kind = _mamba_type(mamba_type)
    tp = int(tp_size)

    def heads(state: int, name: str, count: int, size: int) -> StateComponent:
        return StateComponent(name, state, count * tp, size, dtypes[state])

    if kind in ("mamba1", "mamba2", "gdn_attn") and len(shapes) == 2 and len(shapes[0]) == 2:
        (dim, rows), temporal = shapes
        ssm = heads(1, "ssm", temporal[0], math.prod(temporal[1:]))
        if kind == "mamba1":
            if temporal[0] != dim:
                raise ValueError(f"Mamba1: SSM state dim {temporal[0]} is not the conv dim {dim}")
            return (heads(0, "conv", dim, rows), ssm)
        if kind == "mamba2":
            # x: the SSM heads' channels; B and C: equal halves of the rest
            num_heads, head_dim = temporal[0], temporal[1]
            rest = dim - num_heads * head_dim
            if rest <= 0 or rest % 2:
                raise ValueError(
                    f"Mamba2: conv dim {dim} is not {num_heads} heads x {head_dim} + 2 x groups")
            return (heads(0, "conv_x", num_heads, head_dim * rows),
                    heads(0, "conv_b", rest // 2, rows), heads(0, "conv_c", rest // 2, rows),
                    ssm)
        # GDN: conv = Q | K | V, dim(Q) == dim(K); V: the SSM's value heads' channels
        num_v_heads, v_dim = temporal[0], temporal[1]
        rest = dim - num_v_heads * v_dim
        if rest <= 0 or rest % 2:
            raise ValueError(
                f"GDN: conv dim {dim} is not 2 x key dim + {num_v_heads} heads x {v_dim}")
        return (heads(0, "conv_q", rest // 2, rows), heads(0, "conv_k", rest // 2, rows),
                heads(0, "conv_v", num_v_heads, v_dim * rows), ssm)
    return tuple(
        heads(i, f"state{i}", s[0] if s else 1, math.prod(s[1:]) if len(s) > 1 else 1)
        for i, s in enumerate(shapes)
    )


def components_of(spec: Any, tp_size: int) -> tuple[StateComponent, ...]:
    """`state_components` of a vLLM ``MambaSpec``."""
    return state_components(spec.mamba_type, spec.shapes, spec.dtypes, tp_size,
                            bool(getattr(spec, "tp_replicated", False)))


def state_specs(
    components: Sequence[StateComponent], num_layers: int, layout: str = "LHTD"
) -> tuple[KVCacheSpec, ...]:
    """Per component, its `jaxkv.KVCacheSpec` for a group of `num_layers` Mamba layers.

    Example:
      >>> comps = state_components("MAMBA1", [(8, 3), (8, 16)], ["float32"], 1)
      >>> [s.block_shape() for s in state_specs(comps, 2)]
      [(2, 8, 1, 3), (2, 8, 1, 16)]
    """
    return tuple(c.spec(num_layers, layout) for c in components)


def component_group_name(group: int, component: StateComponent | str) -> str:
    """The `jaxkv.transfer.TransferEngine` cache group of one state component of vLLM's KV
    cache group `group` (no dot: the group's protocol engine is ``<engine_id>.<name>``).

    Example:
      >>> component_group_name(1, "ssm")
      '1_ssm'
    """
    name = component if isinstance(component, str) else component.name
    return f"{int(group)}_{name}"


def clip_state_blocks(block_ids: Sequence[int], num_speculative_blocks: int) -> list[int]:
    """A Mamba group's block that holds a request's running state: vLLM appends
    `num_speculative_blocks` scratch blocks for speculative decoding and keeps earlier
    states (or null placeholders) before it (as vLLM's ``clip_ssm_state_blocks``).

    Example:
      >>> clip_state_blocks([0, 0, 7, 8, 9], 2), clip_state_blocks([7], 3), clip_state_blocks([], 1)
      ([7], [7], [])
    """
    ids = list(block_ids)
    if not ids:
        return ids
    scratch = min(int(num_speculative_blocks), len(ids) - 1)
    if scratch:
        ids = ids[:-scratch]
    return ids[-1:]


def split_state(
    states: Sequence[Any], components: Sequence[StateComponent], tp_size: int
) -> list[Any]:
    """One TP rank's states in vLLM's layout (per state, ``[blocks, *shape]``; the conv state
    ``[blocks, dim, rows]``) as its component arrays ``[blocks, heads, head_size]`` (this
    rank's heads): each component is a contiguous run of its state's elements, in component
    order. numpy or JAX arrays.

    Example:
      >>> import numpy as np
      >>> comps = state_components("MAMBA2", [(24, 3), (2, 8, 4)], ["float32"], 1)
      >>> conv, ssm = np.zeros((5, 24, 3)), np.zeros((5, 2, 8, 4))
      >>> [a.shape for a in split_state([conv, ssm], comps, 1)]
      [(5, 2, 24), (5, 4, 3), (5, 4, 3), (5, 2, 32)]
    """
    out = []
    offsets = [0] * len(states)
    for c in components:
        state = states[c.state]
        flat = state.reshape(state.shape[0], -1)
        heads = c.heads if c.replicated else c.heads // int(tp_size)
        size = heads * c.head_size
        start = offsets[c.state]
        out.append(flat[:, start:start + size].reshape(state.shape[0], heads, c.head_size))
        offsets[c.state] = start + size
    for s, (state, used) in enumerate(zip(states, offsets)):
        if used != math.prod(state.shape[1:]):
            raise ValueError(f"state {s}: the components cover {used} of its "
                             f"{math.prod(state.shape[1:])} elements per block")
    return out
