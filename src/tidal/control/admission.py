"""Admission control: how many sequences an engine decodes at once, and who goes next.

In: an engine's throughput curve (decode tokens/s against the number of sequences it decodes
at once, ``curve(n)``), its slot count, and the rule (``AdmissionRule``: ``off``,
``saturation`` or a per-token latency target in seconds). Out: the engine's concurrency
target (``concurrency_target``) and a fair queue of the requests waiting for it
(``FairQueue``). Pure: no clock is read (callers pass ``now``), no I/O; the simulator's engines
and the proxy's router use these same objects.

Rule (one engine):
- ``saturation``: the target is the smallest batch ``n`` (at most the slots) whose throughput
  reaches ``fraction`` (0.9) of the best throughput over every batch up to the slots. Past it
  more concurrency adds little throughput and only slows every sequence it holds, so a
  version's tail (its slowest member) waits longer.
- ``target_latency_s = L``: the target is the largest ``n`` whose decode step, ``n / curve(n)``
  seconds per token of each sequence, stays at or below ``L`` (at least one sequence always
  runs).
- ``off``: the target is the slot count (every bound request decodes at once).
A request that finds its engine at the target waits in the engine's queue; each time a
sequence leaves, the queue's head is admitted. Invariant kept: an engine never decodes more
than its target while a request waits, and never leaves a request waiting below its target.

Queue order (``FairQueue``): ``longest_waiting`` (default) admits first the request whose group
has waited longest (the time its first waiting member entered the queue; ties in arrival
order), so a group's members finish together and the trainer gets whole groups early;
``shortest_remaining`` admits first the request with the least work left (ties in arrival
order) where the caller knows it.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

from tidal.errors import ConfigError

ORDERS = ("longest_waiting", "shortest_remaining")
SATURATION_FRACTION = 0.9


@dataclass(frozen=True)
class AdmissionRule:
    """``mode`` is ``off``, ``saturation`` or ``latency`` (then ``target_latency_s`` is set)."""

    mode: str = "off"
    target_latency_s: float | None = None
    order: str = "longest_waiting"
    fraction: float = SATURATION_FRACTION

    @property
    def on(self) -> bool:
        return self.mode != "off"

    @classmethod
    def parse(
        cls,
        value: str | float | int | None,
        order: str = "longest_waiting",
        field: str = "control.admission",
    ) -> AdmissionRule:
        """``off`` / ``saturation`` / a positive number of seconds (the per-token latency
        target); anything else is a ``ConfigError`` naming ``field``."""
        if order not in ORDERS:
            raise ConfigError(
                f"{field}_order", f"must be one of {', '.join(ORDERS)}, got {order!r}"
            )
        if value is None or value == "off":
            return cls("off", None, order)
        if value == "saturation":
            return cls("saturation", None, order)
        num: float | None = None
        if isinstance(value, int | float) and not isinstance(value, bool):
            num = float(value)
        elif isinstance(value, str):
            try:
                num = float(value)
            except ValueError:
                num = None
        if num is None or not num > 0 or num == float("inf"):
            raise ConfigError(
                field,
                f"must be 'off', 'saturation' or a per-token latency "
                f"target in seconds > 0, got {value!r}",
            )
        return cls("latency", num, order)


def concurrency_target(curve: Callable[[int], float], slots: int, rule: AdmissionRule) -> int:
    """The engine's concurrency target under ``rule`` (1..slots); ``curve(n)`` is its decode
    throughput (tokens/s) with ``n`` sequences decoding at once."""
    slots = max(1, int(slots))
    if rule.mode == "off":
        return slots
    if rule.mode == "saturation":
        thr = [curve(n) for n in range(1, slots + 1)]
        best = max(thr)
        for n, t in enumerate(thr, start=1):
            if t >= rule.fraction * best:
                return n
        return slots
    assert rule.target_latency_s is not None
    ok = 1
    for n in range(1, slots + 1):
        t = curve(n)
        if t > 0 and n / t <= rule.target_latency_s:
            ok = n
    return ok


class FairQueue:
    """Requests waiting for an engine, in the rule's fair order (see the module docstring).

    ``push(item, group, now, remaining)``, ``pop()``, ``discard(item)``; bounded by the items
    it holds (a group's entry time is kept only while it has a member waiting)."""

    def __init__(self, order: str = "longest_waiting") -> None:
        if order not in ORDERS:
            raise ConfigError(
                "control.admission_order", f"must be one of {', '.join(ORDERS)}, got {order!r}"
            )
        self.order = order
        self._heap: list[tuple[float, int, Hashable]] = []
        self._items: dict[Hashable, tuple[Hashable, Any, int]] = {}  # (group, payload, entry)
        self._since: dict[Hashable, tuple[float, int]] = {}  # group -> (first wait, members)
        self._n = 0

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, item: Hashable) -> bool:
        return item in self._items

    def push(
        self,
        item: Hashable,
        group: Hashable,
        now: float,
        remaining: float | None = None,
        payload: object = None,
    ) -> None:
        if item in self._items:
            raise ValueError(f"{item!r} is already queued")
        since, members = self._since.get(group, (now, 0))
        self._since[group] = (since, members + 1)
        if self.order == "shortest_remaining":
            key = float("inf") if remaining is None else float(remaining)
        else:
            key = since
        self._n += 1
        heapq.heappush(self._heap, (key, self._n, item))
        self._items[item] = (group, payload, self._n)

    def peek(self) -> Hashable | None:
        heap = self._heap
        items = self._items
        # Lazy removal: an entry is live only if its item is queued under that same entry.
        while heap and (heap[0][2] not in items or items[heap[0][2]][2] != heap[0][1]):
            heapq.heappop(heap)
        return heap[0][2] if heap else None

    def pop(self) -> tuple[Hashable, object]:
        """The next request and its payload in the fair order; ``IndexError`` when empty."""
        item = self.peek()
        if item is None:
            raise IndexError("pop from an empty admission queue")
        heapq.heappop(self._heap)
        return item, self._forget(item)

    def discard(self, item: Hashable) -> object:
        """Takes a waiting request out (moved, aborted); its payload, or None if absent."""
        if item not in self._items:
            return None
        return self._forget(item)

    def payload(self, item: Hashable) -> object:
        return self._items[item][1]

    def _forget(self, item: Hashable) -> object:
        group, payload, _ = self._items.pop(item)
        since, members = self._since[group]
        if members <= 1:
            del self._since[group]
        else:
            self._since[group] = (since, members - 1)
        if not self._items:
            self._heap.clear()
        return payload


def curve_from_points(
    points: list[tuple[int, float]] | tuple[tuple[int, float], ...],
    field: str = "control.engine_curve",
) -> Callable[[int], float]:
    """A measured throughput curve: ``(batch, tokens/s)`` points, linear between them, flat
    past the last one, and proportional to the batch below the first."""
    pts = sorted((int(b), float(t)) for b, t in points)
    if not pts or any(b < 1 or not t > 0 for b, t in pts) or len({b for b, _ in pts}) != len(pts):
        raise ConfigError(
            field, f"needs distinct [batch >= 1, tokens/s > 0] pairs, got {list(points)!r}"
        )

    def curve(n: int) -> float:
        if n <= pts[0][0]:
            return pts[0][1] * n / pts[0][0]
        for (b0, t0), (b1, t1) in itertools.pairwise(pts):
            if n <= b1:
                return t0 + (t1 - t0) * (n - b0) / (b1 - b0)
        return pts[-1][1]

    return curve
