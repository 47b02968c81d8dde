"""The simulator against the runtime: one scenario in ``tidal simulate`` and in ``tidal run
--emulate`` (emulated engines and trainer, the real control plane), per policy.

In: a scenario (default ``dapo-math-32gpu``), bursts, policies, the time scale ``k`` and an
output directory. Out: one line per policy: the simulator's makespan (the scenario as shipped:
the like-for-like figure, since ``tidal run --emulate`` runs the same staleness budget,
``control.staleness_threshold``; and with ``sim.staleness_threshold`` 0, no budget, for
reference), the emulated run's makespan
(``bursts_s`` times ``k``: first dispatch to last publication, in emulated seconds), its wall
time, switches, reroutes, failed and lost counts, and the differences in percent. Runs bigger
than a few engines belong under the machine's heavy lock (see RULES: ``flock``). A benchmark,
never a timed test::

    python benchmarks/emulated_vs_sim.py --bursts 2 --k 2 --out /tmp/emu-vs-sim
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path


def simulated(scenario: str, bursts: int, policy: str, staleness: float | None) -> dict:
    from tidal.sim.runner import run_policy
    from tidal.sim.scenario import load

    sc = load(scenario)
    update: dict = {"control": sc.control.model_copy(update={"bursts": bursts})}
    if staleness is not None:
        update["sim"] = sc.sim.model_copy(update={"staleness_threshold": staleness})
    s = run_policy(sc.model_copy(update=update), policy).summary
    return {k: s[k] for k in ("makespan_s", "dispatched", "switches", "reroutes")} | {
        "train_utilization": round(s["train_utilization"], 3),
        "rollout_utilization": round(s["rollout_utilization"], 3),
    }


def emulated(scenario: str, bursts: int, policy: str, k: float, out: Path) -> dict:
    run_dir = out / f"emulated-{policy}"
    t0 = time.monotonic()
    cmd = [sys.executable, "-m", "tidal.cli", "run", "--emulate", scenario, "--k", str(k)]
    cmd += ["--bursts", str(bursts), "--policy", policy, "--out", str(run_dir)]
    with open(out / f"emulated-{policy}.log", "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=900).returncode
    wall = time.monotonic() - t0
    if rc != 0:
        return {"rc": rc, "wall_s": round(wall, 1)}
    s = json.loads((run_dir / "summary.json").read_text())
    return {
        "makespan_s": round(s["bursts_s"] * k, 1),
        "wall_s": round(wall, 1),
        "switches": s["switches_to_training"] + s["switches_to_rollout"],
        "reroutes": s["rerouted_requests"],
        "failed": s["failed_requests"],
        "lost": s["lost_executions"],
        "dispatched": s["dispatched"],
        "trained": s["trained_executions"],
        "carry_over": s.get("carry_over"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", default="dapo-math-32gpu")
    ap.add_argument("--bursts", type=int, default=2)
    ap.add_argument("--k", type=float, default=20.0)
    ap.add_argument("--policy", action="append", default=None)
    ap.add_argument("--out", type=Path, default=Path("/tmp/emulated-vs-sim"))
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    print(f"EMULATED vs simulated: {a.scenario}, {a.bursts} bursts, k = {a.k:g}")
    for policy in a.policy or ["waterlevel", "tidal"]:
        shipped = simulated(a.scenario, a.bursts, policy, None)
        no_slack = simulated(a.scenario, a.bursts, policy, 0.0)
        emu = emulated(a.scenario, a.bursts, policy, a.k, a.out)
        line = {"policy": policy, "sim": shipped, "sim_staleness_0": no_slack, "emulated": emu}
        if "makespan_s" in emu:
            for key, sim in (("vs_sim_pct", shipped), ("vs_sim_staleness_0_pct", no_slack)):
                line[key] = round(100 * (emu["makespan_s"] / sim["makespan_s"] - 1), 1)
        print(json.dumps(line))


if __name__ == "__main__":
    main()
