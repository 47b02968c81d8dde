import pytest

from tidal.cli import main
from tidal.config import PolicyConfig, RunConfig, load_yaml, validate_model
from tidal.control.factory import check_policy
from tidal.errors import ConfigError


@pytest.mark.parametrize(
    "data, field",
    [
        ({"policy": {"name": "nope"}}, "policy.name"),
        (
            {"policy": {"name": "verl-default", "args": {"deactivate_ratio": -0.5}}},
            "policy.args.deactivate_ratio",
        ),
        ({"policy": {"name": "verl-default", "args": {"bogus": 1}}}, "policy.args.bogus"),
        ({"cluster": {"unknown_field": 1}}, "cluster.unknown_field"),
        ({"cluster": {"start_training": [0, 2]}}, "cluster.start_training"),
        (
            {"cluster": {"cell_count": 4, "cells": [{"kind": "elastic"}, {"kind": "hybrid"}]}},
            "cluster.cells.1.kind",
        ),
        ({"control": {"supply_fraction": 1.5}}, "control.supply_fraction"),
        ({"policy": {"name": "static", "args": {"train": 12}}}, "policy.args.train"),
        ({"policy": {"name": "static", "args": {"train": -8}}}, "policy.args.train"),
    ],
)
def test_bad_config_names_the_field(data, field):
    with pytest.raises(ConfigError) as info:
        check_policy(validate_model(RunConfig, data))  # the config, then its policy built
    assert info.value.field == field
    assert "\n" not in str(info.value)


def test_policy_spec_parsing():
    cfg = PolicyConfig.from_spec("verl-default:deactivate_ratio=0.6,clamp=true")
    assert cfg.name == "verl-default"
    assert cfg.args == {"deactivate_ratio": 0.6, "clamp": True}
    with pytest.raises(ConfigError, match="key=value"):
        PolicyConfig.from_spec("static:16")


def test_cli_bad_config_one_line_nonzero(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("cluster:\n  start_training: [1]\n")
    assert main(["check", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "cluster.start_training" in err
    bad.write_text("policy: [unclosed\n")
    assert main(["check", str(bad)]) == 2
    assert "not valid YAML" in capsys.readouterr().err
    assert main(["check", str(tmp_path / "missing.yaml")]) == 2


@pytest.mark.parametrize(
    "text, want",
    [
        ("policy:\n  name: nope\n", "policy.name: unknown policy 'nope' (known: "),
        ("policy:\n  name: x\n  module: no_such.py\n", "policy.module: "),
        ("control:\n  admission: sometimes\n", "control.admission: must be 'off', 'saturation'"),
    ],
)
def test_check_names_what_only_the_control_plane_knows_in_one_line(tmp_path, capsys, text, want):
    """The config layer leaves these to ``control.factory``; ``tidal check`` still names the
    field and the file, as for any other bad value."""
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    assert main(["check", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith(f"tidal: error: {want}"), err
    assert err.endswith(f"(in {bad})")


def test_shipped_configs_are_valid():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "configs"
    files = sorted(root.glob("*.yaml"))
    assert files, "configs/*.yaml missing"
    for f in files:
        load_yaml(f, RunConfig)
