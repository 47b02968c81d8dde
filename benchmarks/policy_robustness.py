"""Policy robustness: every policy on N generated scenarios, against the best of them all.

The scenarios come from ``tidal.sim.generate`` (fixed seed; the ranges of the shipped
scenarios). Every policy runs under the same mechanics (``--mechanics``, default tidal's:
on-demand dispatch, streaming trainer, weight sync in place, KV handoff), and so does the
static sweep (every static split). Per scenario, ``best`` is the shortest makespan of any policy
and any static split. Prints, per policy, the distribution of makespan / best over the set
(median, p90, worst) and how often it is the best; then ``tidal`` against the best *other*
policy (static splits included) per scenario: how often it is within 2 %, its median and worst
gap. ``--show`` prints one line per scenario. Wall time is printed at the end.

    .venv/bin/python benchmarks/policy_robustness.py                 # N = 50, seed 2026
    .venv/bin/python benchmarks/policy_robustness.py --n 60 --seed 7 --show
    .venv/bin/python benchmarks/policy_robustness.py --policy tidal:dwell_s=60 --policy waterlevel
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

from tidal.sim.generate import generate
from tidal.sim.oracle import oracle_bound
from tidal.sim.runner import run_policy
from tidal.sim.sweep import static_specs
from tidal.sim.world import SimulationError

POLICIES = ("tidal", "waterlevel", "verl-default", "verl-fixed-ratio", "verl-switch",
            "colocate")
STATIC = "best static"


def run_scenario(i: int, seed: int, mechanics: str, policies: list[str]) -> dict[str, float]:
    """Makespan (s) of every policy and of the best static split on generated scenario i; a
    run that cannot finish within 20x the oracle bound counts as infinite (``stuck``)."""
    sc = generate(seed, i).model_copy(update={"mechanics": mechanics})
    ob = oracle_bound(sc)
    sc = sc.model_copy(update={"sim": sc.sim.model_copy(
        update={"max_virtual_s": 20 * ob.makespan_s})})

    def makespan(spec: str) -> float:
        try:
            return run_policy(sc, spec, oracle=ob, keep_log=False).summary["makespan_s"]
        except SimulationError as exc:
            print(f"  scenario {i}: {str(exc)[:160]}", flush=True)
            return math.inf

    out = {p: makespan(p) for p in policies}
    out[STATIC] = min(makespan(s) for s in static_specs(sc))
    out["oracle"] = ob.makespan_s
    return out


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=50)
    ap.add_argument("--seed", type=int, default=2026)
    ap.add_argument("--mechanics", default="tidal",
                    choices=["tidal", "verl", "waterlevel", "colocate"])
    ap.add_argument("--policy", action="append", default=None,
                    help="policy spec (repeatable; the first is the one under test)")
    ap.add_argument("--show", action="store_true", help="one line per scenario")
    args = ap.parse_args(argv)
    policies = args.policy or list(POLICIES)
    mine = policies[0]
    t0 = time.perf_counter()
    rows = []
    for i in range(args.n):
        r = run_scenario(i, args.seed, args.mechanics, policies)
        rows.append(r)
        if args.show:
            best = min(v for k, v in r.items() if k != "oracle")
            print(f"{i:3d} best {best / 3600:6.3f} h  " + "  ".join(
                f"{k}={v / best:.3f}" for k, v in r.items() if k != "oracle"), flush=True)
    names = [*policies, STATIC]
    print(f"\n{args.n} generated scenarios (seed {args.seed}), mechanics {args.mechanics}; "
          f"makespan / best of all policies and the best static split")
    print(f"{'policy':28s} {'median':>8s} {'p90':>8s} {'worst':>8s} {'best in':>8s}"
          f" {'/oracle med':>12s}")
    # (a policy that could not finish shows inf in its worst column)
    for p in names:
        ratios = [r[p] / min(r[q] for q in names) for r in rows]
        wins = sum(x <= 1.0 + 1e-9 for x in ratios)
        stuck = sum(math.isinf(x) for x in ratios)
        orc = statistics.median(r[p] / r["oracle"] for r in rows)
        print(f"{p:28s} {statistics.median(ratios):8.3f} {pct(ratios, 0.9):8.3f} "
              f"{max(ratios):8.3f} {wins:8d} {orc:12.3f}"
              + (f"  ({stuck} could not finish)" if stuck else ""))
    gaps = [r[mine] / min(r[q] for q in names if q != mine) - 1.0 for r in rows]
    within = sum(g <= 0.02 for g in gaps)
    worst = max(range(len(gaps)), key=lambda k: gaps[k])
    print(f"\n{mine} against the best other policy or static split: within 2% on "
          f"{within}/{len(gaps)} scenarios; gap median {100 * statistics.median(gaps):+.1f}%, "
          f"p90 {100 * pct(gaps, 0.9):+.1f}%, worst {100 * gaps[worst]:+.1f}% (scenario "
          f"{worst}); wall {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
