"""The sampling fields tidal implements reach vLLM and SGLang servers under their own names
(``top_p``, ``stop``, ``stop_token_ids``, ``top_k``, ``seed``): each adapter's request body, as a
server on loopback receives it."""

from __future__ import annotations

import asyncio
import json

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from tidal.serving.adapters import BuiltinAdapter
from tidal.serving.protocol import GenerateRequest, SamplingParams
from tidal.serving.sglang_adapter import SGLangAdapter
from tidal.serving.vllm_adapter import VLLMAdapter


def _capture() -> FastAPI:
    app = FastAPI()
    app.state.bodies = []

    async def one_token(request: Request, event: dict):
        app.state.bodies.append((request.url.path, await request.json()))

        async def events():
            yield f"data: {json.dumps(event)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await one_token(
            request,
            {
                "choices": [
                    {
                        "index": 0,
                        "text": "a",
                        "token_ids": [7],
                        "finish_reason": "stop",
                        "prompt_token_ids": [3],
                        "logprobs": {"token_logprobs": [-0.5]},
                    }
                ],
                "tidal": {
                    "token_ids": [7],
                    "logprobs": [-0.5],
                    "versions": ["v0"],
                    "text": "a",
                    "finish_reason": "stop",
                    "prompt_token_ids": [3],
                    "cached_tokens": 0,
                },
            },
        )

    @app.post("/generate")
    async def generate(request: Request):
        return await one_token(
            request,
            {
                "text": "a",
                "meta_info": {
                    "finish_reason": {"type": "stop"},
                    "output_token_logprobs": [[-0.5, 7, None]],
                },
            },
        )

    @app.get("/v1/models")
    async def models():
        return {"data": [{"id": "m", "max_model_len": 64}]}

    @app.get("/weight_info")
    async def weight_info():
        return {"weight_version": "v0"}

    return app


def test_sampling_fields_reach_every_backend(serve_asgi):
    params = SamplingParams(
        max_tokens=5, temperature=0.7, top_p=0.5, top_k=4, seed=9, stop=["END"], stop_token_ids=[2]
    )

    async def main():
        app = _capture()
        async with serve_asgi(app) as url:
            for adapter in (BuiltinAdapter(url), VLLMAdapter(url), SGLangAdapter(url)):
                chunks = [c async for c in adapter.generate(GenerateRequest("r", [3], params))]
                assert [t for c in chunks for t in c.token_ids] == [7]
                assert (await adapter.served_model_card()) == ("m", 64)
                await adapter.close()
        return app.state.bodies

    (_, builtin), (_, vllm), (_, sglang) = asyncio.run(main())
    assert (builtin["top_p"], builtin["stop"], builtin["top_k"]) == (0.5, ["END"], 4)
    assert (vllm["top_p"], vllm["stop"], vllm["stop_token_ids"], vllm["seed"]) == (
        0.5,
        ["END"],
        [2],
        9,
    )
    sp = sglang["sampling_params"]
    assert (sp["top_p"], sp["stop"], sp["stop_token_ids"], sp["top_k"], sp["sampling_seed"]) == (
        0.5,
        ["END"],
        [2],
        4,
        9,
    )
