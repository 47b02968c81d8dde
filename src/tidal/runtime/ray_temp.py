"""Where a one-machine run's Ray keeps its session (sockets, logs, spilled objects), and its end.

Ray's default is ``/tmp/ray/session_<time>_<pid>``, a folder it makes world-writable (mode 777)
and never removes: every run left one behind, open to any local user. A run that starts its own
Ray instead gives it ``/tmp/tidal-ray-<random>/ray``: Ray makes that folder world-writable too,
but the one around it is this user's alone (mode 700), so no other user reaches anything in it.
It is short on purpose: the sockets' paths inside must stay under the 107 bytes of a Unix
socket path, which a run directory of any depth cannot promise. At the run's end Ray's logs move
into ``DIR/logs/ray`` and the folder is removed. A killed run (SIGKILL) cannot do that: its folder
is named in ``DIR/logs/ray-temp`` and ``--resume`` ends it the same way (``sweep``). A cluster
joined with ``--address`` keeps its own (``tidal cluster``).

In: the run directory. Out: the folder for ``ray.init(_temp_dir=...)`` (``make``, ``for_ray``),
and its end
(``finish``: logs kept in the run directory, nothing left in ``/tmp``).
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)
PREFIX = "tidal-ray-"


MARK = "ray-temp"  # in DIR/logs: the folder of the run's Ray, for a resume to sweep


def make(run_dir: Path) -> Path:
    """A new folder only this user can enter (mode 700); Ray's goes inside (``for_ray``).
    Its path is noted in ``run_dir/logs`` until ``finish``."""
    private = Path(tempfile.mkdtemp(prefix=PREFIX))
    (run_dir / "logs" / MARK).write_text(str(private))
    return private


def sweep(run_dir: Path) -> None:
    """The folder a killed incarnation of this run left (``--resume``, after its processes
    are ended): its logs kept, the folder removed."""
    mark = run_dir / "logs" / MARK
    try:
        private = Path(mark.read_text().strip())
    except OSError:
        return
    if private.name.startswith(PREFIX) and private.parent == Path(tempfile.gettempdir()):
        finish(private, run_dir)
    mark.unlink(missing_ok=True)


def for_ray(private: Path) -> Path:
    """The folder for ``ray.init(_temp_dir=...)`` inside ``private`` (Ray makes it mode 777)."""
    return private / "ray"


def finish(private: Path, run_dir: Path) -> None:
    """Ray's logs in ``private`` moved into ``run_dir/logs/ray``, then ``private`` removed
    (after ``ray.shutdown``: nothing of Ray writes there any more)."""
    dest = run_dir / "logs" / "ray"
    for logs in sorted(for_ray(private).glob("session_*/logs")):
        if logs.is_dir() and not logs.is_symlink():
            with contextlib.suppress(OSError):
                dest.mkdir(parents=True, exist_ok=True)
                shutil.move(str(logs), str(dest / logs.parent.name))
    shutil.rmtree(private, ignore_errors=True)
    if private.exists():
        log.warning("Ray's session folder %s could not be removed", private)
    else:
        (run_dir / "logs" / MARK).unlink(missing_ok=True)
