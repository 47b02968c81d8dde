"""Issue 38 item (16): the memory sampler outlives the processes it samples. A child that exits
while it is being read (``psutil.NoSuchProcess`` between its memory and its parent, as a command
agent's short-lived children do) is skipped, and the thread goes on sampling (on main it died
with the traceback and sampled nothing after)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil

from tidal.runtime.footprint import MemorySampler


def test_a_child_gone_mid_sample_does_not_stop_the_sampler(monkeypatch):
    root = os.getpid()
    real_ppid = psutil.Process.ppid

    def exited(self):  # every child "exits" between its memory read and its parent read
        if self.pid != root:
            raise psutil.NoSuchProcess(self.pid)
        return real_ppid(self)

    monkeypatch.setattr(psutil.Process, "ppid", exited)
    sampler = MemorySampler(root, interval_s=0.05)  # before the child: the child is the run's
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        sampler.start()
        deadline = time.monotonic() + 10
        while sampler.samples < 5 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sampler._thread.is_alive() and sampler.samples >= 5
        assert child.pid not in sampler.peak_mb  # skipped while it could not be read
        monkeypatch.undo()  # the child readable again: the next samples see it
        time.sleep(0.3)
        memory = sampler.stop()
    finally:
        child.kill()
        child.wait()
    assert sampler.errors == 0 and child.pid in sampler.peak_mb
    assert memory["samples"] >= 6 and "driver" in memory["processes_mb"]


def test_short_lived_children_in_a_loop(tmp_path):
    """The real race: a shell starting a child every few milliseconds, sampled every 50 ms."""
    sampler = MemorySampler(os.getpid(), interval_s=0.05)
    churn = subprocess.Popen(["sh", "-c", "while true; do /bin/true; done"])
    try:
        sampler.start()
        time.sleep(1.5)
        assert sampler._thread.is_alive()
        memory = sampler.stop()
    finally:
        churn.kill()
        churn.wait()
    assert sampler.errors == 0 and memory["samples"] >= 10


def test_processes_from_before_the_run_are_not_its_own():
    """A process the root already had (an earlier run's part still ending in the same process,
    as in the test suite) is neither sampled nor counted as started: the footprint is the run's
    own (CI 2026-12-06: an earlier run's proxy counted ``processes_started: {"proxy": 2}``)."""
    old = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        sampler = MemorySampler(os.getpid(), interval_s=0.05)
        new = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        try:
            sampler.sample()
        finally:
            new.kill()
            new.wait()
    finally:
        old.kill()
        old.wait()
    assert old.pid not in sampler.peak_mb and new.pid in sampler.peak_mb
