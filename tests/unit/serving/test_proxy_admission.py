"""With admission control on, the proxy caps every engine at its concurrency target on the
engines' throughput curve (the rule of ``tidal.control.admission``), and calls past it wait
in the fair queue; without the curve the proxy refuses to start."""

from __future__ import annotations

import asyncio

import pytest

from tidal.errors import ConfigError
from tidal.models import load_model
from tidal.serving.engine import Engine, EngineConfig
from tidal.serving.engine_server import build_engine_app
from tidal.serving.protocol import SamplingParams
from tidal.serving.proxy import Proxy, ProxyConfig

TOKEN = "t0k"
CURVE = [(1, 100.0), (2, 210.0), (4, 220.0), (32, 230.0)]  # saturates at 2 sequences


def test_admission_needs_the_engine_curve():
    with pytest.raises(ConfigError, match="engine_curve"):
        Proxy(ProxyConfig(admission="saturation"))
    with pytest.raises(ConfigError, match="admission"):
        Proxy(ProxyConfig(admission="always", engine_curve=CURVE))


def test_engines_are_capped_at_their_target_and_calls_queue(tiny_dir, serve_asgi):
    async def main():
        model, tok = load_model(tiny_dir)
        app = build_engine_app(Engine(model, tok, tiny_dir, EngineConfig(seed=1)), "tiny", TOKEN)
        async with serve_asgi(app) as url:
            proxy = Proxy(ProxyConfig(admin_token=TOKEN, admission="saturation",
                                      engine_curve=CURVE))
            member = await proxy.join("e0", url, cap=32)
            calls = [proxy.complete(f"b0-g{i}-e0", [3, 4, 5], SamplingParams(
                max_tokens=24, temperature=1.0, ignore_eos=True)) for i in range(5)]
            results = await asyncio.wait_for(asyncio.gather(*calls), 60)
            stats = proxy.queue.stats()
            await proxy.close()
            return member.cap, results, stats

    cap, results, stats = asyncio.run(main())
    assert cap == 2  # 210 tok/s at 2 is >= 90% of the best (230); 100 at 1 is not
    assert all(len(r.token_ids) == 24 for r in results)
    assert stats["admitted_after_wait"] >= 3 and stats["queue_timeouts"] == 0
