"""Proxy throughput against its number of processes (``runtime.proxy_processes``), in front of
emulated engines (a test double at scale: ``tidal emulate``, no model runs).

One ``tidal emulate`` process serves a scenario's engines (default ``dapo-math-32gpu``'s four,
time scale ``--k`` large so the engines answer in about a millisecond: the proxy, not the
engines, is what is measured). For each process count (``--processes``, default 1 2 4):
``proxy_set.start_proxies`` starts that many ``tidal proxy`` processes, the engines join all of
them through ``FanOut`` (each engine's cap split), and ``--concurrency`` executions (ids
partitioned between the processes, each calling its own process, as a run's harness pool does)
send short completions back to back for ``--seconds``. A direct phase (the same calls straight
to the engines) gives the latency the proxy adds. Per process count it prints calls/s,
tokens/s, end-to-end p50/p99, added p50/p99 (via proxy minus direct), in-proxy p50/p99 (each
proxy handler's own time; the highest of the processes), and CPU ms per call of the proxies (all
together), the engines' process and the load generator, from ``/proc``.

On a machine with C cores, N proxy processes cannot raise throughput beyond what C cores shared
with the engines and the load generator give: the CPU per call is the figure that extrapolates
(calls/s one proxy core carries = 1000 / proxy CPU ms per call).

    .venv/bin/python benchmarks/proxy_scale.py                       # 1 2 4 processes, 20 s each
    .venv/bin/python benchmarks/proxy_scale.py --open 10240 --processes 1 2   # the registry bound
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from pathlib import Path

import httpx

from tidal.serving.emulated_farm import start_farm
from tidal.serving.http11 import HTTPFailure, HTTPPool
from tidal.serving.proxy_set import owner, start_proxies

TOKEN = "bench"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")
PROMPT = [0]  # prompt token ids beyond the 4 of every call (--prompt-tokens)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def cpu_s(pid: int) -> float:
    """user + system CPU seconds of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * TICK_S


async def load(
    urls: list[str], concurrency: int, seconds: float, max_tokens: int, tag: str, by_owner: bool
) -> tuple[list[float], int]:
    """Closed loop for ``seconds``: latencies of the calls and the tokens they got back.
    ``by_owner``: execution ``i`` calls ``urls[owner(id, len(urls))]`` (its proxy process);
    else the URLs round-robin (engines called directly)."""
    pools = [
        HTTPPool(u, ADMIN, max_idle=concurrency, timeout_s=120, connect_timeout_s=60) for u in urls
    ]
    lat: list[float] = []
    tokens = [0]
    failed: list[str] = []
    end = time.perf_counter() + seconds

    async def one(i: int) -> None:
        eid = f"{tag}{i}"
        pool = pools[owner(eid, len(urls)) if by_owner else i % len(urls)]
        k = 0
        while time.perf_counter() < end:
            body = {
                "prompt": [1 + i % 300, 2, 3, 4 + k, *range(5, 5 + PROMPT[0])],
                "ignore_eos": True,
                "max_tokens": max_tokens,
            }
            t0 = time.perf_counter()
            try:
                r = await pool.request(
                    "POST", "/v1/completions", json_body=body, headers={"X-Tidal-Execution": eid}
                )
            except HTTPFailure as exc:  # counted and printed: a ceiling, not a crash
                failed.append(str(exc))
                continue
            finally:
                k += 1
            if r.status_code != 200:
                failed.append(f"{r.status_code} {r.text[:100]}")
                continue
            lat.append(time.perf_counter() - t0)
            tokens[0] += r.json()["usage"]["completion_tokens"]

    try:
        await asyncio.gather(*[one(i) for i in range(concurrency)])
    finally:
        for p in pools:
            await p.close()
    if failed:
        print(f"  {tag}: {len(failed)} calls failed, e.g. {failed[0]}", flush=True)
    return lat, tokens[0]


async def measure(urls, pids, args, tag, by_owner):
    before = {k: cpu_s(p) for k, p in pids.items()}
    c0, t0 = time.process_time(), time.perf_counter()
    lat, tokens = await load(urls, args.concurrency, args.seconds, args.max_tokens, tag, by_owner)
    wall = time.perf_counter() - t0
    n = max(1, len(lat))
    cpu = {k: 1e3 * (cpu_s(p) - before[k]) / n for k, p in pids.items()}
    cpu["client"] = 1e3 * (time.process_time() - c0) / n
    return lat, tokens, wall, cpu


async def run_level(processes: int, farm, args, direct) -> None:
    proxies = start_proxies(processes, TOKEN, engine_token=TOKEN, request_timeout_s=120)
    try:
        proxies.wait_healthy(60)
        async with httpx.AsyncClient(
            base_url=proxies.url, headers=ADMIN, timeout=60, transport=proxies.transport()
        ) as admin:
            for name, url in farm.urls.items():
                kind = "cell" if name.startswith("c") else "standalone"
                body = {"id": name, "url": url, "backend": "emulated", "kind": kind}
                r = await admin.post("/tidal/engines", json={**body, "cap": args.cap})
                assert r.status_code == 200, r.text
            await load(proxies.urls, 32, 1.0, args.max_tokens, "warm", True)
            await admin.get("/tidal/stats", params={"reset_overhead": True})
            pids = {f"proxy{i}": p.pid for i, p in enumerate(proxies.procs)}
            pids["engines"] = farm.proc.pid
            lat, tokens, wall, cpu = await measure(proxies.urls, pids, args, f"p{processes}-", True)
            over = (await admin.get("/tidal/stats")).json()
        d_lat = direct[0]
        proxy_cpu = sum(v for k, v in cpu.items() if k.startswith("proxy"))
        per = " ".join(f"{cpu[f'proxy{i}']:.2f}" for i in range(processes))
        o = over["overhead"]
        print(
            f"{processes:>9} {len(lat) / wall:>8.0f} {tokens / wall:>9.0f}"
            f" {1e3 * pct(lat, 0.5):>7.1f} / {1e3 * pct(lat, 0.99):<7.1f}"
            f" {1e3 * (pct(lat, 0.5) - pct(d_lat, 0.5)):>7.1f} / "
            f"{1e3 * (pct(lat, 0.99) - pct(d_lat, 0.99)):<7.1f}"
            f" {o.get('p50_ms', float('nan')):>6.3f} / {o.get('p99_ms', float('nan')):<6.3f}"
            f" {proxy_cpu:>6.3f} ({per})  {cpu['engines']:.3f}  {cpu['client']:.3f}"
            f"   failed {over['failed_calls']}, {len(lat)} calls",
            flush=True,
        )
    finally:
        proxies.stop()


async def open_executions(args: argparse.Namespace) -> None:
    """``--open N``: N executions registered at once (each at its owner process) and held
    open, against 1 process with the former fixed bound (10,000), then each of
    ``--processes`` with the bound ``tidal run`` now sets (the run's slots): refused
    registrations, registrations/s, and each process's resident memory per 1,000 open."""
    print(
        f"open executions: {args.open} registered at once and held open (no engine needed); "
        f"{time.strftime('%Y-%m-%d %H:%M')} UTC, load average {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    for processes, bound in [(1, 10_000)] + [(n, max(10_000, args.open)) for n in args.processes]:
        proxies = start_proxies(processes, TOKEN, max_open_executions=bound)
        try:
            proxies.wait_healthy(60)
            rss0 = [_rss_mb(p.pid) for p in proxies.procs]
            cpu0 = sum(cpu_s(p.pid) for p in proxies.procs)
            limits = httpx.Limits(max_connections=64)
            async with httpx.AsyncClient(
                base_url=proxies.url,
                headers=ADMIN,
                timeout=120,
                limits=limits,
                transport=proxies.transport(),
            ) as admin:

                async def register(i: int, sem: asyncio.Semaphore) -> int:
                    async with sem:
                        body = {"execution_id": f"o{i}", "group_id": f"g{i // 16}"}
                        return (await admin.post("/tidal/executions", json=body)).status_code

                t0 = time.perf_counter()
                sem = asyncio.Semaphore(64)
                codes = await asyncio.gather(*[register(i, sem) for i in range(args.open)])
                wall = time.perf_counter() - t0
                stats = (await admin.get("/tidal/stats")).json()
            grown = [_rss_mb(p.pid) - r for p, r in zip(proxies.procs, rss0, strict=True)]
            cpu = sum(cpu_s(p.pid) for p in proxies.procs) - cpu0
            per_k = 1e3 * sum(grown) / max(1, stats["open_executions"])
            print(
                f"  {processes} process(es), bound {bound:,} each: {stats['open_executions']:,} "
                f"open, {sum(c != 200 for c in codes):,} refused "
                f"({sorted({c for c in codes if c != 200})}), {len(codes) / wall:.0f} "
                f"registrations/s, proxy CPU {1e3 * cpu / len(codes):.2f} ms per registration, "
                f"proxy memory {per_k:.2f} MB per 1,000 open",
                flush=True,
            )
        finally:
            proxies.stop()


def _rss_mb(pid: int) -> float:
    pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 1e6


async def main(args: argparse.Namespace) -> None:
    if args.open:
        await open_executions(args)
        return
    print(
        f"EMULATED ENGINES (a test double at scale: no model runs): scenario {args.scenario}, "
        f"time scale k={args.k:g}; proxy throughput against its process count",
        flush=True,
    )
    farm = start_farm(args.scenario, args.k, token=TOKEN, timeout_s=120)
    try:
        engines = list(farm.urls.values())
        print(
            f"cores: {os.cpu_count()} (N proxy processes share them with the engines' process "
            f"and this load generator: on 2 cores throughput cannot exceed 2x one process's); "
            f"load average at start {os.getloadavg()[0]:.1f}; {len(engines)} engines, cap "
            f"{args.cap} each; {args.concurrency} concurrent executions, prompt "
            f"{4 + args.prompt_tokens} tokens, max_tokens {args.max_tokens}, "
            f"{args.seconds:g} s per level; {time.strftime('%Y-%m-%d %H:%M')}"
            " UTC",
            flush=True,
        )
        await load(engines, 32, 1.0, args.max_tokens, "warm", False)
        pids = {"engines": farm.proc.pid}
        direct = await measure(engines, pids, args, "d-", False)
        lat, tokens, wall, cpu = direct
        print(
            f"direct to the engines: {len(lat) / wall:.0f} calls/s, p50 / p99 "
            f"{1e3 * pct(lat, 0.5):.1f} / {1e3 * pct(lat, 0.99):.1f} ms, CPU ms/call engines "
            f"{cpu['engines']:.3f}, client {cpu['client']:.3f}",
            flush=True,
        )
        print(
            f"{'processes':>9} {'calls/s':>8} {'tokens/s':>9} {'e2e p50/p99 ms':>17}"
            f" {'added p50/p99 ms':>17} {'in-proxy p50/p99':>16}"
            "  CPU ms/call: proxies (each), engines, client"
        )
        for n in args.processes:
            await run_level(n, farm, args, direct)
        print(f"load average at end {os.getloadavg()[0]:.1f}", flush=True)
    finally:
        farm.stop()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--processes", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--scenario", default="dapo-math-32gpu")
    ap.add_argument("--k", type=float, default=2000.0, help="emulated durations divided by k")
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--cap", type=int, default=128, help="each engine's cap at the proxy")
    ap.add_argument("--prompt-tokens", type=int, default=0, help="prompt ids beyond 4 a call")
    ap.add_argument(
        "--open", type=int, default=0, help="instead: register this many executions at once"
    )
    parsed = ap.parse_args()
    PROMPT[0] = parsed.prompt_tokens
    asyncio.run(main(parsed))
