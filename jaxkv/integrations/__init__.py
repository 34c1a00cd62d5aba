"""Connectors that plug jaxkv into serving frameworks.

`import jaxkv.integrations` needs none of those frameworks; each connector module imports its
framework when it is imported itself:

* `jaxkv.integrations.vllm`: `JaxKVConnector`, a vLLM (0.33) `KVConnectorBase_V1` moving KV
  blocks between a prefill (``kv_producer``) and a decode (``kv_consumer``) vLLM engine with
  `jaxkv.transfer.TransferEngine`; load it with vLLM's ``kv_connector="JaxKVConnector"`` and
  ``kv_connector_module_path="jaxkv.integrations.vllm"``.
* `jaxkv.integrations.tpu_inference`: `JaxKVTPUConnector` (also exported as ``TPUConnector``,
  the name tpu-inference's platform accepts), the same connector for tpu-inference's runner:
  it adopts ``runner.kv_caches`` zero-copy and follows them as the runner reassigns them.

The helpers below (no framework needed) convert the transfer parameters that
travel through the framework's router (`GroupedTransfer` and `group_read_plan_ids`: a hybrid
model's, one entry per KV-cache group).
"""

from jaxkv.integrations._params import (
    ConnectorSettings,
    GroupedTransfer,
    group_read_plan_ids,
    read_plan_ids,
    transfer_params_from_dict,
    transfer_params_to_dict,
)

__all__ = [
    "ConnectorSettings",
    "GroupedTransfer",
    "group_read_plan_ids",
    "read_plan_ids",
    "transfer_params_from_dict",
    "transfer_params_to_dict",
]
