"""The KV folder of tidal's vLLM connector over HTTP, on every node: an ASGI middleware vLLM
loads itself (``--middleware tidal.serving.vllm_kv_routes.KVRoutes``, inside the guard), so the
proxy hands calls' KV over between vLLM servers on any node without touching their folders.

In: ``$TIDAL_KV_DIR`` (the connector's ``tidal_kv_dir``, the node's shared-memory folder),
``$TIDAL_KV_NODE`` (the node's name: servers with the same name share the folder) and POSTs
with a JSON body to ``/tidal/kv/<op>``. Out: JSON answers; a request it cannot serve is a 409
with ``{"error": {"message": ...}}`` (the proxy then re-prefills that call, counted):

- ``info`` -> ``{dir, node}``;
- ``keep`` ``{ids: {engine request id: nonce}}``: the markers that make the connector export
  those requests' KV at their abort (``vllm_kv_connector``);
- ``record`` ``{nonce, timeout_s}`` -> ``{key, num_tokens}`` once the export of that abort is
  written (``num_tokens`` 0: nothing was computed);
- ``has`` ``{key}`` -> ``{exists}``; ``ack`` ``{key}`` -> ``{tokens}`` (what the scheduler
  adopted); ``release`` ``{key}``: the export's files removed;
- ``pull`` ``{key, source, timeout_s}``: the export ``key`` of the server at URL ``source`` (on
  another node) carried into this node's folder; ``send`` ``{key, host, port, group,
  timeout_s}``: the source's half (its files then removed: the export moved).

The carrier across nodes is ``tidal.training.carriers``' bucketed broadcast over a two-member
gloo side group (the destination hosts the store on the address the proxy reached it at; the
source is rank 0): the manifest first, then one file per tensor-parallel rank, each received
under a temporary name and renamed into place only when whole, the manifest last (the
connector reads an export by its manifest, so a half-carried export is never loaded).

Imports only the standard library at module level (it loads inside vLLM's venv); torch and the
carriers only for a transfer.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import os
import shutil
import threading
import time
import urllib.request
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

DIR_ENV, NODE_ENV = "TIDAL_KV_DIR", "TIDAL_KV_NODE"
MIDDLEWARE = "tidal.serving.vllm_kv_routes.KVRoutes"
PREFIX = "/tidal/kv/"
MAX_BODY = 1 << 20


class RouteError(Exception):
    """A request the folder cannot serve (409)."""


def _key(body: dict) -> str:
    key = body.get("key")
    if not isinstance(key, str) or not key.isalnum() or len(key) != 40:
        raise RouteError(f"key: not an export key: {key!r:.60}")
    return key


def _timeout(body: dict, default: float) -> float:
    t = body.get("timeout_s", default)
    if not isinstance(t, int | float) or not 0 < t <= 600:
        raise RouteError(f"timeout_s: must be in (0, 600], got {t!r:.20}")
    return float(t)


def export_files(folder: Path, key: str) -> list[Path]:
    """An export's files in carrying order: its manifest, then one per tensor-parallel rank."""
    manifest = json.loads((folder / f"{key}.json").read_text())
    return [folder / f"{key}.json"] + [folder / f"{key}.{r}.kv" for r in range(manifest["tp"])]


def send_export(folder: Path, key: str, host: str, port: int, group: str, timeout_s: float) -> int:
    """Rank 0 of the group met at the destination's store ``host:port``: each file of export
    ``key`` broadcast in buckets (its index as the segment's version); returns the bytes."""
    from tidal.training.carriers import group_on, send_segment
    from tidal.training.groups import store_on

    files = export_files(folder, key)
    _gloo_iface(host)
    g = group_on(store_on(host, port, 2, False, timeout_s), 0, 2, group, "gloo", timeout_s)
    return sum(send_segment(g, p, i, timeout_s=timeout_s) for i, p in enumerate(files))


def recv_export(folder: Path, key: str, store: Any, group: str, timeout_s: float) -> int:
    """Rank 1: export ``key`` received into a staging folder, renamed into ``folder`` when
    whole (the manifest last); returns the bytes."""
    from tidal.training.carriers import group_on, recv_segment

    stage = folder / f".pull-{key}-{uuid.uuid4().hex[:8]}"
    try:
        g = group_on(store, 1, 2, group, "gloo", timeout_s)
        _, path = recv_segment(g, stage, timeout_s)
        manifest = Path(path)
        tp = json.loads(manifest.read_text())["tp"]
        parts = [Path(recv_segment(g, stage, timeout_s)[1]) for _ in range(tp)]
        for r, p in enumerate(parts):
            os.replace(p, folder / f"{key}.{r}.kv")
        os.replace(manifest, folder / f"{key}.json")
        return (
            sum((folder / f"{key}.{r}.kv").stat().st_size for r in range(tp))
            + (folder / f"{key}.json").stat().st_size
        )
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def _in_thread(fn: Callable[..., Any], *args: Any) -> asyncio.Future:
    """``fn(*args)`` on a thread of its own (never the loop's shared executor: a pull's
    receiver waits there for its sender, and eight moved calls at once would fill it)."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def settle(out: Any, exc: BaseException | None) -> None:
        if fut.done():
            return
        if exc is None:
            fut.set_result(out)
        else:
            fut.set_exception(exc)

    def run() -> None:
        try:
            out, exc = fn(*args), None
        except BaseException as e:  # handed to the awaiting request, never lost
            out, exc = None, e
        loop.call_soon_threadsafe(settle, out, exc)

    threading.Thread(target=run, name="tidal-kv", daemon=True).start()
    return fut


def _gloo_iface(host: str) -> None:
    """A loopback transfer needs gloo on ``lo`` (a node's own interface is set by its host)."""
    with contextlib.suppress(ValueError):
        if ipaddress.ip_address(host).is_loopback:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


def _post(url: str, body: dict, timeout_s: float) -> dict:
    """POST ``body`` to another server of the run (with the run's token, if any)."""
    headers = {"Content-Type": "application/json"}
    token = os.environ.get("TIDAL_ENGINE_TOKEN")
    if token:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url, json.dumps(body).encode(), headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return json.loads(resp.read())
    except OSError as exc:  # URLError, HTTPError, timeouts
        detail = exc.read().decode(errors="replace")[:200] if hasattr(exc, "read") else exc
        raise RouteError(f"{url}: {detail}") from None


class KVRoutes:
    """``KVRoutes(app)``: answers ``/tidal/kv/*`` itself, passes everything else to ``app``."""

    def __init__(
        self,
        app: Callable[..., Awaitable[None]],
        folder: str | None = None,
        node: str | None = None,
    ) -> None:
        self.app = app
        self.dir = Path(folder or os.environ.get(DIR_ENV) or "/dev/shm/tidal-kv")
        self.node = node or os.environ.get(NODE_ENV) or os.uname().nodename

    async def __call__(self, scope: dict[str, Any], receive: Callable, send: Callable) -> None:
        path = scope.get("path", "")
        if scope.get("type") != "http" or not path.startswith(PREFIX):
            await self.app(scope, receive, send)
            return
        status, out = 200, {}
        try:
            if scope.get("method") != "POST":
                raise RouteError("POST only")
            body = await _body(receive)
            out = await self.answer(path[len(PREFIX) :], body, (scope.get("server") or [""])[0])
        except RouteError as exc:
            status, out = 409, {"error": {"message": str(exc)}}
        except Exception as exc:  # the HTTP boundary: one line, never a trace
            msg = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            status, out = 409, {"error": {"message": msg[:300]}}
        data = json.dumps(out).encode()
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(data)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": data})

    async def answer(self, op: str, body: dict, host: str) -> dict:
        d = self.dir
        if op == "info":
            return {"dir": str(d), "node": self.node}
        if op == "keep":
            ids = body.get("ids")
            if not isinstance(ids, dict):
                raise RouteError("ids: {engine request id: nonce} expected")
            for rid, nonce in ids.items():
                if not (isinstance(nonce, str) and nonce.isalnum()) or "/" in str(rid):
                    raise RouteError(f"ids: bad entry {rid!r:.60}")
                (d / f"keep-{rid}").write_text(nonce)
            return {}
        if op == "record":
            return await self._record(body)
        if op == "has":
            return {"exists": (d / f"{_key(body)}.json").exists()}
        if op == "ack":
            ack = d / f"{_key(body)}.ack"
            try:
                n = int(ack.read_text())
            except (OSError, ValueError):
                return {"tokens": 0}
            ack.unlink(missing_ok=True)
            return {"tokens": n}
        if op == "release":
            for p in d.glob(f"{_key(body)}.*"):
                p.unlink(missing_ok=True)
            return {}
        if op == "pull":
            return await self._pull(body, host)
        if op == "send":
            key, t = _key(body), _timeout(body, 60.0)
            port, group = body.get("port"), body.get("group")
            if not isinstance(port, int) or not isinstance(group, str):
                raise RouteError("send: port (int) and group (str) expected")
            t0 = time.perf_counter()
            n = await _in_thread(send_export, d, key, str(body.get("host")), port, group, t)
            for p in d.glob(f"{key}.*"):  # the export moved to its adopter's node
                p.unlink(missing_ok=True)
            return {"bytes": n, "seconds": round(time.perf_counter() - t0, 4)}
        raise RouteError(f"unknown KV route {op!r:.40}")

    async def _record(self, body: dict) -> dict:
        nonce = body.get("nonce")
        if not isinstance(nonce, str) or not nonce.isalnum():
            raise RouteError("nonce: expected")
        rec = self.dir / f"rec-{nonce}.json"
        deadline = time.monotonic() + _timeout(body, 30.0)
        while not rec.exists():  # written by the connector after its workers' copy
            if time.monotonic() >= deadline:
                raise RouteError(f"no KV export for {nonce} in time")
            await asyncio.sleep(0.01)
        out = json.loads(rec.read_text())
        rec.unlink(missing_ok=True)
        return out

    async def _pull(self, body: dict, host: str) -> dict:
        from tidal.training.groups import store_on

        key, t = _key(body), _timeout(body, 60.0)
        source = body.get("source")
        if not isinstance(source, str) or not source.startswith(("http://", "https://")):
            raise RouteError("source: the URL of the server holding the export expected")
        _gloo_iface(host)
        t0 = time.perf_counter()
        # the source still holds it (else no receiver waits for a sender that never comes)
        if not (await _in_thread(_post, f"{source}{PREFIX}has", {"key": key}, t))["exists"]:
            raise RouteError(f"{source} holds no export {key[:12]} (its lease ended)")
        store = await _in_thread(store_on, host, 0, 2, True, t)
        group = f"tidal-kv-{uuid.uuid4().hex}"
        recv = _in_thread(recv_export, self.dir, key, store, group, t)
        ask = {"key": key, "host": host, "port": store.port, "group": group, "timeout_s": t}
        try:
            sent = await _in_thread(_post, f"{source}{PREFIX}send", ask, t + 10)
        except RouteError:
            recv.add_done_callback(lambda f: f.exception())  # its thread ends at its timeout
            raise
        n = await recv
        return {
            "bytes": n,
            "sent": sent.get("bytes"),
            "seconds": round(time.perf_counter() - t0, 4),
        }


async def _body(receive: Callable) -> dict:
    chunks, size = [], 0
    while True:
        msg = await receive()
        chunks.append(msg.get("body", b""))
        size += len(chunks[-1])
        if size > MAX_BODY:
            raise RouteError("body too large")
        if not msg.get("more_body"):
            break
    raw = b"".join(chunks)
    data = json.loads(raw) if raw else {}
    if not isinstance(data, dict):
        raise RouteError("a JSON object expected")
    return data
