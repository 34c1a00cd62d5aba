"""Block operations on blocks-first cache arrays, as in-place XLA FFI custom calls.

Block ops: `copy_blocks`, `gather_blocks`, `scatter_blocks`. Reshaping ops for engines that
differ in layout, block size or parallelism: `permute_blocks`, `merge_blocks`,
`copy_block_prefix`, `split_for_peers` / `concat_from_peers` with their pure plan
(`plan_peers` -> `PeerPlan`). `reference` holds the pure-jnp implementations that define their
semantics. `implementation` selects what runs: the custom calls ("ffi", cpu and cuda), Pallas
TPU kernels ("pallas", interpret mode off TPU) or the jnp reference; by default each platform
gets its own when lowered. `check_id_errors` raises the id failures that CUDA custom calls
inside your jit recorded on the device instead of raising.
"""

from jaxkv._parallel import PeerPlan, plan_peers
from jaxkv.ops import reference
from jaxkv.ops._block_ops import copy_blocks, gather_blocks, scatter_blocks
from jaxkv.ops._dispatch import IMPLEMENTATIONS, current_implementation, implementation
from jaxkv.ops._id_errors import check_id_errors
from jaxkv.ops._ids import pad_block_ids
from jaxkv.ops._peer_ops import concat_from_peers, split_for_peers
from jaxkv.ops._reshape_ops import copy_block_prefix, merge_blocks, permute_blocks

__all__ = [
    "IMPLEMENTATIONS",
    "PeerPlan",
    "check_id_errors",
    "concat_from_peers",
    "copy_block_prefix",
    "copy_blocks",
    "current_implementation",
    "gather_blocks",
    "implementation",
    "merge_blocks",
    "pad_block_ids",
    "permute_blocks",
    "plan_peers",
    "reference",
    "scatter_blocks",
    "split_for_peers",
]
