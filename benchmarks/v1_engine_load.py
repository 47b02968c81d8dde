"""What the simulated standalone engines of verl's V1 separate_async runs decode, against
what the published runs imply (docs/simulator.md, "Why the V1 separate_async rows miss").

In: the shipped ``verl-v1-trainer`` file. Out: per no-switch scenario the makespan, the mean
sequences decoding per TP replica and the engines' decode tokens/s (sampled at every tick of
the simulation), beside the response tokens/s the published run implies (64 prompts x 8
responses x its mean response length per published step time; in these modes the standalone
GPUs generate every trained token).

    .venv/bin/python benchmarks/v1_engine_load.py
"""

from __future__ import annotations

import statistics as st

from tidal.sim import published as P
from tidal.sim.world import World

RUNS = (  # scenario, policy, published hours, steps
    ("separate-16-16", "static:train=16", 14.10, 150),
    ("noswitch-16-8", "static:train=16", 13.15, 100),
)


def sampled_run(sc, policy: str) -> tuple[World, list[float], list[float]]:
    """The run, with the standalone engines' sequences per replica and decode tokens/s at
    every tick."""
    w = World(sc, policy, keep_log=False)
    std = [e for e in w.engines if e.cell is None]
    active: list[float] = []
    tok_s: list[float] = []
    tick = w._on_tick

    def sample(a: object, b: object) -> None:
        active.append(sum(e.active for e in std) / sum(e.replicas for e in std))
        tok_s.append(sum(e.rate() * e.active for e in std))
        tick(a, b)

    w._on_tick = sample  # type: ignore[method-assign]
    w.run()
    return w, active, tok_s


def main() -> None:
    pf = P.load("verl-v1-trainer")
    for name, policy, hours, steps in RUNS:
        sc = P.scenario_in(pf, name)
        w, active, tok_s = sampled_run(sc, policy)
        mean_len = sc.workload.classes[0].decode_tokens.mean
        implied = 64 * 8 * mean_len / (hours * 3600 / steps)
        print(
            f"{name}: simulated {w.makespan_s / 3600:.2f} h (published {hours} h); "
            f"{st.mean(active):.0f} sequences decoding per replica; standalone decode "
            f"{st.mean(tok_s):,.0f} tok/s, the published run implies {implied:,.0f} "
            f"({st.mean(tok_s) / implied - 1:+.0%})"
        )


if __name__ == "__main__":
    main()
