"""`FreeBlockQueue`: the free blocks of a pool in eviction order, with O(1) removal anywhere.

vLLM keeps free blocks in a doubly linked list threaded through per-block Python objects. This
queue gives the same order and the same complexity without per-block objects: block ids live in
one int32 array (a deque that can grow at both ends), and ``pos[block]`` is the array index of
the block's entry, or -1 when the block is not queued. Removing a block from the middle only
sets ``pos[block] = -1`` (the entry becomes stale); pops skip stale entries, and the live
entries are compacted when stale ones outnumber them. Bulk operations are single numpy calls,
and memoryviews of the same arrays make one-block operations cheap Python integer reads.

The front of the queue is a Python list used as a stack (its last element is the front): single
blocks put at the front and taken from it, a decode step's churn, are one list append or pop.
Bulk operations first move the stack into the array.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from jaxkv.blocks._errors import InvalidBlockIdError, OutOfBlocksError

__all__ = ["FreeBlockQueue"]

_COMPACT_MIN_STALE = 256


class FreeBlockQueue:
    """Free block ids in eviction order: the front is evicted (reused) first.

    Args:
      num_blocks: size of the id space: ids are in ``[0, num_blocks)``.
      block_ids: the initial queue, front first (distinct ids).

    Raises:
      InvalidBlockIdError: an initial id out of range or repeated.

    Example:
      >>> queue = FreeBlockQueue(8, range(1, 8))
      >>> queue.popleft(), queue.popleft_n(2).tolist()
      (1, [2, 3])
      >>> queue.remove(5); queue.append(2); queue.prepend_n(np.array([3]))
      >>> queue.to_list(), len(queue)
      ([3, 4, 6, 7, 2], 5)
    """

    __slots__ = ("_buf", "_bufv", "_cap", "_front", "_head", "_len", "_num_blocks", "_pos",
                 "_posv", "_stale", "_tail")

    def __init__(self, num_blocks: int, block_ids: Iterable[int] | np.ndarray = ()) -> None:
        num_blocks = int(num_blocks)
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        ids = np.fromiter(block_ids, dtype=np.int64) if not isinstance(block_ids, np.ndarray) \
            else block_ids.astype(np.int64, copy=False).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= num_blocks):
            raise InvalidBlockIdError(f"initial block ids must be in [0, {num_blocks})")
        if np.unique(ids).size != ids.size:
            raise InvalidBlockIdError("initial block ids must be distinct")
        self._num_blocks = num_blocks
        self._cap = 4 * num_blocks + 64
        self._buf = np.zeros(self._cap, dtype=np.int32)
        self._pos = np.full(num_blocks, -1, dtype=np.int64)
        count = int(ids.size)
        head = (self._cap - count) // 2
        self._buf[head : head + count] = ids
        self._pos[ids] = np.arange(head, head + count)
        self._head = head
        self._tail = head + count
        self._len = count  # Entries in the array (the front stack not included).
        self._stale = 0
        self._bufv = self._buf.data  # memoryviews: cheap scalar access to the same memory.
        self._posv = self._pos.data
        # The queue's front, front block last; its blocks have pos -1 (not in the array).
        self._front: list[int] = []

    def __len__(self) -> int:
        """Number of queued (free) blocks."""
        return self._len + len(self._front)

    def __contains__(self, block_id: int) -> bool:
        """Whether ``block_id`` is queued."""
        if not 0 <= block_id < self._num_blocks:
            return False
        return self._posv[block_id] >= 0 or block_id in self._front

    def _flush_front(self) -> None:
        """Moves the front stack into the array (same order)."""
        front = self._front
        if front:
            ids = np.asarray(front[::-1], dtype=np.int64)
            front.clear()
            self._prepend_array(ids)

    @staticmethod
    def _as_ids(block_ids: Any) -> np.ndarray:
        """Block ids (any sequence of ints or an integer array) as a 1-D int64 array."""
        if isinstance(block_ids, np.ndarray):
            array = block_ids
        else:
            try:
                array = np.asarray(block_ids)
            except (TypeError, ValueError) as error:
                raise InvalidBlockIdError(
                    f"block ids must be a sequence of ints: {error}"
                ) from None
        if array.ndim != 1:
            raise InvalidBlockIdError(f"block ids must be one-dimensional, got shape {array.shape}")
        if array.size == 0:
            return array.astype(np.int64)
        if array.dtype.kind not in "iu":
            raise InvalidBlockIdError(f"block ids must be integers, got dtype {array.dtype}")
        return array

    def to_list(self) -> list[int]:
        """The queued ids, front (next evicted) first. O(queue length); for tests and
        debugging.

        Example:
          >>> FreeBlockQueue(4, [3, 1]).to_list()
          [3, 1]
        """
        window = self._buf[self._head : self._tail]
        live = self._pos[window] == np.arange(self._head, self._tail)
        return self._front[::-1] + window[live].tolist()

    # ------------------------------------------------------------------ removal from the front

    def popleft(self) -> int:
        """Removes and returns the front block.

        Raises:
          OutOfBlocksError: the queue is empty.

        Example:
          >>> FreeBlockQueue(4, [2, 3]).popleft()
          2
        """
        if self._front:
            return self._front.pop()
        if self._len == 0:
            raise OutOfBlocksError("no free blocks available")
        buf = self._bufv
        pos = self._posv
        head = self._head
        block = buf[head]
        while pos[block] != head:  # Stale entry: skip it.
            head += 1
            self._stale -= 1
            block = buf[head]
        pos[block] = -1
        self._head = head + 1
        self._len -= 1
        return block

    def popleft_n(self, count: int) -> np.ndarray:
        """Removes and returns the ``count`` front blocks, front first.

        Raises:
          OutOfBlocksError: fewer than ``count`` blocks are queued.

        Example:
          >>> FreeBlockQueue(4, [3, 1, 2]).popleft_n(2).tolist()
          [3, 1]
        """
        if count > self._len + len(self._front):
            raise OutOfBlocksError(f"cannot take {count} blocks: {len(self)} free")
        self._flush_front()
        head = self._head
        if count <= 0:
            return np.zeros(0, dtype=np.int32)
        if self._stale == 0:
            ids = self._buf[head : head + count].copy()
            self._head = head + count
        else:
            extra = min(self._stale, max(count, 64))
            while True:
                end = min(self._tail, head + count + extra)
                window = self._buf[head:end]
                found = np.flatnonzero(self._pos[window] == np.arange(head, end))
                if found.size >= count:
                    break
                if extra >= self._stale:  # pragma: no cover - would be a broken invariant
                    raise AssertionError("free queue length and entries disagree")
                extra = min(self._stale, 2 * extra)
            found = found[:count]
            last = int(found[-1])
            ids = window[found]
            self._stale -= last + 1 - count
            self._head = head + last + 1
        self._pos[ids] = -1
        self._len -= count
        return ids

    # ------------------------------------------------------------------ removal from the middle

    def remove(self, block_id: int) -> None:
        """Removes a queued block wherever it is, in O(1).

        Raises:
          InvalidBlockIdError: the block is not queued.

        Example:
          >>> queue = FreeBlockQueue(4, [1, 2, 3]); queue.remove(2); queue.to_list()
          [1, 3]
        """
        if not 0 <= block_id < self._num_blocks or self._posv[block_id] < 0:
            if block_id in self._front:
                self._front.remove(block_id)
                return
            raise InvalidBlockIdError(f"block {block_id} is not in the free queue")
        self._posv[block_id] = -1
        self._len -= 1
        self._stale += 1
        self._maybe_compact()

    def remove_n(self, block_ids: Sequence[int] | np.ndarray) -> None:
        """Removes queued blocks (distinct ids) wherever they are, O(1) each.

        Args:
          block_ids: any sequence of ints (a list, a tuple, a numpy array).

        Raises:
          InvalidBlockIdError: a block is not queued, out of range or not an int (nothing is
            removed).

        Example:
          >>> queue = FreeBlockQueue(4, [1, 2, 3]); queue.remove_n([3, 1])
          >>> queue.to_list()
          [2]
        """
        self._remove_unchecked(self._checked_ids(block_ids))

    def _remove_unchecked(self, block_ids: np.ndarray) -> None:
        if block_ids.size == 0:
            return
        self._flush_front()
        if (self._pos[block_ids] < 0).any():
            bad = block_ids[self._pos[block_ids] < 0][0]
            raise InvalidBlockIdError(f"block {int(bad)} is not in the free queue")
        self._pos[block_ids] = -1
        self._len -= int(block_ids.size)
        self._stale += int(block_ids.size)
        self._maybe_compact()

    # ------------------------------------------------------------------ insertion

    def append(self, block_id: int) -> None:
        """Puts a block at the back (evicted last). The caller guarantees it is not queued.

        Example:
          >>> queue = FreeBlockQueue(4, [1]); queue.append(3); queue.to_list()
          [1, 3]
        """
        if self._tail == self._cap:
            self._compact()
        tail = self._tail
        self._bufv[tail] = block_id
        self._posv[block_id] = tail
        self._tail = tail + 1
        self._len += 1

    def append_n(self, block_ids: Sequence[int] | np.ndarray) -> None:
        """Puts blocks at the back in the given order (distinct, not queued).

        Args:
          block_ids: any sequence of ints (a list, a tuple, a numpy array).

        Raises:
          InvalidBlockIdError: an id out of range or not an int (nothing is queued).

        Example:
          >>> queue = FreeBlockQueue(4, [1]); queue.append_n([3, 2]); queue.to_list()
          [1, 3, 2]
        """
        self._append_unchecked(self._checked_ids(block_ids))

    def _append_unchecked(self, block_ids: np.ndarray) -> None:
        count = int(block_ids.size)
        if count == 0:
            return
        if self._tail + count > self._cap:
            self._compact()
        tail = self._tail
        self._buf[tail : tail + count] = block_ids
        self._pos[block_ids] = np.arange(tail, tail + count)
        self._tail = tail + count
        self._len += count

    def prepend(self, block_id: int) -> None:
        """Puts a block at the front (evicted first). The caller guarantees it is not queued.

        Example:
          >>> queue = FreeBlockQueue(4, [1]); queue.prepend(3); queue.to_list()
          [3, 1]
        """
        self._front.append(block_id)

    def prepend_n(self, block_ids: Sequence[int] | np.ndarray) -> None:
        """Puts blocks at the front keeping their order: ``block_ids[0]`` becomes the front.

        Args:
          block_ids: any sequence of ints (a list, a tuple, a numpy array).

        Raises:
          InvalidBlockIdError: an id out of range or not an int (nothing is queued).

        Example:
          >>> queue = FreeBlockQueue(4, [1]); queue.prepend_n([3, 2]); queue.to_list()
          [3, 2, 1]
        """
        self._prepend_unchecked(self._checked_ids(block_ids))

    def _prepend_unchecked(self, block_ids: np.ndarray) -> None:
        if block_ids.size == 0:
            return
        self._flush_front()
        self._prepend_array(block_ids)

    def _checked_ids(self, block_ids: Any) -> np.ndarray:
        array = self._as_ids(block_ids)
        if array.size and (array.min() < 0 or array.max() >= self._num_blocks):
            raise InvalidBlockIdError(
                f"block ids must be in [0, {self._num_blocks}), got {array.min()}..{array.max()}"
            )
        return array

    def _prepend_array(self, block_ids: np.ndarray) -> None:
        count = int(block_ids.size)
        if self._head < count:
            self._compact()
        head = self._head - count
        self._buf[head : self._head] = block_ids
        self._pos[block_ids] = np.arange(head, self._head)
        self._head = head
        self._len += count

    # ------------------------------------------------------------------ maintenance

    def _maybe_compact(self) -> None:
        if self._stale > _COMPACT_MIN_STALE and self._stale > self._len:
            self._compact()

    def _compact(self) -> None:
        window = self._buf[self._head : self._tail]
        live = window[self._pos[window] == np.arange(self._head, self._tail)]
        count = int(live.size)
        head = (self._cap - count) // 2
        self._buf[head : head + count] = live
        self._pos[live] = np.arange(head, head + count)
        self._head = head
        self._tail = head + count
        self._stale = 0

    def check(self) -> None:
        """Verifies the queue's internal consistency. O(capacity).

        Raises:
          AssertionError: with the violated property.

        Example:
          >>> FreeBlockQueue(4, [1, 2]).check()
        """
        window = self._buf[self._head : self._tail]
        live_mask = self._pos[window] == np.arange(self._head, self._tail)
        live = window[live_mask]
        front = np.asarray(self._front, dtype=np.int64)
        if front.size:
            if np.unique(front).size != front.size:
                raise AssertionError("a block is on the front stack twice")
            if front.min() < 0 or front.max() >= self._num_blocks:
                raise AssertionError("a front-stack block id is out of range")
            if (self._pos[front] >= 0).any():
                raise AssertionError("a front-stack block is also in the array")
        if live.size != self._len:
            raise AssertionError(
                f"free queue holds {live.size} live entries, length says {self._len}"
            )
        if int(self._tail - self._head) - self._len != self._stale:
            raise AssertionError("free queue stale-entry count is wrong")
        if np.unique(live).size != live.size:
            raise AssertionError("a block is queued twice")
        queued = np.flatnonzero(self._pos >= 0)
        if queued.size != self._len:
            raise AssertionError("pos marks blocks as queued that have no live entry")
        if not np.array_equal(np.sort(live), queued):
            raise AssertionError("free queue entries and positions disagree")
