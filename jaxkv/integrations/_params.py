"""Framework-free pieces of the connectors: settings, transfer parameters as plain dicts (what
travels through a router as JSON), and which blocks a consumer reads."""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

from jaxkv.transfer import TransferParams, make_transfer_params

log = logging.getLogger("jaxkv.integrations.vllm")

__all__ = [
    "ConnectorSettings",
    "GroupedTransfer",
    "group_read_plan_ids",
    "read_plan_ids",
    "transfer_params_from_dict",
    "transfer_params_to_dict",
]

# kv_transfer_params, in vLLM's NIXL connector's keys and shapes where the meaning is the same
# (``remote_block_ids``: one list per KV cache group; ``remote_host``/``remote_port``: the side
# channel of the producer's first process, group 0), jaxkv's extra fields beside them.
ADDRESSES_KEY = "jaxkv_addresses"  # per group, every producer process's [host, port]
LEASE_KEY = "jaxkv_lease_s"  # how long the producer pins the blocks without a heartbeat
BLOCK_SIZES_KEY = "jaxkv_block_sizes"  # per group, the producer's block size in tokens
FIRST_BLOCKS_KEY = "jaxkv_first_blocks"  # per group, the position of its first block id
# per group, null (attention KV) or a Mamba group's state components: their names and, per
# component, every producer process's [host, port] (each component is a cache group of the
# producer's transfer engine with its own side channel); the group's block id list holds the
# one block of the request's running state, read for every component
STATES_KEY = "jaxkv_states"
_KEYS = ("remote_engine_id", "remote_request_id", "remote_block_ids", "remote_num_tokens",
         "remote_block_size", ADDRESSES_KEY, LEASE_KEY)

# The jaxkv shapes before NIXL's (accepted for one release, a deprecation logged once): one
# group's flat ``remote_block_ids`` with ``remote_addresses``/``remote_lease_s``, and a hybrid
# model's ``remote_groups``.
_PARAM_KEYS = (
    "remote_engine_id",
    "remote_addresses",
    "remote_request_id",
    "remote_block_ids",
    "remote_lease_s",
    "remote_num_tokens",
    "remote_block_size",
)
# The deprecated hybrid shape's keys (one entry of "remote_groups" per KV cache group).
_GROUPED_KEYS = ("remote_engine_id", "remote_request_id", "remote_lease_s", "remote_num_tokens",
                 "remote_groups")
_GROUP_KEYS = ("addresses", "block_ids", "first_block", "block_size")
_deprecation_logged = False


class _ParamsError(ValueError):
    """Params that cannot be read (its message names what is wrong)."""


def _log_deprecated_shape(shape: str) -> None:
    global _deprecation_logged
    if not _deprecation_logged:
        _deprecation_logged = True
        log.warning(
            "kv_transfer_params in jaxkv's deprecated %s shape: accepted for one release; "
            "producers now send NIXL's keys (remote_block_ids per KV cache group, "
            "remote_host/remote_port) with jaxkv_addresses/jaxkv_lease_s beside them: "
            "upgrade the producer", shape)


def _params_dict(
    engine_id: str,
    request_id: str,
    group_addresses: Sequence[Sequence[tuple[str, int]]],
    group_block_ids: Sequence[Sequence[int]],
    lease_s: float,
    num_tokens: int,
    block_sizes: Sequence[int],
    first_blocks: Sequence[int],
    tp_size: int | None,
    states: Sequence[Sequence[tuple[str, Sequence[tuple[str, int]]]] | None] = (),
) -> dict[str, Any]:
    host, port = group_addresses[0][0] if group_addresses[0] else ("", 0)
    d: dict[str, Any] = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": engine_id,
        "remote_request_id": request_id,
        "remote_host": str(host),
        "remote_port": int(port),
        "remote_block_ids": [[int(b) for b in ids] for ids in group_block_ids],
        "remote_num_tokens": int(num_tokens),
        "remote_block_size": int(block_sizes[0]),
    }
    if tp_size is not None:
        d["tp_size"] = int(tp_size)
    d[ADDRESSES_KEY] = [[[str(h), int(p)] for h, p in a] for a in group_addresses]
    d[LEASE_KEY] = float(lease_s)
    d[BLOCK_SIZES_KEY] = [int(b) for b in block_sizes]
    d[FIRST_BLOCKS_KEY] = [int(f) for f in first_blocks]
    if any(state is not None for state in states):
        d[STATES_KEY] = [
            None if state is None else {
                "components": [str(name) for name, _ in state],
                "addresses": [[[str(h), int(p)] for h, p in a] for _, a in state],
            }
            for state in states
        ]
    return d


@dataclasses.dataclass(frozen=True)
class _Parsed:
    """A consumer request's params, whatever their shape, per KV cache group."""

    engine_id: str
    request_id: str
    addresses: list[list[tuple[str, int]]]
    block_ids: list[list[int]]
    lease_s: float
    num_tokens: int
    block_sizes: list[int]
    first_blocks: list[int]
    states: list[list[tuple[str, list[tuple[str, int]]]] | None] = dataclasses.field(
        default_factory=list)


def _parse_states(params: Mapping[str, Any], n: int) -> list[Any]:
    """The `STATES_KEY` entries (none: an empty list)."""
    states = params.get(STATES_KEY)
    if states is None:
        return []
    if not isinstance(states, Sequence) or len(states) != n:
        raise _ParamsError(f"malformed kv_transfer_params: {STATES_KEY} must list one entry per "
                           f"KV cache group ({n}), got {states!r}")
    out: list[Any] = []
    for g, state in enumerate(states):
        if state is None:
            out.append(None)
            continue
        names, addresses = state["components"], state["addresses"]
        if not names or len(names) != len(addresses):
            raise _ParamsError(f"malformed kv_transfer_params: {STATES_KEY}[{g}] needs one "
                               f"address list per component, got {state!r}")
        out.append([(str(name), [(str(h), int(p)) for h, p in a])
                    for name, a in zip(names, addresses)])
    return out


def _parse(params: Mapping[str, Any]) -> _Parsed:
    """Reads any accepted shape: NIXL's keys with jaxkv's beside them, or (deprecated) the
    one-group ``remote_addresses`` shape or the hybrid ``remote_groups`` one.

    Raises:
      ValueError: a key is missing or malformed (named in the message).
    """
    try:
        if "remote_groups" in params:
            return _parse_old_grouped(params)
        if "remote_addresses" in params and ADDRESSES_KEY not in params:
            return _parse_old_flat(params)
        missing = [key for key in _KEYS if key not in params]
        if missing:
            raise _ParamsError(f"kv_transfer_params lack {missing}")
        ids = params["remote_block_ids"]
        if not isinstance(ids, Sequence) or not ids or not all(
            isinstance(g, Sequence) and not isinstance(g, str) for g in ids
        ):
            raise _ParamsError(
                "malformed kv_transfer_params: remote_block_ids must be a non-empty list of "
                f"block id lists (one per KV cache group), got {ids!r}"
            )
        n = len(ids)
        addresses = [[(str(h), int(p)) for h, p in group] for group in params[ADDRESSES_KEY]]
        sizes = [int(b) for b in params.get(BLOCK_SIZES_KEY, [params["remote_block_size"]] * n)]
        firsts = [int(f) for f in params.get(FIRST_BLOCKS_KEY, [0] * n)]
        if len(addresses) != n or len(sizes) != n or len(firsts) != n:
            raise _ParamsError(
                f"malformed kv_transfer_params: {n} remote_block_ids lists, "
                f"{len(addresses)} {ADDRESSES_KEY}, {len(sizes)} {BLOCK_SIZES_KEY}, "
                f"{len(firsts)} {FIRST_BLOCKS_KEY} (one per KV cache group)"
            )
        return _Parsed(
            str(params["remote_engine_id"]), str(params["remote_request_id"]), addresses,
            [[int(b) for b in group] for group in ids], float(params[LEASE_KEY]),
            int(params["remote_num_tokens"]), sizes, firsts, _parse_states(params, n),
        )
    except _ParamsError:
        raise
    except (TypeError, AttributeError, ValueError) as error:
        raise ValueError(f"malformed kv_transfer_params: {error}") from error


def _parse_old_flat(params: Mapping[str, Any]) -> _Parsed:
    missing = [key for key in _PARAM_KEYS if key not in params]
    if missing:
        raise _ParamsError(f"kv_transfer_params lack {missing}")
    _log_deprecated_shape("one-group (remote_addresses)")
    return _Parsed(
        str(params["remote_engine_id"]), str(params["remote_request_id"]),
        [[(str(h), int(p)) for h, p in params["remote_addresses"]]],
        [[int(b) for b in params["remote_block_ids"]]], float(params["remote_lease_s"]),
        int(params["remote_num_tokens"]), [int(params["remote_block_size"])], [0],
    )


def _parse_old_grouped(params: Mapping[str, Any]) -> _Parsed:
    missing = [key for key in _GROUPED_KEYS if key not in params]
    if missing:
        raise _ParamsError(f"kv_transfer_params lack {missing}")
    groups = params["remote_groups"]
    if not isinstance(groups, Sequence) or not groups:
        raise _ParamsError(f"remote_groups must be a non-empty list, got {groups!r}")
    _log_deprecated_shape("hybrid (remote_groups)")
    addresses, ids, sizes, firsts = [], [], [], []
    for g, entry in enumerate(groups):
        lacking = [key for key in _GROUP_KEYS if key not in entry]
        if lacking:
            raise _ParamsError(f"remote_groups[{g}] lacks {lacking}")
        addresses.append([(str(h), int(p)) for h, p in entry["addresses"]])
        ids.append([int(b) for b in entry["block_ids"]])
        sizes.append(int(entry["block_size"]))
        firsts.append(int(entry["first_block"]))
    return _Parsed(
        str(params["remote_engine_id"]), str(params["remote_request_id"]), addresses, ids,
        float(params["remote_lease_s"]), int(params["remote_num_tokens"]), sizes, firsts,
    )


def params_num_groups(params: Mapping[str, Any]) -> int:
    """How many KV cache groups a consumer request's params carry (any accepted shape).

    Raises:
      ValueError: the params are malformed.
    """
    if "remote_groups" in params:
        groups = params["remote_groups"]
        return len(groups) if isinstance(groups, Sequence) else 0
    if "remote_addresses" in params and ADDRESSES_KEY not in params:
        return 1
    return len(_parse(params).block_ids)


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
        not pinned yet waits for them to (`TransferEngine`'s ``early_read_grace_s``).
      num_kv_heads: the model's KV heads, when a worker registers one TP rank's cache (its
        heads only); None: the cache's heads times `tp_size` (tpu-inference: the model's).
      head_dim: tpu-inference: the model's head dim (its cache stores it padded to 128 lanes);
        None: the model config's.
      transport: the transfer engine's transport, passed to `TransferEngine` as its
        ``transport`` argument; None: the engine's default (NIXL).
      packed_transfer: tpu-inference's packed caches over NIXL: ``"values"`` (default) moves
        the real heads and head-dim lanes only, the consumer's padding untouched;
        ``"words"`` moves whole 32-bit word columns, padding lanes included (fewer, larger
        NIXL descriptors when the head dim is not a multiple of 128; needs each TP rank's
        heads to fill whole words). The JAX transport always moves values.
      group_ports: hybrid models (several KV-cache groups, one transfer engine each): per
        entry of `side_channel`, the side-channel port of each group's engine, in group order.
        None: group ``g`` listens on the entry's port + ``g`` (port 0: every group picks a
        free port).
      auth_key_file: a file holding the deployment key (`jaxkv.transfer.load_auth_key`),
        the same for every engine of the deployment: the side channels and control
        connections then serve and talk to key holders only. A path, not the key: vLLM logs
        its config. None: ``JAXKV_AUTH_KEY_FILE`` / ``JAXKV_AUTH_KEY`` if set, else no key.
      allow_unauthenticated: serve a non-loopback `side_channel` address without a key
        (refused otherwise: whoever reaches it can read the KV caches).

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
    packed_transfer: str = "values"
    group_ports: tuple[tuple[int, ...], ...] | None = None
    auth_key_file: str | None = None
    allow_unauthenticated: bool = False

    def group_addresses(self, num_groups: int) -> list[list[tuple[str, int]]]:
        """Per KV-cache group, the side-channel address of each of this engine's processes
        (`side_channel` order): `group_ports` when set, else each process's port + group.

        Raises:
          ValueError: `group_ports` does not name one port per group for every process.

        Example:
          >>> s = ConnectorSettings("p", side_channel=(("h", 5600), ("h", 5700)))
          >>> s.group_addresses(2)
          [[('h', 5600), ('h', 5700)], [('h', 5601), ('h', 5701)]]
        """
        if num_groups < 1:
            raise ValueError(f"num_groups must be >= 1, got {num_groups}")
        ports = self.group_ports
        if ports is not None:
            if len(ports) != len(self.side_channel) or any(
                len(p) != num_groups for p in ports
            ):
                raise ValueError(
                    f"group_ports must list {num_groups} port(s) (one per KV cache group) for "
                    f"each of the {len(self.side_channel)} side_channel entries, got {ports!r}"
                )
            return [
                [(host, int(ports[p][g])) for p, (host, _) in enumerate(self.side_channel)]
                for g in range(num_groups)
            ]
        return [
            [(host, port + g if port else 0) for host, port in self.side_channel]
            for g in range(num_groups)
        ]

    def engine_options(self) -> dict[str, Any]:
        """Keyword arguments for `TransferEngine` beyond the timeouts: the transport when
        one is set (an engine without that setting then refuses it by name), the deployment
        key read from `auth_key_file`, `allow_unauthenticated` when set.

        Raises:
          OSError: the key file cannot be read. ValueError: the key is too short.

        Example:
          >>> ConnectorSettings("p", transport="jax").engine_options()
          {'transport': 'jax'}
        """
        options: dict[str, Any] = {}
        if self.transport is not None:
            options["transport"] = self.transport
        if self.auth_key_file is not None:
            from jaxkv.transfer import load_auth_key

            options["auth_key"] = load_auth_key(path=self.auth_key_file)
        if self.allow_unauthenticated:
            options["allow_unauthenticated"] = True
        return options

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
        if values.get("group_ports") is not None:
            try:
                values["group_ports"] = tuple(
                    tuple(int(port) for port in ports) for ports in values["group_ports"]
                )
            except (TypeError, ValueError) as error:
                raise ValueError(
                    "group_ports must be a list (per side_channel entry) of lists of ports, "
                    f"got {extra.get('group_ports')!r}"
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
        if settings.auth_key_file is not None:
            if not isinstance(settings.auth_key_file, str) or not settings.auth_key_file:
                raise ValueError(
                    f"auth_key_file must be a path, got {settings.auth_key_file!r}"
                )
            try:  # fails at configuration, not at the first transfer
                settings.engine_options()
            except (OSError, ValueError) as error:
                raise ValueError(f"auth_key_file: {error}") from error
        if not isinstance(settings.allow_unauthenticated, bool):
            raise ValueError(
                f"allow_unauthenticated must be a bool, got {settings.allow_unauthenticated!r}"
            )
        if settings.packed_transfer not in ("values", "words"):
            raise ValueError(
                f"packed_transfer must be 'values' or 'words', got {settings.packed_transfer!r}"
            )
        return settings


def transfer_params_to_dict(
    params: TransferParams, num_tokens: int, block_size: int, tp_size: int | None = None
) -> dict[str, Any]:
    """A producer's `TransferParams` (one KV cache group) as the JSON-able dict a consumer
    request carries: vLLM NIXL connector's keys where the meaning is the same
    (``remote_block_ids`` as one list per group, here one; ``remote_host``/``remote_port`` of
    the first producer process), jaxkv's ``jaxkv_*`` fields beside them (every process's
    address, the lease, per-group block sizes and first positions).

    Args:
      params: what the producer pins.
      num_tokens: how many tokens the blocks hold.
      block_size: the producer's block size in tokens.
      tp_size: the producer's TP size (NIXL's ``tp_size``); None: left out.

    Example:
      >>> p = TransferParams("prefill", [("127.0.0.1", 5600)], "r1", [4, 7], 30.0)
      >>> d = transfer_params_to_dict(p, 20, 16)
      >>> d["remote_block_ids"], d["remote_host"], d["remote_port"], d["jaxkv_addresses"]
      ([[4, 7]], '127.0.0.1', 5600, [[['127.0.0.1', 5600]]])
    """
    if not params.addresses:
        raise ValueError("kv_transfer_params name no producer address")
    return _params_dict(
        params.engine_id, params.request_id, [params.addresses], [params.block_ids],
        params.lease_s, num_tokens, [block_size], [0], tp_size,
    )


def transfer_params_from_dict(params: Mapping[str, Any]) -> TransferParams:
    """The `TransferParams` of a consumer request's dict of one KV cache group
    (`transfer_params_to_dict`; the deprecated ``remote_addresses`` shape is accepted for one
    release).

    Raises:
      ValueError: a key is missing or malformed (named in the message), or the dict carries
        several groups.
    """
    if "remote_groups" in params:
        raise ValueError(
            f"kv_transfer_params carry {len(params['remote_groups'])} KV cache groups (a hybrid "
            "model's producer): the consumer needs the same groups (GroupedTransfer.from_dict)"
        )
    parsed = _parse(params)
    if len(parsed.block_ids) != 1:
        raise ValueError(
            f"kv_transfer_params carry {len(parsed.block_ids)} KV cache groups (a hybrid "
            "model's producer): the consumer needs the same groups (GroupedTransfer.from_dict)"
        )
    if not parsed.addresses[0]:
        raise ValueError("kv_transfer_params name no producer address")
    return TransferParams(
        parsed.engine_id, parsed.addresses[0], parsed.request_id, parsed.block_ids[0],
        parsed.lease_s,
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


def group_name(group: int) -> str:
    """The `jaxkv.transfer.TransferEngine` cache group name of vLLM's KV cache group `group`."""
    return str(int(group))


@dataclasses.dataclass(frozen=True)
class GroupedTransfer:
    """A hybrid model's request as its producer hands it over: per KV cache group, the blocks
    it keeps of the request's first `num_tokens` tokens.

    A sliding-window group keeps only the blocks of the last window: group ``g``'s ids are
    those of the block positions ``[first_blocks[g], ceil(num_tokens / block_sizes[g]))``
    (a full-attention group starts at 0). Group ``g`` is transfer engine
    ``f"{engine_id}.{g}"`` (a `jaxkv.transfer.TransferEngine` with several groups).

    A Mamba (state-space) group hands over one block, its running state, read for each of
    its state components: engine groups ``f"{g}_{component}"`` (`states`).

    Attributes:
      params: the `TransferParams` (``groups``: per group name ``"0"``, ``"1"``, ...; a Mamba
        group's components ``"1_conv_x"``, ``"1_ssm"``, ...).
      num_tokens: the tokens the blocks hold.
      block_sizes: per group, the producer's block size in tokens.
      first_blocks: per group, the token-order position of its first block id.
      states: per group, None, or a Mamba group's state component names; empty: no Mamba
        group.

    Example:
      >>> t = GroupedTransfer.make("prefill", [[("h", 5600)], [("h", 5601)]], "r1",
      ...                          [[4, 7, 9], [8, 2]], 30.0, num_tokens=20,
      ...                          block_sizes=[8, 8], first_blocks=[0, 1])
      >>> t.params.groups["1"].engine_id, t.params.groups["1"].block_ids
      ('prefill.1', [8, 2])
      >>> GroupedTransfer.from_dict(t.to_dict()) == t
      True
    """

    params: TransferParams
    num_tokens: int
    block_sizes: tuple[int, ...]
    first_blocks: tuple[int, ...]
    states: tuple[tuple[str, ...] | None, ...] = ()

    @property
    def num_groups(self) -> int:
        return len(self.block_sizes)

    def state_of(self, group: int) -> tuple[str, ...] | None:
        """Group `group`'s state component names (None: attention KV)."""
        return self.states[group] if self.states else None

    def engine_names(self, group: int) -> list[str]:
        """The engine groups of vLLM's group `group`: itself, or one per state component."""
        components = self.state_of(group)
        if components is None:
            return [group_name(group)]
        return [f"{int(group)}_{name}" for name in components]

    @classmethod
    def make(
        cls,
        engine_id: str,
        group_addresses: Sequence[Sequence[tuple[str, int]]],
        request_id: str,
        group_block_ids: Sequence[Sequence[int]],
        lease_s: float,
        *,
        num_tokens: int,
        block_sizes: Sequence[int],
        first_blocks: Sequence[int],
        states: Sequence[Sequence[tuple[str, Sequence[tuple[str, int]]]] | None] = (),
    ) -> GroupedTransfer:
        """Builds a request's grouped params where no transfer engine runs (a scheduler),
        as `jaxkv.transfer.make_transfer_params` does for one group.

        Args:
          engine_id: the producer engine's id (group ``g`` is engine ``f"{engine_id}.{g}"``).
          group_addresses: per group, every producer process's side-channel address.
          request_id: the producer's request id.
          group_block_ids: per group, the ids of its block positions from
            ``first_blocks[g]`` on (cut to the blocks holding `num_tokens`).
          lease_s: the lease the producer's workers pin the blocks with.
          num_tokens: how many tokens the request's blocks hold.
          block_sizes, first_blocks: per group, as the attributes.
          states: per group, None, or a Mamba group's state components: (name, every
            producer process's side-channel address); its `group_addresses` entry is then
            ignored and its block ids are the one block of the running state.

        Raises:
          ValueError: the per-group lists differ in length, a group has too few ids for its
            positions (a Mamba group: not exactly one), or what `make_transfer_params`
            refuses.
        """
        n = len(block_sizes)
        if n < 1 or len(group_addresses) != n or len(group_block_ids) != n or len(
            first_blocks
        ) != n:
            raise ValueError(
                f"per-group lists differ: {len(group_addresses)} addresses, "
                f"{len(group_block_ids)} block id lists, {len(block_sizes)} block sizes, "
                f"{len(first_blocks)} first blocks"
            )
        if int(num_tokens) < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        states = list(states) if states else []
        if states and len(states) != n:
            raise ValueError(f"per-group lists differ: {len(states)} states, {n} block sizes")
        groups = {}
        for g in range(n):
            size, first = int(block_sizes[g]), int(first_blocks[g])
            if size < 1 or first < 0:
                raise ValueError(f"group {g}: bad block size {size} / first block {first}")
            state = states[g] if states else None
            if state is not None:
                ids = [int(b) for b in group_block_ids[g]]
                if len(ids) != 1:
                    raise ValueError(f"group {g} (Mamba state): one block of running state, "
                                     f"got {len(ids)} block ids")
                for name, component_addresses in state:
                    name = f"{g}_{name}"
                    groups[name] = make_transfer_params(
                        f"{engine_id}.{name}", list(component_addresses), request_id, ids,
                        lease_s)
                continue
            needed = max(0, math.ceil(int(num_tokens) / size) - first)
            ids = list(group_block_ids[g])
            if len(ids) < needed:
                raise ValueError(
                    f"group {g}: {num_tokens} tokens from block {first} on need {needed} "
                    f"blocks of {size}, got {len(ids)}"
                )
            groups[group_name(g)] = make_transfer_params(
                f"{engine_id}.{g}", list(group_addresses[g]), request_id, ids[:needed],
                lease_s,
            )
        return cls(
            TransferParams(engine_id, [], request_id, [], float(lease_s), groups=groups),
            int(num_tokens),
            tuple(int(b) for b in block_sizes),
            tuple(int(f) for f in first_blocks),
            tuple(None if state is None else tuple(str(name) for name, _ in state)
                  for state in states),
        )

    @property
    def engine_id(self) -> str:
        """The producer engine's id (its groups' engines are ``f"{engine_id}.{g}"``)."""
        return self.params.engine_id

    def to_dict(self, tp_size: int | None = None) -> dict[str, Any]:
        """The JSON-able dict a consumer request carries: ``remote_block_ids`` one list per
        group as vLLM's NIXL connector's, jaxkv's per-group fields beside them
        (`transfer_params_to_dict`'s shape). `tp_size`: NIXL's ``tp_size`` (None: left out)."""
        groups = [self.params.groups[self.engine_names(g)[0]] for g in range(self.num_groups)]
        states = [
            None if self.state_of(g) is None else [
                (name, self.params.groups[engine_name].addresses)
                for name, engine_name in zip(self.state_of(g) or (), self.engine_names(g))
            ]
            for g in range(self.num_groups)
        ]
        return _params_dict(
            self.engine_id, self.params.request_id, [p.addresses for p in groups],
            [p.block_ids for p in groups], groups[0].lease_s, self.num_tokens,
            self.block_sizes, self.first_blocks, tp_size, states,
        )

    @classmethod
    def from_dict(cls, params: Mapping[str, Any]) -> GroupedTransfer:
        """The `GroupedTransfer` of a consumer request's dict (`to_dict`; the deprecated
        ``remote_groups`` shape is accepted for one release).

        Raises:
          ValueError: a key is missing or malformed (named in the message), or the dict is a
            single-group one.
        """
        if params_num_groups(params) == 1:
            raise ValueError(
                "kv_transfer_params carry one KV cache group (a producer without the hybrid "
                "allocator): the consumer has several"
            )
        parsed = _parse(params)
        return cls.make(
            parsed.engine_id, parsed.addresses, parsed.request_id, parsed.block_ids,
            parsed.lease_s, num_tokens=parsed.num_tokens, block_sizes=parsed.block_sizes,
            first_blocks=parsed.first_blocks, states=parsed.states,
        )


def group_read_plan_ids(
    remote_block_ids: Sequence[int],
    remote_first_block: int,
    num_tokens: int,
    remote_block_size: int,
    local_block_ids: Sequence[int],
    local_first_block: int,
    local_block_size: int,
) -> tuple[list[int], list[int]]:
    """Which blocks a consumer reads in one KV cache group: the remote blocks its local ones
    cover, and the local blocks to fill, in token order.

    The producer kept the group's block positions ``[remote_first_block, ...)`` (a sliding
    window keeps the last window's); the consumer fills its positions
    ``[local_first_block, ceil(num_tokens / local_block_size))`` (after its local prefix hit
    and its own out-of-window blocks) with `local_block_ids`, cut to that count.

    Raises:
      ValueError: the block sizes do not divide, too few ids, or the consumer needs blocks
        the producer no longer holds (a sliding window cut on the producer's finer blocks).

    Example:
      >>> # a sliding window group: the producer kept positions 2..4, the consumer fills 3..4
      >>> group_read_plan_ids([6, 7, 8], 2, 40, 8, [11, 12], 3, 8)
      ([7, 8], [11, 12])
    """
    if remote_block_size < 1 or local_block_size % remote_block_size:
        raise ValueError(
            f"the consumer's block size {local_block_size} is not a multiple of the "
            f"producer's {remote_block_size}"
        )
    ratio = local_block_size // remote_block_size
    n_remote = math.ceil(num_tokens / remote_block_size)
    n_local = math.ceil(num_tokens / local_block_size)
    if len(remote_block_ids) < n_remote - remote_first_block:
        raise ValueError(
            f"{num_tokens} tokens from remote block {remote_first_block} on need "
            f"{n_remote - remote_first_block} remote blocks, got {len(remote_block_ids)}"
        )
    needed = n_local - local_first_block
    if needed < 0 or needed > len(local_block_ids):
        raise ValueError(
            f"{num_tokens} tokens from local block {local_first_block} on need {needed} local "
            f"blocks of {local_block_size}, got {len(local_block_ids)}"
        )
    if needed == 0:
        return [], []
    start = local_first_block * ratio
    if start < remote_first_block:
        raise ValueError(
            f"the consumer fills from token {local_first_block * local_block_size}, the "
            f"producer kept its blocks from token {remote_first_block * remote_block_size} "
            "(sliding window): the blocks in between are gone"
        )
    remote = remote_block_ids[start - remote_first_block : n_remote - remote_first_block]
    return [int(b) for b in remote], [int(b) for b in local_block_ids[:needed]]
