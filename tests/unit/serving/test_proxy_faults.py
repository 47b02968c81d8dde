"""The proxy against real built-in engines served in-process on loopback, with faults: a call
waits in a fair queue past any fixed admission bound, a 5xx or a failed step is retried a few
times (not 64), a call that fails is logged, an engine that stops answering leaves routing and
one that comes back on its address is re-admitted."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import pytest

from tidal.models import load_model
from tidal.serving.admission import AdmissionQueue
from tidal.serving.engine import Engine, EngineConfig
from tidal.serving.engine_server import build_engine_app
from tidal.serving.launch import free_port
from tidal.serving.protocol import EngineError, Overloaded, SamplingParams
from tidal.serving.proxy import Proxy, ProxyConfig

TOKEN = "t0k"


def _engine(tiny_dir, **cfg) -> Engine:
    model, tok = load_model(tiny_dir)
    return Engine(model, tok, tiny_dir, EngineConfig(**cfg))


def _proxy(**cfg) -> Proxy:
    return Proxy(ProxyConfig(admin_token=TOKEN, health_interval_s=0.1, **cfg))


def test_admission_is_first_come_first_served_and_bounded():
    async def main():
        q, free, order = AdmissionQueue(), [0], []

        def pick():
            if free[0]:
                free[0] -= 1
                return "slot"
            return None

        loop = asyncio.get_running_loop()

        async def call(i, timeout):
            try:
                await q.acquire(pick, loop.time() + timeout)
                order.append(i)
            except Overloaded:
                order.append(-i)

        tasks = []
        for i in range(1, 6):
            tasks.append(asyncio.create_task(call(i, 0.4 if i == 5 else 30)))
            await asyncio.sleep(0.01)
        for _ in range(4):
            free[0] += 1
            q.notify()
            await asyncio.sleep(0.05)
        await asyncio.gather(*tasks)
        return order, q.stats()

    order, stats = asyncio.run(main())
    assert order == [1, 2, 3, 4, -5]
    assert stats["admitted_after_wait"] == 4 and stats["queue_timeouts"] == 1


def test_calls_queue_past_a_busy_engine_within_their_own_timeout(tiny_dir, serve_asgi):
    """Twelve calls on one engine with room for two: ten wait in the queue for a slot (no
    admission bound of its own), and all finish in full."""

    async def main():
        eng = _engine(tiny_dir, max_batch=2)
        async with serve_asgi(build_engine_app(eng, "tiny", TOKEN)) as url:
            proxy = _proxy(request_timeout_s=60)
            await proxy.join("e0", url, cap=2)
            params = SamplingParams(max_tokens=24, ignore_eos=True)
            results = await asyncio.gather(
                *[proxy.complete(f"x{i}", [3, 4, i], params) for i in range(12)]
            )
            stats = proxy.stats()
            await proxy.close()
            return results, stats

    results, stats = asyncio.run(main())
    assert [len(r.token_ids) for r in results] == [24] * 12
    assert stats["admitted_after_wait"] >= 9 and stats["queued"] == 0
    assert stats["failed_calls"] == 0


def test_a_5xx_is_retried_a_bounded_few_times_and_the_failure_logged(tiny_dir, serve_asgi, caplog):
    async def main():
        eng = _engine(tiny_dir)
        seen = {"n": 0}

        async def broken(req, min_interval_s=0.0):  # a fault injected into the real engine
            seen["n"] += 1
            raise RuntimeError("engine bug")
            yield

        eng.generate = broken
        async with serve_asgi(build_engine_app(eng, "tiny", TOKEN)) as url:
            proxy = _proxy(error_backoff_s=0.05)
            await proxy.join("e0", url)
            t0 = time.monotonic()
            with pytest.raises(EngineError, match="failed it 4 times"):
                await proxy.complete("ex", [3, 4], SamplingParams(max_tokens=4))
            took = time.monotonic() - t0
            stats = proxy.stats()
            await proxy.close()
            return seen["n"], took, stats

    with caplog.at_level(logging.WARNING, logger="tidal.serving.proxy"):
        calls, took, stats = asyncio.run(main())
    assert calls == 4 and took < 5  # 1 + max_error_retries, with back-off
    assert stats["failed_calls"] == 1 and stats["engine_errors"] == 4
    assert stats["engine_failures"] == 0  # it answered: not declared down
    assert any("(execution ex) failed" in r.message for r in caplog.records)


def test_a_failed_step_is_counted_and_the_call_still_completes(tiny_dir, serve_asgi):
    async def main():
        eng = _engine(tiny_dir)
        real, calls = eng.model.forward_cached, {"n": 0}

        def flaky(pending, caches):
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("device fault")
            return real(pending, caches)

        eng.model.forward_cached = flaky
        async with serve_asgi(build_engine_app(eng, "tiny", TOKEN)) as url:
            proxy = _proxy()
            await proxy.join("e0", url)
            res = await proxy.complete("ex", [3, 4], SamplingParams(max_tokens=10, ignore_eos=True))
            stats = proxy.stats()
            await proxy.close()
            return res, stats, eng.totals

    res, stats, totals = asyncio.run(main())
    assert len(res.token_ids) == 10 and res.finish_reason == "length"
    assert stats["engine_step_failures"] == 1 == totals["step_failures"]


def test_a_silent_engine_leaves_and_comes_back_on_its_address(tiny_dir, serve_asgi):
    """No call in flight: the health monitor notices the engine gone (and /health's count of
    serving engines drops to 0), then re-admits it when it answers on the same port."""

    async def main():
        port = free_port()
        proxy = _proxy()
        seen = []
        async with serve_asgi(build_engine_app(_engine(tiny_dir), "tiny", TOKEN), port) as url:
            await proxy.join("e0", url)
            proxy.health.start()
            await asyncio.sleep(0.3)
            seen.append(proxy.serving())
        await _until(lambda: proxy.serving() == 0, 10)
        seen.append(sorted(proxy.health.lost))
        async with serve_asgi(build_engine_app(_engine(tiny_dir), "tiny", TOKEN), port):
            await _until(lambda: proxy.serving() == 1, 10)
            res = await proxy.complete(None, [3, 4], SamplingParams(max_tokens=3))
            seen.append(len(res.token_ids))
            stats = proxy.stats()
        await proxy.close()
        return seen, stats

    seen, stats = asyncio.run(main())
    assert seen == [1, ["e0"], 3]
    assert stats["engine_failures"] == 1 and stats["readmitted_engines"] == 1
    assert stats["lost_engines"] == []


def test_a_wrong_engine_token_is_refused_at_join(tiny_dir, serve_asgi):
    async def main():
        async with serve_asgi(build_engine_app(_engine(tiny_dir), "tiny", "other")) as url:
            proxy = _proxy()
            with contextlib.suppress(Exception):
                await proxy.join("e0", url)
            n = len(proxy.router.members)
            await proxy.close()
            return n

    assert asyncio.run(main()) == 0


async def _until(cond, timeout_s: float) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, "condition not met in time"
        await asyncio.sleep(0.05)


def test_a_caller_hanging_up_on_the_proxy_aborts_the_engine_request(tiny_dir, serve_asgi):
    import httpx

    from tidal.serving.proxy_app import build_proxy_app

    async def main():
        eng = _engine(tiny_dir, step_in_thread=True)
        async with serve_asgi(build_engine_app(eng, "tiny", TOKEN)) as engine_url:
            proxy = _proxy()
            await proxy.join("e0", engine_url)
            async with serve_asgi(build_proxy_app(proxy)) as url:
                async with httpx.AsyncClient(base_url=url, timeout=30) as c:
                    call = asyncio.ensure_future(
                        c.post(
                            "/v1/completions",
                            json={"prompt": [3, 4], "max_tokens": 500, "ignore_eos": True},
                        )
                    )
                    await _until(lambda: eng.stats()["generated_tokens"] or call.done(), 10)
                    call.cancel()  # the caller hangs up mid-generation
                    with contextlib.suppress(asyncio.CancelledError):
                        await call
                t_gone = time.monotonic()
                await _until(
                    lambda: not eng.stats()["running"] and not proxy.stats()["inflight"], 10
                )
                took = time.monotonic() - t_gone
            return eng.stats(), took

    stats, took = asyncio.run(main())
    assert stats["aborted"] == 1 and stats["generated_tokens"] < 500 and took < 8


def test_a_drained_engine_is_its_owners_and_comes_back_drained(tiny_dir, serve_asgi):
    """The monitor leaves a drained member alone (the runtime puts it to sleep, which may hold
    its loop); one lost while drained is re-admitted drained, never routed to while asleep."""

    async def main():
        port, proxy, seen = free_port(), _proxy(), []
        async with serve_asgi(build_engine_app(_engine(tiny_dir), "tiny", TOKEN), port) as url:
            await proxy.join("e0", url)
            proxy.health.start()
            await proxy.drain("e0")
        await asyncio.sleep(0.8)  # gone for 8 sweeps
        seen.append(("e0" in proxy.router.members, proxy.health.lost == {}))
        proxy.health.mark_down(proxy.router.members["e0"], "a failed call")
        async with serve_asgi(build_engine_app(_engine(tiny_dir), "tiny", TOKEN), port):
            await _until(lambda: "e0" in proxy.router.members, 10)
            seen.append((proxy.router.members["e0"].admitting, proxy.serving()))
        await proxy.close()
        return seen

    assert asyncio.run(main()) == [(True, True), (False, 0)]


def test_tokenizing_waits_for_an_engine_to_join(tiny_dir, serve_asgi):
    """Every engine lost (e.g. all replaced at once): a text call waits for one to join, within
    its timeout, instead of failing at once."""

    async def main():
        proxy = _proxy()
        with pytest.raises(Overloaded, match="tokenize"):
            await proxy.tokenize(prompt="The agent", timeout_s=0.2)
        async with serve_asgi(build_engine_app(_engine(tiny_dir), "tiny", TOKEN)) as url:
            waiting = asyncio.create_task(proxy.tokenize(prompt="The agent", timeout_s=30))
            await asyncio.sleep(0.3)
            early = waiting.done()
            await proxy.join("e0", url)
            ids = await asyncio.wait_for(waiting, 10)
        await proxy.close()
        return early, ids

    early, ids = asyncio.run(main())
    assert not early and len(ids) > 0


def test_a_drain_of_an_engine_out_of_routing_is_kept_for_its_return(tiny_dir, serve_asgi):
    """An engine that missed its probes is out of routing, not unknown: a move's drain of it
    (stop admission) succeeds, moving nothing, and it comes back drained; an undrain while
    it is down lets it come back admitting (was: HTTP 404 ``unknown engine``)."""

    async def main():
        port, proxy, seen = free_port(), _proxy(), []
        async with serve_asgi(build_engine_app(_engine(tiny_dir), "tiny", TOKEN), port) as url:
            await proxy.join("e0", url)
            proxy.health.mark_down(proxy.router.members["e0"], "missed probes")
            moved = await proxy.drain("e0")
            seen.append((moved["moved"], moved.get("lost"), proxy.health.lost["e0"].admitting))
            proxy.health.start()
            await _until(lambda: "e0" in proxy.router.members, 10)
            seen.append(proxy.router.members["e0"].admitting)
            proxy.health.mark_down(proxy.router.members["e0"], "missed probes")
            seen.append(proxy.undrain("e0").describe()["admitting"])
            await _until(lambda: "e0" in proxy.router.members, 10)
            seen.append(proxy.router.members["e0"].admitting)
        with pytest.raises(Exception, match="unknown engine 'e9'"):
            await proxy.drain("e9")
        await proxy.close()
        return seen

    assert asyncio.run(main()) == [(0, True, False), False, True, True]
