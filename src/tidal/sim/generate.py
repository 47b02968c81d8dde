"""Random scenarios over the parameters of the shipped ones, for robustness benchmarks.

In: a seed and an index (``generate(seed, i)``), or a seed and a count (``generate_set``). Out:
validated ``Scenario`` objects on the cost model, each drawn independently from its own
``random.Random(f"{seed}:{i}")`` stream (the same seed gives the same set, and scenario ``i``
does not depend on how many others are drawn). The ranges span the shipped scenarios
(``dapo-math-32gpu``, ``mixed``, ``swe-agent-long-tail``, ``qwengyre-long-tail``): model and GPU,
engine tensor parallelism, cluster size and split (hybrid cells, standalone engines, slots),
GRPO group size and batch, single-turn answers or multi-turn agents (lengths and their tails,
tool waits and outputs, timeouts), staleness, and the sync and switch costs (link efficiency,
sleep and wake), and the trainer as each mode runs it (mini-batches per step, fixed per-step
costs, micro-batch size, whether verl's fully-async trainer reuses the rollout's log-probs).
Runs are kept short (a few versions) so that a benchmark over 50+ scenarios
and every policy takes minutes, not hours.
"""

from __future__ import annotations

import random
from typing import Any

from tidal.config import validate_model
from tidal.sim.scenario import Scenario

MODELS = ("qwen3.5-35b-a3b", "qwen3-30b-a3b", "qwen2.5-7b")
GPUS = ("H20", "H200", "H100")
EFFICIENCY = {"decode": 0.488, "mfu": 0.4593}  # as fitted on dapo-math-32gpu


def _log_uniform(rng: random.Random, lo: float, hi: float) -> float:
    return lo * (hi / lo) ** rng.random()


def _workload(rng: random.Random) -> dict[str, Any]:
    """One execution class: a single-turn answer (math-like) or a multi-turn agent."""
    if rng.random() < 0.4:
        dec = _log_uniform(rng, 1500, 15000)
        return {
            "name": "answer",
            "turns": {"median": 1},
            "decode_tokens": {
                "median": round(dec),
                "sigma": rng.uniform(0.4, 1.0),
                "cap": round(dec * rng.uniform(4, 8)),
            },
            "prompt_tokens": rng.choice([300, 1000, 2000]),
            "group_share": rng.uniform(0.2, 0.5),
            "success_rate": 0.5,
        }
    dec = _log_uniform(rng, 150, 1500)
    tool = _log_uniform(rng, 0.5, 30)
    out = _log_uniform(rng, 100, 2000)
    cls: dict[str, Any] = {
        "name": "agent",
        "turns": {
            "median": round(_log_uniform(rng, 3, 30)),
            "sigma": rng.uniform(0.3, 0.8),
            "cap": 150,
            "lo": 1,
        },
        "decode_tokens": {
            "median": round(dec),
            "sigma": rng.uniform(0.5, 1.0),
            "cap": round(dec * 10),
        },
        "tool_s": {"median": round(tool, 2), "sigma": rng.uniform(0.5, 2.0), "cap": 900},
        "tool_output_tokens": {"median": round(out), "sigma": 1.0, "cap": round(out * 10)},
        "prompt_tokens": rng.choice([1000, 2000, 6000]),
        "group_share": rng.uniform(0.2, 0.5),
        "success_rate": 0.3,
    }
    if rng.random() < 0.5:
        cls["timeout_s"] = 14400.0
    return cls


def generate(seed: int, index: int) -> Scenario:
    """Scenario ``index`` of the set drawn with ``seed``."""
    rng = random.Random(f"{seed}:{index}")
    gpu = rng.choice(GPUS)
    model = rng.choice(MODELS)
    tp = rng.choice([4, 8])
    cells = rng.randint(2, 6)
    standalone = rng.randint(1, 4)  # hybrid cells start in training: rollout needs one
    slots = rng.choice([64, 96, 128, 192])
    group = rng.choice([4, 8, 16])
    batch = rng.choice([8, 16, 32])
    updates = rng.choice([1, 2, 4])
    bursts = max(2, round(24 / updates))  # 24 optimizer steps
    data = {
        "name": f"gen-{seed}-{index}",
        "description": f"generated: {cells}x8 hybrid + {standalone}x8 standalone {gpu}, {model}",
        "seed": rng.randrange(1 << 30),
        "cluster": {
            "cell_count": cells,
            "cell_gpus": 8,
            "cell_slots": slots,
            "cell_kind": "hybrid",
            "standalone_count": standalone,
            "standalone_gpus": 8,
            "standalone_slots": slots,
        },
        "control": {
            "group_size": group,
            "batch_groups": batch,
            "updates_per_burst": updates,
            "bursts": bursts,
            "supply_fraction": 0.5,
            "supply_hold_s": 0.0,
        },
        "sim": {"staleness_threshold": rng.choice([0.5, 1.0, 2.0]), "tick_s": 10.0},
        "workload": {"classes": [_workload(rng)]},
        "costmodel": {
            "gpu": gpu,
            "model": model,
            "engine_tp": tp,
            "efficiency": {**EFFICIENCY, "link": round(rng.uniform(0.08, 0.4), 3)},
        },
        "trainer": {"scaling_efficiency": rng.uniform(0.8, 0.95)},
        "costs": {
            "sync_latency_s": 1.0,
            "sleep_s": rng.uniform(1, 10),
            "wake_s": rng.uniform(1, 10),
        },
        "policy_args": {
            "verl-default": {"deactivate_ratio": 0.6},
            "verl-fixed-ratio": {"deactivate_ratio": 0.6},
        },
    }
    # The trainer as each mode runs it (drawn last, so the draws above keep their values):
    # optimizer updates per step (mini-batches), fixed per-step costs, micro-batch size;
    # the colocate family offloads and recomputes old log-probs, verl's uses the rollout's.
    data["trainer"]["mini_batch_groups"] = max(1, batch // rng.choice([1, 2, 4]))
    data["trainer"]["fixed_step_s"] = round(rng.uniform(0.0, 10.0), 2)
    data["sim"]["micro_batch_tokens"] = rng.choice([16384, 32768, 65536])
    if rng.random() < 0.5:
        data["profiles"] = {
            "static": {"old_log_prob": False},
            "verl-static": {"old_log_prob": False},
        }
    return validate_model(Scenario, data, f"generated scenario {index}")


def generate_set(seed: int, count: int) -> list[Scenario]:
    """Scenarios ``0 .. count - 1`` of the set drawn with ``seed``."""
    return [generate(seed, i) for i in range(count)]
