"""The proxy stamps each call of a named execution that brings no seed with the seed derived
from (run seed, execution id, call index); a harness's own seed is kept; without a run seed,
or without an execution, calls go out as they came."""

from __future__ import annotations

import asyncio

from tidal.models import load_model
from tidal.seeding import call_seed
from tidal.serving.engine import Engine, EngineConfig
from tidal.serving.engine_server import build_engine_app
from tidal.serving.protocol import SamplingParams
from tidal.serving.proxy import Proxy, ProxyConfig

TOKEN = "t0k"


def _engine(tiny_dir, **cfg) -> Engine:
    model, tok = load_model(tiny_dir)
    return Engine(model, tok, tiny_dir, EngineConfig(**cfg))


def test_calls_get_seeds_from_run_seed_execution_and_index():
    proxy = Proxy(ProxyConfig(seed=5))
    plain = SamplingParams(max_tokens=4)
    got = [
        proxy._seeded("e1", plain).seed,
        proxy._seeded("e2", plain).seed,
        proxy._seeded("e1", plain).seed,
        proxy._seeded("e1", SamplingParams(seed=99)).seed,  # the harness's own, kept
        proxy._seeded("e1", plain).seed,
    ]  # ... and counted: this is e1's 4th call
    assert got == [
        call_seed(5, "e1", 0),
        call_seed(5, "e2", 0),
        call_seed(5, "e1", 1),
        99,
        call_seed(5, "e1", 3),
    ]
    assert proxy._seeded(None, plain).seed is None
    assert Proxy(ProxyConfig())._seeded("e1", plain).seed is None


def test_call_counts_are_bounded():
    proxy = Proxy(ProxyConfig(seed=0))
    proxy.records.max_executions = 3
    for i in range(10):
        proxy._seeded(f"e{i}", SamplingParams())
    assert list(proxy._call_counts) == ["e7", "e8", "e9"]


def test_a_rerouted_call_samples_what_an_undisturbed_one_does(tiny_dir, serve_asgi):
    """Drained mid-call, the call goes on at another engine (with its KV) at the derived seed
    + tokens so far: the same tokens as the same call served by one engine."""

    async def call(urls, drain: bool):
        proxy = Proxy(ProxyConfig(admin_token=TOKEN, seed=5))
        for i, url in enumerate(urls):
            await proxy.join(f"e{i}", url)
        drained: list[asyncio.Task] = []

        def on_chunk(_chunk) -> None:
            if drain and not drained:
                drained.append(asyncio.create_task(proxy.drain("e0")))

        res = await proxy.complete(
            "b0-g0-e0",
            [3, 4, 5],
            SamplingParams(max_tokens=120, temperature=1.0, ignore_eos=True),
            on_chunk=on_chunk,
        )
        await asyncio.gather(*drained)
        engines = [s.engine_id for c in proxy.records.calls("b0-g0-e0") for s in c.segments]
        await proxy.close()
        return res.token_ids, engines

    async def main():
        apps = [build_engine_app(_engine(tiny_dir, seed=s), "tiny", TOKEN) for s in (1, 2)]
        async with serve_asgi(apps[0]) as u0, serve_asgi(apps[1]) as u1:
            alone = await call([u0], drain=False)
            moved = await call([u0, u1], drain=True)
        return alone, moved

    (alone, one), (moved, both) = asyncio.run(main())
    assert one == ["e0"] and both[0] == "e0" and "e1" in both  # it did move
    assert len(alone) == 120 and moved == alone
