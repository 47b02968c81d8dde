"""Side-by-side comparison of ``tidal run`` directories (one config, several policies).

In: two or more run directories (read by ``tidal.rundir``) and an output directory. Out,
written there: ``reward_compare.png`` (every run's reward per optimizer step, and against wall
time since the first dispatch), ``compare.md`` and ``compare.json`` with one row per run
(policy, run time, bursts time, each over the best other run's, steps, reward first/last
quarter, mean reward over GRPO groups +- its standard error, switches, reroutes, failed,
lost) and, for each pair in the order given, the ratios first / second of run time and bursts
time (``static / waterlevel`` > 1: the elastic run finished sooner) and the reward difference
in standard errors (``z``; |z| < 2: the two runs' rewards are within seed noise of each
other). ``comparison_table`` renders the same rows for the terminal (rich).
Invariant: numbers are read from the runs, never recomputed differently per output; configs
that differ beyond the policy are compared anyway and the differing keys listed as a note.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tidal.errors import ConfigError
from tidal.rundir import RunData, load_run
from tidal.viz.plots import pyplot

if TYPE_CHECKING:
    from rich.console import Group

RATIO_KEYS = ("run_time_s", "bursts_s")


@dataclass
class Comparison:
    out_dir: Path
    rows: list[dict[str, Any]]
    ratios: list[dict[str, Any]]
    notes: list[str] = field(default_factory=list)
    files: list[Path] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("files")
        data["out_dir"] = str(self.out_dir)
        return data


def compare_runs(run_dirs: list[str | Path], out_dir: str | Path) -> Comparison:
    """Read the runs, write ``reward_compare.png``, ``compare.md``, ``compare.json``."""
    if len(run_dirs) < 2:
        raise ConfigError("run_dirs", f"a comparison needs at least two runs, got {len(run_dirs)}")
    resolved = [Path(p).resolve() for p in run_dirs]
    dupes = sorted({str(p) for p in resolved if resolved.count(p) > 1})
    if dupes:
        raise ConfigError("run_dirs", f"the same run given twice: {', '.join(dupes)}")
    runs = [load_run(p) for p in run_dirs]
    emulated = {r.path.name for r in runs if r.emulated}
    if emulated and len(emulated) < len(runs):  # a test double's figures never mix with real
        raise ConfigError(
            "run_dirs",
            f"emulated runs ({', '.join(sorted(emulated))}) cannot be compared with real runs",
        )
    labels = run_labels(runs)
    rows = vs_best_other([run_row(r, label) for r, label in zip(runs, labels, strict=True)])
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    comp = Comparison(out_dir=out, rows=rows, ratios=pair_ratios(rows), notes=config_notes(runs))
    comp.files = [plot_reward_compare(runs, labels, out / "reward_compare.png")]
    (out / "compare.json").write_text(json.dumps(comp.to_json(), indent=2) + "\n")
    (out / "compare.md").write_text(render_markdown(comp))
    comp.files += [out / "compare.md", out / "compare.json"]
    return comp


def run_labels(runs: list[RunData]) -> list[str]:
    """The policy spec of each run; the directory name is added where two specs collide."""
    specs = [r.policy for r in runs]
    return [
        f"{s} ({r.path.name})" if specs.count(s) > 1 else s
        for s, r in zip(specs, runs, strict=True)
    ]


def run_row(run: RunData, label: str) -> dict[str, Any]:
    s = run.summary
    first, last = run.reward_quarters()
    mean, se, n = run.reward_noise()
    return {
        "label": label,
        "policy": run.policy,
        "run_dir": str(run.path),
        "run_time_s": s.get("run_time_s"),
        "bursts_s": s.get("bursts_s"),
        "steps": run.n_steps(),
        "reward_first_quarter": first,
        "reward_last_quarter": last,
        "reward_mean": mean,
        "reward_se": se,
        "reward_groups": n,
        "switches_to_training": s.get("switches_to_training"),
        "switches_to_rollout": s.get("switches_to_rollout"),
        "rerouted_requests": s.get("rerouted_requests"),
        "failed_requests": s.get("failed_requests"),
        "lost_executions": s.get("lost_executions"),
    }


def vs_best_other(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each row's run time and bursts time over the least of every other run's
    (``<key>_vs_best_other``; below 1: this run beat every other one), None where a figure
    is missing."""
    for i, row in enumerate(rows):
        for key in RATIO_KEYS:
            others = [r.get(key) for j, r in enumerate(rows) if j != i]
            others = [x for x in others if isinstance(x, int | float) and x > 0]
            mine = row.get(key)
            row[f"{key}_vs_best_other"] = (
                mine / min(others) if others and isinstance(mine, int | float) else None
            )
    return rows


def pair_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For each pair (i < j in the order given): row i / row j of run time and bursts time."""
    out = []
    for i, a in enumerate(rows):
        for b in rows[i + 1 :]:
            pair: dict[str, Any] = {"numerator": a["label"], "denominator": b["label"]}
            for key in RATIO_KEYS:
                x, y = a.get(key), b.get(key)
                ok = isinstance(x, int | float) and isinstance(y, int | float) and y > 0
                pair[key] = x / y if ok else None
            pair["reward_diff"] = pair["reward_z"] = None
            if a.get("reward_mean") is not None and b.get("reward_mean") is not None:
                pair["reward_diff"] = a["reward_mean"] - b["reward_mean"]
                se = (a["reward_se"] or 0.0) ** 2 + (b["reward_se"] or 0.0) ** 2
                if a["reward_se"] is not None and b["reward_se"] is not None and se > 0:
                    pair["reward_z"] = pair["reward_diff"] / se**0.5
            out.append(pair)
    return out


def config_notes(runs: list[RunData]) -> list[str]:
    notes = []
    base = runs[0].config_without_policy()
    for r in runs[1:]:
        if runs[0].config is None or r.config is None:
            notes.append(f"{r.path.name}: no config.yaml on one side; configs not compared")
            continue
        other = r.config_without_policy()
        keys = sorted(k for k in base.keys() | other.keys() if base.get(k) != other.get(k))
        if keys:
            shown = ", ".join(keys[:8]) + (f" and {len(keys) - 8} more" if len(keys) > 8 else "")
            notes.append(
                f"{r.path.name} differs from {runs[0].path.name} beyond the policy: {shown}"
            )
    return notes


def _fmt(val: object, digits: int = 2) -> str:
    if val is None:
        return "–"
    if isinstance(val, float):
        return f"{val:.{digits}f}"
    return str(val)


COLUMNS = (
    ("policy", "label", 0),
    ("run time s", "run_time_s", 2),
    ("bursts s", "bursts_s", 2),
    ("run vs best other", "run_time_s_vs_best_other", 3),
    ("bursts vs best other", "bursts_s_vs_best_other", 3),
    ("steps", "steps", 0),
    ("reward first q", "reward_first_quarter", 3),
    ("reward last q", "reward_last_quarter", 3),
    ("reward mean ± se", "reward_mean_se", 0),
    ("to training", "switches_to_training", 0),
    ("to rollout", "switches_to_rollout", 0),
    ("reroutes", "rerouted_requests", 0),
    ("failed requests", "failed_requests", 0),
    ("lost", "lost_executions", 0),
)


def _cell(row: dict[str, Any], key: str, digits: int) -> str:
    if key == "reward_mean_se":
        if row.get("reward_mean") is None:
            return "–"
        se = row.get("reward_se")
        return f"{row['reward_mean']:.3f}" + (f" ± {se:.3f}" if se is not None else "")
    return _fmt(row.get(key), digits)


def _z(p: dict[str, Any]) -> str:
    if p.get("reward_diff") is None:
        return "–"
    z = p.get("reward_z")
    return f"{p['reward_diff']:+.3f}" + (f" (z {z:+.2f})" if z is not None else "")


def render_markdown(comp: Comparison) -> str:
    lines = [
        "# tidal run comparison",
        "",
        "Bursts time: first dispatch to the last publication (start-up excluded). Reward "
        "quarters: mean reward of the first and last quarter of optimizer steps. Reward "
        "mean ± se: over the run's GRPO groups (executions.jsonl), with its standard "
        "error. Vs best other: the run's time over the least of every other run's "
        "(below 1: it beat them all).",
        "",
        "| " + " | ".join(h for h, _, _ in COLUMNS) + " |",
        "|---|" + "---:|" * (len(COLUMNS) - 1),
    ]
    for row in comp.rows:
        lines.append("| " + " | ".join(_cell(row, k, d) for _, k, d in COLUMNS) + " |")
    lines += [
        "",
        "## Ratios",
        "",
        "| pair | run time | bursts time | reward difference |",
        "|---|---:|---:|---:|",
    ]
    for p in comp.ratios:
        lines.append(
            f"| {p['numerator']} / {p['denominator']} | {_fmt(p['run_time_s'], 3)} | "
            f"{_fmt(p['bursts_s'], 3)} | {_z(p)} |"
        )
    lines += [
        "",
        "A ratio above 1: the second run of the pair took less time. Reward "
        "difference: first minus second, and in standard errors (z); |z| < 2: within "
        "seed noise.",
        "",
        "## Runs",
        "",
    ]
    lines += [f"- {row['label']}: `{row['run_dir']}`" for row in comp.rows]
    if comp.notes:
        lines += ["", "## Notes", "", *(f"- {n}" for n in comp.notes)]
    lines += ["", "![reward of every run](reward_compare.png)"]
    return "\n".join(lines) + "\n"


def comparison_table(comp: Comparison) -> Group:
    """The rows and the ratios as ``rich`` tables (a ``rich.console.Group``)."""
    from rich.console import Group
    from rich.table import Table

    runs = Table(title="tidal runs")
    for head, _, _ in COLUMNS:
        runs.add_column(head, justify="left" if head == "policy" else "right")
    for row in comp.rows:
        runs.add_row(*(_cell(row, k, d) for _, k, d in COLUMNS))
    ratios = Table(title="ratios (first / second)")
    for head in ("pair", "run time", "bursts time", "reward diff (z)"):
        ratios.add_column(head, justify="left" if head == "pair" else "right")
    for p in comp.ratios:
        ratios.add_row(
            f"{p['numerator']} / {p['denominator']}",
            _fmt(p["run_time_s"], 3),
            _fmt(p["bursts_s"], 3),
            _z(p),
        )
    return Group(runs, ratios)


def plot_reward_compare(runs: list[RunData], labels: list[str], path: Path) -> Path:
    plt = pyplot()
    fig, (ax_step, ax_time) = plt.subplots(1, 2, figsize=(12, 4), sharey=True)
    for run, label in zip(runs, labels, strict=True):
        steps, rewards = run.rewards()
        (line,) = ax_step.plot(steps, rewards, marker="o", ms=3, lw=1, label=label)
        if run.metrics:  # wall time of each step needs metrics.jsonl
            ax_time.plot(
                [float(m["t"]) for m in run.metrics],
                rewards,
                marker="o",
                ms=3,
                lw=1,
                color=line.get_color(),
                label=label,
            )
    ax_step.set_xlabel("optimizer step")
    ax_step.xaxis.get_major_locator().set_params(integer=True)
    ax_step.set_ylabel("mean reward")
    ax_step.set_title("reward per optimizer step", fontsize=9)
    ax_step.legend(fontsize=7)
    ax_time.set_xlim(left=0)
    ax_time.set_xlabel("seconds since the first dispatch")
    ax_time.set_title("reward against wall time", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
