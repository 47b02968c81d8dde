"""``tidal calibrate``: a scenario fitted on a real run directory, and sim against real.

The fixture ``tests/fixtures/runs/tiny-calibration`` is a real ``tidal run configs/tiny.yaml``
(waterlevel, 2 bursts of 2 updates, 48 single-call executions); the expected numbers below are
worked out by hand from its files.
"""

import json
import math
import shutil
from pathlib import Path

import pytest

from tidal.cli import main
from tidal.contracts.run_files import ExecutionLine
from tidal.errors import ConfigError
from tidal.sim.engine_fit import fit_engine, intervals
from tidal.sim.from_run import scenario_from_run
from tidal.sim.run_workload import dispatch_interval_s, dist, trace_lines
from tidal.sim.vs_real import compare, real_burst_times, sim_burst_times

RUNS = Path(__file__).resolve().parents[2] / "fixtures" / "runs"
CAL = RUNS / "tiny-calibration"


def _lines(rows: list[dict]) -> list[ExecutionLine]:
    """Rows as the run directory's line models (what the fits read), the fields a row here
    leaves out at neutral values."""
    return [
        ExecutionLine.model_validate(
            {
                "execution": "e",
                "group": "g",
                "burst": None,
                "reason": "completed",
                "reward": 0.0,
                **r,
                "calls": [
                    {"prompt_tokens": 0, "output_tokens": 0, "engines": [], **c}
                    for c in r.get("calls", [])
                ],
            }
        )
        for r in rows
    ]


@pytest.fixture(scope="module")
def fitted():
    return scenario_from_run(CAL)


def test_cluster_control_and_mechanics_come_from_the_config(fitted):
    sc, _ = fitted
    assert sc.cluster.cell_count == 2 and sc.cluster.standalone_count == 1
    assert sc.cluster.cell_slots == 4 and sc.cluster.standalone_slots == 4
    assert (
        sc.control.group_size,
        sc.control.batch_groups,
        sc.control.updates_per_burst,
        sc.control.bursts,
    ) == (4, 3, 2, 2)
    assert sc.control.supply_fraction == 0.6 and sc.control.supply_hold_s == 0.2
    assert sc.policies == ["waterlevel"]
    prof = sc.profile_for("waterlevel")
    assert (prof.dispatch.value, prof.trainer.value, prof.sync.value) == ("burst", "batch", "keep")
    assert prof.kv_handoff and prof.staleness_threshold == 0.0
    assert sc.sim.tick_s == 0.2
    # configured 0.4 s; measured: groups of burst 0 first dispatched 0.0469 ... 2.7796 s, of
    # burst 1 6.3502 ... 8.4025 s: 10 gaps
    gaps = ((2.7796 - 0.0469) + (8.4025 - 6.3502)) / 10
    assert sc.sim.dispatch_interval_s == pytest.approx(gaps, abs=1e-4)


def test_dispatch_interval_is_the_mean_gap_within_bursts():
    execs = [
        {"burst": b, "group": f"b{b}g{g}", "dispatched_s": t}
        for b, g, t in [(0, 0, 0.0), (0, 1, 0.5), (0, 2, 1.5), (1, 0, 10.0), (1, 1, 10.5)]
    ]
    assert dispatch_interval_s(_lines(execs), 0.4) == pytest.approx((0.5 + 1.0 + 0.5) / 3, abs=1e-4)
    assert dispatch_interval_s(_lines(execs), 0.0) == 0.0  # all at once stays all at once


def test_trace_lines_replay_the_calls_of_each_execution():
    execs = [
        {
            "execution": "e0",
            "group": "g",
            "reward": 1.0,
            "calls": [
                {"prompt_tokens": 100, "output_tokens": 20, "tool_s": 0.5},
                {"prompt_tokens": 150, "output_tokens": 10, "tool_s": 0.1},
            ],
        }
    ]
    (line,) = trace_lines(_lines(execs))  # untimed calls: their tool steps, no setup
    assert line["prompt_tokens"] == 100 and line["reward"] == 1.0 and line["setup_s"] == 0.0
    assert line["turns"] == [
        {"decode_tokens": 20, "tool_s": 0.5, "tool_output_tokens": 30},
        {"decode_tokens": 10, "tool_s": 0.1, "tool_output_tokens": 0},
    ]
    timed = [
        {
            **execs[0],
            "launched_s": 1.0,
            "closed_s": 6.0,
            "calls": [
                {**execs[0]["calls"][0], "start_s": 1.25, "call_s": 2.0},
                {**execs[0]["calls"][1], "start_s": 4.0, "call_s": 1.5},
            ],
        }
    ]
    (line,) = trace_lines(_lines(timed))  # launch 1.0, calls 1.25-3.25 and 4.0-5.5, close 6.0
    assert line["setup_s"] == 0.25
    assert [t["tool_s"] for t in line["turns"]] == [0.75, 0.5]


def test_trainer_overheads_and_publication_by_hand(fitted):
    sc, notes = fitted
    # gap = t[k] - t[k-1] - wait_s[k] - step_s[k], from metrics.jsonl
    gaps = [5.349 - 0 - 4.92 - 0.428, 9.215 - 6.263 - 2.545 - 0.357]  # non-final steps
    finals = [6.263 - 5.349 - 0.34 - 0.285, 13.234 - 9.215 - 3.48 - 0.277]
    o = sum(gaps) / 2
    assert notes["trainer"]["between_steps_s"] == pytest.approx(o, abs=1e-4)
    assert notes["publish_s"] == pytest.approx(sum(finals) / 2 - o, abs=1e-4)
    assert sc.costs.sync_s == pytest.approx(sum(finals) / 2 - o, abs=1e-4)
    # The four steps do not fit a line with a positive intercept: the flat ratio is used.
    # Work = final context (last prompt + last output) of every execution: 4164 tokens.
    tokens = sum(
        json.loads(x)["calls"][-1]["prompt_tokens"] + json.loads(x)["calls"][-1]["output_tokens"]
        for x in (CAL / "executions.jsonl").read_text().splitlines()
    )
    assert tokens == 4164
    assert sc.trainer.train_tok_s_per_gpu == pytest.approx(
        4164 / (0.428 + 0.285 + 0.357 + 0.277), rel=1e-4
    )
    assert sc.trainer.optimizer_s == pytest.approx(o, abs=1e-4)


def test_transition_costs_are_means_of_plans_before_the_last_publication(fitted):
    sc, notes = fitted
    # wake_engine ran in plans 3, 4, 7 (started before t = 13.234 s) and 8 (after: excluded)
    assert sc.costs.wake_s == pytest.approx((3.9234 + 2.3528 + 0.3119) / 3, abs=1e-4)
    assert sc.costs.load_weights_s == pytest.approx((0.0806 + 0.0781 + 0.1132) / 3, abs=1e-4)
    assert sc.costs.weight_gb == 0.0 and sc.costs.kv_kb_per_token == 0.0
    assert notes["costs_not_observed"] == ["sleep_s"]  # the waterlevel plans never sleep


def test_workload_from_the_executions(fitted):
    sc, _ = fitted
    (cls,) = sc.workload.classes
    assert cls.prompt_tokens == 26
    assert cls.turns.median == 1 and cls.turns.cap == 1
    assert cls.decode_tokens.median == 64 and cls.decode_tokens.cap == 64  # max_tokens 64
    assert cls.decode_tokens.lo == 23
    assert cls.tool_s.median == 0.0  # single-call arithmetic: no tool step
    assert cls.success_rate == 0.0 and cls.timeout_s == 120.0


def test_dist_is_median_log_std_max_min():
    d = dist([1.0, math.e, math.e**2])
    assert d["median"] == pytest.approx(math.e, abs=1e-4)
    assert d["sigma"] == pytest.approx(math.sqrt(2 / 3), abs=1e-4)
    assert (d["cap"], d["lo"]) == (pytest.approx(math.e**2, abs=1e-4), 1.0)


def _calls(t_s: float, c_s: float, h_s: float):
    """Calls on two engines timed by the model being fitted: each decodes 60 tokens at
    min(C, T / n_engine, H / n_host), the counts constant over its life (batches of calls that
    start and end together, one batch after the other)."""
    execs, t, k = [], 0.0, 0
    for n_a, n_b in [(1, 0), (2, 0), (4, 0), (1, 1), (2, 2), (4, 4), (3, 1), (0, 3)]:
        n_h = n_a + n_b
        longest = 0.0
        for eng, n in (("a", n_a), ("b", n_b)):
            if not n:
                continue
            d = 60 / min(c_s, t_s / n, h_s / n_h)
            longest = max(longest, d)
            for _ in range(n):
                k += 1
                execs.append(
                    {
                        "execution": f"e{k}",
                        "group": f"g{k}",
                        "reason": "completed",
                        "calls": [
                            {
                                "prompt_tokens": 10,
                                "output_tokens": 60,
                                "engines": [eng],
                                "start_s": t,
                                "call_s": d,
                            }
                        ],
                    }
                )
        t += longest
    return execs


def test_intervals_hold_rates_and_counts_between_call_events():
    rows = [("a", 0.0, 2.0, 100), ("a", 1.0, 2.0, 50), ("b", 1.0, 1.0, 10)]
    durs, ns, rates, engines = intervals(rows)
    assert engines == ["a", "b"]
    assert durs == pytest.approx([1.0, 1.0, 1.0])
    assert ns == [[1, 0], [2, 1], [1, 0]]
    assert rates == pytest.approx([50.0, 50 + 25 + 10, 25.0])


@pytest.mark.parametrize(("t_s", "c_s", "h_s"), [(200.0, 80.0, 300.0), (150.0, 60.0, 250.0)])
def test_engine_fit_recovers_a_known_processor_sharing_model(t_s, c_s, h_s):
    fit, notes = fit_engine(_lines(_calls(t_s, c_s, h_s)))
    assert fit["seq_cap_tok_s"] == pytest.approx(c_s, rel=0.1)
    assert fit["decode_tok_s_per_gpu"] == pytest.approx(t_s, rel=0.1)
    assert fit["host_tok_s"] == pytest.approx(h_s, rel=0.1)
    assert fit["prefill_equiv"] == 0.0
    assert notes["r2"] > 0.95


def test_engine_fit_leaves_a_limit_the_run_never_reached_unbounded():
    fit, _ = fit_engine(_lines(_calls(t_s=200.0, c_s=80.0, h_s=1e9)))
    assert fit["host_tok_s"] is None
    assert fit["decode_tok_s_per_gpu"] == pytest.approx(200.0, rel=0.1)


def test_engine_fit_needs_timed_calls():
    with pytest.raises(ConfigError, match="too few"):
        fit_engine(_lines([{"execution": "e", "group": "g", "calls": [{"output_tokens": 3}]}]))


def test_the_scenario_simulates_and_compares_burst_by_burst(fitted):
    sc, _ = fitted
    real = real_burst_times(CAL)
    assert real == pytest.approx([6.263, 13.234 - 6.263])
    sim = sim_burst_times(sc, "waterlevel")
    assert len(sim) == 2 and all(s > sc.costs.sync_s for s in sim)
    cmp = compare(sc, "waterlevel", CAL, seeds=2)
    assert [r["burst"] for r in cmp.rows] == [0, 1]
    for r in cmp.rows:
        assert r["error"] == pytest.approx((r["sim_s"] - r["real_s"]) / r["real_s"])
    assert cmp.error == pytest.approx((cmp.sim_total_s - sum(real)) / sum(real))
    assert cmp.within(abs(cmp.error) + 1e-9) and not cmp.within(abs(cmp.error) / 2)


def test_describing_another_run_takes_its_config(tmp_path):
    cfg = (CAL / "config.yaml").read_text().replace("bursts: 2", "bursts: 3")
    (tmp_path / "config.yaml").write_text(cfg)
    sc, _ = scenario_from_run(CAL, tmp_path / "config.yaml")
    assert sc.control.bursts == 3
    assert sc.engine == scenario_from_run(CAL)[0].engine  # speeds from the calibration run


def test_cli_writes_a_scenario_that_tidal_simulate_accepts(tmp_path, capsys):
    out = tmp_path / "cal.yaml"
    assert main(["calibrate", str(CAL), "--out", str(out)]) == 0
    assert main(["simulate", str(out), "--no-plots"]) == 0
    assert "waterlevel" in capsys.readouterr().out


def test_cli_check_prints_the_table_and_fails_beyond_the_tolerance(capsys):
    assert main(["calibrate", str(CAL), "--check", "--seeds", "1", "--tolerance", "10"]) == 0
    text = capsys.readouterr().out
    assert "real s" in text and "sim s" in text and "within" in text
    assert main(["calibrate", str(CAL), "--check", "--seeds", "1", "--tolerance", "0"]) == 1
    assert "beyond the tolerance" in capsys.readouterr().err


def test_not_a_run_directory_is_one_line_exit_2(tmp_path, capsys):
    assert main(["calibrate", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "not a run directory" in err and "\n" not in err
    assert main(["calibrate", str(tmp_path / "missing")]) == 2
    assert "no such run directory" in capsys.readouterr().err


def test_a_run_without_executions_jsonl_names_the_file(tmp_path):
    run = tmp_path / "old"
    shutil.copytree(RUNS / "tiny-waterlevel", run)  # written before executions.jsonl existed
    with pytest.raises(ConfigError, match=r"executions\.jsonl"):
        scenario_from_run(run)


def test_against_a_directory_without_config_is_a_config_error(tmp_path, capsys):
    assert main(["calibrate", str(CAL), "--against", str(tmp_path)]) == 2
    assert "--against" in capsys.readouterr().err


def test_training_cells_on_one_shared_host_add_no_compute(fitted):
    """A CPU run (``use_gpus`` off): every cell trains on the same cores, so without a
    measurement across cell counts the fit takes speed-up 1 for any number of cells
    (efficiency 0.5 per doubling); on GPUs the simulator's default stands."""
    from tidal.sim.costs import speedup
    from tidal.sim.from_run import SHARED_HOST_EFFICIENCY, fit_trainer
    from tidal.sim.scenario import TrainerConfig

    sc, _ = fitted
    assert sc.trainer.scaling_efficiency == SHARED_HOST_EFFICIENCY
    assert speedup(1, SHARED_HOST_EFFICIENCY) == speedup(3, SHARED_HOST_EFFICIENCY) == 1.0
    execs = [json.loads(x) for x in (CAL / "executions.jsonl").read_text().splitlines()]
    metrics = [json.loads(x) for x in (CAL / "metrics.jsonl").read_text().splitlines()]
    on_gpus, _, _ = fit_trainer(metrics, _lines(execs), 2, shared_host=False)
    assert on_gpus["scaling_efficiency"] == TrainerConfig().scaling_efficiency


def test_timed_steps_give_the_optimizer_time_and_the_compute_rate_directly():
    """A run that times both parts of a step (``compute_s``, ``update_s``): the per-step
    overhead is the mean update of non-final steps (not a fitted intercept), the final
    steps' extra update time is publication, and the rate comes from compute time alone."""
    from tidal.sim.costs import speedup
    from tidal.sim.from_run import fit_trainer

    execs = [json.loads(x) for x in (CAL / "executions.jsonl").read_text().splitlines()]
    metrics = [json.loads(x) for x in (CAL / "metrics.jsonl").read_text().splitlines()]
    base, base_publish, _ = fit_trainer(metrics, _lines(execs), 2, shared_host=False)
    timed = [
        dict(m, compute_s=c, update_s=u)
        for m, c, u in zip(metrics, (0.3, 0.2, 0.25, 0.2), (0.1, 0.15, 0.12, 0.17), strict=True)
    ]
    fit, publish, notes = fit_trainer(timed, _lines(execs), 2, shared_host=False)
    assert notes["from"] == "timed steps" and notes["step_intercept_s"] == pytest.approx(0.11)
    assert fit["optimizer_s"] == pytest.approx(0.11 + notes["between_steps_s"], abs=1e-4)
    assert publish == pytest.approx(base_publish + (0.16 - 0.11), abs=1e-4)
    eff = fit["scaling_efficiency"]
    work = sum(
        json.loads(x)["calls"][-1]["prompt_tokens"] + json.loads(x)["calls"][-1]["output_tokens"]
        for x in (CAL / "executions.jsonl").read_text().splitlines()
    )
    cells = [1 + len(m.get("satellites") or []) for m in metrics]
    assert len(set(cells)) == 1  # one cell count in the fixture: the rate is a plain ratio
    assert fit["train_tok_s_per_gpu"] == pytest.approx(
        work / speedup(cells[0], eff) / 0.95, rel=1e-3
    )
    assert base["train_tok_s_per_gpu"] != fit["train_tok_s_per_gpu"]


def test_the_cores_micro_steps_give_one_cells_speed_and_more_cells_the_efficiency():
    """With the core's own micro-step time and token share, ``R`` is one cell's speed and the
    steps that ran on more cells give the efficiency per doubling."""
    from tidal.sim.from_run import fit_trainer

    execs = [json.loads(x) for x in (CAL / "executions.jsonl").read_text().splitlines()]
    metrics = [json.loads(x) for x in (CAL / "metrics.jsonl").read_text().splitlines()]
    ctx: dict[str, float] = {}
    for e in execs:
        last = e["calls"][-1]
        ctx[e["group"]] = ctx.get(e["group"], 0.0) + last["prompt_tokens"] + last["output_tokens"]
    work = [sum(ctx[g] for g in m["groups"]) for m in metrics]
    r1 = 1000.0  # one cell: 1000 simulated tokens/s
    steps = []
    for k, (m, w) in enumerate(zip(metrics, work, strict=True)):
        n = 2 if k % 2 else 1  # odd steps ran on the core + one satellite
        # the core did half the work on two cells; two cells took 0.6 of one cell's time
        share, compute = (0.5, 0.6 * w / r1) if n == 2 else (1.0, w / r1)
        steps.append(
            dict(
                m,
                satellites=[1] if n == 2 else [],
                compute_s=compute,
                update_s=0.1,
                n_tokens=100,
                core_tokens=round(100 * share),
                core_compute_s=share * w / r1,
            )
        )
    fit, _, _ = fit_trainer(steps, _lines(execs), 2, shared_host=False)
    assert fit["train_tok_s_per_gpu"] == pytest.approx(r1, rel=1e-3)
    # speed-up 1 / 0.6 on two cells = 2 * e: e = 0.8333
    assert fit["scaling_efficiency"] == pytest.approx(1 / 0.6 / 2, abs=1e-3)
