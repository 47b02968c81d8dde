"""HTTP front of the proxy (``tidal proxy``): the OpenAI door for harnesses, the execution
registration routes of the driver, and the admin routes.

In: OpenAI requests (``/v1/completions``, ``/v1/chat/completions``) and vLLM's token-in
``/inference/v1/generate``, naming their execution by an execution's key or base URL (or, with
the admin token, ``X-Tidal-Execution`` or ``user``) and their session (engine affinity) by
``X-Session-ID``; admin calls. Out: one normal answer per request (retries across engines are
invisible), JSON or SSE, with the tokens' weight versions also in the
``X-Tidal-Weight-Versions`` header.
Admin: ``/tidal/engines`` (GET list, POST join), ``DELETE /tidal/engines/{id}``,
``/tidal/engines/{id}/drain``, ``/tidal/engines/{id}/undrain``, ``/tidal/stats``,
``/tidal/executions/{id}/records``, ``POST /tidal/executions`` (open an execution, body at most
1 MiB, metadata at most 4 KiB; the registry is bounded and forgets closed and idle executions),
``POST /tidal/executions/{id}/close`` (it sets the execution's reward).

Access (``execution_identity.ExecutionIdentity``, from the ``access`` column of ``ROUTES``):
``"model"`` routes take the admin token, an execution's key (its own calls only) or, on
loopback, no credential; ``"open"`` routes take anyone; every other path (``"admin"`` rows,
``/docs``, unknown paths) only the admin token. A new model-call route (a dialect) is a
``"model"`` row. ``/health`` answers 503 while no engine serves; ``/live`` says only that the
process is up. A non-streamed caller that hangs up cancels its call (its engine request is
aborted with it).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Literal

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

__all__ = [
    "MAX_METADATA_BYTES",
    "CloseBody",
    "Conflict",
    "JoinBody",
    "RegisterBody",
    "Unauthorized",
    "build_proxy_app",
    "model_routes",
]

MAX_CONTROL_BODY_BYTES = 1 << 20  # registration, close, admin: small JSON bodies
Access = Literal["model", "open", "admin"]
log = logging.getLogger(__name__)

_EXECUTION_HEADER = {
    "name": "X-Tidal-Execution",
    "in": "header",
    "required": False,
    "schema": {"type": "string", "maxLength": 128},
}


def _body_spec(model: type[BaseModel]) -> dict:
    """OpenAPI of a route that parses its body itself (the document stays complete)."""
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {
        "parameters": [_EXECUTION_HEADER],
        "requestBody": {"required": True, "content": {"application/json": {"schema": ref}}},
    }


#: (method, path, handler name, access, body model the handler parses itself), in the order
#: FastAPI matches them. ``access`` is who may call the route (``ExecutionIdentity``):
#: ``"model"``: a model call (or the model list), open to an execution's key for its own
#: execution; ``"open"``: anyone; ``"admin"``: the admin token only. A model route's path has
#: no parameters (it is matched exactly) and its body may be up to ``MAX_BODY_BYTES``.
ROUTES: tuple[tuple[str, str, str, Access, type[BaseModel] | None], ...] = (
    ("POST", "/v1/completions", "completions", "model", CompletionRequest),
    ("POST", "/v1/chat/completions", "chat", "model", ChatRequest),
    ("POST", "/inference/v1/generate", "generate", "model", TokenInRequest),
    ("POST", "/v1/messages", "messages", "model", MessagesRequest),
    ("POST", "/v1/messages/count_tokens", "count_tokens", "model", CountTokensRequest),
    ("POST", "/v1/responses", "responses", "model", ResponsesRequest),
    ("GET", "/v1/models", "models", "model", None),
    ("GET", "/health", "health", "open", None),
    ("GET", "/live", "live", "open", None),
    ("POST", "/tidal/executions", "register", "admin", None),
    ("POST", "/tidal/executions/{execution_id}/close", "close", "admin", None),
    ("GET", "/tidal/executions/{execution_id}/records", "records", "admin", None),
    ("GET", "/tidal/engines", "engines", "admin", None),
    ("POST", "/tidal/engines", "join", "admin", None),
    ("DELETE", "/tidal/engines/{engine_id}", "leave", "admin", None),
    ("POST", "/tidal/engines/{engine_id}/drain", "drain", "admin", None),
    ("POST", "/tidal/engines/{engine_id}/undrain", "undrain", "admin", None),
    ("GET", "/tidal/stats", "stats", "admin", None),
)


def model_routes() -> frozenset[str]:
    """The paths an execution's key may call (the ``"model"`` rows of ``ROUTES``)."""
    return frozenset(path for _, path, _, access, _ in ROUTES if access == "model")


def open_routes() -> frozenset[str]:
    return frozenset(path for _, path, _, access, _ in ROUTES if access == "open")


def _openapi(app: FastAPI) -> Callable[[], dict]:
    """The OpenAPI document, with the schemas of the bodies the hot path parses itself."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            for model in (
                CompletionRequest,
                ChatRequest,
                TokenInRequest,
                MessagesRequest,
                CountTokensRequest,
                ResponsesRequest,
            ):
                spec = model.model_json_schema(ref_template="#/components/schemas/{model}")
                schemas.update(spec.pop("$defs", {}))
                schemas[model.__name__] = spec
            app.openapi_schema = doc
        return app.openapi_schema

    return openapi


def build_proxy_app(
    proxy: Proxy,
    registry: ExecutionRegistry | None = None,
    on_startup: Callable[[], Awaitable[None]] | None = None,
    max_open: int = 10_000,
) -> ExecutionIdentity:
    """The proxy's ASGI app: ``ExecutionIdentity`` (who calls, for which execution) over
    ``Guard`` (body limits) over the fast OpenAI path over FastAPI (routes: ``ROUTES``,
    handled by ``proxy_handlers.ProxyHandlers``). ``max_open``: registered executions open at
    once (the registry keeps as many closed ones)."""
    registry = registry or ExecutionRegistry(
        EventLog(max_events=3 * max_open),
        max_open=max_open,
        max_closed=max_open,
        idle_s=proxy.config.execution_idle_s + proxy.config.request_timeout_s,
    )
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
    for method, path, name, access, body in ROUTES:
        app.add_api_route(
            path,
            getattr(handlers, name),
            methods=[method],
            response_model=None,
            dependencies=admin if access == "admin" else None,
            openapi_extra=_body_spec(body) if body is not None else None,
        )
    app.openapi = _openapi(app)  # type: ignore[method-assign]
    # credentials are checked by ExecutionIdentity, in front; the guard bounds the bodies
    models = model_routes()
    guard = Guard(
        FastPath(app, handlers.serve),
        None,
        lambda _: False,
        max_body=MAX_CONTROL_BODY_BYTES,
        body_limits=dict.fromkeys(sorted(models), MAX_BODY_BYTES),
    )
    return ExecutionIdentity(
        guard, proxy.config.admin_token, models, open_routes(), is_loopback(proxy.config.host)
    )
