"""Hybrid models' (several KV cache groups) framework-free connector helpers: settings for the
groups' side channels, grouped transfer params as the router's dict, per-group read plans
(no vLLM needed)."""

from __future__ import annotations

import pytest

from jaxkv.integrations import (
    ConnectorSettings,
    GroupedTransfer,
    group_read_plan_ids,
    transfer_params_from_dict,
)


def test_group_addresses_default_to_consecutive_ports():
    s = ConnectorSettings.from_dict(
        {"engine_id": "p", "side_channel": [["a", 5600], ["b", 5700]]}
    )
    assert s.group_addresses(1) == [[("a", 5600), ("b", 5700)]]
    assert s.group_addresses(3)[2] == [("a", 5602), ("b", 5702)]
    free = ConnectorSettings.from_dict({"engine_id": "p", "side_channel": [["a", 0]]})
    assert free.group_addresses(2) == [[("a", 0)], [("a", 0)]]  # each picks a free port


def test_group_ports_setting():
    s = ConnectorSettings.from_dict(
        {"engine_id": "p", "side_channel": [["a", 5600], ["b", 5700]],
         "group_ports": [[5600, 6000], ["5700", 6100]]}
    )
    assert s.group_ports == ((5600, 6000), (5700, 6100))
    assert s.group_addresses(2) == [[("a", 5600), ("b", 5700)], [("a", 6000), ("b", 6100)]]
    with pytest.raises(ValueError, match="one per KV cache group"):
        s.group_addresses(3)
    with pytest.raises(ValueError, match="group_ports must be a list"):
        ConnectorSettings.from_dict({"engine_id": "p", "group_ports": [5600]})


def transfer(**overrides):
    kwargs = dict(
        engine_id="prefill",
        group_addresses=[[("h", 5600)], [("h", 5601)]],
        request_id="r-1",
        group_block_ids=[[4, 7, 9, 2], [8, 3]],
        lease_s=12.5,
        num_tokens=20,
        block_sizes=[8, 8],
        first_blocks=[0, 1],
    )
    kwargs.update(overrides)
    return GroupedTransfer.make(**kwargs)


def old_grouped_dict(t: GroupedTransfer) -> dict:
    """The hybrid kv_transfer_params jaxkv sent before NIXL's shape (``remote_groups``)."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": t.engine_id,
        "remote_request_id": t.params.request_id,
        "remote_lease_s": t.params.groups["0"].lease_s,
        "remote_num_tokens": t.num_tokens,
        "remote_groups": [
            {"addresses": [[h, p] for h, p in t.params.groups[str(g)].addresses],
             "block_ids": list(t.params.groups[str(g)].block_ids),
             "first_block": t.first_blocks[g], "block_size": t.block_sizes[g]}
            for g in range(t.num_groups)
        ],
    }


def test_grouped_transfer_round_trip_through_the_router_dict():
    t = transfer()
    # cut to the blocks holding 20 tokens: 3 in the full group, positions 1-2 in the other
    assert t.params.groups["0"].block_ids == [4, 7, 9]
    assert t.params.groups["1"].block_ids == [8, 3]
    assert t.params.groups["1"].engine_id == "prefill.1"
    assert t.params.groups["1"].addresses == [("h", 5601)]
    assert t.engine_id == "prefill" and t.params.request_id == "r-1"
    d = t.to_dict(tp_size=1)
    assert d["do_remote_prefill"] and not d["do_remote_decode"]
    # NIXL's keys: one block id list per group, group 0's first process's side channel
    assert d["remote_block_ids"] == [[4, 7, 9], [8, 3]]
    assert (d["remote_host"], d["remote_port"], d["tp_size"]) == ("h", 5600, 1)
    assert (d["remote_num_tokens"], d["remote_block_size"]) == (20, 8)
    # jaxkv's beside them
    assert d["jaxkv_addresses"] == [[["h", 5600]], [["h", 5601]]]
    assert d["jaxkv_first_blocks"] == [0, 1] and d["jaxkv_block_sizes"] == [8, 8]
    assert d["jaxkv_lease_s"] == 12.5 and "remote_groups" not in d
    assert GroupedTransfer.from_dict(d) == t
    # a single-group consumer refuses it by name, and the other way round
    with pytest.raises(ValueError, match="2 KV cache groups"):
        transfer_params_from_dict(d)
    with pytest.raises(ValueError, match="one KV cache group"):
        GroupedTransfer.from_dict({**d, "remote_block_ids": [[4, 7, 9]],
                                   "jaxkv_addresses": [[["h", 5600]]],
                                   "jaxkv_first_blocks": [0], "jaxkv_block_sizes": [8]})
    with pytest.raises(ValueError, match="one KV cache group"):
        GroupedTransfer.from_dict({"remote_block_ids": [1], "remote_addresses": [["h", 1]]})


def test_deprecated_grouped_params_accepted_for_one_release():
    t = transfer()
    d = old_grouped_dict(t)
    assert GroupedTransfer.from_dict(d) == t
    with pytest.raises(ValueError, match="2 KV cache groups"):
        transfer_params_from_dict(d)
    with pytest.raises(ValueError, match="lack"):
        GroupedTransfer.from_dict({k: v for k, v in d.items() if k != "remote_num_tokens"})
    broken = {**d, "remote_groups": [d["remote_groups"][0], {"block_ids": [1]}]}
    with pytest.raises(ValueError, match=r"remote_groups\[1\] lacks"):
        GroupedTransfer.from_dict(broken)
    with pytest.raises(ValueError, match="non-empty list"):
        GroupedTransfer.from_dict({**d, "remote_groups": []})


def test_grouped_transfer_errors():
    with pytest.raises(ValueError, match="group 1: 20 tokens from block 1 on need 2 blocks"):
        transfer(group_block_ids=[[4, 7, 9], [8]])
    with pytest.raises(ValueError, match="per-group lists differ"):
        transfer(first_blocks=[0])
    with pytest.raises(ValueError, match="addresses"):
        transfer(group_addresses=[[("h", 5600)], []])
    d = transfer().to_dict()
    with pytest.raises(ValueError, match="lack"):
        GroupedTransfer.from_dict({k: v for k, v in d.items() if k != "remote_num_tokens"})
    with pytest.raises(ValueError, match="one per KV cache group"):
        GroupedTransfer.from_dict({**d, "jaxkv_first_blocks": [0]})
    with pytest.raises(ValueError, match="malformed"):
        GroupedTransfer.from_dict({**d, "jaxkv_addresses": [[["h"]], [["h", 1]]]})
    with pytest.raises(ValueError, match="non-empty list"):
        GroupedTransfer.from_dict({**d, "remote_block_ids": []})


@pytest.mark.parametrize(
    "remote, rfirst, tokens, rbs, local, lfirst, lbs, expected",
    [
        # full attention, no hit: every block
        ([3, 4, 5], 0, 20, 8, [7, 8, 9, 10], 0, 8, ([3, 4, 5], [7, 8, 9])),
        # full attention after a 2-block local hit
        ([3, 4, 5, 6], 0, 30, 8, [9, 1], 2, 8, ([5, 6], [9, 1])),
        # sliding window: the producer kept positions 2-4, the consumer fills 3-4
        ([6, 7, 8], 2, 40, 8, [11, 12], 3, 8, ([7, 8], [11, 12])),
        # a consumer block of 2 producer blocks: position 1 covers producer positions 2-3
        ([6, 7, 8], 2, 40, 8, [11, 12], 1, 16, ([6, 7, 8], [11, 12])),
        # nothing left to read in this group (its tokens were all a local hit)
        ([6, 7], 1, 24, 8, [], 3, 8, ([], [])),
    ],
)
def test_group_read_plan_ids(remote, rfirst, tokens, rbs, local, lfirst, lbs, expected):
    assert group_read_plan_ids(remote, rfirst, tokens, rbs, local, lfirst, lbs) == expected


def test_group_read_plan_ids_errors():
    with pytest.raises(ValueError, match="not a multiple"):
        group_read_plan_ids([1, 2], 0, 16, 16, [1], 0, 8)
    with pytest.raises(ValueError, match="need 2 remote blocks"):
        group_read_plan_ids([1], 1, 24, 8, [5, 6], 1, 8)
    with pytest.raises(ValueError, match="need 2 local blocks"):
        group_read_plan_ids([1, 2], 1, 24, 8, [5], 1, 8)
    # the consumer's 16-token block 1 starts at token 16, the producer kept from token 24 on
    with pytest.raises(ValueError, match="blocks in between are gone"):
        group_read_plan_ids([7, 8], 3, 40, 8, [11, 12], 1, 16)
