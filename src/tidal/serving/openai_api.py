"""The OpenAI-compatible subset spoken by the built-in engine and the proxy: request bodies,
response bodies, SSE chunks and the error envelope.

In: JSON bodies of ``/v1/completions`` and ``/v1/chat/completions``. Out: OpenAI-shaped JSON with
the vLLM-style extensions tidal relies on (``token_ids``, ``prompt_token_ids``, per-token
``weight_versions`` spans, ``usage.prompt_tokens_details.cached_tokens``). Bad input becomes a
4xx with ``{"error": {"message", "type", "code"}}``, never a traceback.
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from tidal.serving.protocol import SamplingParams, ServingError, TokenChunk, version_spans

MAX_PROMPT_CHARS = 131_072  # text prompts: bounds the tokenizer's work per call
MAX_PROMPT_IDS = 131_072  # token-id prompts (the served context is checked by the engine)
INT64 = {"ge": -(2**63), "le": 2**63 - 1}
TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1, le=1_000_000)
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_k: int = Field(0, ge=0)
    seed: int | None = Field(None, **INT64)
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] = Field(default_factory=list, max_length=64)
    stream: bool = False
    user: str | None = Field(None, max_length=256)
    return_token_ids: bool = False
    request_id: str | None = Field(None, max_length=256)
    kv_handle: str | None = Field(None, max_length=256)
    stream_interval_ms: float = Field(0.0, ge=0.0, le=1000.0,
                                      description="coalesce streamed tokens (tidal extension)")

    def sampling(self, default_max_tokens: int = 16) -> SamplingParams:
        return SamplingParams(max_tokens=self.max_tokens or default_max_tokens,
                              temperature=self.temperature, top_k=self.top_k, seed=self.seed,
                              ignore_eos=self.ignore_eos, stop_token_ids=self.stop_token_ids)


class CompletionRequest(_Body):
    prompt: (Annotated[str, Field(max_length=MAX_PROMPT_CHARS)]
             | Annotated[list[TokenId], Field(max_length=MAX_PROMPT_IDS)]) = Field(
        ..., description="text, or token ids")
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool"]
    content: str = Field(..., max_length=MAX_PROMPT_CHARS)


class ChatRequest(_Body):
    messages: list[ChatMessage] = Field(..., min_length=1, max_length=4096)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    max_completion_tokens: int | None = Field(None, ge=1, le=1_000_000)

    @model_validator(mode="after")
    def _bounded(self) -> ChatRequest:
        chars = sum(len(m.content) for m in self.messages)
        if chars > MAX_PROMPT_CHARS:
            raise ValueError(f"messages: {chars} characters in all, at most {MAX_PROMPT_CHARS}")
        return self

    def sampling(self, default_max_tokens: int = 16) -> SamplingParams:
        params = super().sampling(default_max_tokens)
        if self.max_completion_tokens and not self.max_tokens:
            params.max_tokens = self.max_completion_tokens
        return params


class Result:
    """A finished generation, assembled from chunks (possibly from several engines)."""

    def __init__(self, prompt_token_ids: list[int]) -> None:
        self.prompt_token_ids = prompt_token_ids
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[str] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.cached_tokens = 0
        self.upstream_s = 0.0  # proxy: time spent waiting on engines (not its own cost)
        self.kv_tokens: int | None = None  # engine: on an abort, the tokens it holds KV for

    def add(self, chunk: TokenChunk) -> None:
        self.token_ids += chunk.token_ids
        self.logprobs += chunk.logprobs
        self.versions += chunk.versions
        self.text += chunk.text
        if chunk.finish_reason:
            self.finish_reason = chunk.finish_reason
            self.kv_tokens = chunk.kv_tokens


def completion_response(rid: str, model: str, res: Result, want_logprobs: bool,
                        token_texts: list[str]) -> dict:
    offsets, pos = [], 0
    for t in token_texts:
        offsets.append(pos)
        pos += len(t)
    choice = {"index": 0, "text": res.text, "token_ids": res.token_ids,
              "prompt_token_ids": res.prompt_token_ids, "finish_reason": res.finish_reason,
              "weight_versions": version_spans(res.versions),
              "logprobs": {"tokens": token_texts, "token_logprobs": res.logprobs,
                           "top_logprobs": None, "text_offset": offsets}
              if want_logprobs else None}
    if res.kv_tokens is not None:
        choice["kv_tokens"] = res.kv_tokens
    return {"id": f"cmpl-{rid}", "object": "text_completion", "created": int(time.time()),
            "model": model, "choices": [choice], "usage": _usage(res)}


def chat_response(rid: str, model: str, res: Result, want_logprobs: bool,
                  token_texts: list[str]) -> dict:
    content = [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
               for t, lp in zip(token_texts, res.logprobs, strict=False)]
    choice = {"index": 0, "message": {"role": "assistant", "content": res.text},
              "token_ids": res.token_ids, "finish_reason": res.finish_reason,
              "weight_versions": version_spans(res.versions),
              "logprobs": {"content": content} if want_logprobs else None}
    return {"id": f"chatcmpl-{rid}", "object": "chat.completion", "created": int(time.time()),
            "model": model, "choices": [choice], "usage": _usage(res),
            "prompt_token_ids": res.prompt_token_ids}


def _usage(res: Result) -> dict:
    n_prompt, n_out = len(res.prompt_token_ids), len(res.token_ids)
    return {"prompt_tokens": n_prompt, "completion_tokens": n_out,
            "total_tokens": n_prompt + n_out,
            "prompt_tokens_details": {"cached_tokens": res.cached_tokens}}


def sse_chunk(rid: str, model: str, chunk: TokenChunk, chat: bool) -> bytes:
    """One SSE event; ``tidal`` carries the raw token ids, log-probs and versions."""
    if chat:
        choice = {"index": 0, "delta": {"content": chunk.text} if chunk.text else {},
                  "finish_reason": chunk.finish_reason, "token_ids": chunk.token_ids}
        body = {"id": f"chatcmpl-{rid}", "object": "chat.completion.chunk"}
    else:
        choice = {"index": 0, "text": chunk.text, "finish_reason": chunk.finish_reason,
                  "token_ids": chunk.token_ids}
        body = {"id": f"cmpl-{rid}", "object": "text_completion"}
    body.update({"created": int(time.time()), "model": model, "choices": [choice],
                 "tidal": chunk.to_json()})
    return f"data: {json.dumps(body)}\n\n".encode()


SSE_DONE = b"data: [DONE]\n\n"


def error_body(message: str, status: int, code: str | None = None) -> dict:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "code": code or status}}


def validation_message(errors) -> str:
    parts = []
    for err in list(errors)[:5]:
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        parts.append(f"{loc or 'body'}: {err.get('msg')}")
    return "; ".join(parts) or "invalid request"


def install_error_handlers(app: FastAPI) -> None:
    """Translate every failure at the HTTP boundary into an OpenAI-style error envelope."""

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(error_body(validation_message(exc.errors()), 400), 400)

    @app.exception_handler(ServingError)
    async def _serving(_: Request, exc: ServingError) -> JSONResponse:
        return JSONResponse(error_body(str(exc), exc.status), exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(exc.detail), exc.status_code), exc.status_code,
                            headers=getattr(exc, "headers", None))
