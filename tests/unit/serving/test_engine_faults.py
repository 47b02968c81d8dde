"""The built-in engine under hostile timing and input: aborts racing model steps in a worker
thread, a step that fails (counted, its requests end with ``error``), seeds outside int64,
tokenization off the event loop, and a non-streamed caller that hangs up. Real engines on a
real uvicorn server on loopback (``serve_asgi``)."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time

import httpx

from tidal.models import load_model
from tidal.models.hf import bundled_corpus
from tidal.serving.engine import Engine, EngineConfig
from tidal.serving.engine_server import build_engine_app
from tidal.serving.protocol import GenerateRequest, SamplingParams

TOKEN = "engine-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _engine(tiny_dir, **cfg) -> Engine:
    model, tok = load_model(tiny_dir)
    return Engine(model, tok, tiny_dir, EngineConfig(**cfg))


async def _drain(engine, req):
    return [c async for c in engine.generate(req)]


def test_aborts_during_threaded_steps_never_fail_a_step(tiny_dir):
    """Aborts land while the model step runs in its thread, round after round: no step fails,
    every request ends exactly once (aborted ones with ``abort``, the others at full length)."""
    rng = random.Random(7)

    async def main():
        eng = _engine(tiny_dir, max_batch=16, step_in_thread=True)
        await eng.start()
        ends = []
        for rnd in range(120):
            reqs = [
                GenerateRequest(
                    f"r{rnd}-{i}",
                    [3 + i, 4, 5],
                    SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
                )
                for i in range(8)
            ]
            tasks = [asyncio.create_task(_drain(eng, r)) for r in reqs]
            for _ in range(rng.randrange(1, 6)):
                await asyncio.sleep(0)
            victims = [r.request_id for r in reqs if rng.random() < 0.5]
            eng.abort(victims, keep_kv=rng.random() < 0.5)
            for r, chunks in zip(reqs, await asyncio.gather(*tasks), strict=True):
                ends.append(
                    (
                        r.request_id in victims,
                        chunks[-1].finish_reason,
                        sum(len(c.token_ids) for c in chunks),
                    )
                )
        await eng.stop()
        return eng.totals, ends

    totals, ends = asyncio.run(main())
    assert totals["step_failures"] == 0
    assert all(reason in ("abort", "length") for _, reason, _ in ends)
    assert all(n == 6 for victim, reason, n in ends if reason == "length")
    assert all(victim for victim, reason, _ in ends if reason == "abort")
    assert sum(reason == "abort" for _, reason, _ in ends) > 50  # the aborts did land


def test_a_failing_step_is_counted_and_ends_its_requests_with_error(tiny_dir):
    async def main():
        eng = _engine(tiny_dir)
        calls = {"n": 0}
        real = eng.model.forward_cached

        def flaky(pending, caches):  # a fault injected into the real model, once
            calls["n"] += 1
            if calls["n"] == 2:
                raise RuntimeError("device fault")
            return real(pending, caches)

        eng.model.forward_cached = flaky
        await eng.start()
        chunks = await _drain(
            eng, GenerateRequest("a", [3, 4], SamplingParams(max_tokens=8, ignore_eos=True))
        )
        again = await _drain(
            eng, GenerateRequest("b", [3, 4], SamplingParams(max_tokens=8, ignore_eos=True))
        )
        await eng.stop()
        return eng.totals, chunks[-1].finish_reason, again[-1].finish_reason

    totals, first, second = asyncio.run(main())
    assert totals["step_failures"] == 1 and first == "error" and second == "length"


def test_engine_http_bounds_and_token(tiny_dir, serve_asgi):
    async def main():
        eng = _engine(tiny_dir, step_in_thread=True)
        async with (
            serve_asgi(build_engine_app(eng, "tiny", TOKEN)) as url,
            httpx.AsyncClient(base_url=url, timeout=30) as c,
        ):
            out = {}
            for method, path in (
                ("GET", "/health"),
                ("POST", "/sleep"),
                ("POST", "/update_weight_version"),
                ("POST", "/abort_requests"),
                ("POST", "/update_weights"),
                ("GET", "/docs"),
                ("GET", "/openapi.json"),
                ("POST", "/v1/completions"),
            ):
                out[path] = (await c.request(method, path)).status_code
            body = {"prompt": [3, 4], "max_tokens": 2, "seed": 2**63}
            big_seed = await c.post("/v1/completions", json=body, headers=AUTH)
            ok = await c.post("/v1/completions", json={**body, "seed": 2**63 - 1}, headers=AUTH)
            too_long = await c.post("/tokenize", json={"prompt": "a" * 200_000}, headers=AUTH)
            weights = await c.post(
                "/update_weights", headers=AUTH, json={"path": "/", "weight_version": "x"}
            )
            return out, big_seed, ok, too_long, weights, eng.weight_version

    out, big_seed, ok, too_long, weights, version = asyncio.run(main())
    assert set(out.values()) == {401}, out
    assert big_seed.status_code == 400 and "seed" in big_seed.json()["error"]["message"]
    assert ok.status_code == 200 and len(ok.json()["choices"][0]["token_ids"]) == 2
    assert too_long.status_code == 400 and "prompt" in too_long.json()["error"]["message"]
    assert weights.status_code == 400 and version == "v0", weights.text


class _HeldTokenizer:
    """The engine's real tokenizer, holding its thread for a second per ``encode``: what a long
    prompt costs a slow tokenizer (the fast HF one does 60k letters in about 60 ms, too quick
    to tell the loop from a thread)."""

    def __init__(self, tok) -> None:
        self._tok = tok

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def encode(self, text, *args, **kw):
        time.sleep(1.0)
        return self._tok.encode(text, *args, **kw)


def test_tokenizing_a_long_prompt_leaves_the_loop_free(tiny_dir, serve_asgi):
    """A tokenization that holds its thread for a second: ``/health`` still answers at once
    meanwhile (on the loop, one probe would wait for all of it)."""
    letters = "".join(ch for ch in bundled_corpus() if ch.isascii() and ch.isalpha())
    text = (letters * (60_000 // len(letters) + 1))[:60_000]

    async def main():
        eng = _engine(tiny_dir)
        eng.tokenizer = _HeldTokenizer(eng.tokenizer)
        async with (
            serve_asgi(build_engine_app(eng, "tiny", TOKEN)) as url,
            httpx.AsyncClient(base_url=url, timeout=60, headers=AUTH) as c,
        ):
            t0 = time.monotonic()
            work = asyncio.create_task(c.post("/tokenize", json={"prompt": text}))
            probes = []
            while not work.done():
                t = time.monotonic()
                assert (await c.get("/health")).status_code == 200
                probes.append(time.monotonic() - t)
                await asyncio.sleep(0.05)
            return (await work).json()["count"], time.monotonic() - t0, probes

    count, took, probes = asyncio.run(main())
    assert count > 1000 and took >= 1.0, took  # the real tokenizer ran, held for a second
    # the loop answered while the tokenizer held its thread: several probes came back within
    # the held second (a loop blocked by it answers one probe, after the whole second). No
    # bound on any single probe: a loaded machine (2 shared cores) may delay one or two.
    assert len(probes) >= 3 and sorted(probes)[len(probes) // 2] < took / 3, (took, probes)


def test_a_non_streamed_caller_that_hangs_up_aborts_its_request(tiny_dir, serve_asgi):
    async def main():
        eng = _engine(tiny_dir, step_in_thread=True)
        async with serve_asgi(build_engine_app(eng, "tiny", TOKEN)) as url:
            async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=30) as c:
                await _hang_up_once_running(
                    eng,
                    c.post(
                        "/v1/completions",
                        json={"prompt": [3, 4], "max_tokens": 500, "ignore_eos": True},
                    ),
                )
            t_gone = time.monotonic()
            while eng.stats()["running"] and time.monotonic() - t_gone < 10:
                await asyncio.sleep(0.02)
            return eng.stats(), time.monotonic() - t_gone

    stats, took = asyncio.run(main())
    assert stats["aborted"] == 1 and stats["running"] == 0 and took < 8
    assert stats["generated_tokens"] < 500


async def _hang_up_once_running(eng, post) -> None:
    """Send ``post``; once the engine generates for it, drop the connection (cancel)."""
    call = asyncio.ensure_future(post)
    while not eng.stats()["generated_tokens"] and not call.done():
        await asyncio.sleep(0.005)
    call.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await call
