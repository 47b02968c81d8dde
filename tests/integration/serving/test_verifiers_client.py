"""verifiers' own train-client path against tidal's token-in route: ``renderers.client.generate``
(what ``verifiers.v1``'s ``TrainClient`` calls for every turn: it renders the prompt itself,
reads ``max_model_len`` from ``GET /v1/models``, posts ``/inference/v1/generate`` with
``X-Session-ID`` and parses ``choices[0].token_ids`` and the log-probs) over reasoning-gym
questions (generated locally, no network), through ``tidal proxy`` over a built-in engine
process. The proxy's records hold exactly the token ids and log-probs verifiers received:
what the engine sampled is what trains."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tidal.serving.launch import start_engine, start_proxy

renderers = pytest.importorskip("renderers")
reasoning_gym = pytest.importorskip("reasoning_gym")
openai = pytest.importorskip("openai")
TOKEN = "verifiers-token"


def test_verifiers_train_client_over_the_token_in_route(tiny_model, tmp_path):
    from tidal.agents.verifiers_kind import make_renderer, run_episode

    renderer = make_renderer(str(tiny_model))
    dataset = reasoning_gym.create_dataset("basic_arithmetic", size=3, seed=7)
    engine = start_engine(tiny_model, name="tiny", log_path=tmp_path / "e.log", token=TOKEN)
    proxy = None
    try:
        engine.wait_healthy(120)
        proxy = start_proxy([engine.url], [], TOKEN, log_path=tmp_path / "p.log"
                            ).wait_healthy(60)

        async def episode(i: int, entry: dict) -> tuple[dict, float]:
            out = await run_episode(
                f"{proxy.url}/v1", "x", "tiny", renderer,
                [{"role": "user", "content": entry["question"]}],
                {"max_tokens": 12, "temperature": 1.0, "top_p": 0.95}, session=f"vf{i}",
                headers={"X-Tidal-Execution": f"vf{i}"})
            return out, float(dataset.score_answer(out["content"] or "", entry))

        async def main():
            return await asyncio.gather(*[episode(i, e) for i, e in enumerate(dataset)])

        results = asyncio.run(main())
        auth = {"Authorization": f"Bearer {TOKEN}"}
        for i, (out, reward) in enumerate(results):
            [call] = httpx.get(f"{proxy.url}/tidal/executions/vf{i}/records",
                               headers=auth).json()["calls"]
            assert call["prompt_token_ids"] == out["prompt_ids"]
            assert call["output_token_ids"] == out["completion_ids"] and out["completion_ids"]
            logprobs = [lp for s in call["segments"] for lp in s["logprobs"]]
            assert logprobs == pytest.approx(out["completion_logprobs"])
            assert 0.0 <= reward <= 1.0
    finally:
        if proxy is not None:
            proxy.stop()
        engine.stop()
