"""Exceptions raised by `jaxkv.blocks`.

Every error is raised *before* any state changes, so a pool or manager that raised is still
consistent and usable (its invariants hold).
"""

from __future__ import annotations

__all__ = [
    "BlockError",
    "DoubleFreeError",
    "InsufficientMemoryError",
    "InvalidBlockIdError",
    "OutOfBlocksError",
    "PartialBlockError",
    "UnknownRequestError",
]


class BlockError(ValueError):
    """Base class of the block manager's errors (a `ValueError`: the input was wrong).

    Example:
      >>> issubclass(DoubleFreeError, BlockError)
      True
    """


class InvalidBlockIdError(BlockError, IndexError):
    """A block id outside ``[0, num_blocks)``, not an integer, or a block in the wrong state
    for the operation (for example touching a free block that holds no cached data).

    Example:
      >>> raise InvalidBlockIdError("block id 99 is out of range for a pool of 8 blocks")
      Traceback (most recent call last):
      ...
      jaxkv.blocks._errors.InvalidBlockIdError: block id 99 is out of range for a pool of 8 blocks
    """


class DoubleFreeError(BlockError):
    """Freeing a block more times than it is referenced (a double free, or a free of a block
    that was never allocated).

    Example:
      >>> raise DoubleFreeError("block 3 is already free")
      Traceback (most recent call last):
      ...
      jaxkv.blocks._errors.DoubleFreeError: block 3 is already free
    """


class OutOfBlocksError(BlockError):
    """Asking for more blocks than the pool has free.

    Example:
      >>> raise OutOfBlocksError("cannot allocate 9 blocks: 7 free")
      Traceback (most recent call last):
      ...
      jaxkv.blocks._errors.OutOfBlocksError: cannot allocate 9 blocks: 7 free
    """


class PartialBlockError(BlockError):
    """A full-block hash was asked for a token list that does not fill a block.

    Example:
      >>> raise PartialBlockError("a full block holds 16 tokens, got 5")
      Traceback (most recent call last):
      ...
      jaxkv.blocks._errors.PartialBlockError: a full block holds 16 tokens, got 5
    """


class UnknownRequestError(BlockError, KeyError):
    """A request id the manager does not know (never added, or already freed), or one added
    twice.

    Example:
      >>> str(UnknownRequestError("unknown request 'r1'"))
      "unknown request 'r1'"
    """

    def __str__(self) -> str:  # KeyError would quote the message again.
        return str(self.args[0]) if self.args else ""


class InsufficientMemoryError(BlockError):
    """The memory budget cannot hold the KV cache of one request of the maximum model length.

    Example:
      >>> raise InsufficientMemoryError("no memory available for the KV cache")
      Traceback (most recent call last):
      ...
      jaxkv.blocks._errors.InsufficientMemoryError: no memory available for the KV cache
    """
