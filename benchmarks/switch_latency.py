"""One cell's role switch, step by step, on the built-in engine and on vLLM, side by side.

Starts a ``tidal proxy``, a built-in engine that takes the moved calls (``dest``), and one cell
host per backend (``EngineHost``: the built-in engine; ``VLLMCellHost``: a vLLM server, from
``$TIDAL_VLLM_PYTHON``), all serving SmolLM2 as in ``configs/vllm.yaml``. Per backend, while
``--calls`` generations run on the cell: rollout -> training (drain: the proxy stops admission,
aborts the cell's calls and continues each on ``dest`` with prompt + tokens so far; free: the
engine's memory released), then training -> rollout (wake, load: a new published version in
place, read back; rejoin: the proxy admits the cell again and a call is served there). The
trainer's own steps (restore, offload) have nothing to move on a CPU host, where the core never
leaves host memory: they print as ``-``. Every moved call must end as one normal answer.

    TIDAL_VLLM_PYTHON=$PWD/vllm-venv/bin/python .venv/bin/python benchmarks/switch_latency.py
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

TOKEN = "switch-bench"
H = {"Authorization": f"Bearer {TOKEN}"}
STEPS = ("drain", "free", "restore", "offload", "wake", "load", "rejoin")


async def _wait_inflight(c: httpx.AsyncClient, eid: str, n: int, timeout_s: float) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        engines = (await c.get("/tidal/engines", headers=H)).json()["engines"]
        if next(e for e in engines if e["id"] == eid)["inflight"] >= n:
            return
        await asyncio.sleep(0.2)
    raise TimeoutError(f"{eid}: {n} calls not in flight within {timeout_s} s")


async def switch(
    c: httpx.AsyncClient,
    host: Any,
    backend: str,
    url: str,
    weights: str,
    calls: int,
    max_tokens: int,
) -> dict[str, Any]:
    """One full switch of the cell ``host`` (serving at ``url``) with ``calls`` live calls."""
    r = await c.post(
        "/tidal/engines",
        headers=H,
        json={"id": "cell", "url": url, "backend": backend, "kind": "cell", "cap": calls},
    )
    r.raise_for_status()
    await c.post("/tidal/engines/dest/drain", headers=H)  # the calls start on the cell
    stats0 = (await c.get("/tidal/stats", headers=H)).json()
    live = [
        asyncio.create_task(
            c.post(
                "/v1/completions",
                json={
                    "prompt": f"Count from {k} to {k + 50}:",
                    "max_tokens": max_tokens,
                    "ignore_eos": True,
                    "temperature": 1.0,
                },
            )
        )
        for k in range(calls)
    ]
    await _wait_inflight(c, "cell", calls, 120)
    await asyncio.sleep(3.0)  # every call is decoding
    await c.post("/tidal/engines/dest/undrain", headers=H)
    t: dict[str, Any] = {}
    t0 = time.perf_counter()
    (
        await c.post("/tidal/engines/cell/drain", headers=H, params={"handoff": "false"})
    ).raise_for_status()
    t["drain"] = time.perf_counter() - t0
    rss0 = engine_rss_mb(host)
    for step, call in (
        ("free", host.sleep),
        ("wake", host.wake),
        ("load", lambda: host.load_weights(weights, "v1")),
    ):
        t0 = time.perf_counter()
        await asyncio.to_thread(call)
        t[step] = time.perf_counter() - t0
        if step == "free":
            t["rss_freed_mb"] = rss0 - engine_rss_mb(host)
    answers = [(await x) for x in live]  # every moved call ends at dest, as one answer
    bad = [
        a.text[:200]
        for a in answers
        if a.status_code != 200 or a.json()["choices"][0]["finish_reason"] not in ("length", "stop")
    ]
    if bad:
        raise RuntimeError(f"{backend}: {len(bad)} moved calls did not end normally: {bad[0]}")
    stats = (await c.get("/tidal/stats", headers=H)).json()
    t["moved"] = stats["retries"] - stats0["retries"]
    t["reprefill_tokens"] = stats["reprefill_tokens"] - stats0["reprefill_tokens"]
    await c.post("/tidal/engines/dest/drain", headers=H)  # the next call must go to the cell
    t0 = time.perf_counter()
    await c.post("/tidal/engines/cell/undrain", headers=H)
    (await c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})).raise_for_status()
    t["rejoin"] = time.perf_counter() - t0  # admitted again, and its first call served
    await c.post("/tidal/engines/dest/undrain", headers=H)
    (await c.delete("/tidal/engines/cell", headers=H, params={"drain": "false"})).raise_for_status()
    return t


def engine_rss_mb(host: Any) -> float:
    """Resident MB of the cell's engine: the vLLM server's processes, or the built-in
    engine's process."""
    if hasattr(host, "rss_bytes"):
        return host.rss_bytes() / 2**20
    for line in Path(f"/proc/{host.proc.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _row(name: str, cols: list[Any]) -> str:
    cells = [("-" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)) for v in cols]
    return f"{name:<18}" + "".join(f"{x:>12}" for x in cells)


async def main_async(args: argparse.Namespace) -> int:
    import torch

    from tidal.models import fetch, load_model
    from tidal.runtime.cell import EngineHost
    from tidal.runtime.vllm_cell import VLLMCellHost
    from tidal.serving.launch import start_engine, start_proxy
    from tidal.training.flat import ParamLayout
    from tidal.training.transport import FilePublisher

    vllm_python = os.environ.get("TIDAL_VLLM_PYTHON")
    if not vllm_python:
        print("set TIDAL_VLLM_PYTHON to the vLLM venv's python (make vllm-venv)", file=sys.stderr)
        return 2
    os.environ["TIDAL_ENGINE_TOKEN"] = TOKEN
    work = Path(tempfile.mkdtemp(prefix="switch-latency-"))
    model_dir = str(fetch("smollm2-135m"))
    model, _ = load_model(model_dir)
    layout = ParamLayout.of(model)
    pub = FilePublisher(work / "w", layout)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1 + 0.01 * torch.randn_like(p))
    pub.publish(1, layout.params_to_flat(model))
    del model
    hosts = {
        "builtin": EngineHost("cell-builtin", model_dir, args.calls, str(work), served="tidal"),
        "vllm": VLLMCellHost(
            "cell-vllm",
            model_dir,
            args.calls,
            str(work),
            {"python": vllm_python, "kv_cache_gb": args.kv_cache_gb, "max_model_len": 1024},
        ),
    }
    proxy = start_proxy([], [], TOKEN, kv_handoff=False, log_path=work / "proxy.log")
    dest = start_engine(model_dir, name="tidal", log_path=work / "dest.log")
    results: dict[str, dict[str, Any]] = {}
    try:
        proxy.wait_healthy(60)
        dest.wait_healthy(300)
        async with httpx.AsyncClient(base_url=proxy.url, timeout=600) as c:
            (
                await c.post(
                    "/tidal/engines",
                    headers=H,
                    json={"id": "dest", "url": dest.url, "cap": 4 * args.calls},
                )
            ).raise_for_status()
            for backend, host in hosts.items():
                url = await asyncio.to_thread(host.start, 600)
                results[backend] = await switch(
                    c, host, backend, url, pub.path(1), args.calls, args.max_tokens
                )
                await asyncio.to_thread(host.stop)  # one server at a time in memory
    finally:
        for host in hosts.values():
            host.stop()
        dest.stop()
        proxy.stop()
    print(
        f"one cell's role switch, seconds per step ({args.calls} live calls moved, SmolLM2, "
        "CPU; restore/offload: the core trainer stays in host memory here)"
    )
    print(_row("step", list(results)))
    for step in STEPS:
        print(_row(step, [results[b].get(step) for b in results]))
    total = {b: sum(v for k, v in r.items() if k in STEPS) for b, r in results.items()}
    print(_row("total", list(total.values())))
    for key in ("rss_freed_mb", "moved", "reprefill_tokens"):
        print(_row(key, [results[b].get(key) for b in results]))
    print(f"logs: {work}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=4, help="live calls moved by the drain")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--kv-cache-gb", type=float, default=1.0, help="the vLLM engine's KV cache")
    return asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
