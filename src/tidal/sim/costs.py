"""Costs of transition steps, weight syncs, KV handoff and training, in virtual seconds.

In: the scenario's ``CostConfig`` / ``TrainerConfig`` and a step kind (plus, for KV handoff,
the tokens whose cache moves). Out: durations. Pure functions of their inputs.
"""

from __future__ import annotations

import math

from tidal.control.plans import StepKind
from tidal.sim.scenario import CostConfig, TrainerConfig


def step_duration_s(kind: StepKind, costs: CostConfig, kv_tokens: int = 0) -> float:
    """How long one plan step takes (the effects are modelled by the actuator)."""
    c = costs
    table = {
        StepKind.STOP_ADMISSION: c.admission_s,
        StepKind.REMOVE_FROM_LOAD_BALANCER: c.admission_s,
        StepKind.ADD_TO_LOAD_BALANCER: c.admission_s,
        StepKind.RESUME_ADMISSION: c.admission_s,
        StepKind.RESUME_GENERATION: c.admission_s,
        StepKind.RESERVE_AND_REROUTE: c.reroute_s,
        StepKind.CANCEL_AND_RETRY: c.reroute_s,
        StepKind.ABORT_INFLIGHT: c.reroute_s,
        StepKind.REBALANCE: c.reroute_s,
        StepKind.RELEASE_ROLLOUT_MEMORY: c.release_s,
        StepKind.SLEEP_ENGINE: c.sleep_s,
        StepKind.WAKE_ENGINE: c.wake_s,
        StepKind.RESTORE_TRAINING_STATE: c.onload_s,
        StepKind.OFFLOAD_TRAINING_STATE: c.offload_s,
        StepKind.LOAD_WEIGHTS: c.sync_s if c.load_weights_s is None else c.load_weights_s,
        StepKind.SYNC_WEIGHTS: c.sync_s,
    }
    if kind is StepKind.KV_HANDOFF:
        return kv_handoff_s(kv_tokens, c)
    return table[kind]


def kv_handoff_s(tokens: int, costs: CostConfig) -> float:
    return costs.kv_latency_s + tokens * costs.kv_kb_per_token * 1e3 / (costs.kv_gb_s * 1e9)


def speedup(cells: int, efficiency: float) -> float:
    """Training speed-up of ``cells`` cells over one: ``n * e**log2(n)`` (``e`` per doubling)."""
    if cells <= 0:
        return 0.0
    return cells * efficiency ** math.log2(cells)


def train_rate_tok_s(gpus: int, cells: int, trainer: TrainerConfig) -> float:
    """Training tokens per second on ``gpus`` GPUs spread over ``cells`` cells."""
    if gpus <= 0 or cells <= 0:
        return 0.0
    per_cell = gpus / cells
    return trainer.train_tok_s_per_gpu * per_cell * speedup(cells, trainer.scaling_efficiency)
