"""Cells and standalone engines: who serves rollout, who trains, and in which order.

In: the cluster layout (ordered cells, standalone engines) and role changes from transition
plans. Out: rollout capacity (slots), the training prefix, the next cell to move.

Invariant 2 (DESIGN.md): the training side (cells in TRAINING or a MOVING state) is always a
prefix of the cell order; ``set_role`` refuses any change that would break it. Standalone
engines never move; their capacity changes only when engines join or leave.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from tidal.errors import InvariantViolation
from tidal.types import CellIndex, CellKind, EngineId, Role


def training_prefix(roles: Iterable[Role]) -> int:
    """How many leading roles are on the training side (TRAINING or MOVING)."""
    n = 0
    for role in roles:
        if not role.training_side:
            break
        n += 1
    return n


@dataclass
class Cell:
    index: CellIndex
    slots: int
    gpus: int = 1
    kind: CellKind = CellKind.ELASTIC
    role: Role = Role.ROLLOUT

    @property
    def name(self) -> str:
        return "core" if self.index == 0 else f"sat{self.index}"

    @property
    def home(self) -> Role:
        return Role.TRAINING if self.kind is CellKind.HYBRID else Role.ROLLOUT


@dataclass
class Standalone:
    engine_id: EngineId
    slots: int
    gpus: int = 1


class CellSet:
    """The ordered cells (cell 0 = core) and the standalone pool."""

    def __init__(self, cells: list[Cell], standalone: list[Standalone] | None = None) -> None:
        if not cells and not standalone:
            raise InvariantViolation("a cluster needs at least one cell or standalone engine")
        for i, c in enumerate(cells):
            if c.index != i:
                raise InvariantViolation(f"cell at position {i} has index {c.index}")
        self.cells = cells
        self.standalone: dict[EngineId, Standalone] = {s.engine_id: s for s in standalone or []}
        self._cache: dict[str, object] = {}
        self.check_prefix()

    # ---------------------------------------------------------------- queries
    # Derived values are cached: the controller asks for them after every event, and roles
    # change only through set_role / reset_roles / set_standalone, which clear the cache.
    def _cached(self, key: str, compute):  # type: ignore[no-untyped-def]
        val = self._cache.get(key)
        if val is None:
            val = self._cache[key] = compute()
        return val

    @property
    def prefix_len(self) -> int:
        """Number of cells on the training side (they form a prefix)."""
        return self._cached("prefix", lambda: training_prefix(c.role for c in self.cells))

    def training_cells(self) -> list[Cell]:
        return [c for c in self.cells if c.role is Role.TRAINING]

    def rollout_cells(self) -> list[Cell]:
        return [c for c in self.cells if c.role is Role.ROLLOUT]

    def moving(self) -> list[Cell]:
        return [
            c for c in self.cells if c.role in (Role.MOVING_TO_TRAINING, Role.MOVING_TO_ROLLOUT)
        ]

    @property
    def standalone_slots(self) -> int:
        return self._cached("sa_slots", lambda: sum(s.slots for s in self.standalone.values()))

    @property
    def standalone_gpus(self) -> int:
        return self._cached("sa_gpus", lambda: sum(s.gpus for s in self.standalone.values()))

    @property
    def rollout_capacity(self) -> int:
        """Slots admitting work now: rollout cells plus standalone engines."""
        return self._cached(
            "capacity", lambda: sum(c.slots for c in self.rollout_cells()) + self.standalone_slots
        )

    @property
    def training_gpus(self) -> int:
        return sum(c.gpus for c in self.training_cells())

    @property
    def total_gpus(self) -> int:
        return sum(c.gpus for c in self.cells) + sum(s.gpus for s in self.standalone.values())

    def destination_order(self, source: CellIndex | None = None) -> list[str]:
        """Where rerouted requests go: standalone engines first, then rollout cells in
        descending cell order (those stay in rollout longest). Names are engine ids / cell
        names."""
        order = list(self.standalone)
        order += [
            c.name
            for c in sorted(self.rollout_cells(), key=lambda c: -c.index)
            if c.index != source
        ]
        return order

    def roles(self) -> tuple[Role, ...]:
        return self._cached("roles", lambda: tuple(c.role for c in self.cells))

    # -------------------------------------------------------------- mutation
    def set_role(self, index: CellIndex, role: Role) -> None:
        old = self.cells[index].role
        self.cells[index].role = role
        self._cache.clear()
        try:
            self.check_prefix()
        except InvariantViolation:
            self.cells[index].role = old
            self._cache.clear()
            raise

    def reset_roles(self, training_prefix: int) -> None:
        """The first ``training_prefix`` cells train, the rest serve rollout."""
        if not 0 <= training_prefix <= len(self.cells):
            raise InvariantViolation(
                f"training prefix {training_prefix} outside 0..{len(self.cells)}"
            )
        for c in self.cells:
            c.role = Role.TRAINING if c.index < training_prefix else Role.ROLLOUT
        self._cache.clear()

    def set_standalone(self, engine_id: EngineId, slots: int, gpus: int = 1) -> None:
        self._cache.clear()
        if slots <= 0:
            self.standalone.pop(engine_id, None)
        else:
            self.standalone[engine_id] = Standalone(engine_id, slots, gpus)

    def check_prefix(self) -> None:
        self._cache.clear()
        n = self.prefix_len
        for c in self.cells[n:]:
            if c.role.training_side:
                raise InvariantViolation(
                    f"training set is not a prefix of the cell order: roles {self.describe()}"
                )

    def describe(self) -> str:
        short = {
            Role.ROLLOUT: "R",
            Role.TRAINING: "T",
            Role.MOVING_TO_TRAINING: ">T",
            Role.MOVING_TO_ROLLOUT: ">R",
        }
        return " ".join(f"{c.name}:{short[c.role]}" for c in self.cells)
