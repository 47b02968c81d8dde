"""Policy robustness: every policy on N generated scenarios, against the best of them all.

The scenarios come from ``tidal.sim.generate`` (fixed seed; the ranges of the shipped
scenarios). Every policy runs under the same mechanics (``--mechanics``, default tidal's:
on-demand dispatch, streaming trainer, weight sync in place, KV handoff), and so does the
static sweep (every static split). Per scenario, ``best`` is the shortest makespan of any policy
and any static split. Prints, per policy, the distribution of makespan / best over the set
(median, p90, worst) and how often it is the best; then ``tidal`` against the best *other*
policy (static splits included) per scenario: how often it is within 2 %, its median and worst
gap. Beside each policy's makespans: what waiting for a slot cost it over the set (queued
execution-hours and the longest wait, measured by the simulator; over-subscription shows
here). ``--show`` prints one line per scenario, ``--json PATH`` writes every figure (to rerun
the report or compare branches). Wall time is printed at the end.

    .venv/bin/python benchmarks/policy_robustness.py                 # N = 50, seed 2026
    .venv/bin/python benchmarks/policy_robustness.py --n 60 --seed 7 --show
    .venv/bin/python benchmarks/policy_robustness.py --policy tidal:dwell_s=60 --policy waterlevel
    .venv/bin/python benchmarks/policy_robustness.py --seed 7 --json runs/rob7.json
    .venv/bin/python benchmarks/policy_robustness.py --seed 7 --reuse runs/rob7.json \\
        --policy tidal:max_queued=0          # only the first policy runs again
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time

from tidal.sim.generate import generate
from tidal.sim.oracle import oracle_bound
from tidal.sim.runner import run_policy
from tidal.sim.sweep import static_specs
from tidal.sim.world import SimulationError

POLICIES = ("tidal", "waterlevel", "verl-default", "verl-fixed-ratio", "verl-switch", "colocate")
STATIC = "best static"


def run_scenario(
    i: int, seed: int, mechanics: str, policies: list[str], static: bool = True
) -> dict[str, dict[str, float]]:
    """Per policy and for the best static split: ``makespan_s``, and what waiting for a slot
    cost (``queued_s``: execution-seconds, ``max_wait_s``: the longest any execution waited,
    measured by the simulator) on generated scenario i; a run that cannot finish within 20x
    the oracle bound counts as infinite (``stuck``)."""
    sc = generate(seed, i).model_copy(update={"mechanics": mechanics})
    ob = oracle_bound(sc)
    sc = sc.model_copy(
        update={"sim": sc.sim.model_copy(update={"max_virtual_s": 20 * ob.makespan_s})}
    )

    def run(spec: str) -> dict[str, float]:
        try:
            s = run_policy(sc, spec, oracle=ob, keep_log=False).summary
        except SimulationError as exc:
            print(f"  scenario {i}: {str(exc)[:160]}", flush=True)
            return {"makespan_s": math.inf, "queued_s": 0.0, "max_wait_s": 0.0}
        return {
            "makespan_s": s["makespan_s"],
            "queued_s": s["queued_execution_s"],
            "max_wait_s": s["queued_execution_max_s"],
        }

    out = {p: run(p) for p in policies}
    if static:
        out[STATIC] = min((run(s) for s in static_specs(sc)), key=lambda r: r["makespan_s"])
    out["oracle"] = {"makespan_s": ob.makespan_s, "queued_s": 0.0, "max_wait_s": 0.0}
    return out


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=50)
    ap.add_argument("--seed", type=int, default=2026)
    ap.add_argument(
        "--mechanics", default="tidal", choices=["tidal", "verl", "waterlevel", "colocate"]
    )
    ap.add_argument(
        "--policy",
        action="append",
        default=None,
        help="policy spec (repeatable; the first is the one under test)",
    )
    ap.add_argument("--show", action="store_true", help="one line per scenario")
    ap.add_argument(
        "--json",
        default=None,
        metavar="PATH",
        help="also write every scenario's figures (per policy) to PATH",
    )
    ap.add_argument(
        "--reuse",
        default=None,
        metavar="PATH",
        help="take every other policy's and the static sweep's figures from a "
        "--json file of the same seed, n and mechanics, and run only the "
        "first policy (valid only on the code that wrote PATH)",
    )
    args = ap.parse_args(argv)
    policies = args.policy or list(POLICIES)
    t0 = time.perf_counter()
    rows = []
    reused = _reused(args.reuse, args) if args.reuse else None
    for i in range(args.n):
        if reused is None:
            r = run_scenario(i, args.seed, args.mechanics, policies)
        else:
            # the reused figures of the policy under test (any args) are not an other's
            mine = policies[0].split(":")[0]
            r = {
                **{k: v for k, v in reused[i].items() if k.split(":")[0] != mine},
                **run_scenario(i, args.seed, args.mechanics, policies[:1], static=False),
            }
        rows.append(r)
        if args.show:
            best = min(v["makespan_s"] for k, v in r.items() if k != "oracle")
            print(
                f"{i:3d} best {best / 3600:6.3f} h  "
                + "  ".join(
                    f"{k}={v['makespan_s'] / best:.3f}" for k, v in r.items() if k != "oracle"
                ),
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"seed": args.seed, "mechanics": args.mechanics, "rows": rows}, fh)
    if reused is not None:  # the reused policies are others too
        policies = [policies[0], *(k for k in rows[0] if k not in (policies[0], STATIC, "oracle"))]
    report(rows, policies, args.n, args.seed, args.mechanics)
    print(f"wall {time.perf_counter() - t0:.0f} s")
    return 0


def _reused(path: str, args: argparse.Namespace) -> list[dict[str, dict[str, float]]]:
    with open(path) as fh:
        data = json.load(fh)
    rows = data["rows"]
    if data["seed"] != args.seed or data["mechanics"] != args.mechanics or len(rows) < args.n:
        raise SystemExit(
            f"--reuse {path}: seed {data['seed']}, mechanics "
            f"{data['mechanics']}, {len(rows)} scenarios; asked for seed "
            f"{args.seed}, {args.mechanics}, {args.n}"
        )
    return rows


def report(
    rows: list[dict[str, dict[str, float]]], policies: list[str], n: int, seed: int, mechanics: str
) -> None:
    """The table per policy and the line for the policy under test (the first)."""
    mine = policies[0]
    names = [*policies, STATIC]

    def ms(r: dict[str, dict[str, float]], p: str) -> float:
        return r[p]["makespan_s"]

    print(
        f"\n{n} generated scenarios (seed {seed}), mechanics {mechanics}; "
        f"makespan / best of all policies and the best static split; queued: "
        f"execution-seconds waiting for a slot, summed over the set, and the longest wait"
    )
    print(
        f"{'policy':28s} {'median':>8s} {'p90':>8s} {'worst':>8s} {'best in':>8s}"
        f" {'/oracle med':>12s} {'queued h':>9s} {'max wait s':>11s}"
    )
    # (a policy that could not finish shows inf in its worst column)
    for p in names:
        ratios = [ms(r, p) / min(ms(r, q) for q in names) for r in rows]
        wins = sum(x <= 1.0 + 1e-9 for x in ratios)
        stuck = sum(math.isinf(x) for x in ratios)
        orc = statistics.median(ms(r, p) / ms(r, "oracle") for r in rows)
        queued_h = sum(r[p]["queued_s"] for r in rows) / 3600
        wait = max(r[p]["max_wait_s"] for r in rows)
        print(
            f"{p:28s} {statistics.median(ratios):8.3f} {pct(ratios, 0.9):8.3f} "
            f"{max(ratios):8.3f} {wins:8d} {orc:12.3f} {queued_h:9.2f} {wait:11.0f}"
            + (f"  ({stuck} could not finish)" if stuck else "")
        )
    gaps = [ms(r, mine) / min(ms(r, q) for q in names if q != mine) - 1.0 for r in rows]
    within = sum(g <= 0.02 for g in gaps)
    worst = max(range(len(gaps)), key=lambda k: gaps[k])
    print(
        f"\n{mine} against the best other policy or static split: within 2% on "
        f"{within}/{len(gaps)} scenarios; {mine} / best other: median "
        f"{1 + statistics.median(gaps):.4f}, p90 {1 + pct(gaps, 0.9):.4f}, worst "
        f"{1 + gaps[worst]:.4f} (scenario {worst}); behind by more than 2% on "
        f"{[k for k, g in enumerate(gaps) if g > 0.02]}"
    )


if __name__ == "__main__":
    sys.exit(main())
