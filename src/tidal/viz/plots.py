"""PNG plots of simulated runs (matplotlib, Agg backend: no display needed).

In: finished ``RunResult`` objects. Out: files in a directory, one figure per kind:
- ``roles.png``: per run, the cell-role timeline (cells x time, coloured by role);
- ``waterlevel.png``: per run, waterlevel, rollout capacity and ready-queue depth over time;
- ``utilization.png``: per run, the trainer's utilization of each optimizer step
  (compute / allocated seconds) and the cluster-level bars of train / rollout / cluster use.
No business logic: everything plotted is read from the run.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from tidal.types import Role

if TYPE_CHECKING:
    from tidal.sim.runner import RunResult

ROLE_COLOURS = {
    Role.ROLLOUT: "#4C72B0",
    Role.TRAINING: "#DD8452",
    Role.MOVING_TO_TRAINING: "#C44E52",
    Role.MOVING_TO_ROLLOUT: "#8172B3",
}


def pyplot():
    """matplotlib's pyplot on the Agg backend (shared with ``run_report``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_all(results: list[RunResult], out_dir: str | Path) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return [
        plot_roles(results, out / "roles.png"),
        plot_waterlevel(results, out / "waterlevel.png"),
        plot_utilization(results, out / "utilization.png"),
    ]


def plot_roles(results: list[RunResult], path: Path) -> Path:
    plt = pyplot()
    fig, axes = plt.subplots(
        len(results),
        1,
        figsize=(11, 1.2 + 0.9 * len(results) * max(1, _cells(results) / 4)),
        squeeze=False,
    )
    for ax, r in zip(axes[:, 0], results, strict=True):
        world = r.world
        segs = world.controller.timeline.close(world.makespan_s)
        for cell, cell_segs in enumerate(segs):
            for start, end, role in cell_segs:
                ax.broken_barh(
                    [(start / 3600, (end - start) / 3600)],
                    (cell - 0.4, 0.8),
                    color=ROLE_COLOURS[role],
                    linewidth=0,
                )
        names = [c.name for c in world.controller.cells.cells]
        ax.set_yticks(range(len(names)))
        ax.set_yticklabels(names, fontsize=7)
        ax.invert_yaxis()
        ax.set_title(f"{r.spec}: cell roles ({r.summary['makespan_h']:.2f} h)", fontsize=9)
        ax.set_xlim(0, world.makespan_s / 3600)
    axes[-1, 0].set_xlabel("hours")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in ROLE_COLOURS.values()]
    fig.legend(handles, [r.value for r in ROLE_COLOURS], loc="upper right", fontsize=7, ncol=4)
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _cells(results: list[RunResult]) -> int:
    return max(len(r.world.controller.cells.cells) for r in results)


def plot_waterlevel(results: list[RunResult], path: Path) -> Path:
    plt = pyplot()
    fig, axes = plt.subplots(len(results), 1, figsize=(11, 2.2 * len(results)), squeeze=False)
    for ax, r in zip(axes[:, 0], results, strict=True):
        s = r.world.series
        t = [x / 3600 for x in s.t]
        ax.plot(t, s.waterlevel, label="waterlevel w (executions)", lw=0.8)
        ax.plot(t, s.capacity, label="rollout capacity (slots)", lw=0.8, ls="--")
        ax2 = ax.twinx()
        ax2.plot(t, s.ready_groups, label="ready groups (queue)", lw=0.8, color="#55A868")
        ax2.set_ylabel("groups", fontsize=8)
        ax.set_ylabel("executions", fontsize=8)
        ax.set_title(f"{r.spec}: waterlevel and queue depth", fontsize=9)
        lines = ax.get_lines() + ax2.get_lines()
        ax.legend(lines, [ln.get_label() for ln in lines], fontsize=7, loc="upper right")
    axes[-1, 0].set_xlabel("hours")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_utilization(results: list[RunResult], path: Path) -> Path:
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4), gridspec_kw={"width_ratios": [3, 1]})
    for r in results:
        steps = r.world.trainer.steps_log
        util = [s["compute_s"] / s["alloc_s"] if s["alloc_s"] > 0 else 0.0 for s in steps]
        ax1.plot([s["step"] for s in steps], util, lw=0.8, label=r.spec)
    ax1.set_xlabel("optimizer step")
    ax1.set_ylabel("trainer compute / allocated")
    ax1.set_ylim(0, 1.05)
    ax1.set_title("utilization per step", fontsize=9)
    ax1.legend(fontsize=7)
    keys = ("train_utilization", "rollout_utilization", "cluster_utilization")
    width = 0.8 / max(1, len(results))
    for i, r in enumerate(results):
        ax2.bar(
            [k + i * width for k in range(len(keys))],
            [r.summary[k] for k in keys],
            width=width,
            label=r.spec,
        )
    ax2.set_xticks([k + 0.4 - width / 2 for k in range(len(keys))])
    ax2.set_xticklabels(["train", "rollout", "cluster"], fontsize=8)
    ax2.set_ylim(0, 1.05)
    ax2.set_title("whole run", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
