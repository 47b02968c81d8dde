"""Engine membership and routing decisions: sticky per execution, least-loaded otherwise,
per-engine admission caps, and destination reservations for drains. No I/O, no clock.

In: joins / leaves, in-flight bookkeeping from the proxy, drain requests. Out: which engine a
request goes to. Invariant kept: an engine that stopped admitting (draining, dead) is never
picked, and a reservation made for an execution is honoured by its next request.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Literal

from tidal.serving.adapters import EngineAdapter
from tidal.serving.protocol import BadRequest, NotFound

log = logging.getLogger(__name__)
Kind = Literal["standalone", "cell"]


@dataclass
class Member:
    engine_id: str
    adapter: EngineAdapter
    kind: Kind = "standalone"
    cell_index: int = 0
    cap: int = 32
    backend: str = "builtin"
    model: str = ""
    max_model_len: int | None = None
    admitting: bool = True
    alive: bool = True
    inflight: dict[str, object] = field(default_factory=dict)
    reserved: int = 0
    progress_s: float = float("-inf")  # loop time of its last answer or streamed chunk
    prompt_tokens: int = 0  # prompt tokens sent here, and of those the ones found cached
    cached_tokens: int = 0
    # tokens the calls in flight here got back so far (kept as they stream and leave: the
    # proxy's /tidal/stats never walks the calls in flight, 10,000 of them at scale)
    streamed_tokens: int = 0

    @property
    def load(self) -> int:
        return len(self.inflight) + self.reserved

    def routable(self) -> bool:
        return self.admitting and self.alive

    def describe(self) -> dict:
        return engine_view(
            self,
            self.adapter.url,
            alive=self.alive,
            inflight=len(self.inflight),
            reserved=self.reserved,
            inflight_tokens=self.streamed_tokens,
            kv_handoff=self.adapter.supports_kv_handoff,
            prompt_tokens=self.prompt_tokens,
            cached_tokens=self.cached_tokens,
        )


def engine_view(
    e,
    url: str,
    *,
    alive: bool,
    inflight: int = 0,
    reserved: int = 0,
    inflight_tokens: int = 0,
    kv_handoff: bool = False,
    prompt_tokens: int = 0,
    cached_tokens: int = 0,
    lost: bool = False,
) -> dict:
    """How ``/tidal/engines`` and the drain/undrain answers describe an engine, a member or
    one out of routing (``e``: anything with its id, kind, cell index, cap, backend, model
    and admission; ``lost``: down, out of routing, not left)."""
    return {
        "id": e.engine_id,
        "url": url,
        "kind": e.kind,
        "cell_index": e.cell_index,
        "cap": e.cap,
        "backend": e.backend,
        "model": e.model,
        "admitting": e.admitting,
        "alive": alive,
        "inflight": inflight,
        "reserved": reserved,
        # tokens the calls in flight here got back so far (a move continues from them)
        "inflight_tokens": inflight_tokens,
        "kv_handoff": kv_handoff,
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached_tokens,
        "lost": lost,
    }


class Router:
    def __init__(self) -> None:
        self.members: dict[str, Member] = {}
        self.routes: dict[str, str] = {}
        self.reservations: dict[str, str] = {}
        # live executions whose engine left routing (drained) between two of their calls and
        # whose next call went to another engine: rerouted without their harness noticing
        self.rerouted_executions = 0
        self._displaced: set[str] = set()  # routes a drain removed, until the next call

    def join(self, member: Member) -> None:
        if member.engine_id in self.members and self.members[member.engine_id].alive:
            raise BadRequest(f"engine {member.engine_id!r} is already a member")
        self.members[member.engine_id] = member
        log.info(
            "engine %s joined (%s, %s #%d, cap %d)",
            member.engine_id,
            member.adapter.url,
            member.kind,
            member.cell_index,
            member.cap,
        )

    def leave(self, engine_id: str) -> Member | None:
        member = self.members.pop(engine_id, None)
        if member is None:
            return None
        member.alive = member.admitting = False
        for ex in [e for e, m in self.routes.items() if m == engine_id]:
            del self.routes[ex]
        for ex in [e for e, m in self.reservations.items() if m == engine_id]:
            del self.reservations[ex]
        log.info("engine %s left", engine_id)
        return member

    def pick(self, execution_id: str | None) -> Member | None:
        """Reserved engine, else the sticky one if it has room, else the least-loaded engine
        with room (ties: standalone first, then by cell order). None: nothing has room."""
        if execution_id is not None:
            target = self.reservations.pop(execution_id, None)
            if target is not None and target in self.members:
                member = self.members[target]
                member.reserved = max(0, member.reserved - 1)
                if member.routable():
                    return member
            sticky = self.members.get(self.routes.get(execution_id, ""))
            if sticky is not None and sticky.routable() and sticky.load < sticky.cap:
                return sticky
        candidates = [m for m in self.members.values() if m.routable() and m.load < m.cap]
        if not candidates:
            return None
        best = min(
            candidates, key=lambda m: (m.load / m.cap, m.kind != "standalone", -m.cell_index)
        )
        if execution_id is not None:
            if execution_id in self._displaced:
                self._displaced.discard(execution_id)
                self.rerouted_executions += 1
            self.routes[execution_id] = best.engine_id
        return best

    def destinations(self, exclude: str) -> list[Member]:
        """Drain destinations in preference order: standalone engines (least loaded first),
        then rollout cells in descending cell order (they stay in rollout longest)."""
        live = [m for m in self.members.values() if m.routable() and m.engine_id != exclude]
        standalone = sorted(
            (m for m in live if m.kind == "standalone"), key=lambda m: m.load / m.cap
        )
        cells = sorted((m for m in live if m.kind == "cell"), key=lambda m: -m.cell_index)
        return standalone + cells

    def reserve(self, execution_id: str, source: str) -> Member | None:
        """Reserve a slot for ``execution_id`` away from ``source`` and point its route there."""
        self._displaced.discard(execution_id)  # its in-flight call is retried (counted there)
        for member in self.destinations(source):
            if member.load < member.cap:
                member.reserved += 1
                old = self.reservations.get(execution_id)
                if old in self.members:
                    self.members[old].reserved = max(0, self.members[old].reserved - 1)
                self.reservations[execution_id] = member.engine_id
                self.routes[execution_id] = member.engine_id
                return member
        return None

    def set_admitting(self, engine_id: str, admitting: bool) -> Member:
        member = self.members.get(engine_id)
        if member is None:
            raise NotFound(f"unknown engine {engine_id!r}")
        member.admitting = admitting
        if not admitting:
            for ex in [e for e, m in self.routes.items() if m == engine_id]:
                del self.routes[ex]
                self._displaced.add(ex)
        return member

    def capacity(self) -> int:
        return sum(m.cap for m in self.members.values() if m.routable())
