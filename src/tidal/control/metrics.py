"""verl's ``dynamic_resource/*`` metrics and a per-cell role timeline, over an event history.

In: trainer steps (compute and allocated seconds, waits), the rollout history of
(time, active executions, capacity) points, queue sizes, role changes. Out: one dict per cycle
(weight version) with verl's metric names, and role segments per cell.
Formulas: REFERENCE.md §2 "Metrics".
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tidal.types import Role


def train_resource_utilization(compute_s: list[float], alloc_s: list[float]) -> float:
    """sum(compute_i) / sum(alloc_i): summed first, one ratio (not a mean of ratios)."""
    alloc = sum(alloc_s)
    return sum(compute_s) / alloc if alloc > 0 else 0.0


def rollout_resource_utilization(points: list[tuple[float, int, int]], end_s: float) -> float:
    """Capacity-weighted concurrency use over an event-driven history.

    ``points`` are (t_k, active_k, cap_k), each value holding until the next point (the last
    until ``end_s``). Intervals with cap 0 are skipped; 0.0 when there is no weight.
    """
    num = den = 0.0
    for k, (t, active, cap) in enumerate(points):
        t_next = points[k + 1][0] if k + 1 < len(points) else end_s
        dt = t_next - t
        if dt <= 0 or cap <= 0:
            continue
        num += dt * min(cap, active)
        den += dt * cap
    return num / den if den > 0 else 0.0


def resource_utilization(u_train: float, u_rollout: float, hybrid_gpus: float,
                         standalone_gpus: float, wait_s: float, step_s: float) -> float:
    """((1-x) a U_train + (x a + b) U_rollout) / (a + b), x = clip(wait / step, 0, 1)."""
    a, b = hybrid_gpus, standalone_gpus
    if a + b <= 0:
        return 0.0
    x = min(1.0, max(0.0, wait_s / step_s)) if step_s > 0 else 0.0
    return ((1 - x) * a * u_train + (x * a + b) * u_rollout) / (a + b)


@dataclass
class _Cycle:
    start_s: float
    compute_s: list[float] = field(default_factory=list)
    alloc_s: list[float] = field(default_factory=list)
    wait_s: list[float] = field(default_factory=list)
    wait_for_samples_s: list[float] = field(default_factory=list)
    mq_size: int = 0
    generated: int = 0
    points: list[tuple[float, int, int]] = field(default_factory=list)


class MetricsTracker:
    """Accumulates one cycle (one weight version) at a time; ``close_cycle`` emits its row."""

    def __init__(self, hybrid_gpus: int, standalone_gpus: int, max_required: int | None,
                 start_s: float = 0.0) -> None:
        self.hybrid_gpus = hybrid_gpus
        self.standalone_gpus = standalone_gpus
        self.max_required = max_required
        self.rows: list[dict[str, float]] = []
        self._cycle = _Cycle(start_s)
        self._last_point: tuple[int, int] | None = None

    def capacity(self, slots: int) -> int:
        return min(slots, self.max_required) if self.max_required is not None else slots

    def rollout_point(self, t_s: float, active: int, slots: int) -> None:
        cap = self.capacity(slots)
        if self._last_point == (active, cap):
            return
        self._last_point = (active, cap)
        self._cycle.points.append((t_s, active, cap))

    def trainer_step(self, compute_s: float, alloc_s: float, wait_s: float,
                     wait_for_samples_s: float, mq_size: int) -> None:
        c = self._cycle
        c.compute_s.append(compute_s)
        c.alloc_s.append(alloc_s)
        c.wait_s.append(wait_s)
        c.wait_for_samples_s.append(wait_for_samples_s)
        c.mq_size = mq_size

    def group_generated(self) -> None:
        self._cycle.generated += 1

    def close_cycle(self, end_s: float, version: int) -> dict[str, float]:
        c = self._cycle
        u_train = train_resource_utilization(c.compute_s, c.alloc_s)
        u_roll = rollout_resource_utilization(c.points, end_s)
        row = {
            "version": float(version),
            "dynamic_resource/train_resource_utilization": u_train,
            "dynamic_resource/train_compute_time_s": sum(c.compute_s),
            "dynamic_resource/train_allocated_time_s": sum(c.alloc_s),
            "dynamic_resource/rollout_resource_utilization": u_roll,
            "dynamic_resource/resource_utilization": resource_utilization(
                u_train, u_roll, self.hybrid_gpus, self.standalone_gpus,
                sum(c.wait_for_samples_s), sum(c.alloc_s)),
            "dynamic_resource/mq_size": float(c.mq_size),
            "fully_async/rollouter/step_generated_samples": float(c.generated),
            "cycle_s": end_s - c.start_s,
        }
        self.rows.append(row)
        self._cycle = _Cycle(end_s)
        if self._last_point is not None:
            active, cap = self._last_point
            self._cycle.points.append((end_s, active, cap))
        return row


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
