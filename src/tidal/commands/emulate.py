"""``tidal emulate SCENARIO``: the emulated engines of a simulator scenario, in one process.

In: a scenario (shipped name or YAML path), the time scale ``--k`` and which engines
(``--engine s0 --engine c1``; default all). Out: one HTTP server per engine, each with every
route of the built-in engine, tokens at the scenario's cost-model rates divided by ``k``
(``tidal.serving.emulated``; a test double at scale: no model runs). The options are
``serving.emulated_farm.FarmSettings``'s fields. With ``--token`` (or ``$TIDAL_ENGINE_TOKEN``)
every route needs ``Authorization: Bearer <token>``.
"""

from __future__ import annotations

import click

from tidal.commands._settings import options, settings_from
from tidal.serving.emulated_farm import FarmSettings


@click.command(
    "emulate",
    help="Serve a simulator scenario's engines as emulated engines (a test double: seeded "
    "tokens at the cost model's rates over k, no model) in one process.",
)
@options(FarmSettings)
@click.option(
    "--token",
    envvar="TIDAL_ENGINE_TOKEN",
    default=None,
    help="Bearer token every route requires (env TIDAL_ENGINE_TOKEN).",
)
def command(token: str | None, **given: object) -> None:
    from tidal.serving.emulated_farm import serve_farm
    from tidal.serving.guard import is_loopback

    s = settings_from(FarmSettings, given)
    if not token and not is_loopback(s.host):
        raise click.UsageError(f"--host {s.host} is not loopback: give --token")
    serve_farm(s, token or None)
