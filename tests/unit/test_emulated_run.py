"""An emulated run's parts without Ray: the config ``tidal run --emulate`` builds from a scenario,
the emulated agent's draws (the simulator's own), and the emulated core trainer's step time on
an injected clock (the simulator's trainer rate for the cells training, over k; re-rated when a
cell leaves), its versions published as markers; the report and comparisons of an emulated run
say so first."""

from __future__ import annotations

import json

import pytest

from tidal.clock import ManualClock
from tidal.config import AgentConfig, RunConfig, validate_model
from tidal.contracts.calls import ExecutionRecord
from tidal.errors import ConfigError
from tidal.runtime.emulated_run import emulated_config
from tidal.serving.emulated_timing import resolved_scenario
from tidal.sim.costs import train_rate_tok_s
from tidal.sim.scenario import train_work_tokens
from tidal.training.emulated import POLL_S, EmulatedCore, EmulatedVersions
from tidal.training.trajectory_buffer import TrajectoryBuffer, TrajectoryBufferConfig

SC = resolved_scenario("dapo-math-32gpu")


def test_the_config_is_the_scenarios_with_emulated_engines_trainer_and_workload():
    cfg = validate_model(RunConfig, emulated_config("dapo-math-32gpu", 20.0, "verl-default"))
    assert cfg.cluster == SC.cluster and cfg.seed == SC.seed
    # verl's mechanics: no KV handoff; the simulator's staleness budget (sim.staleness_threshold)
    want = SC.control.model_copy(update={"kv_handoff": False, "staleness_threshold": 0.5})
    assert cfg.control == want
    tidal = validate_model(RunConfig, emulated_config("dapo-math-32gpu", 20.0, "tidal"))
    assert tidal.control.kv_handoff is True  # the tidal policy's mechanics hand KV over
    assert cfg.runtime.cell_backend == cfg.runtime.standalone_backend == "emulated"
    assert (cfg.runtime.emulate.scenario, cfg.runtime.emulate.k) == ("dapo-math-32gpu", 20.0)
    assert cfg.policy.args == {"deactivate_ratio": 0.6}  # the scenario's policy_args
    assert cfg.runtime.tick_s == pytest.approx(SC.sim.tick_s / 20.0)
    assert cfg.task.agent.kind == "emulated"


def test_the_256_gpu_stress_passes_the_local_rays_cpu_preflight_without_a_set():
    from tidal.runtime.preflight import Machine, check_machine

    cfg = validate_model(RunConfig, emulated_config("benchmarks/scale/stress-256gpu.yaml", 20.0))
    check_machine(cfg, Machine(cores=2, gpus=0))  # 32 engines: 1/32 CPU each, not 0.25
    assert cfg.runtime.cpus_per_engine * 32 <= 1.0


def test_the_agent_draws_the_simulators_groups_in_order():
    from tidal.agents.emulated_agent import EmulatedKind
    from tidal.sim.workloads import make_workload

    kind = EmulatedKind(AgentConfig(kind="emulated", args={"scenario": "dapo-math-32gpu", "k": 5}))
    sim = make_workload(SC.workload, SC.seed, SC.control.batch_groups)
    first, second = sim.group(8), sim.group(8)
    assert [kind.spec_for("g-a") for _ in range(2)] == first[:2]
    assert kind.spec_for("g-b") == second[0]  # the second group to call
    assert kind.spec_for("g-a") == first[2]
    with pytest.raises(ConfigError, match=r"task.agent.args.k"):
        EmulatedKind(AgentConfig(kind="emulated", args={"scenario": "dapo-math-32gpu", "k": 0}))


def _group(buffer: TrajectoryBuffer, gid: str, tokens: int) -> None:
    for i in range(2):
        buffer.add(
            ExecutionRecord.model_validate(
                {
                    "execution_id": f"{gid}-{i}",
                    "group_id": gid,
                    "reward": float(i),
                    "calls": [
                        {
                            "prompt_token_ids": [1] * 100,
                            "segments": [
                                {
                                    "engine_id": "s0",
                                    "request_id": f"{gid}-{i}",
                                    "token_ids": [2] * (tokens - 100),
                                    "logprobs": [-1.0] * (tokens - 100),
                                    "versions": ["v0"] * (tokens - 100),
                                }
                            ],
                        }
                    ],
                }
            )
        )


def test_a_step_takes_the_simulators_trainer_time_over_k_and_publishes_a_marker(tmp_path):
    clock = ManualClock(0.0)
    buffer = TrajectoryBuffer(TrajectoryBufferConfig(group_size=2, max_policy_lag=4), clock)
    versions = EmulatedVersions(tmp_path / "weights", SC.costs.weight_gb)
    core = EmulatedCore(SC, 10.0, buffer, clock, versions, 2, [8, 8])
    training = {0, 1}
    core.bind(lambda: training)
    for g in ("a", "b"):
        _group(buffer, g, 4000)
    report = core.train_step(final=True, groups=2)
    tr = SC.trainer
    work = 4 * train_work_tokens(4000, tr)
    update = tr.optimizer_s + tr.fixed_step_s + tr.aggregate_s_per_cell
    want = (work / train_rate_tok_s(16, 2, tr) + update) / 10.0
    assert clock.now() == pytest.approx(want, rel=0.01)
    assert report.group_ids == ["a", "b"] and report.n_executions == 4 and core.version == 1
    marker = json.loads((tmp_path / "weights" / "v1-emulated" / "EMULATED.json").read_text())
    assert marker == {"emulated": True, "version": 1, "weight_gb": SC.costs.weight_gb}
    # one cell fewer: the same work takes longer (the rate of 8 GPUs on one cell)
    training.discard(1)
    for g in ("c", "d"):
        _group(buffer, g, 4000)
    t0 = clock.now()
    core.train_step(final=False, groups=2)
    alone = (work / train_rate_tok_s(8, 1, tr) + tr.optimizer_s + tr.fixed_step_s) / 10.0
    assert clock.now() - t0 == pytest.approx(alone, rel=0.01)


def test_a_streaming_step_takes_groups_as_they_get_ready(tmp_path):
    """A step started with 2 of its 4 groups (``TrainerLoop`` with a streaming policy) trains
    them, waits for the rest without computing, takes each as it gets ready and ends one
    group's work (plus the update) after the last one came, as the simulator's streaming
    trainer; its compute time excludes the waits."""
    tr = SC.trainer
    per_group = 2 * train_work_tokens(4000, tr) / train_rate_tok_s(16, 2, tr) / 10.0
    update = (tr.optimizer_s + tr.fixed_step_s + tr.aggregate_s_per_cell) / 10.0

    due = [(3 * per_group, "c"), (5 * per_group, "d")]

    class Arrivals(ManualClock):
        def sleep(self, dt_s: float) -> None:
            super().sleep(dt_s)
            while due and due[0][0] <= self.now():
                _group(buffer, due.pop(0)[1], 4000)

    clock = Arrivals(0.0)
    buffer = TrajectoryBuffer(TrajectoryBufferConfig(group_size=2, max_policy_lag=4), clock)
    core = EmulatedCore(SC, 10.0, buffer, clock, EmulatedVersions(tmp_path, 1.0), 4, [8, 8])
    core.bind(lambda: {0, 1})
    for g in ("a", "b"):
        _group(buffer, g, 4000)
    report = core.train_step(final=False, groups=4)
    assert report.group_ids == ["a", "b", "c", "d"] and report.n_executions == 8
    # seen within one poll (POLL_S) of its arrival
    assert clock.now() == pytest.approx(6 * per_group + update, abs=POLL_S + 1e-6)
    assert report.compute_s == pytest.approx(4 * per_group, rel=0.05)


def test_an_emulated_runs_report_says_so_first_and_is_never_compared_with_a_real_one(tmp_path):
    from tidal.rundir import load_run
    from tidal.viz.run_compare import compare_runs
    from tidal.viz.run_report import render_report

    emu, real = tmp_path / "emu", tmp_path / "real"
    for d, first in ((emu, {"emulated": "EMULATED RUN (test double)"}), (real, {})):
        d.mkdir()
        (d / "summary.json").write_text(json.dumps({**first, "policy": "tidal"}))
    run = load_run(emu)
    assert render_report(run, [], []).splitlines()[0] == "**EMULATED RUN (test double)**"
    assert run.policy.startswith("EMULATED") and load_run(real).policy == "tidal"
    with pytest.raises(ConfigError, match=r"emulated runs .* cannot be compared"):
        compare_runs([emu, real], tmp_path / "cmp")
