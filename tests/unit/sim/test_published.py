"""Published results as a file: loading, errors per row, the efficiency fit and its
uncertainty, ``tidal validate`` and ``tidal calibrate --published`` end to end."""

import math

import pytest
import yaml

from tidal.cli import main
from tidal.errors import ConfigError
from tidal.sim import calibration
from tidal.sim import published as P
from tidal.testing.sim_scenarios import tiny_scenario


def test_the_shipped_file_marks_only_the_two_static_rows_for_calibration():
    pf = P.load("verl-dapo")
    assert [r.id for r in pf.rows if r.calibrate] == ["static-16+16", "static-8+24"]
    assert {r.policy for r in pf.rows if not r.calibrate} == {"verl-default"}


def test_a_reduction_needs_a_baseline(tmp_path):
    f = tmp_path / "p.yaml"
    f.write_text(
        yaml.safe_dump(
            {
                "name": "x",
                "source": "s",
                "rows": [
                    {
                        "id": "r",
                        "scenario": "mixed",
                        "policy": "tidal",
                        "metric": "reduction",
                        "published": 0.1,
                        "workload": "known",
                    }
                ],
            }
        )
    )
    with pytest.raises(ConfigError, match=r"rows\.r\.baseline"):
        P.load(str(f))


def test_errors_are_relative_for_makespans_and_points_for_reductions():
    pf = P.PublishedFile(
        name="x",
        source="s",
        rows=[
            P.Row(id="a", scenario="mixed", policy="static", published=2.0, workload="known"),
            P.Row(
                id="b",
                scenario="mixed",
                policy="static",
                metric="reduction",
                baseline="waterlevel",
                published=0.2,
                workload="known",
            ),
        ],
    )
    hours = {"static": 2.2, "waterlevel": 2.5}  # the table shows each policy's mechanics
    out = P.evaluate(pf, lambda name, policy, seed: hours[policy])
    assert out[0].error == pytest.approx(0.1)
    assert out[1].predicted == pytest.approx(0.12) and out[1].error == pytest.approx(-0.08)
    assert "+10.0%" in P.table(pf, out) and "-8.0pt" in P.table(pf, out)


def test_the_fit_recovers_known_efficiencies_with_their_spread():
    # Makespans as power laws of two efficiencies (as the simulator's nearly are), with a
    # seed-dependent wobble: the fit must land on the truth and report a nonzero spread.
    truth = {"decode": 0.3, "mfu": 0.45}

    def runner_for(eff):
        def run(name, policy, seed=0):
            wobble = 1 + 0.01 * math.sin(seed + len(policy))
            if policy == "rollout-bound":
                return 6.0 * (truth["decode"] / eff["decode"]) ** 0.9 * wobble
            return (
                5.0
                * (truth["mfu"] / eff["mfu"]) ** 0.7
                * (truth["decode"] / eff["decode"]) ** 0.2
                * wobble
            )

        return run

    pf = P.PublishedFile(
        name="x",
        source="s",
        rows=[
            P.Row(
                id="r",
                scenario="dapo-math-32gpu",
                policy="rollout-bound",
                published=6.0,
                calibrate=True,
                workload="known",
            ),
            P.Row(
                id="t",
                scenario="dapo-math-32gpu",
                policy="train-bound",
                published=5.0,
                calibrate=True,
                workload="known",
            ),
        ],
    )
    fit = calibration.fit(pf, seeds=3, tol=1e-4, rounds=20, runner_for=runner_for)
    assert fit.values["decode"] == pytest.approx(0.3, rel=0.02)
    assert fit.values["mfu"] == pytest.approx(0.45, rel=0.02)
    assert fit.sd["decode"] > 0 and fit.sd["mfu"] > 0 and "link" in fit.fixed


def test_the_fit_refuses_more_unknowns_than_rows():
    with pytest.raises(ConfigError, match="--fit"):
        calibration.fit(P.load("verl-dapo"), ("decode", "mfu", "link"))


def test_validate_prints_the_table(tmp_path, capsys):
    sc = tmp_path / "tiny.yaml"
    sc.write_text(yaml.safe_dump(tiny_scenario(control={"bursts": 2}).model_dump(mode="json")))
    f = tmp_path / "p.yaml"
    f.write_text(
        yaml.safe_dump(
            {
                "name": "tiny-table",
                "source": "made up",
                "rows": [
                    {
                        "id": "static",
                        "scenario": str(sc),
                        "policy": "static:train=8",
                        "published": 0.1,
                        "workload": "known",
                    },
                    {
                        "id": "gain",
                        "scenario": str(sc),
                        "policy": "tidal",
                        "metric": "reduction",
                        "baseline": "static:train=8",
                        "published": 0.05,
                        "workload": "known",
                    },
                ],
            }
        )
    )
    assert main(["validate", str(f)]) == 0
    out = capsys.readouterr().out
    assert "tiny-table" in out and "prediction" in out and "vs train=8" in out
    assert main(["validate", str(f), "--tolerance", "0.01"]) == 1


def _phased(tmp_path, phases):
    base = tiny_scenario(control={"bursts": 3}).model_dump(mode="json")
    f = tmp_path / "phased.yaml"
    f.write_text(
        yaml.safe_dump(
            {
                "name": "tiny-phases",
                "source": "made up",
                "scenarios": {
                    "base": base,
                    "split": {"extends": "base", "control": {"batch_groups": 2}},
                },
                "rows": [
                    {
                        "id": "half",
                        "scenario": "split",
                        "policy": "static:cells=1",
                        "metric": "speedup",
                        "baseline": "static:cells=1",
                        "baseline_scenario": "base",
                        "per_version": True,
                        "published": 1.5,
                        "workload": "known",
                    }
                ],
                "phases": phases,
            }
        )
    )
    return f


def test_published_phases_print_against_the_simulation_and_stay_out_of_the_summary(
    tmp_path, capsys
):
    f = _phased(tmp_path, {"base": {"step_s": 100.0, "train_s": 50.0}, "split": {"step_s": 60.0}})
    pf = P.load(str(f))
    run = P.makespan_runner(pf=pf)
    text = P.phase_table(pf, run)
    step = run("split", "static:cells=1", 0, 1)
    train = run("base", "static:cells=1", 0, 1, train=True)
    assert 0 < train <= run("base", "static:cells=1", 0, 1) + 1e-9  # busy within the wall
    assert f"{step:.0f}" in text and f"{train:.0f}" in text and "split" in text
    assert main(["validate", str(f)]) == 0
    out = capsys.readouterr().out
    assert "phases (s per version)" in out and "/1 judged rows within" in out  # no rows


def test_phases_must_name_a_scenario_a_per_version_row_runs(tmp_path):
    with pytest.raises(ConfigError, match=r"phases\.nowhere"):
        P.load(str(_phased(tmp_path, {"nowhere": {"step_s": 1.0}})))


def _split_outcomes():
    rows = [
        P.Row(
            id="cal",
            scenario="mixed",
            policy="static",
            published=1.0,
            calibrate=True,
            workload="known",
        ),
        P.Row(id="near", scenario="mixed", policy="colocate", published=2.0, workload="known"),
        P.Row(id="far", scenario="mixed", policy="tidal", published=2.0, workload="known"),
        P.Row(
            id="lost", scenario="mixed", policy="waterlevel", published=1.0, workload="unpublished"
        ),
    ]
    hours = {"static": 1.01, "colocate": 2.1, "tidal": 2.6, "waterlevel": 0.4}
    return P.evaluate(
        P.PublishedFile(name="x", source="s", rows=rows), lambda name, policy, seed: hours[policy]
    )


def test_judged_and_unjudged_rows_are_counted_apart():
    out = _split_outcomes()
    line = P.counts(out, 0.1)
    # calibration 1/1, judged predictions 1/2 (far +30%), unjudged 0/1 (lost -60%)
    assert "calibration rows: 1/1 within 10%" in line
    assert "judged rows (workload known): 1/2 within 10%, worst far +30.0%" in line
    assert "unjudged rows (workload unpublished): 0/1 within 10%, worst lost -60.0%" in line
    first = P.summary(out, 0.1).splitlines()[0]
    assert first.startswith(
        "all files: 2/3 judged rows within 10% (1/2 outside the 1 "
        "calibration rows); 1 unjudged rows"
    )
    table = P.table(P.PublishedFile(name="x", source="s", rows=[o.row for o in out]), out)
    lost = next(t for t in table.splitlines() if t.startswith("lost"))
    assert "unjudged" in lost and "-60.0%" in lost and lost.endswith("workload unpublished")


def test_a_row_must_say_whether_its_workload_is_known(tmp_path):
    f = tmp_path / "p.yaml"
    f.write_text(
        yaml.safe_dump(
            {
                "name": "x",
                "source": "s",
                "rows": [{"id": "r", "scenario": "mixed", "policy": "tidal", "published": 1.0}],
            }
        )
    )
    with pytest.raises(ConfigError, match=r"workload"):
        P.load(str(f))
    f.write_text(
        yaml.safe_dump(
            {
                "name": "x",
                "source": "s",
                "rows": [
                    {
                        "id": "r",
                        "scenario": "mixed",
                        "policy": "tidal",
                        "published": 1.0,
                        "calibrate": True,
                        "workload": "unpublished",
                    }
                ],
            }
        )
    )
    with pytest.raises(ConfigError, match=r"rows\.r\.workload"):
        P.load(str(f))


def test_the_tolerance_fails_only_on_judged_rows(tmp_path, capsys):
    sc = tmp_path / "tiny.yaml"
    sc.write_text(yaml.safe_dump(tiny_scenario(control={"bursts": 2}).model_dump(mode="json")))
    hours = P.makespan_runner()(str(sc), "static:train=8")

    def write(workload_of_miss):
        f = tmp_path / "p.yaml"
        f.write_text(
            yaml.safe_dump(
                {
                    "name": "tiny-split",
                    "source": "made up",
                    "rows": [
                        {
                            "id": "hit",
                            "scenario": str(sc),
                            "policy": "static:train=8",
                            "published": hours,
                            "workload": "known",
                        },
                        {
                            "id": "miss",
                            "scenario": str(sc),
                            "policy": "static:train=8",
                            "published": 2 * hours,
                            "workload": workload_of_miss,
                        },
                    ],
                }
            )
        )
        return str(f)

    assert main(["validate", write("unpublished"), "--tolerance", "0.1"]) == 0
    out = capsys.readouterr().out
    assert "miss" in out and "-50.0%" in out and "workload unpublished" in out
    assert "1/1 judged rows within 10%" in out
    assert main(["validate", write("known"), "--tolerance", "0.1"]) == 1


def test_the_dapo_saving_is_printed_with_what_it_rests_on():
    from tidal.sim.saving import dapo_saving

    hours = {"tidal": 5.0, "verl-default": 6.0, "static:train=16": 6.6, "static:train=8": 6.4}
    text = dapo_saving(lambda name, policy, seed=0: hours[policy])
    first = text.splitlines()[0]
    assert "tidal 5.000 h" in first and "verl-default 6.000 h (+16.7% time saved)" in first
    assert "best static train=8 6.400 h (+21.9%)" in first
    assert "fitted on the two calibration rows only: efficiency.decode" in text
    assert "prior (not measured): engine sleep" in text and "weight sync" in text


def test_the_shipped_v1_file_takes_each_runs_published_mean_length():
    pf = P.load("verl-v1-trainer")
    assert all(r.judged for r in pf.rows) and len(pf.rows) == 6
    means = {
        name: P.scenario_in(pf, name).workload.classes[0].decode_tokens.mean
        for name in ("sync-32", "separate-16-16", "noswitch-16-8", "switch-16-8")
    }
    assert means == {
        "sync-32": 12720,
        "separate-16-16": 12288,
        "noswitch-16-8": 13343,
        "switch-16-8": 13478,
    }
