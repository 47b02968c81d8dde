"""An oracle lower bound on the makespan, printed beside every run.

In: a scenario. Out: the largest of three bounds no schedule can beat (all computed on the very
groups the run trains on: the same seeded workload, ``steps * batch_groups`` groups):
- work: all rollout GPU-seconds (decode plus one prefill of every prompt and tool output, at
  the engines' full throughput) plus all training GPU-seconds (at single-cell efficiency),
  spread over every GPU of the cluster;
- critical path: the slowest execution at the per-sequence speed cap, then its batch trained on
  the whole cluster; and the chain of optimizer steps each training one batch on all GPUs;
- slots: every execution holds a slot for at least its fastest duration, over all slots.
"""

from __future__ import annotations

from dataclasses import dataclass

from tidal.sim.scenario import Scenario
from tidal.sim.workloads import make_workload


@dataclass(frozen=True)
class OracleBound:
    makespan_s: float
    work_s: float
    critical_path_s: float
    slots_s: float
    rollout_gpu_s: float
    train_gpu_s: float

    def to_json(self) -> dict[str, float]:
        return {k: round(v, 3) for k, v in self.__dict__.items()}


def oracle_bound(sc: Scenario) -> OracleBound:
    cl, eng, tr = sc.cluster, sc.engine, sc.trainer
    cells = cl.cell_specs()
    gpus = sum(c.gpus for c in cells) + cl.standalone_count * cl.standalone_gpus
    slots = sum(c.slots for c in cells) + cl.standalone_count * cl.standalone_slots
    steps = sc.total_steps
    wl = make_workload(sc.workload, sc.seed)
    n_groups = steps * sc.control.batch_groups
    roll_gpu_s = train_gpu_s = slot_s = longest = 0.0
    batch_tokens: list[float] = []
    for _ in range(n_groups):
        group = wl.group(sc.control.group_size)
        tokens = 0.0
        for spec in group:
            work = spec.decode_tokens + spec.prefill_tokens * eng.prefill_equiv
            roll_gpu_s += work / eng.decode_tok_s_per_gpu
            train_gpu_s += spec.train_tokens / tr.train_tok_s_per_gpu
            d = spec.min_duration_s(eng.seq_cap_tok_s)
            if spec.timeout_s is not None:
                d = min(d, spec.timeout_s)
            slot_s += d
            longest = max(longest, d)
            tokens += spec.train_tokens
        batch_tokens.append(tokens)
    per_batch = sum(batch_tokens) / max(1, steps)
    work_s = (roll_gpu_s + train_gpu_s) / gpus
    one_batch_s = per_batch / (tr.train_tok_s_per_gpu * gpus)
    critical = max(longest + one_batch_s + tr.optimizer_s,
                   steps * (one_batch_s + tr.optimizer_s))
    slots_s = slot_s / slots
    return OracleBound(max(work_s, critical, slots_s), work_s, critical, slots_s,
                       roll_gpu_s, train_gpu_s)
