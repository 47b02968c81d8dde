"""The plots and the short report of one ``tidal run`` directory (files in, files out).

In: a run directory (read by ``tidal.rundir``). Out, written into that directory:
- ``roles.png``: cells x time coloured by role (``timeline.json``);
- ``reward.png``: mean reward per optimizer step with one standard deviation of its
  executions' rewards as a band (``tidal.viz.run_figures``);
- ``waterlevel.png``: the waterlevel against the rollout capacity over time, queued executions
  only where there are any;
- ``utilization.png``: train and rollout utilisation of every optimizer step;
- ``trace.json``: the run as a Chrome trace-event file for Perfetto (``tidal.viz.trace``);
- ``report.md``: the run in one line, its totals, reward first vs last quarter and its mean
  over GRPO groups with the standard error, a table of bursts, and each plot as a relative image
  link with one sentence saying what it shows.
Invariant: everything shown is read from the files; a plot whose input is missing is skipped
with a note in ``report.md`` (and a stale PNG of that name removed), never invented.
Colours and backend are the simulator's (``tidal.viz.plots``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tidal.rundir import RunData, burst_rows, load_run
from tidal.viz import run_figures as figures
from tidal.viz.plots import ROLE_COLOURS, pyplot

if TYPE_CHECKING:
    from matplotlib.figure import Figure

ROLE_COLOURS_BY_NAME = {role.value: colour for role, colour in ROLE_COLOURS.items()}
UNKNOWN_ROLE_COLOUR = "#999999"
DPI = 110
EXPLAIN = {  # one sentence per figure in report.md
    "roles.png": "Each cell's role over time: blue serves rollout, orange trains, red and "
    "magenta are moves between the two.",
    "reward.png": "Mean reward of each optimizer step, the band one standard deviation of the "
    "rewards of the executions it trained.",
    "waterlevel.png": "The waterlevel (executions queued or running) against the rollout "
    "capacity (slots of the cells in rollout plus the standalone engines): "
    "a cell may leave for training only while the capacity left covers the "
    "waterlevel.",
    "utilization.png": "For each optimizer step, over the time since the previous one: the "
    "share the trainer computed (train) and the mean share of rollout slots "
    "busy (rollout).",
}


def write_report(run_dir: str | Path) -> list[Path]:
    """Write the four plots (those whose input exists) and ``report.md`` into RUN_DIR."""
    run = load_run(run_dir)
    plots: list[tuple[str, str, Callable[[RunData, Path], Path], str | None]] = [
        (
            "roles.png",
            "cell roles",
            plot_roles,
            None if run.timeline else "no timeline.json (or no cells in it)",
        ),
        (
            "reward.png",
            "mean reward per step",
            _fig(figures.plot_reward),
            None if run.rewards()[1] else "no optimizer steps in metrics.jsonl or summary.json",
        ),
        (
            "waterlevel.png",
            "waterlevel against rollout capacity",
            _fig(figures.plot_waterlevel),
            None if run.states else "no state.jsonl samples",
        ),
        (
            "utilization.png",
            "utilisation per optimizer step",
            _fig(figures.plot_utilization),
            None if run.metrics else "no optimizer steps in metrics.jsonl",
        ),
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


def render_report(
    run: RunData, shown: list[tuple[str, str]], skipped: list[tuple[str, str]]
) -> str:
    s = run.summary
    name = (run.config or {}).get("name", run.path.name)
    out = [f"# tidal run report: {name} ({run.policy})", "", run.config_line(), ""]
    if run.emulated:  # its first line says so: a test double's figures are never a real run's
        banner = s.get("emulated") or f"EMULATED RUN (test double: {run.emulated})"
        out = [f"**{banner}**", "", *out]
    bursts_s = s.get("bursts_s")
    rows: list[tuple[str, str]] = [
        (
            "run time",
            f"{_num(s.get('run_time_s'), 2)} s"
            + (
                f" (first dispatch to last publication {bursts_s:.2f} s)"
                if isinstance(bursts_s, int | float)
                else ""
            ),
        ),
        ("optimizer steps", str(run.n_steps())),
        (
            "switches",
            f"{_num(s.get('switches_to_training'))} to training, "
            f"{_num(s.get('switches_to_rollout'))} to rollout",
        ),
    ]
    for key, label in (
        ("rerouted_requests", "rerouted requests"),
        ("failed_requests", "failed requests"),
        ("lost_executions", "lost executions"),
    ):
        rows.append((label, _num(s.get(key))))
    if "satellite_joins" in s:  # newer runtimes only
        rows.append(("satellite joins", _num(s["satellite_joins"])))
    if "chain_breaks_per_100_calls" in s:  # newer runtimes only
        rows.append(
            (
                "chain breaks per 100 calls",
                f"{_num(s['chain_breaks_per_100_calls'], 2)} ({_num(s.get('chain_breaks'))} "
                f"calls trained apart; {_num(s.get('bridged_calls'))} got their sampled "
                "ids back)",
            )
        )
    if "cached_token_share" in s:
        by_engine = ", ".join(
            f"{k} {v:.3f}" for k, v in (s.get("cached_token_share_by_engine") or {}).items()
        )
        rows.append(
            (
                "cached prompt-token share",
                f"{_num(s['cached_token_share'], 3)}" + (f" ({by_engine})" if by_engine else ""),
            )
        )
    first, last = run.reward_quarters()
    q = max(1, len(run.rewards()[1]) // 4)
    rows.append(
        (
            "mean reward",
            f"first quarter {_num(first, 3)}, last quarter {_num(last, 3)} "
            f"({q} step{'s' if q != 1 else ''} each)",
        )
    )
    change = run.reward_change()
    if change is not None:
        z = change["z"]
        rows.append(
            (
                "learning (last quarter's groups - first's)",
                f"{change['change']:+.3f} ± {change['change_se']:.3f} "
                f"({'–' if z is None else f'{z:.1f}'} standard errors; first "
                f"{change['first']:.3f} ± {change['first_se']:.3f} over "
                f"{change['first_groups']} groups, last {change['last']:.3f} ± "
                f"{change['last_se']:.3f} over {change['last_groups']})",
            )
        )
    mean_g, se, n_groups = run.reward_noise()
    rows.append(
        (
            "mean reward over GRPO groups",
            f"{mean_g:.3f} ± {se:.3f} (standard error over {n_groups} groups: the noise "
            f"a seed alone moves it by)"
            if se is not None
            else "– (needs executions.jsonl with two or more groups)",
        )
    )
    pub = s.get("publication")
    if pub:  # newer runtimes only
        g, w, ld = pub.get("gbps") or {}, pub.get("write_s") or {}, pub.get("engine_load_s") or {}
        rows.append(
            (
                "weight publication",
                f"{_num(g.get('p50'), 2)} GB/s p50 (max {_num(g.get('max'), 2)}) beside "
                f"memcpy {_num(pub.get('memcpy_gbps'), 1)} GB/s at the start, "
                f"{_num((pub.get('memcpy_beside_gbps') or {}).get('p50'), 1)} GB/s p50 beside "
                f"each version ({_pct((pub.get('share_of_memcpy_beside') or {}).get('p50'))} "
                "of it); write p50 "
                f"{_num(w.get('p50'), 3)} s, engine load p50 {_num(ld.get('p50'), 3)} s "
                f"(of it, waiting for the step in flight "
                f"{_num((pub.get('engine_step_wait_s') or {}).get('p50'), 3)} s); "
                f"{_num(pub.get('bytes_per_version'))} bytes a version; carriers "
                + ", ".join(f"{k} {v}" for k, v in (pub.get("carriers") or {}).items())
                + f"; {_num(pub.get('fallbacks'))} fallbacks",
            )
        )
    out += ["| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows), ""]
    out += switch_step_table(s.get("switch_steps_s"))
    bursts = burst_rows(run)
    out += ["## Bursts", ""]
    if bursts:
        out += [
            "Time: from the previous burst's final optimizer step (the first dispatch for "
            "burst 0) to this burst's final step. Utilization: verl's `dynamic_resource/*` "
            "of the burst's last weight version.",
            "",
            "| burst | steps | start s | end s | time s | version | train util | "
            "rollout util | cluster util | groups generated |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for b in bursts:
            out.append(
                f"| {b['burst']} | {b['steps']} | {_num(b['start_s'], 2)} "
                f"| {b['end_s']:.2f} | {_num(b['time_s'], 2)} | {_num(b['version'])} "
                f"| {_num(b['train_utilization'], 3)} "
                f"| {_num(b['rollout_utilization'], 3)} "
                f"| {_num(b['cluster_utilization'], 3)} "
                f"| {_num(b['generated_samples'], 0)} |"
            )
        if not run.relative_times():
            out += [
                "",
                "metrics.jsonl's `t` is not counted from the first dispatch (a run "
                "written before the runtime recorded relative times): the first burst's "
                "start and time are unknown.",
            ]
    else:
        out.append("No metrics.jsonl lines: no per-burst figures.")
    out += ["", "## Plots", ""]
    for name, title in shown:
        out += [f"![{title}]({name})", "", EXPLAIN[name], ""]
    for name, why in skipped:
        out.append(f"- `{name}` skipped: {why}")
    out += [
        "",
        "`trace.json`: the run as a Chrome trace (cells as tracks with their roles, "
        "every move with its steps, reroutes as arrows, trainer steps, weight "
        "publications); open it at https://ui.perfetto.dev.",
    ]
    return "\n".join(out).rstrip() + "\n"


def switch_step_table(steps: dict | None) -> list[str]:
    """``report.md``'s switch costs: per direction, each plan step's p50 and max."""
    if not steps:
        return []
    out = [
        "## Switch steps",
        "",
        "Each plan step's measured duration (s) per direction.",
        "",
        "| direction | step | n | p50 s | max s |",
        "|---|---|---:|---:|---:|",
    ]
    for direction, by_step in steps.items():
        for step, c in by_step.items():
            out.append(f"| {direction} | {step} | {c['n']} | {c['p50_s']:.3f} | {c['max_s']:.3f} |")
    return [*out, ""]


def _num(val: object, digits: int | None = None) -> str:
    if val is None:
        return "–"
    if digits is not None and isinstance(val, int | float) and not isinstance(val, bool):
        return f"{val:.{digits}f}"
    return str(val)


def _pct(share: object) -> str:
    return "–" if not isinstance(share, int | float) else f"{100 * share:.0f} %"


def moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over up to ``window`` values (fewer at the start)."""
    out = []
    for i in range(len(values)):
        part = values[max(0, i - window + 1) : i + 1]
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
            ax.broken_barh(
                [(start, stop - start)],
                (i - 0.4, 0.8),
                linewidth=0,
                color=ROLE_COLOURS_BY_NAME.get(role, UNKNOWN_ROLE_COLOUR),
            )
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


def training_cells(run: RunData) -> tuple[list[float], list[int]]:
    """Cells in the training role over time: exact from the timeline's segment boundaries,
    else sampled from the roles in state.jsonl."""
    if run.timeline:
        edges = sorted(
            {a for segs in run.timeline for a, _, _ in segs}
            | {b for segs in run.timeline for _, b, _ in segs}
        )
        count = [
            sum(1 for segs in run.timeline for a, b, r in segs if r == "training" and a <= e < b)
            for e in edges
        ]
        if len(count) > 1:  # the timeline's end closes the last segments: hold their count
            count[-1] = count[-2]
        return edges, count
    st = run.states or []
    return (
        [float(s["t"]) for s in st],
        [sum(r == "training" for r in s.get("roles") or []) for s in st],
    )


def _fig(plot: Callable[[RunData, Path, Any], Path]) -> Callable[[RunData, Path], Path]:
    return lambda run, path: plot(run, path, pyplot())


def _save(fig: Figure, path: Path) -> Path:
    fig.savefig(path, dpi=DPI)
    pyplot().close(fig)
    return path
