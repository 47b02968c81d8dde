"""The SGLang adapter over real HTTP. SGLang itself needs CUDA, so the server here is a
test-only FastAPI front shaped like SGLang 0.5.23's documented routes (``/generate`` SSE with
cumulative ``meta_info.output_token_logprobs``, ``/abort_request``, ``/pause_generation``,
``/continue_generation``, memory release, ``/metrics``) over the real built-in engine."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, StreamingResponse

from tidal.models import load_model
from tidal.serving.engine import Engine
from tidal.serving.launch import free_port
from tidal.serving.protocol import GenerateRequest, SamplingParams
from tidal.serving.sglang_adapter import SGLangAdapter


def _sglang_shaped(engine: Engine) -> FastAPI:
    app = FastAPI()
    calls: list[tuple[str, dict]] = []
    app.state.calls = calls

    @app.post("/generate")
    async def generate(request: Request):
        body = await request.json()
        sp = body["sampling_params"]
        req = GenerateRequest(
            body["rid"],
            body["input_ids"],
            SamplingParams(
                max_tokens=sp["max_new_tokens"],
                temperature=sp["temperature"],
                ignore_eos=sp.get("ignore_eos", False),
            ),
        )

        async def events():
            ids, lps, text = [], [], ""
            async for chunk in engine.generate(req):
                ids += chunk.token_ids
                lps += chunk.logprobs
                text += chunk.text
                fin = {"type": chunk.finish_reason} if chunk.finish_reason else None
                pairs = [[lp, t, None] for lp, t in zip(lps, ids, strict=True)]
                meta = {
                    "id": req.request_id,
                    "finish_reason": fin,
                    "weight_version": "v0",
                    "output_token_logprobs": pairs,
                    "cached_tokens": 0,
                }
                yield f"data: {json.dumps({'text': text, 'meta_info': meta})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/abort_request")
    async def abort(request: Request):
        body = await request.json()
        calls.append(("abort", body))
        engine.abort(None if body.get("abort_all") else [body["rid"]])
        return PlainTextResponse("")

    @app.post("/pause_generation")
    async def pause(request: Request):
        body = await request.json()
        calls.append(("pause", body))
        await engine.pause({"in_place": "keep"}.get(body["mode"], body["mode"]))
        return {}

    @app.post("/continue_generation")
    async def cont():
        await engine.resume()
        return {}

    @app.post("/release_memory_occupation")
    async def release():
        await engine.sleep(2)
        return {}

    @app.post("/resume_memory_occupation")
    async def resume_mem():
        await engine.wake_up()
        return {}

    @app.get("/metrics")
    async def metrics():
        s = engine.stats()
        return PlainTextResponse(
            f'sglang:num_running_reqs{{model="m"}} {s["running"]}\n'
            f'sglang:num_queue_reqs{{model="m"}} {s["waiting"]}\n'
        )

    @app.get("/health")
    async def health():
        return {}

    return app


def test_sglang_adapter_against_an_sglang_shaped_server(tiny_dir):
    model, tok = load_model(tiny_dir)
    engine = Engine(model, tok, tiny_dir)
    app = _sglang_shaped(engine)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    loop_ready = threading.Event()

    def serve():
        async def main():
            await engine.start()
            loop_ready.set()
            await server.serve()
            await engine.stop()

        asyncio.run(main())

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    loop_ready.wait(10)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
            break
        except httpx.HTTPError:
            time.sleep(0.05)

    async def client():
        a = SGLangAdapter(f"http://127.0.0.1:{port}")
        assert await a.health()
        req = GenerateRequest("sg-1", [3, 4, 5], SamplingParams(max_tokens=7, ignore_eos=True))
        chunks = [c async for c in a.generate(req)]
        toks = [t for c in chunks for t in c.token_ids]
        assert len(toks) == 7 and chunks[-1].finish_reason == "length"
        assert len([lp for c in chunks for lp in c.logprobs]) == 7
        assert chunks[0].prompt_token_ids == [3, 4, 5]
        assert "".join(c.text for c in chunks) == tok.decode(toks)
        long = GenerateRequest("sg-2", [3], SamplingParams(max_tokens=400, ignore_eos=True))
        gen = a.generate(long)
        first = await anext(gen)
        await a.abort(["sg-2"])
        rest = [c async for c in gen]
        assert (rest[-1] if rest else first).finish_reason == "abort"
        await a.pause("keep")
        assert engine.is_paused
        await a.resume()
        await a.sleep(2)
        assert engine.is_sleeping
        await a.wake_up()
        assert not engine.is_sleeping and (await a.stats()).running == 0
        await a.close()
        return app.state.calls

    try:
        calls = asyncio.run(client())
    finally:
        server.should_exit = True
        thread.join(10)
    assert ("abort", {"rid": "sg-2", "abort_all": False}) in calls
    assert ("pause", {"mode": "in_place"}) in calls
