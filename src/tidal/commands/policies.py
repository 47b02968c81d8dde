"""``tidal policies [--module FILE.py|MODULE]``: every registered scheduling policy, one line
each: its name, the mechanics it declares (``Mechanics.label``: dispatch / trainer / weight
sync / KV handoff) and its summary. ``--module`` loads a user's module first (as
``policy.module`` does in a run config), so its policies are listed too."""

from __future__ import annotations

import click


@click.command(
    help="List every registered scheduling policy, one line each: name, declared "
    "mechanics, summary."
)
@click.option(
    "--module",
    "modules",
    multiple=True,
    metavar="FILE.py|MODULE",
    help="Load the user's module that registers policies first (repeatable).",
)
def command(modules: tuple[str, ...]) -> None:
    from tidal.control.policy import registered, registered_mechanics
    from tidal.plugins import load_policies, resolved

    load_policies([resolved(m) for m in modules], "--module")
    entries, mechanics = registered(), registered_mechanics()
    width = max(len(n) for n in entries)
    labels = {n: mechanics[n].label() for n in entries}
    mwidth = max(len(v) for v in labels.values())
    for name, summary in entries.items():
        click.echo(f"{name:<{width}}  {labels[name]:<{mwidth}}  {summary}")
