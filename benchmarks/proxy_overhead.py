"""Latency the proxy adds over calling an engine directly, at 64 / 256 / 1024 concurrent
executions.

Starts one built-in engine process (tiny GPT, batch wide enough for every call) and a
``tidal proxy`` process in front of it. Each concurrent execution sends short completions
(``--max-tokens``) in a loop, once straight to the engine and once through the proxy. Prints
two figures per level:
- end to end: client-observed p50 / p99 via the proxy minus direct (includes the extra HTTP hop,
  and the client's own queueing on these 2 cores);
- in-proxy: the proxy's own time per call (handler time minus upstream streaming and admission
  waits), from ``/tidal/stats``.

    .venv/bin/python benchmarks/proxy_overhead.py --levels 64 256 1024
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import httpx

from tidal.models import create_tiny
from tidal.serving.launch import start_engine, start_proxy

TOKEN = "bench"


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def load(url: str, concurrency: int, calls_per_exec: int, max_tokens: int,
               tag: str) -> list[float]:
    lat: list[float] = []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as c:
        async def one(i: int) -> None:
            for k in range(calls_per_exec):
                t0 = time.perf_counter()
                r = await c.post("/v1/completions", headers={"X-Tidal-Execution": f"{tag}{i}"},
                                 json={"prompt": [1 + i % 300, 2, 3, 4 + k], "ignore_eos": True,
                                       "max_tokens": max_tokens})
                lat.append(time.perf_counter() - t0)
                assert r.status_code == 200, r.text

        await asyncio.gather(*[one(i) for i in range(concurrency)])
    return lat


async def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        model = create_tiny(Path(tmp) / "m", max_seq_len=256)
        top = max(args.levels)
        engine = start_engine(model, max_batch=top).wait_healthy(120)
        proxy = start_proxy([engine.url], [], TOKEN, cap=top).wait_healthy(60)
        admin = {"Authorization": f"Bearer {TOKEN}"}
        try:
            await load(engine.url, 16, 2, args.max_tokens, "warm")
            await load(proxy.url, 16, 2, args.max_tokens, "warm")
            print(f"{'concurrent':>10} {'direct p50/p99 ms':>20} {'proxy p50/p99 ms':>20}"
                  f" {'added p50/p99 ms':>20} {'in-proxy p50/p99 ms':>22}")
            for level in args.levels:
                direct = await load(engine.url, level, args.calls, args.max_tokens, "d")
                async with httpx.AsyncClient(base_url=proxy.url) as c:
                    before = (await c.get("/tidal/stats", headers=admin)).json()["overhead"]
                via = await load(proxy.url, level, args.calls, args.max_tokens, f"p{level}-")
                async with httpx.AsyncClient(base_url=proxy.url) as c:
                    stats = (await c.get("/tidal/stats", headers=admin)).json()["overhead"]
                d50, d99 = 1e3 * pct(direct, 0.5), 1e3 * pct(direct, 0.99)
                p50, p99 = 1e3 * pct(via, 0.5), 1e3 * pct(via, 0.99)
                n_new = stats["n"] - before.get("n", 0)
                print(f"{level:>10} {d50:>9.1f} / {d99:<8.1f} {p50:>9.1f} / {p99:<8.1f}"
                      f" {p50 - d50:>9.1f} / {p99 - d99:<8.1f}"
                      f" {stats['p50_ms']:>10.2f} / {stats['p99_ms']:<8.2f}"
                      f" (window of the last {min(stats['n'], 20000)} calls, {n_new} new)")
        finally:
            proxy.stop()
            engine.stop()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--levels", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--calls", type=int, default=3, help="calls per execution per level")
    ap.add_argument("--max-tokens", type=int, default=4)
    asyncio.run(main(ap.parse_args()))
