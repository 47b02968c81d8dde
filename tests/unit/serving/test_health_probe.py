import asyncio

from tidal.serving.adapters import HTTPEngineBase


def test_health_probe_on_a_closed_client_answers_unhealthy():
    async def go():
        eng = HTTPEngineBase("http://127.0.0.1:9")
        await eng.close()  # as a concurrent leave does
        return await eng.health()

    assert asyncio.run(go()) is False
