"""A SIGKILLed server's anonymous shared memory (``/dev/shm/psm_*``, what vLLM on the CPU keeps
its KV cache in) is found through its process group's mappings and removed once the group is
gone; a live group's segments and another program's are never touched."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from multiprocessing import shared_memory
from pathlib import Path

from tidal.runtime import shm_segments

# a server that maps a segment of its own and never unlinks it (as one SIGKILLed mid-run)
SERVER = ("import mmap, os, sys, time\n"
          "path = f'/dev/shm/psm_tidaltest{os.getpid()}'\n"
          "fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)\n"
          "os.ftruncate(fd, 1 << 20)\n"
          "buf = mmap.mmap(fd, 1 << 20)\n"
          "print(path, flush=True)\n"
          "time.sleep(60)\n")


def test_a_killed_groups_segments_are_removed_and_no_others():
    other = shared_memory.SharedMemory(create=True, size=4096)  # another program's
    proc = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        path = proc.stdout.readline().strip()
        deadline = time.monotonic() + 10
        seen: set[str] = set()
        while path not in seen and time.monotonic() < deadline:
            seen = shm_segments.mapped_by_group(proc.pid)
        assert seen == {path}, seen  # only the group's own
        assert shm_segments.remove(seen, proc.pid) == 0 and Path(path).exists()  # still alive
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        assert Path(path).exists()  # what a SIGKILL leaves behind
        assert shm_segments.remove(seen, proc.pid) == 1
        assert not Path(path).exists()
        assert Path(f"/dev/shm/{other.name.lstrip('/')}").exists()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        other.close()
        other.unlink()
