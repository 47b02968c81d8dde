"""What the simulated dapo saving rests on (``tidal validate``, after verl's dapo rows).

In: a makespan runner (``tidal.sim.published.makespan_runner``: the runs of the verl-dapo rows
are cached there, so only ``tidal`` runs again) and the scenario name (``dapo-math-32gpu``).
Out: text: tidal's simulated saving against verl-default and the better of verl's two static
splits (a prediction, not a published figure), then every input the saving rests on, each
marked as fitted (on the two calibration rows), a prior (assumed, not measured) or derived
(from spec sheets and the model's config through the cost model): the efficiencies, the
workload, the switch and sync costs as the cost model resolves them.
"""

from __future__ import annotations

from collections.abc import Callable

from tidal.sim import perf
from tidal.sim import scenario as scenarios

POLICIES = ("tidal", "verl-default", "static:train=16", "static:train=8")


def dapo_saving(run: Callable[..., float], name: str = "dapo-math-32gpu") -> str:
    """The saving and its assumptions, as printed by ``tidal validate``."""
    hours = {p: run(name, p) for p in POLICIES}
    best_static = min(("static:train=16", "static:train=8"), key=hours.__getitem__)
    t = hours["tidal"]
    lines = [
        f"{name}: tidal's simulated saving (a prediction; no published figure checks it): "
        f"tidal {t:.3f} h, verl-default {hours['verl-default']:.3f} h "
        f"({1 - t / hours['verl-default']:+.1%} time saved), best static "
        f"{best_static.split(':')[1]} {hours[best_static]:.3f} h "
        f"({1 - t / hours[best_static]:+.1%})",
        "  it rests on:",
    ]
    sc = scenarios.load(name)
    res = perf.resolve(sc)
    cm, c, w = sc.costmodel, res.costs, sc.workload.classes[0]
    if cm is not None:
        eff = cm.efficiency
        lines.append(
            f"  - fitted on the two calibration rows only: efficiency.decode "
            f"{eff.decode:g}, efficiency.mfu {eff.mfu:g}"
        )
        lines.append(
            f"  - prior (not fitted, not measured): efficiency.link {eff.link:g}, "
            f"which sets every transfer below"
        )
    d = w.decode_tokens
    lines.append(
        f"  - prior: the workload (responses lognormal, median {d.median:g} tokens, "
        f"sigma {d.sigma:g}, cap {d.cap:g}; prompts {w.prompt_tokens} tokens); "
        f"its lengths are not published"
    )
    lines.append(
        f"  - prior (not measured): engine sleep {c.sleep_s:g} s, wake {c.wake_s:g} s, "
        f"sync latency {c.sync_latency_s:g} s, admission {c.admission_s:g} s, "
        f"reroute {c.reroute_s:g} s, release {c.release_s:g} s"
    )
    lines.append(
        f"  - derived (spec sheet x link prior): weight sync {c.sync_s:.1f} s "
        f"({c.weight_gb:.1f} GB at {c.sync_gb_s:.2f} GB/s), trainer offload "
        f"{c.offload_s:.1f} s, onload {c.onload_s:.1f} s"
    )
    lines.append(
        "  - no switch cost here is measured on a real engine: the saving moves with "
        "them (docs/simulator.md, 'What the dapo saving rests on')"
    )
    return "\n".join(lines)
