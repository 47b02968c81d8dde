"""The version hold of a deterministic run: whether dispatch may go on at a weight-version
boundary, and what holding there cost.

In: at each boundary (a burst about to be dispatched) the label of the version published last
(``v<n>``) and, per engine, whether it is in routing (admitting and alive at the proxy) and the
label it serves; the time of each look, from the run's clock. Out: the engines that still serve
another version (empty: dispatch may go), and the tally a run reports (``deterministic_hold_s``:
seconds from a boundary's first look to its release, summed; boundaries; boundaries that held).

Rule: at a boundary, dispatch (and so every model call: no call is in flight at a boundary, the
burst's final step trained every group of the burst) waits until every engine in routing serves
the published version. Why: a call answered by an engine that still serves the old version is
sampled from other logits, so the run's tokens would depend on which engine was quicker to
load. An engine out of routing (a cell asleep in training, a drained one) is not waited for:
the actuator loads the published version into it before it is routed again, and refuses it if
it serves another. Pure: no clock read (times come in), no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class EngineVersion:
    """One engine as a boundary sees it."""

    engine_id: str
    routed: bool  # admitting and alive at the proxy
    version: str | None  # the label it serves (None: unknown, e.g. its describe failed)


def unserved(published: str, engines: Iterable[EngineVersion]) -> list[str]:
    """Ids of the engines in routing that do not serve ``published``, sorted."""
    return sorted(e.engine_id for e in engines if e.routed and e.version != published)


@dataclass
class VersionHold:
    """The boundaries of one run: ``look`` at each poll, ``held_s`` and counts for the
    summary."""

    held_s: float = 0.0
    boundaries: int = 0
    held_boundaries: int = 0
    _open: tuple[str, float] | None = field(default=None, repr=False)  # (label, first look)

    def look(self, now_s: float, published: str, engines: Iterable[EngineVersion]) -> list[str]:
        """One poll at a boundary: the engines that still hold it (empty: released, and the
        boundary's waiting time is added to ``held_s``)."""
        if self._open is None or self._open[0] != published:
            self._open = (published, now_s)
            self.boundaries += 1
        waiting = unserved(published, engines)
        if not waiting:
            waited_s = now_s - self._open[1]
            self.held_s += waited_s
            self.held_boundaries += waited_s > 0
            self._open = None
        return waiting

    def report(self) -> dict[str, float | int]:
        return {
            "deterministic_hold_s": round(self.held_s, 3),
            "deterministic_boundaries": self.boundaries,
            "deterministic_held_boundaries": self.held_boundaries,
        }
