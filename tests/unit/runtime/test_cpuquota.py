"""CPU quotas per cell (``runtime.cell_cpus``): finding the cgroup v1 cpu controller, and on a
host where it is writable (root in a cgroup v1 container, as here) real groups that hold a busy
process and a busy thread to their share; ``tidal run --set`` parsing."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tidal.commands.run import apply_set
from tidal.errors import ConfigError
from tidal.runtime import cpuquota
from tidal.runtime.cpuquota import CpuGroups, CpuQuotaError, join_process, join_thread

MOUNTINFO_V1 = """\
25 30 0:22 / /sys/fs/cgroup rw,nosuid - tmpfs tmpfs rw,mode=755
31 25 0:27 / /sys/fs/cgroup/cpu,cpuacct rw,nosuid - cgroup cgroup rw,cpu,cpuacct
32 25 0:28 / /sys/fs/cgroup/memory rw,nosuid - cgroup cgroup rw,memory
"""
MOUNTINFO_V2 = "35 25 0:30 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"


def test_the_cpu_controller_is_found_in_mountinfo_and_proc_cgroup():
    assert cpuquota._cpu_mount(MOUNTINFO_V1) == (Path("/sys/fs/cgroup/cpu,cpuacct"), "/")
    assert cpuquota._cpu_mount(MOUNTINFO_V2) is None
    assert cpuquota._own_cpu_path("4:memory:/x\n3:cpu,cpuacct:/docker/abc\n") == "/docker/abc"
    assert cpuquota._own_cpu_path("0::/user.slice\n") is None


def test_a_cgroup_v2_host_gets_one_clear_error(monkeypatch):
    real = Path.read_text

    def fake(self, *a, **kw):
        if str(self) == "/proc/self/mountinfo":
            return MOUNTINFO_V2
        if str(self) == "/proc/self/cgroup":
            return "0::/user.slice\n"
        return real(self, *a, **kw)

    monkeypatch.setattr(Path, "read_text", fake)
    with pytest.raises(CpuQuotaError, match="cgroup v2 only"):
        cpuquota.cpu_cgroup_base()
    with pytest.raises(CpuQuotaError, match="must be > 0"):
        CpuGroups(0.0, ["a"])


def _writable() -> bool:
    try:
        cpuquota.cpu_cgroup_base()
        return True
    except CpuQuotaError:
        return False


needs_cgroups = pytest.mark.skipif(not _writable(), reason="no writable cgroup v1 cpu controller")

BUSY = (
    "import resource, time\nt = time.time()\nwhile time.time() - t < {s}: pass\n"
    "print(resource.getrusage(resource.RUSAGE_SELF).ru_utime)"
)


@needs_cgroups
def test_a_group_holds_a_busy_process_and_a_busy_thread_to_its_share():
    groups = CpuGroups(0.25, ["proc", "thread"])
    try:
        assert groups.parent.is_dir() and groups.quota_us == 5000
        wall = 1.5
        p = subprocess.Popen(
            [sys.executable, "-c", BUSY.format(s=wall)], stdout=subprocess.PIPE, text=True
        )
        join_process(groups.path("proc"), p.pid)
        out, _ = p.communicate(timeout=60)
        # a free busy loop uses ~1 core; held to 0.25 core (the interpreter's start-up ran
        # before the move, at full speed)
        assert float(out) < 0.25 * wall + 0.35, out
        used: dict[str, float] = {}

        def busy() -> None:
            join_thread(groups.path("thread"))
            c0, t0 = time.thread_time(), time.time()
            while time.time() - t0 < wall:
                pass
            used["cpu"] = time.thread_time() - c0

        th = threading.Thread(target=busy)
        th.start()
        th.join(60)
        assert used["cpu"] < 0.25 * wall + 0.1, used
        st = groups.stats()
        # throttled, not merely slow: how long depends on how much CPU the loaded host gave it
        assert st["proc"]["throttled_periods"] > 0 and st["thread"]["throttled_periods"] > 0, st
        assert (
            str(threading.get_native_id())
            not in (groups.groups["thread"] / "tasks").read_text().split()
        )
    finally:
        assert groups.remove() == []
    assert not groups.parent.exists()


@needs_cgroups
def test_groups_of_a_dead_run_are_removed_and_a_live_ones_kept(tmp_path):
    base = cpuquota.cpu_cgroup_base()
    dead = base / "tidal-999999999"  # no such process
    (dead / "c0").mkdir(parents=True)
    groups = CpuGroups(0.5, ["c0"])
    try:
        assert not dead.exists()
        assert groups.parent.exists()
    finally:
        groups.remove()


def test_set_overrides_one_value_and_rejects_bad_items():
    data = {"runtime": {"cell_cpus": None, "model": "tiny"}, "control": {"bursts": 2}}
    apply_set(data, "runtime.cell_cpus=0.5")
    apply_set(data, "control.bursts=3")
    apply_set(data, "runtime.model=smollm2-135m")
    assert data == {
        "runtime": {"cell_cpus": 0.5, "model": "smollm2-135m"},
        "control": {"bursts": 3},
    }
    apply_set(data, "runtime.cell_cpus=null")
    assert data["runtime"]["cell_cpus"] is None
    for bad, msg in (
        ("runtime.cell_cpus", "KEY=VALUE"),
        ("=1", "KEY=VALUE"),
        ("nope.x=1", "not a config section"),
        ("runtime.model=[1, 2]", "scalar"),
        ("runtime..x=1", "KEY=VALUE"),
    ):
        with pytest.raises(ConfigError, match=msg):
            apply_set(data, bad)


def test_tidal_check_says_whether_cell_cpus_can_be_enforced(capsys):
    from tidal.cli import main

    config = Path(__file__).resolve().parents[3] / "configs" / "quickstart.yaml"
    assert main(["check", str(config)]) == 0
    err = capsys.readouterr().err
    line = next(x for x in err.splitlines() if x.startswith("# runtime.cell_cpus"))
    assert ("can be enforced here" in line) == _writable(), line
