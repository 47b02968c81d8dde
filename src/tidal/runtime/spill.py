"""Where a run's engines put their weights while asleep, and that nothing of it stays behind.

In: a run directory. Out: ``spill_dir`` (``DIR/spill``: a built-in engine's level-1 sleep writes
``tidal-spill-<served model>-<pid>.safetensors`` there, ``serving.engine_config.spill_path``),
``remove`` (the directory deleted: when a run's parts stop, at ``--resume`` and by the sweep of
the other nodes, so an engine killed while asleep leaves no copy of the model), and ``stale_in_tmp``
(spill files that older tidal versions wrote to the system's temporary directory, which
``tidal run`` prints a warning about, naming the command that removes them). Invariant: tidal
writes no spill file outside a run directory.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

SPILL_GLOB = "tidal-spill-*"


def spill_dir(run_dir: str | Path) -> Path:
    """The run's spill directory (made by the first engine that sleeps)."""
    return Path(run_dir) / "spill"


def _size(paths: list[Path]) -> int:
    total = 0
    for p in paths:
        try:
            total += p.stat().st_size
        except OSError:  # gone meanwhile
            continue
    return total


def remove(run_dir: str | Path) -> int:
    """Delete the run's spill directory; returns the bytes it held."""
    where = spill_dir(run_dir)
    freed = _size([p for p in where.glob("*") if p.is_file()]) if where.is_dir() else 0
    shutil.rmtree(where, ignore_errors=True)
    return freed


def stale_in_tmp(tmp: str | Path | None = None) -> list[Path]:
    """Spill files in the system's temporary directory (tidal writes none there any more)."""
    root = Path(tmp or tempfile.gettempdir())
    return sorted(p for p in root.glob(SPILL_GLOB) if p.is_file())


def stale_line(tmp: str | Path | None = None) -> str | None:
    """One line naming the stale spill files of older runs and how to remove them (None:
    there are none). ``tidal run`` prints it: it is about the machine, not about the run."""
    stale = stale_in_tmp(tmp)
    if not stale:
        return None
    return (
        f"{len(stale)} stale engine spill files ({_size(stale) / 1e6:.0f} MB of model "
        f"weights) of older tidal runs in {stale[0].parent}; nothing uses them: remove "
        f"them with 'rm {stale[0].parent / SPILL_GLOB}'"
    )
