"""Fits dapo-math-32gpu's cost-model efficiencies to the two static rows of verl's table.

Free parameters: ``costmodel.efficiency.decode`` (share of the decode roofline an engine gets)
and ``costmodel.efficiency.mfu`` (training and prefill FLOPs utilization); everything else is
derived from the H20 spec sheet, the model's config.json and the setup (TP8 engines, trainer
passes, offload, sync), and the step count is fixed (200 steps). Targets (REFERENCE.md §3):
static 16 + 16 = 6.546 h, static 8 + 24 = 6.379 h. The other rows of the published file
(verl-default 5.4 h and its two "faster than" figures) are NOT targets: they are printed after
the fit as predictions with their error. Same as ``tidal calibrate --published verl-dapo`` then
``tidal validate verl-dapo``.

    .venv/bin/python benchmarks/calibrate.py            # fit and print (about a minute)
    .venv/bin/python benchmarks/calibrate.py --write    # also store the fit in the scenario
    .venv/bin/python benchmarks/calibrate.py --derived  # what the shipped fit derives (instant)
"""

from __future__ import annotations

import sys

from tidal.sim import calibration
from tidal.sim import published as P


def derived() -> None:
    """The speeds and costs the shipped scenario's efficiencies derive (benchmarks/README.md,
    "What is derived, not fitted")."""
    from tidal.sim import perf
    from tidal.sim.scenario import load

    sc = load("dapo-math-32gpu")
    cm = sc.costmodel
    assert cm is not None
    eff = cm.efficiency
    std, hyb = perf.engine_model(cm, cm.mem_fraction), perf.engine_model(cm, cm.hybrid_mem_fraction)
    print(f"efficiencies: decode {eff.decode}, mfu {eff.mfu}, link {eff.link}")
    for n, ctx in ((128, 1000), (128, 6000), (128, 30000), (64, 1000), (1, 0)):
        print(
            f"TP{cm.engine_tp} replica, {n} sequences of {ctx} context: "
            f"{std.throughput_tok_s(n, ctx):,.0f} tok/s"
        )
    print(
        f"KV capacity at 6K context: {std.kv_capacity_seqs(6000):,.0f} sequences standalone, "
        f"{hyb.kv_capacity_seqs(6000):,.0f} hybrid"
    )
    print(
        f"saturation point at 6K: {std.saturation_batch(6000, 128)} under the 128 cap, "
        f"{std.saturation_batch(6000, 4096)} without"
    )
    pf_s = std.prefill_s(10_000)
    equiv = std.prefill_s(1.0, 4000) * std.throughput_tok_s(128, 4000)
    print(
        f"prefill: 10K tokens in {pf_s:.3f} s ({pf_s / 10_000 * 1e6:.1f} us a token); "
        f"one token at 4K context = {equiv:.3f} decode-token equivalents at 128 x 4K"
    )
    r = perf.resolve(sc)
    print(
        f"trainer: {r.trainer.train_tok_s_per_gpu:,.0f} tok/s per GPU (weights' FLOPs, "
        f"{r.trainer.weight_passes} passes), optimizer step {r.trainer.optimizer_s:.2f} s"
    )
    c = r.costs
    print(
        f"weight sync {c.sync_latency_s + c.weight_gb / c.sync_gb_s:.1f} s "
        f"({c.weight_gb:.1f} GB at {c.sync_gb_s:.2f} GB/s), offload {c.offload_s:.1f} s, "
        f"onload {c.onload_s:.1f} s"
    )


def main() -> int:
    if "--derived" in sys.argv:
        derived()
        return 0
    pf = P.load("verl-dapo")
    fit = calibration.fit(pf, ("decode", "mfu"), seeds=4, echo=print)
    for p, v in fit.values.items():
        print(f"efficiency.{p} = {v:.4f} ± {fit.sd[p]:.4f}")
    print(f"fixed (prior): {fit.fixed}")
    if "--write" in sys.argv:
        print(f"wrote {calibration.write_efficiencies(fit.scenario, fit.values)}")
    print(P.table(pf, P.evaluate(pf, P.makespan_runner(fit.values), seeds=3)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
