"""``tidal backends [--module FILE.py|MODULE]``: every registered engine backend, one line each:
its name, what it serves (cells, standalone engines), whether it is a server of its own, and
the proxy's adapter for it. ``--module`` loads a user's module first (as
``runtime.backend_modules`` does in a run config), so its backends are listed too; installed
``tidal.backends`` entry points are always loaded."""

from __future__ import annotations

import click


@click.command(
    help="List every registered engine backend, one line each: name, what it serves, "
    "server or built-in process, adapter."
)
@click.option(
    "--module",
    "modules",
    multiple=True,
    metavar="FILE.py|MODULE",
    help="Load the user's module that registers engine backends first (repeatable).",
)
def command(modules: tuple[str, ...]) -> None:
    from tidal.backends import BACKEND_GROUP, backend_names, engine_backend, load_backends
    from tidal.specs import resolved
    from tidal.user_modules import broken_plugins

    load_backends([resolved(m) for m in modules], "--module")
    rows = []
    for name in backend_names():
        b = engine_backend(name)
        serves = "+".join(
            k for k, host in (("cells", b.cell_host), ("standalone", b.standalone_host)) if host
        )
        rows.append((name, serves, "server" if b.server else "process", b.adapter))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    for row in rows:
        padded = "  ".join(f"{v:<{w}}" for v, w in zip(row[:3], widths, strict=True))
        click.echo(f"{padded}  {row[3]}")
    for name, why in broken_plugins(BACKEND_GROUP).items():
        click.echo(f"entry point {name} not loaded: {why}", err=True)
