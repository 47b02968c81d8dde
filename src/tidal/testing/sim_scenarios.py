"""A tiny simulator scenario for tests: 2 hybrid cells + 2 standalone engines, small batches.

For tests and docs only; production code never imports this package.
"""

from __future__ import annotations

from tidal.sim.scenario import Scenario


def tiny_scenario(**over: object) -> Scenario:
    """A fast scenario; top-level keys in ``over`` replace (dicts: update) the defaults."""
    data = {
        "name": "tiny",
        "seed": 1,
        "cluster": {
            "cells": [
                {"gpus": 8, "slots": 32, "kind": "hybrid"},
                {"gpus": 8, "slots": 32, "kind": "hybrid"},
            ],
            "standalone_count": 2,
            "standalone_gpus": 8,
            "standalone_slots": 32,
        },
        "control": {"group_size": 4, "batch_groups": 4, "updates_per_burst": 2, "bursts": 4},
        "workload": {"classes": [{"decode_tokens": {"median": 2000, "sigma": 0.7, "cap": 12000}}]},
        "engine": {"decode_tok_s_per_gpu": 400.0, "seq_cap_tok_s": 100.0},
        "trainer": {"train_tok_s_per_gpu": 900.0},
        "policy_args": {"verl-default": {"deactivate_ratio": 0.6}},
    }
    for key, val in over.items():
        if isinstance(val, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **val}
        else:
            data[key] = val
    return Scenario.model_validate(data)
