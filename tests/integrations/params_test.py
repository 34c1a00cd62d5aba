"""`jaxkv.integrations`' framework-free helpers (no vLLM needed)."""

from __future__ import annotations

import importlib.util
import json
import logging
import subprocess
import sys

import pytest

from jaxkv.integrations import (
    ConnectorSettings,
    _params,
    read_plan_ids,
    transfer_params_from_dict,
    transfer_params_to_dict,
)
from jaxkv.transfer import TransferParams


def test_settings():
    s = ConnectorSettings.from_dict(
        {"side_channel": [["10.0.0.1", "5600"]], "tp_size": 2}, default_engine_id="p"
    )
    assert s.engine_id == "p" and s.side_channel == (("10.0.0.1", 5600),) and s.tp_size == 2
    with pytest.raises(ValueError, match="unknown jaxkv connector settings"):
        ConnectorSettings.from_dict({"engine_id": "p", "lease": 3})
    with pytest.raises(ValueError, match="needs an engine_id"):
        ConnectorSettings.from_dict({})
    with pytest.raises(ValueError, match="side_channel"):
        ConnectorSettings.from_dict({"engine_id": "p", "side_channel": [5600]})
    with pytest.raises(ValueError, match="lease_s"):
        ConnectorSettings.from_dict({"engine_id": "p", "lease_s": 0})


def test_params_round_trip():
    params = TransferParams("prefill", [("h", 1), ("h", 2)], "r-1", [5, 3, 9], 12.5)
    d = transfer_params_to_dict(params, 20, 8, tp_size=2)
    assert d["do_remote_prefill"] and not d["do_remote_decode"]
    # NIXL's keys and shapes: one block id list per KV cache group, the first process's host
    assert d["remote_block_ids"] == [[5, 3, 9]]
    assert (d["remote_host"], d["remote_port"], d["tp_size"]) == ("h", 1, 2)
    assert (d["remote_num_tokens"], d["remote_block_size"]) == (20, 8)
    # jaxkv's beside them
    assert d["jaxkv_addresses"] == [[["h", 1], ["h", 2]]] and d["jaxkv_lease_s"] == 12.5
    assert d["jaxkv_block_sizes"] == [8] and d["jaxkv_first_blocks"] == [0]
    assert "remote_addresses" not in d and "remote_groups" not in d
    assert json.loads(json.dumps(d)) == d
    back = transfer_params_from_dict(d)
    assert back == params
    for key in ("remote_engine_id", "remote_block_ids", "jaxkv_addresses", "jaxkv_lease_s"):
        with pytest.raises(ValueError, match=key):
            transfer_params_from_dict({k: v for k, v in d.items() if k != key})
    with pytest.raises(ValueError, match="malformed"):
        transfer_params_from_dict({**d, "remote_block_ids": [["x"]]})
    with pytest.raises(ValueError, match="one per KV cache group"):
        transfer_params_from_dict({**d, "remote_block_ids": [5, 3, 9]})  # flat: not NIXL's
    with pytest.raises(ValueError, match="no producer address"):
        transfer_params_from_dict({**d, "jaxkv_addresses": [[]]})
    with pytest.raises(ValueError, match="one per KV cache group"):
        transfer_params_from_dict({**d, "jaxkv_addresses": [[["h", 1]], [["h", 2]]]})


def old_flat_dict(params: TransferParams, num_tokens: int, block_size: int) -> dict:
    """The one-group kv_transfer_params jaxkv sent before NIXL's shape."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": params.engine_id,
        "remote_addresses": [[host, port] for host, port in params.addresses],
        "remote_request_id": params.request_id,
        "remote_block_ids": list(params.block_ids),
        "remote_lease_s": params.lease_s,
        "remote_num_tokens": num_tokens,
        "remote_block_size": block_size,
    }


def test_deprecated_flat_params_accepted_for_one_release(caplog):
    params = TransferParams("prefill", [("h", 1), ("h", 2)], "r-1", [5, 3, 9], 12.5)
    d = old_flat_dict(params, 20, 8)
    _params._deprecation_logged = False
    with caplog.at_level(logging.WARNING, logger="jaxkv.integrations.vllm"):
        assert transfer_params_from_dict(d) == params
        assert transfer_params_from_dict(d) == params
    deprecations = [r for r in caplog.records if "deprecated" in r.getMessage()]
    assert len(deprecations) == 1  # logged once
    for key in ("remote_engine_id", "remote_block_ids", "remote_lease_s"):
        with pytest.raises(ValueError, match=key):
            transfer_params_from_dict({k: v for k, v in d.items() if k != key})
    with pytest.raises(ValueError, match="malformed"):
        transfer_params_from_dict({**d, "remote_block_ids": ["x"]})
    with pytest.raises(ValueError, match="no producer address"):
        transfer_params_from_dict({**d, "remote_addresses": []})


def test_a_nixl_router_carries_jaxkv_params_unchanged():
    """A router or proxy that knows only vLLM NIXL connector's keys reads what it needs from
    jaxkv's params, and passes them on as they are (JSON)."""
    from jaxkv.integrations import GroupedTransfer

    one = transfer_params_to_dict(
        TransferParams("prefill", [("10.0.0.1", 5600), ("10.0.0.2", 5600)], "r-1", [5, 3], 30.0),
        20, 16, tp_size=2)
    hybrid = GroupedTransfer.make(
        "prefill", [[("10.0.0.1", 5600)], [("10.0.0.1", 5601)]], "r-2", [[4, 7], [8]], 30.0,
        num_tokens=20, block_sizes=[16, 16], first_blocks=[0, 1]).to_dict(tp_size=1)

    def nixl_router_view(d):  # the keys NIXL's scheduler and worker read (vLLM 0.33)
        return (d["remote_engine_id"], d["remote_request_id"], d["remote_host"],
                d["remote_port"], [list(g) for g in d["remote_block_ids"]],
                d.get("tp_size", 1), d.get("remote_num_tokens"), d.get("remote_block_size"))

    assert nixl_router_view(one) == ("prefill", "r-1", "10.0.0.1", 5600, [[5, 3]], 2, 20, 16)
    assert nixl_router_view(hybrid) == (
        "prefill", "r-2", "10.0.0.1", 5600, [[4, 7], [8]], 1, 20, 16)
    for d in (one, hybrid):
        carried = json.loads(json.dumps(d))  # through the router
        assert nixl_router_view(carried) == nixl_router_view(d)
    assert transfer_params_from_dict(json.loads(json.dumps(one))).block_ids == [5, 3]
    assert GroupedTransfer.from_dict(json.loads(json.dumps(hybrid))).params.groups[
        "1"].block_ids == [8]


@pytest.mark.parametrize(
    "remote, tokens, rbs, local, lbs, hit, expected",
    [
        ([3, 4, 5], 20, 8, [7, 8, 9, 10], 8, 0, ([3, 4, 5], [7, 8, 9])),  # extra local block
        ([3, 4, 5, 6], 50, 16, [9, 8, 2], 16, 2, ([3, 4, 5, 6], [9, 8])),  # local prefix hit
        ([3, 4, 5, 6], 64, 16, [9, 8], 32, 0, ([3, 4, 5, 6], [9, 8])),  # consumer blocks x2
        ([3, 4, 5, 6, 1], 64, 16, [9, 8], 32, 0, ([3, 4, 5, 6], [9, 8])),  # extra remote block
    ],
)
def test_read_plan_ids(remote, tokens, rbs, local, lbs, hit, expected):
    assert read_plan_ids(remote, tokens, rbs, local, lbs, hit) == expected


def test_read_plan_ids_errors():
    with pytest.raises(ValueError, match="not a multiple"):
        read_plan_ids([1, 2], 16, 16, [1], 8)
    with pytest.raises(ValueError, match="need 3 remote blocks"):
        read_plan_ids([1, 2], 20, 8, [1, 2, 3], 8)
    with pytest.raises(ValueError, match="need 3 local blocks"):
        read_plan_ids([1, 2, 3], 20, 8, [1, 2], 8)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed")
def test_vllm_module_without_vllm_names_what_is_missing():
    code = "import jaxkv.integrations, jaxkv.integrations.vllm"
    out = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True)
    assert out.returncode != 0
    assert "jaxkv.integrations.vllm needs vLLM 0.33" in out.stderr


def test_early_read_grace_setting():
    s = ConnectorSettings.from_dict({"engine_id": "p"})
    assert s.early_read_grace_s == 5.0
    s = ConnectorSettings.from_dict({"engine_id": "p", "early_read_grace_s": 0.5})
    assert s.early_read_grace_s == 0.5
    with pytest.raises(ValueError, match="early_read_grace_s"):
        ConnectorSettings.from_dict({"engine_id": "p", "early_read_grace_s": -1})


def test_scheduler_params_round_trip_through_the_router_dict():
    from jaxkv.transfer import make_transfer_params

    params = make_transfer_params(
        "prefill", [("h", 1), ("h", 2)], "r-1", [5, 3, 9, 4], 12.5, num_tokens=20, block_size=8
    )
    assert params.block_ids == [5, 3, 9]
    assert transfer_params_from_dict(transfer_params_to_dict(params, 20, 8)) == params
    assert transfer_params_from_dict(old_flat_dict(params, 20, 8)) == params


def test_reads_per_request_setting():
    assert ConnectorSettings.from_dict({"engine_id": "p"}).reads_per_request == 1
    s = ConnectorSettings.from_dict({"engine_id": "p", "reads_per_request": 2})
    assert s.reads_per_request == 2
    with pytest.raises(ValueError, match="reads_per_request"):
        ConnectorSettings.from_dict({"engine_id": "p", "reads_per_request": 0})


def test_transport_and_head_dim_settings():
    """``transport`` reaches the engine's keyword arguments only when set (a non-empty str);
    ``head_dim`` (tpu-inference) is read like ``num_kv_heads``."""
    base = {"engine_id": "p"}
    assert ConnectorSettings.from_dict(base).engine_options() == {}
    settings = ConnectorSettings.from_dict({**base, "transport": "jax", "head_dim": 96})
    assert settings.engine_options() == {"transport": "jax"} and settings.head_dim == 96
    for bad in ("", 3):
        with pytest.raises(ValueError, match="transport must be a non-empty str"):
            ConnectorSettings.from_dict({**base, "transport": bad})


def test_auth_key_file_and_allow_unauthenticated_settings(tmp_path):
    """``auth_key_file`` reaches the engine as the key's bytes (read and checked when the
    settings are read); ``allow_unauthenticated`` only when set."""
    path = tmp_path / "jaxkv.key"
    path.write_bytes(b"0123456789abcdef0123456789abcdef\n")
    settings = ConnectorSettings.from_dict({"engine_id": "p", "auth_key_file": str(path)})
    assert settings.engine_options() == {"auth_key": b"0123456789abcdef0123456789abcdef"}
    assert "0123456789abcdef" not in repr(settings)  # the path is shown, never the key
    open_settings = ConnectorSettings.from_dict({"engine_id": "p",
                                                 "allow_unauthenticated": True})
    assert open_settings.engine_options() == {"allow_unauthenticated": True}
    with pytest.raises(ValueError, match="auth_key_file"):
        ConnectorSettings.from_dict({"engine_id": "p", "auth_key_file": str(tmp_path / "no")})
    (tmp_path / "short.key").write_bytes(b"short")
    with pytest.raises(ValueError, match="at least 16 bytes"):
        ConnectorSettings.from_dict({"engine_id": "p",
                                     "auth_key_file": str(tmp_path / "short.key")})
    with pytest.raises(ValueError, match="allow_unauthenticated must be a bool"):
        ConnectorSettings.from_dict({"engine_id": "p", "allow_unauthenticated": "yes"})
