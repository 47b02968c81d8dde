"""Received-version directories (full weights in ``/dev/shm``) of engine hosts that are gone
are removed; a live host's are kept, and so is anything not shaped like one."""

from __future__ import annotations

import os
import subprocess
import sys

from tidal.runtime.cell import remove_orphan_received_dirs


def test_only_directories_of_ended_hosts_are_removed(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    dead = tmp_path / f"tidal-c1-{done.stdout.strip()}"  # its process has exited
    live = tmp_path / f"tidal-s0-{os.getpid()}"
    other = tmp_path / "tidal-vllm"  # a named shared-memory segment, not a host's directory
    for d in (dead, live):
        d.mkdir()
        (d / "v1.safetensors").write_bytes(b"x" * 16)
    other.write_bytes(b"x")
    assert remove_orphan_received_dirs(tmp_path) == 1
    assert not dead.exists() and live.exists() and other.exists()
