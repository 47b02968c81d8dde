"""Drain latency of the proxy, with and without KV handoff, and the re-prefill time it saves.

Starts two built-in engine processes (tiny GPT) behind a ``tidal proxy`` process, keeps
``--concurrency`` long generations (long prompts) running on engine A, drains A (all move to B),
undrains, repeats. Prints drain time p50 / p99 per mode, re-prefilled tokens per drain, and the
prefill time those tokens cost on this machine (measured on an idle engine).

    .venv/bin/python benchmarks/drain_latency.py --drains 10 --concurrency 16
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from tidal.models import create_tiny
from tidal.serving.launch import start_engine, start_proxy

TOKEN = "bench"
H = {"Authorization": f"Bearer {TOKEN}"}


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def prefill_rate(url: str, prompt_tokens: int) -> float:
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        body = {"prompt": [5] * prompt_tokens, "max_tokens": 1}
        await c.post("/v1/completions", json=body)
        t0 = time.perf_counter()
        for _ in range(3):
            await c.post("/v1/completions", json=body)
        return 3 * prompt_tokens / (time.perf_counter() - t0)


async def run_mode(proxy_url: str, handoff: bool, drains: int, concurrency: int,
                   prompt_tokens: int) -> dict:
    durations, moved, reprefill = [], 0, 0
    async with httpx.AsyncClient(base_url=proxy_url, timeout=300,
                                 limits=httpx.Limits(max_connections=concurrency + 8)) as c:
        stats0 = (await c.get("/tidal/stats", headers=H)).json()
        for i in range(drains):
            await c.post("/tidal/engines/s1/drain", headers=H, params={"handoff": False})
            await c.post("/tidal/engines/s1/undrain", headers=H)
            # pin the load on s0: s1 is drained while the calls start
            await c.post("/tidal/engines/s1/drain", headers=H)
            calls = [asyncio.create_task(c.post("/v1/completions", headers={
                **H, "X-Tidal-Execution": f"d{i}-{k}"}, json={
                "prompt": [(k * 7 + j) % 300 + 1 for j in range(prompt_tokens)],
                "max_tokens": 160, "ignore_eos": True})) for k in range(concurrency)]
            await asyncio.sleep(2.0)  # every call is past its prefill and decoding
            await c.post("/tidal/engines/s1/undrain", headers=H)
            r = await c.post("/tidal/engines/s0/drain", headers=H, params={"handoff": handoff})
            durations.append(r.json()["duration_s"])
            moved += r.json()["moved"]
            await c.post("/tidal/engines/s0/undrain", headers=H)
            for resp in await asyncio.gather(*calls):
                assert resp.status_code == 200 and \
                    len(resp.json()["choices"][0]["token_ids"]) == 160, resp.text
        stats1 = (await c.get("/tidal/stats", headers=H)).json()
        reprefill = stats1["reprefill_tokens"] - stats0["reprefill_tokens"]
        saved = stats1["saved_prefill_tokens"] - stats0["saved_prefill_tokens"]
    return {"durations": durations, "moved": moved, "reprefill": reprefill, "saved": saved}


async def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        model = create_tiny(Path(tmp) / "m", max_seq_len=1024)
        engines = [start_engine(model, name="tiny", log_path=args.log_dir / f"e{i}.log"
                                if args.log_dir else None) for i in range(2)]
        for e in engines:
            e.wait_healthy(120)
        proxy = start_proxy([e.url for e in engines], [], TOKEN,
                            log_path=args.log_dir / "proxy.log" if args.log_dir else None
                            ).wait_healthy(60)
        try:
            rate = await prefill_rate(engines[1].url, args.prompt_tokens)
            print(f"prefill on an idle engine: {rate:,.0f} tokens/s "
                  f"(prompt {args.prompt_tokens} tokens)")
            for handoff in (False, True):
                r = await run_mode(proxy.url, handoff, args.drains, args.concurrency,
                                   args.prompt_tokens)
                d = r["durations"]
                print(f"kv_handoff={handoff!s:5}: drain p50 {1e3 * statistics.median(d):7.1f} ms"
                      f"  p99 {1e3 * pct(d, 0.99):7.1f} ms  over {len(d)} drains,"
                      f" {r['moved'] / len(d):.1f} calls moved per drain;"
                      f" re-prefilled {r['reprefill'] / len(d):,.0f} tokens/drain"
                      f" (~{1e3 * r['reprefill'] / len(d) / rate:,.0f} ms of prefill),"
                      f" reused via KV {r['saved'] / len(d):,.0f} tokens/drain"
                      f" (~{1e3 * r['saved'] / len(d) / rate:,.0f} ms of prefill saved)")
        finally:
            proxy.stop()
            for e in engines:
                e.stop()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drains", type=int, default=10)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--log-dir", type=Path, default=None)
    asyncio.run(main(ap.parse_args()))
