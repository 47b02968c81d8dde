"""verl's metrics (``dynamic_resource/*``, ``timing_s/*``, idle ratios) over tidal's events, and
a per-cell role timeline.

In: the controller's events — trainer steps (``TrainerReady``, ``TrainerStepDone``), weight
syncs and the activation after them, plan durations, groups launched / completed / generated,
the rollout capacity. Out: one row per weight sync with verl 0.9.1's names and formulas
(``fully_async_trainer.py``, ``fully_async_rollouter.py``, ``detach_utils.MetricsAggregator``):
- per micro-step (verl: one ``fit_step``, tidal: one optimizer step), as verl times it:
  ``timing_s/step`` from the step's start (or the end of the previous step's sync) to its end
  (after the sync and any activation, for the last step of a version);
  ``timing_s/wait_for_enough_samples`` the hybrid rollout wait before a deactivation (the
  time without GPUs less the deactivation itself); ``timing_s/gen`` and
  ``fully_async/total_wait_time`` the wait for the batch once the GPUs are back;
  ``timing_s/update_actor`` and ``dynamic_resource/train_compute_time_s`` the compute;
  ``dynamic_resource/train_allocated_time_s`` from the GPUs' return to the step's end (verl's
  ``_allocated_start`` is after the deactivation; it includes the wait for the batch, the sync
  and the activation); ``timing_s/timing_s/param_sync`` the sync and activation (verl's timer
  is named ``timing_s/param_sync`` and every timer gets the ``timing_s/`` prefix again);
  ``dynamic_resource/mq_size`` the queue when the step ends;
- aggregated like verl: sums for ``timing_s/*`` and ``*_time_s``/``*total*``, the last value
  of ``mq_size``, then ``train_resource_utilization = compute / allocated`` (summed first),
  ``fully_async/trainer/idle_ratio = gen / step``, and with the rollouter's utilization
  ``resource_utilization = ((1-x) a U_train + (x a + b) U_rollout) / (a + b)``,
  ``x = clip(wait_for_enough_samples / step, 0, 1)``; like verl, a row covers the micro-steps
  added since the previous row, and the step that ends with the sync is added after its row;
- the rollouter's window (sync end to sync end): ``rollout_resource_utilization`` =
  sum dt S u / sum dt S with u = min(1, A/S), A the prompt groups in generation (launched,
  not all closed), S = min(rollout slots / group size, the dispatch budget); ``idle_ratio``
  (1 - active/version time, active until the last time the rollouter went idle: budget spent
  and nothing in generation), ``step_generated_samples`` (groups completed).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from itertools import pairwise

from tidal.types import Role

LAST = ("dynamic_resource/mq_size", "fully_async/count/current_param_version")
SUMMED = ("dynamic_resource/train_compute_time_s", "dynamic_resource/train_allocated_time_s")


def aggregation_type(name: str) -> str:
    """verl's ``MetricsAggregator._get_aggregation_type`` for the keys tidal emits."""
    if name in LAST:
        return "last"
    if name in SUMMED:
        return "sum"
    low = name.lower()
    if "timing_s/" in low:
        return "time_sum"
    if any(k in low for k in ("mean", "avg", "average")):
        return "avg"
    if any(k in low for k in ("max", "maximum")):
        return "max"
    if any(k in low for k in ("min", "minimum")):
        return "min"
    if any(k in low for k in ("sum", "total")):
        return "sum"
    return "avg"


def aggregate(values: dict[str, list[float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, vals in values.items():
        if not vals:
            continue
        kind = aggregation_type(name)
        if kind == "last":
            out[name] = vals[-1]
        elif kind in ("sum", "time_sum"):
            out[name] = sum(vals)
        elif kind == "max":
            out[name] = max(vals)
        elif kind == "min":
            out[name] = min(vals)
        else:
            out[name] = sum(vals) / len(vals)
    return out


def train_resource_utilization(compute_s: float, alloc_s: float) -> float | None:
    """Summed compute over summed allocated time (verl computes it once per cycle)."""
    return compute_s / alloc_s if alloc_s > 0 else None


def rollout_resource_utilization(points: list[tuple[float, int, int]]) -> float:
    """verl's ``_compute_rollout_resource_utilization`` over (t_k, A_k, S_k) points, the last
    one closing the window: u_k = min(1, A_k / S_k), weighted by dt x S_k; S_k = 0 skipped."""
    num = den = 0.0
    for (t_k, active_k, cap_k), (t_k1, _a, _c) in pairwise(points):
        dt = t_k1 - t_k
        if dt <= 0 or cap_k <= 0:
            continue
        u_k = min(1.0, active_k / cap_k)
        num += dt * cap_k * u_k
        den += dt * cap_k
    return num / den if den > 0 else 0.0


def resource_utilization(
    u_train: float,
    u_rollout: float,
    hybrid_gpus: float,
    standalone_gpus: float,
    wait_s: float,
    step_s: float,
) -> float:
    """((1-x) a U_train + (x a + b) U_rollout) / (a + b), x = clip(wait / step, 0, 1)."""
    a, b = hybrid_gpus, standalone_gpus
    x = min(1.0, max(0.0, wait_s / step_s))
    return ((1 - x) * a * u_train + (x * a + b) * u_rollout) / (a + b)


def rollouter_idle_ratio(
    window_start_s: float, idle_start_s: float, now_s: float
) -> tuple[float, float, float]:
    """verl's ``reset_staleness``: (active_time, version_time, idle_ratio)."""
    version_time = max(now_s - window_start_s, 1e-6)
    if idle_start_s > window_start_s:
        active = idle_start_s - window_start_s
        return active, version_time, 1 - active / version_time
    return version_time, version_time, 0


def special_metrics(
    agg: dict[str, float], u_rollout: float | None, hybrid_gpus: float, standalone_gpus: float
) -> dict[str, float]:
    """verl's ``_special_metrics_aggergate`` for the keys tidal emits."""
    if "timing_s/gen" in agg and agg.get("timing_s/step", 0.0) > 0:  # (verl: no zero steps)
        agg["fully_async/trainer/idle_ratio"] = agg["timing_s/gen"] / agg["timing_s/step"]
    alloc = agg.get("dynamic_resource/train_allocated_time_s")
    if "dynamic_resource/train_compute_time_s" in agg and alloc is not None and alloc > 0:
        agg["dynamic_resource/train_resource_utilization"] = (
            agg["dynamic_resource/train_compute_time_s"] / alloc
        )
    total = hybrid_gpus + standalone_gpus
    if (
        "dynamic_resource/train_resource_utilization" in agg
        and u_rollout is not None
        and total > 0
        and agg.get("timing_s/step", 0.0) > 0
    ):
        agg["dynamic_resource/rollout_resource_utilization"] = u_rollout
        agg["dynamic_resource/resource_utilization"] = resource_utilization(
            agg["dynamic_resource/train_resource_utilization"],
            u_rollout,
            hybrid_gpus,
            standalone_gpus,
            agg.get("timing_s/wait_for_enough_samples", 0.0),
            agg["timing_s/step"],
        )
    return agg


@dataclass
class _Step:
    start_s: float
    gpus_s: float | None = None  # when the trainer had its GPUs back
    switch_s: float = 0.0  # moves into training that completed during the step
    done: dict[str, float] | None = None  # the step's timings once it ended
    done_s: float = 0.0


class VerlMetrics:
    """verl's metrics, one row per weight sync (``rows``); fed by the controller."""

    def __init__(
        self,
        hybrid_gpus: int,
        standalone_gpus: int,
        budget_groups: int | None = None,
        start_s: float = 0.0,
    ) -> None:
        self.hybrid_gpus = hybrid_gpus
        self.standalone_gpus = standalone_gpus
        self.budget_groups = budget_groups  # verl's max_required_samples caps the capacity
        self.rows: list[dict[str, float]] = []
        self._values: dict[str, list[float]] = defaultdict(list)
        self._step: _Step | None = None
        self._last_end_s = start_s
        self._sync_open: _Step | None = None  # the last step of a version, until its end
        self._version = 0
        # rollouter
        self._window_s = start_s
        self._idle_s = start_s
        self._idle = False
        self._generated = 0
        self._points: list[tuple[float, int, int]] = []
        self._open_groups: dict[str, int] = {}  # group -> members closed, once one launched
        self.group_size = 1
        self._slots = 0

    # ------------------------------------------------------------------ rollouter
    def launched(self, group_id: str, group_size: int) -> None:
        self.group_size = group_size
        self._open_groups.setdefault(group_id, 0)

    def closed(self, group_id: str, group_size: int) -> None:
        self.group_size = group_size
        n = self._open_groups.get(group_id, 0) + 1
        if n >= group_size:
            self._open_groups.pop(group_id, None)
        else:
            self._open_groups[group_id] = n

    def generated(self) -> None:
        self._generated += 1

    @property
    def active_groups(self) -> int:
        return len(self._open_groups)

    def capacity_groups(self, slots: int) -> int:
        cap = slots // max(1, self.group_size)
        return min(cap, self.budget_groups) if self.budget_groups is not None else cap

    def rollout(self, t_s: float, slots: int, idle: bool) -> None:
        """After every event: the groups in generation and the capacity (a point when either
        changed); ``idle``: the budget is spent and nothing is in generation."""
        self._slots = slots
        point = (self.active_groups, self.capacity_groups(slots))
        if not self._points or self._points[-1][1:] != point:
            self._points.append((t_s, *point))
        if idle and not self._idle:
            self._idle_s = t_s  # verl: idle_start_time, set when the drained rollouter blocks
        self._idle = idle

    # -------------------------------------------------------------------- trainer
    def step_begin(self, t_s: float) -> None:
        self._step = _Step(max(t_s, self._last_end_s))

    def moved_to_training(self, created_s: float, done_s: float) -> None:
        """A plan that gave the trainer GPUs completed (its time is not a rollout wait)."""
        s = self._step
        if s is not None and s.done is None and done_s >= s.start_s:
            s.switch_s += done_s - max(created_s, s.start_s)

    def step_done(
        self, t_s: float, wait_s: float, compute_s: float, alloc_s: float, final: bool, mq_size: int
    ) -> None:
        s = self._step or _Step(self._last_end_s)
        self._step = None
        gpus_s = min(t_s, max(s.start_s, t_s - alloc_s))
        no_gpu = gpus_s - s.start_s
        s.done = {
            "timing_s/wait_for_enough_samples": max(0.0, no_gpu - s.switch_s),
            "timing_s/gen": wait_s,
            "fully_async/total_wait_time": wait_s,
            "timing_s/update_actor": compute_s,
            "dynamic_resource/train_compute_time_s": compute_s,
        }
        s.gpus_s, s.done_s = gpus_s, t_s
        if final:
            self._sync_open = s  # ends with the sync (and the activation after it)
        else:
            self._add(s, t_s, mq_size)

    def _add(self, s: _Step, end_s: float, mq_size: int, synced: bool = False) -> None:
        assert s.done is not None and s.gpus_s is not None
        vals = dict(s.done)
        vals["timing_s/step"] = end_s - s.start_s
        vals["dynamic_resource/train_allocated_time_s"] = end_s - s.gpus_s
        vals["dynamic_resource/mq_size"] = float(mq_size)
        if synced:
            vals["timing_s/timing_s/param_sync"] = end_s - s.done_s
        for k, v in vals.items():
            self._values[k].append(v)
        self._last_end_s = end_s

    def sync(self, version: int) -> None:
        self._version = version

    def sync_end(self, t_s: float, mq_size: int) -> dict[str, float]:
        """The last step of the version ends (sync and activation done): the rollouter's
        window closes (``reset_staleness``) and verl logs the aggregated row, then adds that
        step to the next one."""
        self._points.append((t_s, self.active_groups, self.capacity_groups(self._slots)))
        u_roll = rollout_resource_utilization(self._points)
        active, version_time, idle_ratio = rollouter_idle_ratio(self._window_s, self._idle_s, t_s)
        row = special_metrics(
            aggregate(self._values), u_roll, self.hybrid_gpus, self.standalone_gpus
        )
        row.update(
            {
                "version": float(self._version),
                "fully_async/rollouter/active_time": active,
                "fully_async/rollouter/version_time": version_time,
                "fully_async/rollouter/idle_ratio": idle_ratio,
                "fully_async/rollouter/step_generated_samples": float(self._generated),
            }
        )
        self.rows.append(row)
        self._values = defaultdict(list)
        self._window_s, self._generated = t_s, 0
        self._points = [self._points[-1]]
        self._idle = False  # verl's reset resumes the rollouter; it may pause again at once
        s, self._sync_open = self._sync_open, None
        if s is not None:
            self._add(s, t_s, mq_size, synced=True)
        if self._step is not None and self._step.start_s < t_s:
            self._step.start_s = t_s  # verl's next fit_step starts after the activation
        return row

    @property
    def sync_pending(self) -> bool:
        return self._sync_open is not None


class RoleTimeline:
    """Per cell, the (start_s, end_s, role) segments; the open segment ends at ``now``."""

    def __init__(self, roles: tuple[Role, ...], start_s: float = 0.0) -> None:
        self.segments: list[list[tuple[float, float, Role]]] = [[] for _ in roles]
        self._open: list[tuple[float, Role]] = [(start_s, r) for r in roles]

    def change(self, cell: int, role: Role, t_s: float) -> None:
        start, old = self._open[cell]
        if old is role:
            return
        if t_s > start:
            self.segments[cell].append((start, t_s, old))
        self._open[cell] = (t_s, role)

    def close(self, now_s: float) -> list[list[tuple[float, float, Role]]]:
        out = [list(s) for s in self.segments]
        for cell, (start, role) in enumerate(self._open):
            if now_s > start:
                out[cell].append((start, now_s, role))
        return out

    def time_in(self, role: Role, now_s: float) -> list[float]:
        return [sum(e - s for s, e, r in segs if r is role) for segs in self.close(now_s)]
