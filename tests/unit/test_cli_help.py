"""Every ``tidal`` option says what it does, and a wrong value is one line naming it."""

from pathlib import Path

import click
import pytest

from tidal.cli import _command_modules, cli, main


def test_every_command_and_option_has_help_text():
    ctx = click.Context(cli)
    missing = []
    for name in _command_modules():
        cmd = cli.get_command(ctx, name)
        if not (cmd.help or cmd.short_help):
            missing.append(f"tidal {name}")
        for p in cmd.params:
            if isinstance(p, click.Option) and not p.help:
                missing.append(f"tidal {name} {p.opts[0]}")
    assert missing == []


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["engine", "--model", ".", "--port", "99999"],
            "Invalid value for --port: Input should be less than or equal to 65535 "
            "(see `tidal engine -h`)",
        ),
        (
            ["proxy", "--port", "0"],
            "Invalid value for --port: Input should be greater than or equal to 1",
        ),
        (
            ["simulate", "dapo-math-32gpu", "--policy", "waterlevel:bogus=1"],
            "policy.args.bogus: waterlevel takes no argument 'bogus' (it takes: core_may_stay)",
        ),
        (
            ["run", "configs/tiny.yaml", "--policy", "static:bogus=1"],
            "policy.args.bogus: static takes no argument 'bogus' (it takes: train, cells)",
        ),
    ],
)
def test_bad_values_are_one_line(argv, message, capsys, monkeypatch):
    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and message in err, err
