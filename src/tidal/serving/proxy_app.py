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

import logging
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from fastapi import Depends, FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from tidal.serving.anthropic_api import CountTokensRequest, MessagesRequest
from tidal.serving.execution_identity import ExecutionIdentity
from tidal.serving.executions import EventLog, ExecutionRegistry
from tidal.serving.fast_path import MAX_BODY_BYTES, FastPath
from tidal.serving.guard import CatchAll, Guard, is_loopback
from tidal.serving.openai_api import ChatRequest, CompletionRequest, install_error_handlers
from tidal.serving.proxy_handlers import (
    MAX_METADATA_BYTES,
    CloseBody,
    Conflict,
    JoinBody,
    ProxyHandlers,
    RegisterBody,
    Unauthorized,
)
from tidal.serving.responses_api import ResponsesRequest
from tidal.serving.token_in import TokenInRequest

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from tidal.serving.proxy import Proxy

__all__ = ["MAX_METADATA_BYTES", "CloseBody", "Conflict", "JoinBody", "RegisterBody",
           "Unauthorized", "build_proxy_app", "needs_token"]

MAX_CONTROL_BODY_BYTES = 1 << 20  # registration, close, admin: small JSON bodies
ALWAYS_OPEN = frozenset({"/health", "/live"})
DOCS = frozenset({"/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})
log = logging.getLogger(__name__)

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


#: (method, path, handler name, admin only, body model the handler parses itself), in the
#: order FastAPI matches them
ROUTES: tuple[tuple[str, str, str, bool, type[BaseModel] | None], ...] = (
    ("POST", "/v1/completions", "completions", False, CompletionRequest),
    ("POST", "/v1/chat/completions", "chat", False, ChatRequest),
    ("POST", "/inference/v1/generate", "generate", False, TokenInRequest),
    ("POST", "/v1/messages", "messages", False, MessagesRequest),
    ("POST", "/v1/messages/count_tokens", "count_tokens", False, CountTokensRequest),
    ("POST", "/v1/responses", "responses", False, ResponsesRequest),
    ("GET", "/v1/models", "models", False, None),
    ("GET", "/health", "health", False, None),
    ("GET", "/live", "live", False, None),
    ("POST", "/tidal/executions", "register", False, None),
    ("POST", "/tidal/executions/{execution_id}/close", "close", False, None),
    ("GET", "/tidal/executions/{execution_id}/records", "records", True, None),
    ("GET", "/tidal/engines", "engines", True, None),
    ("POST", "/tidal/engines", "join", True, None),
    ("DELETE", "/tidal/engines/{engine_id}", "leave", True, None),
    ("POST", "/tidal/engines/{engine_id}/drain", "drain", True, None),
    ("POST", "/tidal/engines/{engine_id}/undrain", "undrain", True, None),
    ("GET", "/tidal/stats", "stats", True, None),
)


def _openapi(app: FastAPI) -> Callable[[], dict]:
    """The OpenAPI document, with the schemas of the bodies the hot path parses itself."""
    def openapi() -> dict:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            for model in (CompletionRequest, ChatRequest, TokenInRequest, MessagesRequest,
                          CountTokensRequest, ResponsesRequest):
                spec = model.model_json_schema(ref_template="#/components/schemas/{model}")
                schemas.update(spec.pop("$defs", {}))
                schemas[model.__name__] = spec
            app.openapi_schema = doc
        return app.openapi_schema
    return openapi


def build_proxy_app(proxy: Proxy, registry: ExecutionRegistry | None = None,
                    on_startup: Callable[[], Awaitable[None]] | None = None) -> ExecutionIdentity:
    """The proxy's ASGI app: ``ExecutionIdentity`` (an execution named by its URL or key)
    over ``Guard`` over the fast OpenAI path over FastAPI (routes: ``ROUTES``, handled by
    ``proxy_handlers.ProxyHandlers``)."""
    registry = registry or ExecutionRegistry(
        EventLog(max_events=30_000), max_open=10_000, max_closed=10_000,
        idle_s=proxy.config.execution_idle_s + proxy.config.request_timeout_s)
    handlers = ProxyHandlers(proxy, registry)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if on_startup is not None:
            await on_startup()
        proxy.health.start()
        yield
        await proxy.close()

    app = FastAPI(title="tidal proxy", lifespan=lifespan)
    install_error_handlers(app)
    app.add_middleware(CatchAll)
    app.state.proxy, app.state.registry = proxy, registry
    admin = [Depends(handlers.admin)]
    for method, path, name, admin_only, body in ROUTES:
        app.add_api_route(path, getattr(handlers, name), methods=[method], response_model=None,
                          dependencies=admin if admin_only else None,
                          openapi_extra=_body_spec(body) if body is not None else None)
    app.openapi = _openapi(app)  # type: ignore[method-assign]
    open_api = is_loopback(proxy.config.host)
    guard = Guard(FastPath(app, handlers.serve), proxy.config.admin_token,
                  needs_token(open_api), max_body=MAX_CONTROL_BODY_BYTES,
                  body_limits={"/v1/": MAX_BODY_BYTES})
    return ExecutionIdentity(guard, proxy.config.admin_token)
