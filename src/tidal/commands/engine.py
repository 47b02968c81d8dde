"""``tidal engine``: serve a model directory with the built-in engine over HTTP (loopback).

In: a model directory (tiny GPT or HF Llama) and a device (``--device cpu|cuda|cuda:N``; the
weights are read on the CPU and moved there). Out: an OpenAI-compatible server with vLLM-shaped
control routes; runs until interrupted. With ``--token`` (or ``$TIDAL_ENGINE_TOKEN``) every route
needs ``Authorization: Bearer <token>``; off loopback a token is required.
"""

from __future__ import annotations

import click


@click.command("engine", help="Serve a model directory with the built-in engine over HTTP "
                              "(OpenAI-compatible, with vLLM-shaped control routes).")
@click.option("--model", "model_dir", required=True, type=click.Path(exists=True, file_okay=False),
              help="Model directory (tiny GPT or HF Llama, e.g. from `tidal model`).")
@click.option("--port", default=8100, show_default=True, type=click.IntRange(1, 65535),
              help="TCP port to listen on.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--name", default=None, help="Served model name (default: directory name).")
@click.option("--max-batch", default=32, show_default=True, type=click.IntRange(min=1),
              help="Sequences decoded together at most (continuous batching).")
@click.option("--max-waiting", default=1024, show_default=True, type=click.IntRange(min=1),
              help="Requests queued beyond the batch at most (more are refused with 503).")
@click.option("--threads", default=1, show_default=True, type=click.IntRange(min=1),
              help="torch threads.")
@click.option("--weight-version", default="v0", show_default=True,
              help="Label of the loaded weights (each generated token carries it).")
@click.option("--seed", default=0, show_default=True,
              help="Sampling seed of requests without their own; give each engine of a "
                   "cluster its own, or engines serving one GRPO group draw the same samples.")
@click.option("--step-in-thread/--step-on-loop", default=False, show_default=True,
              help="Run model steps in a worker thread so the HTTP loop keeps answering "
                   "(control calls, tokenize) during long prefills.")
@click.option("--device", default="cpu", show_default=True,
              help="Where the model and KV caches live: cpu, cuda or cuda:N.")
@click.option("--token", envvar="TIDAL_ENGINE_TOKEN", default=None,
              help="Bearer token every route requires (env TIDAL_ENGINE_TOKEN; the proxy "
                   "passes its --engine-token).")
@click.option("--spill-dir", type=click.Path(file_okay=False), default=None,
              help="Where a level-1 sleep writes the weights (default: held in CPU memory).")
@click.option("--read-timeout-s", default=30.0, show_default=True,
              help="A request must arrive whole (head and body) within this time.")
@click.option("--tool-call-parser", default="hermes", show_default=True,
              type=click.Choice(["hermes"]),
              help="How tool calls are read out of chat answers (see `tidal proxy -h`).")
@click.option("--prefix-cache-mb", default=0.0, show_default=True,
              type=click.FloatRange(min=0),
              help="Keep finished requests' KV (up to this many MiB) for the next call of "
                   "their conversation (what session affinity routes to); 0: off.")
@click.option("--deterministic", is_flag=True, default=False,
              help="Compute each request alone and token by token, so its tokens and "
                   "log-probs do not depend on what else is batched with it or where it "
                   "was moved from (slower; runtime.deterministic).")
def command(model_dir: str, port: int, host: str, name: str | None, max_batch: int,
            max_waiting: int, threads: int, weight_version: str, seed: int,
            step_in_thread: bool, device: str, token: str | None,
            read_timeout_s: float, tool_call_parser: str, prefix_cache_mb: float,
            spill_dir: str | None, deterministic: bool) -> None:
    """Serve MODEL on HOST:PORT with continuous batching."""
    from pathlib import Path

    import torch

    from tidal.models import load_model
    from tidal.models.device import resolve_device
    from tidal.serving.engine import Engine, EngineConfig
    from tidal.serving.engine_server import build_engine_app
    from tidal.serving.guard import is_loopback, run_server

    if not token and not is_loopback(host):
        raise click.UsageError(f"--host {host} is not loopback: give --token (or set "
                               f"TIDAL_ENGINE_TOKEN) so that only the proxy can drive it")
    if not is_loopback(host):
        click.echo(f"tidal engine: listening on {host}, beyond this machine", err=True)
    if not token:
        click.echo("tidal engine: no --token: every local process can drive this engine",
                   err=True)
    torch.set_num_threads(threads)
    if deterministic:
        torch.use_deterministic_algorithms(True)
    served = name or Path(model_dir).name
    resolve_device(device)  # fail before the model is read
    model, tok = load_model(model_dir)
    engine = Engine(model, tok, model_dir, EngineConfig(name=served, max_batch=max_batch,
                                                        max_waiting=max_waiting,
                                                        seed=seed,
                                                        step_in_thread=step_in_thread,
                                                        device=device,
                                                        prefix_cache_mb=prefix_cache_mb,
                                                        spill_dir=spill_dir,
                                                        deterministic=deterministic),
                    weight_version=weight_version)
    app = build_engine_app(engine, served, token, tool_call_parser)
    # The stdlib loop, never uvloop: model steps run on the loop, and under uvloop streamed
    # chunks were seen held up to ~1 s behind them (benchmarks/proxy_overhead.py).
    run_server(app, host, port, read_timeout_s=read_timeout_s, loop="asyncio")
