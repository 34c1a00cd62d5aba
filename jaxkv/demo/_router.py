"""The demo's router loop, one for every serving mode.

The router (the decode process) hands each prompt to the prefill side when it arrives, hands
the prefill side's transfer parameters to the decode side, lets the decode side work (read,
decode) and polls until every request is done, failed or timed out. What differs between
serving modes is only the decode side (`DecodeSide`): the demo's own loop over jaxkv's block
manager and transfer engine (`jaxkv.demo._engines`), or vLLM's scheduler with the jaxkv
connector (`jaxkv.demo._vllm_serve`).

Messages from the prefill side (over a pipe): ``("published", id, params, first_token,
hit_tokens, start, end)`` (monotonic clock) or ``("error", id, message)``; with layer-pipelined
transfer, ``("started", id, params, hit_tokens, start)`` before the prefill computes (the
decode side starts reading) and then ``("published", ...)`` with ``params`` None (the first
token, `DecodeSide.first_token`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

__all__ = ["DecodeSide", "Router", "send_arrived"]


def send_arrived(conn, process, unsent: list[str], arrival: dict[str, float],
                 prompts: list[list[int]], now: float) -> None:
    """Hands the prefill side every unsent request whose arrival time has come (in order).

    Args:
      conn: the router's end of the pipe to the prefill side.
      process: the prefill process (or group): nothing is sent once it is dead.
      unsent: request ids not sent yet, in arrival order (sent ones are removed).
      arrival: request id -> arrival time (`time.monotonic`).
      prompts: the prompts, ``req-<i>`` being ``prompts[i]``.
      now: the current time.

    Example:
      >>> class Pipe(list):
      ...     send = list.append
      >>> class Alive:
      ...     def is_alive(self): return True
      >>> pipe, unsent = Pipe(), ["req-0", "req-1"]
      >>> send_arrived(pipe, Alive(), unsent, {"req-0": 0.0, "req-1": 5.0}, [[1], [2]], 1.0)
      >>> pipe, unsent
      ([('request', 'req-0', [1])], ['req-1'])
    """
    while unsent and arrival[unsent[0]] <= now and process.is_alive():
        rid = unsent.pop(0)
        conn.send(("request", rid, prompts[int(rid.split("-")[1])]))


class DecodeSide(Protocol):
    """What a serving mode plugs into the `Router`: the decode engine's side of a request."""

    finished_reads: int
    """Requests whose KV read finished (for ``kill_prefill_after``)."""

    def admit(self, router: Router, request_id: str, params: Any,
              first_token: int | None) -> None:
        """Takes a request the prefill side published (its transfer `params`; its first
        token, or None when it arrives later by `first_token`); fails it through
        ``router.fail`` if it cannot."""

    def advance(self, router: Router) -> None:
        """One round of the decode side: progress reads, run a step, `Router.finish` the
        requests that are done; sleeps briefly when there is nothing to do."""

    def release(self, request_id: str) -> None:
        """Frees what a failed request holds (called once, when it fails)."""

    def first_token(self, router: Router, request_id: str, first_token: int) -> None:
        """A request admitted early (``admit`` with ``first_token`` None: its layers are
        read while the prefill computes) got its first token."""


class Router:
    """The router loop shared by the serving modes, and the request bookkeeping it owns.

    Args:
      settings: the run (`DemoSettings`): ``timeout_s``, ``request_interval_s``,
        ``kill_prefill_after``.
      conn: the pipe to the prefill side; process: the prefill process (or group).
      prompts: the prompts (``req-<i>`` is ``prompts[i]``).
      results: request id -> `RequestResult`, filled in place.
      reference: the colocated run's results (tokens and prompt KV to compare with).
      progress: called with the results after every change (or None).
      t_serve: when serving starts (`time.monotonic`); request ``i`` arrives at
        ``t_serve + i * request_interval_s``.

    Example:
      >>> router = Router(settings, conn, process, prompts, results, reference, None,
      ...                 time.monotonic())                         # doctest: +SKIP
      >>> router.run(decode_side)                                   # doctest: +SKIP
    """

    def __init__(self, settings, conn, process, prompts: list[list[int]],
                 results: dict[str, Any], reference: dict[str, dict[str, Any]],
                 progress: Callable[[list[Any]], None] | None, t_serve: float) -> None:
        self.settings, self.conn, self.process = settings, conn, process
        self.prompts, self.results, self.reference = prompts, results, reference
        self.progress = progress
        self.t_serve = t_serve
        self.arrival = {rid: t_serve + i * settings.request_interval_s
                        for i, rid in enumerate(results)}
        self._side: DecodeSide | None = None

    def prompt(self, request_id: str) -> list[int]:
        """The prompt of a request."""
        return self.prompts[int(request_id.split("-")[1])]

    def fail(self, request_id: str, error: str) -> None:
        """Marks a pending request failed (a request already done or failed is left as is)
        and lets the decode side free what it holds."""
        r = self.results[request_id]
        if r.status == "pending":
            r.status, r.error = "failed", error
            r.total_s = time.monotonic() - self.arrival[request_id]
            if self._side is not None:
                self._side.release(request_id)

    def report(self) -> None:
        """Hands the results to `progress` (after a change)."""
        if self.progress is not None:
            self.progress(list(self.results.values()))

    def finish(self, request_id: str, tokens: list[int],
               prompt_kv: Callable[[], np.ndarray]) -> Any:
        """Records a finished request's tokens and total time, and compares its tokens and
        prompt KV bytes with the colocated run's; the caller sets its status.

        Returns:
          The request's `RequestResult`.
        """
        r = self.results[request_id]
        r.tokens = tokens
        r.total_s = time.monotonic() - self.arrival[request_id]
        ref = self.reference.get(request_id)
        r.tokens_match = ref is not None and ref["tokens"] == r.tokens
        kv = prompt_kv()
        r.kv_match = ref is not None and np.array_equal(kv.view(np.uint8),
                                                        ref["kv"].view(np.uint8))
        return r

    def run(self, side: DecodeSide) -> None:
        """Routes every request until each is done or failed, or ``timeout_s`` passed after
        the last request's arrival (the rest then fail: a schedule of many requests far
        apart is not cut short): sends arrived prompts to the prefill side, hands what it
        published to `side`, kills the prefill side after ``kill_prefill_after`` finished
        reads (fault injection), fails what a dead prefill side never published, and advances
        `side`."""
        self._side = side
        settings, conn, process, results = self.settings, self.conn, self.process, self.results
        deadline = max(self.arrival.values(), default=self.t_serve) + settings.timeout_s
        unsent = list(results)
        published: set[str] = set()
        killed = False
        while any(r.status == "pending" for r in results.values()):
            now = time.monotonic()
            send_arrived(conn, process, unsent, self.arrival, self.prompts, now)
            if now > deadline:
                for rid in results:
                    self.fail(rid, f"timed out {settings.timeout_s:g}s after the last "
                                   "request arrived")
                break
            while conn.poll(0):
                try:
                    message = conn.recv()
                except (EOFError, OSError):
                    break
                rid = message[1]
                if message[0] == "error":
                    self.fail(rid, f"prefill: {message[2]}")
                    continue
                r = results[rid]
                if message[0] == "started":  # layer-wise: read while the prefill computes
                    _, rid, params, hit, start = message
                    published.add(rid)
                    r.prefill_hit_tokens, r.queue_s = hit, start - self.arrival[rid]
                    side.admit(self, rid, params, None)
                    continue
                _, rid, params, first, hit, start, end = message
                published.add(rid)
                r.prefill_hit_tokens, r.queue_s = hit, start - self.arrival[rid]
                r.prefill_s = end - start
                if params is None:
                    if r.status == "pending":
                        side.first_token(self, rid, first)
                else:
                    side.admit(self, rid, params, first)
            if (settings.kill_prefill_after and not killed
                    and side.finished_reads >= settings.kill_prefill_after):
                process.kill()
                process.join(timeout=10)
                killed = True
            if not process.is_alive():
                for rid in results:
                    if rid not in published:
                        self.fail(rid, f"prefill process exited (code {process.exitcode}) "
                                       "before publishing it")
                unsent.clear()
            side.advance(self)
