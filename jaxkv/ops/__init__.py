"""Block operations on blocks-first cache arrays, as in-place XLA FFI custom calls.

Block ops: `copy_blocks`, `gather_blocks`, `scatter_blocks` (`pad_block_ids` pads id lists to a
few lengths, so that jit compiles few programs). Reshaping ops for engines that differ in
layout, block size or parallelism: `permute_blocks`, `merge_blocks`, `copy_block_prefix`,
`split_for_peers` / `concat_from_peers` with their pure plan (`plan_peers` -> `PeerPlan`).
`jaxkv.ops.reference` holds the pure-jnp implementations that define their semantics.
`implementation` selects what runs: the custom calls ("ffi", cpu and cuda), Pallas TPU kernels
("pallas", interpret mode off TPU) or the jnp reference; by default each platform gets its own
when lowered (`current_implementation` says which is chosen). `check_id_errors` raises the id
failures that CUDA custom calls inside your jit recorded on the device instead of raising.
"""

from jaxkv._deprecation import deprecated_getattr as _deprecated_getattr
from jaxkv._parallel import PeerPlan, plan_peers
from jaxkv.ops import reference  # noqa: F401  (jaxkv.ops.reference: a public module)
from jaxkv.ops._block_ops import copy_blocks, gather_blocks, scatter_blocks
from jaxkv.ops._dispatch import current_implementation, implementation
from jaxkv.ops._id_errors import check_id_errors
from jaxkv.ops._ids import pad_block_ids
from jaxkv.ops._peer_ops import concat_from_peers, split_for_peers
from jaxkv.ops._reshape_ops import copy_block_prefix, merge_blocks, permute_blocks

__all__ = [
    "check_id_errors",
    "concat_from_peers",
    "copy_block_prefix",
    "copy_blocks",
    "current_implementation",
    "gather_blocks",
    "implementation",
    "merge_blocks",
    "pad_block_ids",
    "PeerPlan",
    "permute_blocks",
    "plan_peers",
    "scatter_blocks",
    "split_for_peers",
]

# Names that left the public API, kept one release (docs/guide.md, "Deprecated names"):
# each use warns with a DeprecationWarning naming what to use instead.
_DEPRECATED = {
    "IMPLEMENTATIONS": "jaxkv.ops._dispatch",
}
__getattr__ = _deprecated_getattr('jaxkv.ops', _DEPRECATED)
