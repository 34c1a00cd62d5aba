"""Framework-free pieces of the connectors: settings, transfer parameters as plain dicts (what
travels through a router as JSON), and which blocks a consumer reads."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from jaxkv.transfer import TransferParams

__all__ = [
    "ConnectorSettings",
    "read_plan_ids",
    "transfer_params_from_dict",
    "transfer_params_to_dict",
]

# Keys of a consumer request's kv_transfer_params (besides vLLM's do_remote_prefill/decode).
_PARAM_KEYS = (
    "remote_engine_id",
    "remote_addresses",
    "remote_request_id",
    "remote_block_ids",
    "remote_lease_s",
    "remote_num_tokens",
    "remote_block_size",
)


@dataclasses.dataclass(frozen=True)
class ConnectorSettings:
    """A connector's settings (vLLM: ``kv_connector_extra_config``).

    Attributes:
      engine_id: this engine's name; every process of the engine uses the same.
      side_channel: ``(host, port)`` of each of this engine's worker processes, in process
        order (one per TP rank process, or one for a process that holds every rank). The
        scheduler of a producer hands them to consumers; each worker listens on its own. Port
        0 lets a worker pick a free port (then the scheduler must be told the real ones).
      tp_size, pp_size: the engine's parallel sizes.
      tp_rank: the TP rank of this worker process; None when one process holds every rank
        (TP ranks as devices of one process).
      process_index: which entry of `side_channel` this worker listens on.
      lease_s: how long a producer pins a request's blocks without a consumer heartbeat.
      read_timeout_s: the consumer's deadline for a request's reads and confirmations.
      handshake_timeout_s: the bound of each metadata fetch from a producer.
      reads_per_request: producer: how many consumer requests read each request (the
        blocks are freed after that many reads finished, or the lease expired).
      early_read_grace_s: producer: how long a consumer's read of a request the workers have
        not pinned yet waits for them to (`KVTransferEngine`'s ``early_read_grace_s``).
      num_kv_heads: the model's KV heads, when a worker registers one TP rank's cache (its
        heads only); None: the cache's heads times `tp_size` (tpu-inference: the model's).
      head_dim: tpu-inference: the model's head dim (its cache stores it padded to 128 lanes);
        None: the model config's.
      transport: the transfer engine's transport, passed to `KVTransferEngine` as its
        ``transport`` argument; None: the engine's default (NIXL).

    Example:
      >>> ConnectorSettings.from_dict({"engine_id": "p", "side_channel": [["127.0.0.1", 5600]]})
      ... # doctest: +ELLIPSIS
      ConnectorSettings(engine_id='p', side_channel=(('127.0.0.1', 5600),), ...)
    """

    engine_id: str
    side_channel: tuple[tuple[str, int], ...] = ()
    tp_size: int = 1
    pp_size: int = 1
    tp_rank: int | None = None
    process_index: int = 0
    lease_s: float = 30.0
    read_timeout_s: float = 30.0
    handshake_timeout_s: float = 5.0
    early_read_grace_s: float = 5.0
    reads_per_request: int = 1
    num_kv_heads: int | None = None
    head_dim: int | None = None
    transport: str | None = None

    def engine_options(self) -> dict[str, Any]:
        """Keyword arguments for `KVTransferEngine` beyond the timeouts: the transport when
        one is set (an engine without that setting then refuses it by name)."""
        return {} if self.transport is None else {"transport": self.transport}

    @classmethod
    def from_dict(cls, extra: Mapping[str, Any], default_engine_id: str | None = None):
        """Reads the settings from a dict (unknown keys raise: a typo must not be ignored).

        Raises:
          ValueError: unknown keys, no engine id, or malformed values.
        """
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(extra) - names)
        if unknown:
            raise ValueError(f"unknown jaxkv connector settings {unknown}; known: {sorted(names)}")
        values = dict(extra)
        values.setdefault("engine_id", default_engine_id)
        if not values.get("engine_id"):
            raise ValueError("the jaxkv connector needs an engine_id")
        try:
            values["side_channel"] = tuple(
                (str(host), int(port)) for host, port in values.get("side_channel", ())
            )
        except (TypeError, ValueError) as error:
            raise ValueError(
                f"side_channel must be a list of [host, port], got {extra.get('side_channel')!r}"
            ) from error
        settings = cls(**values)
        for name in ("tp_size", "pp_size", "reads_per_request"):
            if int(getattr(settings, name)) < 1:
                raise ValueError(f"{name} must be >= 1")
        for name in ("lease_s", "read_timeout_s", "handshake_timeout_s"):
            if not float(getattr(settings, name)) > 0:
                raise ValueError(f"{name} must be > 0")
        if settings.transport is not None and (
            not isinstance(settings.transport, str) or not settings.transport
        ):
            raise ValueError(f"transport must be a non-empty str, got {settings.transport!r}")
        if not float(settings.early_read_grace_s) >= 0:
            raise ValueError("early_read_grace_s must be >= 0")
        return settings


def transfer_params_to_dict(
    params: TransferParams, num_tokens: int, block_size: int
) -> dict[str, Any]:
    """A producer's `TransferParams` as the JSON-able dict a consumer request carries.

    Args:
      params: what the producer pins.
      num_tokens: how many tokens the blocks hold.
      block_size: the producer's block size in tokens.

    Example:
      >>> p = TransferParams("prefill", [("127.0.0.1", 5600)], "r1", [4, 7], 30.0)
      >>> transfer_params_to_dict(p, 20, 16)["remote_block_ids"]
      [4, 7]
    """
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": params.engine_id,
        "remote_addresses": [[host, int(port)] for host, port in params.addresses],
        "remote_request_id": params.request_id,
        "remote_block_ids": [int(b) for b in params.block_ids],
        "remote_lease_s": float(params.lease_s),
        "remote_num_tokens": int(num_tokens),
        "remote_block_size": int(block_size),
    }


def transfer_params_from_dict(params: Mapping[str, Any]) -> TransferParams:
    """The `TransferParams` of a consumer request's dict (`transfer_params_to_dict`).

    Raises:
      ValueError: a key is missing or malformed (named in the message).
    """
    missing = [key for key in _PARAM_KEYS if key not in params]
    if missing:
        raise ValueError(f"kv_transfer_params lack {missing}")
    try:
        addresses = [(str(h), int(p)) for h, p in params["remote_addresses"]]
        block_ids = [int(b) for b in params["remote_block_ids"]]
        lease = float(params["remote_lease_s"])
    except (TypeError, ValueError) as error:
        raise ValueError(f"malformed kv_transfer_params: {error}") from error
    if not addresses:
        raise ValueError("kv_transfer_params name no producer address")
    return TransferParams(
        str(params["remote_engine_id"]),
        addresses,
        str(params["remote_request_id"]),
        block_ids,
        lease,
    )


def read_plan_ids(
    remote_block_ids: Sequence[int],
    remote_num_tokens: int,
    remote_block_size: int,
    local_block_ids: Sequence[int],
    local_block_size: int,
    num_local_hit_blocks: int = 0,
) -> tuple[list[int], list[int]]:
    """Which blocks a consumer reads: the remote blocks holding the request's tokens, and the
    local blocks to fill, in token order.

    `local_block_ids` are the consumer's blocks after its local prefix hit of
    `num_local_hit_blocks` whole blocks; they are cut to the number the remote tokens fill
    after the hit, the remote ids to the number holding `remote_num_tokens`. `jaxkv.transfer`
    reads only the tail of the remote blocks that the local ones cover.

    Raises:
      ValueError: the block sizes do not divide (the consumer's must be a multiple of the
        producer's), or the remote ids are fewer than the tokens need.

    Example:
      >>> read_plan_ids([3, 4, 5, 6], 50, 16, [9, 8, 2], 16, 2)  # a 2-block local hit
      ([3, 4, 5, 6], [9, 8])
      >>> read_plan_ids([3, 4, 5, 6], 50, 16, [9, 8, 1], 32)
      ([3, 4, 5, 6], [9, 8])
    """
    if remote_block_size < 1 or local_block_size % remote_block_size:
        raise ValueError(
            f"the consumer's block size {local_block_size} is not a multiple of the "
            f"producer's {remote_block_size}"
        )
    n_remote = math.ceil(remote_num_tokens / remote_block_size)
    if n_remote > len(remote_block_ids):
        raise ValueError(
            f"{remote_num_tokens} tokens need {n_remote} remote blocks, "
            f"got {len(remote_block_ids)}"
        )
    needed = math.ceil(remote_num_tokens / local_block_size) - num_local_hit_blocks
    if needed < 0 or needed > len(local_block_ids):
        raise ValueError(
            f"{remote_num_tokens} tokens after a {num_local_hit_blocks}-block local hit need "
            f"{needed} local blocks of {local_block_size}, got {len(local_block_ids)}"
        )
    return [int(b) for b in remote_block_ids[:n_remote]], [
        int(b) for b in local_block_ids[:needed]
    ]
