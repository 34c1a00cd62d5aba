"""A thin wrapper over one NIXL agent: optional import, options, deduplicated registration.

NIXL is optional: nothing here imports it until an agent is created (`load_nixl`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import logging
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxkv.transfer._plan import ReadPlan, ReadPlanner

__all__ = ["AgentOptions", "NixlAgent", "load_nixl", "nixl_available"]

_log = logging.getLogger(__name__)

_NIXL_MODULES = ("nixl_cu13._api", "nixl_cu12._api", "nixl._api")


def load_nixl() -> Any:
    """The NIXL Python API module (``nixl_agent``, ``nixl_agent_config``).

    Raises:
      ImportError: NIXL is not installed, with how to install it.
    """
    errors = []
    for name in _NIXL_MODULES:
        try:
            return importlib.import_module(name)
        except ImportError as error:
            errors.append(f"{name}: {error}")
    raise ImportError(
        "jaxkv.transfer needs NIXL to create an agent; install it with "
        "`pip install jaxkv[nixl]` or `pip install --no-deps nixl-cu13` (its torch dependency "
        "is not needed). Tried: " + "; ".join(errors)
    )


def nixl_available() -> bool:
    """Whether a NIXL Python API can be imported."""
    try:
        load_nixl()
    except ImportError:
        return False
    return True


@dataclasses.dataclass(frozen=True)
class AgentOptions:
    """How the NIXL agent is created.

    Attributes:
      backends: NIXL backends to instantiate ("UCX" moves DRAM and VRAM between processes).
      progress_thread: NIXL's progress thread; off by default: on small machines polling from
        `poll()` is faster (platform notes: the thread made medians 2-3x worse on 2 cores).
      num_threads: backend worker threads (0: the backend's default).
    """

    backends: tuple[str, ...] = ("UCX",)
    progress_thread: bool = False
    num_threads: int = 0


_MAX_PREPPED = 64  # (planner, remote rank, agent) list pairs held; the oldest are released


@dataclasses.dataclass(frozen=True)
class _Prepped:
    local: Any  # NIXL prepped descriptor list handles
    remote: Any


class NixlAgent:
    """One NIXL agent with registration bookkeeping.

    Registrations are deduplicated by ``(address, length, device, memory kind)``: two regions
    sharing a base address but not a length are two registrations (vLLM 57661).
    """

    def __init__(self, name: str, options: AgentOptions | None = None):
        options = options or AgentOptions()
        api = load_nixl()
        config = api.nixl_agent_config(
            enable_prog_thread=options.progress_thread,
            enable_listen_thread=False,
            num_threads=options.num_threads,
            backends=list(options.backends),
        )
        self.name = name
        self.options = options
        self._agent = api.nixl_agent(name, config)
        missing = [b for b in options.backends if b not in self._agent.backends]
        if missing:
            raise RuntimeError(
                f"NIXL could not create backends {missing} "
                f"(available plugins: {self._agent.plugin_list})"
            )
        self._registered: dict[tuple[int, int, int, str], tuple[Any, int]] = {}
        self._remote: set[str] = set()
        self._inbox: dict[str, list[bytes]] = {}
        self._lock = threading.RLock()
        # Prepared descriptor lists per (planner, remote rank, remote agent): a planner is
        # made for one pair of metadata objects (one generation of each side), so a list is
        # never used with addresses of another generation. None: the planner has no tables.
        self._prepped: dict[tuple[int, int, str], tuple[ReadPlanner, _Prepped | None]] = {}
        self.prepped_reads = 0  # READs posted from prepared lists (the rest: per request)

    # -- registration ---------------------------------------------------------------------

    def register(self, regions: Sequence[tuple[int, int, int, str]]) -> int:
        """Registers ``(address, length, device, kind)`` regions not registered yet (a repeat
        only takes a reference). Returns the number of new registrations."""
        new = 0
        with self._lock:
            for key in regions:
                key = (int(key[0]), int(key[1]), int(key[2]), str(key[3]))
                if key in self._registered:
                    descs, refs = self._registered[key]
                    self._registered[key] = (descs, refs + 1)
                    continue
                descs = self._agent.register_memory(np.array([key[:3]], dtype=np.uint64), key[3])
                self._registered[key] = (descs, 1)
                new += 1
        return new

    def deregister(self, regions: Sequence[tuple[int, int, int, str]]) -> None:
        with self._lock:
            # Prepared lists point into the registrations: released before any goes away.
            self.release_prepped()
            for key in regions:
                key = (int(key[0]), int(key[1]), int(key[2]), str(key[3]))
                if key not in self._registered:
                    continue
                descs, refs = self._registered[key]
                if refs > 1:
                    self._registered[key] = (descs, refs - 1)
                else:
                    self._agent.deregister_memory(descs)
                    del self._registered[key]

    @property
    def num_registrations(self) -> int:
        return len(self._registered)

    def metadata(self) -> bytes:
        """The agent's serialized metadata (connection info and registrations)."""
        return self._agent.get_agent_metadata()

    # -- peers ----------------------------------------------------------------------------

    def add_remote(self, metadata: bytes) -> str:
        with self._lock:
            name = self._agent.add_remote_agent(metadata)
            name = name.decode() if isinstance(name, bytes) else name
            self._remote.add(name)
            return name

    def connect(self, name: str) -> None:
        """Establishes the connection to a loaded peer now (warm-up; messages sent on an
        endpoint that is still being wired up may be dropped)."""
        self._agent.make_connection(name)

    def remove_remote(self, name: str) -> None:
        with self._lock:
            self.release_prepped(name)
            if name in self._remote:
                self._remote.discard(name)
                with contextlib.suppress(Exception):  # best effort on a dead peer
                    self._agent.remove_remote_agent(name)

    @property
    def remote_agents(self) -> frozenset[str]:
        return frozenset(self._remote)

    # -- transfers ------------------------------------------------------------------------

    def read(
        self,
        local: np.ndarray,
        remote: np.ndarray,
        remote_name: str,
        kind: str = "DRAM",
        remote_kind: str | None = None,
        notif: bytes = b"",
    ) -> Any:
        """Posts a READ of ``Nx3`` ``(address, length, device)`` descriptors; returns the
        handle (state via `state`, freed with `release`)."""
        local_descs = self._agent.get_xfer_descs(np.ascontiguousarray(local, np.uint64), kind)
        remote_descs = self._agent.get_xfer_descs(
            np.ascontiguousarray(remote, np.uint64), remote_kind or kind
        )
        try:
            handle = self._agent.initialize_xfer(
                "READ", local_descs, remote_descs, remote_name, notif
            )
        except Exception as error:  # noqa: BLE001 - NIXL's errors (a dead peer) are untyped
            raise ConnectionError(
                f"NIXL could not post a READ from {remote_name!r}: {type(error).__name__}: "
                f"{error}"
            ) from error
        return self._post(handle, remote_name)

    def read_plan(
        self,
        plan: ReadPlan,
        local_meta: Any,
        remote_meta: Any,
        remote_rank: int,
        remote_name: str,
        kind: str = "DRAM",
        remote_kind: str | None = None,
        notif: bytes = b"",
    ) -> Any:
        """Posts the READs of `plan` from `remote_rank` (agent `remote_name`); returns the
        handle as `read` does.

        The first read of a (planner, remote rank) prepares NIXL descriptor lists of every
        block of both caches (`ReadPlanner.block_table`); this and later reads then only pick
        their rows by index (`make_prepped_xfer`) instead of building, validating and
        preparing two descriptor lists per request. Plans without tables (block-size ratios,
        caches too large to prepare, large requests whose runs merge, layer-wise sub-plans)
        are posted from their own descriptors. Lists are released with the remote agent
        (`remove_remote`), before any deregistration, and at `close`.

        Raises:
          ConnectionError: NIXL refused the READ.
        """
        planner = plan.planner
        # Layer-wise sub-plans (one planner per layer) keep per-request descriptors: lists
        # per layer would multiply the prepared rows by the layers.
        if planner is not None and planner.layers is None:
            pair = self._prepared(planner, remote_rank, remote_name, kind, remote_kind or kind)
            indices = None if pair is None else planner.prepped_indices(plan, remote_rank)
            if pair is not None and indices is not None:
                try:
                    handle = self._agent.make_prepped_xfer(
                        "READ", pair.local, indices[0], pair.remote, indices[1], notif
                    )
                except Exception as error:  # noqa: BLE001 - NIXL's own error types
                    raise ConnectionError(
                        f"NIXL refused a READ from {remote_name!r}: {error!r}"
                    ) from error
                self.prepped_reads += 1
                return self._post(handle, remote_name)
        loc, rem = plan.expanded_descriptors(local_meta, remote_meta, remote_rank)
        return self.read(loc, rem, remote_name, kind, remote_kind, notif)

    def _prepared(
        self, planner: ReadPlanner, remote_rank: int, remote_name: str, kind: str,
        remote_kind: str,
    ) -> _Prepped | None:
        key = (id(planner), remote_rank, remote_name)
        with self._lock:
            held = self._prepped.get(key)
            if held is not None:  # the entry keeps the planner alive: its id is not reused
                return held[1]
            tables = planner.block_table(remote_rank)
            pair = None
            if tables is not None:
                local = remote = None
                try:
                    local = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", tables[0], kind)
                    remote = self._agent.prep_xfer_dlist(remote_name, tables[1], remote_kind)
                    pair = _Prepped(local, remote)
                except Exception as error:  # noqa: BLE001 - reads fall back to descriptors
                    _log.warning("preparing descriptor lists for %s failed: %r", remote_name,
                                 error)
                    if local is not None:
                        with contextlib.suppress(Exception):
                            self._agent.release_dlist_handle(local)
            while len(self._prepped) >= _MAX_PREPPED:
                self._release(self._prepped.pop(next(iter(self._prepped)))[1])
            self._prepped[key] = (planner, pair)
            return pair

    def release_prepped(self, remote_name: str | None = None) -> None:
        """Releases the prepared descriptor lists (of one remote agent, or all)."""
        with self._lock:
            for key in [k for k in self._prepped if remote_name in (None, k[2])]:
                self._release(self._prepped.pop(key)[1])

    def _release(self, pair: _Prepped | None) -> None:
        if pair is None:
            return
        for handle in (pair.local, pair.remote):
            with contextlib.suppress(Exception):  # best effort on a dead peer
                self._agent.release_dlist_handle(handle)

    @property
    def num_prepped(self) -> int:
        """Prepared (local, remote) list pairs held."""
        return sum(pair is not None for _, pair in self._prepped.values())

    def _post(self, handle: Any, remote_name: str) -> Any:
        try:
            status = self._agent.transfer(handle)
        except Exception as error:  # noqa: BLE001 - NIXL's errors (a dead peer) are untyped
            self.release(handle)
            raise ConnectionError(
                f"NIXL could not post a READ from {remote_name!r}: {type(error).__name__}: "
                f"{error}"
            ) from error
        if status == "ERR":
            self.release(handle)
            raise ConnectionError(f"NIXL refused to post a READ from {remote_name!r}")
        return handle

    def state(self, handle: Any) -> str:
        """ "DONE", "PROC" or "ERR"."""
        try:
            return self._agent.check_xfer_state(handle)
        except Exception:  # noqa: BLE001 - NIXL raises on a failed endpoint
            return "ERR"

    def release(self, handle: Any) -> bool:
        try:
            self._agent.release_xfer_handle(handle)
            return True
        except Exception:  # noqa: BLE001 - still active and not cancellable
            return False

    def progress(self) -> None:
        """Progresses the backend (queued sends) without a progress thread; notifications
        that arrive meanwhile are kept for the next `notifications` call."""
        for name, messages in self._fetch().items():
            self._inbox.setdefault(name, []).extend(messages)

    def _fetch(self) -> dict[str, list[bytes]]:
        notifs = self._agent.get_new_notifs()
        return {(k.decode() if isinstance(k, bytes) else k): v for k, v in notifs.items()}

    def notifications(self) -> dict[str, list[bytes]]:
        """New notifications by sender agent name (each returned once)."""
        inbox, self._inbox = self._inbox, {}
        for name, messages in self._fetch().items():
            inbox.setdefault(name, []).extend(messages)
        return inbox

    def send(self, remote_name: str, message: bytes) -> bool:
        try:
            self._agent.send_notif(remote_name, message)
            return True
        except Exception:  # noqa: BLE001 - a dead peer
            return False

    def close(self) -> None:
        """Deregisters everything and forgets the peers."""
        with self._lock:
            self.release_prepped()
            for name in list(self._remote):
                self.remove_remote(name)
            for descs, _ in list(self._registered.values()):
                with contextlib.suppress(Exception):
                    self._agent.deregister_memory(descs)
            self._registered.clear()
