"""``tidal check CONFIG``: validate a run or scenario config and print it resolved."""

from __future__ import annotations

import click


@click.command(help="Validate a config file (YAML); print the resolved config on success.")
@click.argument("config", type=click.Path(dir_okay=False))
@click.option("--quiet", "-q", is_flag=True, help="Print nothing on success.")
def command(config: str, quiet: bool) -> None:
    from tidal.config import RunConfig, dump_yaml, load_yaml

    cfg = load_yaml(config, RunConfig)
    if not quiet:
        click.echo(dump_yaml(cfg), nl=False)
