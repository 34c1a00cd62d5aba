"""Spawned child processes of the remote-process tests (not a test module): the child's
environment, spawning a process with a pipe, stopping it, a process answering commands.

Children are spawned (multiprocessing's "spawn" start method: no forked JAX or NIXL state);
they inherit the parent's sys.path, so the target may live in any `support` module.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pathlib
import signal
import socket
import time


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (a `jax.distributed` coordinator's)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pause(pid: int, timeout_s: float = 10.0) -> None:
    """SIGSTOPs process `pid` and returns once every one of its threads is stopped.

    The kernel stops a process's threads one by one as each is next scheduled: on a loaded
    machine its other threads (an engine's control channel, its progress thread) run on for
    100+ ms after `os.kill` returns, long enough to answer a read a test meant to go
    unanswered. Raises TimeoutError if some thread has not stopped after `timeout_s`."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout_s
    while True:
        states = []
        for stat in pathlib.Path(f"/proc/{pid}/task").glob("*/stat"):
            with contextlib.suppress(OSError):
                # "pid (comm) S ...": comm may hold spaces and parentheses, the state follows
                # the last ")".
                states.append(stat.read_text().rsplit(")", 1)[1].split()[0])
        if states and all(state in "Tt" for state in states):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"process {pid} did not stop: thread states {sorted(states)}")
        time.sleep(0.005)


def spawn(target, *args):
    """Starts `target(conn, *args)` in a spawned daemon process; returns (process, conn), `conn`
    this side's end of the pipe."""
    ctx = multiprocessing.get_context("spawn")
    conn, child = ctx.Pipe()
    process = ctx.Process(target=target, args=(child, *args), daemon=True)
    process.start()
    child.close()
    return process, conn


def stop(process, conn, *, join_s: float = 10.0, close: bool = True) -> None:
    """Asks a spawned process to exit (("exit",) over `conn`), terminates (then kills) it if it
    does not within `join_s`, reaps it; closes `conn` unless `close` is False."""
    if process.is_alive():
        with contextlib.suppress(OSError, BrokenPipeError):
            conn.send(("exit",))
        process.join(timeout=join_s)
    for end in (process.terminate, process.kill):
        if process.is_alive():
            end()
            process.join(timeout=5)
    if close:
        conn.close()


def child_env(num_devices: int) -> None:
    """Environment of a spawned child, before it imports JAX or NIXL."""
    import os

    flags = os.environ.get("XLA_FLAGS", "")
    flags = " ".join(f for f in flags.split() if "xla_force_host_platform_device_count" not in f)
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={num_devices}"
    os.environ.setdefault("UCX_TLS", "tcp,sm,self")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


class RemoteProcess:
    """A spawned process answering commands over a pipe (`serve_scheduler_side` and the like):
    `target(conn, *args)` sends a ("ready", ...) message first."""

    def __init__(self, target, args: tuple, *, start_timeout_s: float = 180.0,
                 call_timeout_s: float = 60.0):
        self.call_timeout_s = call_timeout_s
        self.process, self.conn = spawn(target, *args)
        assert self.conn.poll(start_timeout_s), "the remote process did not start"
        self.ready = self.conn.recv()
        assert self.ready[0] == "ready", self.ready

    def call(self, *command, timeout_s: float | None = None):
        """Sends `command` and returns the answer (fails after `timeout_s`, by default the
        constructor's `call_timeout_s`)."""
        self.conn.send(command)
        assert self.conn.poll(timeout_s or self.call_timeout_s), f"no answer to {command[0]}"
        return self.conn.recv()

    def wait_idle(self, timeout_s: float = 60.0):
        """Asks for ("state",) until it reports neither busy nor pinned blocks (its first two
        entries) or `timeout_s` passed; returns the last state."""
        deadline = time.monotonic() + timeout_s
        state = self.call("state")
        while (state[0] or state[1]) and time.monotonic() < deadline:
            time.sleep(0.2)
            state = self.call("state")
        return state

    def close(self, join_s: float = 20.0) -> None:
        """Asks the process to exit; kills it if it does not."""
        stop(self.process, self.conn, join_s=join_s, close=False)


def serve_scheduler_side(conn, side, make_request, state, *, interval: float = 0.001) -> None:
    """Serves a producer-side scheduler harness (`side`: ``add``, ``step``, ``sent_params``,
    ``close``) from `conn`, stepping it in between, until ("exit",):
    ("add", prompts) -> the consumer params of each, once all were handed over;
    ("pause", seconds) -> stops stepping that long (the engine's threads still answer), then
    True; ("state",) -> ``state()``. `make_request(prompt)` builds a producer request."""
    waiting: list = []
    try:
        while True:
            if conn.poll(0.0):
                command = conn.recv()
                if command[0] == "exit":
                    break
                if command[0] == "add":
                    waiting = []
                    for prompt in command[1]:
                        r = make_request(prompt)
                        side.add(r)
                        waiting.append(r.request_id)
                elif command[0] == "pause":
                    time.sleep(command[1])
                    conn.send(True)
                elif command[0] == "state":
                    conn.send(state())
            side.step()
            if waiting and all(r in side.sent_params for r in waiting):
                conn.send([side.sent_params[r] for r in waiting])
                waiting = []
            time.sleep(interval)
    finally:
        side.close()
