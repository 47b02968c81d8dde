"""HTTP front of the proxy (``tidal proxy``): the OpenAI door for harnesses, the execution
registration routes for external harnesses, and bearer-protected admin routes.

In: OpenAI requests (``/v1/completions``, ``/v1/chat/completions``) and vLLM's token-in
``/inference/v1/generate``, naming their execution by ``X-Tidal-Execution`` (or ``user``) and
their session (engine affinity) by ``X-Session-ID``; admin calls. Out: one normal answer per
request (retries across engines are invisible), JSON or SSE, with the tokens' weight versions
also in the ``X-Tidal-Weight-Versions`` header.
Admin: ``/tidal/engines`` (GET list, POST join), ``DELETE /tidal/engines/{id}``,
``/tidal/engines/{id}/drain``, ``/tidal/engines/{id}/undrain``, ``/tidal/stats``,
``/tidal/executions/{id}/records``. Harness: ``POST /tidal/executions`` (open, body at most 1 MiB,
metadata at most 4 KiB; the registry is bounded and forgets closed and idle executions),
``POST /tidal/executions/{id}/close`` (the token: it sets the execution's reward).

Access (``guard.Guard``): the OpenAI routes, ``/health`` and registration are open on loopback;
bound elsewhere every route but ``/health`` / ``/live`` needs the token. ``/docs`` and
``/openapi.json`` always need it. ``/health`` answers 503 while no engine serves; ``/live``
says only that the process is up. A non-streamed caller that hangs up cancels its call (its
engine request is aborted with it).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Annotated

from fastapi import Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import Response, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from tidal.errors import LedgerError, TimeoutExpired
from tidal.serving.chat import tool_parser
from tidal.serving.execution_identity import ExecutionIdentity
from tidal.serving.executions import CLOSE_REASONS, EventLog, ExecutionRegistry
from tidal.serving.fast_path import MAX_BODY_BYTES, FastPath
from tidal.serving.guard import CatchAll, Guard, is_loopback
from tidal.serving.openai_api import (
    VERSIONS_HEADER,
    ChatRequest,
    CompletionRequest,
    chat_response,
    completion_response,
    error_body,
    install_error_handlers,
    versions_header,
)
from tidal.serving.protocol import (
    BadRequest,
    NotFound,
    SamplingParams,
    ServingError,
    TokenChunk,
)
from tidal.serving.proxy import Proxy
from tidal.serving.proxy_stream import stream_choices
from tidal.serving.token_in import TokenInRequest, token_in_response

_bearer = HTTPBearer(auto_error=False)
AdminCreds = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]


class Unauthorized(ServingError):
    status = 401


class Conflict(ServingError):
    status = 409


MAX_CONTROL_BODY_BYTES = 1 << 20  # registration, close, admin: small JSON bodies
MAX_METADATA_BYTES = 4096  # a registration's metadata, as JSON: kept while its execution is open
ALWAYS_OPEN = frozenset({"/health", "/live"})
DOCS = frozenset({"/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})
log = logging.getLogger(__name__)


class JoinBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str = Field(..., min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:-]+$")
    url: str = Field(..., min_length=1, max_length=512, pattern=r"^https?://")
    backend: str = Field("builtin", pattern="^(builtin|vllm|sglang)$")
    kind: str = Field("standalone", pattern="^(standalone|cell)$")
    cell_index: int = Field(0, ge=0, le=1_000_000)
    cap: int = Field(32, ge=1, le=1_000_000)
    model: str | None = Field(None, max_length=256)


class RegisterBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    execution_id: str | None = Field(None, min_length=1, max_length=128,
                                     pattern=r"^[A-Za-z0-9_.:-]+$")
    group_id: str = Field("default", min_length=1, max_length=128)
    metadata: dict = Field(default_factory=dict, description="at most 4 KiB as JSON")
    timeout_s: float | None = Field(None, gt=0, le=86_400,
                                    description="each model call's limit, queueing included")

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
    reason: str = Field("completed", pattern="^(" + "|".join(CLOSE_REASONS) + ")$")


def _json(body: dict, headers: dict[str, str] | None = None) -> Response:
    """Serialised once with the stdlib (FastAPI's encoder walks every token id again)."""
    return Response(json.dumps(body, separators=(",", ":")).encode(),
                    media_type="application/json", headers=headers)


REQUESTS: dict[str, type[BaseModel]] = {"completions": CompletionRequest, "chat": ChatRequest,
                                        "generate": TokenInRequest}


def _choice(params: SamplingParams, index: int) -> SamplingParams:
    """Choice ``index`` of ``n``: with the caller's seed, each choice samples with its own
    (seed + index, within int64), so n choices are n samples, reproducibly."""
    if params.seed is None or index == 0:
        return params
    seed = (params.seed + index + 2**63) % 2**64 - 2**63
    return params.model_copy(update={"seed": seed})


def _validate(raw: bytes, model: type[BaseModel]):
    """The body validated straight from its bytes; errors take the 400 path of FastAPI's."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors(include_url=False, include_context=False)
                                     ) from None


_EXECUTION_HEADER = {"name": "X-Tidal-Execution", "in": "header", "required": False,
                     "schema": {"type": "string", "maxLength": 128}}


def _body_spec(model: type[BaseModel]) -> dict:
    """OpenAPI of a route that parses its body itself (the document stays complete)."""
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"parameters": [_EXECUTION_HEADER],
            "requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def needs_token(open_api: bool) -> Callable[[str], bool]:
    """Which paths need the token: docs and close always, admin routes check it themselves;
    with ``open_api`` False (bound beyond loopback) everything but the health routes."""
    def check(path: str) -> bool:
        if path in ALWAYS_OPEN:
            return False
        return path in DOCS or path.endswith("/close") or not open_api
    return check


def build_proxy_app(proxy: Proxy, registry: ExecutionRegistry | None = None,
                    on_startup: Callable[[], Awaitable[None]] | None = None) -> ExecutionIdentity:
    """The proxy's ASGI app: ``ExecutionIdentity`` (an execution named by its URL or key)
    over ``Guard`` over the fast OpenAI path over FastAPI."""
    registry = registry or ExecutionRegistry(
        EventLog(max_events=30_000), max_open=10_000, max_closed=10_000,
        idle_s=proxy.config.execution_idle_s + proxy.config.request_timeout_s)
    parser = tool_parser(proxy.config.tool_call_parser)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        if on_startup is not None:
            await on_startup()
        proxy.health.start()
        yield
        await proxy.close()

    app = FastAPI(title="tidal proxy", lifespan=lifespan)
    install_error_handlers(app)
    app.add_middleware(CatchAll)
    app.state.proxy, app.state.registry = proxy, registry

    def admin(creds: AdminCreds) -> None:
        token = proxy.config.admin_token
        if not token:
            raise Unauthorized("admin routes are disabled: no admin token configured")
        if creds is None or not hmac.compare_digest(creds.credentials.encode(), token.encode()):
            raise Unauthorized("missing or wrong bearer token")

    def execution_of(header: str | None, user: str | None) -> str | None:
        eid = header or user
        if eid is None:
            if proxy.config.require_registration:
                raise BadRequest("name the execution with X-Tidal-Execution or user")
            return None
        try:
            state = registry.get(eid)
        except LedgerError:
            if proxy.config.require_registration:
                raise NotFound(f"unknown execution {eid!r}; register it with "
                               f"POST /tidal/executions") from None
            return eid
        if state.closed_reason is not None:
            raise Conflict(f"execution {eid!r} is closed ({state.closed_reason})")
        registry.launch(eid)
        return eid

    def check_model(name: str | None) -> None:
        served = {m.model for m in proxy.router.members.values() if m.model}
        if name is not None and served and name not in served:
            raise NotFound(f"model {name!r} is not served (serving {sorted(served)})")

    def timeout_of(eid: str | None) -> float | None:
        try:
            return registry.get(eid).metadata.get("timeout_s") if eid is not None else None
        except LedgerError:
            return None

    async def answer(eid: str | None, prompt: list[int], body, kind: str, t_entry: float,
                     session: str | None, bridged: bool):
        params = body.sampling()
        timeout_s = timeout_of(eid)
        rid = uuid.uuid4().hex
        model = body.model or next((m.model for m in proxy.router.members.values()), "tidal")
        chat = kind == "chat"
        parse = parser if chat and body.parses_tools else None
        n = getattr(body, "n", 1)
        if not body.stream:
            # token in: streamed from the engine, so a call whose engine dies continues from
            # the tokens it had (a one-piece engine answer dies with its engine)
            keep = (lambda _: None) if kind == "generate" else None
            calls = [proxy.complete(eid, prompt, _choice(params, i), on_chunk=keep,
                                    record_overhead=False, timeout_s=timeout_s,
                                    session=session, bridged=bridged) for i in range(n)]
            # one choice: awaited in this task (it takes its engine slot at once, in the
            # order calls arrive); n: side by side
            results = [await calls[0]] if n == 1 else list(await asyncio.gather(*calls))
            texts = [[f"token_id:{t}" for t in r.token_ids] for r in results]
            if kind == "generate":
                out = token_in_response(rid, model, results[0])
            elif chat:
                out = chat_response(rid, model, results, body.logprobs, texts, parse)
            else:
                out = completion_response(rid, model, results, body.logprobs is not None,
                                          texts)
            resp = _json(out, {VERSIONS_HEADER: versions_header(results)})
            # the handler's own time: parsing, routing, records, serialising the answer
            proxy.overhead_s.append(time.perf_counter() - t_entry
                                    - max(r.upstream_s for r in results))
            return resp
        queue: asyncio.Queue[tuple[int, TokenChunk | None]] = asyncio.Queue()
        tasks = [asyncio.create_task(proxy.complete(
            eid, prompt, _choice(params, i), on_chunk=lambda c, i=i: queue.put_nowait((i, c)),
            timeout_s=timeout_s, session=session, bridged=bridged)) for i in range(n)]
        for i, task in enumerate(tasks):
            task.add_done_callback(lambda _, i=i: queue.put_nowait((i, None)))
        usage = body.stream_options is not None and body.stream_options.include_usage
        return StreamingResponse(stream_choices(rid, model, tasks, queue, chat, parse, usage),
                                 media_type="text/event-stream")

    async def serve(raw: bytes, header_eid: str | None, kind: str,
                    session: str | None = None):
        """One OpenAI or token-in call from its raw body: the hot path, shared by the
        FastAPI routes (and their OpenAPI document) and the ASGI fast path in front of the
        framework. ``kind``: completions, chat or generate (token in)."""
        t_entry = time.perf_counter()
        body = _validate(raw, REQUESTS[kind])
        if header_eid is not None and len(header_eid) > 128:
            raise BadRequest("X-Tidal-Execution: at most 128 characters")
        if session is not None and len(session) > 256:
            raise BadRequest("X-Session-ID: at most 256 characters")
        eid = execution_of(header_eid, body.user)
        check_model(body.model)
        t_up = time.perf_counter()
        if kind == "chat":
            prompt = await proxy.tokenize(messages=body.wire_messages(),
                                          tools=body.template_tools(),
                                          timeout_s=timeout_of(eid))
        elif kind == "generate":
            prompt = body.token_ids
        elif isinstance(body.prompt, list):
            prompt = body.prompt
        else:
            prompt = await proxy.tokenize(prompt=body.prompt, timeout_s=timeout_of(eid))
        bridged = None
        if kind == "chat" and eid is not None:  # the model's own ids for its earlier turns
            bridged = await proxy.bridge(eid, prompt)
        t_entry += time.perf_counter() - t_up  # an engine's time, not the proxy's
        if not prompt:
            raise BadRequest("prompt is empty")
        return await answer(eid, bridged or prompt, body, kind, t_entry, session,
                            bridged is not None)

    @app.post("/v1/completions", openapi_extra=_body_spec(CompletionRequest))
    async def completions(request: Request):
        return await serve(await request.body(), request.headers.get("x-tidal-execution"),
                           "completions", request.headers.get("x-session-id"))

    @app.post("/v1/chat/completions", openapi_extra=_body_spec(ChatRequest))
    async def chat(request: Request):
        return await serve(await request.body(), request.headers.get("x-tidal-execution"),
                           "chat", request.headers.get("x-session-id"))

    @app.post("/inference/v1/generate", openapi_extra=_body_spec(TokenInRequest))
    async def generate(request: Request):
        return await serve(await request.body(), request.headers.get("x-tidal-execution"),
                           "generate", request.headers.get("x-session-id"))

    @app.get("/v1/models")
    async def models():
        cards: dict[str, dict] = {}
        for m in proxy.router.members.values():
            name = m.model or m.engine_id
            card = cards.setdefault(name, {"id": name, "object": "model", "owned_by": "tidal"})
            if m.max_model_len:  # the smallest context among the engines serving it
                card["max_model_len"] = min(card.get("max_model_len", m.max_model_len),
                                            m.max_model_len)
        return {"object": "list", "data": [cards[n] for n in sorted(cards)]}

    @app.get("/health")
    async def health():
        serving = proxy.serving()
        body = {"status": "ok" if serving else "no engine serves", "engines": serving,
                "lost_engines": sorted(proxy.health.lost), "queued": len(proxy.queue)}
        if serving:
            return _json(body)
        return Response(json.dumps({**error_body(body["status"], 503), **body}).encode(), 503,
                        media_type="application/json")

    @app.get("/live")
    async def live():
        return {"status": "ok"}

    # -- harness registration ------------------------------------------------------------
    @app.post("/tidal/executions")
    async def register(body: RegisterBody | None = None):
        body = body or RegisterBody()
        meta = {**body.metadata, **({"timeout_s": body.timeout_s} if body.timeout_s else {})}
        try:
            state = registry.dispatch(body.group_id, body.execution_id, meta)
        except LedgerError as exc:
            raise Conflict(str(exc)) from None
        return {"execution_id": state.execution_id, "group_id": state.group_id}

    @app.post("/tidal/executions/{execution_id}/close")
    async def close(execution_id: str, body: CloseBody | None = None):
        body = body or CloseBody()
        try:
            first = registry.close(execution_id, body.reason, body.reward)
        except LedgerError as exc:
            raise NotFound(str(exc)) from None
        return {"execution_id": execution_id, "closed": True, "duplicate": not first,
                "calls": len(proxy.records.calls(execution_id))}

    # -- admin ---------------------------------------------------------------------------
    @app.get("/tidal/executions/{execution_id}/records", dependencies=[Depends(admin)])
    async def records(execution_id: str):
        return {"execution_id": execution_id,
                "calls": [c.to_json() for c in proxy.records.calls(execution_id)]}

    @app.get("/tidal/engines", dependencies=[Depends(admin)])
    async def engines():
        return {"engines": [m.describe() for m in proxy.router.members.values()]}

    @app.post("/tidal/engines", dependencies=[Depends(admin)])
    async def join(body: JoinBody):
        member = await proxy.join(body.id, body.url, body.backend, body.kind,  # type: ignore[arg-type]
                                  body.cell_index, body.cap, body.model)
        return member.describe()

    @app.delete("/tidal/engines/{engine_id}", dependencies=[Depends(admin)])
    async def leave(engine_id: str, drain: bool = Query(True)):
        await proxy.leave(engine_id, drain=drain)
        return {"engine": engine_id, "left": True}

    @app.post("/tidal/engines/{engine_id}/drain", dependencies=[Depends(admin)])
    async def drain(engine_id: str, handoff: bool | None = Query(None)):
        try:
            return await proxy.drain(engine_id, handoff)
        except TimeoutExpired as exc:
            raise Conflict(str(exc)) from None

    @app.post("/tidal/engines/{engine_id}/undrain", dependencies=[Depends(admin)])
    async def undrain(engine_id: str):
        return proxy.undrain(engine_id).describe()

    @app.get("/tidal/stats", dependencies=[Depends(admin)])
    async def stats(reset_overhead: bool = Query(False)):
        return {**proxy.stats(reset_overhead), "open_executions": registry.open_count(),
                "registered_executions": len(registry),
                "expired_executions": registry.expired,
                "duplicate_closes": registry.duplicate_closes}

    def openapi() -> dict:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            for model in (CompletionRequest, ChatRequest, TokenInRequest):
                spec = model.model_json_schema(ref_template="#/components/schemas/{model}")
                schemas.update(spec.pop("$defs", {}))
                schemas[model.__name__] = spec
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    open_api = is_loopback(proxy.config.host)
    guard = Guard(FastPath(app, serve), proxy.config.admin_token, needs_token(open_api),
                  max_body=MAX_CONTROL_BODY_BYTES, body_limits={"/v1/": MAX_BODY_BYTES})
    return ExecutionIdentity(guard, proxy.config.admin_token)
