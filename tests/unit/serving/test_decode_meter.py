"""The proxy's decode meter (``/tidal/stats`` ``decode_meter``), over HTTP on loopback with a
real built-in engine: ``tokens`` is every completion token the engines sent back, streamed or
not; ``inflight_s`` integrates the calls held at engines up to the read: it grows while a call
is in flight and holds still while none is."""

from __future__ import annotations

import asyncio
import json
import time

import httpx

from tidal.models import load_model
from tidal.serving.engine import Engine, EngineConfig
from tidal.serving.engine_server import build_engine_app
from tidal.serving.proxy import Proxy, ProxyConfig
from tidal.serving.proxy_app import build_proxy_app

TOKEN = "t0k"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}


def _slow_engine(tiny_dir, step_s: float) -> Engine:
    """A built-in engine whose model steps take at least ``step_s`` (off the loop)."""
    model, tok = load_model(tiny_dir)
    eng = Engine(model, tok, tiny_dir, EngineConfig(step_in_thread=True))
    real = eng.model.forward_cached

    def slow(pending, caches):
        time.sleep(step_s)
        return real(pending, caches)

    eng.model.forward_cached = slow
    return eng


async def _streamed(c: httpx.AsyncClient, max_tokens: int) -> int:
    """Completion tokens of one streamed call (its text chunks' token counts)."""
    n = 0
    async with c.stream(
        "POST",
        "/v1/completions",
        json={
            "prompt": [3, 4],
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    ) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                usage = json.loads(line[6:]).get("usage")
                if usage:
                    n = usage["completion_tokens"]
    return n


def test_decode_meter_counts_tokens_and_in_flight_seconds(tiny_dir, serve_asgi):
    async def main():
        eng = _slow_engine(tiny_dir, 0.005)
        async with serve_asgi(build_engine_app(eng, "tiny", TOKEN)) as engine_url:
            proxy = Proxy(ProxyConfig(admin_token=TOKEN))
            await proxy.join("e0", engine_url)
            async with (
                serve_asgi(build_proxy_app(proxy)) as url,
                httpx.AsyncClient(base_url=url, timeout=60) as c,
            ):

                async def meter():
                    s = (await c.get("/tidal/stats", headers=ADMIN)).json()
                    return s["decode_meter"], s["inflight"]

                seen = [await meter()]
                plain = [
                    c.post(
                        "/v1/completions",
                        json={"prompt": [3, 4, i], "max_tokens": n, "ignore_eos": True},
                    )
                    for i, n in enumerate((5, 7, 9))
                ]
                answers = await asyncio.gather(*plain, _streamed(c, 11))
                counts = [a.json()["usage"]["completion_tokens"] for a in answers[:3]]
                counts.append(answers[3])
                seen.append(await meter())
                await asyncio.sleep(0.2)
                seen.append(await meter())  # none in flight: no exposure added

                long = asyncio.ensure_future(_streamed(c, 200))
                while proxy.stats()["inflight"] == 0:
                    await asyncio.sleep(0.01)
                t0 = time.monotonic()
                held = [await meter()]
                await asyncio.sleep(0.3)
                held.append(await meter())
                wall = time.monotonic() - t0
                counts.append(await long)
                seen.append(await meter())
            await proxy.close()
            return seen, held, wall, counts, eng.stats()

    seen, held, wall, counts, eng_stats = asyncio.run(main())
    assert counts == [5, 7, 9, 11, 200]
    (m0, _), (m1, n1), (m2, n2), (m3, _) = seen
    assert m0 == {"tokens": 0.0, "inflight_s": 0.0}
    assert m1["tokens"] == 32.0 and m1["inflight_s"] > 0 and n1 == 0
    assert m2 == m1 and n2 == 0
    (h0, k0), (h1, k1) = held
    assert k0 == k1 == 1  # the long call was in flight at both reads
    assert m1["inflight_s"] <= h0["inflight_s"]
    assert 0.25 <= h1["inflight_s"] - h0["inflight_s"] <= wall + 0.05
    assert m1["tokens"] <= h0["tokens"] <= h1["tokens"] <= m3["tokens"] == 232.0
    assert m3["inflight_s"] >= h1["inflight_s"]
    assert eng_stats["generated_tokens"] == 232
