"""An engine SIGKILLed under load: 60 concurrent long calls (half streamed) over two built-in
engine processes behind ``tidal proxy``, one engine killed mid-flight. Every call answers 200
with its full token budget: the 30-odd calls that lose their engine continue on the survivor
(streamed tokens kept, re-prefill counted) after waiting their turn in the fair queue, which
the survivor's capacity empties one call after another. Then the dead engine's address comes
back (re-admitted by the health monitor), and with no engine left ``/health`` answers 503."""

from __future__ import annotations

import asyncio
import json
import time

import httpx

from tidal.serving.launch import start_engine, start_proxy

TOKEN = "kill-test-token"
CALLS, BUDGET, CAP = 60, 160, 20


async def _call(client, i: int) -> tuple[int, int, str | None]:
    """(status, tokens, finish reason) of one completion; odd calls stream."""
    body = {
        "prompt": [3 + i % 50, 4, 5, 6],
        "max_tokens": BUDGET,
        "ignore_eos": True,
        "stream": bool(i % 2),
    }
    headers = {"X-Tidal-Execution": f"x{i}"}
    if not body["stream"]:
        r = await client.post("/v1/completions", json=body, headers=headers)
        if r.status_code != 200:
            return r.status_code, 0, r.text[:200]
        choice = r.json()["choices"][0]
        return 200, len(choice["token_ids"]), choice["finish_reason"]
    tokens, reason = 0, None
    async with client.stream("POST", "/v1/completions", json=body, headers=headers) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return 200, tokens, f"error event: {event['error']}"
            tokens += len(event["choices"][0]["token_ids"])
            reason = event["choices"][0]["finish_reason"] or reason
        return r.status_code, tokens, reason


async def _kill_when_busy(victim, client, admin) -> dict:
    """SIGKILL ``victim`` once it holds calls and has streamed part of them."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        engines = (await client.get("/tidal/engines", headers=admin)).json()["engines"]
        stats = httpx.get(f"{victim.url}/stats", headers=admin, timeout=5).json()
        mine = next(e for e in engines if e["url"] == victim.url)
        if mine["inflight"] >= CAP // 2 and stats["generated_tokens"] >= CAP * BUDGET // 4:
            await asyncio.to_thread(victim.kill)
            return {
                "inflight_at_kill": mine["inflight"],
                "victim_tokens_at_kill": stats["generated_tokens"],
            }
        await asyncio.sleep(0.05)
    raise AssertionError("the victim never got busy")


def test_a_killed_engine_fails_no_call(tiny_model, tmp_path):
    admin = {"Authorization": f"Bearer {TOKEN}"}
    engines = [
        start_engine(tiny_model, max_batch=CAP, log_path=tmp_path / f"e{i}.log", token=TOKEN)
        for i in range(2)
    ]
    proxy = None
    try:
        for e in engines:
            e.wait_healthy(120)
        proxy = start_proxy(
            [e.url for e in engines],
            [],
            TOKEN,
            cap=CAP,
            request_timeout_s=120,
            log_path=tmp_path / "proxy.log",
        ).wait_healthy(60)

        async def main():
            limits = httpx.Limits(max_connections=CALLS + 8)
            async with httpx.AsyncClient(
                base_url=proxy.url, timeout=180, headers=admin, limits=limits
            ) as client:
                t0 = time.monotonic()
                calls = [asyncio.create_task(_call(client, i)) for i in range(CALLS)]
                kill = await _kill_when_busy(engines[0], client, admin)
                results = await asyncio.gather(*calls)
                took = time.monotonic() - t0
                stats = (await client.get("/tidal/stats", headers=admin)).json()
                records = [
                    (await client.get(f"/tidal/executions/x{i}/records", headers=admin)).json()[
                        "calls"
                    ][0]["segments"]
                    for i in range(CALLS)
                ]
                return results, kill, stats, took, records

        results, kill, stats, took, records = asyncio.run(main())
        # streamed calls cut by the kill continue where they were: the survivor adds the rest
        continued = [s for s in records if len(s) > 1 and len(s[0]["token_ids"]) > 0]
        ok = [r for r in results if r == (200, BUDGET, "length")]
        print(
            f"\nengine kill: {len(ok)}/{CALLS} answered 200 with {BUDGET} tokens in "
            f"{took:.1f} s; killed with {kill['inflight_at_kill']} calls in flight "
            f"({kill['victim_tokens_at_kill']} tokens generated there); retries "
            f"{stats['retries']}, engine failures {stats['engine_failures']}, re-prefilled "
            f"tokens {stats['reprefill_tokens']}, admitted after a wait "
            f"{stats['admitted_after_wait']} (longest {stats['queue_max_wait_s']} s), "
            f"failed calls {stats['failed_calls']}, streamed calls continued "
            f"{len(continued)}"
        )
        assert len(ok) == CALLS, [r for r in results if r not in ok][:5]
        assert stats["engine_failures"] == 1 and stats["failed_calls"] == 0
        assert stats["retries"] >= CAP // 2 and stats["reprefill_tokens"] > 0
        assert stats["admitted_after_wait"] >= CALLS - 2 * CAP
        assert continued and all(sum(len(x["token_ids"]) for x in s) == BUDGET for s in continued)

        # the dead engine's address answers again: re-admitted without an admin call
        engines[0] = start_engine(
            tiny_model,
            port=engines[0].port,
            max_batch=CAP,
            log_path=tmp_path / "e0-again.log",
            token=TOKEN,
        )
        engines[0].wait_healthy(120)
        _until(
            lambda: (
                httpx.get(f"{proxy.url}/tidal/stats", headers=admin).json()["readmitted_engines"]
                == 1
            ),
            30,
        )
        assert httpx.get(f"{proxy.url}/health").json()["engines"] == 2
        for e in engines:  # no call in flight: the monitor alone notices
            e.kill()
        _until(lambda: httpx.get(f"{proxy.url}/health").status_code == 503, 30)
    finally:
        if proxy is not None:
            proxy.stop()
        for e in engines:
            e.stop()


def _until(cond, timeout_s: float) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, "condition not met in time"
        time.sleep(0.2)
