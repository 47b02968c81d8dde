from tidal.cli import main


def test_help_lists_subcommands(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "Commands:" in out
