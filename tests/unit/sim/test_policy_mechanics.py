"""Issue 28: the simulator gives a policy the mechanics it declares, never ones guessed from
its name. A user's policy (a file outside ``src/``) registered under a fresh name with
waterlevel's mechanics runs exactly as waterlevel does; the same rule declaring verl's runs
otherwise; an undeclared one is refused in one line by ``tidal simulate`` and ``tidal run``;
and ``sim`` holds no table or comparison keyed by a policy's name."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from tidal.cli import main
from tidal.control.mechanics import QWENGYRE, VERL
from tidal.control.policy import register_policy, registered
from tidal.control.waterlevel import WaterlevelPolicy
from tidal.errors import ConfigError
from tidal.sim import scenario as scenarios
from tidal.sim.runner import run_policy

ROOT = Path(__file__).resolve().parents[3]
FIXTURES = ROOT / "tests" / "fixtures" / "policies"
SCENARIO = FIXTURES / "scenario.yaml"
UNDECLARED = FIXTURES / "undeclared_policy.py"
SAME = (
    "makespan_s",
    "switches",
    "reroutes",
    "reprefill_tokens",
    "trainer_steps",
    "dispatched",
    "finished",
    "mean_staleness",
    "train_utilization",
    "profile",
    "policy_mechanics",
)


def _records(res) -> list[dict]:
    """The decision log, its ``policy`` field (the name) left out."""
    return [{k: v for k, v in r.items() if k != "policy"} for r in res.records]


def test_a_user_policy_with_waterlevels_mechanics_runs_exactly_as_waterlevel(isolated_policies):
    sc = scenarios.load(str(SCENARIO))  # policy_modules: the fixture, relative to the file
    assert sc.policy_modules == [str(FIXTURES / "mirror_waterlevel.py")]
    mine, theirs = run_policy(sc, "mirror-waterlevel"), run_policy(sc, "waterlevel")
    assert mine.summary["policy_mechanics"] == QWENGYRE.model_dump(mode="json")
    assert {k: mine.summary[k] for k in SAME} == {k: theirs.summary[k] for k in SAME}
    assert mine.summary["switches"] > 0
    assert {r.get("policy") for r in mine.records} >= {"mirror-waterlevel"}
    assert _records(mine) == _records(theirs)


def test_the_same_rule_declaring_verls_mechanics_runs_with_verls(isolated_policies):
    class VerlMirror(WaterlevelPolicy):
        name = "verl-mechanics-mirror"
        mechanics = VERL

    register_policy("verl-mechanics-mirror", "test: waterlevel's rule, verl's mechanics")(
        VerlMirror
    )
    sc = scenarios.load(str(SCENARIO))
    mine, theirs = run_policy(sc, "verl-mechanics-mirror"), run_policy(sc, "waterlevel")
    assert mine.summary["profile"] == VERL.model_dump(mode="json")
    assert mine.summary["makespan_s"] != theirs.summary["makespan_s"]


def test_simulate_runs_a_user_policy_from_the_scenarios_modules(
    isolated_policies, tmp_path, capsys
):
    out = tmp_path / "sim"
    assert main(["simulate", str(SCENARIO), "--no-plots", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "mirror-waterlevel" in text and "burst/stream/keep/kv" in text
    runs = json.loads((out / "summary.json").read_text())["runs"]
    assert [r["policy"] for r in runs] == ["mirror-waterlevel", "waterlevel"]
    assert runs[0]["policy_mechanics"] == runs[1]["policy_mechanics"]


@pytest.mark.parametrize(
    "argv",
    [
        [
            "simulate",
            str(SCENARIO),
            "--policy-module",
            str(UNDECLARED),
            "-p",
            "undeclared",
            "--no-plots",
        ],
        [
            "run",
            str(ROOT / "configs" / "tiny.yaml"),
            "--policy",
            "undeclared",
            "--set",
            f"policy.module={UNDECLARED}",
        ],
    ],
)
def test_an_undeclared_policy_is_refused_in_one_line(isolated_policies, argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err
    assert err.startswith(("tidal: error: --policy-module: ", "tidal: error: policy.module: "))
    assert "policy 'undeclared' (Undeclared) declares no mechanics" in err
    assert not {"undeclared", "declared-first"} & set(registered())


def test_an_unknown_policy_is_refused_not_simulated_as_verl(isolated_policies):
    sc = scenarios.load(str(SCENARIO))
    with pytest.raises(ConfigError, match="unknown policy 'my-own'"):
        sc.run_config("my-own")
    with pytest.raises(ConfigError, match="unknown policy 'my-own'"):
        sc.profile_for("my-own")


def _policy_name_tables(path: Path, names: set[str]) -> list[str]:
    """Comparisons with a policy's name, ``startswith`` on one, and dicts keyed by policy
    names whose values are objects (not the plain data of a generated scenario)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        consts = {
            n.value
            for n in ast.walk(node)
            if isinstance(n, ast.Constant) and isinstance(n.value, str)
        }
        if isinstance(node, ast.Compare) and consts & names:
            found.append(f"compare at line {node.lineno}")
        if (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", "") == "startswith"
            and any(
                n.startswith(c.value)
                for a in node.args
                for c in ast.walk(a)
                if isinstance(c, ast.Constant) and isinstance(c.value, str) and c.value
                for n in names
            )
        ):
            found.append(f"startswith at line {node.lineno}")
        if isinstance(node, ast.Dict) and any(
            isinstance(k, ast.Constant)
            and k.value in names
            and not isinstance(v, ast.Dict | ast.Constant | ast.List)
            for k, v in zip(node.keys, node.values, strict=True)
        ):
            found.append(f"table at line {node.lineno}")
    return found


def test_sim_keeps_no_table_keyed_by_policy_name(isolated_policies):
    names = set(registered())
    sim = ROOT / "src" / "tidal" / "sim"
    bad = {p.name: f for p in sorted(sim.rglob("*.py")) if (f := _policy_name_tables(p, names))}
    assert bad == {}
    assert not hasattr(scenarios, "family_of") and not hasattr(scenarios, "FAMILY_PROFILES")


def test_simulates_mechanics_choices_are_the_systems_sets():
    from tidal.commands.simulate import command
    from tidal.control.mechanics import MECHANICS_SETS

    choice = next(p for p in command.params if p.name == "mechanics").type
    assert set(choice.choices) == {"own", *MECHANICS_SETS}
