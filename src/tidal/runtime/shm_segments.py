"""The shared-memory segments a server's process group maps, so they can be removed after it.

vLLM on the CPU keeps its KV cache (and its message queues) in anonymous POSIX shared memory
(``/dev/shm/psm_*``, Python's ``SharedMemory``), which only the process that made a segment
unlinks, at a clean exit. A server tidal SIGKILLs, or one that crashes, leaves them behind:
~0.25 GB each, counted as used memory until the machine reboots (CI's vLLM tier piled up 5 GB
and Ray's memory monitor killed the next test's workers).

In: a process group id (the server's session, ``start_new_session``). Out: the ``psm_*`` paths
its processes map, read from ``/proc/<pid>/maps``; ``remove`` unlinks them once the group is
gone. Only segments seen mapped by that group are touched, never another program's, and never
tidal's own named segments (``tidal-*``, owned by their publisher).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

PREFIX = "/dev/shm/psm_"


def _group_pids(pgid: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # field 5 of /proc/<pid>/stat, after the parenthesised command name
            stat = (entry / "stat").read_text()
            if int(stat[stat.rindex(")") + 2:].split()[2]) == pgid:
                pids.append(int(entry.name))
        except (OSError, ValueError, IndexError):  # the process ended meanwhile
            continue
    return pids


def mapped_by_group(pgid: int) -> set[str]:
    """The ``/dev/shm/psm_*`` segments the processes of group ``pgid`` map now."""
    found: set[str] = set()
    for pid in _group_pids(pgid):
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        for line in maps.splitlines():
            path = line.split(maxsplit=5)[-1] if line.count(" ") >= 5 else ""
            if path.startswith(PREFIX):
                found.add(path.removesuffix(" (deleted)"))
    return found


def remove(paths: set[str], pgid: int) -> int:
    """Unlink ``paths`` if no process of group ``pgid`` is left (else none: a live server
    still uses them). Returns how many were removed."""
    if not paths or _group_pids(pgid):
        return 0
    removed = 0
    for path in paths:
        try:
            os.unlink(path)
            removed += 1
        except FileNotFoundError:  # its owner unlinked it at a clean exit
            continue
        except OSError as exc:
            log.warning("could not remove shared memory %s: %s", path, exc)
    if removed:
        log.info("removed %d shared-memory segments left by process group %d", removed, pgid)
    return removed
