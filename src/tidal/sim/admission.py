"""Admission control in the simulated world: each engine's concurrency target and fair queue.

In: the world (its resolved scenario, run config and engines). Out: every engine configured
with ``tidal.control.admission``'s target and ``FairQueue`` when ``control.admission`` is on
(nothing changes when it is off). The throughput curve of an engine is the cost model's
(``perf.EngineModel.throughput_tok_s`` per replica, at the workload's typical context), or,
without a cost model, the plain engine's ``min(throughput, n * seq_cap)``. The rule itself
lives in ``tidal.control.admission``; this module only supplies the curve.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from tidal.control.admission import AdmissionRule, FairQueue, concurrency_target

if TYPE_CHECKING:
    from tidal.sim.engines import Engine
    from tidal.sim.scenario import Scenario
    from tidal.sim.world import World


def typical_context_tokens(sc: Scenario) -> float:
    """Mean context a decoding sequence holds: the prompt plus half of an execution's decoded
    and tool tokens (lognormal means, weighted by class share); the cost model's nominal
    context for a replayed trace."""
    classes = sc.workload.classes
    if sc.workload.trace is not None or not classes:
        return float(sc.costmodel.nominal_context_tokens if sc.costmodel else 0)
    total = sum(c.weight for c in classes)
    ctx = 0.0
    for c in classes:
        turns = _mean(c.turns.median, c.turns.sigma, c.turns.cap)
        per_turn = _mean(
            c.decode_tokens.median, c.decode_tokens.sigma, c.decode_tokens.cap
        ) + _mean(c.tool_output_tokens.median, c.tool_output_tokens.sigma, c.tool_output_tokens.cap)
        ctx += c.weight / total * (c.prompt_tokens + 0.5 * turns * per_turn)
    return ctx


def _mean(median: float, sigma: float, cap: float | None) -> float:
    m = median * math.exp(0.5 * sigma * sigma)
    return min(m, cap) if cap is not None else m


def engine_target(e: Engine, rule: AdmissionRule, ctx_tokens: float) -> int:
    """Sequences ``e`` decodes at once under ``rule`` (all its replicas together)."""
    m = e.model
    if m is None:
        thr, cap = e.throughput, e.seq_cap
        return concurrency_target(lambda n: min(thr, n * cap), e.slots, rule)
    k = e.replicas
    per = concurrency_target(
        lambda n: m.throughput_tok_s(n, ctx_tokens), max(1, e.slots // k), rule
    )
    return min(e.slots, k * per)


def configure(w: World) -> None:
    ctrl = w.cfg.control
    rule = AdmissionRule.parse(ctrl.admission, ctrl.admission_order)
    w.admission_rule = rule
    if not rule.on:
        return
    ctx = typical_context_tokens(w.scenario)
    for e in w.engines:
        e.admit(engine_target(e, rule, ctx), FairQueue(rule.order))
