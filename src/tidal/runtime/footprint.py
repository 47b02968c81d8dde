"""Memory footprint of a run: peak resident memory per process and the machine's peak.

In: the root process of a run (the driver: Ray's GCS and raylet, the cell actors, their engines
and satellites, the proxy all descend from it on a local cluster) and a sampling interval. Out:
``MemorySampler.summary()`` for ``summary.json``'s ``memory``: per process (labelled by what it
runs) its peak RSS in MB, the sum of the per-process peaks by kind, and the machine's used
memory at the start (baseline) and its peak. Samples are taken by one daemon thread, every
``interval_s`` (bounded: 0.05-10 s); ``stop`` ends it within one interval. A process that exits
while it is being sampled (a command agent's short-lived child) is skipped or keeps the label it
could get; no error ends the thread (the first is logged, the sampling goes on).
Processes of other nodes of a Ray cluster are not seen (their node's memory is theirs).
"""

from __future__ import annotations

import logging
import re
import threading
from typing import Any

import psutil

log = logging.getLogger(__name__)
_MB = 1024 * 1024
_RAY_DAEMONS = (
    "gcs_server",
    "raylet",
    "dashboard",
    "log_monitor",
    "monitor.py",
    "runtime_env",
    "default_worker",
    "agent",
)


def label(proc: psutil.Process, root_pid: int) -> str:
    """What a process of the run is, from its command line (stable across its life)."""
    if proc.pid == root_pid:
        return "driver"
    try:
        cmd = proc.cmdline()
    except psutil.Error:
        return f"pid{proc.pid}"
    text = " ".join(cmd)
    if "tidal.training.satellite" in text:
        m = re.search(r'"cell":\s*(\d+)', text)
        return f"satellite-c{m.group(1) if m else '?'}"
    if "tidal.training.cell_ranks" in text or "tidal.training.sharded" in text:
        return f"cell-rank-{proc.pid}"
    if "tidal.cli" in cmd or "tidal.cli" in text:
        if "proxy" in cmd:
            return "proxy"
        if "engine" in cmd:
            return f"engine-{proc.pid}"  # the driver names it by its id (``rename``)
        return f"tidal-{proc.pid}"
    if text.startswith("ray::") or "default_worker.py" in text:
        return f"ray-worker-{proc.pid}"
    for d in _RAY_DAEMONS:
        if d in text:
            return f"ray-{d.removesuffix('.py')}-{proc.pid}"
    try:
        return f"{proc.name()}-{proc.pid}"
    except psutil.Error:  # it exited between the two reads
        return f"pid{proc.pid}"


def kind(name: str) -> str:
    """The group a label belongs to in the totals: driver, proxy, engine, satellite, ray."""
    for k in ("driver", "proxy", "engine", "satellite"):
        if name.startswith(k):
            return k
    return "ray" if name.startswith("ray") else "other"


class MemorySampler:
    def __init__(self, root_pid: int, interval_s: float = 0.5) -> None:
        self.root = psutil.Process(root_pid)
        # processes the root had before the run (an earlier run's parts still ending, in the
        # same process: tests) are not this run's
        try:
            self.before = {p.pid for p in self.root.children(recursive=True)}
        except psutil.Error:
            self.before = set()
        self.interval_s = min(max(interval_s, 0.05), 10.0)
        self.peak_mb: dict[int, float] = {}
        self.labels: dict[int, str] = {}
        self.parent: dict[int, int] = {}
        self.baseline_mb = psutil.virtual_memory().used / _MB
        self.machine_peak_mb = self.baseline_mb
        self.samples = 0
        self.errors = 0  # samples an unexpected error cut short (the first is logged)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="memory-sampler", daemon=True)

    def start(self) -> MemorySampler:
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.sample()
            except Exception:  # a sampler that dies samples nothing after: never end the loop
                self.errors += 1
                if self.errors == 1:
                    log.exception("memory sampler: a sample failed (sampling goes on)")
            self._stop.wait(self.interval_s)

    def sample(self) -> None:
        try:
            procs = [self.root, *self.root.children(recursive=True)]
        except psutil.Error:
            procs = []
        for p in procs:
            if p.pid in self.before:
                continue
            try:
                rss = p.memory_info().rss / _MB
                if p.pid not in self.labels:
                    self.parent[p.pid] = p.ppid()
                    self.labels[p.pid] = label(p, self.root.pid)
            except psutil.Error:  # gone (NoSuchProcess) or closed to us (AccessDenied)
                continue
            self.peak_mb[p.pid] = max(self.peak_mb.get(p.pid, 0.0), rss)
        self.machine_peak_mb = max(self.machine_peak_mb, psutil.virtual_memory().used / _MB)
        self.samples += 1

    def rename(self, names: dict[int, str]) -> None:
        """Name processes the run knows by pid (an engine by its id: ``engine-c1``)."""
        self.labels.update(names)

    def _names(self) -> dict[int, str]:
        """The labels, a Ray worker that hosts an engine named for it (``actor-c1``)."""
        out = dict(self.labels)
        for pid, name in self.labels.items():
            ppid = self.parent.get(pid)
            if name.startswith("engine-") and out.get(ppid, "").startswith("ray-worker"):
                out[ppid] = "ray-actor-" + name.removeprefix("engine-")
        return out

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(self.interval_s + 5.0)
        self.sample()
        return self.summary()

    def summary(self) -> dict[str, Any]:
        """``{"processes": {label: peak_mb}, "by_kind_mb": ..., "machine_*_mb": ...}``; a label
        that several processes shared in turn (a restarted satellite) keeps the largest peak
        and counts the processes (``restarts``)."""
        per: dict[str, float] = {}
        count: dict[str, int] = {}
        names = self._names()
        for pid, mb in self.peak_mb.items():
            name = names[pid]
            per[name] = max(per.get(name, 0.0), mb)
            count[name] = count.get(name, 0) + 1
        by_kind: dict[str, float] = {}
        for name, mb in per.items():
            by_kind[kind(name)] = by_kind.get(kind(name), 0.0) + mb
        return {
            "interval_s": self.interval_s,
            "samples": self.samples,
            "processes_mb": {k: round(v, 1) for k, v in sorted(per.items())},
            "processes_started": {k: n for k, n in sorted(count.items()) if n > 1},
            "by_kind_mb": {k: round(v, 1) for k, v in sorted(by_kind.items())},
            "machine_baseline_mb": round(self.baseline_mb, 1),
            "machine_peak_mb": round(self.machine_peak_mb, 1),
            "machine_over_baseline_mb": round(self.machine_peak_mb - self.baseline_mb, 1),
        }


def table(memory: dict[str, Any]) -> str:
    """The ``memory`` summary as aligned text lines (largest process first)."""
    rows = sorted(memory["processes_mb"].items(), key=lambda kv: -kv[1])
    width = max([len(k) for k, _ in rows] + [20])
    lines = [f"{'process':<{width}}  peak RSS MB"]
    lines += [f"{k:<{width}}  {v:>10.1f}" for k, v in rows]
    lines.append("")
    lines += [f"{'all ' + k:<{width}}  {v:>10.1f}" for k, v in memory["by_kind_mb"].items()]
    lines.append(f"{'machine baseline':<{width}}  {memory['machine_baseline_mb']:>10.1f}")
    lines.append(f"{'machine peak':<{width}}  {memory['machine_peak_mb']:>10.1f}")
    lines.append(f"{'peak over baseline':<{width}}  {memory['machine_over_baseline_mb']:>10.1f}")
    return "\n".join(lines)
