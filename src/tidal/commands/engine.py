"""``tidal engine``: serve a model directory with the built-in engine over HTTP (loopback).

In: a model directory (tiny GPT or HF Llama) and a device (``--device cpu|cuda|cuda:N``; the
weights are read on the CPU and moved there). Out: an OpenAI-compatible server with vLLM-shaped
control routes; runs until interrupted. With ``--token`` (or ``$TIDAL_ENGINE_TOKEN``) every route
needs ``Authorization: Bearer <token>``; off loopback a token is required. The options are
``tidal.contracts.launch.EngineSettings``'s fields (``serving.launch`` passes them as
``--settings JSON``).
"""

from __future__ import annotations

import click

from tidal.commands._settings import options, settings_from
from tidal.contracts.launch import EngineSettings


@click.command(
    "engine",
    help="Serve a model directory with the built-in engine over HTTP "
    "(OpenAI-compatible, with vLLM-shaped control routes).",
)
@options(EngineSettings)
@click.option(
    "--token",
    envvar="TIDAL_ENGINE_TOKEN",
    default=None,
    help="Bearer token every route requires (env TIDAL_ENGINE_TOKEN; the proxy "
    "passes its --engine-token).",
)
def command(token: str | None, **given: object) -> None:
    """Serve MODEL on HOST:PORT with continuous batching (the options: ``EngineSettings``)."""
    serve(settings_from(EngineSettings, given), token)


def serve(s: EngineSettings, token: str | None) -> None:
    """Serve ``s.model_dir`` on ``s.host:s.port`` with continuous batching."""
    from pathlib import Path

    import torch

    from tidal.models import load_model
    from tidal.models.device import resolve_device
    from tidal.serving.engine import Engine, EngineConfig
    from tidal.serving.engine_server import build_engine_app
    from tidal.serving.guard import is_loopback, run_server

    model_dir, host, port, device = s.model_dir, s.host, s.port, s.device
    if not Path(model_dir).is_dir():
        raise click.BadParameter(f"{model_dir}: no such directory", param_hint="--model")
    if not token and not is_loopback(host):
        raise click.UsageError(
            f"--host {host} is not loopback: give --token (or set "
            f"TIDAL_ENGINE_TOKEN) so that only the proxy can drive it"
        )
    if not is_loopback(host):
        click.echo(f"tidal engine: listening on {host}, beyond this machine", err=True)
    if not token:
        click.echo("tidal engine: no --token: every local process can drive this engine", err=True)
    torch.set_num_threads(s.threads)
    if s.deterministic:
        torch.use_deterministic_algorithms(True)
    served = s.name or Path(model_dir).name
    resolve_device(device)  # fail before the model is read
    model, tok = load_model(model_dir)
    engine = Engine(
        model,
        tok,
        model_dir,
        EngineConfig(
            name=served,
            max_batch=s.max_batch,
            max_waiting=s.max_waiting,
            seed=s.seed,
            step_in_thread=s.step_in_thread,
            device=device,
            prefix_cache_mb=s.prefix_cache_mb,
            spill_dir=s.spill_dir,
            deterministic=s.deterministic,
        ),
        weight_version=s.weight_version,
    )
    app = build_engine_app(engine, served, token, s.tool_call_parser)
    # The stdlib loop, never uvloop: model steps run on the loop, and under uvloop streamed
    # chunks were seen held up to ~1 s behind them (benchmarks/proxy_overhead.py).
    run_server(app, host, port, read_timeout_s=s.read_timeout_s, loop="asyncio")
