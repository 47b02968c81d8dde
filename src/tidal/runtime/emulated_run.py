"""An emulated run's config: ``tidal run --emulate SCENARIO`` builds it from a simulator scenario.

In: a scenario (shipped name or YAML path), the time scale ``k`` and the policy (a spec; default
``tidal``, its arguments from the scenario's ``policy_args``). Out: the run config's data (a
dict, validated as a ``RunConfig`` by ``tidal run``) whose cluster, control section and seed are
the scenario's (KV handoff on moves as the policy's mechanics say, and the staleness budget the
simulator gives the policy, ``control.staleness_threshold``: as the simulator runs it),
whose engines are emulated (``runtime.cell_backend`` and ``runtime.standalone_backend``
``emulated``, ``runtime.emulate``), whose trainer is emulated
(``training.emulated``) and whose task is the scenario's workload (the ``emulated`` agent kind:
its lengths, turns, tool latencies and rewards), driven through the real harness pool and proxy.
The controller ticks at the scenario's tick over ``k``. The same file runs in the simulator
(``tidal simulate``) and here. Every output of such a run says it is emulated on its first line
(``emulated_banner``).
"""

from __future__ import annotations

from typing import Any


def emulated_banner(emulate: Any) -> str:
    """The first line of every summary and report of an emulated run."""
    return (
        f"EMULATED RUN (test double: no model ran; scenario {emulate.scenario}, every "
        f"duration divided by k = {emulate.k:g}; never compare with real runs' figures)"
    )


def emulated_config(scenario: str, k: float, policy: str | None = None) -> dict[str, Any]:
    """The ``RunConfig`` data of an emulated run of ``scenario`` at time scale ``k``."""
    from tidal.serving.emulated_timing import resolved_scenario
    from tidal.specs import parse_policy_spec

    sc = resolved_scenario(scenario)
    name, args = parse_policy_spec(policy or "tidal")
    args = {**sc.policy_args.get(name, {}), **args}
    emulate = {"scenario": scenario, "k": k}
    from tidal.control.policy import policy_mechanics

    control = sc.control.model_dump(mode="json")
    # a move hands its KV over where the policy's mechanics do in the simulator
    control["kv_handoff"] = bool(policy_mechanics(name).kv_handoff)
    # the staleness budget the simulator runs this policy with (tidal.control.carry_over)
    control["staleness_threshold"] = sc.staleness_for(sc.profile_for(name))
    # an emulated engine's actor idles (its engine generates no model): the engines together
    # reserve at most one of the local Ray's CPUs, so 32-256 of them pass the preflight
    engines = sc.cluster.standalone_count + len(sc.cluster.cell_specs())
    cpus_per_engine = min(0.25, 1.0 / max(1, engines))
    return {
        "name": f"emulated-{sc.name}",
        "seed": sc.seed,
        "cluster": sc.cluster.model_dump(mode="json"),
        "control": control,
        "policy": {"name": name, "args": args},
        "runtime": {
            "cell_backend": "emulated",
            "standalone_backend": "emulated",
            "emulate": emulate,
            "satellites": False,  # emulated: a training cell's GPUs count at once
            "tick_s": sc.sim.tick_s / k,
            "execution_timeout_s": 6 * 3600.0 / k,
            "step_data_timeout_s": 3600.0 / k + 120.0,
            "run_timeout_s": 4 * 3600.0,
            "start_timeout_s": 120.0,
            "cpus_per_engine": cpus_per_engine,
            "checkpoint_every_steps": 0,
        },
        "task": {
            "source": {"kind": "arithmetic"},
            "agent": {"kind": "emulated", "args": emulate},
        },
    }
