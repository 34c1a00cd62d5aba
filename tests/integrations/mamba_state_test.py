"""Mamba (state-space) groups without vLLM: how a layer's conv and SSM states split into
head-sharded components (checked against vLLM's TP sharding of the conv projections), the
running-state block, and the transfer params of a hybrid model with a Mamba group."""

from __future__ import annotations

import numpy as np
import pytest

from jaxkv.integrations._mamba import (
    clip_state_blocks,
    component_group_name,
    split_state,
    state_components,
)
from jaxkv.integrations._params import GroupedTransfer

# Mamba2: 4 SSM heads of head dim 4, 2 groups of state size 8, conv kernel 4 (3 rows kept)
H, P, N, G, ROWS = 4, 4, 8, 2, 3


def mamba2_shapes(tp: int):
    return [((H * P + 2 * G * N) // tp, ROWS), (H // tp, P, N)]


def vllm_rank_conv(conv: np.ndarray, tp: int, rank: int) -> np.ndarray:
    """vLLM's TP shard of a Mamba2 conv state ``[blocks, dim, rows]``: each projection (x,
    B, C) split on its own, rank ``r`` holding ``x_r | B_r | C_r``."""
    x, b, c = np.split(conv, [H * P, H * P + G * N], axis=1)
    return np.concatenate([np.split(part, tp, axis=1)[rank] for part in (x, b, c)], axis=1)


def test_mamba2_components_and_their_specs():
    comps = state_components("MAMBA2", mamba2_shapes(2), ["bfloat16", "float32"], 2)
    assert [(c.name, c.state, c.heads, c.head_size, c.dtype) for c in comps] == [
        ("conv_x", 0, H, P * ROWS, "bfloat16"), ("conv_b", 0, G * N, ROWS, "bfloat16"),
        ("conv_c", 0, G * N, ROWS, "bfloat16"), ("ssm", 1, H, P * N, "float32")]
    # the same components whatever the TP size (heads are the model's)
    assert comps == state_components("MAMBA2", mamba2_shapes(1), ["bfloat16", "float32"], 1)
    spec = comps[3].spec(num_layers=3)
    assert (spec.block_size, spec.kv_factor, spec.block_shape(2)) == (1, 1, (3, 2, 1, P * N))


@pytest.mark.parametrize("tp", [2, 4])
def test_components_of_vllm_rank_shards_are_head_shards_of_the_whole(tp):
    """Split each rank's state (vLLM's sharding: conv projections split separately) into
    components: per component, the ranks' pieces side by side are the TP 1 component, so
    jaxkv's head-sharded reads between any two TP sizes move the right bytes."""
    rng = np.random.default_rng(tp)
    conv = rng.integers(0, 1 << 16, (5, H * P + 2 * G * N, ROWS)).astype(np.uint16)
    ssm = rng.integers(0, 1 << 31, (5, H, P, N)).astype(np.uint32)
    whole = split_state([conv, ssm], state_components("MAMBA2", mamba2_shapes(1),
                                                      ["uint16", "uint32"], 1), 1)
    comps = state_components("MAMBA2", mamba2_shapes(tp), ["uint16", "uint32"], tp)
    ranks = [split_state([vllm_rank_conv(conv, tp, r), np.split(ssm, tp, axis=1)[r]], comps, tp)
             for r in range(tp)]
    for i, c in enumerate(comps):
        np.testing.assert_array_equal(np.concatenate([rank[i] for rank in ranks], axis=1),
                                      whole[i], err_msg=c.name)
    # negative control: the conv state as one head-sharded array would mix projections
    assert not np.array_equal(np.concatenate([vllm_rank_conv(conv, tp, r) for r in range(tp)],
                                             axis=1), conv)


def test_mamba1_gdn_other_and_replicated_states():
    m1 = state_components("MAMBA1", [(8, 3), (8, 16)], ["float16"], 2)
    assert [(c.name, c.heads, c.head_size) for c in m1] == [("conv", 16, 3), ("ssm", 16, 16)]
    gdn = state_components("GDN_ATTN", [(2 * 6 + 2 * 4, 3), (2, 4, 6)], ["bfloat16"], 1)
    assert [(c.name, c.heads, c.head_size) for c in gdn] == [
        ("conv_q", 6, 3), ("conv_k", 6, 3), ("conv_v", 2, 12), ("ssm", 2, 24)]
    other = state_components("SHORT_CONV", [(16,), (4, 2)], ["float16"], 2)
    assert [(c.name, c.heads, c.head_size) for c in other] == [("state0", 32, 1),
                                                              ("state1", 8, 2)]
    (rep,) = state_components("MAMBA2", [(7, 3)], ["float32"], 4, tp_replicated=True)
    assert rep.replicated and rep.spec(2).mla and rep.spec(2).block_shape(4) == (2, 1, 21)
    with pytest.raises(ValueError, match="Mamba2: conv dim 17"):
        state_components("MAMBA2", [(17, 3), (2, 4, 8)], ["float32"], 1)
    with pytest.raises(ValueError, match="3 state shapes but 2 dtypes"):
        state_components("MAMBA2", [(8,), (8,), (8,)], ["float32", "float16"], 1)


def test_running_state_block():
    assert clip_state_blocks([5], 0) == [5]
    assert clip_state_blocks([0, 0, 5], 0) == [5]  # earlier states, null placeholders
    assert clip_state_blocks([5, 6, 7, 8], 3) == [5]  # three speculative scratch blocks
    assert clip_state_blocks([5, 6], 3) == [5]  # not all scratch allocated yet
    assert component_group_name(2, "conv_x") == "2_conv_x"


def grouped(states=((None, [("conv_x", [("h", 5601)]), ("ssm", [("h", 5602)])])),
            ids=((4, 7, 9), (12,))):
    return GroupedTransfer.make(
        "prefill", [[("h", 5600)], [("h", 5601)]], "r1", ids, 30.0,
        num_tokens=20, block_sizes=[8, 8], first_blocks=[0, 0], states=list(states))


def test_params_with_a_mamba_group_round_trip():
    t = grouped()
    assert sorted(t.params.groups) == ["0", "1_conv_x", "1_ssm"]
    assert t.params.groups["1_ssm"].engine_id == "prefill.1_ssm"
    assert t.params.groups["1_ssm"].block_ids == [12] and t.engine_names(1) == ["1_conv_x",
                                                                               "1_ssm"]
    d = t.to_dict(tp_size=2)
    # NIXL's keys: one list per KV cache group, the Mamba group's one state block
    assert d["remote_block_ids"] == [[4, 7, 9], [12]]
    assert d["jaxkv_states"] == [None, {"components": ["conv_x", "ssm"],
                                        "addresses": [[["h", 5601]], [["h", 5602]]]}]
    assert GroupedTransfer.from_dict(d) == t
    # no Mamba group: no key
    assert "jaxkv_states" not in grouped((), ((4, 7, 9), (1, 2, 3))).to_dict()


def test_params_with_a_mamba_group_refused_when_malformed():
    with pytest.raises(ValueError, match=r"group 1 \(Mamba state\): one block"):
        GroupedTransfer.make(
            "p", [[("h", 1)], [("h", 2)]], "r", [[4, 7, 9], [12, 13]], 30.0, num_tokens=20,
            block_sizes=[8, 8], first_blocks=[0, 0], states=[None, [("ssm", [("h", 2)])]])
    d = grouped().to_dict()
    d["jaxkv_states"] = [None]
    with pytest.raises(ValueError, match="jaxkv_states must list one entry per KV cache group"):
        GroupedTransfer.from_dict(d)
