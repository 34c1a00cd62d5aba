"""Prefix-cache hit rate over the most recent requests (vLLM's ``PrefixCachingMetrics``)."""

from __future__ import annotations

import collections
import dataclasses

__all__ = ["PrefixCacheStats", "PrefixCachingMetrics"]


@dataclasses.dataclass
class PrefixCacheStats:
    """Prefix-cache lookups of a set of requests.

    Attributes:
      requests: number of requests looked up.
      queries: tokens looked up (the requests' lengths).
      hits: tokens found in the cache.
      reset: the prefix cache was reset before these lookups.

    Example:
      >>> PrefixCacheStats(requests=1, queries=64, hits=48).hits
      48
    """

    requests: int = 0
    queries: int = 0
    hits: int = 0
    reset: bool = False


class PrefixCachingMetrics:
    """Hit rate (hit tokens / queried tokens) over the most recent ``max_recent_requests``.

    Observations are kept in arrival order; when the requests they hold exceed the window, the
    oldest observations are dropped (the newest one is always kept, even when it alone holds
    more requests than the window).

    Args:
      max_recent_requests: size of the window, in requests.

    Raises:
      ValueError: ``max_recent_requests < 1``.

    Example:
      >>> metrics = PrefixCachingMetrics(max_recent_requests=2)
      >>> for hits in (0, 50, 100):
      ...     metrics.observe(PrefixCacheStats(requests=1, queries=100, hits=hits))
      >>> metrics.hit_rate, metrics.requests
      (0.75, 2)
    """

    def __init__(self, max_recent_requests: int = 1000) -> None:
        if max_recent_requests < 1:
            raise ValueError(f"max_recent_requests must be >= 1, got {max_recent_requests}")
        self.max_recent_requests = int(max_recent_requests)
        self._requests = 0
        self._queries = 0
        self._hits = 0
        self._window: collections.deque[tuple[int, int, int]] = collections.deque()

    def observe(self, stats: PrefixCacheStats) -> None:
        """Adds one observation (and first resets when ``stats.reset``).

        Args:
          stats: lookups to add.

        Raises:
          ValueError: negative counts, or more hits than queries.

        Example:
          >>> metrics = PrefixCachingMetrics()
          >>> metrics.observe(PrefixCacheStats(requests=2, queries=10, hits=4)); metrics.hit_rate
          0.4
        """
        if min(stats.requests, stats.queries, stats.hits) < 0 or stats.hits > stats.queries:
            raise ValueError(f"invalid prefix-cache stats {stats}")
        if stats.reset:
            self.reset()
        self._window.append((stats.requests, stats.queries, stats.hits))
        self._requests += stats.requests
        self._queries += stats.queries
        self._hits += stats.hits
        while self._requests > self.max_recent_requests and len(self._window) > 1:
            requests, queries, hits = self._window.popleft()
            self._requests -= requests
            self._queries -= queries
            self._hits -= hits

    def reset(self) -> None:
        """Forgets every observation.

        Example:
          >>> metrics = PrefixCachingMetrics()
          >>> metrics.observe(PrefixCacheStats(1, 10, 5)); metrics.reset(); metrics.hit_rate
          0.0
        """
        self._requests = self._queries = self._hits = 0
        self._window.clear()

    @property
    def requests(self) -> int:
        """Requests in the window."""
        return self._requests

    @property
    def queries(self) -> int:
        """Tokens looked up in the window."""
        return self._queries

    @property
    def hits(self) -> int:
        """Tokens hit in the window."""
        return self._hits

    @property
    def hit_rate(self) -> float:
        """``hits / queries`` over the window (0.0 when nothing was queried)."""
        return self._hits / self._queries if self._queries else 0.0
