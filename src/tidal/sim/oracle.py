"""An oracle lower bound on the makespan, printed beside every run.

In: a scenario. Out: the largest of three bounds no schedule can beat. A run trains on
``N = steps * batch_groups`` groups; dispatch follows the seeded workload's draw order and the
per-version budget (``quota = budget - carried`` at every version start) lets at most
``M = N - batch_groups * updates_per_burst + budget`` groups ever be dispatched, so the groups
trained on are some N of the first M drawn. Each bound takes the N most favourable of those M:
- work: rollout GPU-seconds (decode plus one prefill of every prompt and tool output, at the
  engines' full throughput) plus training GPU-seconds (at single-cell efficiency), over every
  GPU of the cluster;
- critical path: the N-th fastest group at the per-sequence speed cap, then its batch trained
  on the whole cluster; and the chain of optimizer steps each training one batch on all GPUs;
- slots: every execution holds a slot for at least its fastest duration, over all slots.
"""

from __future__ import annotations

from dataclasses import dataclass

from tidal.control.verl import dispatch_budget
from tidal.sim.scenario import FAMILY_PROFILES, Scenario
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


def candidate_groups(sc: Scenario) -> int:
    ctrl = sc.control
    stale = max([sc.sim.staleness_threshold]
                + [p.staleness_threshold for p in (*FAMILY_PROFILES.values(),
                                                   *sc.profiles.values())
                   if p.staleness_threshold is not None])
    budget = dispatch_budget(ctrl.batch_groups, stale, ctrl.updates_per_burst)
    n = sc.total_steps * ctrl.batch_groups
    return max(n, n - ctrl.batch_groups * ctrl.updates_per_burst + budget)


def oracle_bound(sc: Scenario) -> OracleBound:
    cl, eng, tr = sc.cluster, sc.engine, sc.trainer
    cells = cl.cell_specs()
    gpus = sum(c.gpus for c in cells) + cl.standalone_count * cl.standalone_gpus
    slots = sum(c.slots for c in cells) + cl.standalone_count * cl.standalone_slots
    steps = sc.total_steps
    n = steps * sc.control.batch_groups
    wl = make_workload(sc.workload, sc.seed)
    work, train_tok, duration, slot_s = [], [], [], []
    for _ in range(candidate_groups(sc)):
        roll = train = longest = held = tokens = 0.0
        for spec in wl.group(sc.control.group_size):
            roll += (spec.decode_tokens + spec.prefill_tokens * eng.prefill_equiv) \
                / eng.decode_tok_s_per_gpu
            train += spec.train_tokens / tr.train_tok_s_per_gpu
            d = spec.min_duration_s(eng.seq_cap_tok_s)
            if spec.timeout_s is not None:
                d = min(d, spec.timeout_s)
            held += d
            longest = max(longest, d)
            tokens += spec.train_tokens
        work.append((roll + train, roll, train))
        train_tok.append(tokens)
        duration.append(longest)
        slot_s.append(held)
    best = sorted(work)[:n]
    roll_gpu_s = sum(w[1] for w in best)
    train_gpu_s = sum(w[2] for w in best)
    work_s = (roll_gpu_s + train_gpu_s) / gpus
    per_batch = sum(sorted(train_tok)[:n]) / max(1, steps)
    one_batch_s = per_batch / (tr.train_tok_s_per_gpu * gpus)
    nth_fastest = sorted(duration)[n - 1]
    critical = max(nth_fastest + one_batch_s + tr.optimizer_s,
                   steps * (one_batch_s + tr.optimizer_s))
    slots_s = sum(sorted(slot_s)[:n]) / slots
    return OracleBound(max(work_s, critical, slots_s), work_s, critical, slots_s,
                       roll_gpu_s, train_gpu_s)
