"""Issue 28: every policy declares the mechanics the simulator gives it, and a user's policy
is registered from a module named in config (``policy.module``) or a ``tidal.policies`` entry
point; an undeclared or unknown policy is one ``ConfigError`` naming the field."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tidal.config import PolicyConfig, validate_model
from tidal.control.factory import check_policy_config
from tidal.control.mechanics import COLOCATE, QWENGYRE, TIDAL, VERL, Mechanics
from tidal.control.policy import (
    Decision,
    make_policy,
    policy_mechanics,
    register_policy,
    registered,
    registered_mechanics,
)
from tidal.errors import ConfigError, UnknownPolicyError

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "policies"


def _checked(data: dict) -> PolicyConfig:
    """A policy section as a run uses it: validated, its module loaded, its name known."""
    return check_policy_config(validate_model(PolicyConfig, data, "policy"))


class _Holds:
    name = "holds"
    waterlevel_safe = False

    def initial_prefix(self, cells):
        return 0

    def decide(self, obs):
        return Decision.hold("holds")

    def state(self):
        return {}


def test_every_builtin_policy_declares_the_mechanics_its_system_runs():
    # what family_of guessed from the names before: verl-* and static -> verl's
    want = {
        "static": VERL,
        "verl-default": VERL,
        "verl-fixed-ratio": VERL,
        "verl-static": VERL,
        "verl-switch": VERL,
        "waterlevel": QWENGYRE,
        "tidal": TIDAL,
        "colocate": COLOCATE,
    }
    declared = registered_mechanics()
    assert {name: declared[name] for name in want} == want
    assert make_policy("waterlevel").mechanics is QWENGYRE


def test_a_policy_declaring_no_mechanics_is_refused_and_not_registered(isolated_policies):
    with pytest.raises(ConfigError, match="declares no mechanics") as err:
        register_policy("holds", "test")(_Holds)
    assert err.value.field == "mechanics"
    with pytest.raises(ConfigError, match=r"declares mechanics 'verl': want a .*Mechanics"):
        register_policy("holds", "test", mechanics="verl")(_Holds)  # type: ignore[arg-type]
    assert "holds" not in registered()
    with pytest.raises(UnknownPolicyError, match="unknown policy 'holds'"):
        policy_mechanics("holds")


def test_a_function_factory_declares_through_register_policy(isolated_policies):
    own = Mechanics(dispatch="burst", partial_rollout=False)
    register_policy("holds", "test", mechanics=own)(lambda: _Holds())
    assert policy_mechanics("holds") is own
    with pytest.raises(ConfigError, match="registered twice"):
        register_policy("holds", "test", mechanics=own)(_Holds)


def test_policy_module_by_path_registers_it_and_is_kept_absolute(
    isolated_policies, tmp_path, monkeypatch
):
    monkeypatch.chdir(FIXTURES.parent)
    cfg = _checked({"name": "mirror-waterlevel", "module": "policies/mirror_waterlevel.py"})
    assert cfg.module == str(FIXTURES / "mirror_waterlevel.py")
    assert policy_mechanics("mirror-waterlevel") == QWENGYRE
    again = _checked(cfg.model_dump())  # loaded once, no twice
    assert again == cfg


@pytest.mark.parametrize(
    "module, want",
    [
        (
            str(FIXTURES / "undeclared_policy.py"),
            r"^policy\.module: .*undeclared_policy\.py: "
            r"mechanics: policy 'undeclared' \(Undeclared\) declares no mechanics",
        ),
        ("no/such/file.py", r"^policy\.module: .*no/such/file\.py: no such file$"),
        (
            "tidal_plugin_absent",
            r"^policy\.module: tidal_plugin_absent does not import: "
            r"ModuleNotFoundError",
        ),
    ],
)
def test_a_bad_policy_module_is_one_line_naming_the_field(isolated_policies, module, want):
    for _ in range(2):  # a module refused part-way registered nothing: the same error again
        with pytest.raises(ConfigError, match=want) as err:
            _checked({"name": "undeclared", "module": module})
        assert "\n" not in str(err.value)
        assert not {"undeclared", "declared-first"} & set(registered())


def _plugin(root: Path, value: str, module_text: str | None) -> None:
    dist = root / "tidal_plugin_demo-1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: tidal-plugin-demo\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(f"[tidal.policies]\ndemo = {value}\n")
    if module_text is not None:
        (root / "tidal_plugin_demo.py").write_text(module_text)


def test_an_installed_entry_point_registers_its_policy(isolated_policies, tmp_path, monkeypatch):
    _plugin(
        tmp_path,
        "tidal_plugin_demo",
        (FIXTURES / "mirror_waterlevel.py").read_text().replace('"mirror-waterlevel"', '"ep-demo"'),
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "ep-demo" not in registered()
    cfg = _checked({"name": "ep-demo"})
    assert cfg.module is None and "tidal_plugin_demo" in sys.modules
    assert policy_mechanics("ep-demo") == QWENGYRE


def test_a_broken_entry_point_is_named_when_its_policy_is_asked_for(
    isolated_policies, tmp_path, monkeypatch
):
    _plugin(tmp_path, "tidal_plugin_demo", "raise RuntimeError('needs a GPU library')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert _checked({"name": "waterlevel"}).name == "waterlevel"
    with pytest.raises(
        ConfigError,
        match=r"^policy\.name: unknown policy 'ep-demo' \(known: "
        r".*; entry point demo not loaded: tidal_plugin_demo: RuntimeError: "
        r"needs a GPU library\)$",
    ):
        _checked({"name": "ep-demo"})
