"""When an emulated engine's tokens come out: the simulator's cost model, on a clock, scaled.

In: a simulator scenario (``tidal.sim.scenario``: its cluster, cost model or engine speeds and
transition costs), one of its engines (``scenario_engines``: ``s<j>`` standalone, ``c<i>``
cells, as the runtime names them), a time scale ``k`` and a clock. Out: ``EmulatedTiming``:
requests added with the tokens they will decode and the prompt tokens they must prefill; at
any moment the tokens each has decoded, the ones finished, and the real seconds until the next
finish; and the scenario's sleep, wake and weight-load times in real seconds.

Emulated time is ``k`` times the clock's: ``k`` divides every emulated duration (a decode that
takes 60 s in the scenario takes 6 s of real time at ``k = 10``). The speeds are the
simulator's own engine (``tidal.sim.engines.Engine``: a prefill queue, then processor sharing of
the cost model's ``seq_rate`` over the active sequences and their context, KV capacity shared),
built exactly as the simulator's world builds it, so the emulated and simulated engine agree by
construction; this module only maps request ids and the clock onto it. A test double at scale:
nothing here runs a model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tidal.clock import Clock
from tidal.errors import ConfigError
from tidal.sim import perf
from tidal.sim.engines import Engine as SimEngine
from tidal.sim.scenario import Scenario
from tidal.sim.scenario import load as load_scenario


@dataclass(frozen=True)
class EngineSlot:
    """One engine of a scenario: its runtime id, kind (standalone or the cell's), GPUs, slots."""

    name: str
    kind: str  # "standalone" | "hybrid" | "elastic"
    gpus: int
    slots: int


def resolved_scenario(name_or_path: str) -> Scenario:
    """The scenario (a shipped name or a YAML path) with every speed its cost model derives."""
    return perf.resolve(load_scenario(name_or_path))


def scenario_engines(sc: Scenario) -> list[EngineSlot]:
    """The scenario's engines in the runtime's order: standalone ``s0..``, then cells ``c0..``."""
    cl = sc.cluster
    out = [
        EngineSlot(f"s{j}", "standalone", cl.standalone_gpus, cl.standalone_slots)
        for j in range(cl.standalone_count)
    ]
    out += [
        EngineSlot(f"c{i}", str(getattr(s.kind, "value", s.kind)), s.gpus, s.slots)
        for i, s in enumerate(cl.cell_specs())
    ]
    return out


def engine_slot(sc: Scenario, name: str) -> EngineSlot:
    """The engine ``name`` (``s<j>`` / ``c<i>``) of ``sc``; an unknown one names the known."""
    slots = scenario_engines(sc)
    for s in slots:
        if s.name == name:
            return s
    known = ", ".join(s.name for s in slots)
    raise ConfigError("engine", f"scenario {sc.name!r} has no engine {name!r} ({known})")


def sim_engine(sc: Scenario, slot: EngineSlot) -> SimEngine:
    """The simulator's engine for ``slot``, built as ``sim.world.World`` builds it."""
    eng = sc.engine
    models = perf.engine_models(sc)
    model = None
    if models is not None:
        model = models[1] if slot.kind == "hybrid" else models[0]
    return SimEngine(
        slot.name,
        slot.gpus,
        slot.slots,
        eng.decode_tok_s_per_gpu * slot.gpus,
        eng.seq_cap_tok_s,
        cell=None,
        model=model,
        prefill_equiv=eng.prefill_equiv,
    )


class EmulatedTiming:
    """One emulated engine's clock-driven decode progress (emulated seconds = ``k`` x real)."""

    def __init__(self, sc: Scenario, slot: EngineSlot, k: float, clock: Clock) -> None:
        if not k > 0 or not math.isfinite(k):
            raise ConfigError("k", f"the time scale must be a positive number, not {k!r}")
        self.scenario, self.slot, self.k, self.clock = sc, slot, float(k), clock
        self.sim = sim_engine(sc, slot)
        self._t0 = clock.now()
        self._seq: dict[str, int] = {}  # request id -> the sim engine's sequence number
        self._rid: dict[int, str] = {}
        self._work: dict[int, float] = {}
        self._next = 0
        costs = sc.costs
        load = costs.sync_s if costs.load_weights_s is None else costs.load_weights_s
        # the scenario's transition times, in real seconds
        self.sleep_real_s = costs.sleep_s / self.k
        self.wake_real_s = costs.wake_s / self.k
        self.load_real_s = load / self.k

    def now(self) -> float:
        """Emulated seconds since this engine started."""
        return (self.clock.now() - self._t0) * self.k

    def __contains__(self, rid: str) -> bool:
        return rid in self._seq

    def __len__(self) -> int:
        return len(self._seq)

    def add(self, rid: str, decode_tokens: int, prompt_tokens: int, cached_tokens: int = 0) -> None:
        """Start ``rid``: prefill what the cache lacks of its prompt, then decode
        ``decode_tokens``."""
        seq = self._next
        self._next += 1
        self._seq[rid], self._rid[seq], self._work[seq] = seq, rid, float(decode_tokens)
        self.sim.add(
            seq,
            float(decode_tokens),
            self.now(),
            ctx_tokens=float(prompt_tokens),
            prefill_tokens=float(max(0, prompt_tokens - cached_tokens)),
        )

    def decoded(self, rid: str) -> int:
        """Tokens ``rid`` has decoded by now (0 while it waits for its prefill)."""
        seq = self._seq[rid]
        self.sim.advance(self.now())
        if not self.sim.has(seq):
            return int(self._work[seq])
        left = self.sim.remaining(seq)
        return max(0, min(int(self._work[seq]), int(self._work[seq] - left + 1e-6)))

    def remove(self, rid: str) -> int:
        """Take ``rid`` out (aborted, or its caller gone); returns the tokens it decoded."""
        seq = self._seq.pop(rid)
        self._rid.pop(seq, None)
        work = self._work.pop(seq)
        if not self.sim.has(seq):
            return int(work)
        left = self.sim.remove(seq, self.now())
        return max(0, int(work - left + 1e-6))

    def pop_finished(self) -> list[str]:
        """The requests whose decode is done by now (removed from this timing)."""
        out = []
        for seq in self.sim.pop_finished(self.now()):
            rid = self._rid.pop(seq)
            self._seq.pop(rid, None)
            self._work.pop(seq, None)
            out.append(rid)
        return out

    def next_event_real_s(self) -> float | None:
        """Real seconds until the next prefill ends or request finishes (None: none pending)."""
        t = self.sim.next_finish()
        if t is None:
            return None
        return max(0.0, (t - self.now()) / self.k)

    def set_paused(self, paused: bool) -> None:
        """Stop (or restart) every decode and prefill; requests keep their progress."""
        self.sim.set_paused(paused, self.now())

    def tokens_per_s(self) -> float:
        """Emulated decode tokens/s of the engine now (the sum over its active sequences)."""
        self.sim.advance(self.now())
        return self.sim.rate() * self.sim.active
