"""``tidal run CONFIG [--out DIR]``: a real elastic RL run on Ray (see ``tidal.runtime``).

In: a YAML run config (``configs/tiny.yaml``), or ``--resume DIR`` (an interrupted run's
directory). Out: the run directory (resolved config, metrics.jsonl, decisions.jsonl, steps.jsonl,
state.jsonl, timeline.json, checkpoint/, summary.json) and a live panel or one line per step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:
    from tidal.config import RunConfig


@click.command("run", help="Run an elastic RL job on Ray (embedded local Ray by default).")
@click.argument("config", type=click.Path(exists=True, dir_okay=False), required=False)
@click.option(
    "--out",
    type=click.Path(file_okay=False),
    default=None,
    help="Run directory (default: runs/<config name>).",
)
@click.option(
    "--resume",
    "resume",
    type=click.Path(exists=True, file_okay=False),
    default=None,
    help="Continue the interrupted run in this directory (its config.yaml and "
    "checkpoint); nothing trained twice, nothing lost.",
)
@click.option("--policy", default=None, help="Override the policy, e.g. 'static:cells=1'.")
@click.option("--address", default=None, help="Join an existing Ray cluster at this address.")
@click.option(
    "--bursts",
    type=click.IntRange(min=1),
    default=None,
    help="Override control.bursts (e.g. 1 for a short calibration run).",
)
@click.option(
    "--set",
    "sets",
    multiple=True,
    metavar="KEY=VALUE",
    help="Override one config value (a YAML scalar), e.g. "
    "'--set runtime.cell_cpus=0.5'; repeatable.",
)
@click.option(
    "--emulate",
    "emulate",
    default=None,
    metavar="SCENARIO",
    help="Run a simulator scenario with emulated engines and trainer (a test double at "
    "scale: no model runs; docs/emulate.md) instead of CONFIG.",
)
@click.option(
    "--k",
    "k",
    type=click.FloatRange(min=0.0, min_open=True),
    default=10.0,
    show_default=True,
    help="With --emulate: the time scale; every emulated duration is divided by k.",
)
def command(
    config: str | None,
    out: str | None,
    resume: str | None,
    policy: str | None,
    address: str | None,
    bursts: int | None,
    sets: tuple[str, ...],
    emulate: str | None = None,
    k: float = 10.0,
) -> None:
    import json
    from pathlib import Path

    from rich.console import Console

    from tidal.errors import ConfigError
    from tidal.logcount import counting_warnings

    if resume is not None:
        if (
            config is not None
            or out is not None
            or policy is not None
            or bursts is not None
            or sets
        ):
            raise ConfigError(
                "--resume",
                "takes the run directory only (its config.yaml "
                "holds the config, policy and output place)",
            )
        if not (Path(resume) / "config.yaml").is_file():
            raise ConfigError("--resume", f"{resume} is not a run directory (no config.yaml)")
        config, out = str(Path(resume) / "config.yaml"), resume
    elif emulate is not None:
        if config is not None:
            raise ConfigError("--emulate", "takes a scenario instead of a run config, not both")
        config = _emulated_config_file(emulate, k, policy)
        policy = None  # in the file, with the scenario's arguments for it
    elif config is None:
        raise ConfigError("config", "give a run config (e.g. configs/tiny.yaml) or --resume DIR")
    cfg, built = checked_run(config, policy, address, bursts, sets)

    def show(line: dict) -> None:
        r = line["mean_reward"]  # any finite reward (1e308 in 4 significant digits)
        click.echo(
            f"burst {line['burst']} step {line['step']:3d} v{line['version']:<3d} "
            f"reward {f'{r:.3f}' if abs(r) < 1e6 else f'{r:.4g}'} loss {line['loss']:+.4f} "
            f"w {line['waterlevel']:3d} roles {' '.join(line['roles'])}"
        )

    console = Console()
    run_dir = Path(out or f"runs/{cfg.name}")
    from tidal.runtime.spill import stale_line

    if (stale := stale_line()) is not None:  # the machine's, not this run's: not counted
        click.echo(f"tidal: warning: {stale}", err=True)
    from tidal.viz.run_report import write_report

    with counting_warnings() as counter:  # the run ends with one line naming each warning
        summary, written = _run(
            cfg,
            built,
            run_dir,
            console,
            resume is not None,
            show,
            counter,
            lambda: write_report(run_dir),
        )
    keys = (
        "policy",
        "run_time_s",
        "trainer_steps",
        "switches_to_training",
        "switches_to_rollout",
        "rerouted_requests",
        "failed_requests",
        "lost_executions",
        "satellite_joins",
    )
    click.echo(json.dumps({k: summary[k] for k in keys}))
    click.echo(counter.line())
    click.echo(
        f"report: {run_dir / 'report.md'} ({len(written)} files; trace.json opens in "
        f"https://ui.perfetto.dev)"
    )


def _run(
    cfg: Any,
    policy: Any,
    run_dir: Any,
    console: Any,
    resume: bool,
    show: Any,
    counter: Any,
    report: Any,
) -> tuple[dict, Any]:
    """The run, then ``report()``, with a live panel in a terminal (percentage, elapsed, ETA;
    its last frame the final state), or when piped its step lines and a heartbeat at least every
    10 s of silence (the report's plots included); Ctrl-C (or SIGTERM) ends it with the warnings
    line and the resume command. Out: the summary and what ``report()`` returned."""
    from tidal.control.carry_over import budget_groups
    from tidal.runtime.driver import Runtime
    from tidal.viz.progress import Heartbeat, RunProgress

    c = cfg.control
    # a staleness budget dispatches its slack once more (tidal.control.carry_over)
    slack = budget_groups(c.batch_groups, c.updates_per_burst, c.staleness) * c.group_size
    slack = max(0, slack - c.batch_groups * c.updates_per_burst * c.group_size)
    progress = RunProgress(
        (c.bursts or 0) * c.updates_per_burst, (c.bursts or 0) * c.quota_executions + slack
    )
    try:
        if console.is_terminal:
            from rich.live import Live

            with Live(console=console, refresh_per_second=2, get_renderable=progress.panel) as live:
                summary = Runtime(
                    cfg,
                    run_dir,
                    resume=resume,
                    on_state=progress.on_state,
                    on_step=progress.on_step,
                    policy=policy,
                ).run()
                progress.finish(summary)
                live.refresh()
                return summary, report()
        beat = Heartbeat(progress, click.echo).start()

        def step(line: dict) -> None:
            progress.on_step(line)
            show(line)
            beat.printed()

        try:
            summary = Runtime(
                cfg, run_dir, on_step=step, on_state=progress.on_state, resume=resume, policy=policy
            ).run()
            progress.finish(summary)
            click.echo(progress.line())
            beat.printed()
            return summary, report()
        finally:
            beat.stop()
    except KeyboardInterrupt:
        click.echo(counter.line(), err=True)
        from tidal.runtime.checkpoint import how_to_continue

        click.echo(
            f"tidal: run interrupted; its parts are stopped. {how_to_continue(run_dir)}", err=True
        )
        raise SystemExit(130) from None


def _emulated_config_file(scenario: str, k: float, policy: str | None) -> str:
    """The run config of ``tidal run --emulate`` written to a file of its own (the run's
    ``config.yaml`` holds it again, resolved)."""
    import tempfile

    import yaml

    from tidal.runtime.emulated_run import emulated_config

    data = emulated_config(scenario, k, policy)
    with tempfile.NamedTemporaryFile(
        "w", prefix=f"tidal-{data['name']}-", suffix=".yaml", delete=False
    ) as f:
        f.write(yaml.safe_dump(data, sort_keys=False))
    return f.name


def build_config(
    config: str,
    policy: str | None = None,
    address: str | None = None,
    bursts: int | None = None,
    sets: tuple[str, ...] = (),
) -> RunConfig:
    """The ``RunConfig`` a ``tidal run`` command line asks for: the file, then ``--policy``,
    ``--address``, ``--bursts`` and each ``--set``, validated together (so ``--set
    policy.module=...`` loads the module that registers the ``--policy`` named). What only the
    control plane knows (the policy's module, name and arguments, the admission rule) is
    ``checked_run``'s. Any bad value is a one-line ``ConfigError``."""
    from tidal.config import RunConfig, load_yaml, validate_model
    from tidal.specs import parse_policy_spec

    data = load_yaml(config).model_dump(mode="json")
    if policy is not None:
        name, args = parse_policy_spec(policy)
        data["policy"] = {"name": name, "args": args, "module": data["policy"].get("module")}
    if address is not None:
        data["runtime"]["ray_address"] = address
    if bursts is not None:
        data["control"]["bursts"] = bursts
    for item in sets:
        apply_set(data, item)
    return validate_model(RunConfig, data)


def checked_run(
    config: str,
    policy: str | None = None,
    address: str | None = None,
    bursts: int | None = None,
    sets: tuple[str, ...] = (),
) -> tuple[RunConfig, Any]:
    """``build_config``'s config and its policy (``checked_policy``: the config checked against
    the control plane once, the policy built once; the run hands it to its controller). An
    error in a value the command line left alone names the file, as ``load_yaml``'s do."""
    from tidal.control.factory import checked_policy

    cfg = build_config(config, policy, address, bursts, sets)
    touched = policy is not None or any(
        s.partition("=")[0].strip().startswith(("policy.", "control.")) for s in sets
    )
    return cfg, checked_policy(cfg, source=None if touched else config)


def apply_set(data: dict, item: str) -> None:
    """``--set a.b.c=VALUE``: VALUE parsed as a YAML scalar into ``data['a']['b']['c']``; an
    unknown section or a malformed item is a ``ConfigError`` (unknown fields are rejected when
    the config is validated)."""
    import yaml

    from tidal.errors import ConfigError

    key, sep, raw = item.partition("=")
    parts = key.strip().split(".")
    if not sep or not all(parts):
        raise ConfigError("--set", f"{item!r}: expected KEY=VALUE, e.g. runtime.cell_cpus=0.5")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        raise ConfigError("--set", f"{item!r}: the value is not a YAML scalar") from None
    if isinstance(value, dict | list):
        raise ConfigError("--set", f"{item!r}: give one scalar value")
    node = data
    for i, part in enumerate(parts[:-1]):
        if not isinstance(node.get(part), dict):
            where = ".".join(parts[: i + 1])
            raise ConfigError("--set", f"{item!r}: {where} is not a config section")
        node = node[part]
    node[parts[-1]] = value
