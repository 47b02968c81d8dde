"""``summary.json``'s ``control_plane`` figures (``tidal.runtime.control_plane``): the event
loop's lag is measured when the loop is blocked, controller decisions are timed, memory per
entry grows with the entries, and the report divides the proxy's CPU and counts between the
first dispatch and the end by its calls and the run's seconds (several processes summed)."""

from __future__ import annotations

import asyncio
import time

from tidal.contracts.run_files import Summary
from tidal.runtime.control_plane import ControlPlane, Latencies, deep_size


def test_latencies_quantiles_in_ms():
    lat = Latencies()
    for ms in range(1, 101):
        lat.add(ms / 1e3)
    assert lat.figures() == {"n": 100, "p50_ms": 51.0, "p99_ms": 100.0, "max_ms": 100.0}
    assert Latencies().figures() == {"n": 0}


def test_deep_size_grows_with_entries():
    small = {f"e{i}": {"state": "running", "reward": None} for i in range(10)}
    large = {f"e{i}": {"state": "running", "reward": None} for i in range(1000)}
    assert deep_size(large) > 50 * deep_size(small) > 0


def test_loop_lag_and_decisions_are_measured():
    open_now = [0]
    plane = ControlPlane(lambda: open_now[0], lambda: {"ledger": (list(range(500)), 500)}, 0.01)

    def decide(event: object) -> None:
        time.sleep(0.03)  # a slow controller decision

    handle = plane.timed(decide)

    async def main() -> None:
        task = asyncio.create_task(plane.run())
        await asyncio.sleep(0.05)
        open_now[0] = 500
        handle("tick")  # blocks the loop 30 ms: the lag probe wakes late
        await asyncio.sleep(0.05)
        task.cancel()

    asyncio.run(main())
    assert plane.decisions.figures()["n"] == 1
    assert plane.decisions.figures()["max_ms"] >= 29
    assert plane.loop_lag.figures()["max_ms"] >= 20
    assert plane.peak_open == 500
    assert plane.bytes_per_entry["ledger"] > 8


def test_report_divides_between_first_dispatch_and_end():
    plane = ControlPlane(lambda: 0)
    plane.peak_open = 1000
    plane.proxy_start = {
        "calls": 100,
        "decode_meter": {"tokens": 1000.0},
        "process": [
            {"pid": 1, "cpu_s": 1.0, "rss_mb": 100.0},
            {"pid": 2, "cpu_s": 1.0, "rss_mb": 100.0},
        ],
    }
    end = {
        "calls": 1100,
        "decode_meter": {"tokens": 21000.0},
        "overhead": {"n": 1000, "p50_ms": 0.1, "p99_ms": 2.0},
        "process": [
            {"pid": 1, "cpu_s": 1.3, "rss_mb": 150.0},
            {"pid": 2, "cpu_s": 1.3, "rss_mb": 150.0},
        ],
    }
    rep = plane.report(end, bursts_s=10.0)
    proxy = rep["proxy"]
    assert proxy["processes"] == 2 and proxy["calls"] == 1000
    assert proxy["calls_per_s"] == 100.0 and proxy["tokens_per_s"] == 2000.0
    assert proxy["cpu_ms_per_call"] == 0.6 and proxy["cpu_cores_busy"] == 0.06
    assert proxy["added_latency_ms"] == {"n": 1000, "p50_ms": 0.1, "p99_ms": 2.0}
    assert proxy["rss_mb_per_1k_executions"] == 100.0
    assert rep["memory"]["peak_open_executions"] == 1000
    Summary.model_validate({"control_plane": rep})  # summary.json's schema takes it
