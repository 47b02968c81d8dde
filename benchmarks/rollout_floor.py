"""The rollout side's own floor: every policy again with its training made k times faster.

The oracle bound (``tidal.sim.oracle``) is clairvoyant: it may complete any groups it likes at
the full batch throughput. A real policy does not know how long a sequence will decode, and
verl's staleness budget lets a version dispatch only ``budget - carried`` groups, so a
version's last groups decode at low concurrency while nothing new may start. This benchmark
measures how much of a policy's makespan that leaves when training costs (almost) nothing:
each policy runs on the scenario as given and with the trainer's FLOPs per token divided by
each ``--speedup`` (a what-if: nothing else changes, same mechanics, same seeded workload), and
the table prints the makespans beside the scenario's oracle bound. A policy whose makespan
with 100x faster training is already above ``target x bound`` cannot reach the target by any
scheduling of training.

    .venv/bin/python benchmarks/rollout_floor.py dapo-math-32gpu
    .venv/bin/python benchmarks/rollout_floor.py dapo-math-32gpu --speedup 10 --speedup 100 \\
        --policy tidal --policy verl-default --mechanics tidal
"""

from __future__ import annotations

import argparse
import sys
import time

from tidal.sim import scenario as scenario_mod
from tidal.sim.oracle import oracle_bound
from tidal.sim.rollout_floor import faster_training
from tidal.sim.runner import run_policy


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("scenario")
    ap.add_argument(
        "--policy",
        action="append",
        default=None,
        help="policy spec (repeatable; default: the scenario's list)",
    )
    ap.add_argument(
        "--speedup",
        action="append",
        type=float,
        default=None,
        help="training speed-up factor (repeatable; default 10 and 100)",
    )
    ap.add_argument(
        "--mechanics",
        default=None,
        choices=["own", "verl", "tidal", "waterlevel", "colocate"],
        help="run every policy with this family's mechanics (default: the scenario's setting)",
    )
    ap.add_argument(
        "--target",
        type=float,
        default=1.10,
        help="ratio to the oracle bound to check against (default 1.10)",
    )
    args = ap.parse_args(argv)
    sc = scenario_mod.load(args.scenario)
    if sc.costmodel is None:
        print(f"{sc.name}: needs a cost model (costmodel:) to scale training", file=sys.stderr)
        return 2
    if args.mechanics:
        sc = sc.model_copy(
            update={"mechanics": None if args.mechanics == "own" else args.mechanics}
        )
    speedups = [1.0, *(args.speedup or [10.0, 100.0])]
    if any(k <= 0 for k in speedups):
        print("--speedup: must be > 0", file=sys.stderr)
        return 2
    policies = args.policy or list(sc.policies)
    bound = oracle_bound(sc).makespan_s
    t0 = time.perf_counter()
    rows: dict[str, list[float]] = {}
    total = len(policies) * len(speedups)
    for n, (p, k) in enumerate(((p, k) for p in policies for k in speedups), 1):
        with faster_training(k):
            rows.setdefault(p, []).append(run_policy(sc, p, keep_log=False).summary["makespan_s"])
        done = time.perf_counter() - t0
        print(
            f"  [{n}/{total}] {p} x{k:g} ({done:.0f} s, ETA {done / n * (total - n):.0f} s)",
            file=sys.stderr,
            flush=True,
        )
    head = "".join(f"{f'train x{k:g} h':>15s}" for k in speedups)
    print(
        f"{sc.name}: oracle bound {bound / 3600:.3f} h (training as given); "
        f"{args.target:g}x the bound = {args.target * bound / 3600:.3f} h"
    )
    print(f"{'policy':32s}{head}{'floor/bound':>13s}")
    for p, ms in rows.items():
        print(f"{p:32s}" + "".join(f"{m / 3600:15.3f}" for m in ms) + f"{min(ms) / bound:13.3f}")
    floor = min(min(ms) for ms in rows.values())
    print(
        f"\nshortest makespan of any policy at any training speed: {floor / 3600:.3f} h = "
        f"{floor / bound:.3f}x the bound ({'below' if floor <= args.target * bound else 'above'}"
        f" the {args.target:g}x target); wall {time.perf_counter() - t0:.0f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
