"""Simulator speed: events per second and wall time for swe-agent-long-tail at 1024 GPUs.

The figure the issue bounds (< 60 s on an idle machine) is the total: the oracle bound plus
the policy runs, with the cost model (batch- and context-dependent decode) on.

The scenario (128 GPUs: 8 hybrid cells + 8 standalone engines) is scaled 8x: 64 hybrid
cells + 64 standalone engines, 8x the batch, same bursts. Prints one line per policy: wall and
CPU seconds (the machine may be shared: CPU time is the figure that does not depend on load).

    .venv/bin/python benchmarks/sim_speed.py                 # tidal, 1024 GPUs
    .venv/bin/python benchmarks/sim_speed.py --policy verl-default --policy waterlevel
    .venv/bin/python benchmarks/sim_speed.py --scale 1       # the 128-GPU original
"""

from __future__ import annotations

import argparse
import sys
import time

from tidal.sim import scenario as S
from tidal.sim.oracle import oracle_bound
from tidal.sim.world import World


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", default="swe-agent-long-tail")
    ap.add_argument("--scale", type=float, default=8.0)
    ap.add_argument("--policy", action="append", default=None)
    args = ap.parse_args(argv)
    sc = S.load(args.scenario)
    if args.scale != 1.0:
        sc = sc.scaled(args.scale)
    gpus = (
        sum(c.gpus for c in sc.cluster.cell_specs())
        + sc.cluster.standalone_count * sc.cluster.standalone_gpus
    )
    print(
        f"{sc.name} x{args.scale:g}: {gpus} GPUs, {len(sc.cluster.cell_specs())} cells, "
        f"{sc.cluster.standalone_count} standalone engines, batch {sc.control.batch_groups} "
        f"groups, {sc.total_steps} steps"
    )
    t0, c0 = time.perf_counter(), time.process_time()
    bound = oracle_bound(sc)
    o_wall, o_cpu = time.perf_counter() - t0, time.process_time() - c0
    print(
        f"{'oracle':<14} wall {o_wall:6.1f} s  cpu {o_cpu:6.1f} s  bound "
        f"{bound.makespan_s / 3600:.2f} h"
    )
    total_wall, total_cpu = o_wall, o_cpu
    for spec in args.policy or ["tidal"]:
        t0, c0 = time.perf_counter(), time.process_time()
        world = World(sc, spec, keep_log=False).run()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        n_exec = world.ledger.total.dispatched
        print(
            f"{spec:<14} wall {wall:6.1f} s  cpu {cpu:6.1f} s  events {world.events:>9,}  "
            f"{world.events / wall:>9,.0f} events/s  controller events "
            f"{world.controller.events_handled:>8,}  executions {n_exec:,}  "
            f"virtual {world.makespan_s / 3600:.2f} h"
        )
        total_wall += wall
        total_cpu += cpu
    print(f"{'total':<14} wall {total_wall:6.1f} s  cpu {total_cpu:6.1f} s  (oracle included)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
