"""Cells that own their compute on a CPU host: each cell and standalone engine is held to
``runtime.cell_cpus`` cores by a Linux cgroup CPU bandwidth limit (CFS quota).

Why: on a GPU cluster a cell is its GPUs; whatever role it has, its compute is its own, and a
fixed split leaves one side's GPUs idle. On a shared CPU host every process can use every core,
so an idle "training cell" simply hands its cores to the engines and a static split wastes
nothing. With a quota per cell, a cell's processes (its engine, its satellite trainer, and for
cell 0 the core trainer's thread in the driver) can never use more than ``cell_cpus`` cores
together, idle or not: the host behaves like a cluster of small devices, and elastic role
changes have something to gain. The driver, proxy and harness pool stay outside every group
(they are the cluster's host CPUs).

In: the number of cores per group and the group names. Out: one cgroup
directory per name (``join_process`` / ``join_thread`` move a process or one thread into it),
their throttling counters (``stats``) and their removal. Pure OS code, no Ray.

Supported: cgroup v1 with the ``cpu`` controller mounted and writable (root, or a delegated
hierarchy), e.g. Docker hosts with cgroup v1. Not supported: cgroup v2 (moving a single thread,
the core trainer's, needs a threaded subtree that a process-holding cgroup cannot have); any
unsupported host gets ``CpuQuotaError`` with one line that says why."""

from __future__ import annotations

import contextlib
import errno
import os
import time
from pathlib import Path

from tidal.errors import TidalError

PERIOD_US = 20_000  # a short period: throttled groups interleave finely (no 100 ms stalls)


class CpuQuotaError(TidalError):
    """runtime.cell_cpus cannot be enforced on this host."""


def _cpu_mount(mountinfo: str) -> tuple[Path, str] | None:
    """The cgroup v1 mount that holds the ``cpu`` controller: (mount point, its root)."""
    for line in mountinfo.splitlines():
        pre, _, post = line.partition(" - ")
        fields, tail = pre.split(), post.split()
        if len(fields) < 5 or len(tail) < 3 or tail[0] != "cgroup":
            continue
        if "cpu" in tail[2].split(","):
            return Path(fields[4]), fields[3]
    return None


def _own_cpu_path(proc_cgroup: str) -> str | None:
    """This process's cgroup in the hierarchy of the ``cpu`` controller (v1)."""
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3 and "cpu" in parts[1].split(","):
            return parts[2]
    return None


def cpu_cgroup_base() -> Path:
    """The directory of this process's own cpu cgroup, or ``CpuQuotaError`` saying why not."""
    try:
        mountinfo = Path("/proc/self/mountinfo").read_text()
        own = Path("/proc/self/cgroup").read_text()
    except OSError as exc:
        raise CpuQuotaError(f"runtime.cell_cpus needs Linux cgroups ({exc.strerror})") from None
    mount = _cpu_mount(mountinfo)
    path = _own_cpu_path(own)
    if mount is None or path is None:
        v2 = any(" - cgroup2 " in line for line in mountinfo.splitlines())
        raise CpuQuotaError(
            "runtime.cell_cpus needs the cgroup v1 'cpu' controller; this host "
            + ("has cgroup v2 only (not supported)" if v2 else "has none")
        )
    mount_point, mount_root = mount
    rel = os.path.relpath(path, mount_root) if path.startswith(mount_root) else path
    base = (mount_point / rel.lstrip("/")).resolve() if rel not in (".", "/") else mount_point
    if not (base / "cpu.cfs_quota_us").is_file():
        raise CpuQuotaError(
            f"runtime.cell_cpus: {base} has no cpu.cfs_quota_us (CFS bandwidth "
            "control is not compiled into this kernel)"
        )
    if not os.access(base, os.W_OK):
        raise CpuQuotaError(
            f"runtime.cell_cpus: {base} is not writable (run as root or in a "
            "delegated cgroup, or drop runtime.cell_cpus)"
        )
    return base


def _write(path: Path, value: str) -> None:
    try:
        path.write_text(value)
    except OSError as exc:
        raise CpuQuotaError(f"writing {value!r} to {path}: {exc.strerror}") from None


def join_process(group: str, pid: int | None = None) -> None:
    """Move a whole process (all its threads; its future children follow) into ``group``."""
    _write(Path(group) / "cgroup.procs", str(pid or os.getpid()))


def join_thread(group: str, tid: int | None = None) -> None:
    """Move one thread (default: the calling one) into ``group``; threads it starts later
    (e.g. an OpenMP team) are born there."""
    import threading

    _write(Path(group) / "tasks", str(tid or threading.get_native_id()))


class CpuGroups:
    """One cgroup per name under ``<own cpu cgroup>/tidal-<pid>``, each limited to ``cpus``
    cores (quota = cpus x period). Create before the processes start; ``remove`` at the end."""

    def __init__(self, cpus: float, names: list[str], period_us: int = PERIOD_US) -> None:
        if cpus <= 0:
            raise CpuQuotaError(f"runtime.cell_cpus must be > 0, got {cpus}")
        self.base = cpu_cgroup_base()
        self.cpus, self.period_us = cpus, period_us
        self.quota_us = max(1000, round(cpus * period_us))  # the kernel's minimum is 1 ms
        _remove_stale(self.base)
        self.parent = self.base / f"tidal-{os.getpid()}"
        self.groups: dict[str, Path] = {}
        try:
            self.parent.mkdir(exist_ok=True)
            for name in names:
                g = self.parent / name
                g.mkdir(exist_ok=True)
                _write(g / "cpu.cfs_period_us", str(period_us))
                _write(g / "cpu.cfs_quota_us", str(self.quota_us))
                self.groups[name] = g
        except (OSError, CpuQuotaError) as exc:
            self.remove()
            if isinstance(exc, CpuQuotaError):
                raise
            raise CpuQuotaError(
                f"runtime.cell_cpus: cannot create cgroups under {self.base}: {exc.strerror}"
            ) from None

    def path(self, name: str) -> str:
        return str(self.groups[name])

    def stats(self) -> dict[str, dict[str, float]]:
        """Per group: periods, throttled periods and throttled seconds so far."""
        out: dict[str, dict[str, float]] = {}
        for name, g in self.groups.items():
            with contextlib.suppress(OSError):
                kv = dict(
                    line.split()
                    for line in (g / "cpu.stat").read_text().splitlines()
                    if len(line.split()) == 2
                )
                out[name] = {
                    "periods": int(kv.get("nr_periods", 0)),
                    "throttled_periods": int(kv.get("nr_throttled", 0)),
                    "throttled_s": round(int(kv.get("throttled_time", 0)) / 1e9, 3),
                }
        return out

    def remove(self, timeout_s: float = 10.0) -> list[str]:
        """Move what is left back to the base group and delete the groups; returns the names
        that could not be removed (still busy after ``timeout_s``)."""
        left: list[str] = []
        for name, g in list(self.groups.items()):
            if not _rmdir(g, self.base, timeout_s):
                left.append(name)
            else:
                del self.groups[name]
        if not left:
            _rmdir(self.parent, self.base, timeout_s)
        return left


def _rmdir(group: Path, base: Path, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(OSError):
            for tid in (group / "tasks").read_text().split():
                with contextlib.suppress(OSError):
                    (base / "tasks").write_text(tid)
        try:
            group.rmdir()
            return True
        except FileNotFoundError:
            return True
        except OSError as exc:
            if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                return False
        time.sleep(0.05)


def _remove_stale(base: Path) -> None:
    """Delete the empty groups of earlier runs whose process is gone (busy ones stay)."""
    for parent in base.glob("tidal-*"):
        pid = parent.name.removeprefix("tidal-")
        if not parent.is_dir() or (pid.isdigit() and Path(f"/proc/{pid}").exists()):
            continue
        for g in parent.iterdir():
            if g.is_dir():
                with contextlib.suppress(OSError):
                    g.rmdir()
        with contextlib.suppress(OSError):
            parent.rmdir()
