"""``runtime.deterministic``: two seeded runs of one config, token-identical end to end.

In: the run config (checked before anything starts: what this mode cannot make deterministic
is refused in one line naming the field), and at each weight-version boundary (a burst about to
be dispatched) the burst's groups in dispatch order and the published version's label. Out:
the groups' training order handed to the trajectory buffer (``ordered``: every step trains the
same groups, packed the same way, whatever order their executions closed in), and the hold:
the dispatcher waits until every engine in routing serves the published version
(``tidal.control.version_hold``; the proxy's members for who is routed, each engine actor's
``describe`` for what it serves), bounded by ``runtime.start_timeout_s``.

What else this mode sets, and where (every source of run-to-run difference, removed):
- engines (``EngineConfig.deterministic``): each request's forward alone, one token at a time,
  so its logits never depend on its batch-mates or on how a move cut its tokens (a drain's
  re-prefill or KV handoff computes each position as the first engine did); with the proxy's
  per-call seeds (``tidal.seeding``: ``call_seed``, ``continued_seed``) the same tokens follow;
- the core trains every micro-step itself (satellites are not started): a satellite's share of
  the gradient sum depends on who claimed what first, and float sums in another order differ
  in the last bits;
- torch's deterministic algorithms on (trainer and engines), fixed thread counts
  (``runtime.torch_threads``, one thread per engine).
Not covered (stated in docs/deterministic.md): an execution that times out (its cut depends on
wall time), and the user's own agent or reward code where it is itself not deterministic.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

import httpx

from tidal.clock import Clock
from tidal.config import RunConfig
from tidal.control.version_hold import EngineVersion, VersionHold
from tidal.errors import ConfigError, TimeoutExpired
from tidal.runtime.tasks import remote

if TYPE_CHECKING:
    from tidal.runtime.engines import Engines
    from tidal.training.trajectory_buffer import TrajectoryBuffer

log = logging.getLogger(__name__)


def check(cfg: RunConfig) -> None:
    """Refuse what deterministic mode cannot make token-identical (one line naming the field);
    nothing when the mode is off."""
    rt = cfg.runtime
    if not rt.deterministic:
        return
    why = "runtime.deterministic needs the built-in engine, which computes each request alone"
    if rt.standalone_backend != "builtin":
        raise ConfigError(
            "runtime.standalone_backend",
            f"{why} ('{rt.standalone_backend}' batches requests together, so a request's "
            "logits depend on its batch-mates)",
        )
    if rt.cell_backend != "builtin":
        raise ConfigError(
            "runtime.cell_backend", f"{why} ('{rt.cell_backend}' batches requests together)"
        )
    for i, spec in enumerate(cfg.cluster.cell_specs()):
        if spec.backend not in (None, "builtin"):
            raise ConfigError(
                f"cluster.cells.{i}.backend", f"{why} ('{spec.backend}' batches requests together)"
            )
    if rt.use_gpus:
        raise ConfigError(
            "runtime.use_gpus",
            "runtime.deterministic is verified on CPU "
            "engines and trainers only (CUDA kernels choose their reduction "
            "order per launch)",
        )
    if rt.fsdp_ranks > 1:
        raise ConfigError(
            "runtime.fsdp_ranks",
            "runtime.deterministic trains on one rank (ranks claim micro-steps in arrival order)",
        )


class Boundaries:
    """The dispatcher's gate at each weight-version boundary of a deterministic run."""

    def __init__(
        self,
        clock: Clock,
        admin: httpx.AsyncClient,
        engines: Engines,
        buffer: TrajectoryBuffer,
        timeout_s: float,
        poll_s: float = 0.05,
    ) -> None:
        self.clock, self.admin, self.engines, self.buffer = clock, admin, engines, buffer
        self.timeout_s, self.poll_s = timeout_s, poll_s
        self.hold = VersionHold()

    async def at(self, burst: int, label: str, group_ids: list[str]) -> None:
        """Burst ``burst``'s groups go to the buffer's training order; returns once every
        engine in routing serves ``label`` (``TimeoutExpired`` after ``timeout_s``)."""
        self.buffer.expect(group_ids)
        deadline, said = self.clock.now() + self.timeout_s, False
        while True:
            waiting = self.hold.look(self.clock.now(), label, await self._engines())
            if not waiting:
                if said:
                    log.info(
                        "deterministic hold released: burst %d, every engine serves %s",
                        burst,
                        label,
                    )
                return
            if self.clock.now() >= deadline:
                raise TimeoutExpired(
                    f"deterministic hold at burst {burst}: engines {', '.join(waiting)} do not "
                    f"serve {label} after {self.timeout_s:g} s (runtime.start_timeout_s)"
                )
            if not said:
                log.info(
                    "deterministic hold: burst %d waits for %s to serve %s",
                    burst,
                    ", ".join(waiting),
                    label,
                )
                said = True
            await self.clock.asleep(self.poll_s)

    async def _engines(self) -> list[EngineVersion]:
        """Who is routed (the proxy) and what each serves (its actor), for one look."""
        resp = await self.admin.get("/tidal/engines", timeout=10.0)
        resp.raise_for_status()
        routed = {e["id"]: e["admitting"] and e["alive"] for e in resp.json()["engines"]}
        ids = list(self.engines.actors)
        described = await asyncio.gather(
            *[
                remote(a.describe.remote(), f"{eid} describe", 30.0)
                for eid, a in self.engines.actors.items()
            ],
            return_exceptions=True,
        )
        versions = {
            str(eid): d.get("version") if isinstance(d, dict) else None
            for eid, d in zip(ids, described, strict=True)
        }
        return [EngineVersion(eid, ok, versions.get(eid)) for eid, ok in routed.items()]
