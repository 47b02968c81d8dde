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
from typing import TYPE_CHECKING, Literal

from fastapi import FastAPI, Header, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from tidal.errors import TidalError
from tidal.serving.chat import MAX_PROMPT_CHARS, MAX_TOOLS, ChatMessage, Tool, tool_parser
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

if TYPE_CHECKING:  # the emulated engine serves these routes without torch
    from tidal.serving.engine import Engine

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
    add_generation_prompt: Literal[True] = Field(
        True, description="the generation prompt is always appended"
    )
    add_special_tokens: Literal[False] = Field(False, description="text is encoded as is")


class DetokenizeBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[int] = Field(..., max_length=MAX_PROMPT_CHARS)


class WeightsBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str = Field(..., min_length=1)
    weight_version: str = Field(..., min_length=1, max_length=128)


class IpcBody(BaseModel):
    """A version as CUDA IPC handles (``tidal.training.cuda_ipc.ipc_export``)."""

    model_config = ConfigDict(extra="forbid")

    handles: list[dict] = Field(..., min_length=1)
    weight_version: str = Field(..., min_length=1, max_length=128)


class VersionBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    new_version: str = Field(..., min_length=1, max_length=128)


class EngineHandlers:
    """Every route of the engine app as a method (FastAPI reads their signatures)."""

    def __init__(self, engine: Engine, served_name: str, parser: ToolParse) -> None:
        self.engine, self.served_name, self.parser = engine, served_name, parser
        self.tok = engine.tokenizer

    # -- helpers ---------------------------------------------------------------------------
    def check_model(self, name: str | None) -> None:
        if name not in (None, self.served_name):
            raise NotFound(f"model {name!r} is not served here (serving {self.served_name!r})")

    async def encode(self, text: str) -> list[int]:
        return await asyncio.to_thread(self.tok.encode, text)

    async def encode_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        try:
            return await asyncio.to_thread(self.tok.apply_chat_template, messages, tools)
        except TidalError as exc:
            raise BadRequest(str(exc)) from None

    async def run(
        self,
        request: Request,
        rid: str,
        prompt: list[int],
        body: CompletionRequest | ChatRequest,
        chat: bool,
    ) -> Response:
        """One generation: streamed as SSE, or collected into one JSON answer."""
        if body.n != 1:
            raise BadRequest("n: an engine serves one choice per request (the proxy serves n)")
        parse = self.parser if chat and body.parses_tools else None
        if body.output_context >= len(prompt):
            raise BadRequest("output_context: must be shorter than the prompt")
        req = GenerateRequest(
            rid,
            prompt,
            body.sampling(),
            kv_handle=body.kv_handle,
            output_context=body.output_context,
        )
        stream = self.engine.generate(req, min_interval_s=body.stream_interval_ms / 1000.0)
        first = await anext(stream)  # admission errors surface here, before any byte is sent
        res = Result(prompt)
        res.cached_tokens = first.cached_tokens or 0
        res.add(first)
        name = self.served_name
        if body.stream:
            return StreamingResponse(
                _events(rid, name, first, stream, res, chat, parse, body),
                media_type="text/event-stream",
            )
        if not await _collect(request, stream, res):
            return Response(status_code=499)  # the caller is gone; its request was aborted
        texts = [[self.tok.decode([t]) for t in res.token_ids]]
        if chat:
            out = chat_response(rid, name, [res], body.logprobs, texts, parse)
        else:
            out = completion_response(rid, name, [res], body.logprobs is not None, texts)
        return JSONResponse(out, headers={VERSIONS_HEADER: versions_header([res])})

    # -- OpenAI and tokenizer routes -------------------------------------------------------
    async def completions(
        self,
        request: Request,
        body: CompletionRequest,
        x_request_id: str | None = Header(None, max_length=256),
    ) -> Response:
        self.check_model(body.model)
        prompt = body.prompt if isinstance(body.prompt, list) else await self.encode(body.prompt)
        rid = body.request_id or x_request_id or uuid.uuid4().hex
        return await self.run(request, rid, prompt, body, chat=False)

    async def chat(
        self,
        request: Request,
        body: ChatRequest,
        x_request_id: str | None = Header(None, max_length=256),
    ) -> Response:
        self.check_model(body.model)
        prompt = await self.encode_chat(body.template_messages(), body.template_tools())
        rid = body.request_id or x_request_id or uuid.uuid4().hex
        return await self.run(request, rid, prompt, body, chat=True)

    async def tokenize(self, body: TokenizeBody) -> dict:
        self.check_model(body.model)
        if body.messages:
            ids = await self.encode_chat(
                [m.to_template() for m in body.messages],
                [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None,
            )
        elif body.prompt is not None:
            ids = await self.encode(body.prompt)
        else:
            raise BadRequest("tokenize needs prompt or messages")
        return {"tokens": ids, "count": len(ids), "max_model_len": self.engine.model.max_seq_len}

    async def detokenize(self, body: DetokenizeBody) -> dict:
        self.check_model(body.model)
        tok = self.tok
        bad = [t for t in body.tokens if not 0 <= t < tok.vocab_size]
        if bad:
            raise BadRequest(f"tokens: id {bad[0]} outside vocabulary of {tok.vocab_size}")
        return {"prompt": await asyncio.to_thread(tok.decode, body.tokens)}

    async def models(self) -> dict:
        return {
            "object": "list",
            "data": [
                {
                    "id": self.served_name,
                    "object": "model",
                    "owned_by": "tidal",
                    "max_model_len": self.engine.model.max_seq_len,
                }
            ],
        }

    # -- control routes (vLLM's shapes) ----------------------------------------------------
    async def pause(self, mode: str = Query("abort")) -> dict:
        await self.engine.pause(mode)
        return {"status": "paused"}

    async def resume(self) -> dict:
        await self.engine.resume()
        return {"status": "resumed"}

    async def is_paused(self) -> dict:
        return {"is_paused": self.engine.is_paused}

    async def abort_requests(self, body: AbortBody | None = None) -> dict:
        body = body or AbortBody()
        n = self.engine.abort(body.request_ids, keep_kv=body.keep_kv)
        return {"status": "aborted", "aborted": n}

    async def sleep(self, level: int = Query(1)) -> dict:
        await self.engine.sleep(level)
        return {"status": "sleeping", "level": level}

    async def wake_up(self) -> dict:
        await self.engine.wake_up()
        return {"status": "awake"}

    async def is_sleeping(self) -> dict:
        return {"is_sleeping": self.engine.is_sleeping}

    async def update_weights(self, body: WeightsBody) -> dict:
        try:
            await self.engine.update_weights(weights_path(body.path), body.weight_version)
        except (TidalError, OSError, ValueError) as exc:  # the old version keeps serving
            raise BadRequest(
                f"path: no weights of this model at {body.path!r}: {str(exc)[:300]}"
            ) from None
        return {
            "status": "ok",
            "weight_version": self.engine.weight_version,
            "pause_s": round(self.engine.last_pause_s, 6),
            **self.engine.last_load_parts,  # prepare_s, step_wait_s (an awake engine's load)
        }

    async def update_weights_ipc(self, body: IpcBody) -> dict:
        from tidal.training.cuda_ipc import ipc_import

        try:
            named = ipc_import(body.handles)
            await self.engine.update_weights_from(named, body.weight_version)
        except (TidalError, RuntimeError, KeyError, TypeError, ValueError) as exc:
            raise BadRequest(f"handles: not a version of this model: {str(exc)[:300]}") from None
        return {
            "status": "ok",
            "weight_version": self.engine.weight_version,
            "pause_s": round(self.engine.last_pause_s, 6),
        }

    async def update_weight_version(self, body: VersionBody) -> dict:
        self.engine.weight_version = body.new_version
        return {"status": "ok", "weight_version": self.engine.weight_version}

    async def weight_info(self) -> dict:
        return {"weight_version": self.engine.weight_version}

    async def weight_hashes(self) -> dict:
        return {
            "weight_version": self.engine.weight_version,
            "hashes": await self.engine.weight_hashes(),
        }

    # -- KV handoff ------------------------------------------------------------------------
    async def export_kv(self, request_id: str) -> Response:
        blob = await self.engine.export_kv(request_id)
        return Response(blob, media_type="application/octet-stream")

    async def import_kv(self, request: Request) -> dict:
        blob = await request.body()
        if not blob or len(blob) > MAX_KV_BLOB_BYTES:
            raise BadRequest("body: KV import needs a safetensors body of at most 1 GiB")
        handle, tokens = await self.engine.import_kv(blob)
        return {"handle": handle, "tokens": tokens}

    async def release_kv(self, key: str) -> dict:
        if not self.engine.release_kv(key):
            raise NotFound(f"no KV cache held under {key!r}")
        return {"status": "released"}

    # -- load and health -------------------------------------------------------------------
    async def stats(self) -> dict:
        return self.engine.stats()

    async def load(self) -> dict:
        s = self.engine.stats()
        return {"server_load": s["running"] + s["waiting"]}

    async def health(self) -> JSONResponse:
        return JSONResponse({"status": "ok"})


#: (method, path, handler name), in the order FastAPI matches them
ROUTES: tuple[tuple[str, str, str], ...] = (
    ("POST", "/v1/completions", "completions"),
    ("POST", "/v1/chat/completions", "chat"),
    ("POST", "/tokenize", "tokenize"),
    ("POST", "/detokenize", "detokenize"),
    ("GET", "/v1/models", "models"),
    ("POST", "/pause", "pause"),
    ("POST", "/resume", "resume"),
    ("GET", "/is_paused", "is_paused"),
    ("POST", "/abort_requests", "abort_requests"),
    ("POST", "/sleep", "sleep"),
    ("POST", "/wake_up", "wake_up"),
    ("GET", "/is_sleeping", "is_sleeping"),
    ("POST", "/update_weights", "update_weights"),
    ("POST", "/update_weight_version", "update_weight_version"),
    ("POST", "/tidal/weights/ipc", "update_weights_ipc"),
    ("GET", "/weight_info", "weight_info"),
    ("GET", "/tidal/weights/hashes", "weight_hashes"),
    ("GET", "/tidal/kv/{request_id}", "export_kv"),
    ("POST", "/tidal/kv", "import_kv"),
    ("DELETE", "/tidal/kv/{key}", "release_kv"),
    ("GET", "/stats", "stats"),
    ("GET", "/load", "load"),
    ("GET", "/health", "health"),
)


def build_engine_app(
    engine: Engine, served_name: str, token: str | None = None, tool_call_parser: str = "hermes"
) -> Guard:
    """The engine's ASGI app (routes: ``ROUTES``, handled by ``EngineHandlers``); with
    ``token`` every route needs ``Authorization: Bearer``. ``tool_call_parser``
    (``chat.TOOL_PARSERS``) reads tool calls out of chat answers."""
    handlers = EngineHandlers(engine, served_name, tool_parser(tool_call_parser))

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await engine.start()
        yield
        await engine.stop()

    app = FastAPI(title=f"tidal engine {served_name}", lifespan=lifespan)
    app.state.engine = engine
    install_error_handlers(app)
    app.add_middleware(CatchAll)
    for method, path, name in ROUTES:
        app.add_api_route(path, getattr(handlers, name), methods=[method], response_model=None)
    return Guard(
        app,
        token,
        None if token else (lambda _: False),
        body_limits={"/tidal/kv": MAX_KV_BLOB_BYTES + 1},
    )


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


async def _events(
    rid: str, model: str, first, stream, res: Result, chat: bool, parse: ToolParse | None, body
) -> AsyncIterator[bytes]:
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
