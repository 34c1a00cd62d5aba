"""Block operations on blocks-first cache arrays, as in-place XLA FFI custom calls.

`reference` holds the pure-jnp implementations that define their semantics.
"""

from jaxkv.ops import reference
from jaxkv.ops._block_ops import copy_blocks, gather_blocks, scatter_blocks
from jaxkv.ops._ids import pad_block_ids

__all__ = ["copy_blocks", "gather_blocks", "pad_block_ids", "reference", "scatter_blocks"]
