"""Waiting, in a test thread beside a live ``Runtime``, until one engine serves live calls."""

from __future__ import annotations

import time
from typing import Any

import httpx


def wait_until_busy(runtime: Any, name: str, deadline_s: float) -> list[dict] | None:
    """The proxy's engine list (``GET /tidal/engines``) at the first moment engine ``name``
    has calls in flight, once the run has dispatched; ``None`` if that never happens within
    ``deadline_s`` (the caller's assertions then say what was not seen)."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        wired = runtime.wired
        if wired is not None and wired.bridge.n_dispatched > 0 and runtime.engines is not None:
            try:
                listed = engines_listed(runtime)
            except httpx.HTTPError:
                listed = []
            if any(e["id"] == name and e["inflight"] > 0 for e in listed):
                return listed
        time.sleep(0.02)
    return None


def engines_listed(runtime: Any) -> list[dict]:
    """The proxy's engine list now (``httpx.HTTPError`` if it does not answer)."""
    return httpx.get(
        f"{runtime.proxy.url}/tidal/engines",
        timeout=5,
        headers={"Authorization": f"Bearer {runtime.token}"},
    ).json()["engines"]


def drain_when_busy(
    runtime: Any, name: str, seen: dict, attempts: int = 8, deadline_s: float = 180
) -> bool:
    """Drain engine ``name`` (then undrain it) while it serves a call, again (up to
    ``attempts`` times) if the call ended before the drain landed. ``seen["drained"]`` is the
    last drain's answer; True once a drain moved a live call."""
    head = {"Authorization": f"Bearer {runtime.token}"}
    for _ in range(attempts):
        if wait_until_busy(runtime, name, deadline_s) is None:
            return False
        url = runtime.proxy.url
        seen["drained"] = httpx.post(
            f"{url}/tidal/engines/{name}/drain", headers=head, timeout=60
        ).json()
        httpx.post(f"{url}/tidal/engines/{name}/undrain", headers=head, timeout=30)
        if seen["drained"].get("moved"):
            return True
    return False


def drain_then_kill(runtime: Any, seen: dict, attempts: int = 8, deadline_s: float = 180) -> None:
    """The chaos of the harness runs: drain the standalone engine ``s0`` while it serves a
    call (``drain_when_busy``), then SIGKILL the engine process of a cell serving a call (its
    actor lives on; the supervisor replaces the engine). ``seen`` gets the drain's answer
    (``drained``) and the killed cell (``killed``); what never happened is absent, for the
    caller's assertions."""
    import ray

    from tidal.runtime.engines import EngineId

    drain_when_busy(runtime, "s0", seen, attempts, deadline_s)
    if "drained" not in seen:
        return
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            listed = engines_listed(runtime)
        except httpx.HTTPError:
            listed = []
        busy = [e["id"] for e in listed if e["id"].startswith("c") and e["inflight"] > 0]
        if busy:
            seen["killed"] = busy[0]
            actor = runtime.engines.actors[EngineId.parse(busy[0])]
            ray.get(actor.kill_engine.remote(), timeout=30)
            return
        time.sleep(0.01)
