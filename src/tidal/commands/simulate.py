"""``tidal simulate SCENARIO [--policy NAME[:ARGS]]... [--sweep static] [--out DIR]``: policies
side by side (with ``--sweep static``: every static split first, the best one the baseline).

In: a scenario name (``configs/scenarios/*.yaml``, shipped with the package) or a YAML path, and
policy specs. Out: a table on stdout (makespan, the rollout floor: the same run with training
~free (``tidal.sim.rollout_floor``), the ratio to the best other run (the other policies and,
with ``--sweep static``, the best static split), the ratio to the oracle bound (a clairvoyant
lower bound, reported, not a goal), utilizations, switches, reroutes, re-prefilled tokens,
mean staleness, seconds executions waited for a slot), speed-ups against each other run and,
with
``--out``: ``summary.json``, ``verl_metrics.jsonl`` (verl's metrics per weight version, each
tagged with its run), ``decisions.jsonl`` (every decision and plan record, each tagged
with its run), ``scenario.yaml`` (the resolved scenario), ``trace.json`` (every policy's run as
a Chrome trace for Perfetto, one process each) and PNG plots.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:
    from tidal.sim.runner import RunResult
    from tidal.sim.sweep import StaticSweep


@click.command(
    help="Simulate scheduling policies on a scenario, side by side, in virtual "
    "time, with the real control plane."
)
@click.argument("scenario")
@click.option(
    "--policy",
    "-p",
    "policies",
    multiple=True,
    metavar="NAME[:ARGS]",
    help="Policy spec, e.g. static:train=16 or verl-default:deactivate_ratio=0.6 "
    "(repeatable; default: the scenario's list).",
)
@click.option(
    "--out",
    "-o",
    "out_dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Directory for summary.json, decisions.jsonl, trace.json (Perfetto) and plots.",
)
@click.option("--bursts", type=int, default=None, help="Override the number of bursts.")
@click.option(
    "--scale",
    type=float,
    default=1.0,
    show_default=True,
    help="Scale cells, standalone engines and batch size by this factor.",
)
@click.option(
    "--trace",
    type=click.Path(dir_okay=False, exists=True),
    default=None,
    help="Replay this JSONL trace (one line per execution) instead of the "
    "scenario's workload classes.",
)
@click.option(
    "--mechanics",
    type=click.Choice(["own", "verl", "tidal", "waterlevel", "colocate"]),
    default="own",
    show_default=True,
    help="Run every policy with this system's mechanics (trainer, sync, KV handoff, "
    "dispatch, partial rollout); own: what each policy declares.",
)
@click.option(
    "--policy-module",
    "modules",
    multiple=True,
    metavar="FILE.py|MODULE",
    help="Load the user's module that registers policies (register_policy) before "
    "the policies are looked up (repeatable; added to the scenario's "
    "policy_modules).",
)
@click.option(
    "--sweep",
    type=click.Choice(["static"]),
    default=None,
    help="Also run every static split and report each policy's saving against the "
    "best one (the baseline column).",
)
@click.option(
    "--admission",
    default=None,
    metavar="off|saturation|SECONDS",
    help="Engine admission control for every policy (control.admission).",
)
@click.option("--check", is_flag=True, help="Check the invariants after every event (slow).")
@click.option("--no-plots", is_flag=True, help="Skip the PNG plots.")
@click.option(
    "--no-floor",
    is_flag=True,
    help="Skip the rollout-floor column (one more run per policy, training ~free).",
)
@click.option(
    "--costs-from",
    "costs_from",
    type=click.Path(dir_okay=False),
    default=None,
    metavar="FILE",
    help="A GPU check's JSON (benchmarks/gpu/results/): also print each policy's "
    "saving against the best static split with the switch costs tidal measured "
    "there (sleep, wake, weight sync), beside the scenario's assumed ones.",
)
def command(
    scenario: str,
    policies: tuple[str, ...],
    out_dir: str | None,
    bursts: int | None,
    scale: float,
    trace: str | None,
    mechanics: str,
    modules: tuple[str, ...],
    sweep: str | None,
    admission: str | None,
    check: bool,
    no_plots: bool,
    no_floor: bool,
    costs_from: str | None,
) -> None:
    from tidal.config import ControlConfig, validate_model
    from tidal.sim import scenario as scenarios

    sc = scenarios.load(scenario)
    if modules:  # loaded now; the resolved scenario lists them
        from tidal.plugins import load_policies, resolved

        paths = [resolved(m) for m in modules]
        load_policies(paths, "--policy-module")
        sc = sc.model_copy(update={"policy_modules": [*sc.policy_modules, *paths]})
    if admission is not None:
        from tidal.control.factory import check_control

        control = check_control(
            validate_model(
                ControlConfig,
                {**sc.control.model_dump(mode="json"), "admission": admission},
                "control",
            )
        )
        sc = sc.model_copy(update={"control": control})
    if mechanics != "own":
        sc = sc.model_copy(update={"mechanics": mechanics})
    if scale != 1.0 or bursts is not None:
        sc = sc.scaled(scale, bursts=bursts)
    if trace is not None:
        sc = sc.model_copy(
            update={"workload": scenarios.WorkloadConfig(trace=str(Path(trace).resolve()))}
        )
    measured = None
    if costs_from is not None:  # read before anything runs: a bad file fails at once
        from tidal.sim.measured_costs import read_check

        measured = read_check(costs_from)
    baseline = sweep_and_report(sc) if sweep == "static" or measured else None
    specs = list(policies) or list(sc.policies)
    results = run_and_report(
        sc, specs, out_dir, check=check, plots=not no_plots, baseline=baseline, floor=not no_floor
    )
    if measured is not None:
        costs_report(sc, specs, results, baseline, measured)


def costs_report(
    sc: Any, specs: list[str], results: list[Any], baseline: Any, measured: Any
) -> None:
    """Each policy's saving against the best static split with the scenario's assumed costs
    (the runs above) and with the measured ones (every split and policy run again)."""
    from rich.console import Console
    from rich.table import Table

    from tidal.sim import measured_costs
    from tidal.sim.runner import compare
    from tidal.sim.sweep import sweep_static

    console = Console(width=None if Console().is_terminal else 200)
    sc_m, used = measured_costs.apply(sc, measured)
    base_m = sweep_static(sc_m)
    again = compare(sc_m, specs, keep_log=False)
    had = measured_costs.assumed(sc)
    console.print(
        f"switch costs per move: assumed sleep {had['sleep_s']:.2f} s, wake "
        f"{had['wake_s']:.2f} s, weight sync {had['sync_s']:.2f} s; measured "
        f"({measured.device}, {measured.date}: {measured.source}) sleep "
        f"{used['sleep_s']:.2f} s, wake {used['wake_s']:.2f} s, weight sync "
        f"{used['sync_s']:.2f} s ({measured.sync_gbps:.2f} GB/s per GPU, "
        f"'{measured.sync_figure}'; the check's {measured.weights_gib:.1f} GiB on one "
        f"GPU scaled to this scenario's bytes per GPU)"
    )
    table = Table(
        title=f"{sc.name}: saving against the best static split, by the costs it rests on",
        title_justify="left",
    )
    for name in (
        "policy",
        "assumed costs: makespan h",
        "saved",
        "measured costs: makespan h",
        "saved ",
    ):
        table.add_column(name, justify="left" if name == "policy" else "right")
    for r, m in zip(results, again, strict=True):
        a_s, m_s = r.summary["makespan_s"], m.summary["makespan_s"]
        table.add_row(
            r.spec,
            f"{a_s / 3600:.3f}",
            f"{100 * baseline.saving(a_s):+.1f}%",
            f"{m_s / 3600:.3f}",
            f"{100 * base_m.saving(m_s):+.1f}%",
        )
    console.print(table)


def sweep_and_report(sc: Any) -> Any:
    """Runs every static split, prints them and the best one; returns the ``StaticSweep``."""
    from rich.console import Console
    from rich.table import Table

    from tidal.sim.sweep import sweep_static

    console = Console(width=None if Console().is_terminal else 200)
    sweep = sweep_static(sc)
    table = Table(title=f"{sc.name}: static splits (train+rollout GPUs)", title_justify="left")
    for name in ("split", "policy", "makespan h", "/oracle", "vs best"):
        table.add_column(name, justify="left" if name in ("split", "policy") else "right")
    for r in sweep.runs:
        table.add_row(
            sweep.split_label(r) + (" (best)" if r is sweep.best else ""),
            r.spec,
            f"{r.summary['makespan_h']:.3f}",
            f"{r.summary['oracle_ratio']:.3f}",
            f"{r.summary['makespan_s'] / sweep.best_makespan_s:.3f}",
        )
    console.print(table)
    return sweep


def run_and_report(
    sc: Any,
    specs: list[str],
    out_dir: str | Path | None,
    *,
    check: bool = False,
    plots: bool = True,
    baseline: Any = None,
    floor: bool = True,
) -> list[Any]:
    """Runs the specs with a progress bar (and, with ``floor``, each again with training
    ~free: the rollout floor), prints the table, writes the run directory."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from tidal.config import dump_yaml
    from tidal.control.decision_log import jsonl_file_sink
    from tidal.sim.runner import compare
    from tidal.viz.trace_sources import recording_reroutes

    for spec in specs:  # fail on a bad spec before anything runs
        sc.run_config(spec)
    console = Console(width=None if Console().is_terminal else 200)
    out = Path(out_dir) if out_dir else None
    fh = None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "scenario.yaml").write_text(dump_yaml(sc))
        fh = open(out / "decisions.jsonl", "w")  # noqa: SIM115
    base_sink = jsonl_file_sink(fh) if fh else None

    kept: dict[str, list[dict[str, Any]]] = {s: [] for s in specs}  # for trace.json

    def sink_for(spec: str):
        if base_sink is None:
            return None

        def sink(rec: dict[str, Any]) -> None:
            base_sink({"run": spec, **rec})
            if rec.get("type") != "decision":
                kept[spec].append(rec)

        return sink

    try:
        with Progress(
            TextColumn("{task.description:<28}"),
            BarColumn(),
            TextColumn("step {task.completed:.0f}/{task.total:.0f}"),
            TimeElapsedColumn(),
            console=console,
            transient=False,
        ) as bar:
            tasks = {s: bar.add_task(s, total=sc.total_steps) for s in specs}

            def progress_for(spec: str):
                return lambda step, total: bar.update(tasks[spec], completed=step)

            def done(res):
                bar.update(tasks[res.spec], completed=res.summary["trainer_steps"])

            with recording_reroutes() as reroutes:
                results = compare(
                    sc,
                    specs,
                    check=check,
                    on_done=done,
                    log_sink_for=sink_for,
                    progress_for=progress_for,
                    keep_log=False,
                )
    finally:
        if fh is not None:
            fh.close()
    if floor:
        from tidal.sim.rollout_floor import floor_makespan_s

        for r in results:  # the summary carries it (summary.json), the table prints it
            r.summary["rollout_floor_s"] = floor_makespan_s(sc, r.spec)
    console.print(render_table(sc, results, baseline))
    if len(results) > 1:
        console.print(render_speedups(results))
    if out is not None:
        _write_outputs(sc, results, baseline, out, kept, reroutes, plots, console)
    return results


def _write_outputs(
    sc: Any,
    results: list[Any],
    baseline: Any,
    out: Path,
    kept: dict[str, list[dict[str, Any]]],
    reroutes: dict[str, list[Any]],
    plots: bool,
    console: Any,
) -> None:
    """The run directory's summary, verl metrics, trace and plots (decisions.jsonl and
    scenario.yaml are written while the runs go)."""
    from tidal.viz import trace
    from tidal.viz.trace_sources import from_sim

    summary = {
        "scenario": sc.name,
        "description": sc.description,
        "oracle_makespan_s": results[0].summary["oracle_makespan_s"],
        "runs": [r.summary for r in results],
    }
    if baseline is not None:
        summary["best_static"] = {
            "spec": baseline.best.spec,
            "split": baseline.split_label(baseline.best),
            "makespan_s": baseline.best_makespan_s,
        }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    with open(out / "verl_metrics.jsonl", "w") as fh:  # verl's rows, one per version
        for r in results:
            for row in r.world.controller.metrics.rows:
                fh.write(json.dumps({"run": r.spec, **row}) + "\n")
    trace.write(
        [from_sim(r, kept[r.spec], reroutes.get(r.spec, [])) for r in results], out / "trace.json"
    )
    written = [
        "summary.json",
        "verl_metrics.jsonl",
        "decisions.jsonl",
        "scenario.yaml",
        "trace.json",
    ]
    if plots:
        from tidal.viz.plots import plot_all

        written += [p.name for p in plot_all(results, out)]
    console.print(f"wrote {', '.join(written)} to {out}/")


def best_other_s(
    results: list[RunResult], r: RunResult, baseline: StaticSweep | None = None
) -> float | None:
    """The shortest makespan of every run but ``r`` and, with a sweep, the best static split
    (None: nothing else ran)."""
    others = [o.summary["makespan_s"] for o in results if o is not r]
    if baseline is not None:
        others.append(baseline.best_makespan_s)
    return min(others) if others else None


def render_table(sc: Any, results: list[Any], baseline: Any = None) -> Any:
    """One row per run; the speed-ups against every other run follow in ``render_speedups``.
    ``vs best other``: makespan over the best of every other run (and the best static split
    with a sweep); ``floor h``: the rollout floor (training ~free), where it was run; the
    oracle ratio is a reported figure (a clairvoyant bound), not a goal. With a
    ``StaticSweep`` baseline each row also shows its saving against the best split."""
    from rich.table import Table

    oracle_h = results[0].summary["oracle_makespan_s"] / 3600 if results else 0.0
    title = f"{sc.name}: {sc.total_steps} optimizer steps, oracle bound {oracle_h:.3f} h"
    if baseline is not None:
        title += (
            f"; baseline: best static split {baseline.split_label(baseline.best)} "
            f"({baseline.best.spec}) {baseline.best_makespan_s / 3600:.3f} h"
        )
    table = Table(title=title, title_justify="left")
    for name in (
        "policy",
        "mechanics",
        "makespan h",
        "floor h",
        "vs best other",
        "/oracle",
        "train",
        "rollout",
        "cluster",
        "switches",
        "reroutes",
        "re-prefill Mtok",
        "staleness",
        "queued s",
        *(["saved vs best static"] if baseline is not None else []),
    ):
        table.add_column(
            name, justify="left" if name == "policy" else "right", no_wrap=name == "policy"
        )
    for r in results:
        s = r.summary
        other = best_other_s(results, r, baseline)
        fl = s.get("rollout_floor_s")
        table.add_row(
            r.spec,
            r.world.profile.label(),
            f"{s['makespan_h']:.3f}",
            "-" if fl is None else f"{fl / 3600:.3f}",
            "-" if not other else f"{s['makespan_s'] / other:.3f}",
            f"{s['oracle_ratio']:.3f}",
            f"{s['train_utilization']:.3f}",
            f"{s['rollout_utilization']:.3f}",
            f"{s['cluster_utilization']:.3f}",
            str(s["switches"]),
            str(s["reroutes"]),
            f"{s['reprefill_tokens'] / 1e6:.2f}",
            f"{s['mean_staleness']:.2f}",
            f"{s['queued_execution_s']:.0f}",
            *([f"{100 * baseline.saving(s['makespan_s']):+.1f}%"] if baseline is not None else []),
        )
    return table


def render_speedups(results: list[Any]) -> Any:
    """Speed-up of each row's run against each column's run (column makespan / row's)."""
    from rich.table import Table

    table = Table(
        title="speed-up of row over column (column makespan / row makespan)", title_justify="left"
    )
    table.add_column("policy", no_wrap=True)
    for r in results:
        table.add_column(r.spec, justify="right")
    for r in results:
        table.add_row(
            r.spec,
            *[
                ("-" if o is r else f"{o.summary['makespan_s'] / r.summary['makespan_s']:.3f}x")
                for o in results
            ],
        )
    return table
