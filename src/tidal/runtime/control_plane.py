"""What the control plane itself costs in a run: the figures of ``summary.json``'s
``control_plane`` section.

In: every controller decision's duration (``Decisions.timed`` wraps the guarded ``handle``), the
driver's event loop (``ControlPlane.run``, a part of the run: it sleeps ``every_s`` and measures
how late it wakes), the driver's resident memory and the controller's open executions (sampled
with it), the proxy's ``/tidal/stats`` at the first dispatch and at the end (its calls, decoded
tokens, its process CPU seconds and resident memory: ``process``, one entry per proxy process).
Out: ``ControlPlane.report``: proxy calls/s and tokens/s, proxy CPU ms per call, the proxy's
added latency p50/p99 (its own time per call: parse, route, record, serialise; waits on engines
and admission excluded), controller decision latency p50/p99/max, driver event-loop lag
p50/p99/max, and memory per execution (the driver's resident growth at peak concurrency per
execution in flight, the ledger's and the trajectory buffer's own bytes per entry, the proxies'
resident growth per execution).
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from tidal.serving.proxy_set import rss_bytes

log = logging.getLogger(__name__)


class Latencies:
    """The last ``keep`` durations (seconds) and their count; quantiles in ms."""

    def __init__(self, keep: int = 100_000) -> None:
        self.values: deque[float] = deque(maxlen=keep)
        self.n = 0

    def add(self, seconds: float) -> None:
        self.values.append(seconds)
        self.n += 1

    def figures(self) -> dict[str, float]:
        v = sorted(self.values)
        if not v:
            return {"n": self.n}
        q = lambda p: round(1e3 * v[min(len(v) - 1, int(p * len(v)))], 3)  # noqa: E731
        return {"n": self.n, "p50_ms": q(0.5), "p99_ms": q(0.99), "max_ms": round(1e3 * v[-1], 3)}


def deep_size(root: object, limit: int = 2_000_000) -> int:
    """Bytes of ``root`` and everything it reaches through containers and instance dicts /
    slots (each object once; at most ``limit`` objects; modules, types and functions not
    followed: they are shared code, not per-execution state)."""
    seen: set[int] = set()
    stack, total = [root], 0
    skip = (type, type(sys), type(deep_size))
    while stack and len(seen) < limit:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, skip):
            continue
        seen.add(id(obj))
        total += sys.getsizeof(obj)
        if isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset, deque)):
            stack.extend(obj)
        elif not isinstance(obj, (str, bytes, int, float, bool)) and obj is not None:
            if hasattr(obj, "__dict__"):
                stack.append(vars(obj))
            for name in getattr(type(obj), "__slots__", ()):
                if hasattr(obj, name):
                    stack.append(getattr(obj, name))
    return total


def per_entry(root: object, entries: int) -> float | None:
    return round(deep_size(root) / entries, 1) if entries else None


class ControlPlane:
    """The run's control-plane figures (one per run, on the driver's loop).

    ``open_executions``: the controller's count of executions dispatched and not closed now;
    ``sizes``: name -> (object, entries) whose deep size per entry is measured at the peak
    (the ledger's executions, the trajectory buffer); ``every_s``: the lag probe's period;
    ``size_every_s``: how often at most a new peak is measured (a deep walk of 10,000
    executions takes tens of ms of the loop: it shows in the lag, so it is rare).
    """

    def __init__(
        self,
        open_executions: Callable[[], int],
        sizes: Callable[[], dict[str, tuple[object, int]]] | None = None,
        every_s: float = 0.05,
        size_every_s: float = 30.0,
    ) -> None:
        self.decisions = Latencies()
        self.loop_lag = Latencies()
        self._open, self._sizes = open_executions, sizes
        self.every_s, self.size_every_s = every_s, size_every_s
        self.rss0 = rss_bytes()
        self.cpu0 = time.process_time()
        self.peak_open, self.rss_at_peak, self.peak_rss = 0, self.rss0, self.rss0
        self.bytes_per_entry: dict[str, float | None] = {}
        self._sized_at = float("-inf")
        self.proxy_start: dict[str, Any] | None = None

    def timed(self, handle: Callable[[Any], None]) -> Callable[[Any], None]:
        """``handle`` whose every call's duration is a controller decision's latency."""

        def timed_handle(event: Any) -> None:
            t0 = time.perf_counter()
            try:
                handle(event)
            finally:
                self.decisions.add(time.perf_counter() - t0)

        return timed_handle

    def sample(self, now: float) -> None:
        """Resident memory and open executions now; at a new peak of open executions (and at
        most every ``size_every_s``) the per-entry sizes."""
        rss, n = rss_bytes(), self._open()
        self.peak_rss = max(self.peak_rss, rss)
        if n > self.peak_open:
            self.peak_open, self.rss_at_peak = n, rss
            if self._sizes is not None and now - self._sized_at >= self.size_every_s:
                self._sized_at = now
                self.bytes_per_entry = {
                    k: per_entry(obj, count) for k, (obj, count) in self._sizes().items()
                }

    async def run(self) -> None:
        """Forever: wake every ``every_s`` and record how late (the event loop's lag)."""
        loop = asyncio.get_running_loop()
        every = self.every_s
        while True:
            t = loop.time()
            await asyncio.sleep(every)
            now = loop.time()
            self.loop_lag.add(max(0.0, now - t - every))
            self.sample(now)

    async def begin(self, admin: Any) -> None:
        """The proxy's counts now (``admin``: the run's admin client; at the first dispatch):
        the report's figures are from here to the end."""
        try:
            self.proxy_start = (await admin.get("/tidal/stats", timeout=30.0)).json()
        except Exception as exc:  # a figure, never the run's failure
            log.warning("control plane: the proxy's stats at the start: %s", exc)

    def report(
        self, stats: dict[str, Any], bursts_s: float, meter: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """The ``control_plane`` section: ``stats`` the proxy's at the end (``self.proxy_start``
        its stats at the first dispatch, when set), ``bursts_s`` the run's bursts' seconds,
        ``meter`` the decode meter's polls (``DecodeMeter.figures``: its misses, its longest
        time without a reading)."""
        start = self.proxy_start or {}
        calls = stats.get("calls", 0) - start.get("calls", 0)
        tokens = _tokens(stats) - _tokens(start)
        cpu = _cpu(stats.get("process", [])) - _cpu(start.get("process", []))
        rss = _rss(stats.get("process", [])) - _rss(start.get("process", []))
        span = max(bursts_s, 1e-9)
        over = stats.get("overhead", {})
        return {
            "proxy": {
                "processes": len(_procs(stats.get("process", []))),
                "calls": calls,
                "calls_per_s": round(calls / span, 2),
                "tokens_per_s": round(tokens / span, 1),
                "cpu_s": round(cpu, 3),
                "cpu_ms_per_call": round(1e3 * cpu / calls, 4) if calls else None,
                "cpu_cores_busy": round(cpu / span, 3),
                "added_latency_ms": {k: over.get(k) for k in ("n", "p50_ms", "p99_ms")},
                "rss_mb": round(_rss(stats.get("process", [])), 1),
                "rss_mb_per_1k_executions": (
                    round(1e3 * rss / self.peak_open, 2) if self.peak_open else None
                ),
            },
            "controller_decision": self.decisions.figures(),
            "driver": {
                "loop_lag": self.loop_lag.figures(),
                "cpu_s": round(time.process_time() - self.cpu0, 2),
                "cpu_cores_busy": round((time.process_time() - self.cpu0) / span, 3),
                "rss_mb_start": round(self.rss0 / 1e6, 1),
                "rss_mb_peak": round(self.peak_rss / 1e6, 1),
            },
            "memory": {
                "peak_open_executions": self.peak_open,
                "driver_bytes_per_execution": (
                    round((self.rss_at_peak - self.rss0) / self.peak_open)
                    if self.peak_open
                    else None
                ),
                "bytes_per_entry": dict(self.bytes_per_entry),
            },
            **({"decode_meter": meter} if meter is not None else {}),
        }


def _tokens(stats: dict[str, Any]) -> float:
    return float(stats.get("decode_meter", {}).get("tokens", 0.0))


def _procs(process: dict | Iterable[dict]) -> list[dict]:
    return [process] if isinstance(process, dict) else list(process)


def _cpu(process: dict | Iterable[dict]) -> float:
    return sum(float(p.get("cpu_s", 0.0)) for p in _procs(process))


def _rss(process: dict | Iterable[dict]) -> float:
    return sum(float(p.get("rss_mb", 0.0)) for p in _procs(process))
