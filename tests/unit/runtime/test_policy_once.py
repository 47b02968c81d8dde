"""``tidal run`` builds its policy once and checks the config against the control plane once:
the command line's check (``checked_policy``) hands the policy to the runtime's preflight and on
to the controller (``build_controller(policy=...)``), counted through the real command up to the
point where Ray would start."""

from __future__ import annotations

from pathlib import Path

import pytest

from tidal.cli import main
from tidal.clock import ManualClock
from tidal.control import factory
from tidal.control.factory import build_controller
from tidal.runtime.driver import Runtime
from tidal.testing.actuator import FakeActuator

ROOT = Path(__file__).resolve().parents[3]


class Started(Exception):
    """Where the stubbed run stops: after the preflight and the controller's construction."""


@pytest.mark.parametrize(
    "argv", [[], ["--policy", "static:cells=1"], ["--set", "control.supply_fraction=0.5"]]
)
def test_a_run_builds_its_policy_once_and_checks_once(argv, tmp_path, monkeypatch):
    counts = {"make_policy": 0, "check_known": 0}
    made = []

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            counts[name] += 1
            out = fn(*args, **kwargs)
            if name == "make_policy":
                made.append(out)
            return out

        return wrapper

    monkeypatch.setattr(factory, "make_policy", counted("make_policy", factory.make_policy))
    monkeypatch.setattr(factory, "check_known", counted("check_known", factory.check_known))
    seen = {}

    def run(self):  # the wiring's controller, as ``wiring.wire`` builds it, then stop
        clock = ManualClock()
        seen["ctl"] = build_controller(self.cfg, clock, FakeActuator(clock), policy=self.policy)
        raise Started

    monkeypatch.setattr(Runtime, "run", run)
    monkeypatch.chdir(ROOT)
    with pytest.raises(Started):
        main(["run", "configs/tiny.yaml", "--out", str(tmp_path / "run"), *argv])
    assert counts == {"make_policy": 1, "check_known": 1}
    assert seen["ctl"].policy is made[0]


def test_a_runtime_built_in_code_builds_its_own_policy_once(tmp_path, monkeypatch):
    """Without a policy from its caller, the runtime's preflight checks the config and builds
    the policy, once each."""
    from tidal.config import load_yaml

    counts = {"make_policy": 0, "check_known": 0}
    for name in counts:
        fn = getattr(factory, name)
        monkeypatch.setattr(
            factory,
            name,
            lambda *a, _n=name, _f=fn, **k: (counts.__setitem__(_n, counts[_n] + 1), _f(*a, **k))[
                1
            ],
        )
    rt = Runtime(load_yaml(ROOT / "configs" / "tiny.yaml"), tmp_path / "run")
    assert counts == {"make_policy": 1, "check_known": 1}
    assert rt.policy.name == "waterlevel"
