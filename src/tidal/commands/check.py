"""``tidal check CONFIG``: validate a run or scenario config, run every check ``tidal run`` makes
before it starts Ray (``runtime.preflight``: the model directory, the backends' venvs, the
machine's cores and GPUs, the sampling settings; a config with ``control.bursts``) and print it
resolved, then the
device torch sees here and where ``runtime.device`` puts the trainer and engines, and whether
per-cell CPU quotas (``runtime.cell_cpus``) can be enforced on this host (on stderr, so the YAML
on stdout stays clean)."""

from __future__ import annotations

import click


@click.command(
    help="Validate a config file (YAML); print the resolved config on success, and "
    "the device torch sees (stderr)."
)
@click.argument("config", type=click.Path(dir_okay=False))
@click.option("--quiet", "-q", is_flag=True, help="Print nothing on success.")
def command(config: str, quiet: bool) -> None:
    from tidal.agents.workload import check_workload
    from tidal.config import RunConfig, dump_yaml, load_yaml
    from tidal.control.factory import checked_policy

    cfg = load_yaml(config, RunConfig)
    policy = checked_policy(cfg, source=config)
    runnable = cfg.control.bursts is not None
    if runnable:  # every check `tidal run` makes before it starts Ray: one line naming a field
        from tidal.runtime.preflight import check_run

        # the task: section too: its rows load, its code imports
        workload = check_run(cfg, policy=policy).workload
    else:
        workload = check_workload(cfg)
    if quiet:
        return
    click.echo(dump_yaml(cfg), nl=False)
    rt = cfg.runtime
    click.echo(
        "# tidal run's checks (model, backends, machine): passed"
        if runnable
        else "# control.bursts unset: a simulator config; tidal run's checks skipped",
        err=True,
    )
    from tidal.runtime.cpuquota import CpuQuotaError, cpu_cgroup_base

    try:
        where = f"can be enforced here (cgroup v1 cpu at {cpu_cgroup_base()})"
    except CpuQuotaError as exc:
        where = f"cannot be enforced here: {exc}"
    rows = f"{len(workload.rows)} rows" if not workload.builtin else "a row from each group's seed"
    click.echo(
        f"# task: {rows} ({cfg.task.source.kind}), agent kind {cfg.task.agent.kind!r}", err=True
    )
    click.echo(f"# runtime.cell_cpus {rt.cell_cpus}: per-cell CPU quotas {where}", err=True)
    try:
        import torch

        from tidal.models.device import describe_devices
    except ImportError:  # a simulator-only install
        click.echo(f"# device: torch is not installed; runtime.device {rt.device}", err=True)
        return
    click.echo(
        f"# device: {describe_devices()}; runtime.device {rt.device} -> "
        f"{rt.resolved_device(torch.cuda.is_available())} here",
        err=True,
    )
