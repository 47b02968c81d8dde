"""The proxy's door for black-box harnesses: an execution named by its base URL or its API key
instead of the ``X-Tidal-Execution`` header (``tidal.serving.execution_keys`` makes both).

In: every ASGI request. Out: the same request for the proxy behind, with
``/x/<execution_id>`` stripped from the path and an ``Authorization: Bearer tx-...`` key of this
run replaced by the run's token, the execution they name set as ``X-Tidal-Execution``. A key
that is not one of this run's is refused (401); a URL, key and header naming different
executions are refused (400): a call is never counted to the wrong execution.
"""

from __future__ import annotations

from tidal.serving.execution_keys import KEY_PREFIX, PATH_PREFIX, parse_key, split_path
from tidal.serving.guard import send_error


class ExecutionIdentity:
    """ASGI wrapper over the proxy's app; ``token``: the run's token (None: keys refused)."""

    def __init__(self, app, token: str | None) -> None:
        self.app, self.token = app, token
        self.state = getattr(app, "state", None)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        named: set[str] = set()
        path = scope.get("path", "")
        if path.startswith(PATH_PREFIX):
            split = split_path(path)
            if split is None:
                return await send_error(send, f"{path[:80]}: expected /x/<execution id>/...", 404)
            named.add(split[0])
            scope = {**scope, "path": split[1], "raw_path": split[1].encode()}
        headers = []
        for k, v in scope["headers"]:
            if k == b"authorization" and v[7:].strip().startswith(KEY_PREFIX.encode()):
                eid = parse_key(self.token, v[7:].strip().decode("latin-1"))
                if eid is None or v[:7].lower() != b"bearer ":
                    return await send_error(
                        send, "the API key is not an execution key of this run", 401
                    )
                named.add(eid)
                if self.token:
                    headers.append((k, b"Bearer " + self.token.encode()))
            elif k == b"x-tidal-execution":
                named.add(v.decode("latin-1"))
            else:
                headers.append((k, v))
        if len(named) > 1:
            return await send_error(
                send,
                "the URL, API key and X-Tidal-Execution name "
                f"different executions: {sorted(named)}",
                400,
            )
        if named:
            headers.append((b"x-tidal-execution", next(iter(named)).encode("latin-1")))
            scope = {**scope, "headers": headers}
        await self.app(scope, receive, send)
