"""The file tier: KV blocks in files named by their prefix hash, so a restarted engine (or
another engine of the same model) finds them.

Directory layout (``<root>/<compat key>/``): ``blocks/<hash hex>.kvb`` (one file per block: a
4 KiB header, then the payload), ``tmp/`` (files being written), ``quarantine/`` (files that
failed their checks) and ``manifest.msgpack`` (the blocks in LRU order). The compat key hashes
the model id, the cache geometry, dtype, layout and TP arrangement, so an engine of another
model or shape never sees (let alone loads) these blocks; every header repeats it and is checked
on read.

Writes go to a temporary file, are synced (``fdatasync``) and then renamed into place
(`os.replace`): a crash never leaves a half-written block visible. Reads verify an xxh3-128
checksum of the payload; a mismatch is a miss and the file is quarantined. Header and payload
move in one ``os.preadv`` / ``os.pwritev`` per block (``backend="files"``, the default) or one
NIXL POSIX transfer per batch (``backend="nixl"``), directly between the caller's memory and
the file. Published files are immutable; the tier keeps an LRU of open fds, and a write that
evicts a block reuses its file (renamed into ``tmp/`` at once, overwritten in place, synced,
renamed to the new name), which avoids an unlink and new block allocation per write.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import ctypes
import dataclasses
import functools
import hashlib
import logging
import os
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import numpy as np
import xxhash

from jaxkv._spec import KVCacheSpec
from jaxkv.offload._ordering import Dependency, wait_for
from jaxkv.offload._types import BlockCorruptError, IncompatibleTierError, OffloadTimeoutError

__all__ = ["FORMAT_VERSION", "FileTier", "FileTierStats", "TierFuture", "file_compat_fields"]

FORMAT_VERSION = 1
_MAGIC = b"JAXKVBK1"
_HEADER_BYTES = 4096  # The payload starts here (page aligned).
_SUFFIX = ".kvb"

Region = tuple[int, int]
"""``(address, nbytes)`` of host memory."""

_encode = msgspec.msgpack.Encoder().encode
_log = logging.getLogger(__name__)


class _Header(msgspec.Struct, frozen=True):
    format_version: int
    compat_key: str
    block_hash: str
    payload_nbytes: int
    checksum: str


class _Manifest(msgspec.Struct):
    format_version: int
    compat_key: str
    fields: dict[str, Any]
    entries: list[tuple[str, int]]  # (hash hex, file bytes), least recently used first.


@dataclasses.dataclass
class FileTierStats:
    """Counters of a `FileTier` (cumulative).

    Attributes:
      writes: blocks published. write_bytes: their payload bytes.
      skipped_writes: writes of blocks already on disk (content-addressed: nothing to do).
      rejected_writes: writes refused because every other block was being read (budget full).
      reads: blocks looked up. hits: blocks loaded. misses: not on disk.
      corrupt: blocks that failed the header or checksum check (quarantined).
      evictions: blocks removed to stay within the size budget.
      write_s, read_s: seconds spent in file I/O (workers).
    """

    writes: int = 0
    write_bytes: int = 0
    skipped_writes: int = 0
    rejected_writes: int = 0
    reads: int = 0
    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    evictions: int = 0
    write_s: float = 0.0
    read_s: float = 0.0


def file_compat_fields(spec: KVCacheSpec, model_id: str, tp_size: int = 1) -> dict[str, Any]:
    """What must match for block files to be reusable: the model id, the cache geometry, dtype,
    layout, and the TP arrangement of the payload (shards in head order).

    Example:
      >>> spec = KVCacheSpec(2, 4, 8, 16, "bfloat16")
      >>> file_compat_fields(spec, "llama-3-8b@rev1")["dtype"]
      'bfloat16'
    """
    return {
        "format_version": FORMAT_VERSION,
        "model_id": str(model_id),
        "num_layers": spec.num_layers,
        "num_kv_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "block_size": spec.block_size,
        "dtype": spec.dtype.name,
        "layout": spec.layout,
        "kv_factor": spec.kv_factor,
        "mla": spec.mla,
        "num_arrays": spec.num_arrays,
        "tp_size": int(tp_size),
    }


def _compat_key(fields: dict[str, Any]) -> str:
    return hashlib.sha256(msgspec.msgpack.encode(sorted(fields.items()))).hexdigest()


def _view(address: int, nbytes: int) -> memoryview:
    """A writable memoryview of raw host memory (no copy)."""
    return memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")


def _checksum(regions: Sequence[Region]) -> str:
    if len(regions) == 1:
        return xxhash.xxh3_128_hexdigest(_view(*regions[0]))
    digest = xxhash.xxh3_128()
    for address, nbytes in regions:
        digest.update(_view(address, nbytes))
    return digest.hexdigest()


def _views_checksum(views: Sequence[memoryview]) -> str:
    """`_checksum` of the regions behind `views` (the same digest)."""
    if len(views) == 1:
        return xxhash.xxh3_128_hexdigest(views[0])
    digest = xxhash.xxh3_128()
    for view in views:
        digest.update(view)
    return digest.hexdigest()


def _publish(tmp_path: str, final_path: str) -> None:
    """The atomic publish of a written block (a seam for crash tests)."""
    os.replace(tmp_path, final_path)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclasses.dataclass
class _Job:
    """One block file's I/O: its fd, a page-sized header buffer, the payload regions."""

    fd: int
    head: bytearray
    regions: Sequence[Region]
    views: Sequence[memoryview] | None = None  # Of the regions, when already made.


class _FilesIO:
    """Payload I/O with os.pwritev / os.preadv (header and payload in one call) on raw memory
    views; no intermediate copies."""

    name = "files"

    def forget(self, fd: int) -> None:
        """Called before an fd is closed (nothing to release here)."""

    def write_many(self, jobs: Sequence[_Job], deadline: float) -> None:
        for job in jobs:
            views = [memoryview(job.head), *(_view(a, n) for a, n in job.regions)]
            total = sum(len(v) for v in views)
            done = os.pwritev(job.fd, views, 0)
            if done != total:  # Short write: finish it region by region.
                position = 0
                for view in views:
                    end = position + len(view)
                    if end > done:
                        start = max(0, done - position)
                        chunk = view[start:]
                        while chunk:
                            written = os.pwrite(job.fd, chunk, position + start)
                            chunk = chunk[written:]
                            start += written
                    position = end

    def read_many(self, jobs: Sequence[_Job], deadline: float) -> list[int]:
        """Reads each job's header and payload; returns the bytes read per job (short for a
        truncated file)."""
        return [os.preadv(job.fd, [job.head, *(job.views if job.views is not None else
                                               [_view(a, n) for a, n in job.regions])], 0)
                for job in jobs]


class _NixlIO:
    """Payload I/O through a NIXL agent with the POSIX backend (loopback DRAM <-> FILE).

    One transfer per batch (every block's header and payload); a file descriptor is
    registered once and stays registered while the tier keeps it open (`forget` releases it).
    """

    name = "nixl"

    def __init__(self) -> None:
        from jaxkv.transfer._agent import load_nixl

        nixl = load_nixl()
        self._name = f"jaxkv-offload-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        config = nixl.nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False,
                                        backends=[])
        self._agent = nixl.nixl_agent(self._name, config)
        self._agent.create_backend("POSIX", {})
        self._lock = threading.Lock()
        self._registered: list[tuple[int, int, Any]] = []
        self._files: dict[int, Any] = {}

    def register(self, buffers: Sequence[Region]) -> None:
        """Registers long-lived host buffers (e.g. the host pool) once."""
        with self._lock:
            for address, nbytes in buffers:
                if self._covered(address, nbytes):
                    continue
                handle = self._agent.register_memory(
                    np.array([[address, nbytes, 0]], dtype=np.uint64), "DRAM")
                self._registered.append((address, nbytes, handle))

    def forget(self, fd: int) -> None:
        """Deregisters a file descriptor (before it is closed: fd numbers are reused)."""
        with self._lock:
            handle = self._files.pop(fd, None)
            if handle is not None:
                self._agent.deregister_memory(handle)

    def unregister_all(self) -> None:
        with self._lock:
            for _, _, handle in self._registered:
                self._agent.deregister_memory(handle)
            for handle in self._files.values():
                self._agent.deregister_memory(handle)
            self._registered = []
            self._files = {}

    def _covered(self, address: int, nbytes: int) -> bool:
        return any(a <= address and address + nbytes <= a + n for a, n, _ in self._registered)

    def _transfer(self, op: str, jobs: Sequence[_Job], deadline: float) -> None:
        if not jobs:
            return
        agent = self._agent
        heads = np.empty((len(jobs), _HEADER_BYTES), np.uint8)  # One DRAM buffer for all headers.
        if op == "WRITE":
            for row, job in zip(heads, jobs):
                row[:] = np.frombuffer(job.head, np.uint8)
        dram_list, file_list = [], []
        for row, job in zip(heads, jobs):
            dram_list.append([row.ctypes.data, _HEADER_BYTES, 0])
            file_list.append((0, _HEADER_BYTES, job.fd))
            position = _HEADER_BYTES
            for address, nbytes in job.regions:
                dram_list.append([address, nbytes, 0])
                file_list.append((position, nbytes, job.fd))
                position += nbytes
        with self._lock:
            extra = [(a, n) for a, n in {(a, n) for job in jobs for a, n in job.regions}
                     if not self._covered(a, n)]
            extra.append((heads.ctypes.data, heads.nbytes))
            dram_handle = agent.register_memory(
                np.array([[a, n, 0] for a, n in extra], dtype=np.uint64), "DRAM")
            handle = None
            try:
                for job in jobs:
                    if job.fd not in self._files:
                        self._files[job.fd] = agent.register_memory(
                            [(0, _HEADER_BYTES + sum(n for _, n in job.regions), job.fd, "")],
                            "FILE")
                dram = agent.get_xfer_descs(np.array(dram_list, dtype=np.uint64), "DRAM")
                files = agent.get_xfer_descs(file_list, "FILE")
                handle = agent.initialize_xfer(op, dram, files, self._name)
                state = agent.transfer(handle)
                begin, pause = time.monotonic(), 1e-4
                while state not in ("DONE", "ERR"):
                    now = time.monotonic()
                    if now > deadline:
                        raise OffloadTimeoutError(f"NIXL {op} of block files timed out")
                    if now - begin > 2e-3:  # Spin (yielding) briefly, then back off.
                        time.sleep(pause)
                        pause = min(2 * pause, 1e-3)
                    else:
                        time.sleep(0)
                    state = agent.check_xfer_state(handle)
                if state == "ERR":
                    raise OSError(f"NIXL POSIX {op} failed")
            finally:
                if handle is not None:
                    agent.release_xfer_handle(handle)
                agent.deregister_memory(dram_handle)
        if op == "READ":
            for row, job in zip(heads, jobs):
                job.head[:] = row.tobytes()

    def write_many(self, jobs: Sequence[_Job], deadline: float) -> None:
        self._transfer("WRITE", jobs, deadline)

    def read_many(self, jobs: Sequence[_Job], deadline: float) -> list[int]:
        got, whole = [], []
        for job in jobs:
            size = os.fstat(job.fd).st_size
            total = _HEADER_BYTES + sum(n for _, n in job.regions)
            if size < total:  # Truncated file: NIXL would fail; read what is there.
                got.append(os.preadv(job.fd, [job.head, *(_view(a, n) for a, n in job.regions)],
                                     0))
            else:
                got.append(total)
                whole.append(job)
        self._transfer("READ", whole, deadline)
        return got


class _Task:
    """Work that runs at most once, on whichever thread claims it first."""

    def __init__(self, fn: Callable[[], None]) -> None:
        self._fn: Callable[[], None] | None = fn
        self._claim = threading.Lock()

    def __call__(self) -> None:
        if self._claim.acquire(blocking=False):
            fn, self._fn = self._fn, None
            assert fn is not None  # only the thread holding the claim gets here, once
            fn()


class TierFuture(concurrent.futures.Future):
    """The future of a file tier operation.

    A thread that asks for its result (`result`, `exception`) while the operation is still
    queued runs the operation itself instead of waiting for a worker thread to pick it up:
    this saves two thread hand-offs when the caller waits at once, and the operation stays
    asynchronous when it does not. The operation still waits for its dependencies and
    keeps its deadline; `timeout` bounds only the wait for an operation a worker runs.
    """

    def __init__(self) -> None:
        super().__init__()
        self._tasks: list[Callable[[], None]] = []

    def help_with(self, task: Callable[[], None]) -> None:
        """Registers queued work that produces this future's result (runs at most once)."""
        self._tasks.append(task)

    def run_if_queued(self) -> None:
        """Runs the registered work here if no thread has started it yet (never waits)."""
        if not self.done():
            for task in list(self._tasks):
                task()

    def result(self, timeout: float | None = None) -> Any:
        """As `concurrent.futures.Future.result`, running the operation here if queued."""
        self.run_if_queued()
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """As `concurrent.futures.Future.exception`, running the operation here if queued."""
        self.run_if_queued()
        return super().exception(timeout)


class FileTier:
    """A content-addressed, size-bounded store of KV blocks in files, with LRU eviction.

    Thread-safe. I/O runs on a bounded pool of worker threads; `write_async` / `read_async`
    return futures, and every wait has a timeout. `read_async` is the one read path (queued,
    or run on the calling thread with ``inline=True``); `get`, `queue_checked_read` and
    `read_checked_now` are deprecated aliases of it.

    Args:
      directory: root directory (shared by models: each compat key gets its own
        subdirectory).
      spec: the cache spec of the blocks.
      model_id: identifies the model weights (e.g. name and revision): blocks of another model
        with the same geometry must never be loaded.
      capacity_bytes: size budget of the files (headers included); the least recently used
        blocks are removed to make room.
      tp_size: the TP size of the pool the blocks come from (the payload holds the shards in
        head order).
      backend: "files" (``os.preadv`` / ``os.pwritev``), "nixl" (NIXL's POSIX backend: one
        transfer per batch, files registered once while open) or "auto" (= "files": faster
        for host memory, measured in benchmarks/RESULTS.md).
      num_workers: I/O threads.
      durable: fsync each block file and the directory before the block becomes visible.
      create: create `directory` when missing (otherwise a missing directory is an error).
      timeout_s: default timeout of every wait.
      max_open_files: how many block files the tier keeps open (least recently used are
        closed first); 0 opens and closes a file per access.

    Raises:
      FileNotFoundError: `directory` does not exist and `create` is False.
      ValueError: bad arguments (e.g. a budget smaller than one block).
      ImportError: ``backend="nixl"`` without NIXL.

    Example:
      >>> import tempfile
      >>> spec = KVCacheSpec(1, 1, 4, 2, "float32", layout="THD")
      >>> tier = FileTier(tempfile.mkdtemp(), spec=spec, model_id="m", capacity_bytes=1 << 20,
      ...                 backend="files")
      >>> block = np.arange(16, dtype=np.float32)
      >>> tier.put(b"h0", block); out = np.zeros_like(block)
      True
      >>> tier.read_async([(b"h0", out)]).result(10), bool((out == block).all())
      ([True], True)
      >>> tier.close()
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        spec: KVCacheSpec,
        model_id: str,
        capacity_bytes: int,
        tp_size: int = 1,
        backend: str = "auto",
        num_workers: int = 2,
        durable: bool = True,
        create: bool = False,
        timeout_s: float = 60.0,
        max_open_files: int = 256,
    ) -> None:
        root = os.fspath(directory)
        if not os.path.isdir(root):
            if not create:
                raise FileNotFoundError(
                    f"file tier directory {root!r} does not exist (pass create=True to create it)")
            os.makedirs(root, exist_ok=True)
        if not isinstance(model_id, str) or not model_id:
            raise ValueError("model_id must be a non-empty string naming the model weights")
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if max_open_files < 0:
            raise ValueError(f"max_open_files must be >= 0, got {max_open_files}")
        self.spec = spec
        self.fields = file_compat_fields(spec, model_id, tp_size)
        self.compat_key = _compat_key(self.fields)
        self.payload_nbytes = spec.block_nbytes() * spec.num_arrays
        self.file_nbytes = _HEADER_BYTES + self.payload_nbytes
        if capacity_bytes < self.file_nbytes:
            raise ValueError(f"capacity_bytes={capacity_bytes} is smaller than one block file "
                             f"({self.file_nbytes} bytes)")
        self.capacity_bytes = int(capacity_bytes)
        self.durable = bool(durable)
        self.timeout_s = float(timeout_s)
        self.directory = os.path.join(root, self.compat_key[:32])
        self._blocks = os.path.join(self.directory, "blocks")
        self._tmp = os.path.join(self.directory, "tmp")
        self._quarantine = os.path.join(self.directory, "quarantine")
        for path in (self._blocks, self._tmp, self._quarantine):
            os.makedirs(path, exist_ok=True)
        if backend == "auto":
            # The payload is host memory (the host pool), where NIXL's POSIX backend does what
            # preadv/pwritev do, with more overhead: benchmarks/RESULTS.md, "Offload tiers".
            backend = "files"
        if backend == "nixl":
            self._io: _FilesIO | _NixlIO = _NixlIO()
        elif backend == "files":
            self._io = _FilesIO()
        else:
            raise ValueError(f"backend must be 'auto', 'nixl' or 'files', got {backend!r}")
        self._lock = threading.RLock()
        self._manifest_lock = threading.Lock()
        self._entries: collections.OrderedDict[bytes, int] = collections.OrderedDict()
        self._readers: collections.Counter[bytes] = collections.Counter()
        self._writing: set[bytes] = set()
        # Open fds of published blocks (O_RDWR; least recently used first), each owned by the
        # cache or by one worker at a time: reads skip the open, and an evicted block's file is
        # overwritten in place by the next write (no unlink, no new allocation).
        self._fds: collections.OrderedDict[bytes, int] = collections.OrderedDict()
        self._max_open_files = int(max_open_files)
        self._bytes_used = 0
        self.stats = FileTierStats()
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=num_workers, thread_name_prefix="jaxkv-file-tier")
        # Leaf tasks only (fdatasync): they never wait on the workers, so no deadlock.
        self._helpers = concurrent.futures.ThreadPoolExecutor(
            max_workers=8, thread_name_prefix="jaxkv-file-tier-sync")
        self._closed = False
        self._recover()

    # ------------------------------------------------------------------ properties

    @property
    def backend(self) -> str:
        """The payload I/O backend in use: "nixl" or "files"."""
        return self._io.name

    @property
    def bytes_used(self) -> int:
        """Bytes of the published block files."""
        with self._lock:
            return self._bytes_used

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def __repr__(self) -> str:
        return (f"FileTier({self.directory!r}, blocks={len(self)}, bytes_used={self.bytes_used}, "
                f"capacity_bytes={self.capacity_bytes}, backend={self.backend!r})")

    def contains(self, block_hash: bytes) -> bool:
        """Whether a published file holds the block (it may still fail its checksum on read).

        Example:
          >>> import tempfile
          >>> tier = FileTier(tempfile.mkdtemp(), spec=KVCacheSpec(1, 1, 4, 2, "float32"),
          ...                 model_id="m", capacity_bytes=1 << 20, backend="files")
          >>> tier.contains(b"h")
          False
        """
        with self._lock:
            return bytes(block_hash) in self._entries

    def block_hashes(self) -> list[bytes]:
        """The stored block hashes, least recently used first."""
        with self._lock:
            return list(self._entries)

    def path_of(self, block_hash: bytes) -> str:
        """The file name a block is (or would be) published under."""
        return os.path.join(self._blocks, bytes(block_hash).hex() + _SUFFIX)

    def register_memory(self, buffers: Sequence[Region]) -> None:
        """Registers long-lived host buffers (a host pool) with the NIXL backend once, instead
        of per transfer; a no-op for plain files."""
        if isinstance(self._io, _NixlIO):
            self._io.register(buffers)

    # ------------------------------------------------------------------ recovery

    def _recover(self) -> None:
        """Loads the manifest, reconciles it with the files and removes leftovers."""
        for name in os.listdir(self._tmp):  # Writes that never published (crash).
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(self._tmp, name))
        manifest_path = os.path.join(self.directory, "manifest.msgpack")
        order: list[str] = []
        if os.path.exists(manifest_path):
            try:
                with open(manifest_path, "rb") as handle:
                    manifest = msgspec.msgpack.decode(handle.read(), type=_Manifest)
                if manifest.compat_key != self.compat_key:
                    raise IncompatibleTierError(
                        f"{manifest_path} belongs to compat key {manifest.compat_key[:12]}..., "
                        f"this tier is {self.compat_key[:12]}...")
                order = [entry[0] for entry in manifest.entries]
            except (msgspec.DecodeError, msgspec.ValidationError, OSError) as error:
                _log.warning("jaxkv file tier: ignoring unreadable manifest %s (%s); "
                                "scanning the files", manifest_path, error)
        on_disk = {}
        for name in os.listdir(self._blocks):
            if not name.endswith(_SUFFIX):
                continue
            try:
                digest = bytes.fromhex(name[: -len(_SUFFIX)])
                on_disk[digest] = os.stat(os.path.join(self._blocks, name)).st_size
            except (ValueError, OSError):
                continue
        listed = []
        for hex_hash in order:
            try:
                digest = bytes.fromhex(hex_hash)
            except ValueError:
                continue
            if digest in on_disk:
                listed.append(digest)
        unlisted = [d for d in on_disk if d not in set(listed)]  # Published after the manifest.
        for digest in unlisted + listed:
            self._entries[digest] = on_disk[digest]
            self._bytes_used += on_disk[digest]
        with self._lock:
            self._evict_to_fit(0)
        self.flush()

    # ------------------------------------------------------------------ budget

    def _evict_to_fit(self, incoming: int,
                      victims: list[tuple[str, int | None]] | None = None) -> bool:
        """Removes LRU blocks not being read until `incoming` more bytes fit (lock held).

        With `victims`, an evicted file is renamed into tmp/ (out of sight at once) and
        appended as ``(tmp path, open fd or None)`` for the caller to reuse or delete;
        otherwise it is deleted.
        """
        if self._bytes_used + incoming <= self.capacity_bytes:
            return True
        for digest in list(self._entries):
            if self._bytes_used + incoming <= self.capacity_bytes:
                break
            if self._readers[digest]:
                continue
            if victims is None:
                self._remove_locked(digest)
            else:
                self._bytes_used -= self._entries.pop(digest)
                fd = self._fds.pop(digest, None)
                tmp = os.path.join(self._tmp, f"evicted.{uuid.uuid4().hex}.tmp")
                try:
                    os.replace(self.path_of(digest), tmp)
                    victims.append((tmp, fd))
                except FileNotFoundError:
                    if fd is not None:
                        self._close_fd(fd)
            self.stats.evictions += 1
        return self._bytes_used + incoming <= self.capacity_bytes

    def _remove_locked(self, digest: bytes) -> None:
        nbytes = self._entries.pop(digest)
        self._bytes_used -= nbytes
        fd = self._fds.pop(digest, None)
        if fd is not None:
            self._close_fd(fd)
        _unlink_quietly(self.path_of(digest))

    def remove(self, block_hash: bytes) -> bool:
        """Deletes a block's file (not while it is being read).

        Returns:
          Whether a block was removed.
        """
        digest = bytes(block_hash)
        with self._lock:
            if digest not in self._entries or self._readers[digest]:
                return False
            self._remove_locked(digest)
        self.flush()
        return True

    def flush(self) -> None:
        """Writes the manifest (atomically: temporary file, fsync, rename)."""
        with self._lock:
            entries = [(d.hex(), n) for d, n in self._entries.items()]
        manifest = _Manifest(FORMAT_VERSION, self.compat_key, self.fields, entries)
        data = msgspec.msgpack.encode(manifest)
        with self._manifest_lock:
            tmp = os.path.join(self._tmp, f"manifest.{uuid.uuid4().hex}")
            with open(tmp, "wb") as handle:
                handle.write(data)
                if self.durable:
                    handle.flush()
                    os.fsync(handle.fileno())
            os.replace(tmp, os.path.join(self.directory, "manifest.msgpack"))

    # ------------------------------------------------------------------ submit

    def _submit(self, result: concurrent.futures.Future, *args: Any) -> None:
        """Queues `_run(result, *args)` for a worker; a `TierFuture` result can also run it on
        the thread that waits for it first (whichever claims it first runs it, once)."""
        if self._closed:
            raise RuntimeError("the file tier is closed")
        task = _Task(functools.partial(self._run, result, *args))
        if isinstance(result, TierFuture):
            result.help_with(task)
        self._executor.submit(task)

    def write_async(
        self,
        items: Sequence[tuple[bytes, Sequence[Region]]],
        *,
        after: Sequence[Dependency] = (),
        skip: Callable[[], Sequence[bool]] | None = None,
        keepalive: Any = None,
        future: concurrent.futures.Future | None = None,
    ) -> concurrent.futures.Future:
        """Writes blocks from host memory into files, on a worker thread.

        Args:
          items: ``(block hash, regions)`` per block; the regions (address, nbytes) are the
            payload in order and add up to `payload_nbytes`. The memory must stay valid and
            unchanged until the future is done.
          after: copies that must finish first (e.g. the copy that filled the memory).
          skip: evaluated on the worker once `after` is done: one bool per block, True to not
            write it (its result is False), e.g. memory whose fill failed.
          keepalive: any object to keep referenced until the write is done (e.g. the numpy
            buffers behind the regions).
          future: a future to complete instead of a new one (for callers that registered it in
            an ordering first).

        Returns:
          A future of one bool per block: True when the block is on disk afterwards (written
          now, or already there), False when the budget could not make room (every other block
          was being read). It raises the I/O error if a write failed (nothing is published).

        Raises:
          ValueError: regions that do not add up to one block payload; a hash that is not bytes.
        """
        checked = []
        for block_hash, regions in items:
            if not isinstance(block_hash, bytes) or not block_hash:
                raise ValueError(f"block hashes must be non-empty bytes, got {block_hash!r}")
            regions = [(int(a), int(n)) for a, n in regions]
            if sum(n for _, n in regions) != self.payload_nbytes:
                raise ValueError(f"regions of block {block_hash.hex()[:12]} hold "
                                 f"{sum(n for _, n in regions)} bytes, a block has "
                                 f"{self.payload_nbytes}")
            checked.append((block_hash, regions))
        deadline = time.monotonic() + self.timeout_s
        result = future if future is not None else TierFuture()
        self._submit(result, self._write_batch, (checked, skip), list(after),
                     deadline, keepalive)
        return result

    def read_async(
        self,
        items: Sequence[tuple[bytes, Sequence[Region] | np.ndarray]],
        *,
        replicas: Sequence[Sequence[Sequence[Region]]] | None = None,
        after: Sequence[Dependency] = (),
        keepalive: Any = None,
        future: concurrent.futures.Future | None = None,
        inline: bool = False,
    ) -> concurrent.futures.Future:
        """Reads blocks from files into host memory: the tier's one read path.

        Every read is checked the same way: the destination must hold exactly one block
        payload, and each block's header and xxh3-128 payload checksum are verified before it
        counts as loaded (a file that fails is quarantined and read as a miss).

        By default the read is queued for a worker thread; a thread that then waits for the
        future while the read is still queued runs it itself (`TierFuture`). With
        ``inline=True`` it runs now, on the calling thread, and the future comes back done:
        no worker is woken, which saves the hand-off and the woken thread's contention for
        the GIL when the caller needs the blocks at once (`OffloadManager.read_file_now`).
        Either way the read first waits for `after` and gives up at the tier's timeout.

        Args:
          items: ``(block hash, destination)`` per block. The destination is a list of
            ``(address, nbytes)`` regions that receive the payload in order, or a writeable
            C-contiguous numpy array of one block payload (kept alive until the read is done).
          replicas: per block, extra copies of the regions (same lengths) to fill after the
            checksum passed (replicated heads); None for none.
          after: copies that must finish first (earlier readers and writers of the memory).
          keepalive, future: as in `write_async`.
          inline: run the read on the calling thread before returning (see above).

        Returns:
          A future of one bool per block: True when loaded and verified; False for a miss
          (not on disk, or a file that failed its header or checksum check: it is
          quarantined). The destination memory of a missed block is undefined. The future
          raises `OffloadTimeoutError` when `after` did not finish in time, and the I/O error
          of a failed read.

        Raises:
          ValueError: a destination that does not hold one block payload, or an array that
            is not writeable and C-contiguous.
          RuntimeError: the tier is closed.

        Example:
          >>> import tempfile
          >>> tier = FileTier(tempfile.mkdtemp(), spec=KVCacheSpec(1, 1, 4, 2, "float32"),
          ...                 model_id="m", capacity_bytes=1 << 20, backend="files")
          >>> block = np.arange(16, dtype=np.float32); out = np.zeros_like(block)
          >>> tier.put(b"h0", block)
          True
          >>> tier.read_async([(b"h0", out), (b"h1", np.zeros_like(block))]).result(10)
          [True, False]
          >>> bool((out == block).all()), tier.read_async([(b"h0", out)], inline=True).done()
          (True, True)
          >>> tier.close()
        """
        payload = self.payload_nbytes
        checked: list[tuple[bytes, list[Region], list[list[Region]]]] = []
        arrays: list[np.ndarray] = []
        # Plain loops, no generators: this runs per read, often on the thread that needs
        # the blocks at once (`OffloadManager.read_file_now`).
        for index, (block_hash, destination) in enumerate(items):
            if isinstance(destination, np.ndarray):
                if not destination.flags.c_contiguous or not destination.flags.writeable:
                    raise ValueError("a numpy destination must be a writeable C-contiguous "
                                     "array")
                arrays.append(destination)
                regions = [(int(destination.ctypes.data), int(destination.nbytes))]
            else:
                regions = [(int(a), int(n)) for a, n in destination]
            total = 0
            for region in regions:
                total += region[1]
            if total != payload:
                raise ValueError(f"regions of block {bytes(block_hash).hex()[:12]} hold "
                                 f"{total} bytes, a block has {payload}")
            extra = [] if replicas is None else [
                [(int(a), int(n)) for a, n in copy] for copy in replicas[index]]
            checked.append((bytes(block_hash), regions, extra))
        if self._closed:
            raise RuntimeError("the file tier is closed")
        deadline = time.monotonic() + self.timeout_s
        result = future if future is not None else TierFuture()
        keep = (keepalive, arrays) if arrays else keepalive
        if inline:
            # `_run` waits for `after` (bounded by the deadline) and delivers any error
            # through the future, as a worker would.
            self._run(result, self._read_batch, checked, list(after), deadline, keep)
        else:
            self._submit(result, self._read_batch, checked, list(after), deadline, keep)
        return result

    # ------------------------------------------------------------------ deprecated reads

    def queue_checked_read(self, items: list[tuple[bytes, list[Region], list[list[Region]]]],
                           after: list[Dependency], future: concurrent.futures.Future,
                           keepalive: Any = None) -> None:
        """Deprecated: use ``read_async([(h, regions) ...], replicas=[copies ...],
        after=after, future=future)``.

        Queues a read of ``(hash, regions, replicas)`` items into `future` (now checked like
        every read).

        Raises:
          ValueError: a destination that does not hold one block payload (`read_async`).
          RuntimeError: the tier is closed.

        Example:
          >>> tier.queue_checked_read([(h, regions, [])], [], future)   # doctest: +SKIP
        """
        _deprecated("queue_checked_read", "read_async(items, replicas=..., after=..., "
                    "future=...)")
        self.read_async([(h, regions) for h, regions, _ in items],
                        replicas=[copies for _, _, copies in items], after=after,
                        keepalive=keepalive, future=future)

    def read_checked_now(self, items: list[tuple[bytes, list[Region], list[list[Region]]]],
                         after: Sequence[Dependency]) -> list[bool]:
        """Deprecated: use ``read_async(..., after=after, inline=True).result(0)``.

        Reads ``(hash, regions, replicas)`` items on the calling thread.

        Returns:
          One bool per block, as `read_async`'s future.

        Raises:
          RuntimeError: the tier is closed. OffloadTimeoutError: `after` did not finish in
          time. OSError: a failed read. ValueError: as `read_async`.

        Example:
          >>> tier.read_checked_now([(h, regions, [])], [])   # doctest: +SKIP
          [True]
        """
        _deprecated("read_checked_now", "read_async(items, replicas=..., after=..., "
                    "inline=True).result(0)")
        return self.read_async([(h, regions) for h, regions, _ in items],
                               replicas=[copies for _, _, copies in items], after=after,
                               inline=True).result(0)

    @staticmethod
    def _run(result: concurrent.futures.Future, fn, items, after, deadline, keepalive) -> None:
        del keepalive  # Referenced until here.
        if not result.set_running_or_notify_cancel():
            return
        try:
            wait_for(after, deadline, "file tier I/O")
            result.set_result(fn(items, deadline))
        except BaseException as error:  # noqa: BLE001 - delivered through the future.
            result.set_exception(error)

    # ------------------------------------------------------------------ convenience

    def put(self, block_hash: bytes, block: np.ndarray, timeout: float | None = None) -> bool:
        """Writes one block from a C-contiguous numpy array and waits (see `write_async`).

        Raises:
          ValueError: the array does not hold exactly one block payload.
          OffloadTimeoutError: the write did not finish in time.
        """
        block = np.ascontiguousarray(block)
        future = self.write_async([(block_hash, [(block.ctypes.data, block.nbytes)])],
                                  keepalive=block)
        return self._wait(future, timeout)[0]

    def get(self, block_hash: bytes, out: np.ndarray, timeout: float | None = None) -> bool:
        """Deprecated: use ``read_async([(block_hash, out)]).result(timeout)[0]``.

        Reads one block into a writeable C-contiguous numpy array and waits.

        Returns:
          True when loaded and verified, False for a miss.

        Raises:
          ValueError: as `read_async`. OffloadTimeoutError: the read did not finish in time.

        Example:
          >>> tier.get(b"h0", out)   # doctest: +SKIP
          True
        """
        _deprecated("get", "read_async([(block_hash, out)]).result(timeout)[0]")
        return self._wait(self.read_async([(block_hash, out)]), timeout)[0]

    def _wait(self, future: concurrent.futures.Future, timeout: float | None) -> Any:
        try:
            return future.result(timeout=self.timeout_s if timeout is None else timeout)
        except concurrent.futures.TimeoutError:
            raise OffloadTimeoutError("file tier operation timed out") from None

    def close(self, timeout: float | None = None) -> None:
        """Waits for pending I/O (bounded), writes the manifest and stops the workers."""
        if self._closed:
            return
        self._closed = True
        self._executor.shutdown(wait=False)
        deadline = time.monotonic() + (self.timeout_s if timeout is None else timeout)
        for thread in list(getattr(self._executor, "_threads", ())):
            thread.join(max(0.0, deadline - time.monotonic()))
        self._helpers.shutdown(wait=False)
        with self._lock:
            while self._fds:
                self._close_fd(self._fds.popitem()[1])
        self.flush()
        if isinstance(self._io, _NixlIO):
            self._io.unregister_all()

    # ------------------------------------------------------------------ open files

    def _give_fd(self, block_hash: bytes, fd: int) -> None:
        """Returns an owned fd to the cache (lock held); closes it when the block is gone or
        already has one, and closes the least recently used fds beyond the limit."""
        if block_hash not in self._entries or block_hash in self._fds:
            self._close_fd(fd)
            return
        self._fds[block_hash] = fd
        while len(self._fds) > self._max_open_files:
            _, old = self._fds.popitem(last=False)
            self._close_fd(old)

    def _close_fd(self, fd: int) -> None:
        self._io.forget(fd)
        os.close(fd)

    def _sync_all(self, fds: Sequence[int]) -> None:
        """fdatasync of each fd, overlapped on helper threads (the flushes can merge).

        fdatasync (not fsync) is enough before the rename: it persists the data and the
        metadata needed to read it back (size, block map), only not the timestamps.
        """
        if len(fds) <= 1:
            for fd in fds:
                os.fdatasync(fd)
            return
        for future in [self._helpers.submit(os.fdatasync, fd) for fd in fds]:
            future.result()

    # ------------------------------------------------------------------ workers

    def _header_bytes(self, block_hash: bytes, checksum: str) -> bytes:
        """The meaningful start of a block file's header: magic, length, msgpack `_Header`.

        Reads compare the bytes they read with this (the header a write of the same block
        and payload writes); only a mismatch decodes the header (`_verify`).
        """
        encoded = _encode(_Header(FORMAT_VERSION, self.compat_key, block_hash.hex(),
                                  self.payload_nbytes, checksum))
        return _MAGIC + len(encoded).to_bytes(4, "little") + encoded

    def _header(self, block_hash: bytes, regions: Sequence[Region]) -> bytearray:
        head = bytearray(_HEADER_BYTES)  # Zero padded: the payload starts page aligned.
        start = self._header_bytes(block_hash, _checksum(regions))
        head[:len(start)] = start
        return head

    def _write_batch(self, work, deadline: float) -> list[bool]:
        items, skip = work
        skipped = [False] * len(items) if skip is None else list(skip())
        results: list[bool] = []
        claimed: list[tuple[int, bytes, Sequence[Region]]] = []  # (result index, hash, regions)
        victims: list[tuple[str, int | None]] = []  # Evicted files renamed into tmp/: reused.
        with self._lock:
            for (block_hash, regions), skipped_one in zip(items, skipped):
                if skipped_one:
                    results.append(False)
                    continue
                if block_hash in self._entries or block_hash in self._writing:
                    if block_hash in self._entries:
                        self._entries.move_to_end(block_hash)
                    self.stats.skipped_writes += 1
                    results.append(True)
                    continue
                if not self._evict_to_fit(self.file_nbytes + self._pending_bytes(), victims):
                    self.stats.rejected_writes += 1
                    results.append(False)
                    continue
                self._writing.add(block_hash)
                claimed.append((len(results), block_hash, regions))
                results.append(True)
        if not claimed:
            self._discard_victims(victims)
            return results
        begin = time.perf_counter()
        jobs: list[_Job] = []
        tmps: list[str] = []
        published: list[tuple[bytes, int]] = []
        try:
            if self.durable and victims:
                # The evicted names are gone from blocks/ for good before their files are
                # overwritten: a crash never shows a half-overwritten file under an old name.
                _fsync_dir(self._blocks)
            for _, block_hash, regions in claimed:
                head = self._header(block_hash, regions)
                if victims:
                    tmp, fd = victims.pop()
                    tmps.append(tmp)
                    if fd is None:
                        fd = os.open(tmp, os.O_RDWR)
                    jobs.append(_Job(fd, head, regions))
                    if os.fstat(fd).st_size != self.file_nbytes:
                        os.ftruncate(fd, self.file_nbytes)
                else:
                    tmp = os.path.join(self._tmp,
                                       f"{block_hash.hex()}.{uuid.uuid4().hex[:12]}.tmp")
                    tmps.append(tmp)
                    jobs.append(_Job(os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644),
                                     head, regions))
            self._io.write_many(jobs, deadline)
            if self.durable:
                self._sync_all([job.fd for job in jobs])
            for (_, block_hash, _), tmp, job in zip(claimed, tmps, jobs):
                _publish(tmp, self.path_of(block_hash))
                published.append((block_hash, job.fd))
            if self.durable:  # The renames of the batch (the files were synced before).
                _fsync_dir(self._blocks)
        finally:
            done = {block_hash for block_hash, _ in published}
            with self._lock:
                for block_hash, fd in published:
                    self._entries[block_hash] = self.file_nbytes
                    self._bytes_used += self.file_nbytes
                    self.stats.writes += 1
                    self.stats.write_bytes += self.payload_nbytes
                    self._give_fd(block_hash, fd)
                for (_, block_hash, _), job in zip(claimed, jobs):
                    if block_hash not in done:
                        self._close_fd(job.fd)
                for _, block_hash, _ in claimed:
                    self._writing.discard(block_hash)
                self.stats.write_s += time.perf_counter() - begin
            for (_, block_hash, _), tmp in zip(claimed, tmps):
                if block_hash not in done:
                    _unlink_quietly(tmp)
            self._discard_victims(victims)
            if published:
                self.flush()
        return results

    def _discard_victims(self, victims: list[tuple[str, int | None]]) -> None:
        """Deletes evicted files that no write reused."""
        while victims:
            tmp, fd = victims.pop()
            if fd is not None:
                with self._lock:
                    self._close_fd(fd)
            _unlink_quietly(tmp)

    def _pending_bytes(self) -> int:
        return self.file_nbytes * len(self._writing)

    def _read_batch(self, items, deadline: float) -> list[bool]:
        results = [False] * len(items)
        stats, entries, readers, fds = self.stats, self._entries, self._readers, self._fds
        # (index, hash, regions, replicas, cached fd or None): the fds are taken (owned) at once.
        reading: list[tuple[int, bytes, Sequence[Region], Any, int | None]] = []
        with self._lock:
            stats.reads += len(items)
            for index, (block_hash, regions, replicas) in enumerate(items):
                if block_hash in entries:
                    readers[block_hash] = readers.get(block_hash, 0) + 1
                    reading.append((index, block_hash, regions, replicas,
                                    fds.pop(block_hash, None)))
            stats.misses += len(items) - len(reading)
        if not reading:
            return results
        begin = time.perf_counter()
        jobs: list[_Job | None] = [None] * len(reading)  # None: not opened (the file is gone).
        states: list[str | None] = [None] * len(reading)  # "ok", "corrupt" or "missing".
        # Plain files are read and verified one block at a time: the blocks share one header
        # buffer (NIXL reads the whole batch first: one each).
        shared_head = bytearray(_HEADER_BYTES) if isinstance(self._io, _FilesIO) else None
        try:
            for k, (_, block_hash, regions, _, fd) in enumerate(reading):
                if fd is None:
                    try:
                        fd = os.open(self.path_of(block_hash), os.O_RDWR)
                    except FileNotFoundError:
                        states[k] = "missing"
                        continue
                jobs[k] = _Job(fd, shared_head if shared_head is not None
                               else bytearray(_HEADER_BYTES), regions)
            live = [(reading[k][1], job) for k, job in enumerate(jobs) if job is not None]
            errors = iter(self._load(live, deadline))
            for k, ((_, _, regions, replicas, _), job) in enumerate(zip(reading, jobs)):
                if job is None:
                    continue
                error = next(errors)
                if error is not None:
                    _log.warning("jaxkv file tier: %s; quarantined, treated as a miss", error)
                    states[k] = "corrupt"
                    continue
                states[k] = "ok"
                for copy in replicas:
                    for (src, nbytes), (dst, _) in zip(regions, copy):
                        ctypes.memmove(dst, src, nbytes)
        finally:
            with self._lock:
                for (index, block_hash, _, _, fd), job, state in zip(reading, jobs, states):
                    left = readers[block_hash] - 1
                    if left:
                        readers[block_hash] = left
                    else:
                        readers.pop(block_hash)
                    if state == "ok":
                        stats.hits += 1
                        results[index] = True
                        if block_hash in entries:
                            entries.move_to_end(block_hash)
                    else:
                        stats.misses += 1
                        if state == "corrupt":
                            stats.corrupt += 1
                            self._quarantine_locked(block_hash)
                        elif state == "missing" and block_hash in entries:
                            self._bytes_used -= entries.pop(block_hash)
                    if job is not None:
                        fd = job.fd
                    if fd is not None:
                        self._give_fd(block_hash, fd)
                stats.read_s += time.perf_counter() - begin
        return results

    def _load(self, blocks: Sequence[tuple[bytes, _Job]], deadline: float
              ) -> list[BlockCorruptError | None]:
        """Reads and verifies blocks; returns the check failure of each (None: verified).

        Plain files: each block is checksummed right after its read, while it is in cache.
        NIXL: one transfer for the batch, then the checks. (Splitting a batch over two
        threads was measured: no faster on the 2-core benchmark VM, so it is not done.)

        Every block's payload checksum is computed; a header that is byte for byte the one a
        write of this block with this checksum writes (`_header_bytes`) passes at once, any
        other header is decoded and checked field by field (`_verify`: it may still pass, or
        names what is wrong).
        """
        io = self._io
        got_all = io.read_many([job for _, job in blocks], deadline) if isinstance(
            io, _NixlIO) else None
        file_nbytes, header_bytes = self.file_nbytes, self._header_bytes
        out: list[BlockCorruptError | None] = []
        for k, (block_hash, job) in enumerate(blocks):
            views = job.views = [_view(address, nbytes) for address, nbytes in job.regions]
            got = got_all[k] if got_all is not None else io.read_many([job], deadline)[0]
            checksum = _views_checksum(views)
            if got == file_nbytes and job.head.startswith(header_bytes(block_hash, checksum)):
                out.append(None)
                continue
            try:
                self._verify(block_hash, job, got, checksum)
                out.append(None)
            except BlockCorruptError as error:
                out.append(error)
        return out

    def _quarantine_locked(self, block_hash: bytes) -> None:
        if block_hash in self._entries:
            self._bytes_used -= self._entries.pop(block_hash)
        fd = self._fds.pop(block_hash, None)
        if fd is not None:
            self._close_fd(fd)
        with contextlib.suppress(FileNotFoundError):
            os.replace(self.path_of(block_hash), os.path.join(
                self._quarantine, f"{block_hash.hex()}.{uuid.uuid4().hex[:8]}{_SUFFIX}"))

    def _verify(self, block_hash: bytes, job: _Job, got: int, checksum: str | None = None
                ) -> None:
        """Checks a read block's header and checksum (`checksum`: the payload's, if already
        computed); raises BlockCorruptError."""
        path = self.path_of(block_hash)
        head = memoryview(job.head)[:min(got, _HEADER_BYTES)]
        if len(head) < 12 or head[:8] != _MAGIC:
            raise BlockCorruptError(f"{path}: not a jaxkv block file (bad magic)")
        length = int.from_bytes(head[8:12], "little")
        try:
            header = msgspec.msgpack.decode(head[12 : 12 + length], type=_Header)
        except (msgspec.DecodeError, msgspec.ValidationError) as error:
            raise BlockCorruptError(f"{path}: unreadable header ({error})") from None
        if header.compat_key != self.compat_key:
            raise BlockCorruptError(f"{path}: written for another model or spec "
                                    f"(compat key {header.compat_key[:12]}...)")
        if header.block_hash != block_hash.hex() or header.payload_nbytes != self.payload_nbytes:
            raise BlockCorruptError(f"{path}: header names another block or size")
        if got != self.file_nbytes:
            raise BlockCorruptError(f"{path}: truncated ({max(0, got - _HEADER_BYTES)} of "
                                    f"{self.payload_nbytes} payload bytes)")
        if checksum is None:
            checksum = _checksum(job.regions)
        if checksum != header.checksum:
            raise BlockCorruptError(f"{path}: checksum mismatch")


def _unlink_quietly(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _deprecated(name: str, instead: str) -> None:
    """Warns that ``FileTier.<name>`` is deprecated (it stays one release: docs/offload.md,
    "Deprecated names")."""
    warnings.warn(f"FileTier.{name} is deprecated and will be removed in the next release; "
                  f"use FileTier.{instead}", DeprecationWarning, stacklevel=3)
