"""The figures of one run that show its rule at work: waterlevel against rollout capacity,
utilisation per optimizer step, reward per step with its spread.

In: a ``RunData`` (``tidal.rundir``) and its ``executions.jsonl`` for the per-step spread. Out:
PNG files and the numbers behind them (``rollout_capacity``, ``step_utilization``,
``step_rewards``), every time in seconds since the first dispatch.
- Rollout capacity at time t: the execution slots of the cells in the rollout role at t (from
  ``timeline.json``) plus every standalone engine's slots (from ``config.yaml``).
- Utilisation of step i, over the window from step i-1's end (or the first dispatch) to step
  i's end: train = the step's compute seconds / the window (``step_s`` when a run recorded no
  ``compute_s``); rollout = the mean over the window's ``state.jsonl`` samples of running /
  rollout capacity.
- Reward of step i: the rewards of the executions of the groups it trained (``groups`` in
  ``metrics.jsonl``); the band is one standard deviation each side of their mean.
"""

from __future__ import annotations

import bisect
import math
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tidal.contracts import run_files as schema
from tidal.rundir import RunData, read_lines

if TYPE_CHECKING:
    from types import ModuleType

    from matplotlib.figure import Figure

ROLL, TRAIN, WATER, QUEUE = "#4C72B0", "#DD8452", "#222222", "#C44E52"


def rollout_capacity(run: RunData) -> tuple[list[float], list[int]] | None:
    """(edges, capacity from each edge on); None without a timeline or a readable cluster."""
    from tidal.config import ClusterConfig

    if not run.timeline or not run.config or "cluster" not in run.config:
        return None
    try:
        cl = ClusterConfig.model_validate(run.config["cluster"])
    except ValueError:
        return None
    slots = [s.slots for s in cl.cell_specs()]
    if len(slots) != len(run.timeline):
        return None
    base = cl.standalone_count * cl.standalone_slots
    edges = sorted({x for segs in run.timeline for a, b, _ in segs for x in (a, b)})
    caps = [
        base
        + sum(
            slots[i]
            for i, segs in enumerate(run.timeline)
            if any(r == "rollout" and a <= e < b for a, b, r in segs)
        )
        for e in edges
    ]
    if len(caps) > 1:  # the timeline's end closes every segment: hold the last value
        caps[-1] = caps[-2]
    return edges, caps


def capacity_at(cap: tuple[list[float], list[int]], t: float) -> int:
    edges, caps = cap
    return caps[max(0, bisect.bisect_right(edges, t) - 1)]


def step_utilization(run: RunData) -> list[dict[str, Any]]:
    """Per optimizer step: ``step``, ``start_s``, ``end_s``, ``train`` and ``rollout`` (None
    when the window holds no state sample or no capacity is known)."""
    cap = rollout_capacity(run)
    states = run.states or []
    out, prev = [], 0.0
    for m in run.metrics or []:
        end = float(m["t"])
        window = max(end - prev, 1e-9)
        busy = m.get("compute_s")
        busy = float(busy) if busy is not None else float(m.get("step_s", 0.0))
        shares = [
            float(s["running"]) / c
            for s in states
            if prev < float(s["t"]) <= end
            and "running" in s
            and cap
            and (c := capacity_at(cap, float(s["t"]))) > 0
        ]
        out.append(
            {
                "step": int(m["step"]),
                "start_s": prev,
                "end_s": end,
                "train": min(1.0, busy / window),
                "rollout": statistics.fmean(shares) if shares else None,
            }
        )
        prev = end
    return out


def step_rewards(run: RunData) -> list[tuple[int, float, float | None, int]]:
    """Per step: (step, mean reward, standard deviation over its executions or None, n)."""
    execs = read_lines(run.path / "executions.jsonl", schema.ExecutionLine) or []
    by_group: dict[str, list[float]] = {}
    for e in execs:
        if e.reward is not None:  # reward_error: no reward
            by_group.setdefault(e.group, []).append(e.reward)
    out = []
    for m in run.metrics or []:
        vals = [r for g in m.get("groups") or [] for r in by_group.get(str(g), [])]
        sd = statistics.stdev(vals) if len(vals) >= 2 else None
        out.append((int(m["step"]), float(m["mean_reward"]), sd, len(vals)))
    return out


def plot_waterlevel(run: RunData, path: Path, plt: ModuleType) -> Path:
    """Waterlevel against rollout capacity (the rule: a cell may train only while the capacity
    left covers the waterlevel); queued executions drawn only where there are any."""
    st = run.states or []
    t = [float(s["t"]) for s in st]
    fig, ax = plt.subplots(figsize=(11, 3.8))
    cap = rollout_capacity(run)
    if cap is not None:
        ax.fill_between(cap[0], cap[1], step="post", color=ROLL, alpha=0.18, lw=0)
        ax.step(
            cap[0],
            cap[1],
            where="post",
            color=ROLL,
            lw=1.4,
            label="rollout capacity (slots of rollout cells + standalone)",
        )
    ax.plot(
        t,
        [s.get("waterlevel") for s in st],
        color=WATER,
        lw=2.0,
        label="waterlevel (queued + running executions)",
    )
    queued = [s.get("queued") or 0 for s in st]
    if any(queued):
        ax.plot(
            t,
            [q if q else math.nan for q in queued],
            "o",
            ms=3,
            color=QUEUE,
            label="queued (where > 0)",
        )
    ax.set_ylim(
        0, max([*(cap[1] if cap else []), *(s.get("waterlevel") or 0 for s in st), 1]) * 1.3
    )
    ax.set_ylabel("executions")
    ax.set_xlabel("seconds since the first dispatch")
    note = "" if any(queued) else " (nothing ever queued)"
    ax.set_title(f"{run.policy}: waterlevel against rollout capacity{note}", fontsize=9)
    ax.legend(fontsize=7, loc="upper center", ncol=3)
    fig.tight_layout()
    return _save(plt, fig, path)


def plot_utilization(run: RunData, path: Path, plt: ModuleType) -> Path:
    """Train and rollout utilisation of every optimizer step, drawn over its time window."""
    rows = step_utilization(run)
    fig, ax = plt.subplots(figsize=(11, 3.5))
    for key, colour in (("train", TRAIN), ("rollout", ROLL)):
        xs, ys = [], []
        for r in rows:
            if r[key] is not None:
                xs += [r["start_s"], r["end_s"], math.nan]
                ys += [r[key], r[key], math.nan]
        ax.plot(xs, ys, color=colour, lw=2.0, label=f"{key} utilisation per step")
        mids = [(r["start_s"] + r["end_s"]) / 2 for r in rows if r[key] is not None]
        ax.plot(mids, [r[key] for r in rows if r[key] is not None], "o", ms=4, color=colour)
    ax.set_ylim(0, 1.1)
    ax.set_xlabel("seconds since the first dispatch (each segment: one optimizer step)")
    ax.set_ylabel("utilisation")
    ax.set_title(f"{run.policy}: utilisation per optimizer step ({len(rows)} steps)", fontsize=9)
    ax.legend(fontsize=7, loc="upper right", framealpha=0.9)
    fig.tight_layout()
    return _save(plt, fig, path)


def plot_reward(run: RunData, path: Path, plt: ModuleType) -> Path:
    """Mean reward per step with one standard deviation of its executions as a band."""
    rows = step_rewards(run)
    steps, mean = [r[0] for r in rows], [r[1] for r in rows]
    if not rows:  # a summary-only run: its list of step means
        steps, mean = run.rewards()
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.plot(steps, mean, marker="o", ms=3, lw=1.2, color=ROLL, label="mean reward")
    band = [(s, m, sd) for s, m, sd, _ in rows if sd is not None]
    if band:
        ax.fill_between(
            [b[0] for b in band],
            [b[1] - b[2] for b in band],
            [b[1] + b[2] for b in band],
            color=ROLL,
            alpha=0.2,
            lw=0,
            label="± one standard deviation over the step's executions",
        )
    mean_g, se, n = run.reward_noise()
    noise = f", mean over {n} groups {mean_g:.3f} ± {se:.3f} (s.e.)" if se is not None else ""
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("reward")
    ax.set_title(f"{run.policy}: reward per step{noise}", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return _save(plt, fig, path)


def _save(plt: ModuleType, fig: Figure, path: Path) -> Path:
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
