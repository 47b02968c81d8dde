"""``tidal proxy``: the OpenAI-compatible front door that routes, drains and records.

In: engine URLs (standalone ``--engine``, rollout cells ``--cell`` in cell order). Out: an HTTP
server on loopback; every route but the model routes and ``/health`` / ``/live`` (registering,
closing, records, engines, stats, ``/docs``) needs ``--admin-token`` (or
``$TIDAL_ADMIN_TOKEN``), which is also the bearer token sent to the engines unless
``--engine-token`` names another; an execution's key calls only its own model calls
(``serving.execution_identity``). Bound beyond loopback no call is anonymous.
The options are ``tidal.contracts.launch.ProxySettings``'s fields (``serving.launch`` passes
them as ``--settings JSON``).
"""

from __future__ import annotations

import click

from tidal.commands._settings import options, settings_from
from tidal.contracts.launch import ProxySettings


@click.command(
    "proxy",
    help="The OpenAI-compatible front door: routes requests to engines, "
    "drains and reroutes them, records every call.",
)
@options(ProxySettings)
@click.option(
    "--admin-token",
    envvar="TIDAL_ADMIN_TOKEN",
    default=None,
    help="Bearer token of the admin routes (env TIDAL_ADMIN_TOKEN).",
)
@click.option(
    "--engine-token",
    envvar="TIDAL_ENGINE_TOKEN",
    default=None,
    help="Bearer token sent to the engines (env TIDAL_ENGINE_TOKEN; default: the admin token).",
)
def command(admin_token: str | None, engine_token: str | None, **given: object) -> None:
    """Run the proxy in front of ENGINE / CELL URLs (the options: ``ProxySettings``)."""
    serve(settings_from(ProxySettings, given), admin_token, engine_token)


def serve(s: ProxySettings, admin_token: str | None, engine_token: str | None) -> None:
    from tidal.serving.guard import is_loopback, run_server
    from tidal.serving.proxy import Proxy, ProxyConfig
    from tidal.serving.proxy_app import build_proxy_app

    _check_backend(s.backend, tuple(s.backend_modules))
    if not is_loopback(s.host):
        if not admin_token:
            raise click.UsageError(
                f"--host {s.host} is not loopback: give --admin-token (or "
                f"set TIDAL_ADMIN_TOKEN); every route will need it"
            )
        click.echo(
            f"tidal proxy: listening on {s.host}, beyond this machine: every route but "
            f"/health needs the admin token (model calls: it or an execution's key)",
            err=True,
        )
    if not admin_token:
        click.echo("tidal proxy: no --admin-token: admin routes are disabled", err=True)
    proxy = Proxy(
        ProxyConfig(
            host=s.host,
            port=s.port,
            admin_token=admin_token,
            engine_token=engine_token,
            kv_handoff=s.kv_handoff,
            require_registration=s.require_registration,
            request_timeout_s=s.request_timeout_s,
            max_prompt_tokens=s.max_prompt_tokens,
            seed=s.seed,
            admission=s.admission,
            admission_order=s.admission_order,
            engine_curve=s.engine_curve,
            tool_call_parser=s.tool_call_parser,
            affinity=s.affinity,
        )
    )

    async def join_all() -> None:
        for i, url in enumerate(s.engines):
            await proxy.join(
                f"s{i}", url, s.backend, "standalone", 0, s.cap, wait_healthy_s=s.wait_s
            )
        for i, url in enumerate(s.cells):
            await proxy.join(f"c{i}", url, s.backend, "cell", i, s.cap, wait_healthy_s=s.wait_s)

    app = build_proxy_app(proxy, on_startup=join_all, max_open=s.max_open_executions)
    # uvloop and httptools are used when installed (the ``serve`` extra)
    run_server(app, s.host, s.port, read_timeout_s=s.read_timeout_s)


def _check_backend(backend: str, modules: tuple[str, ...]) -> None:
    """The user's backend modules loaded (their adapters registered), and ``backend`` one of
    the registry's; else a usage error naming the option."""
    from tidal.backends import backend_names, load_backends
    from tidal.errors import ConfigError

    try:
        load_backends(modules, "--backend-module")
    except ConfigError as exc:
        raise click.BadParameter(exc.message, param_hint=exc.field) from None
    if backend not in backend_names():
        raise click.BadParameter(
            f"unknown engine backend {backend!r} (registered: {', '.join(backend_names())})",
            param_hint="--backend",
        )
