"""The plots and the short report of one ``tidal run`` directory (files in, files out).

In: a run directory (read by ``tidal.viz.run_data``). Out, written into that directory:
- ``roles.png``: cells x time coloured by role (``timeline.json``);
- ``reward.png``: mean reward per optimizer step with a trailing moving average;
- ``waterlevel.png``: waterlevel, queued, running and ready groups over time, and the number of
  training cells as a step line (``state.jsonl``);
- ``utilization.png``: verl's train / rollout / cluster utilization per weight version (the
  ``dynamic_resource/*`` metrics on each burst's final step);
- ``trace.json``: the run as a Chrome trace-event file for Perfetto (``tidal.viz.trace``);
- ``report.md``: the run in one line, its totals, reward first vs last quarter, a table of
  bursts, and the plots as relative image links.
Invariant: everything shown is read from the files; a plot whose input is missing is skipped
with a note in ``report.md`` (and a stale PNG of that name removed), never invented.
Colours and backend are the simulator's (``tidal.viz.plots``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from tidal.rundir import UTIL_KEYS, RunData, burst_rows, load_run
from tidal.viz.plots import ROLE_COLOURS, pyplot

ROLE_COLOURS_BY_NAME = {role.value: colour for role, colour in ROLE_COLOURS.items()}
UNKNOWN_ROLE_COLOUR = "#999999"
UTIL_COLOURS = {"train": ROLE_COLOURS_BY_NAME["training"],
                "rollout": ROLE_COLOURS_BY_NAME["rollout"], "cluster": "#55A868"}
DPI = 110


def write_report(run_dir: str | Path) -> list[Path]:
    """Write the four plots (those whose input exists) and ``report.md`` into RUN_DIR."""
    run = load_run(run_dir)
    plots: list[tuple[str, str, Callable[[RunData, Path], Path], str | None]] = [
        ("roles.png", "cell roles", plot_roles,
         None if run.timeline else "no timeline.json (or no cells in it)"),
        ("reward.png", "mean reward per step", plot_reward,
         None if run.rewards()[1] else "no optimizer steps in metrics.jsonl or summary.json"),
        ("waterlevel.png", "waterlevel and queues", plot_waterlevel,
         None if run.states else "no state.jsonl samples"),
        ("utilization.png", "utilization per weight version", plot_utilization,
         None if _util_lines(run) else "no verl dynamic_resource/* metrics in metrics.jsonl"),
    ]
    written: list[Path] = []
    shown: list[tuple[str, str]] = []
    skipped: list[tuple[str, str]] = []
    for name, title, plot, missing in plots:
        target = run.path / name
        if missing is None:
            written.append(plot(run, target))
            shown.append((name, title))
        else:
            target.unlink(missing_ok=True)
            skipped.append((name, missing))
    from tidal.viz import trace, trace_sources

    written.append(trace.write([trace_sources.from_run_dir(run.path)], run.path / "trace.json"))
    report = run.path / "report.md"
    report.write_text(render_report(run, shown, skipped))
    written.append(report)
    return written


def render_report(run: RunData, shown: list[tuple[str, str]],
                  skipped: list[tuple[str, str]]) -> str:
    s = run.summary
    name = (run.config or {}).get("name", run.path.name)
    out = [f"# tidal run report: {name} ({run.policy})", "", run.config_line(), ""]
    bursts_s = s.get("bursts_s")
    rows: list[tuple[str, str]] = [
        ("run time", f"{_num(s.get('run_time_s'), 2)} s"
         + (f" (first dispatch to last publication {bursts_s:.2f} s)"
            if isinstance(bursts_s, int | float) else "")),
        ("optimizer steps", str(run.n_steps())),
        ("switches", f"{_num(s.get('switches_to_training'))} to training, "
                     f"{_num(s.get('switches_to_rollout'))} to rollout"),
    ]
    for key, label in (("rerouted_requests", "rerouted requests"),
                       ("failed_requests", "failed requests"),
                       ("lost_executions", "lost executions")):
        rows.append((label, _num(s.get(key))))
    if "satellite_joins" in s:  # newer runtimes only
        rows.append(("satellite joins", _num(s["satellite_joins"])))
    first, last = run.reward_quarters()
    q = max(1, len(run.rewards()[1]) // 4)
    rows.append(("mean reward", f"first quarter {_num(first, 3)}, last quarter {_num(last, 3)} "
                                f"({q} step{'s' if q != 1 else ''} each)"))
    out += ["| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows), ""]
    bursts = burst_rows(run)
    out += ["## Bursts", ""]
    if bursts:
        out += ["Time: from the previous burst's final optimizer step (the first dispatch for "
                "burst 0) to this burst's final step. Utilization: verl's `dynamic_resource/*` "
                "of the burst's last weight version.", "",
                "| burst | steps | start s | end s | time s | version | train util | "
                "rollout util | cluster util | generated samples |",
                "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for b in bursts:
            out.append(f"| {b['burst']} | {b['steps']} | {_num(b['start_s'], 2)} "
                       f"| {b['end_s']:.2f} | {_num(b['time_s'], 2)} | {_num(b['version'])} "
                       f"| {_num(b['train_utilization'], 3)} "
                       f"| {_num(b['rollout_utilization'], 3)} "
                       f"| {_num(b['cluster_utilization'], 3)} "
                       f"| {_num(b['generated_samples'], 0)} |")
        if not run.relative_times():
            out += ["", "metrics.jsonl's `t` is not counted from the first dispatch (a run "
                    "written before the runtime recorded relative times): the first burst's "
                    "start and time are unknown."]
    else:
        out.append("No metrics.jsonl lines: no per-burst figures.")
    out += ["", "## Plots", ""]
    for name, title in shown:
        out += [f"![{title}]({name})", ""]
    for name, why in skipped:
        out.append(f"- `{name}` skipped: {why}")
    out += ["", "`trace.json`: the run as a Chrome trace (cells as tracks with their roles, "
            "every move with its steps, reroutes as arrows, trainer steps, weight "
            "publications); open it at https://ui.perfetto.dev."]
    return "\n".join(out).rstrip() + "\n"


def _num(val: Any, digits: int | None = None) -> str:
    if val is None:
        return "–"
    if digits is not None and isinstance(val, int | float) and not isinstance(val, bool):
        return f"{val:.{digits}f}"
    return str(val)


def moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over up to ``window`` values (fewer at the start)."""
    out = []
    for i in range(len(values)):
        part = values[max(0, i - window + 1):i + 1]
        out.append(sum(part) / len(part))
    return out


def ma_window(n: int) -> int:
    return max(2, min(20, n // 10))


def plot_roles(run: RunData, path: Path) -> Path:
    plt = pyplot()
    cells = run.timeline or []
    names = run.cell_names()
    fig, ax = plt.subplots(figsize=(11, 1.2 + 0.45 * max(2, len(cells))))
    end = max((b for segs in cells for _, b, _ in segs), default=0.0)
    for i, segs in enumerate(cells):
        for start, stop, role in segs:
            ax.broken_barh([(start, stop - start)], (i - 0.4, 0.8), linewidth=0,
                           color=ROLE_COLOURS_BY_NAME.get(role, UNKNOWN_ROLE_COLOUR))
    ax.set_yticks(range(len(names)))
    ax.set_yticklabels(names, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlim(0, max(end, 1e-3))
    ax.set_xlabel("seconds since the first dispatch")
    ax.set_title(f"{run.policy}: cell roles ({end:.1f} s)", fontsize=9)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in ROLE_COLOURS_BY_NAME.values()]
    fig.legend(handles, list(ROLE_COLOURS_BY_NAME), loc="upper right", fontsize=7, ncol=4)
    fig.tight_layout(rect=(0, 0, 1, 0.92))
    return _save(fig, path)


def plot_reward(run: RunData, path: Path) -> Path:
    plt = pyplot()
    steps, rewards = run.rewards()
    w = ma_window(len(rewards))
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.plot(steps, rewards, marker="o", ms=3, lw=0.8, label="mean reward")
    ax.plot(steps, moving_average(rewards, w), lw=1.6, label=f"moving average ({w} steps)")
    first, last = run.reward_quarters()
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("mean reward")
    ax.set_title(f"{run.policy}: reward (first quarter {first:.3f}, last quarter {last:.3f})",
                 fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return _save(fig, path)


def plot_waterlevel(run: RunData, path: Path) -> Path:
    plt = pyplot()
    st = run.states or []
    t = [float(s["t"]) for s in st]
    fig, (ax, ax_cells) = plt.subplots(2, 1, figsize=(11, 4.5), sharex=True,
                                       gridspec_kw={"height_ratios": [3, 1]})
    for key, label, style, colour, width in (
            ("waterlevel", "waterlevel w (queued + running)", "-", "#4C72B0", 2.2),
            ("running", "running", "--", "#937860", 1.0),
            ("queued", "queued", ":", "#8172B3", 1.0)):
        ax.plot(t, [s.get(key) for s in st], ls=style, lw=width, color=colour, label=label)
    ax.set_ylabel("executions", fontsize=8)
    ax2 = ax.twinx()
    ax2.plot(t, [s.get("ready_groups") for s in st], lw=1.0, color="#55A868",
             label="ready groups (right axis)")
    ax2.set_ylabel("groups", fontsize=8)
    for a in (ax, ax2):
        a.set_ylim(0, a.get_ylim()[1] * 1.3 or 1)  # head-room for the legend
    lines = ax.get_lines() + ax2.get_lines()
    ax.legend(lines, [ln.get_label() for ln in lines], fontsize=7, loc="upper center", ncol=4)
    ax.set_title(f"{run.policy}: waterlevel and queue depth", fontsize=9)
    ct, count = training_cells(run)
    ax_cells.step(ct, count, where="post", color=ROLE_COLOURS_BY_NAME["training"], lw=1.2)
    ax_cells.set_ylabel("training\ncells", fontsize=8)
    ax_cells.set_ylim(-0.2, max([*count, 1]) + 0.2)
    ax_cells.yaxis.get_major_locator().set_params(integer=True)
    ax_cells.set_xlabel("seconds since the first dispatch")
    fig.tight_layout()
    return _save(fig, path)


def training_cells(run: RunData) -> tuple[list[float], list[int]]:
    """Cells in the training role over time: exact from the timeline's segment boundaries,
    else sampled from the roles in state.jsonl."""
    if run.timeline:
        edges = sorted({a for segs in run.timeline for a, _, _ in segs}
                       | {b for segs in run.timeline for _, b, _ in segs})
        count = [sum(1 for segs in run.timeline for a, b, r in segs
                     if r == "training" and a <= e < b) for e in edges]
        if len(count) > 1:  # the timeline's end closes the last segments: hold their count
            count[-1] = count[-2]
        return edges, count
    st = run.states or []
    return ([float(s["t"]) for s in st],
            [sum(r == "training" for r in s.get("roles") or []) for s in st])


def _util_lines(run: RunData) -> list[dict[str, Any]]:
    return [m for m in run.metrics or [] if UTIL_KEYS["train"] in m]


def plot_utilization(run: RunData, path: Path) -> Path:
    plt = pyplot()
    lines = _util_lines(run)
    versions = [m.get("version", i + 1) for i, m in enumerate(lines)]
    fig, ax = plt.subplots(figsize=(8, 3.5))
    for name, key in UTIL_KEYS.items():
        ax.plot(versions, [m.get(key) for m in lines], marker="o", ms=4, lw=1,
                color=UTIL_COLOURS[name], label=f"{name} ({key.split('/')[-1]})")
    ax.set_ylim(0, 1.05)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel("weight version (final step of a burst)")
    ax.set_ylabel("utilization")
    ax.set_title(f"{run.policy}: verl dynamic_resource utilization per version", fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    return _save(fig, path)


def _save(fig: Any, path: Path) -> Path:
    fig.savefig(path, dpi=DPI)
    pyplot().close(fig)
    return path
