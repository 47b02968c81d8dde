"""HTTP face of the built-in engine: the OpenAI subset plus vLLM-shaped control routes.

In: HTTP requests on loopback (``tidal engine``). Out: completions (JSON or SSE), control
results, KV blobs. Routes: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``,
``/pause?mode=``, ``/resume``, ``/is_paused``, ``/abort_requests``, ``/sleep?level=``, ``/wake_up``,
``/is_sleeping``, ``/update_weights``, ``/update_weight_version``, ``/weight_info``, ``/stats``,
``/health``, ``/load``, ``/tokenize``, ``/detokenize``, and ``/tidal/kv`` (export / import /
release one request's KV cache).

Every route requires the run's bearer token when one is set (``guard.Guard``): without it any
local process could relabel the served weights, abort calls, put the engine to sleep or load a
file of its choosing. Prompts are tokenized in a worker thread (a long one never stalls the
loop); a non-streamed caller that hangs up aborts its request.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Literal

from fastapi import FastAPI, Header, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from tidal.errors import TidalError
from tidal.serving.chat import MAX_PROMPT_CHARS, MAX_TOOLS, ChatMessage, Tool, tool_parser
from tidal.serving.engine import Engine
from tidal.serving.fast_path import unless_gone
from tidal.serving.guard import CatchAll, Guard
from tidal.serving.openai_api import (
    SSE_DONE,
    VERSIONS_HEADER,
    ChatRequest,
    CompletionRequest,
    Result,
    ToolParse,
    chat_response,
    completion_response,
    install_error_handlers,
    sse_chunk,
    sse_usage,
    tool_delta,
    versions_header,
)
from tidal.serving.protocol import BadRequest, GenerateRequest, NotFound

MAX_KV_BLOB_BYTES = 1 << 30


class AbortBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    request_ids: list[str] | None = None
    keep_kv: bool = False


class TokenizeBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = Field(None, max_length=MAX_PROMPT_CHARS)
    messages: list[ChatMessage] | None = Field(None, max_length=4096)
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    add_generation_prompt: Literal[True] = Field(True, description="the generation prompt is "
                                                 "always appended")
    add_special_tokens: Literal[False] = Field(False, description="text is encoded as is")


class DetokenizeBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[int] = Field(..., max_length=MAX_PROMPT_CHARS)


class WeightsBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str = Field(..., min_length=1)
    weight_version: str = Field(..., min_length=1, max_length=128)


class VersionBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    new_version: str = Field(..., min_length=1, max_length=128)


def build_engine_app(engine: Engine, served_name: str, token: str | None = None,
                     tool_call_parser: str = "hermes") -> Guard:
    """The engine's ASGI app; with ``token`` every route needs ``Authorization: Bearer``.
    ``tool_call_parser`` (``chat.TOOL_PARSERS``) reads tool calls out of chat answers."""
    parser = tool_parser(tool_call_parser)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        await engine.start()
        yield
        await engine.stop()

    app = FastAPI(title=f"tidal engine {served_name}", lifespan=lifespan)
    app.state.engine = engine
    install_error_handlers(app)
    app.add_middleware(CatchAll)
    tok = engine.tokenizer

    def check_model(name: str | None) -> None:
        if name not in (None, served_name):
            raise NotFound(f"model {name!r} is not served here (serving {served_name!r})")

    async def encode(text: str) -> list[int]:
        return await asyncio.to_thread(tok.encode, text)

    async def encode_chat(messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        try:
            return await asyncio.to_thread(tok.apply_chat_template, messages, tools)
        except TidalError as exc:
            raise BadRequest(str(exc)) from None

    async def run(request: Request, rid: str, prompt: list[int], body, chat: bool):
        if body.n != 1:
            raise BadRequest("n: an engine serves one choice per request (the proxy serves n)")
        parse = parser if chat and body.parses_tools else None
        req = GenerateRequest(rid, prompt, body.sampling(), kv_handle=body.kv_handle)
        stream = engine.generate(req, min_interval_s=body.stream_interval_ms / 1000.0)
        first = await anext(stream)  # admission errors surface here, before any byte is sent
        res = Result(prompt)
        res.cached_tokens = first.cached_tokens or 0
        res.add(first)
        if body.stream:
            return StreamingResponse(_events(rid, served_name, first, stream, res, chat, parse,
                                             body), media_type="text/event-stream")
        if not await _collect(request, stream, res):
            return Response(status_code=499)  # the caller is gone; its request was aborted
        texts = [[tok.decode([t]) for t in res.token_ids]]
        if chat:
            out = chat_response(rid, served_name, [res], body.logprobs, texts, parse)
        else:
            out = completion_response(rid, served_name, [res], body.logprobs is not None,
                                      texts)
        return JSONResponse(out, headers={VERSIONS_HEADER: versions_header([res])})

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest,
                          x_request_id: str | None = Header(None, max_length=256)):
        check_model(body.model)
        prompt = body.prompt if isinstance(body.prompt, list) else await encode(body.prompt)
        rid = body.request_id or x_request_id or uuid.uuid4().hex
        return await run(request, rid, prompt, body, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request, body: ChatRequest,
                   x_request_id: str | None = Header(None, max_length=256)):
        check_model(body.model)
        prompt = await encode_chat(body.template_messages(), body.template_tools())
        rid = body.request_id or x_request_id or uuid.uuid4().hex
        return await run(request, rid, prompt, body, chat=True)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeBody):
        check_model(body.model)
        if body.messages:
            ids = await encode_chat([m.to_template() for m in body.messages],
                                    [t.model_dump(exclude_none=True) for t in body.tools]
                                    if body.tools else None)
        elif body.prompt is not None:
            ids = await encode(body.prompt)
        else:
            raise BadRequest("tokenize needs prompt or messages")
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.model.max_seq_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeBody):
        check_model(body.model)
        bad = [t for t in body.tokens if not 0 <= t < tok.vocab_size]
        if bad:
            raise BadRequest(f"tokens: id {bad[0]} outside vocabulary of {tok.vocab_size}")
        return {"prompt": await asyncio.to_thread(tok.decode, body.tokens)}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served_name, "object": "model",
                                            "owned_by": "tidal",
                                            "max_model_len": engine.model.max_seq_len}]}

    @app.post("/pause")
    async def pause(mode: str = Query("abort")):
        await engine.pause(mode)
        return {"status": "paused"}

    @app.post("/resume")
    async def resume():
        await engine.resume()
        return {"status": "resumed"}

    @app.get("/is_paused")
    async def is_paused():
        return {"is_paused": engine.is_paused}

    @app.post("/abort_requests")
    async def abort_requests(body: AbortBody | None = None):
        body = body or AbortBody()
        n = engine.abort(body.request_ids, keep_kv=body.keep_kv)
        return {"status": "aborted", "aborted": n}

    @app.post("/sleep")
    async def sleep(level: int = Query(1)):
        await engine.sleep(level)
        return {"status": "sleeping", "level": level}

    @app.post("/wake_up")
    async def wake_up():
        await engine.wake_up()
        return {"status": "awake"}

    @app.get("/is_sleeping")
    async def is_sleeping():
        return {"is_sleeping": engine.is_sleeping}

    @app.post("/update_weights")
    async def update_weights(body: WeightsBody):
        try:
            await engine.update_weights(weights_path(body.path), body.weight_version)
        except (TidalError, OSError, ValueError) as exc:  # the old version keeps serving
            raise BadRequest(f"path: no weights of this model at {body.path!r}: "
                             f"{str(exc)[:300]}") from None
        return {"status": "ok", "weight_version": engine.weight_version}

    @app.post("/update_weight_version")
    async def update_weight_version(body: VersionBody):
        engine.weight_version = body.new_version
        return {"status": "ok", "weight_version": engine.weight_version}

    @app.get("/weight_info")
    async def weight_info():
        return {"weight_version": engine.weight_version}

    @app.get("/tidal/kv/{request_id}")
    async def export_kv(request_id: str):
        blob = await engine.export_kv(request_id)
        return Response(blob, media_type="application/octet-stream")

    @app.post("/tidal/kv")
    async def import_kv(request: Request):
        blob = await request.body()
        if not blob or len(blob) > MAX_KV_BLOB_BYTES:
            raise BadRequest("body: KV import needs a safetensors body of at most 1 GiB")
        handle, tokens = await engine.import_kv(blob)
        return {"handle": handle, "tokens": tokens}

    @app.delete("/tidal/kv/{key}")
    async def release_kv(key: str):
        if not engine.release_kv(key):
            raise NotFound(f"no KV cache held under {key!r}")
        return {"status": "released"}

    @app.get("/stats")
    async def stats():
        return engine.stats()

    @app.get("/load")
    async def load():
        s = engine.stats()
        return {"server_load": s["running"] + s["waiting"]}

    @app.get("/health")
    async def health():
        return JSONResponse({"status": "ok"})

    return Guard(app, token, None if token else (lambda _: False),
                 body_limits={"/tidal/kv": MAX_KV_BLOB_BYTES + 1})


def weights_path(path: str) -> Path:
    """``path`` of an ``/update_weights`` body if it can hold weights: a ``.safetensors`` file
    or a directory, no ``..`` part; else ``BadRequest`` naming it (what is in it is checked
    when it is read, ``Engine.update_weights``)."""
    p = Path(path)
    if ".." in p.parts:
        raise BadRequest(f"path: {path!r} has a '..' part")
    if p.is_file() and p.suffix != ".safetensors":
        raise BadRequest(f"path: {path!r} is not a .safetensors file")
    if not (p.is_file() or p.is_dir()):
        raise BadRequest(f"path: weights not found at {path!r}")
    return p


async def _events(rid: str, model: str, first, stream, res: Result, chat: bool,
                  parse: ToolParse | None, body) -> AsyncIterator[bytes]:
    """The SSE events of one streamed request; with tools offered the text is held back and
    the last event carries it with the parsed tool calls."""
    try:
        chunk = first
        while True:
            final = chunk.finish_reason
            if parse is not None:
                if final:
                    delta, called = tool_delta(res.text, parse)
                    if called and final == "stop":
                        chunk.finish_reason = "tool_calls"
                    yield sse_chunk(rid, model, chunk, chat, delta=delta)
                else:
                    yield sse_chunk(rid, model, chunk, chat, delta={})
            else:
                yield sse_chunk(rid, model, chunk, chat)
            if final:
                break
            chunk = await anext(stream)
            res.add(chunk)
        if body.stream_options is not None and body.stream_options.include_usage:
            yield sse_usage(rid, model, [res], chat)
        yield SSE_DONE
    finally:
        await stream.aclose()


async def _collect(request: Request, stream, res: Result) -> bool:
    """Read ``stream`` into ``res``; False if the caller hung up first (the stream is closed,
    which aborts the engine request)."""

    async def collect() -> bool:
        async for chunk in stream:
            res.add(chunk)
        return True

    try:
        return await unless_gone(collect(), request.receive) is not None  # raises its error
    finally:
        await stream.aclose()
