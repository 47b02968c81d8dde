"""The proxy's route handlers, one method each, over one proxy and its execution registry.

In: requests routed by ``proxy_app.build_proxy_app`` (FastAPI routes, and the ASGI fast path
that calls ``serve`` with a raw body). Out: OpenAI answers (whole or streamed), token-in
answers, registration and admin JSON. The hot path: ``serve`` (validate, name the execution,
tokenize, bridge) then ``answer_whole`` or ``answer_stream``.

Over 500 lines since the tree took ``ruff format``'s one-argument-per-line style (414 before):
every route's handler shares the one ``serve`` path (validate, name, tokenize, bridge), kept
together so each dialect goes through the same admission and records.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from typing import TYPE_CHECKING, Annotated

from fastapi import Depends, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from tidal.backends import NAME as BACKEND_NAME
from tidal.contracts.close import CloseReason
from tidal.errors import LedgerError, TimeoutExpired
from tidal.serving import anthropic_api, responses_api
from tidal.serving.chat import tool_parser
from tidal.serving.execution_identity import CALLER, Caller
from tidal.serving.executions import ExecutionRegistry
from tidal.serving.openai_api import (
    VERSIONS_HEADER,
    ChatRequest,
    CompletionRequest,
    chat_response,
    completion_response,
    error_body,
    versions_header,
)
from tidal.serving.protocol import BadRequest, NotFound, SamplingParams, ServingError, TokenChunk
from tidal.serving.proxy_set import process_figures
from tidal.serving.proxy_stream import stream_choices
from tidal.serving.token_in import TokenInRequest, token_in_json

if TYPE_CHECKING:
    from tidal.serving.proxy import Proxy

_bearer = HTTPBearer(auto_error=False)
AdminCreds = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
OpenAIBody = CompletionRequest | ChatRequest | TokenInRequest
MAX_METADATA_BYTES = 4096  # a registration's metadata, as JSON: kept while its execution is open


class Unauthorized(ServingError):
    status = 401


class Conflict(ServingError):
    status = 409


class JoinBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str = Field(..., min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:-]+$")
    url: str = Field(..., min_length=1, max_length=512, pattern=r"^https?://")
    # a registered backend's name (an unknown one: 400 listing the registered, ``make_adapter``)
    backend: str = Field("builtin", max_length=128, pattern=BACKEND_NAME.pattern)
    kind: str = Field("standalone", pattern="^(standalone|cell)$")
    cell_index: int = Field(0, ge=0, le=1_000_000)
    cap: int = Field(32, ge=1, le=1_000_000)
    model: str | None = Field(None, max_length=256)


class RegisterBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    execution_id: str | None = Field(
        None, min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:-]+$"
    )
    group_id: str = Field("default", min_length=1, max_length=128)
    metadata: dict = Field(default_factory=dict, description="at most 4 KiB as JSON")
    timeout_s: float | None = Field(
        None, gt=0, le=86_400, description="each model call's limit, queueing included"
    )

    @field_validator("metadata")
    @classmethod
    def _small(cls, value: dict) -> dict:
        size = len(json.dumps(value, separators=(",", ":")))
        if size > MAX_METADATA_BYTES:
            raise ValueError(f"{size} bytes as JSON, over the limit of {MAX_METADATA_BYTES}")
        return value


class CloseBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reward: float | None = Field(None, allow_inf_nan=False)
    reason: CloseReason = CloseReason.COMPLETED


REQUESTS: dict[str, type[BaseModel]] = {
    "completions": CompletionRequest,
    "chat": ChatRequest,
    "generate": TokenInRequest,
}
ROUTE_OF = {
    "completions": "/v1/completions",
    "chat": "/v1/chat/completions",
    "generate": "/inference/v1/generate",
}


def for_route(exc: ServingError, route: str) -> ServingError:
    """An engine's refusal (``adapters.raise_for``: it names the engine's route, whatever the
    caller called) as the caller's own route's error; any other error as it is."""
    detail = getattr(exc, "detail", None)
    return exc if detail is None else type(exc)(f"{route}: {detail}")


async def on_route(work, route: str):
    """``await work``, an engine's refusal named for the caller's ``route``."""
    try:
        return await work
    except ServingError as exc:
        raise for_route(exc, route) from None


def json_response(body: dict, headers: dict[str, str] | None = None) -> Response:
    """Serialised once with the stdlib (FastAPI's encoder walks every token id again)."""
    return Response(
        json.dumps(body, separators=(",", ":")).encode(),
        media_type="application/json",
        headers=headers,
    )


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice ``index`` of ``n``: with the caller's seed, each choice samples with its own
    (seed + index, within int64), so n choices are n samples, reproducibly."""
    if params.seed is None or index == 0:
        return params
    seed = (params.seed + index + 2**63) % 2**64 - 2**63
    return params.model_copy(update={"seed": seed})


ENGINE_FIELDS = ("kv_handle", "output_context")


def validate_body(raw: bytes, model: type[BaseModel]) -> BaseModel:
    """The body validated straight from its bytes; errors take the 400 path of FastAPI's."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors(include_url=False, include_context=False)) from None


class ProxyHandlers:
    """Every route of the proxy app as a method (FastAPI reads their signatures)."""

    def __init__(self, proxy: Proxy, registry: ExecutionRegistry) -> None:
        self.proxy, self.registry = proxy, registry
        self.parser = tool_parser(proxy.config.tool_call_parser)

    # -- helpers of the hot path ---------------------------------------------------------
    async def admin(self, creds: AdminCreds) -> None:
        """The dependency of admin routes: the run's admin token as bearer (a coroutine: FastAPI
        runs a plain function's dependency in its thread pool, a thread hop for each of the
        three admin calls every execution makes)."""
        token = self.proxy.config.admin_token
        if not token:
            raise Unauthorized("admin routes are disabled: no admin token configured")
        if creds is None or not hmac.compare_digest(creds.credentials.encode(), token.encode()):
            raise Unauthorized("missing or wrong bearer token")

    def execution_of(
        self, header: str | None, user: str | None, caller: Caller | None = None
    ) -> str | None:
        """The call's execution (header, else the body's ``user``), launched; None: none.
        The header was checked against ``caller`` at the door (``ExecutionIdentity``); the
        body's ``user`` is checked here: only a caller that may name it names it (401)."""
        eid = header or user
        if caller is None:  # not behind the door: no one proved anything
            caller = Caller(enforced=bool(self.proxy.config.admin_token))
        if header is None and user is not None and not caller.may_name(user):
            raise Unauthorized(caller.refusal(user))
        required = self.proxy.config.require_registration
        if eid is None:
            if required:
                raise BadRequest("name the execution with X-Tidal-Execution or user")
            return None
        try:
            state = self.registry.get(eid)
        except LedgerError:
            if required:
                raise NotFound(
                    f"unknown execution {eid!r}; register it with POST /tidal/executions"
                ) from None
            return eid
        if state.closed_reason is not None:
            raise Conflict(f"execution {eid!r} is closed ({state.closed_reason})")
        self.registry.launch(eid)
        return eid

    def check_model(self, name: str | None) -> None:
        served = {m.model for m in self.proxy.router.members.values() if m.model}
        if name is not None and served and name not in served:
            raise NotFound(f"model {name!r} is not served (serving {sorted(served)})")

    def timeout_of(self, eid: str | None) -> float | None:
        try:
            return self.registry.get(eid).metadata.get("timeout_s") if eid is not None else None
        except LedgerError:
            return None

    async def prompt_of(self, body: OpenAIBody, kind: str, eid: str | None) -> list[int]:
        """The call's prompt token ids (the engines tokenize text and chat messages)."""
        if kind == "chat":
            return await self.proxy.tokenize(
                messages=body.wire_messages(),
                tools=body.template_tools(),
                timeout_s=self.timeout_of(eid),
            )
        if kind == "generate":
            return body.token_ids
        if isinstance(body.prompt, list):
            return body.prompt
        return await self.proxy.tokenize(prompt=body.prompt, timeout_s=self.timeout_of(eid))

    async def serve(
        self,
        raw: bytes,
        header_eid: str | None,
        kind: str,
        session: str | None = None,
        caller: Caller | None = None,
    ) -> Response:
        """One OpenAI or token-in call from its raw body: the hot path, shared by the
        FastAPI routes (and their OpenAPI document) and the ASGI fast path in front of the
        framework. ``kind``: completions, chat or generate (token in); ``caller``: who
        calls (``ExecutionIdentity``'s ``scope["tidal.caller"]``). An engine's refusal is
        answered naming the caller's route."""
        return await on_route(self._serve(raw, header_eid, kind, session, caller), ROUTE_OF[kind])

    async def _serve(
        self,
        raw: bytes,
        header_eid: str | None,
        kind: str,
        session: str | None,
        caller: Caller | None,
    ) -> Response:
        t_entry = time.perf_counter()
        body = validate_body(raw, REQUESTS[kind])
        call, t_engine = await self.prepare(body, kind, header_eid, session, caller)
        if body.stream:
            return self.answer_stream(call)
        return await self.answer_whole(call, t_entry + t_engine)

    async def prepare(
        self,
        body: OpenAIBody,
        kind: str,
        header_eid: str | None,
        session: str | None,
        caller: Caller | None = None,
    ) -> tuple[_Call, float]:
        """A validated call on its way to the engines: its execution named (by ``caller``'s
        right, ``execution_of``) and launched, its model checked, its prompt tokenized (chat:
        bridged to the ids the model sampled earlier); also the seconds spent waiting on an
        engine to tokenize. Every route that samples (OpenAI, token in, Anthropic Messages,
        Responses) goes through here."""
        if header_eid is not None and len(header_eid) > 128:
            raise BadRequest("X-Tidal-Execution: at most 128 characters")
        if session is not None and len(session) > 256:
            raise BadRequest("X-Session-ID: at most 256 characters")
        for field in ENGINE_FIELDS:  # set by the proxy per attempt, never by a caller
            if getattr(body, field, None):
                raise BadRequest(f"{field}: an engine-side field the proxy sets itself")
        eid = self.execution_of(header_eid, body.user, caller)
        self.check_model(body.model)
        t_up = time.perf_counter()
        prompt = await self.prompt_of(body, kind, eid)
        bridged = None
        if kind == "chat" and eid is not None:  # the model's own ids for its earlier turns
            bridged = await self.proxy.bridge(eid, prompt)
        t_engine = time.perf_counter() - t_up  # an engine's time, not the proxy's
        if not prompt:
            raise BadRequest("prompt is empty")
        return _Call(
            eid, bridged or prompt, body, kind, session, bridged is not None, self.timeout_of(eid)
        ), t_engine

    def _model_name(self, body: OpenAIBody) -> str:
        return body.model or next((m.model for m in self.proxy.router.members.values()), "tidal")

    async def answer_whole(self, c: _Call, t_entry: float) -> Response:
        """A non-streamed answer: every choice complete, then one JSON body."""
        proxy, body, n = self.proxy, c.body, getattr(c.body, "n", 1)
        params, rid, model = body.sampling(), uuid.uuid4().hex, self._model_name(body)
        parse = self.parser if c.kind == "chat" and body.parses_tools else None
        # token in: streamed from the engine, so a call whose engine dies continues from
        # the tokens it had (a one-piece engine answer dies with its engine)
        keep = (lambda _: None) if c.kind == "generate" else None
        calls = [
            proxy.complete(
                c.eid,
                c.prompt,
                choice_params(params, i),
                on_chunk=keep,
                record_overhead=False,
                timeout_s=c.timeout_s,
                session=c.session,
                bridged=c.bridged,
            )
            for i in range(n)
        ]
        # one choice: awaited in this task (it takes its engine slot at once, in the
        # order calls arrive); n: side by side
        results = [await calls[0]] if n == 1 else list(await asyncio.gather(*calls))
        headers = {VERSIONS_HEADER: versions_header(results)}
        if c.kind == "generate":  # serialised as text (its per-token entries: docs/scale.md)
            resp = Response(
                token_in_json(rid, model, results[0]),
                media_type="application/json",
                headers=headers,
            )
        else:
            texts = [[f"token_id:{t}" for t in r.token_ids] for r in results]
            if c.kind == "chat":
                out = chat_response(rid, model, results, body.logprobs, texts, parse)
            else:
                out = completion_response(rid, model, results, body.logprobs is not None, texts)
            resp = json_response(out, headers)
        # the handler's own time: parsing, routing, records, serialising the answer
        proxy.overhead_s.append(time.perf_counter() - t_entry - max(r.upstream_s for r in results))
        return resp

    def answer_stream(self, c: _Call) -> StreamingResponse:
        """A streamed answer: each choice's chunks as server-sent events while they come."""
        body, n, chat = c.body, getattr(c.body, "n", 1), c.kind == "chat"
        params, rid, model = body.sampling(), uuid.uuid4().hex, self._model_name(body)
        parse = self.parser if chat and body.parses_tools else None
        queue: asyncio.Queue[tuple[int, TokenChunk | None]] = asyncio.Queue()
        tasks = [
            asyncio.create_task(
                on_route(
                    self.proxy.complete(
                        c.eid,
                        c.prompt,
                        choice_params(params, i),
                        on_chunk=lambda ch, i=i: queue.put_nowait((i, ch)),
                        timeout_s=c.timeout_s,
                        session=c.session,
                        bridged=c.bridged,
                    ),
                    ROUTE_OF[c.kind],
                )
            )
            for i in range(n)
        ]
        for i, task in enumerate(tasks):
            task.add_done_callback(lambda _, i=i: queue.put_nowait((i, None)))
        usage = body.stream_options is not None and body.stream_options.include_usage
        return StreamingResponse(
            stream_choices(rid, model, tasks, queue, chat, parse, usage),
            media_type="text/event-stream",
        )

    # -- OpenAI routes -------------------------------------------------------------------
    async def _route(self, request: Request, kind: str) -> Response:
        return await self.serve(
            await request.body(),
            request.headers.get("x-tidal-execution"),
            kind,
            request.headers.get("x-session-id"),
            request.scope.get(CALLER),
        )

    async def completions(self, request: Request) -> Response:
        return await self._route(request, "completions")

    async def chat(self, request: Request) -> Response:
        return await self._route(request, "chat")

    async def generate(self, request: Request) -> Response:
        return await self._route(request, "generate")

    async def messages(self, request: Request) -> Response:
        return await anthropic_api.messages(self, request)

    async def count_tokens(self, request: Request) -> Response:
        return await anthropic_api.count_tokens(self, request)

    async def responses(self, request: Request) -> Response:
        return await responses_api.responses(self, request)

    async def models(self) -> dict:
        cards: dict[str, dict] = {}
        for m in self.proxy.router.members.values():
            name = m.model or m.engine_id
            card = cards.setdefault(name, {"id": name, "object": "model", "owned_by": "tidal"})
            if m.max_model_len:  # the smallest context among the engines serving it
                card["max_model_len"] = min(
                    card.get("max_model_len", m.max_model_len), m.max_model_len
                )
        return {"object": "list", "data": [cards[n] for n in sorted(cards)]}

    async def health(self) -> Response:
        proxy = self.proxy
        serving = proxy.serving()
        body = {
            "status": "ok" if serving else "no engine serves",
            "engines": serving,
            "lost_engines": sorted(proxy.health.lost),
            "queued": len(proxy.queue),
        }
        if serving:
            return json_response(body)
        return Response(
            json.dumps({**error_body(body["status"], 503), **body}).encode(),
            503,
            media_type="application/json",
        )

    async def live(self) -> dict:
        return {"status": "ok"}

    # -- harness registration ------------------------------------------------------------
    async def register(self, body: RegisterBody | None = None) -> dict:
        body = body or RegisterBody()
        meta = {**body.metadata, **({"timeout_s": body.timeout_s} if body.timeout_s else {})}
        try:
            state = self.registry.dispatch(body.group_id, body.execution_id, meta)
        except LedgerError as exc:
            raise Conflict(str(exc)) from None
        return {"execution_id": state.execution_id, "group_id": state.group_id}

    async def close(self, execution_id: str, body: CloseBody | None = None) -> dict:
        body = body or CloseBody()
        try:
            first = self.registry.close(execution_id, body.reason, body.reward)
            state = self.registry.get(execution_id)
        except LedgerError as exc:
            raise NotFound(str(exc)) from None
        # the close this registry keeps (the first one): what the caller reports onwards
        return {
            "execution_id": execution_id,
            "closed": True,
            "duplicate": not first,
            "reason": state.closed_reason,
            "reward": state.reward,
            "calls": len(self.proxy.records.calls(execution_id)),
        }

    # -- admin ---------------------------------------------------------------------------
    async def records(self, execution_id: str) -> Response:
        """``{execution_id, calls}``, each call serialised by pydantic's own JSON writer
        (FastAPI's encoder walked every token id of every record: 74 % of the proxy's CPU
        while 10,000 executions closed in the 256-GPU stress, docs/scale.md)."""
        calls = ",".join(c.model_dump_json() for c in self.proxy.records.calls(execution_id))
        head = json.dumps({"execution_id": execution_id}, separators=(",", ":"))[:-1]
        return Response(f'{head},"calls":[{calls}]}}'.encode(), media_type="application/json")

    async def engines(self) -> dict:
        return {"engines": [m.describe() for m in self.proxy.router.members.values()]}

    async def join(self, body: JoinBody) -> dict:
        member = await self.proxy.join(
            body.id,
            body.url,
            body.backend,  # type: ignore[arg-type]
            body.kind,
            body.cell_index,
            body.cap,
            body.model,
        )
        return member.describe()

    async def leave(self, engine_id: str, drain: bool = Query(True)) -> dict:
        await self.proxy.leave(engine_id, drain=drain)
        return {"engine": engine_id, "left": True}

    async def drain(self, engine_id: str, handoff: bool | None = Query(None)) -> dict:
        try:
            return await self.proxy.drain(engine_id, handoff)
        except TimeoutExpired as exc:
            raise Conflict(str(exc)) from None

    async def undrain(self, engine_id: str) -> dict:
        return self.proxy.undrain(engine_id).describe()

    async def stats(self, reset_overhead: bool = Query(False)) -> dict:
        registry = self.registry
        return {
            **self.proxy.stats(reset_overhead),
            "open_executions": registry.open_count(),
            "registered_executions": len(registry),
            "expired_executions": registry.expired,
            "duplicate_closes": registry.duplicate_closes,
            "process": process_figures(),  # this process's CPU seconds and memory
        }


class _Call:
    """One validated call on its way to the engines."""

    __slots__ = ("body", "bridged", "eid", "kind", "prompt", "session", "timeout_s")

    def __init__(
        self,
        eid: str | None,
        prompt: list[int],
        body: OpenAIBody,
        kind: str,
        session: str | None,
        bridged: bool,
        timeout_s: float | None,
    ) -> None:
        self.eid, self.prompt, self.body, self.kind = eid, prompt, body, kind
        self.session, self.bridged, self.timeout_s = session, bridged, timeout_s
