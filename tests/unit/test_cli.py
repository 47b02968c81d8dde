from tidal.cli import main


def test_help_lists_subcommands(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for cmd in ("policies", "check"):
        assert cmd in out


def test_policies_one_line_each(capsys):
    from tidal.control.policy import registered

    assert main(["policies"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == len(registered())
    for name in (
        "waterlevel",
        "verl-default",
        "verl-fixed-ratio",
        "verl-static",
        "static",
        "colocate",
    ):
        assert any(line.startswith(name + " ") for line in lines)


def test_unknown_command_is_an_error(capsys):
    assert main(["no-such-command"]) != 0
