"""The same tiny run under ``static`` (core always training, cells 1.. always serving) and
``waterlevel`` (cells move with the waterlevel): wall time, transitions, reroutes, rewards.

Run: ``.venv/bin/python benchmarks/runtime_policies.py --config configs/tiny.yaml``
(about 80 s on 2 cores; each policy runs ``--repeats`` times). Prints one line per run and the
ratio of mean ``bursts_s`` (first dispatch to last publication; start-up excluded). Run
directories go under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics

from tidal.config import PolicyConfig, RunConfig, load_yaml, validate_model
from tidal.runtime.driver import Runtime

KEYS = (
    "run_time_s",
    "bursts_s",
    "switches_to_training",
    "switches_to_rollout",
    "rerouted_requests",
    "failed_requests",
    "lost_executions",
    "mean_reward",
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--policies", nargs="+", default=["static:cells=1", "waterlevel"])
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--out", default="runs/runtime_policies")
    args = ap.parse_args()
    logging.basicConfig(level=logging.ERROR)
    base = load_yaml(args.config).model_dump(mode="json")
    times: dict[str, list[float]] = {}
    for spec in args.policies:
        for r in range(args.repeats):
            data = {**base, "policy": PolicyConfig.from_spec(spec).model_dump(mode="json")}
            name = spec.replace(":", "_").replace("=", "")
            summary = Runtime(validate_model(RunConfig, data), f"{args.out}/{name}-{r}").run()
            times.setdefault(spec, []).append(summary["bursts_s"])
            print(
                json.dumps({"policy": spec, "repeat": r, **{k: summary[k] for k in KEYS}}),
                flush=True,
            )
    means = {k: statistics.mean(v) for k, v in times.items()}
    print(json.dumps({"mean_bursts_s": means}))
    if len(means) == 2:
        (a, ta), (b, tb) = means.items()
        print(f"{b} / {a} time from first dispatch to last publication: {tb / ta:.3f}")


if __name__ == "__main__":
    main()
