"""The discrete-event world: executions, engines, dispatcher and trainer around the REAL
control plane, in virtual time.

In: a ``Scenario`` and one policy spec. Out: the run's makespan and counters, the controller's
decision log, time series for plots. The world holds no scheduling logic: it builds the
controller with ``tidal.control.factory.build_controller`` (on a ``ManualClock``), feeds it the
events a runtime would (dispatched, launched, closed, retried, groups assigned, trainer ready /
step done, weight sync done, step acknowledgements, ticks), and obeys its decisions: engines of
cells admit work only in ``Role.ROLLOUT``; the trainer uses only cells in ``Role.TRAINING``.
The dispatcher (budget, draw order, launches) lives in ``dispatch``, moves in ``moves``,
weight publication in ``sync``.

Event loop: one heap of (time, seq, code, a, b); processor sharing inside engines is advanced
analytically between events (see ``engines``). With ``check=True`` the DESIGN.md invariants
are checked after every event (``check_invariants``).
"""

from __future__ import annotations

import contextlib
import heapq
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from tidal.clock import ManualClock
from tidal.contracts.close import CloseReason
from tidal.control.admission import AdmissionRule
from tidal.control.carry_over import budget_groups
from tidal.control.decision_log import DecisionLog, Sink
from tidal.control.factory import build_controller
from tidal.control.plans import PlanStep, TransitionPlan
from tidal.control.queued_waits import QueuedWaits
from tidal.errors import TidalError
from tidal.sim import (
    admission,
    dispatch,
    invariants,
    moves,
    perf,
    requests,
    slot_waits,
    sync,
)
from tidal.sim.actuator import SimActuator
from tidal.sim.dispatch import ExecRec
from tidal.sim.engines import Engine
from tidal.sim.scenario import Scenario, train_work_tokens
from tidal.sim.trainer import Trainer
from tidal.sim.workloads import make_workload
from tidal.types import (
    Event,
    ExecutionClosed,
    Role,
    Tick,
)

#: called with (world, execution, from engine, to engine) after every move of an execution
#: between two engines, in every world while registered (``observing_moves``)
MoveObserver = Callable[["World", ExecRec, str, str], None]
_MOVE_OBSERVERS: list[MoveObserver] = []


@contextlib.contextmanager
def observing_moves(observer: MoveObserver) -> Iterator[None]:
    """While open, ``observer`` sees every execution any world moves from one engine to
    another (the simulator itself keeps only a count)."""
    _MOVE_OBSERVERS.append(observer)
    try:
        yield
    finally:
        _MOVE_OBSERVERS.remove(observer)


ENGINE, TOOL, TIMEOUT, TRAINER, STEP, ACK, SYNC, TICK, DISPATCH = range(9)


class SimulationError(TidalError):
    """The simulated run cannot finish (deadlock, runaway time)."""


@dataclass
class Series:
    t: list[float] = field(default_factory=list)
    waterlevel: list[int] = field(default_factory=list)
    queued: list[int] = field(default_factory=list)
    running: list[int] = field(default_factory=list)
    ready_groups: list[int] = field(default_factory=list)
    capacity: list[int] = field(default_factory=list)
    train_gpus: list[int] = field(default_factory=list)


class World:
    def _decode_meter(self) -> tuple[float, float]:
        tokens = seq_s = 0.0
        for e in self.engines:
            t, s = e.meter_at(self.now)
            tokens += t
            seq_s += s
        return tokens, seq_s

    def __init__(
        self,
        scenario: Scenario,
        policy_spec: str,
        *,
        check: bool = False,
        log_sink: Sink | None = None,
        keep_log: bool = True,
    ) -> None:
        self.cfg, self.profile = scenario.run_config(policy_spec)
        scenario = perf.resolve(scenario.for_profile(self.profile))
        self.scenario = scenario
        self.spec = policy_spec
        self.check = check
        self.clock = ManualClock()
        self.now = 0.0
        self.log = DecisionLog(log_sink, keep=keep_log)
        self.actuator = SimActuator(self)
        self.controller = build_controller(self.cfg, self.clock, self.actuator, self.log)
        self.ledger = self.controller.ledger
        self.waterlevel_safe = self.controller.policy.waterlevel_safe
        ctrl, eng = scenario.control, scenario.engine
        self.group_size = ctrl.group_size
        # the run config's control.staleness_threshold: the key tidal run's dispatcher reads
        self.budget_groups = budget_groups(
            ctrl.batch_groups, ctrl.updates_per_burst, self.cfg.control.staleness
        )
        self.controller.metrics.budget_groups = self.budget_groups  # verl's capacity cap
        self.workload = make_workload(scenario.workload, scenario.seed, ctrl.batch_groups)
        # Engines: one per cell (its rollout role) and one per standalone engine; with a cost
        # model each is g / tp replicas (hybrid cells with their smaller KV cache).
        models = perf.engine_models(scenario)
        std, hyb = models if models is not None else (None, None)
        kinds = [spec.kind for spec in scenario.cluster.cell_specs()]
        self.cell_engines: list[Engine] = []
        self.engine_by_name: dict[str, Engine] = {}
        for c in self.controller.cells.cells:
            e = Engine(
                c.name,
                c.gpus,
                c.slots,
                eng.decode_tok_s_per_gpu * c.gpus,
                eng.seq_cap_tok_s,
                cell=c.index,
                model=hyb if kinds[c.index] == "hybrid" else std,
                prefill_equiv=eng.prefill_equiv,
            )
            self.cell_engines.append(e)
            self.engine_by_name[c.name] = e
        for s in self.controller.cells.standalone.values():
            self.engine_by_name[s.engine_id] = Engine(
                s.engine_id,
                s.gpus,
                s.slots,
                eng.decode_tok_s_per_gpu * s.gpus,
                eng.seq_cap_tok_s,
                model=std,
                prefill_equiv=eng.prefill_equiv,
            )
        self.engines = list(self.engine_by_name.values())
        # The decode meter (``Observation.decode_meter``): tokens the engines decoded and
        # sequence-seconds they held, as the proxy counts streamed tokens and in-flight calls.
        self.controller.decode_meter = self._decode_meter
        self.admission_rule = AdmissionRule()
        admission.configure(self)
        self._host_tok_s = eng.host_tok_s
        self.trainer = Trainer(
            self,
            self.profile.trainer,
            scenario.trainer,
            ctrl.batch_groups,
            ctrl.updates_per_burst,
            scenario.total_steps,
            offload=(
                (scenario.costs.weight_gb, scenario.trainer.host_gb_s)
                if self.profile.param_offload
                else None
            ),
        )
        self._heap: list[tuple[float, int, int, Any, Any]] = []
        self._seq = 0
        self.seg_no = 0  # the last request id given out
        self.seqs: dict[int, ExecRec] = {}
        self.live: dict[str, ExecRec] = {}
        self.queue: deque[ExecRec] = deque()  # dispatched, not launched
        self.waiting: dict[ExecRec, None] = {}  # launched, displaced, no slot yet
        self.groups: dict[str, list[ExecRec]] = {}
        self.group_open: dict[str, int] = {}
        self.burst = -1
        self.quota_left = 0
        self.burst_held = False  # a burst group waits for the policy's dispatch hold
        self.n_exec = 0
        self.syncing = False
        self.pending_rebalance = False
        self.pending_redistribute = False  # verl V1: spread requests once the hybrids admit
        self.done = False
        self.makespan_s = 0.0
        self._sig: tuple[int, int, int] = (-1, -1, -1)
        self._filling = False
        self._refill = False
        self.series = Series()
        self.events = 0
        self._started = False
        # Counters for the summary.
        self.reroutes = 0
        self.reprefill_tokens = 0
        self.wasted_tokens = 0
        self.sync_s_total = 0.0
        self.timeouts = 0
        self.slot_waits = QueuedWaits()  # seconds each execution waited for a slot

    # ------------------------------------------------------------- plumbing
    @property
    def version(self) -> int:
        return self.controller.version

    def push(self, t: float, code: int, a: object = None, b: object = None) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t if t > self.now else self.now, self._seq, code, a, b))

    def emit(self, ev: Event) -> None:
        self.controller.handle(ev)
        self._sync_roles()
        if self.burst_held:  # the waterlevel or the dispatch hold may have moved
            dispatch.resume(self)

    def schedule_trainer(self, t: float, epoch: int) -> None:
        self.push(t, TRAINER, None, epoch)

    def schedule_step(self, plan: TransitionPlan, step: PlanStep) -> None:
        self.push(self.now, STEP, plan, step)

    def schedule_ack(self, plan: TransitionPlan, step: PlanStep, dur: float) -> None:
        self.push(self.now + dur, ACK, (plan, step), dur)

    def resched(self, e: Engine) -> None:
        """Arms the engine's completion timer. A pending timer that fires no later than the
        new completion is kept (it re-arms when it finds nothing due): adding work only ever
        delays completions, so most changes cost no heap push. On a shared host
        (``engine.host_tok_s``) every engine's share changes with the sequences in flight."""
        host = self._host_tok_s
        if host is not None:
            n = sum(x.active for x in self.engines if not x.paused)
            for x in self.engines:
                lim = host * x.active / n if n else float("inf")
                if lim != x.limit:
                    x.set_limit(lim, self.now)
                    if x is not e:
                        self._arm(x)
        self._arm(e)

    def _arm(self, e: Engine) -> None:
        nf = e.next_finish()
        if nf is None:
            return
        t = e.timer_t
        if t is not None and self.now <= t <= nf:
            return
        e.timer += 1
        e.timer_t = nf
        self.push(nf, ENGINE, e, e.timer)

    # ------------------------------------------------------------- main loop
    def run(self, progress: Callable[[int, int], None] | None = None, every: int = 5000) -> World:
        """Runs to the last optimizer step; ``progress(step, total)`` every ``every``
        events."""
        self._start()
        heap, handlers = self._heap, self._handlers()
        limit = self.scenario.sim.max_virtual_s
        pop, clock, check = heapq.heappop, self.clock, self.check
        while not self.done:
            if progress is not None and self.events % every == 0:
                progress(self.trainer.step, self.trainer.total_steps)
            if not heap:
                raise SimulationError(self._stuck("no event left"))
            t, _, code, a, b = pop(heap)
            if code == ENGINE and a.timer != b:
                continue
            if t > self.now:
                if t > limit:
                    raise SimulationError(self._stuck(f"virtual time passed {limit:g}s"))
                self.now = t
                clock.set(t)
            self.events += 1
            handlers[code](a, b)
            if check:
                self.check_invariants()
        return self

    def run_events(self, n: int) -> bool:
        """Processes at most ``n`` events (started on the first call, for tests that act on
        the world between events); False once the run is over."""
        if not self._started:
            self._start()
        handlers = self._handlers()
        for _ in range(n):
            if self.done or not self._heap:
                break
            t, _, code, a, b = heapq.heappop(self._heap)
            if code == ENGINE and a.timer != b:
                continue
            if t > self.now:
                self.now = t
                self.clock.set(t)
            self.events += 1
            handlers[code](a, b)
            if self.check:
                self.check_invariants()
        return not self.done

    def _handlers(self) -> list:
        return [
            self._on_engine,
            self._on_tool,
            self._on_timeout,
            lambda a, b: self.trainer.on_timer(b, self.now),
            lambda a, b: self.actuator.start(a, b),
            lambda a, b: self.actuator.finish(a[0], a[1], b),
            lambda a, b: sync.on_sync_done(self, a, b),
            self._on_tick,
            lambda a, b: dispatch.on_dispatch(self, b),
        ]

    def _stuck(self, why: str) -> str:
        c = self.controller
        return (
            f"{self.spec}: the run cannot finish ({why}) at t={self.now:.0f}s: trainer "
            f"step {self.trainer.step}/{self.trainer.total_steps} ({self.trainer.state.name},"
            f" {self.trainer.gpus} GPUs), roles {c.cells.describe()}, waterlevel "
            f"{self.ledger.waterlevel}, ready groups {self.ledger.ready_unassigned}"
        )

    def _start(self) -> None:
        self._started = True
        self._sync_roles(force=True)
        dispatch.start_burst(self)
        self.trainer.begin_step(self.now)
        self.push(self.scenario.sim.tick_s, TICK)

    def finish(self, now: float) -> None:
        self.done = True
        self.makespan_s = now

    # ------------------------------------------------------------ cell roles
    def _sync_roles(self, force: bool = False) -> None:
        c = self.controller
        fl = c.inflight
        sig = (fl.plan.plan_id if fl else 0, len(c.plans_done), c.plans_aborted)
        if sig == self._sig and not force:
            return
        self._sig = sig
        gpus = cells = 0
        for cell, eng in zip(c.cells.cells, self.cell_engines, strict=True):
            eng.admitting = cell.role is Role.ROLLOUT
            if cell.role is Role.TRAINING:
                gpus += cell.gpus
                cells += 1
        if self.pending_rebalance and fl is None:
            self.pending_rebalance = False
            moves.rebalance(self)
        if self.pending_redistribute and fl is None:
            self.pending_redistribute = False
            moves.redistribute(self)
        self.trainer.set_gpus(gpus, cells, self.now)
        dispatch.fill(self)

    def arm_timeout(self, ex: ExecRec) -> None:
        assert ex.spec.timeout_s is not None
        self.push(self.now + ex.spec.timeout_s, TIMEOUT, ex, ex.gen)

    # ------------------------------------------------------------ executions
    def begin_turn(self, ex: ExecRec) -> None:
        requests.begin_turn(self, ex)

    def start_seq(self, ex: ExecRec, decode_tokens: float) -> None:
        requests.start_seq(self, ex, decode_tokens)

    def stop_seq(self, ex: ExecRec) -> float:
        return requests.stop_seq(self, ex)

    def _on_engine(self, e: Engine, _timer: object) -> None:
        e.timer_t = None
        done = e.pop_finished(self.now)
        if not done and not e.prefilling:
            nf = e.next_finish()
            if nf is not None and nf <= self.now + 1e-9:
                # Rounding left a hair of work: finish the sequence that is due.
                done = [min(e.sequences(), key=e.remaining)]
                e.remove(done[0], self.now)
        for seg in done:
            ex = self.seqs.pop(seg)
            ex.seg = None
            self._turn_done(ex)
        self.resched(e)

    def _turn_done(self, ex: ExecRec) -> None:
        dec, tool_s, _ = ex.spec.turns[ex.turn]
        ex.ctx += dec
        ex.cached = ex.ctx
        ex.hw = max(ex.hw, ex.ctx)
        ex.decoded += dec
        if ex.turn == len(ex.spec.turns) - 1 and tool_s <= 0:
            self._close(ex, CloseReason.COMPLETED, ex.spec.reward)
            return
        ex.in_tool = True  # a tool step (after the last call: the harness's final step)
        self.push(self.now + tool_s, TOOL, ex, (ex.gen, ex.turn))

    def _on_tool(self, ex: ExecRec, token: object) -> None:
        if ex.closed or not ex.in_tool:
            return
        if token == (ex.gen, -1) and ex.turn == 0:  # setup done: the first call
            ex.in_tool = False
            self.begin_turn(ex)
            return
        if token != (ex.gen, ex.turn):
            return
        ex.in_tool = False
        if ex.turn == len(ex.spec.turns) - 1:
            self._close(ex, CloseReason.COMPLETED, ex.spec.reward)
            return
        tout = ex.spec.turns[ex.turn][2]
        ex.ctx += tout
        ex.turn += 1
        self.begin_turn(ex)

    def _on_timeout(self, ex: ExecRec, gen: object) -> None:
        if not ex.closed and gen == ex.gen:
            self.timeouts += 1
            self._close(ex, CloseReason.TIMEOUT, 0.0)

    def _close(self, ex: ExecRec, reason: CloseReason, reward: float) -> None:
        if ex.seg is not None:
            self.stop_seq(ex)
        if ex.engine is not None:
            ex.engine.members.discard(ex)
            ex.engine = None
        self.waiting.pop(ex, None)
        slot_waits.stop(self, ex)
        ex.closed = True
        ex.pending = None
        self.live.pop(ex.eid, None)
        left = self.group_open[ex.gid] - 1
        if left:
            self.group_open[ex.gid] = left
        else:
            del self.group_open[ex.gid]
        self.emit(ExecutionClosed(self.now, ex.eid, reason, reward))
        if not left:
            self.trainer.pull(self.now)
        dispatch.fill(self)

    def consume_group(self, gid: str, version: int) -> tuple[float, int, int]:
        """Training work of a group taken by the trainer (token equivalents: each sequence's
        tokens and attention pairs), its staleness sum and size."""
        members = self.groups.pop(gid)
        tr = self.scenario.trainer
        return (
            float(sum(train_work_tokens(ex.ctx, tr) for ex in members)),
            sum(version - ex.first_version for ex in members),
            len(members),
        )

    # ----------------------------------------------------------------- ticks
    def _on_tick(self, _a: object, _b: object) -> None:
        self.emit(Tick(self.now))
        s, lg = self.series, self.ledger
        s.t.append(self.now)
        s.waterlevel.append(lg.waterlevel)
        s.queued.append(lg.total.queued)
        s.running.append(lg.total.running)
        s.ready_groups.append(lg.ready_unassigned)
        s.capacity.append(self.controller.cells.rollout_capacity)
        s.train_gpus.append(self.trainer.gpus)
        self.push(self.now + self.scenario.sim.tick_s, TICK)

    # ------------------------------------------------- delegated (moves, sync, checks)
    def pick_destination(self, dests: list[Engine], ordered: bool) -> Engine | None:
        return moves.pick_destination(self, dests, ordered)

    def move(self, ex: ExecRec, dest: Engine | None, kv: bool, hold: bool) -> None:
        src = ex.engine.name if ex.engine is not None else None
        moves.move(self, ex, dest, kv, hold)
        if src is not None and dest is not None and str(dest.name) != str(src):
            for observer in tuple(_MOVE_OBSERVERS):
                observer(self, ex, str(src), str(dest.name))

    def release_hold(self, ex: ExecRec, kv: bool) -> None:
        moves.release_hold(self, ex, kv)

    def start_sync(self, now: float) -> None:
        sync.start_sync(self, now)

    def check_invariants(self) -> None:
        invariants.check(self)
