"""``tidal policies``: every registered scheduling policy, one line each."""

from __future__ import annotations

import click


@click.command(help="List every registered scheduling policy, one line each.")
def command() -> None:
    from tidal.control.policy import registered

    entries = registered()
    width = max(len(n) for n in entries)
    for name, summary in entries.items():
        click.echo(f"{name:<{width}}  {summary}")
