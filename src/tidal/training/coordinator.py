"""The core's side of membership: who joined which step, who delivered, who was lost.

In: satellite requests (``hello``, ``join``, ``pull``, ``claim``, ``complete``, ``deliver``,
``await_update``) arriving on RPC handler threads, and the core trainer's step calls
(``open_step``, ``close_window``, ``wait_deliveries``, ``post_outcome``) on its main thread.
Out: replies, gradient ``Contribution``s received over each satellite's link group, and the
list of members that must receive the parameter broadcast after a non-final update.

Keeps: satellites join in cell order (a join waits until every registered lower cell joined the
step); the join window closes before the optimizer update and a late join waits for the next
step; a claim is served only to a satellite holding the step's weight version, so nobody mixes
versions within an accumulation window (invariant 5); a lost satellite's claimed and completed
micro-steps go back to the packing buffer before the update. Every wait is bounded.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from tidal.clock import Clock
from tidal.errors import TidalError, TimeoutExpired
from tidal.training.aggregate import Contribution
from tidal.training.groups import CommError, GroupRegistry
from tidal.training.packing import PackingBuffer
from tidal.training.transport import BroadcastTransport

log = logging.getLogger(__name__)


class CoordinatorConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    join_timeout_s: float = Field(default=120.0, gt=0)
    gather_timeout_s: float = Field(default=60.0, gt=0)
    claim_wait_s: float = Field(default=0.2, gt=0)
    snapshot_transport: Literal["link", "shm"] = "link"


class MembershipError(TidalError):
    """A satellite request that does not fit its state (lost, wrong version, not joined)."""


@dataclass
class _Sat:
    cell: int
    incarnation: str
    joined_step: int | None = None
    delivered: bool = False
    lost: bool = False
    version: int = -1
    parked: bool = False  # between training stints: waits in ``park`` (model offloaded)

    @property
    def worker(self) -> str:
        return f"cell{self.cell}:{self.incarnation}"


@dataclass
class StepInfo:
    step: int
    batch_id: int
    version: int
    final: bool


class Coordinator:
    def __init__(
        self,
        config: CoordinatorConfig,
        packing: PackingBuffer,
        registry: GroupRegistry,
        clock: Clock,
        shm_name: str | None = None,
    ) -> None:
        self.config, self.packing, self.registry, self.clock = config, packing, registry, clock
        self.shm_name = shm_name
        self._cv = threading.Condition()
        self._sats: dict[int, _Sat] = {}
        self._departing: set[int] = set()  # satellites the runtime is stopping (planned)
        self._inactive: set[int] = set()  # cells the runtime moved out of training (they park)
        self._members_fixed = -1  # the step whose broadcast members the core has read
        self._step: StepInfo | None = None
        self._window_open = False
        self._snapshot: torch.Tensor | None = None
        self._contribs: dict[int, Contribution] = {}
        self._outcomes: dict[int, dict[str, Any]] = {}
        self._shutdown = False
        self.numel = 0
        self.fingerprint = ""
        self.loss: dict[str, Any] = {}  # the core's GRPOLossConfig; satellites must use it
        self.pad_id = 0
        self.join_log: list[tuple[int, int, float]] = []  # (step, cell, time)

    # ----- core side -----------------------------------------------------------------------
    def open_step(self, info: StepInfo, snapshot: torch.Tensor) -> None:
        with self._cv:
            self._step, self._snapshot = info, snapshot
            self._contribs, self._window_open = {}, True
            self._cv.notify_all()

    def close_window(self) -> None:
        with self._cv:
            self._window_open = False
            self._cv.notify_all()

    def _joined(self) -> list[_Sat]:
        s = self._step
        return [x for x in self._sats.values() if s and x.joined_step == s.step and not x.lost]

    def wait_deliveries(self) -> list[Contribution]:
        """Block until every satellite that joined this step delivered or was lost."""
        deadline = self.clock.now() + self.config.gather_timeout_s
        with self._cv:
            while any(not x.delivered for x in self._joined()):
                if self.clock.now() > deadline:
                    for x in self._joined():
                        if not x.delivered:
                            self._lose(
                                x, f"no delivery within {self.config.gather_timeout_s:.1f}s", False
                            )
                    break
                self.clock.wait(self._cv, 0.05)
            # A satellite lost after delivering still counts: its gradient is in hand.
            return [self._contribs[c] for c in sorted(self._contribs)]

    def release_gradients(self) -> None:
        """The delivered sums were aggregated: their tensors go (the record of who delivered,
        and their counts, stay until the next step opens)."""
        with self._cv:
            self._contribs = {c: replace(x, grad=torch.empty(0)) for c, x in self._contribs.items()}

    def registered(self) -> list[int]:
        """Cells whose satellite said hello and is not lost."""
        with self._cv:
            return sorted(c for c, x in self._sats.items() if not x.lost)

    def members(self) -> list[tuple[int, str]]:
        """This step's broadcast members; from here on none of them may leave the step."""
        with self._cv:
            if self._step is not None:
                self._members_fixed = self._step.step
            return [(x.cell, x.incarnation) for x in sorted(self._joined(), key=lambda x: x.cell)]

    def post_outcome(self, step: int, outcome: dict[str, Any]) -> None:
        with self._cv:
            self._outcomes[step] = outcome
            if outcome["next"] == "continue":
                for x in self._joined():
                    x.version = outcome["version"]
            self._cv.notify_all()

    def mark_stale(self, cells: list[int]) -> None:
        with self._cv:
            for c in cells:
                if c in self._sats:
                    self._sats[c].version = -1

    def shutdown(self) -> None:
        with self._cv:
            self._shutdown = True
            self._cv.notify_all()

    # ----- persistent satellites: the runtime moves a cell's satellite in and out -----------
    def deactivate(self, cell: int) -> None:
        """Cell ``cell`` leaves training: its satellite claims nothing more, delivers what it
        computed, leaves its step (unless the update's broadcast already counts it) and parks
        (process, model and groups kept)."""
        with self._cv:
            self._inactive.add(cell)
            self._cv.notify_all()

    def activate(self, cell: int) -> None:
        """Cell ``cell`` trains again: its parked satellite joins the next step (pulling only
        a version it does not hold)."""
        with self._cv:
            self._inactive.discard(cell)
            self._cv.notify_all()

    def wait_parked(self, cell: int, timeout_s: float) -> bool:
        """Block until cell ``cell``'s satellite parked, or is lost or unknown (nothing left
        to wait for); False after ``timeout_s``."""
        deadline = self.clock.now() + timeout_s
        with self._cv:
            while True:
                sat = self._sats.get(cell)
                if sat is None or sat.lost or sat.parked:
                    return True
                if self.clock.now() > deadline:
                    return False
                self.clock.wait(self._cv, 0.05)

    def is_parked(self, cell: int) -> bool:
        with self._cv:
            sat = self._sats.get(cell)
            return sat is not None and not sat.lost and sat.parked

    def expect_departure(self, cell: int) -> None:
        """The runtime is about to stop cell ``cell``'s satellite (the cell returns to rollout):
        its disconnect is a planned departure (INFO), not a loss (WARNING)."""
        with self._cv:
            self._departing.add(cell)

    def lose(self, cell: int, reason: str = "its link failed", planned: bool = False) -> None:
        """Cell ``cell`` leaves the step; a planned departure (the satellite said bye) is
        INFO, anything else a WARNING naming ``reason``."""
        with self._cv:
            if cell in self._sats:
                self._lose(self._sats[cell], reason, planned)

    def _lose(self, sat: _Sat, reason: str, planned: bool) -> None:
        if sat.lost:
            return
        sat.lost = True
        if sat.cell in self._contribs:
            reopened = 0  # delivered: its micro-steps are accounted for by its contribution
        else:
            reopened = self.packing.reopen(sat.worker)
        self.registry.forget(f"{sat.cell}:{sat.incarnation}")
        self.registry.forget(GroupRegistry.link_key(sat.cell, sat.incarnation))
        if planned:
            log.info(
                "cell %d (%s) left training: %s; %d micro-steps reopened",
                sat.cell,
                sat.incarnation,
                reason,
                reopened,
            )
        else:
            log.warning(
                "cell %d (%s) lost: %s; %d micro-steps reopened",
                sat.cell,
                sat.incarnation,
                reason,
                reopened,
            )
        self._cv.notify_all()

    # ----- satellite requests (RPC handler threads) --------------------------------------------
    def on_disconnect(self, session: dict[str, Any]) -> None:
        if "cell" in session:
            cell = session["cell"]
            with self._cv:
                current = self._sats.get(cell)
                if current is None or current.incarnation != session.get("incarnation"):
                    # an earlier incarnation's connection closing late (its handler thread
                    # was still waiting): it was replaced already; never lose the newcomer
                    return
                stopped = cell in self._departing
                self._departing.discard(cell)
                ended = self._shutdown  # the core closed its server: the run is over
            if stopped or session.get("closing") or ended:
                self.lose(
                    cell,
                    "the runtime stopped it (the cell returns to rollout)"
                    if stopped
                    else "it said bye"
                    if session.get("closing")
                    else "the run ended (the core shut down)",
                    planned=True,
                )
            else:
                self.lose(cell, "its connection closed without a bye")

    def handle(self, req: dict[str, Any], session: dict[str, Any]) -> dict[str, Any]:
        op = req["op"]
        if op == "hello":
            return self._hello(req, session)
        sat = self._sats[session["cell"]]
        if sat.incarnation != session.get("incarnation"):
            raise MembershipError(
                f"cell {sat.cell}: incarnation {session.get('incarnation')} "
                f"was replaced by {sat.incarnation}"
            )
        if op == "bye":
            session["closing"] = True
            return {}
        if sat.lost:
            raise MembershipError(f"cell {sat.cell} was declared lost; restart it")
        return getattr(self, f"_op_{op}")(sat, req)

    def _hello(self, req: dict[str, Any], session: dict[str, Any]) -> dict[str, Any]:
        cell, inc = int(req["cell"]), str(req["incarnation"])
        if cell < 1:
            raise MembershipError("satellites are cells 1..K-1")
        if req["fingerprint"] != self.fingerprint:
            raise MembershipError(f"cell {cell} runs another model ({req['fingerprint']})")
        with self._cv:
            old = self._sats.get(cell)
            if old is not None and not old.lost:
                planned = cell in self._departing
                self._departing.discard(cell)
                self._lose(old, f"incarnation {inc} joined in its place", planned)
            self._sats[cell] = _Sat(cell, inc)
            session["cell"], session["incarnation"] = cell, inc
        return {
            "shm_name": self.shm_name,
            "numel": self.numel,
            "loss": self.loss,
            "pad_id": self.pad_id,
        }

    def _op_link(self, sat: _Sat, req: dict[str, Any]) -> dict[str, Any]:
        self.registry.link(sat.cell, sat.incarnation)
        return {}

    def _op_join(self, sat: _Sat, req: dict[str, Any]) -> dict[str, Any]:
        deadline = self.clock.now() + self.config.join_timeout_s
        with self._cv:
            while True:
                if self._shutdown:
                    return {"next": "shutdown"}
                if sat.cell in self._inactive:
                    return {"next": "park"}
                s = self._step
                if (
                    s
                    and self._window_open
                    and sat.joined_step != s.step
                    and self._order_ok(sat.cell, s.step)
                ):
                    sat.joined_step, sat.delivered = s.step, False
                    self.join_log.append((s.step, sat.cell, self.clock.now()))
                    log.info("cell %d joined step %d (v%d)", sat.cell, s.step, s.version)
                    self._cv.notify_all()
                    return {
                        "next": "train",
                        "step": s.step,
                        "batch_id": s.batch_id,
                        "version": s.version,
                        "final": s.final,
                        "pull": sat.version != s.version,
                    }
                if self.clock.now() > deadline:
                    raise TimeoutExpired(
                        f"cell {sat.cell}: no join window within {self.config.join_timeout_s}s"
                    )
                self.clock.wait(self._cv, 0.05)

    def _order_ok(self, cell: int, step: int) -> bool:
        return all(
            x.joined_step == step
            for x in self._sats.values()
            if x.cell < cell and not x.lost and x.cell not in self._inactive
        )

    def _op_park(self, sat: _Sat, req: dict[str, Any]) -> dict[str, Any]:
        """The satellite waits here between training stints (bounded by ``wait_s``: it calls
        again on ``park``); ``join`` once its cell trains again."""
        deadline = self.clock.now() + float(req.get("wait_s", 30.0))
        with self._cv:
            sat.parked = True
            self._cv.notify_all()
            try:
                while True:
                    if self._shutdown:
                        return {"next": "shutdown"}
                    if sat.cell not in self._inactive:
                        return {"next": "join"}
                    if self.clock.now() > deadline:
                        return {"next": "park"}
                    self.clock.wait(self._cv, 0.05)
            finally:
                if sat.cell not in self._inactive or self._shutdown:
                    sat.parked = False

    def _op_pull(self, sat: _Sat, req: dict[str, Any]) -> dict[str, Any]:
        with self._cv:
            s, snap = self._step, self._snapshot
        if s is None or snap is None:
            raise MembershipError("no snapshot exposed")
        if self.config.snapshot_transport == "link":
            link = self.registry.link(sat.cell, sat.incarnation)
            try:
                BroadcastTransport(self.registry, link).publish(s.version, snap)
            except CommError:
                self.lose(sat.cell)
                raise
        return {"version": s.version}

    def _op_pulled(self, sat: _Sat, req: dict[str, Any]) -> dict[str, Any]:
        with self._cv:
            sat.version = int(req["version"])
        return {}

    def _op_claim(self, sat: _Sat, req: dict[str, Any]) -> dict[str, Any]:
        s = self._step
        if (
            s is None or sat.joined_step != s.step or sat.delivered or sat.cell in self._inactive
        ):  # leaving: deliver what it computed
            return {"kind": "drained"}
        if sat.version != s.version:
            raise MembershipError(f"cell {sat.cell} holds v{sat.version}, step trains v{s.version}")
        deadline = self.clock.now() + self.config.claim_wait_s
        while True:
            claim = self.packing.claim(sat.worker)
            if claim.kind != "wait" or self.clock.now() > deadline:
                return {"kind": claim.kind, "micro_step": claim.micro_step}
            self.clock.sleep(0.01)

    def _op_complete(self, sat: _Sat, req: dict[str, Any]) -> dict[str, Any]:
        return {"accepted": self.packing.complete(sat.worker, req["batch_id"], req["index"])}

    def _op_deliver_begin(self, sat: _Sat, req: dict[str, Any]) -> dict[str, Any]:
        s = self._step
        if s is None or sat.joined_step != s.step or s.step != req["step"]:
            raise MembershipError(f"cell {sat.cell}: no delivery expected for step {req['step']}")
        return {}

    def _op_deliver(self, sat: _Sat, req: dict[str, Any]) -> dict[str, Any]:
        grad = torch.empty(self.numel, dtype=torch.float32)
        link = self.registry.link(sat.cell, sat.incarnation)
        try:
            self.registry.broadcast(link, grad, 1)
        except CommError:
            self.lose(sat.cell)
            raise
        c = req["counts"]
        with self._cv:
            if sat.lost:
                raise MembershipError(f"cell {sat.cell} was lost before its delivery completed")
            self._contribs[sat.cell] = Contribution(
                sat.cell,
                grad,
                c["n_micro_steps"],
                c["n_tokens"],
                c["n_executions"],
                c["loss_sum"],
                c["device_peak_mb"],
            )
            sat.delivered = True
            self._cv.notify_all()
        return {}

    def _op_await_update(self, sat: _Sat, req: dict[str, Any]) -> dict[str, Any]:
        step = int(req["step"])
        deadline = self.clock.now() + self.config.gather_timeout_s + self.config.join_timeout_s
        with self._cv:
            while step not in self._outcomes:
                if sat.cell in self._inactive and self._members_fixed != step:
                    # leaving training after its delivery: not in this update's broadcast;
                    # it pulls the version it lacks when it trains again
                    sat.joined_step = None
                    log.info("cell %d left step %d after its delivery", sat.cell, step)
                    self._cv.notify_all()
                    return {"next": "park"}
                if sat.lost:
                    raise MembershipError(f"cell {sat.cell} was lost during step {step}")
                if self.clock.now() > deadline:
                    raise TimeoutExpired(f"cell {sat.cell}: update of step {step} not announced")
                self.clock.wait(self._cv, 0.05)
            return dict(self._outcomes[step])
