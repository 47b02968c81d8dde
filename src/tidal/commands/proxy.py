"""``tidal proxy``: the OpenAI-compatible front door that routes, drains and records.

In: engine URLs (standalone ``--engine``, rollout cells ``--cell`` in cell order). Out: an HTTP
server on loopback; every route but the model routes and ``/health`` / ``/live`` (registering,
closing, records, engines, stats, ``/docs``) needs ``--admin-token`` (or
``$TIDAL_ADMIN_TOKEN``), which is also the bearer token sent to the engines unless
``--engine-token`` names another; an execution's key calls only its own model calls
(``serving.execution_identity``). Bound beyond loopback no call is anonymous.
"""

from __future__ import annotations

import click


@click.command("proxy", help="The OpenAI-compatible front door: routes requests to engines, "
                             "drains and reroutes them, records every call.")
@click.option("--port", default=8200, show_default=True, type=click.IntRange(1, 65535),
              help="TCP port to listen on.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--engine", "engines", multiple=True, help="Standalone engine URL (repeatable).")
@click.option("--cell", "cells", multiple=True, help="Rollout-cell engine URL, in cell order.")
@click.option("--backend", default="builtin", show_default=True,
              help="What serves behind the engine URLs: builtin, vllm, sglang or a backend "
                   "a --backend-module registers.")
@click.option("--backend-module", "backend_modules", multiple=True, metavar="MODULE",
              help="A module that registers engine backends (a .py path or a dotted name; "
                   "repeatable), as runtime.backend_modules.")
@click.option("--cap", default=32, show_default=True, type=click.IntRange(min=1),
              help="Admission cap per engine.")
@click.option("--admin-token", envvar="TIDAL_ADMIN_TOKEN", default=None,
              help="Bearer token of the admin routes (env TIDAL_ADMIN_TOKEN).")
@click.option("--kv-handoff/--no-kv-handoff", default=True, show_default=True,
              help="Move a rerouted request's KV cache to its new engine (else it prefills).")
@click.option("--wait-s", default=120.0, show_default=True,
              help="How long to wait for the engines to become healthy at start.")
@click.option("--require-registration", is_flag=True,
              help="Refuse requests of executions not registered via POST /tidal/executions.")
@click.option("--engine-token", envvar="TIDAL_ENGINE_TOKEN", default=None,
              help="Bearer token sent to the engines (env TIDAL_ENGINE_TOKEN; default: the "
                   "admin token).")
@click.option("--request-timeout-s", default=600.0, show_default=True,
              help="Limit of one model call, waiting for a free engine slot included "
                   "(an execution may register its own timeout_s).")
@click.option("--read-timeout-s", default=30.0, show_default=True,
              help="A request must arrive whole (head and body) within this time.")
@click.option("--seed", default=None, type=click.IntRange(-(2**63), 2**63 - 1),
              help="Run seed: a call of a named execution without its own seed samples with "
                   "one derived from (seed, execution id, call index), the same on any engine "
                   "(default: none, engines' own streams).")
@click.option("--admission", default="off", show_default=True,
              help="Admission control: 'off', 'saturation' or a per-token latency target in "
                   "seconds; caps each engine at its concurrency target on --engine-curve.")
@click.option("--admission-order", default="longest_waiting", show_default=True,
              type=click.Choice(["longest_waiting", "shortest_remaining"]),
              help="Order of the calls waiting for a slot.")
@click.option("--engine-curve", default=None, metavar="B:TOK_S,...",
              help="The engines' throughput curve, e.g. 1:200,32:3200,128:8800 "
                   "(batch:tokens/s; needed with --admission).")
@click.option("--tool-call-parser", default="hermes", show_default=True,
              type=click.Choice(["hermes"]),
              help="How tool calls are read out of chat answers, per model family (hermes: "
                   "<tool_call>{json}</tool_call>, Qwen2.5/Qwen3/Hermes).")
@click.option("--affinity/--no-affinity", default=True, show_default=True,
              help="Keep the calls of one X-Session-ID (else one execution) on the engine "
                   "that holds their prefix while it has a slot.")
def command(port: int, host: str, engines: tuple[str, ...], cells: tuple[str, ...],
            backend: str, backend_modules: tuple[str, ...], cap: int,
            admin_token: str | None, kv_handoff: bool,
            wait_s: float, require_registration: bool, engine_token: str | None,
            request_timeout_s: float, read_timeout_s: float, seed: int | None,
            admission: str, admission_order: str, engine_curve: str | None,
            tool_call_parser: str, affinity: bool) -> None:
    """Run the proxy in front of ENGINE / CELL URLs."""
    from tidal.serving.guard import is_loopback, run_server
    from tidal.serving.proxy import Proxy, ProxyConfig
    from tidal.serving.proxy_app import build_proxy_app

    _check_backend(backend, backend_modules)
    if not is_loopback(host):
        if not admin_token:
            raise click.UsageError(f"--host {host} is not loopback: give --admin-token (or "
                                   f"set TIDAL_ADMIN_TOKEN); every route will need it")
        click.echo(f"tidal proxy: listening on {host}, beyond this machine: every route but "
                   f"/health needs the admin token (model calls: it or an execution's key)",
                   err=True)
    if not admin_token:
        click.echo("tidal proxy: no --admin-token: admin routes are disabled", err=True)
    if request_timeout_s <= 0:
        raise click.BadParameter("must be > 0", param_hint="--request-timeout-s")
    proxy = Proxy(ProxyConfig(host=host, port=port, admin_token=admin_token,
                              engine_token=engine_token, kv_handoff=kv_handoff,
                              require_registration=require_registration,
                              request_timeout_s=request_timeout_s, seed=seed,
                              admission=admission, admission_order=admission_order,
                              engine_curve=parse_curve(engine_curve),
                              tool_call_parser=tool_call_parser, affinity=affinity))

    async def join_all() -> None:
        for i, url in enumerate(engines):
            await proxy.join(f"s{i}", url, backend, "standalone", 0, cap,
                             wait_healthy_s=wait_s)
        for i, url in enumerate(cells):
            await proxy.join(f"c{i}", url, backend, "cell", i, cap, wait_healthy_s=wait_s)

    app = build_proxy_app(proxy, on_startup=join_all)
    # uvloop and httptools are used when installed (the ``serve`` extra)
    run_server(app, host, port, read_timeout_s=read_timeout_s)


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
        raise click.BadParameter(f"unknown engine backend {backend!r} (registered: "
                                 f"{', '.join(backend_names())})", param_hint="--backend")


def parse_curve(text: str | None) -> list[tuple[int, float]] | None:
    """``B:TOK_S,...`` into [(batch, tokens/s)]; a malformed one is a usage error."""
    if text is None:
        return None
    try:
        return [(int(b), float(t)) for b, t in (p.split(":") for p in text.split(","))]
    except ValueError:
        raise click.BadParameter(f"{text!r} is not B:TOK_S,... (e.g. 1:200,128:8800)",
                                 param_hint="--engine-curve") from None
