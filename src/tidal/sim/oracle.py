"""An oracle lower bound on the makespan, printed beside every run.

In: a scenario. Out: ``OracleBound``: the largest of five bounds that no schedule of any
registered policy can beat, with each bound kept for the report. Nothing here runs a policy.

Facts every run obeys (each is a property of the simulated system, not of a policy):
(F1) A run trains on ``N = steps * b`` groups (``b`` groups per optimizer step, ``U`` steps per
     weight version, ``V`` versions). Groups are dispatched in the seeded workload's draw order.
(F2) Dispatch budget: version ``v`` may dispatch ``max(0, B - carried_v)`` groups, where
     ``carried_v = D_{v-1} - v*U*b`` (dispatched, not yet consumed, when it starts) and ``B``
     the per-version budget (the largest over all policy families). By induction the groups
     dispatched by the end of version ``v`` number ``D_v <= v*U*b + B``, so group ``k`` (draw
     order, from 0) is dispatched no earlier than the start ``S_{v(k)}`` of version
     ``v(k) = max(0, ceil((k + 1 - B) / (U*b))``, and only the first
     ``K = N - U*b + B`` groups can ever be dispatched: the groups trained on are some N of K.
(F3) No sequence decodes faster than the per-sequence cap, so group ``k`` cannot complete
     before ``d_k`` = its slowest member's decode tokens / cap + tool waits after its
     launch (no timeout can fire earlier than its ``timeout_s``; see the cap below).
(F4) Step ``s`` cannot end before ``b*(s+1)`` groups are complete, nor before its own tokens
     are trained at the fastest training rate ``rho_max`` after the previous step; an optimizer
     step (``optimizer_s``) follows the compute; after the last step of a version the weights
     are published (``sync_s``) before the next version starts: the trainer computes only
     outside optimizer steps and syncs, and not before the first group completes.
(F5) Only cells train, with the speed of ``train_rate_tok_s``: ``k`` cells of ``g`` GPUs
     process ``r * g * e**log2(k)`` tokens/s, so a token costs ``1 / (r * e**log2(k))``
     GPU-seconds; standalone engines never train. Rollout work runs at ``decode_tok_s_per_gpu``
     per GPU at best, and with a cost model whose peak is memory-bound every decoded token
     also reads its context's KV cache (``kv_gpu_s_per_ctx_token`` per context token: a
     step lasts at least its bytes over the bandwidth, ``tidal.sim.perf``); during every
     weight sync all standalone engines are paused.
(F6) A step's compute ends with at least one cell in training (the rate must be > 0). That
     cell neither trains during the optimizer step (nor, after a version's last step, during
     the sync) nor decodes before a return to rollout completes (``tau_r``, the shortest
     return plan: a role changes only when its plan's last step is done). Those windows of
     distinct steps are disjoint, and disjoint from compute.
(F7) During a weight sync ``[a, a + sync_s)`` no cell does useful work, in a window of its own,
     when (a) ``tau_r >= optimizer_s + sync_s``, (b) ``optimizer_s`` plus the fewest seconds
     any step computes is ``>= sync_s`` and (c) no plan can abort (no injected step failures,
     every step shorter than the step timeout; a KV handoff moves at most a full cell of the
     longest contexts). Proof, per cell, by its role at ``a``: TRAINING: the trainer does
     not compute during a sync, and a return to rollout started at ``a`` or later ends after
     ``a + tau_r >= a + sync_s``; ROLLOUT: its engine admits, so the sync pauses it until
     ``a + sync_s`` whatever its role becomes; MOVING_TO_TRAINING: it admits nothing (a plan
     that cannot abort cannot bring it back before it trains), and paused if it still holds
     executions; MOVING_TO_ROLLOUT: if its plan ends at ``y`` inside the sync it may decode
     after ``y``, but it was moving during ``[y - tau_r, y)``: charge ``[y - sync_s, y)``
     instead. The windows are disjoint from the F6 windows of the same cell: the cell that
     ends a version's last compute at ``a - optimizer_s`` cannot finish a return before
     ``a - optimizer_s + tau_r >= a + sync_s`` by (a), and every earlier F6 window ends by
     ``a - optimizer_s - (fewest compute seconds) <= a - sync_s`` by (b); versions are
     longer than a sync. So every GPU of the cluster is charged ``sync_s`` at every sync.

The bounds (``R`` = the N smallest rollout GPU-seconds among the K candidates, ``T`` = the N
smallest training-token totals; every real run does at least this work):
- work: (rollout + single-cell training GPU-seconds of the N most favourable groups) / all GPUs.
- critical path: the N-th fastest group at the cap, then one batch on the whole cluster; and
  the chain of optimizer steps (as before this module grew the two bounds below).
- slots: every execution holds a slot for at least its fastest duration, over all slots.
- trainer LP (F4-F6): the trainer computes for ``C(M) = M - (V-1)*sync_s - steps*optimizer_s
  - t_first`` at most; processing ``T`` tokens in time ``C`` costs at least ``C * h(T / C)``
  GPU-seconds, ``h`` the lower convex hull of (rate, GPUs) over "the k largest cells train"
  (for k cells the cost per token is fixed, the largest are fastest; time-sharing between
  configurations is allowed). So ``G * M >= R + C * h(T / C) + G_standalone * (V-1) * sync_s
  + g_min * (steps * min(optimizer_s, tau_r) + (V-1) * (min(optimizer_s + sync_s, tau_r) -
  min(optimizer_s, tau_r)))``, and where F7 holds ``G * M >= R + C * h(T / C) + G * (V-1) *
  sync_s + g_min * steps * min(optimizer_s, tau_r)``; the left side grows with M and the right
  side shrinks (``h`` is convex through 0), so the least feasible M is found by bisection.
- pipeline (F2-F4): ``S_0 = 0``; in version ``v`` the completion of group ``k`` is at least
  ``c_k = S_{v(k)} + d_k`` for every released group (``v(k) <= v``). Let ``c_(1) <= c_(2) ...``
  be these bounds sorted: the i-th completion among any groups is no earlier than ``c_(i)``.
  Step ``s`` trains ``n = b*(s+1)`` groups by its end; those completing from the i-th on are
  all trained after ``c_(i)``, so ``E_s >= max_i (c_(i) + train(n - i + 1)) + optimizer_s``
  (``train(m)``: the fewest seconds in which any m groups train at ``rho_max``), and
  ``E_s >= E_{s-1} + train(b) + optimizer_s`` (``E_{s-1}`` is ``S_v`` for a version's first
  step); ``S_{v+1} = E_last + sync_s``. Every quantity bounds its real counterpart from below
  and the recursion is monotone, so ``E`` of the final step bounds the makespan.
Timeouts only shorten executions and cut their tokens. The pipeline uses durations cut at the
timeout and a timed-out execution's fewest tokens (its prompt), so it holds either way; the
other bounds assume that no timeout fires, and a run in which one fires lasts at least the
smallest ``timeout_s``: each of them is reported as ``min(bound, smallest timeout)``.
Not bounded (no policy is forced to pay them): switch costs, re-prefill, rollout engines below
saturation, training cells waiting for data.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from tidal.control.mechanics import MECHANICS_SETS, Mechanics
from tidal.control.plans import QWENGYRE_TO_ROLLOUT, VERL_ACTIVATE, StepKind
from tidal.control.policy import registered_mechanics
from tidal.control.verl import dispatch_budget
from tidal.sim import perf
from tidal.sim.costs import kv_handoff_s, step_duration_s, train_rate_tok_s
from tidal.sim.scenario import Scenario, train_work_tokens
from tidal.sim.workloads import make_workload


@dataclass(frozen=True)
class OracleBound:
    makespan_s: float
    work_s: float
    critical_path_s: float
    slots_s: float
    trainer_lp_s: float
    pipeline_s: float
    rollout_gpu_s: float
    train_gpu_s: float

    @property
    def legacy_s(self) -> float:
        """The bound before the trainer LP and the pipeline were added."""
        return max(self.work_s, self.critical_path_s, self.slots_s)

    def to_json(self) -> dict[str, float]:
        return {k: round(v, 3) for k, v in self.__dict__.items()}


@dataclass(frozen=True)
class Candidates:
    """Per candidate group (draw order): rollout GPU-s, training tokens (and the fewest it can
    have when executions may time out: the prompts), single-cell training GPU-s, fastest
    duration without and with timeouts, slot-seconds held."""

    roll_gpu_s: list[float]
    train_tok: list[float]
    train_tok_timeout: list[float]
    train_gpu_s: list[float]
    fastest_s: list[float]
    fastest_timeout_s: list[float]
    held_s: list[float]
    min_timeout_s: float
    max_context_tokens: int = 0


def max_staleness(sc: Scenario) -> float:
    """The largest staleness any policy may run with here: the scenario's, every system's
    mechanics set, every registered policy's declaration and the scenario's own profiles."""
    every = (*MECHANICS_SETS.values(), *registered_mechanics().values(), *sc.profiles.values())
    return max(
        [sc.staleness_for(Mechanics())]  # the scenario's own (control, else sim section)
        + [p.staleness_threshold for p in every if p.staleness_threshold is not None]
    )


def dispatch_budget_groups(sc: Scenario) -> int:
    ctrl = sc.control
    stale = max_staleness(sc)
    return dispatch_budget(ctrl.batch_groups, stale, ctrl.updates_per_burst)


def candidate_groups(sc: Scenario) -> int:
    ctrl = sc.control
    n = sc.total_steps * ctrl.batch_groups
    return max(n, n - ctrl.batch_groups * ctrl.updates_per_burst + dispatch_budget_groups(sc))


def draw_candidates(sc: Scenario) -> Candidates:
    eng, tr = sc.engine, sc.trainer
    wl = make_workload(sc.workload, sc.seed, sc.control.batch_groups)
    out = Candidates([], [], [], [], [], [], [], math.inf)
    min_timeout = math.inf
    max_ctx = 0
    for _ in range(candidate_groups(sc)):
        roll = tokens = tokens_to = longest = longest_to = held = 0.0
        for spec in wl.group(sc.control.group_size):
            dec = pre = 0
            tools_s = 0.0
            ctx, ctx_sum = spec.prompt_tokens, 0.0
            for d_tok, tool_s, out_tok in spec.turns:
                dec += d_tok
                pre += out_tok
                tools_s += tool_s
                ctx_sum += d_tok * ctx + d_tok * (d_tok - 1) / 2  # context of each token
                ctx += d_tok + out_tok
            # Nothing follows the last turn: no tool wait, no tool output to prefill.
            # The longest context an execution can reach: prompt, every turn and tool output.
            max_ctx = max(max_ctx, spec.prompt_tokens + dec + pre)
            pre += spec.prompt_tokens - spec.turns[-1][2]
            tools_s -= spec.turns[-1][1]
            work = dec + pre * eng.prefill_equiv
            roll += work / eng.decode_tok_s_per_gpu + ctx_sum * eng.kv_gpu_s_per_ctx_token
            # Training work of the sequence (token equivalents, attention included).
            tokens += train_work_tokens(dec + pre, tr)
            tokens_to += train_work_tokens(
                dec + pre if spec.timeout_s is None else spec.prompt_tokens, tr
            )
            # Prefill may run at the whole engine's speed: only decode bounds the latency.
            longest = max(longest, dec / eng.seq_cap_tok_s + tools_s)
            d_to = dec / eng.seq_cap_tok_s + tools_s
            if spec.timeout_s is not None:
                d_to = min(d_to, spec.timeout_s)
                min_timeout = min(min_timeout, spec.timeout_s)
            longest_to = max(longest_to, d_to)
            held += d_to
        out.roll_gpu_s.append(roll)
        out.train_tok.append(tokens)
        out.train_tok_timeout.append(tokens_to)
        out.train_gpu_s.append(tokens / tr.train_tok_s_per_gpu)
        out.fastest_s.append(longest)
        out.fastest_timeout_s.append(longest_to)
        out.held_s.append(held)
    return Candidates(
        out.roll_gpu_s,
        out.train_tok,
        out.train_tok_timeout,
        out.train_gpu_s,
        out.fastest_s,
        out.fastest_timeout_s,
        out.held_s,
        min_timeout,
        max_ctx,
    )


def training_configs(sc: Scenario) -> list[tuple[float, float]]:
    """(tokens/s, GPUs) of the fastest configuration with k training cells, k = 1..n: for k
    cells the cost per token is fixed (F5), so the k largest cells are the best k."""
    sizes = sorted((c.gpus for c in sc.cluster.cell_specs()), reverse=True)
    out, gpus = [], 0
    for k, g in enumerate(sizes, 1):
        gpus += g
        out.append((train_rate_tok_s(gpus, k, sc.trainer), float(gpus)))
    return out


def hull_rate_max(sc: Scenario) -> float:
    """The fastest training rate of any configuration (tokens/s)."""
    return max(r for r, _ in training_configs(sc))


def lower_hull(configs: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The lower convex hull of (0, 0) and the (rate, GPUs) points, by increasing rate: the
    fewest GPUs that sustain an average rate when configurations (and idling) time-share."""
    hull: list[tuple[float, float]] = []
    for p in sorted({(0.0, 0.0), *configs}):
        while len(hull) >= 2:
            (x1, y1), (x2, y2) = hull[-2], hull[-1]
            # Drop the middle point if it lies on or above the chord to p.
            if (y2 - y1) * (p[0] - x1) >= (p[1] - y1) * (x2 - x1):
                hull.pop()
            else:
                break
        if hull and p[0] == hull[-1][0]:
            continue  # same rate, more GPUs
        hull.append(p)
    return hull


def min_train_gpus(rate: float, hull: list[tuple[float, float]]) -> float:
    """GPUs on the hull at ``rate`` tokens/s; inf above the fastest configuration."""
    if rate > hull[-1][0]:
        return math.inf
    i = max(1, bisect.bisect_left(hull, (rate, -math.inf)))
    (r1, g1), (r2, g2) = hull[i - 1], hull[min(i, len(hull) - 1)]
    return g1 if r2 == r1 else g1 + (g2 - g1) * (rate - r1) / (r2 - r1)


def min_return_s(sc: Scenario) -> float:
    """The shortest plan that returns a training cell to rollout (its role changes only when
    the last step completes)."""
    optional = (StepKind.REBALANCE, StepKind.KV_HANDOFF)
    return min(
        sum(step_duration_s(k, sc.costs) for k in kinds if k not in optional)
        for kinds in (QWENGYRE_TO_ROLLOUT, VERL_ACTIVATE)
    )


def plans_never_abort(sc: Scenario, max_context_tokens: int) -> bool:
    """No transition plan can abort: no injected step failures, and every step (a KV handoff
    moves at most a full cell of the longest contexts) ends before the step timeout."""
    if sc.sim.step_failure_rate > 0:
        return False
    slots = max(c.slots for c in sc.cluster.cell_specs())
    longest = max(
        [step_duration_s(k, sc.costs) for k in StepKind if k is not StepKind.KV_HANDOFF]
        + [kv_handoff_s(slots * max_context_tokens, sc.costs)]
    )
    return longest < sc.control.step_timeout_s


def sync_stops_every_cell(sc: Scenario, step_compute_min_s: float, max_context_tokens: int) -> bool:
    """(F7) holds: no cell does useful work during a weight sync (see the module docstring)."""
    tau_r = min_return_s(sc)
    sync_s, opt_s = sc.costs.sync_s, sc.trainer.optimizer_s
    return (
        tau_r >= opt_s + sync_s
        and opt_s + step_compute_min_s >= sync_s
        and plans_never_abort(sc, max_context_tokens)
    )


def trainer_lp_bound(
    sc: Scenario, roll_gpu_s: float, tokens: float, t_first_s: float, every_cell_syncs: bool = False
) -> float:
    cl, tr = sc.cluster, sc.trainer
    cell_gpus = sum(c.gpus for c in cl.cell_specs())
    gpus = cell_gpus + cl.standalone_count * cl.standalone_gpus
    syncs = max(0, (sc.control.bursts or 1) - 1)
    sync_s = syncs * sc.costs.sync_s
    fixed_s = sync_s + sc.total_steps * tr.optimizer_s + t_first_s
    # (F6) The trainer's compute of a step ends with at least one cell in training; that cell
    # cannot decode until a return to rollout completes (tau_r), nor train during the
    # optimizer step and, after a version's last step, the weight sync: these windows of
    # distinct steps are disjoint. The standalone engines are paused during every sync.
    # (F7) Where it holds, every cell is idle for a sync's length at every sync, in windows
    # disjoint from the F6 windows of optimizer steps: all GPUs are charged for the syncs.
    tau_r = min_return_s(sc)
    step_idle_s = min(tr.optimizer_s, tau_r)
    sync_idle_s = min(tr.optimizer_s + sc.costs.sync_s, tau_r) - step_idle_s
    g_min = min(c.gpus for c in cl.cell_specs())
    if every_cell_syncs:
        loss_gpu_s = gpus * sync_s + g_min * sc.total_steps * step_idle_s
    else:
        loss_gpu_s = cl.standalone_count * cl.standalone_gpus * sync_s + g_min * (
            sc.total_steps * step_idle_s + syncs * sync_idle_s
        )
    hull = lower_hull(training_configs(sc))
    rho_max = hull[-1][0]

    def slack(m: float) -> float:
        compute_s = m - fixed_s
        if compute_s <= 0 or tokens > rho_max * compute_s * (1 + 1e-12):
            return -math.inf
        rate = min(tokens / compute_s, rho_max)
        return gpus * m - roll_gpu_s - compute_s * min_train_gpus(rate, hull) - loss_gpu_s

    lo = fixed_s
    hi = max(fixed_s + tokens / rho_max, 1.0) * 2 + (roll_gpu_s + loss_gpu_s) / gpus
    while slack(hi) < 0:
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        if slack(mid) >= 0:
            hi = mid
        else:
            lo = mid
        if hi - lo <= 1e-9 * hi:
            break
    return hi


def pipeline_bound(sc: Scenario, fastest_s: list[float], train_tok: list[float]) -> float:
    ctrl, tr = sc.control, sc.trainer
    b, u = ctrl.batch_groups, ctrl.updates_per_burst
    budget = dispatch_budget_groups(sc)
    rho_max = max(r for r, _ in training_configs(sc))
    # train_after[m]: the fewest seconds in which any m groups can be trained.
    train_after = [0.0]
    for tok in sorted(train_tok):
        train_after.append(train_after[-1] + tok / rho_max)
    done: list[float] = []  # lower bounds of completion times of released groups, sorted
    released = 0
    start = end = 0.0
    for v in range(ctrl.bursts or 0):
        limit = min(len(fastest_s), v * u * b + budget)
        for k in range(released, limit):
            bisect.insort(done, start + fastest_s[k])
        released = limit
        for j in range(u):
            n = b * (v * u + j + 1)
            # The groups trained by this step complete no earlier than done[0..n-1] in turn:
            # those from the i-th completion on are all trained after it.
            last = max(done[i] + train_after[n - i] for i in range(max(0, n - u * b - budget), n))
            end = max(start + train_after[b], last) + tr.optimizer_s
            start = end
        start = end + sc.costs.sync_s
    return end


def fastest_trainer(sc: Scenario) -> Scenario:
    """The scenario with the fewest trainer passes any of its policies runs (a profile may
    drop the old-log-prob pass), so the bound holds for every policy."""
    for name in sc.policies:
        p = sc.profile_for(name.split(":")[0])
        if p.old_log_prob is False:
            return sc.for_profile(p)
    return sc


def oracle_bound(sc: Scenario) -> OracleBound:
    # With a cost model: peak decode and the cap are upper bounds.
    sc = perf.resolve(fastest_trainer(sc))
    cl, tr = sc.cluster, sc.trainer
    cells = cl.cell_specs()
    gpus = sum(c.gpus for c in cells) + cl.standalone_count * cl.standalone_gpus
    slots = sum(c.slots for c in cells) + cl.standalone_count * cl.standalone_slots
    steps = sc.total_steps
    n = steps * sc.control.batch_groups
    cand = draw_candidates(sc)
    work = sorted(zip(cand.roll_gpu_s, cand.train_gpu_s, strict=True), key=sum)[:n]
    roll_gpu_s = sum(w[0] for w in work)
    train_gpu_s = sum(w[1] for w in work)
    work_s = (roll_gpu_s + train_gpu_s) / gpus
    per_batch = sum(sorted(cand.train_tok)[:n]) / max(1, steps)
    one_batch_s = per_batch / (tr.train_tok_s_per_gpu * gpus)
    nth_fastest = sorted(cand.fastest_timeout_s)[n - 1]
    critical = max(
        nth_fastest + one_batch_s + tr.optimizer_s, steps * (one_batch_s + tr.optimizer_s)
    )
    slots_s = sum(sorted(cand.held_s)[:n]) / slots
    # The fewest seconds any step computes: its b groups' fewest tokens at the fastest rate.
    b = sc.control.batch_groups
    step_min_s = sum(sorted(cand.train_tok_timeout)[:b]) / hull_rate_max(sc)
    lp_s = trainer_lp_bound(
        sc,
        sum(sorted(cand.roll_gpu_s)[:n]),
        sum(sorted(cand.train_tok)[:n]),
        min(cand.fastest_s),
        sync_stops_every_cell(sc, step_min_s, cand.max_context_tokens),
    )
    # Timeouts can only shorten durations and cut tokens: the pipeline with both cut holds
    # whether or not one fires; the rest holds for runs in which none fires, and a run in which
    # one fires lasts at least the smallest timeout.
    cap = cand.min_timeout_s
    pipe_s = pipeline_bound(sc, cand.fastest_timeout_s, cand.train_tok_timeout)
    if cap < math.inf:
        pipe_s = max(pipe_s, min(cap, pipeline_bound(sc, cand.fastest_s, cand.train_tok)))
    work_s, critical, lp_s = (min(x, cap) for x in (work_s, critical, lp_s))
    return OracleBound(
        max(work_s, critical, slots_s, lp_s, pipe_s),
        work_s,
        critical,
        slots_s,
        lp_s,
        pipe_s,
        roll_gpu_s,
        train_gpu_s,
    )
