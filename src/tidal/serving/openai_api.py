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
from collections.abc import Callable
from typing import Annotated, Literal
from urllib.parse import quote

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from tidal.contracts.calls import version_spans
from tidal.serving.chat import MAX_PROMPT_CHARS, MAX_TOOLS, ChatMessage, Tool
from tidal.serving.protocol import (
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    SamplingParams,
    ServingError,
    TokenChunk,
    check_temperature,
)

__all__ = ["MAX_PROMPT_CHARS", "ChatMessage"]

MAX_PROMPT_IDS = 131_072  # token-id prompts (the served context is checked by the engine)
MAX_CHOICES = 16
INT64 = {"ge": -(2**63), "le": 2**63 - 1}
TokenId = Annotated[int, Field(strict=True, ge=0, le=2**31 - 1)]  # "4" and true refused


def check_stops(v):
    """``stop`` as OpenAI takes it (a string or a list), bounded: at most ``MAX_STOP_STRINGS``
    strings of 1 to ``MAX_STOP_CHARS`` characters (a ``ValueError`` naming the bound)."""
    stops = [v] if isinstance(v, str) else (v or [])
    if len(stops) > MAX_STOP_STRINGS or any(not 0 < len(x) <= MAX_STOP_CHARS for x in stops):
        raise ValueError(f"at most {MAX_STOP_STRINGS} strings of 1 to {MAX_STOP_CHARS} characters")
    return v


def _only(value, neutral, what: str):
    """A field accepted only at its neutral value: anything else would be silently ignored."""
    if value is not None and value != neutral:
        raise ValueError(f"not implemented: {what}")
    return value


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Body(BaseModel):
    # every field the server does not implement is refused by name (400), never ignored
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1, le=1_000_000)
    temperature: float | None = Field(None, ge=0.0, le=100.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    seed: int | None = Field(None, **INT64)
    stop: str | list[str] | None = Field(None)
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = Field(None, max_length=64)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=256)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # OpenAI-platform bookkeeping, no effect on sampling: accepted, not stored
    store: bool | None = None
    metadata: dict[str, str] | None = Field(None, max_length=16)
    return_token_ids: bool = False
    request_id: str | None = Field(None, max_length=256)
    kv_handle: str | None = Field(None, max_length=256)
    output_context: int = Field(
        0, ge=0, description="prompt tokens that are the call's earlier output (tidal extension)"
    )
    stream_interval_ms: float = Field(
        0.0, ge=0.0, le=1000.0, description="coalesce streamed tokens (tidal extension)"
    )

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, v):
        return _only(v, 0.0, "only 0 (no penalty)")

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, v):
        return _only(v, {}, "only an empty map")

    @field_validator("temperature")
    @classmethod
    def _computable(cls, v):
        return v if v is None else check_temperature(v)

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        return check_stops(v)

    def max_new_tokens(self, default: int) -> int:
        return self.max_tokens or default

    def sampling(self, default_max_tokens: int = 16) -> SamplingParams:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            max_tokens=self.max_new_tokens(default_max_tokens),
            temperature=1.0 if self.temperature is None else self.temperature,
            top_k=max(0, self.top_k or 0),
            top_p=1.0 if self.top_p is None else self.top_p,
            seed=self.seed,
            ignore_eos=self.ignore_eos,
            stop_token_ids=list(self.stop_token_ids or []),
            stop=stops,
        )


class CompletionRequest(_Body):
    prompt: (
        Annotated[str, Field(max_length=MAX_PROMPT_CHARS)]
        | Annotated[list[TokenId], Field(max_length=MAX_PROMPT_IDS)]
    ) = Field(..., description="text, or token ids")
    logprobs: int | None = Field(
        None,
        ge=0,
        le=0,
        description="0: each sampled token's log-prob (top alternatives are not computed)",
    )
    echo: bool = Field(False, description="refused when true")
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v):
        return _only(v, False, "the prompt is returned as prompt_token_ids")

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v):
        return _only(v, None, "no insertion mode")

    @model_validator(mode="after")
    def _best_of(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of: not implemented (only equal to n)")
        return self


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"] = Field(
        ..., description="json_object and json_schema are refused: no constrained decoding"
    )


class NamedTool(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: dict


class ChatRequest(_Body):
    messages: list[ChatMessage] = Field(..., min_length=1, max_length=4096)
    logprobs: bool = False
    top_logprobs: int | None = Field(
        None, ge=0, le=0, description="0 only: top alternatives are not computed"
    )
    max_completion_tokens: int | None = Field(None, ge=1, le=1_000_000)
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto"] | None = Field(
        None, description="'required' and a named function need constrained decoding: refused"
    )
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None

    @model_validator(mode="after")
    def _bounded(self) -> ChatRequest:
        chars = sum(len(m.text()) for m in self.messages)
        if chars > MAX_PROMPT_CHARS:
            raise ValueError(f"messages: {chars} characters in all, at most {MAX_PROMPT_CHARS}")
        if self.tool_choice is not None and not self.tools:
            raise ValueError("tool_choice: given without tools")
        return self

    def max_new_tokens(self, default: int) -> int:
        return self.max_tokens or self.max_completion_tokens or default

    @property
    def parses_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    def template_messages(self) -> list[dict]:
        """As the model's chat template reads them (rendered where the tokenizer is)."""
        return [m.to_template() for m in self.messages]

    def wire_messages(self) -> list[dict]:
        """As OpenAI sends them (what an engine's ``/tokenize`` takes)."""
        return [m.model_dump(exclude_none=True) for m in self.messages]

    def template_tools(self) -> list[dict] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None


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


def _offsets(token_texts: list[str]) -> list[int]:
    offsets, pos = [], 0
    for t in token_texts:
        offsets.append(pos)
        pos += len(t)
    return offsets


def completion_response(
    rid: str, model: str, results: list[Result], want_logprobs: bool, token_texts: list[list[str]]
) -> dict:
    choices = []
    for i, (res, texts) in enumerate(zip(results, token_texts, strict=True)):
        choice = {
            "index": i,
            "text": res.text,
            "token_ids": res.token_ids,
            "prompt_token_ids": res.prompt_token_ids,
            "finish_reason": res.finish_reason,
            "weight_versions": version_spans(res.versions),
            "logprobs": {
                "tokens": texts,
                "token_logprobs": res.logprobs,
                "top_logprobs": None,
                "text_offset": _offsets(texts),
            }
            if want_logprobs
            else None,
        }
        if res.kv_tokens is not None:
            choice["kv_tokens"] = res.kv_tokens
        choices.append(choice)
    return {
        "id": f"cmpl-{rid}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": _usage(results),
    }


ToolParse = Callable[[str], tuple[str | None, list[dict]]]


def chat_choice(
    i: int, res: Result, want_logprobs: bool, token_texts: list[str], parse: ToolParse | None
) -> dict:
    """One chat choice; with ``parse`` (tools offered) the text's tool calls become
    ``tool_calls`` and the finish reason ``tool_calls``."""
    message: dict = {"role": "assistant", "content": res.text}
    reason = res.finish_reason
    if parse is not None:
        content, calls = parse(res.text)
        if calls:
            message = {"role": "assistant", "content": content, "tool_calls": calls}
            reason = "tool_calls" if reason == "stop" else reason
    content = [
        {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
        for t, lp in zip(token_texts, res.logprobs, strict=False)
    ]
    return {
        "index": i,
        "message": message,
        "token_ids": res.token_ids,
        "finish_reason": reason,
        "weight_versions": version_spans(res.versions),
        "logprobs": {"content": content} if want_logprobs else None,
    }


def chat_response(
    rid: str,
    model: str,
    results: list[Result],
    want_logprobs: bool,
    token_texts: list[list[str]],
    parse: ToolParse | None = None,
) -> dict:
    choices = [
        chat_choice(i, res, want_logprobs, texts, parse)
        for i, (res, texts) in enumerate(zip(results, token_texts, strict=True))
    ]
    return {
        "id": f"chatcmpl-{rid}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": _usage(results),
        "prompt_token_ids": results[0].prompt_token_ids,
    }


def _usage(results: list[Result]) -> dict:
    n_prompt = len(results[0].prompt_token_ids)
    n_out = sum(len(r.token_ids) for r in results)
    return {
        "prompt_tokens": n_prompt,
        "completion_tokens": n_out,
        "total_tokens": n_prompt + n_out,
        "prompt_tokens_details": {"cached_tokens": results[0].cached_tokens},
    }


VERSIONS_HEADER = "X-Tidal-Weight-Versions"


def versions_header(results: list[Result]) -> str:
    """The weight versions of each choice's tokens: ``start-end=version`` spans joined by
    commas, choices by semicolons (``0-12=v3,12-20=v4;0-9=v4``); a version label is
    percent-encoded where it holds characters a header cannot carry."""
    return ";".join(
        ",".join(f"{a}-{b}={quote(v, safe='')}" for a, b, v in version_spans(r.versions))
        for r in results
    )


def sse_chunk(
    rid: str, model: str, chunk: TokenChunk, chat: bool, index: int = 0, delta: dict | None = None
) -> bytes:
    """One SSE event; ``tidal`` carries the raw token ids, log-probs and versions. ``delta``
    replaces a chat chunk's text delta (tool calls, held-back text)."""
    if chat:
        if delta is None:
            delta = {"content": chunk.text} if chunk.text else {}
        choice = {
            "index": index,
            "delta": delta,
            "finish_reason": chunk.finish_reason,
            "token_ids": chunk.token_ids,
        }
        body = {"id": f"chatcmpl-{rid}", "object": "chat.completion.chunk"}
    else:
        choice = {
            "index": index,
            "text": chunk.text,
            "finish_reason": chunk.finish_reason,
            "token_ids": chunk.token_ids,
        }
        body = {"id": f"cmpl-{rid}", "object": "text_completion"}
    body.update(
        {"created": int(time.time()), "model": model, "choices": [choice], "tidal": chunk.to_json()}
    )
    return f"data: {json.dumps(body)}\n\n".encode()


def tool_delta(text: str, parse: ToolParse) -> tuple[dict, bool]:
    """The closing delta of a streamed chat whose text was held back (tools offered): its
    content and its tool calls (indexed, as OpenAI streams them); True if it has calls."""
    content, calls = parse(text)
    delta: dict = {"content": content} if content else {}
    if calls:
        delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(calls)]
    return delta, bool(calls)


def sse_usage(rid: str, model: str, results: list[Result], chat: bool) -> bytes:
    """The last event when ``stream_options.include_usage``: no choices, the usage."""
    body = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{rid}",
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [],
        "usage": _usage(results),
    }
    return f"data: {json.dumps(body)}\n\n".encode()


SSE_DONE = b"data: [DONE]\n\n"


def error_body(message: str, status: int, code: str | None = None) -> dict:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "code": code or status}}


_UNION_TAGS = ("str", "int", "float", "bool", "list[", "dict[", "function-after[")


def validation_message(errors) -> str:
    """One line naming each bad field (a field the server does not implement says so)."""
    parts = []
    for err in list(errors)[:6]:
        loc = ".".join(
            str(x) for x in err.get("loc", ()) if x != "body" and not str(x).startswith(_UNION_TAGS)
        )
        msg = err.get("msg")
        if err.get("type") == "extra_forbidden":
            msg = "not supported by this server (refused, not ignored)"
        elif err.get("type") == "literal_error":
            msg = f"{msg} (other values are not implemented)"
        parts.append(f"{loc or 'body'}: {msg}")
    return "; ".join(dict.fromkeys(parts)) or "invalid request"


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
        return JSONResponse(
            error_body(str(exc.detail), exc.status_code),
            exc.status_code,
            headers=getattr(exc, "headers", None),
        )
