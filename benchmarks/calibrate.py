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
"""

from __future__ import annotations

import sys

from tidal.sim import calibration
from tidal.sim import published as P


def main() -> int:
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
