"""The built-in engine's prefix cache: the KV caches of finished requests, kept so that the next
call of a conversation (its prompt extends the last one's prompt + output) prefills only what
is new. What session affinity buys: a call routed to the engine that served its previous call
finds its prefix here.

In: a finished request's tokens and cache (``put``); a new prompt (``take``). Out: the cache with
the longest common prefix, cut to it, handed to one request (a cache has one owner: the request
extends it in place). Bounded: least recently stored first out past ``max_bytes``; cleared when
the weights change (a cache is only valid for the weights that computed it).
"""

from __future__ import annotations

from collections import OrderedDict

from tidal.models import KVCache
from tidal.serving.protocol import common_prefix_len

MIN_SHARED_TOKENS = 4  # a shorter common prefix (a shared system turn's first tokens) is noise


class PrefixCache:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[int, tuple[list[int], KVCache]] = OrderedDict()
        self._next = 0
        self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def nbytes(self) -> int:
        return sum(c.nbytes() for _, c in self._entries.values())

    def put(self, tokens: list[int], cache: KVCache) -> None:
        """Keep ``cache``, whose first ``cache.length`` positions hold ``tokens``' KV."""
        if self.max_bytes <= 0 or cache.length < MIN_SHARED_TOKENS:
            return
        self._entries[self._next] = (tokens[: cache.length], cache)
        self._next += 1
        while self._entries and self.nbytes() > self.max_bytes:
            self._entries.popitem(last=False)

    def take(self, prompt: list[int]) -> tuple[KVCache | None, int]:
        """The cache sharing the longest prefix with ``prompt`` (removed from the store, cut
        to the shared tokens) and how many tokens it covers; ``(None, 0)`` if none shares
        ``MIN_SHARED_TOKENS``."""
        best, best_n = None, 0
        for key, (tokens, _) in self._entries.items():
            n = common_prefix_len(tokens, prompt)
            if n > best_n:
                best, best_n = key, n
        if best is None or best_n < MIN_SHARED_TOKENS:
            self.misses += 1
            return None, 0
        _, cache = self._entries.pop(best)
        cache.length = min(cache.length, best_n)
        self.hits += 1
        return cache, cache.length

    def clear(self) -> None:
        self._entries.clear()
