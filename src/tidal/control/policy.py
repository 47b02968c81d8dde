"""The policy protocol, what a policy sees and what it may answer, and the registry.

In: an ``Observation`` (a frozen snapshot the controller builds after every event).
Out: a ``Decision`` (hold, move cells to training, move cells to rollout) with a reason.

Policies are small objects with one decision method and bounded state; they never read a clock
or do I/O, so the simulator and production run the very same objects. The registry fails loudly
on unknown names, bad arguments and policies that declare no mechanics (``ConfigError`` naming
the field); a user's module registers with ``register_policy`` when ``tidal.plugins`` loads it
(``policy.module`` in a run config, ``policy_modules`` in a scenario, or a ``tidal.policies``
entry point).
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from tidal.control.cells import training_prefix
from tidal.control.mechanics import Mechanics
from tidal.control.supply import SupplyView
from tidal.errors import ConfigError, UnknownPolicyError
from tidal.specs import parse_policy_spec as parse_policy_spec  # re-exported (was here)
from tidal.types import CellIndex, CellKind, Role


class Action(enum.StrEnum):
    HOLD = "hold"
    TO_TRAINING = "to_training"
    TO_ROLLOUT = "to_rollout"


class PlanStyle(enum.StrEnum):
    """Which step sequence a move runs: QwenGyre's harness-preserving change or verl's
    activate / deactivate."""

    QWENGYRE = "qwengyre"
    VERL = "verl"


@dataclass(frozen=True)
class CellView:
    index: CellIndex
    slots: int
    gpus: int
    kind: CellKind
    role: Role


@dataclass(frozen=True)
class Observation:
    """Everything a policy may look at. Counts are executions unless named ``*_groups``."""

    now_s: float
    trigger: str
    cells: tuple[CellView, ...]
    standalone_slots: int
    standalone_gpus: int
    rollout_capacity: int
    waterlevel: int
    queued: int
    running: int
    pending_dispatch: int
    supply: SupplyView
    ready_groups: int
    groups_generated: int
    batch_groups: int
    updates_per_burst: int
    trainer_waiting: bool
    trainer_step: int
    steps_in_version: int
    version: int
    bursts_ended: int
    in_flight: bool
    cycle_wait_times_s: tuple[float, ...] = ()
    cycle_queue_at_start: tuple[int, ...] = ()
    last_activate_duration_s: float = 0.0
    last_deactivate_duration_s: float = 0.0
    switch_cycle: int = -1
    executions_finished: int = 0  # cumulative (the ledger's ``f``): the finish rate's count
    #: (tokens decoded, sequence-seconds in flight) over the engines, cumulative (None: not
    #: metered): tokens per sequence-second falling shows the engines past their knee
    decode_meter: tuple[float, float] | None = None

    training_prefix: int | None = None  # filled in by the controller (cheap); else computed

    @functools.cached_property
    def prefix_len(self) -> int:
        if self.training_prefix is not None:
            return self.training_prefix
        return training_prefix(c.role for c in self.cells)

    def next_to_train(self) -> CellView | None:
        n = self.prefix_len
        return self.cells[n] if n < len(self.cells) else None

    def last_training(self) -> CellView | None:
        n = self.prefix_len
        return self.cells[n - 1] if n else None


@dataclass(frozen=True)
class Decision:
    """What the policy answers, and everything the controller reads from it: the move (or
    hold), its reason, the plan style, the plan options, and ``dispatch_limit``: executions
    the waterlevel may reach through new dispatches until the next decision (None: no limit;
    the controller hands it to the dispatcher as ``Controller.dispatch_limit``), and
    ``oversubscribe``: a move to training that leaves less capacity than the waterlevel on
    purpose (the executions past it wait for a slot); the controller accepts it only from a
    policy that declares ``may_oversubscribe``, never from the waterlevel policy."""

    action: Action
    cells: tuple[CellIndex, ...] = ()
    reason: str = ""
    style: PlanStyle = PlanStyle.QWENGYRE
    options: dict[str, Any] = field(default_factory=dict)
    dispatch_limit: int | None = None
    oversubscribe: bool = False

    @staticmethod
    def hold(reason: str, dispatch_limit: int | None = None) -> Decision:
        return Decision(Action.HOLD, (), reason, dispatch_limit=dispatch_limit)


@runtime_checkable
class Policy(Protocol):
    name: str
    #: True if the controller must enforce invariant 3 (capacity after a move >= waterlevel
    #: and ready supply held) on every move to training this policy asks for.
    waterlevel_safe: bool
    #: What the simulator gives the policy around its decisions (dispatch, trainer, sync, KV
    #: handoff...): a ``tidal.control.mechanics.Mechanics``, declared on the class.
    mechanics: Mechanics

    def initial_prefix(self, cells: tuple[CellView, ...]) -> int:
        """How many leading cells start on the training side."""
        ...

    def decide(self, obs: Observation) -> Decision: ...

    def state(self) -> dict[str, Any]:
        """Bounded internal state, logged with every decision."""
        ...


def default_prefix(cells: tuple[CellView, ...]) -> int:
    """Hybrid cells (home = training) lead the order and start there; elastic cells don't."""
    n = 0
    for c in cells:
        if c.kind is not CellKind.HYBRID:
            break
        n += 1
    return n


# ------------------------------------------------------------------------ registry

PolicyFactory = Callable[..., Policy]


@dataclass(frozen=True)
class _Entry:
    factory: PolicyFactory
    summary: str
    mechanics: Mechanics


_REGISTRY: dict[str, _Entry] = {}


def register_policy(
    name: str, summary: str, mechanics: Mechanics | None = None
) -> Callable[[PolicyFactory], PolicyFactory]:
    """Registers ``factory`` (a policy class, or a function building one) under ``name``.

    Every policy declares its mechanics (``tidal.control.mechanics``): the class attribute
    ``mechanics``, or ``mechanics=`` here (a function factory). One missing or of another type
    is a ``ConfigError`` naming ``mechanics``: the simulator never guesses them from a name.
    """

    def deco(factory: PolicyFactory) -> PolicyFactory:
        if name in _REGISTRY:
            raise ConfigError(
                "policy.name",
                f"policy {name!r} registered twice "
                f"({_where(_REGISTRY[name].factory)} and {_where(factory)})",
            )
        declared = mechanics if mechanics is not None else getattr(factory, "mechanics", None)
        _REGISTRY[name] = _Entry(factory, summary, _checked_mechanics(name, factory, declared))
        return factory

    return deco


def _checked_mechanics(name: str, factory: object, declared: object) -> Mechanics:
    if declared is None:
        raise ConfigError(
            "mechanics",
            f"policy {name!r} ({_where(factory)}) declares no "
            "mechanics: set `mechanics = ...` on its class (a "
            "tidal.control.mechanics.Mechanics, e.g. QWENGYRE or VERL) or pass "
            "register_policy(..., mechanics=...)",
        )
    if not isinstance(declared, Mechanics):
        raise ConfigError(
            "mechanics",
            f"policy {name!r} ({_where(factory)}) declares "
            f"mechanics {declared!r}: want a tidal.control.mechanics.Mechanics",
        )
    return declared


def _where(factory: object) -> str:
    return str(getattr(factory, "__qualname__", factory))


def unregister_policy(name: str) -> None:
    """Removes a policy registered with ``register_policy`` (a plugin's or a test's);
    unknown names are an error, never ignored."""
    if _REGISTRY.pop(name, None) is None:
        raise UnknownPolicyError("policy.name", f"unknown policy {name!r}")


def registered() -> dict[str, str]:
    """Name -> one-line summary of every registered policy."""
    _load_builtin()
    return {k: v.summary for k, v in sorted(_REGISTRY.items())}


def policy_mechanics(name: str) -> Mechanics:
    """The mechanics policy ``name`` declares; an unknown name is an ``UnknownPolicyError``."""
    return _entry(name).mechanics


def registered_mechanics() -> dict[str, Mechanics]:
    """Name -> declared mechanics of every registered policy."""
    _load_builtin()
    return {k: v.mechanics for k, v in sorted(_REGISTRY.items())}


def _entry(name: str) -> _Entry:
    _load_builtin()
    entry = _REGISTRY.get(name)
    if entry is None:
        known = ", ".join(sorted(_REGISTRY))
        raise UnknownPolicyError("policy.name", f"unknown policy {name!r} (known: {known})")
    return entry


def make_policy(name: str, args: dict[str, Any] | None = None) -> Policy:
    factory = _entry(name).factory
    _check_args(name, factory, args or {})
    try:
        return factory(**(args or {}))
    except TypeError as exc:
        raise ConfigError("policy.args", f"{name}: {exc}") from None


def _check_args(name: str, factory: Callable[..., Policy], args: dict[str, Any]) -> None:
    """An argument the policy does not take is one error naming it and the ones it takes."""
    import inspect

    params = inspect.signature(factory).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return
    takes = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    for key in args:
        if key not in takes:
            have = ", ".join(takes) if takes else "no arguments"
            raise ConfigError(
                f"policy.args.{key}", f"{name} takes no argument {key!r} (it takes: {have})"
            )


def _load_builtin() -> None:
    # Importing the modules runs their @register_policy decorators.
    from tidal.control import policies_simple, tidal_policy, verl, waterlevel  # noqa: F401
