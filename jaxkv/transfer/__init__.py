"""KV-block transfer between engines (disaggregated prefill/decode): one engine class,
`TransferEngine` (one or several cache groups, one process or several with a `JaxDistributed`
coordinator), over NIXL or ``jax.experimental.transfer`` (the transport is pluggable:
`Transport`; control messages over TCP or NIXL notifications).

`import jaxkv.transfer` needs neither NIXL nor a JAX backend: metadata, the side channel and
read planning are pure Python/numpy; only creating an agent imports NIXL.
"""

from jaxkv.transfer._agent import AgentOptions, NixlAgent, load_nixl, nixl_available
from jaxkv.transfer._auth import load_auth_key
from jaxkv.transfer._engine import TRANSPORTS
from jaxkv.transfer._jax_transport import JaxTransport, jax_transfer_available
from jaxkv.transfer._jit import (
    after_callback,
    publish_in_jit,
    publish_layer_in_jit,
    wait_in_jit,
    written_token,
)
from jaxkv.transfer._layout_advice import LayoutAdvice, recommend_layout
from jaxkv.transfer._metadata import (
    MAX_METADATA_BYTES,
    PROTOCOL_VERSION,
    AgentInfo,
    EngineMetadata,
    IncompatibleEngineError,
    MetadataError,
    RankInfo,
    RegionInfo,
    check_compatible,
    compat_fields,
    compute_compat_hash,
    decode_metadata,
    encode_metadata,
    engine_metadata,
)
from jaxkv.transfer._multicontroller import (
    KeyValueClient,
    StepChannel,
    broadcast_block_ids,
    distributed_client,
)
from jaxkv.transfer._params import FailedRead, PollResult, TransferParams, make_transfer_params
from jaxkv.transfer._plan import (
    COPY_COLUMNS,
    PlanError,
    PostProcess,
    ReadPlan,
    block_runs,
    plan_read,
)
from jaxkv.transfer._post import apply_post_processing, group_post_steps
from jaxkv.transfer._prometheus import BUCKETS_S, TransferStatsCollector, prometheus_text
from jaxkv.transfer._protocol import ProtocolError, ReadState, RequestState
from jaxkv.transfer._side_channel import HandshakeError, MetadataServer, fetch_metadata
from jaxkv.transfer._staging import HostMirror
from jaxkv.transfer._stats import PublishRecord, TransferRecord, TransferStats, WorkerAggregator
from jaxkv.transfer._transfer_engine import DEFAULT_GROUP, JaxDistributed, TransferEngine
from jaxkv.transfer._transport import ControlChannel, Fetch, Offer, Transport

__all__ = [
    "AgentInfo",
    "AgentOptions",
    "DEFAULT_GROUP",
    "FailedRead",
    "JaxDistributed",
    "LayoutAdvice",
    "HostMirror",
    "JaxTransport",
    "KeyValueClient",
    "TransferEngine",
    "StepChannel",
    "broadcast_block_ids",
    "distributed_client",
    "NixlAgent",
    "PollResult",
    "ProtocolError",
    "ReadState",
    "RequestState",
    "TRANSPORTS",
    "Transport",
    "ControlChannel",
    "Fetch",
    "Offer",
    "PublishRecord",
    "TransferParams",
    "TransferRecord",
    "TransferStats",
    "TransferStatsCollector",
    "BUCKETS_S",
    "WorkerAggregator",
    "jax_transfer_available",
    "load_auth_key",
    "load_nixl",
    "make_transfer_params",
    "nixl_available",
    "after_callback",
    "publish_in_jit",
    "publish_layer_in_jit",
    "recommend_layout",
    "wait_in_jit",
    "written_token",
    "COPY_COLUMNS",
    "EngineMetadata",
    "HandshakeError",
    "IncompatibleEngineError",
    "MAX_METADATA_BYTES",
    "MetadataError",
    "MetadataServer",
    "PROTOCOL_VERSION",
    "PlanError",
    "PostProcess",
    "RankInfo",
    "ReadPlan",
    "RegionInfo",
    "apply_post_processing",
    "block_runs",
    "group_post_steps",
    "check_compatible",
    "compat_fields",
    "compute_compat_hash",
    "decode_metadata",
    "encode_metadata",
    "engine_metadata",
    "fetch_metadata",
    "plan_read",
    "prometheus_text",
]


# The name of the engine `TransferEngine` replaced, kept one release (docs/transfer.md,
# "Deprecated names"); it warns where it is used.
_DEPRECATED = {"KVTransferEngine": "TransferEngine (one group, one process: the same arguments)"}


def __getattr__(name: str):
    if name in _DEPRECATED:
        import warnings

        warnings.warn(f"jaxkv.transfer.{name} is deprecated: use {_DEPRECATED[name]}",
                      DeprecationWarning, stacklevel=2)
        return TransferEngine
    raise AttributeError(f"module 'jaxkv.transfer' has no attribute {name!r}")
