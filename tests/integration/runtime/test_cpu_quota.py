"""``tidal run configs/tiny.yaml --set runtime.cell_cpus=0.5``: every cell and standalone engine
gets its own CPU-quota cgroup; during the run each engine process is in its own group and the core
trainer's thread in cell 0's; the run trains everything, and afterwards no group is left."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from tidal.cli import main
from tidal.config import RunConfig, validate_model
from tidal.errors import ConfigError
from tidal.runtime import cpuquota
from tidal.runtime.driver import Runtime

from .test_tiny_run import CONFIG, expected_groups


def _group_of(proc_cgroup: Path) -> str:
    """The cpu cgroup path of a process or thread (from /proc/.../cgroup)."""
    for line in proc_cgroup.read_text().splitlines():
        _, ctrl, path = line.split(":", 2)
        if "cpu" in ctrl.split(","):
            return path
    return ""


def _writable() -> bool:
    try:
        cpuquota.cpu_cgroup_base()
        return True
    except cpuquota.CpuQuotaError:
        return False


@pytest.mark.skipif(not _writable(), reason="no writable cgroup v1 cpu controller")
def test_each_cell_runs_in_its_own_cpu_quota(tmp_path):
    cfg = yaml.safe_load(CONFIG.read_text())
    cfg["runtime"]["cell_cpus"] = 0.5
    runtime = Runtime(
        validate_model(RunConfig, cfg),
        tmp_path / "run",
        on_step=lambda line: seen.append(_membership(runtime)),
    )
    seen: list[dict[str, str]] = []
    summary = runtime.run()

    prefix = f"tidal-{os.getpid()}/"
    assert seen, "no step was reported"
    for step in seen:  # at every step: each engine in its group, the core thread in c0's
        for name, group in step.items():
            assert group.endswith(prefix + name.split(":")[0]), (name, group)
    assert "c0:core" in seen[0]
    assert summary["cell_cpus"] == 0.5
    assert set(summary["cpu_throttled_s"]) == {"s0", "c0", "c1"}
    assert summary["failed_requests"] == 0 and summary["lost_executions"] == 0
    metrics = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert sorted(g for m in metrics for g in m["groups"]) == expected_groups(cfg)
    assert not (cpuquota.cpu_cgroup_base() / prefix.rstrip("/")).exists()


def _membership(runtime: Runtime) -> dict[str, str]:
    out = {
        str(eid): _group_of(Path(f"/proc/{pid}/cgroup"))
        for eid, pid in runtime.engines.pids.items()
    }
    for cell, pid in runtime.wired.actuator.satellite_pids.items():
        if Path(f"/proc/{pid}").exists():
            out[f"c{cell}:satellite"] = _group_of(Path(f"/proc/{pid}/cgroup"))
    for th in runtime.core_pool._threads:  # the core trainer's one thread
        out["c0:core"] = _group_of(Path(f"/proc/self/task/{th.native_id}/cgroup"))
    return out


def test_cell_cpus_is_refused_where_it_cannot_hold(tmp_path, capsys):
    cfg = yaml.safe_load(CONFIG.read_text())
    for extra, why in (
        ({"ray_address": "127.0.0.1:1"}, "joins a Ray cluster"),
        ({"use_gpus": True}, "uses GPUs"),
    ):
        data = {**cfg, "runtime": {**cfg["runtime"], "cell_cpus": 0.5, **extra}}
        with pytest.raises(ConfigError, match=why):
            Runtime(validate_model(RunConfig, data), tmp_path / "run")
    assert (
        main(["run", str(CONFIG), "--set", "runtime.cell_cpus=0", "--out", str(tmp_path / "x")])
        != 0
    )
    assert "runtime.cell_cpus" in capsys.readouterr().err
