"""Drain latency of the proxy, with and without KV handoff, and the re-prefill time it saves.

Starts two built-in engine processes (tiny GPT) behind a ``tidal proxy`` process, keeps
``--concurrency`` long generations (long prompts) running on engine A, drains A (all move to B),
undrains, repeats. Prints drain time p50 / p99 per mode, re-prefilled tokens per drain, and the
prefill time those tokens cost on this machine (measured on an idle engine).

    .venv/bin/python benchmarks/drain_latency.py --drains 10 --concurrency 16

``--backend vllm`` does the same on two vLLM-CPU servers (SmolLM2, ``$TIDAL_VLLM_PYTHON``)
running tidal's KV connector, and reads the cost from the destination's own counters
(``/metrics``): prompt tokens it computed for the moved calls (``local_compute``; each call's
newest token is new work, the rest re-prefill) or loaded (``external_kv_transfer``), and its
time to first token (``vllm:time_to_first_token_seconds``, mean over the moved calls):

    TIDAL_VLLM_PYTHON=vllm-venv/bin/python .venv/bin/python benchmarks/drain_latency.py \
        --backend vllm --drains 3 --concurrency 8
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from tidal.models import create_tiny
from tidal.serving.launch import start_engine, start_proxy
from tidal.testing.vllm_servers import counters, spawn_vllm

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


async def run_mode(
    proxy_url: str, handoff: bool, drains: int, concurrency: int, prompt_tokens: int
) -> dict:
    durations, moved, reprefill = [], 0, 0
    async with httpx.AsyncClient(
        base_url=proxy_url, timeout=300, limits=httpx.Limits(max_connections=concurrency + 8)
    ) as c:
        stats0 = (await c.get("/tidal/stats", headers=H)).json()
        for i in range(drains):
            await c.post("/tidal/engines/s1/drain", headers=H, params={"handoff": False})
            await c.post("/tidal/engines/s1/undrain", headers=H)
            # pin the load on s0: s1 is drained while the calls start
            await c.post("/tidal/engines/s1/drain", headers=H)
            calls = [
                asyncio.create_task(
                    c.post(
                        "/v1/completions",
                        headers={**H, "X-Tidal-Execution": f"d{i}-{k}"},
                        json={
                            "prompt": [(k * 7 + j) % 300 + 1 for j in range(prompt_tokens)],
                            "max_tokens": 160,
                            "ignore_eos": True,
                        },
                    )
                )
                for k in range(concurrency)
            ]
            await asyncio.sleep(2.0)  # every call is past its prefill and decoding
            await c.post("/tidal/engines/s1/undrain", headers=H)
            r = await c.post("/tidal/engines/s0/drain", headers=H, params={"handoff": handoff})
            durations.append(r.json()["duration_s"])
            moved += r.json()["moved"]
            await c.post("/tidal/engines/s0/undrain", headers=H)
            for resp in await asyncio.gather(*calls):
                assert (
                    resp.status_code == 200 and len(resp.json()["choices"][0]["token_ids"]) == 160
                ), resp.text
        stats1 = (await c.get("/tidal/stats", headers=H)).json()
        reprefill = stats1["reprefill_tokens"] - stats0["reprefill_tokens"]
        saved = stats1["saved_prefill_tokens"] - stats0["saved_prefill_tokens"]
    return {"durations": durations, "moved": moved, "reprefill": reprefill, "saved": saved}


async def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        model = create_tiny(Path(tmp) / "m", max_seq_len=1024)
        engines = [
            start_engine(
                model, name="tiny", log_path=args.log_dir / f"e{i}.log" if args.log_dir else None
            )
            for i in range(2)
        ]
        for e in engines:
            e.wait_healthy(120)
        proxy = start_proxy(
            [e.url for e in engines],
            [],
            TOKEN,
            log_path=args.log_dir / "proxy.log" if args.log_dir else None,
        ).wait_healthy(60)
        try:
            rate = await prefill_rate(engines[1].url, args.prompt_tokens)
            print(
                f"prefill on an idle engine: {rate:,.0f} tokens/s "
                f"(prompt {args.prompt_tokens} tokens)"
            )
            for handoff in (False, True):
                r = await run_mode(
                    proxy.url, handoff, args.drains, args.concurrency, args.prompt_tokens
                )
                d = r["durations"]
                print(
                    f"kv_handoff={handoff!s:5}: drain p50 {1e3 * statistics.median(d):7.1f} ms"
                    f"  p99 {1e3 * pct(d, 0.99):7.1f} ms  over {len(d)} drains,"
                    f" {r['moved'] / len(d):.1f} calls moved per drain;"
                    f" re-prefilled {r['reprefill'] / len(d):,.0f} tokens/drain"
                    f" (~{1e3 * r['reprefill'] / len(d) / rate:,.0f} ms of prefill),"
                    f" reused via KV {r['saved'] / len(d):,.0f} tokens/drain"
                    f" (~{1e3 * r['saved'] / len(d) / rate:,.0f} ms of prefill saved)"
                )
        finally:
            proxy.stop()
            for e in engines:
                e.stop()


async def vllm_counters(url: str) -> dict[str, float]:
    """A vLLM server's prompt tokens by source, its TTFT sum / count, its running calls."""
    async with httpx.AsyncClient(timeout=30) as c:
        return counters((await c.get(f"{url}/metrics")).text)


async def run_vllm_mode(proxy_url: str, urls: list[str], handoff: bool, args) -> dict:
    """Per drain: its duration, the destination's computed / loaded prompt tokens for the
    moved calls and their mean time to first token there."""
    rows = []
    async with httpx.AsyncClient(base_url=proxy_url, timeout=600) as c:
        for i in range(args.drains):
            await c.post("/tidal/engines/s1/drain", headers=H)
            async with httpx.AsyncClient() as raw:
                await raw.post(f"{urls[1]}/reset_prefix_cache")  # nothing of earlier drains
            a0 = await vllm_counters(urls[0])
            calls = [
                asyncio.create_task(
                    c.post(
                        "/v1/completions",
                        headers={"X-Tidal-Execution": f"v{handoff}-{i}-{k}"},
                        json={
                            "model": "smollm2",
                            "prompt": [
                                (k * 7 + j * 13 + i * 101 + 17 * handoff) % 30000 + 100
                                for j in range(args.prompt_tokens)
                            ],
                            "max_tokens": 32,
                            "ignore_eos": True,
                            "temperature": 0,
                        },
                    )
                )
                for k in range(args.concurrency)
            ]
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline:  # every call decoding at s0, a few tokens each
                a = await vllm_counters(urls[0])
                if (
                    a.get("num_requests_running") == args.concurrency
                    and a["generation_tokens_total"] - a0["generation_tokens_total"]
                    >= 3 * args.concurrency
                ):
                    break
                await asyncio.sleep(0.05)
            await c.post("/tidal/engines/s1/undrain", headers=H)
            b0 = await vllm_counters(urls[1])
            r = (
                await c.post("/tidal/engines/s0/drain", headers=H, params={"handoff": handoff})
            ).json()
            for resp in await asyncio.gather(*calls):
                assert resp.status_code == 200, resp.text
            await c.post("/tidal/engines/s0/undrain", headers=H)
            b1 = await vllm_counters(urls[1])
            n = b1["time_to_first_token_seconds_count"] - b0["time_to_first_token_seconds_count"]
            rows.append(
                {
                    "drain_s": r["duration_s"],
                    "moved": r["moved"],
                    "computed": b1["local_compute"] - b0["local_compute"],
                    "loaded": b1["external_kv_transfer"] - b0["external_kv_transfer"],
                    "ttft_s": (
                        b1["time_to_first_token_seconds_sum"]
                        - b0["time_to_first_token_seconds_sum"]
                    )
                    / max(n, 1),
                }
            )
        stats = (await c.get("/tidal/stats", headers=H)).json()
    return {"rows": rows, "failures": stats["kv_handoff_failures"]}


async def main_vllm(args: argparse.Namespace) -> None:
    from tidal.models import fetch

    python = os.environ.get("TIDAL_VLLM_PYTHON")
    if not python:
        raise SystemExit("--backend vllm: set TIDAL_VLLM_PYTHON to the vLLM venv's python")
    model = str(fetch("smollm2-135m"))
    with tempfile.TemporaryDirectory() as tmp:
        logs = args.log_dir or Path(tmp)
        kv_dir = f"/dev/shm/tidal-kv-bench-{os.getpid()}"
        servers = []
        proxy = None
        try:
            servers = [
                spawn_vllm(python, model, logs / f"vllm{i}.log", kv_dir, kv_cache_gb=2)
                for i in range(2)
            ]
            urls = [s.wait_healthy().url for s in servers]
            proxy = start_proxy([], [], TOKEN, log_path=logs / "proxy.log").wait_healthy(60)
            async with httpx.AsyncClient(base_url=proxy.url, timeout=60) as c:
                for i, u in enumerate(urls):
                    r = await c.post(
                        "/tidal/engines",
                        headers=H,
                        json={"id": f"s{i}", "url": u, "backend": "vllm", "kind": "cell"},
                    )
                    assert r.status_code == 200, r.text
            for handoff in (False, True):
                r = await run_vllm_mode(proxy.url, urls, handoff, args)
                rows = r["rows"]
                moved = sum(x["moved"] for x in rows)
                reprefill = sum(x["computed"] for x in rows) - moved  # newest token: new work
                print(
                    f"vLLM kv_handoff={handoff!s:5}: drain p50 "
                    f"{1e3 * statistics.median(x['drain_s'] for x in rows):7.1f} ms over "
                    f"{len(rows)} drains, {moved / len(rows):.1f} calls moved per drain; "
                    f"re-prefilled {reprefill / len(rows):,.0f} tokens/drain, loaded "
                    f"{sum(x['loaded'] for x in rows) / len(rows):,.0f} tokens/drain "
                    f"(destination's counters); destination TTFT mean "
                    f"{1e3 * statistics.mean(x['ttft_s'] for x in rows):,.0f} ms; "
                    f"handoff failures {r['failures']}"
                )
        finally:
            if proxy is not None:
                proxy.stop()
            for server in servers:
                server.stop()
            import shutil

            shutil.rmtree(kv_dir, ignore_errors=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drains", type=int, default=10)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--log-dir", type=Path, default=None)
    ap.add_argument("--backend", choices=["builtin", "vllm"], default="builtin")
    ns = ap.parse_args()
    asyncio.run(main_vllm(ns) if ns.backend == "vllm" else main(ns))
