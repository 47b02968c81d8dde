"""Each mode's trainer as it runs, and what a planner can now say in a scenario: optimizer
updates per mini-batch, fixed step costs, the old-log-prob pass per profile, a colocated
trainer's parameter offload, an accelerator defined inline, a total in-flight pool; the oracle
still bounds every policy; published files with inline scenarios and speed-up rows."""

import pytest
import yaml

from tidal.cli import main
from tidal.config import validate_model
from tidal.errors import ConfigError
from tidal.sim import published as P
from tidal.sim.oracle import oracle_bound
from tidal.sim.runner import run_policy
from tidal.sim.scenario import Scenario
from tidal.sim.world import World
from tidal.testing.sim_scenarios import tiny_scenario

H20 = {
    "bf16_tflops": 148.0,
    "hbm_tb_s": 4.0,
    "hbm_gb": 96.0,
    "nvlink_gb_s": 900.0,
    "host_gb_s": 64.0,
    "network_gb_s": 50.0,
    "allreduce_latency_s": 1e-5,
}


def _costed(**over):
    base = {
        "costmodel": {
            "gpu": "H20",
            "model": "qwen2.5-7b",
            "engine_tp": 4,
            "efficiency": {"decode": 0.29, "mfu": 0.43},
        },
        "workload": {"classes": [{"decode_tokens": {"median": 800, "sigma": 0.7, "cap": 6000}}]},
    }
    return tiny_scenario(**{**base, **over})


def test_a_step_runs_one_optimizer_update_per_mini_batch_plus_its_fixed_costs():
    def first_step_s(trainer):
        sc = tiny_scenario(
            control={"group_size": 4, "batch_groups": 4, "updates_per_burst": 2, "bursts": 1},
            trainer={"train_tok_s_per_gpu": 900.0, "optimizer_s": 20.0, **trainer},
        )
        return run_policy(sc, "static:cells=1").world.trainer.steps_log[0]["compute_s"]

    one = first_step_s({})
    assert first_step_s({"mini_batch_groups": 1}) == pytest.approx(one + 3 * 20.0)
    assert first_step_s({"fixed_step_s": 7.5}) == pytest.approx(one + 7.5)


def test_the_old_log_prob_pass_follows_the_profile():
    sc = _costed(profiles={"static": {"old_log_prob": False}})
    without = World(sc, "static:cells=1").scenario.trainer
    with_pass = World(sc, "verl-static").scenario.trainer  # the cost model's setting
    # forward + recompute + backward (+ old log-probs): 4 passes against 5
    assert without.train_tok_s_per_gpu == pytest.approx(with_pass.train_tok_s_per_gpu * 5 / 4)
    assert (without.weight_passes, with_pass.weight_passes) == (4, 5)


def test_a_colocated_trainer_pays_for_its_offloaded_parameters():
    sc = _costed()
    w = World(sc, "colocate")
    assert w.profile.param_offload and w.trainer.offload is not None
    w.trainer.set_gpus(16, 2, 0.0)
    plain = World(sc, "static:cells=1")
    plain.trainer.set_gpus(16, 2, 0.0)
    weight_gb, host = w.trainer.offload
    extra = w.scenario.trainer.weight_passes * weight_gb / (16 * 16 * 65536 * host)
    assert 1 / w.trainer.rate == pytest.approx(1 / plain.trainer.rate + extra)


def test_an_accelerator_defined_inline_is_the_same_as_its_named_entry():
    named = World(_costed(), "tidal").scenario
    inline = World(
        _costed(
            costmodel={
                "gpu": {"name": "my-h20", **H20},
                "model": "qwen2.5-7b",
                "engine_tp": 4,
                "efficiency": {"decode": 0.29, "mfu": 0.43},
            }
        ),
        "tidal",
    ).scenario
    assert inline.engine == named.engine and inline.trainer == named.trainer
    data = _costed().model_dump(mode="json")
    data["costmodel"]["gpu"] = {k: v for k, v in H20.items() if k != "hbm_gb"}
    with pytest.raises(ConfigError, match=r"costmodel\.gpu\.hbm_gb"):
        validate_model(Scenario, data)


def test_a_total_in_flight_pool_caps_dispatched_and_unconsumed_groups():
    sc = tiny_scenario(sim={"max_inflight_groups": 5, "staleness_threshold": 4.0})
    w = World(sc, "static:cells=1", check=True)
    peak = 0
    while w.run_events(1):
        peak = max(peak, len(w.group_open) + w.ledger.ready_unassigned)
        assert peak <= 5
    assert peak == 5 and w.trainer.step == sc.total_steps
    with pytest.raises(ConfigError, match=r"sim\.max_inflight_groups"):
        validate_model(Scenario, {**sc.model_dump(mode="json"), "sim": {"max_inflight_groups": 3}})


@pytest.mark.parametrize(
    "policy", ["colocate", "static:cells=1", "verl-default", "tidal", "waterlevel"]
)
def test_the_oracle_still_bounds_every_policy_with_the_trainer_modes(policy):
    sc = _costed(
        profiles={"static": {"old_log_prob": False}},
        trainer={"mini_batch_groups": 2, "fixed_step_s": 3.0},
        policies=["colocate", "static:cells=1", "verl-default", "tidal", "waterlevel"],
    )
    res = run_policy(sc, policy, check=True)
    assert res.summary["makespan_s"] >= oracle_bound(sc).makespan_s > 0


def _published(tmp_path, rows):
    base = tiny_scenario(control={"bursts": 3}).model_dump(mode="json")
    f = tmp_path / "p.yaml"
    f.write_text(
        yaml.safe_dump(
            {
                "name": "tiny-modes",
                "source": "made up",
                "scenarios": {
                    "base": base,
                    "split": {"extends": "base", "control": {"batch_groups": 2}},
                },
                "rows": rows,
            }
        )
    )
    return f


def test_published_files_define_scenarios_inline_and_compare_speed_ups(tmp_path, capsys):
    f = _published(
        tmp_path,
        [
            {
                "id": "half-batch",
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
    )
    pf = P.load(str(f))
    assert P.scenario_in(pf, "split").control.batch_groups == 2
    assert P.scenario_in(pf, "split").control.group_size == 4  # from base
    run = P.makespan_runner(pf=pf)
    out = P.evaluate(pf, run)[0]
    assert out.predicted == pytest.approx(
        run("base", "static:cells=1", 0, 1) / run("split", "static:cells=1", 0, 1)
    )
    assert main(["validate", str(f)]) == 0
    text = capsys.readouterr().out
    assert "speed-up" in text and "judged rows (workload known): " in text
    assert "1 within 10%, worst half-batch" in text
    tol = abs(out.relative_error) * 0.5
    assert main(["validate", str(f), "--tolerance", f"{tol:.4f}"]) == 1


def test_a_bad_inline_scenario_or_row_names_its_field(tmp_path):
    f = _published(
        tmp_path,
        [
            {
                "id": "r",
                "scenario": "nowhere",
                "policy": "tidal",
                "published": 1.0,
                "workload": "known",
            }
        ],
    )
    with pytest.raises(ConfigError, match="nowhere"):
        P.load(str(f))
    f = _published(
        tmp_path,
        [
            {
                "id": "r",
                "scenario": "split",
                "policy": "tidal",
                "metric": "speedup",
                "published": 1.0,
                "workload": "known",
            }
        ],
    )
    with pytest.raises(ConfigError, match=r"rows\.r\.baseline"):
        P.load(str(f))
