"""KV-block transfer between engines (disaggregated prefill/decode): one engine class,
`TransferEngine` (one or several cache groups, one process or several with a `JaxDistributed`
coordinator; `StepChannel` / `broadcast_block_ids` share a step's block ids among those
processes), over NIXL or ``jax.experimental.transfer`` (`nixl_available`,
`jax_transfer_available`; the transport is pluggable: `Transport`). The producer publishes a
request's blocks and hands `TransferParams` (`make_transfer_params`) to the consumer, whose
reads end in a `PollResult` (`FailedRead` on failure); in-jit variants: `publish_in_jit`,
`publish_layer_in_jit`, `wait_in_jit`. Handshakes fail with `HandshakeError` or
`IncompatibleEngineError`; `load_auth_key` loads the deployment key; `recommend_layout` advises
on layouts; `TransferStats`, `TransferStatsCollector` and `prometheus_text` report.

`import jaxkv.transfer` needs neither NIXL nor a JAX backend: metadata, the side channel and
read planning are pure Python/numpy; only creating an agent imports NIXL.
"""

from jaxkv._deprecation import deprecated_getattr as _deprecated_getattr
from jaxkv.transfer._agent import nixl_available
from jaxkv.transfer._auth import load_auth_key
from jaxkv.transfer._jax_transport import jax_transfer_available
from jaxkv.transfer._jit import publish_in_jit, publish_layer_in_jit, wait_in_jit
from jaxkv.transfer._layout_advice import recommend_layout
from jaxkv.transfer._metadata import IncompatibleEngineError
from jaxkv.transfer._multicontroller import StepChannel, broadcast_block_ids
from jaxkv.transfer._params import FailedRead, PollResult, TransferParams, make_transfer_params
from jaxkv.transfer._prometheus import TransferStatsCollector, prometheus_text
from jaxkv.transfer._side_channel import HandshakeError
from jaxkv.transfer._stats import TransferStats
from jaxkv.transfer._transfer_engine import JaxDistributed, TransferEngine
from jaxkv.transfer._transport import Transport

__all__ = [
    "broadcast_block_ids",
    "FailedRead",
    "HandshakeError",
    "IncompatibleEngineError",
    "jax_transfer_available",
    "JaxDistributed",
    "load_auth_key",
    "make_transfer_params",
    "nixl_available",
    "PollResult",
    "prometheus_text",
    "publish_in_jit",
    "publish_layer_in_jit",
    "recommend_layout",
    "StepChannel",
    "TransferEngine",
    "TransferParams",
    "TransferStats",
    "TransferStatsCollector",
    "Transport",
    "wait_in_jit",
]

# Names that left the public API, kept one release (docs/guide.md, "Deprecated names"):
# each use warns with a DeprecationWarning naming what to use instead.
_DEPRECATED = {
    "KVTransferEngine": "jaxkv.transfer._transfer_engine:TransferEngine",
    "AgentInfo": "jaxkv.transfer._metadata",
    "AgentOptions": "jaxkv.transfer._agent",
    "DEFAULT_GROUP": "jaxkv.transfer._transfer_engine",
    "LayoutAdvice": "jaxkv.transfer._layout_advice",
    "HostMirror": "jaxkv.transfer._staging",
    "JaxTransport": "jaxkv.transfer._jax_transport",
    "KeyValueClient": "jaxkv.transfer._multicontroller",
    "distributed_client": "jaxkv.transfer._multicontroller",
    "NixlAgent": "jaxkv.transfer._agent",
    "ProtocolError": "jaxkv.transfer._protocol",
    "ReadState": "jaxkv.transfer._protocol",
    "RequestState": "jaxkv.transfer._protocol",
    "TRANSPORTS": "jaxkv.transfer._engine",
    "ControlChannel": "jaxkv.transfer._transport",
    "Fetch": "jaxkv.transfer._transport",
    "Offer": "jaxkv.transfer._transport",
    "PublishRecord": "jaxkv.transfer._stats",
    "TransferRecord": "jaxkv.transfer._stats",
    "BUCKETS_S": "jaxkv.transfer._prometheus",
    "WorkerAggregator": "jaxkv.transfer._stats",
    "load_nixl": "jaxkv.transfer._agent",
    "after_callback": "jaxkv.transfer._jit",
    "written_token": "jaxkv.transfer._jit",
    "COPY_COLUMNS": "jaxkv.transfer._plan",
    "EngineMetadata": "jaxkv.transfer._metadata",
    "MAX_METADATA_BYTES": "jaxkv.transfer._metadata",
    "MetadataError": "jaxkv.transfer._metadata",
    "MetadataServer": "jaxkv.transfer._side_channel",
    "PROTOCOL_VERSION": "jaxkv.transfer._metadata",
    "PlanError": "jaxkv.transfer._plan",
    "PostProcess": "jaxkv.transfer._plan",
    "RankInfo": "jaxkv.transfer._metadata",
    "ReadPlan": "jaxkv.transfer._plan",
    "RegionInfo": "jaxkv.transfer._metadata",
    "apply_post_processing": "jaxkv.transfer._post",
    "block_runs": "jaxkv.transfer._plan",
    "group_post_steps": "jaxkv.transfer._post",
    "check_compatible": "jaxkv.transfer._metadata",
    "compat_fields": "jaxkv.transfer._metadata",
    "compute_compat_hash": "jaxkv.transfer._metadata",
    "decode_metadata": "jaxkv.transfer._metadata",
    "encode_metadata": "jaxkv.transfer._metadata",
    "engine_metadata": "jaxkv.transfer._metadata",
    "fetch_metadata": "jaxkv.transfer._side_channel",
    "plan_read": "jaxkv.transfer._plan",
}
_USE = {
    "KVTransferEngine": "jaxkv.transfer.TransferEngine (one group, one process: same arguments)",
}
__getattr__ = _deprecated_getattr('jaxkv.transfer', _DEPRECATED, _USE)
