"""Several proxy processes as one proxy (``runtime.proxy_processes: N``): executions
partitioned by id, one engine view.

One proxy is one Python process (about 0.3-0.6 ms of CPU per call, benchmarks/README.md "Proxy
overhead"): a cluster's call rate can exceed one core. With N processes, execution ``e`` belongs
to process ``owner(e, N)`` (a stable hash of its id): its base URL names that process, its
registration, close and records go there, so each execution's calls, token records and registry
entry live in one process exactly as with one proxy. Every process knows every engine: joins,
leaves, drains and undrains reach all of them (``FanOut``), each moving its own calls; an
engine's cap is split between them (``cap_share``), so the engine never holds more than its cap.

In: the driver's admin requests (an ``httpx`` client whose transport is ``FanOut``), the engines'
join bodies. Out: one answer per admin request: the owner's for an execution's route, for the
engine routes and ``/tidal/stats`` / ``/health`` the processes' answers merged (counts summed,
engines' in-flight figures summed per engine, maxima and quantiles the highest of the
processes, ``process``: one entry per process); the first refusal (non-2xx) where any refused.
``ProxySet``: the N ``tidal proxy`` processes of a run (``start_proxies``).
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import time
import zlib
from pathlib import Path
from typing import Any

import httpx

from tidal.serving.execution_keys import PATH_PREFIX

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_EXECUTIONS = "/tidal/executions"
_ENGINE_SUMS = ("cap", "inflight", "reserved", "inflight_tokens", "prompt_tokens", "cached_tokens")


def rss_bytes() -> int:
    """This process's resident memory now (``/proc/self/statm``; the peak where absent)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def process_figures() -> dict[str, float]:
    """This process's id, CPU seconds (user + system) and resident MB (the proxy's
    ``/tidal/stats`` carries them as ``process``: a reader divides by its calls)."""
    return {
        "pid": os.getpid(),
        "cpu_s": round(time.process_time(), 4),
        "rss_mb": round(rss_bytes() / 1e6, 2),
    }


def owner(execution_id: str, processes: int) -> int:
    """The proxy process that serves ``execution_id`` (stable across processes and runs)."""
    return zlib.crc32(execution_id.encode()) % processes if processes > 1 else 0


def cap_share(cap: int, index: int, processes: int) -> int:
    """Process ``index``'s share of an engine's ``cap`` (the shares sum to ``cap``; at least 1
    each, so a cap below ``processes`` is exceeded by at most ``processes - cap``)."""
    return max(1, cap // processes + (1 if index < cap % processes else 0))


def _execution_of(request: httpx.Request) -> str | None:
    """The execution a request names in its path (``/x/<id>/...``,
    ``/tidal/executions/<id>/...``), its ``X-Tidal-Execution`` header or (registration) its
    body; None: no execution (an engine or process-wide route)."""
    path = request.url.path
    for prefix in (PATH_PREFIX, _EXECUTIONS + "/"):
        if path.startswith(prefix):
            return path[len(prefix) :].split("/", 1)[0] or None
    if (eid := request.headers.get("X-Tidal-Execution")) is not None:
        return eid
    if path == _EXECUTIONS and request.method == "POST":
        try:
            return json.loads(request.content or b"{}").get("execution_id")
        except (ValueError, AttributeError):
            return None
    return None


def _merge_engines(views: list[list[dict]]) -> list[dict]:
    merged: dict[str, dict] = {}
    for view in views:
        for e in view:
            m = merged.get(e["id"])
            if m is None:
                merged[e["id"]] = dict(e)
                continue
            for k in _ENGINE_SUMS:
                if k in e:
                    m[k] = m.get(k, 0) + e[k]
            m["admitting"] = m.get("admitting", False) and e.get("admitting", False)
            m["alive"] = m.get("alive", False) and e.get("alive", False)
    return list(merged.values())


def _highest(key: str) -> bool:
    return any(w in key for w in ("max", "p50", "p99", "share", "per_100", "duration_s"))


def merge(bodies: list[Any]) -> Any:
    """The processes' JSON answers as one: numbers summed (maxima and quantiles: the highest),
    engine lists merged per engine, other lists joined without repeats, the rest the first's."""
    first = bodies[0]
    if isinstance(first, dict):
        out: dict[str, Any] = {}
        for key, value in first.items():
            values = [b[key] for b in bodies if isinstance(b, dict) and key in b]
            if key == "engines" and isinstance(value, list):
                out[key] = _merge_engines(values)
            elif key == "engines" and isinstance(value, int):  # /health: engines serving
                out[key] = min(values)
            elif key == "process":
                out[key] = [p for v in values for p in (v if isinstance(v, list) else [v])]
            elif isinstance(value, bool) or not isinstance(value, (int, float, dict, list)):
                out[key] = value
            elif isinstance(value, (int, float)):
                nums = [v for v in values if isinstance(v, (int, float))]
                out[key] = max(nums) if _highest(key) else sum(nums)
            elif isinstance(value, dict):
                out[key] = merge(values) if key != "cached_token_share_by_engine" else value
            else:
                out[key] = list(dict.fromkeys(x for v in values for x in v))
        _recompute(out)
        return out
    return first


def _recompute(out: dict[str, Any]) -> None:
    """Ratios of sums, from the summed parts (not the highest of the processes' ratios)."""
    if "cached_token_share" in out and out.get("prompt_tokens"):
        out["cached_token_share"] = round(out["cached_tokens"] / out["prompt_tokens"], 4)
    if "cached_token_share_by_engine" in out and isinstance(out.get("engines"), list):
        out["cached_token_share_by_engine"] = {
            e["id"]: round(e["cached_tokens"] / e["prompt_tokens"], 4)
            if e["prompt_tokens"]
            else 0.0
            for e in out["engines"]
            if "prompt_tokens" in e
        }
    if "chain_breaks_per_100_calls" in out and out.get("recorded_calls"):
        out["chain_breaks_per_100_calls"] = round(
            100.0 * out.get("chain_breaks", 0) / out["recorded_calls"], 2
        )


class FanOut(httpx.AsyncBaseTransport):
    """An ``httpx`` transport over N proxy processes (``urls``): a request that names an
    execution goes to its owner; engine routes, ``/tidal/stats`` and ``/health`` to all
    (``merge``); anything else to process 0. A join's ``cap`` is split (``cap_share``)."""

    def __init__(
        self,
        urls: list[str],
        inner: httpx.AsyncBaseTransport | None = None,
        keep_open: bool = False,
    ) -> None:
        """``keep_open``: a client's close leaves the connections open (a transport shared by
        short-lived clients, e.g. the harness pool's one per group)."""
        if not urls:
            raise ValueError("FanOut needs at least one proxy URL")
        self.urls = [httpx.URL(u) for u in urls]
        if inner is None:  # several pools: one httpcore pool is O(n^2) at 10,000 connections
            from tidal.serving.shared_http import Sharded

            inner = Sharded()
        self.inner = inner
        self.keep_open = keep_open

    def _to(
        self, request: httpx.Request, index: int, content: bytes | None = None
    ) -> httpx.Request:
        base = self.urls[index]
        url = request.url.copy_with(scheme=base.scheme, host=base.host, port=base.port)
        headers = request.headers.copy()
        if content is not None:
            headers["Content-Length"] = str(len(content))
        return httpx.Request(
            request.method,
            url,
            headers=headers,
            content=request.content if content is None else content,
            extensions=request.extensions,
        )

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        await request.aread()
        n, path = len(self.urls), request.url.path
        eid = _execution_of(request)
        if n == 1 or eid is not None:
            return await self.inner.handle_async_request(self._to(request, owner(eid or "", n)))
        if not (path.startswith("/tidal/engines") or path in ("/tidal/stats", "/health")):
            return await self.inner.handle_async_request(self._to(request, 0))
        requests = [self._to(request, i) for i in range(n)]
        if path == "/tidal/engines" and request.method == "POST":  # a join: the cap split
            body = json.loads(request.content)
            cap = int(body.get("cap", 32))
            requests = [
                self._to(request, i, json.dumps({**body, "cap": cap_share(cap, i, n)}).encode())
                for i in range(n)
            ]
        answers = await asyncio.gather(*[self._send(r) for r in requests])
        for status, content, headers in answers:
            if not 200 <= status < 300:
                return httpx.Response(status, headers=headers, content=content)
        try:
            body = merge([json.loads(c) for _, c, _ in answers])
        except ValueError:
            _, content, headers = answers[0]
            return httpx.Response(200, headers=headers, content=content)
        return httpx.Response(200, json=body)

    async def _send(self, request: httpx.Request) -> tuple[int, bytes, httpx.Headers]:
        resp = await self.inner.handle_async_request(request)
        try:
            content = await resp.aread()
        finally:
            await resp.aclose()
        headers = httpx.Headers(
            {k: v for k, v in resp.headers.items() if k.lower() in ("content-type",)}
        )
        return resp.status_code, content, headers

    async def aclose(self) -> None:
        if not self.keep_open:
            await self.inner.aclose()


class ProxySet:
    """The run's proxy processes (``tidal proxy`` each, on its own port): ``url`` the first's
    (the admin client's base; its transport is ``transport()``), ``url_for(execution)`` the
    owner's, ``procs`` every process (each a supervised part of the run)."""

    def __init__(self, servers: list[Any]) -> None:
        self.servers = servers

    @property
    def url(self) -> str:
        return self.servers[0].url

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    @property
    def procs(self) -> list[Any]:
        return [s.proc for s in self.servers]

    @property
    def proc(self) -> Any:  # one process: what a single proxy's watchers read
        return self.servers[0].proc

    def url_for(self, execution_id: str) -> str:
        return self.urls[owner(execution_id, len(self.servers))]

    def transport(self, keep_open: bool = False) -> FanOut | None:
        """An admin transport (None with one process: the plain client reaches it)."""
        return FanOut(self.urls, keep_open=keep_open) if len(self.servers) > 1 else None

    def wait_healthy(self, timeout_s: float = 60.0) -> ProxySet:
        for s in self.servers:
            s.wait_healthy(timeout_s)
        return self

    def stop(self) -> None:
        for s in self.servers:
            s.stop()


def start_proxies(
    processes: int, admin_token: str, log_path: Path | None = None, **fields: Any
) -> ProxySet:
    """``processes`` ``tidal proxy`` processes (``launch.start_proxy`` each, no engine yet);
    logs ``log_path`` for the first, ``proxy-<i>.log`` beside it for the others."""
    from tidal.serving.launch import start_proxy

    servers: list[Any] = []
    try:
        for i in range(processes):
            log = log_path if i == 0 or log_path is None else log_path.with_name(f"proxy-{i}.log")
            servers.append(start_proxy([], [], admin_token, log_path=log, **fields))
    except BaseException:
        for s in servers:
            s.stop()
        raise
    return ProxySet(servers)
