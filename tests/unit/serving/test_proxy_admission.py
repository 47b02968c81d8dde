"""With admission control on, the proxy caps every engine at its concurrency target on the
engines' throughput curve (the rule of ``tidal.control.admission``), and calls past it wait
in the fair queue; without the curve the proxy refuses to start."""

from __future__ import annotations

import asyncio

import pytest

from tidal.contracts.launch import ProxySettings
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
            proxy = Proxy(
                ProxyConfig(admin_token=TOKEN, admission="saturation", engine_curve=CURVE)
            )
            member = await proxy.join("e0", url, cap=32)
            calls = [
                proxy.complete(
                    f"b0-g{i}-e0",
                    [3, 4, 5],
                    SamplingParams(max_tokens=24, temperature=1.0, ignore_eos=True),
                )
                for i in range(5)
            ]
            results = await asyncio.wait_for(asyncio.gather(*calls), 60)
            stats = {**proxy.queue.stats(), **proxy.queued_waits.figures()}
            await proxy.close()
            return member.cap, results, stats

    cap, results, stats = asyncio.run(main())
    # the waits are charged to the executions whose calls waited, measured in the queue
    assert stats["queued_executions"] == stats["admitted_after_wait"]
    assert 0 < stats["queued_execution_max_s"] <= stats["queued_execution_s"]
    assert stats["queued_execution_p99_s"] <= stats["queued_execution_max_s"]
    assert cap == 2  # 210 tok/s at 2 is >= 90% of the best (230); 100 at 1 is not
    assert all(len(r.token_ids) == 24 for r in results)
    assert stats["admitted_after_wait"] >= 3 and stats["queue_timeouts"] == 0


def test_tidal_proxy_refuses_admission_without_a_curve(capsys):
    from tidal.cli import main

    assert main(["proxy", "--admission", "saturation"]) == 2
    assert "control.engine_curve" in capsys.readouterr().err
    assert main(["proxy", "--admission", "saturation", "--engine-curve", "1:x"]) == 2
    assert "--engine-curve" in capsys.readouterr().err


def test_run_passes_admission_to_the_proxy_command(monkeypatch):
    """``start_proxy`` (what ``tidal run``'s driver calls) hands the rule and the curve to
    ``tidal proxy``; the process itself is not started here."""
    from tidal.serving import launch

    seen: list = []
    monkeypatch.setattr(launch, "ServerProcess", lambda args, *a, **kw: seen.append(args))
    launch.start_proxy(
        [], [], "tok", port=9, admission="saturation", engine_curve=[(1, 100.0), (32, 2000.0)]
    )
    launch.start_proxy([], [], "tok", port=9)
    on, off = (
        ProxySettings.model_validate_json(args[args.index("--settings") + 1]) for args in seen
    )
    assert on.admission == "saturation" and on.engine_curve == [(1, 100.0), (32, 2000.0)]
    assert off.admission == "off" and off.engine_curve is None
