"""The ``tidal`` command. Subcommands live in ``tidal.commands`` (one module each).

Errors derived from ``TidalError`` become one line on stderr and a non-zero exit code; nothing
here holds business logic.
"""

from __future__ import annotations

import importlib
import logging
import pkgutil
import sys

import click

import tidal.commands
from tidal import __version__, malloc
from tidal.errors import TidalError


def _command_modules() -> dict[str, str]:
    names = {}
    for info in pkgutil.iter_modules(tidal.commands.__path__):
        if not info.name.startswith("_"):
            names[info.name.replace("_", "-")] = f"tidal.commands.{info.name}"
    return names


class _LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(_command_modules())

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        module = _command_modules().get(cmd_name)
        if module is None:
            return None
        return importlib.import_module(module).command


@click.group(cls=_LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="tidal")
@click.option("-v", "--verbose", count=True, help="More logging (-v INFO, -vv DEBUG).")
def cli(verbose: int) -> None:
    """tidal: move GPU cells between agent rollout and RL training while agents keep running."""
    level = logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def main(argv: list[str] | None = None) -> int:
    try:
        malloc.tune()  # before the work allocates: freed memory goes back to the system
        cli.main(args=argv, prog_name="tidal", standalone_mode=False)
    except TidalError as exc:
        click.echo(f"tidal: error: {exc}", err=True)
        return exc.exit_code
    except click.exceptions.Abort:
        click.echo("tidal: aborted", err=True)
        return 130
    except click.UsageError as exc:  # one line: the wrong value and where help is
        where = exc.ctx.command_path if exc.ctx is not None else "tidal"
        click.echo(f"tidal: error: {exc.format_message()} (see `{where} -h`)", err=True)
        return exc.exit_code
    except click.ClickException as exc:
        exc.show()
        return exc.exit_code
    except KeyboardInterrupt:
        click.echo("tidal: interrupted", err=True)
        return _interrupted(argv)
    except SystemExit as exc:
        if exc.code == 130:  # a run stopped by Ctrl-C or SIGTERM (its parts are stopped)
            _interrupted(argv)
        raise
    return 0


def _interrupted(argv: list[str] | None) -> int:
    """The process is ``tidal`` itself (``argv`` None): it exits within a moment whatever
    thread is stuck (``runtime.stopping.exit_soon``); called in-process (tests), nothing."""
    if argv is None:
        from tidal.runtime.stopping import exit_soon

        exit_soon(130)
    return 130


if __name__ == "__main__":
    sys.exit(main())
