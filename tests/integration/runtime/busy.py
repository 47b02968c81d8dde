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
