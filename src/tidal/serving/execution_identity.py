"""The proxy's door: who is calling, and which execution a call is counted to. Every request
passes here first; it is the only place the proxy checks credentials.

Callers, by their ``Authorization: Bearer`` credential (or, without that header, Anthropic's
``x-api-key``, what an Anthropic SDK sends its key as):

- **admin** (the run's admin token: the driver, its harness pool, an operator): every route,
  and it may name any execution (``X-Tidal-Execution``, ``/x/<id>/...`` or the body's ``user``):
  the driver's own harness pool names its executions that way.
- **an execution** (its key ``tx-<id>.<mac>``, ``execution_keys``): the model routes only
  (``model_routes``, the ``"model"`` rows of ``proxy_app.ROUTES``), each call counted to that
  execution; naming any other execution is refused (401). An invalid ``tx-`` key: 401.
- **anonymous** (no bearer, or one that is neither): on a loopback proxy the model routes,
  naming no execution (such calls are recorded nowhere); bound beyond loopback, nothing.
- ``open_routes`` (``/health``, ``/live``): anyone.

Every other path (``/tidal/...``: registration, close, records, engines, drains, stats;
``/docs``; a path no route serves) is admin only: a route is reachable by an execution's key only
once it is declared a model route. A proxy with no admin token (``tidal proxy`` without
``--admin-token``, loopback only) has no secret to prove anything with: admin routes are
disabled and a model call may name any execution.

In: every ASGI request. Out: the same request, ``/x/<id>`` stripped from its path, the
execution it names (if any) as its only ``X-Tidal-Execution`` header and its caller as
``scope["tidal.caller"]`` (a ``Caller``, for the handler's check of the body's ``user``); or a
one-line JSON error: 401 (credentials), 400 (a URL and a header naming different executions
under the admin token), 404 (a malformed ``/x/`` path).
"""

from __future__ import annotations

import hmac
from collections.abc import Collection
from dataclasses import dataclass

from tidal.serving.execution_keys import KEY_PREFIX, PATH_PREFIX, parse_key, split_path
from tidal.serving.guard import send_error

CALLER = "tidal.caller"  # the scope key the verified caller travels under
_HEADER = b"x-tidal-execution"


@dataclass(frozen=True)
class Caller:
    """Who a request comes from: ``admin``, or the ``execution`` of its key, or neither
    (anonymous). ``enforced``: the proxy has an admin token (identities can be proved)."""

    admin: bool = False
    execution: str | None = None
    enforced: bool = True

    def may_name(self, execution_id: str) -> bool:
        return self.admin or not self.enforced or self.execution == execution_id

    def refusal(self, execution_id: str) -> str:
        return (
            f"execution {execution_id!r} is named without its key (give its "
            f"'Authorization: Bearer tx-...' key or use its base URL with it)"
        )


class ExecutionIdentity:
    """ASGI wrapper over the proxy's app. ``token``: the run's admin token (None: no
    identities, admin routes disabled); ``model_routes``: paths an execution's key may call;
    ``open_routes``: paths anyone may call; ``open_api``: anonymous model calls are accepted
    (a loopback proxy)."""

    def __init__(
        self,
        app,
        token: str | None,
        model_routes: Collection[str],
        open_routes: Collection[str],
        open_api: bool,
    ) -> None:
        self.app, self.token = app, token
        self.model_routes, self.open_routes = frozenset(model_routes), frozenset(open_routes)
        self.open_api = open_api
        self.state = getattr(app, "state", None)

    def _caller(self, headers) -> Caller | str:
        """The caller of a request's headers, or the reason its credential is refused."""
        given = next((v for k, v in headers if k == b"authorization"), None)
        if given is None:  # an Anthropic SDK's key
            api_key = next((v for k, v in headers if k == b"x-api-key"), None)
            given = None if api_key is None else b"Bearer " + api_key
        if given is None or not self.token:
            return Caller(enforced=bool(self.token))
        kind, _, secret = given.partition(b" ")
        secret = secret.strip()
        if kind.lower() != b"bearer":
            return Caller()
        if hmac.compare_digest(secret, self.token.encode()):
            return Caller(admin=True)
        if secret.startswith(KEY_PREFIX.encode()):
            eid = parse_key(self.token, secret.decode("latin-1"))
            if eid is None:
                return "the API key is not an execution key of this run"
            return Caller(execution=eid)
        return Caller()  # e.g. an SDK's placeholder key: anonymous

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        named: set[str] = set()
        if path.startswith(PATH_PREFIX):
            split = split_path(path)
            if split is None:
                return await send_error(send, f"{path[:80]}: expected /x/<execution id>/...", 404)
            named.add(split[0])
            path = split[1]
            scope = {**scope, "path": path, "raw_path": path.encode()}
        if path in self.open_routes:
            return await self.app(scope, receive, send)
        caller = self._caller(scope["headers"])
        if isinstance(caller, str):
            return await _unauthorized(send, caller)
        headers = [(k, v) for k, v in scope["headers"] if k != _HEADER]
        named |= {v.decode("latin-1") for k, v in scope["headers"] if k == _HEADER}
        if caller.execution is not None:
            named.add(caller.execution)
        if why := self._refused(path, caller, named):
            return await _unauthorized(send, why)
        if len(named) > 1:  # the admin token (or no token) naming two executions at once
            return await send_error(
                send,
                "the URL, API key and X-Tidal-Execution name "
                f"different executions: {sorted(named)}",
                400,
            )
        if named:
            headers.append((_HEADER, next(iter(named)).encode("latin-1")))
        await self.app({**scope, "headers": headers, CALLER: caller}, receive, send)

    def _refused(self, path: str, caller: Caller, named: set[str]) -> str | None:
        """Why ``caller`` may not call ``path`` naming ``named``; None: it may."""
        if caller.admin:
            return None
        if path not in self.model_routes:
            if not self.token:
                return f"{path[:80]} is disabled: no admin token configured"
            return f"{path[:80]} needs the run's admin token"
        if not self.open_api and caller.execution is None:
            return "missing or wrong bearer token (the proxy is bound beyond loopback)"
        other = sorted(e for e in named if not caller.may_name(e))
        return caller.refusal(other[0]) if other else None


async def _unauthorized(send, why: str) -> None:
    await send_error(send, why, 401, [(b"www-authenticate", b"Bearer")])
