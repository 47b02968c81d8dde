"""Latency the proxy adds over calling an engine directly, at 1 / 64 / 256 / 1024 concurrent
executions, and where that time goes.

Starts one built-in engine process (tiny GPT, batch wide enough for every call) and a
``tidal proxy`` process in front of it. Each concurrent execution sends short completions
(``--max-tokens``, token-id prompts, non-streamed) back to back, ``--calls`` per phase. Direct
and proxied phases alternate (``--rounds`` of each per level) so both see the same machine
load; the load generator is the project's lean HTTP/1.1 client (``tidal.serving.http11``),
the same for both. Per level it prints:
- direct / via-proxy p50 / p99 and the difference (what a harness sees the proxy add);
- in-proxy p50 / p99: the proxy handler's own time per call (parse, route, record, serialise;
  upstream streaming and admission waits excluded), from ``/tidal/stats``;
- CPU per call (ms) of the proxy process, the engine process and the client, read from
  ``/proc``: on a machine whose cores are saturated the added latency is mostly the proxy's
  CPU per call times the calls queued ahead (``concurrency x proxy CPU / cores``), not the
  in-proxy time of one call.

    .venv/bin/python benchmarks/proxy_overhead.py                # levels 1 64 256 1024
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from pathlib import Path

from tidal.models import create_tiny
from tidal.serving.http11 import HTTPPool
from tidal.serving.launch import start_engine, start_proxy

TOKEN = "bench"
TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def cpu_s(pid: int) -> float:
    """user + system CPU seconds of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * TICK_S


async def load(
    url: str, concurrency: int, calls_per_exec: int, max_tokens: int, tag: str
) -> list[float]:
    lat: list[float] = []
    # the engine takes calls with the run's token only; the proxy takes it as its admin
    # token, which may name any execution (as the driver's own harness pool does)
    pool = HTTPPool(
        url,
        {"Authorization": f"Bearer {TOKEN}"},
        max_idle=concurrency,
        timeout_s=600,
        connect_timeout_s=120,
    )

    async def one(i: int) -> None:
        for k in range(calls_per_exec):
            body = {
                "prompt": [1 + i % 300, 2, 3, 4 + k],
                "ignore_eos": True,
                "max_tokens": max_tokens,
            }
            t0 = time.perf_counter()
            r = await pool.request(
                "POST",
                "/v1/completions",
                json_body=body,
                headers={"X-Tidal-Execution": f"{tag}{i}"},
            )
            lat.append(time.perf_counter() - t0)
            assert r.status_code == 200, r.text

    try:
        await asyncio.gather(*[one(i) for i in range(concurrency)])
    finally:
        await pool.close()
    return lat


async def phase(
    url: str, level: int, args, tag: str, pids: dict[str, int]
) -> tuple[list[float], dict[str, float]]:
    before = {k: cpu_s(p) for k, p in pids.items()}
    c0 = time.process_time()
    calls = max(args.calls, -(-args.min_samples // level))  # enough samples at low levels
    lat = await load(url, level, calls, args.max_tokens, tag)
    n = len(lat)
    cpu = {k: 1e3 * (cpu_s(p) - before[k]) / n for k, p in pids.items()}
    cpu["client"] = 1e3 * (time.process_time() - c0) / n
    return lat, cpu


async def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        model = create_tiny(Path(tmp) / "m", max_seq_len=256)
        top = max(args.levels)
        engine = start_engine(model, max_batch=top, token=TOKEN).wait_healthy(120)
        proxy = start_proxy([engine.url], [], TOKEN, cap=top).wait_healthy(60)
        admin = {"Authorization": f"Bearer {TOKEN}"}
        pids = {"proxy": proxy.proc.pid, "engine": engine.proc.pid}
        stats_pool = HTTPPool(proxy.url)
        try:
            await load(engine.url, 16, 2, args.max_tokens, "warm")
            await load(proxy.url, 16, 2, args.max_tokens, "warm")
            print(
                f"cores: {os.cpu_count()}, load average at start: "
                f"{os.getloadavg()[0]:.1f}; per level and path {args.rounds} rounds of at "
                f"least {args.calls} calls per execution and {args.min_samples} calls; "
                f"max_tokens {args.max_tokens}"
            )
            print(
                f"{'concurrent':>10} {'direct p50/p99 ms':>19} {'proxy p50/p99 ms':>19}"
                f" {'added p50/p99 ms':>19} {'in-proxy p50/p99 ms':>21}"
                f"   CPU ms/call: proxy, engine (direct/via), client (direct/via)"
            )
            for level in args.levels:
                direct: list[float] = []
                via: list[float] = []
                cpu_d: list[dict] = []
                cpu_v: list[dict] = []
                await stats_pool.request(
                    "GET", "/tidal/stats", headers=admin, params={"reset_overhead": True}
                )
                for r in range(args.rounds):
                    lat, cpu = await phase(engine.url, level, args, f"d{level}-{r}-", pids)
                    direct += lat
                    cpu_d.append(cpu)
                    lat, cpu = await phase(proxy.url, level, args, f"p{level}-{r}-", pids)
                    via += lat
                    cpu_v.append(cpu)
                stats = (await stats_pool.request("GET", "/tidal/stats", headers=admin)).json()[
                    "overhead"
                ]
                d50, d99 = 1e3 * pct(direct, 0.5), 1e3 * pct(direct, 0.99)
                p50, p99 = 1e3 * pct(via, 0.5), 1e3 * pct(via, 0.99)

                def mean(rows: list[dict], key: str) -> float:
                    return sum(r[key] for r in rows) / len(rows)

                print(
                    f"{level:>10} {d50:>8.1f} / {d99:<8.1f} {p50:>8.1f} / {p99:<8.1f}"
                    f" {p50 - d50:>8.1f} / {p99 - d99:<8.1f}"
                    f" {stats['p50_ms']:>9.3f} / {stats['p99_ms']:<9.3f}"
                    f"   {mean(cpu_v, 'proxy'):.2f}, {mean(cpu_d, 'engine'):.2f}"
                    f"/{mean(cpu_v, 'engine'):.2f}, {mean(cpu_d, 'client'):.2f}"
                    f"/{mean(cpu_v, 'client'):.2f}  ({stats['n']} proxied calls)"
                )
            print(f"load average at end: {os.getloadavg()[0]:.1f}")
        finally:
            await stats_pool.close()
            proxy.stop()
            engine.stop()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 64, 256, 1024])
    ap.add_argument("--calls", type=int, default=3, help="calls per execution per phase")
    ap.add_argument("--rounds", type=int, default=2, help="direct/proxy phase pairs per level")
    ap.add_argument(
        "--min-samples",
        type=int,
        default=150,
        help="calls per phase at least (more calls per execution at low levels)",
    )
    ap.add_argument("--max-tokens", type=int, default=4)
    asyncio.run(main(ap.parse_args()))
