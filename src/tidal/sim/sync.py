"""Weight publication in the simulated world.

After the final update of a burst the trainer publishes weights: every rollout engine pauses
for ``costs.sync_s``. verl-style syncs (``SyncStyle.ABORT``) abort in-flight requests and flush
the engines' caches (partial rollout: the client keeps its tokens and re-sends prompt + tokens,
so the request prefills its whole context once when it resumes); ``KEEP`` syncs pause in place.
Then ``WeightSyncDone`` goes to the controller, executions past the maximum policy lag restart,
the next burst starts and the trainer begins its next step.

Invariant: an aborted request's pending work is the decode tokens its turn has left (never
more than the turn's), and its prefill is decided when it restarts from what the cache holds
(nothing after a flush): two syncs in a row charge one prefill, never two.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tidal.control.mechanics import SyncStyle
from tidal.sim import dispatch
from tidal.types import RequestRetried, WeightSyncDone

if TYPE_CHECKING:
    from tidal.sim.engines import Engine
    from tidal.sim.world import World


def start_sync(w: World, now: float) -> None:
    w.syncing = True
    dur = w.scenario.costs.sync_s
    abort = w.profile.sync is SyncStyle.ABORT
    targets = [e for e in w.engines if e.admitting or e.members]
    for e in targets:
        if abort:
            abort_requests(w, e, now)
        e.set_paused(True, now)
        w.resched(e)
    w.sync_s_total += dur
    from tidal.sim.world import SYNC

    w.push(now + dur, SYNC, targets, dur)


def abort_requests(w: World, e: Engine, now: float) -> None:
    """A weight update on ``e``: its in-flight requests are aborted (they keep the decode
    tokens left, or start the turn over without partial rollout) and its cache is flushed."""
    for ex in sorted(e.members, key=lambda x: x.seq_no):
        if ex.seg is not None:
            ex.pending = w.stop_seq(ex)
            if not w.profile.partial_rollout:  # the turn starts over
                dec = float(ex.spec.turns[ex.turn][0])
                w.wasted_tokens += int(max(0.0, dec - ex.pending))
                ex.pending = dec
            w.emit(RequestRetried(now, ex.eid))
        ex.cached = 0


def resume_requests(w: World, e: Engine) -> None:
    """``e`` serves again: every request of its executions that waits restarts."""
    e.set_paused(False, w.now)
    for ex in sorted(e.members, key=lambda x: x.seq_no):
        if ex.pending is not None and ex.seg is None and not ex.in_tool and not ex.hold:
            work, ex.pending = ex.pending, None
            w.start_seq(ex, work)
    w.resched(e)


def on_sync_done(w: World, targets: list[Engine], dur: float) -> None:
    for e in targets:
        resume_requests(w, e)
    w.syncing = False
    version = w.version + 1
    w.emit(WeightSyncDone(w.now, version, dur))
    if w.scenario.sim.max_policy_lag is not None:
        restart_lagging(w, version, w.scenario.sim.max_policy_lag)
    dispatch.start_burst(w)
    w.trainer.begin_step(w.now)


def restart_lagging(w: World, version: int, lag: int) -> None:
    """Executions whose first token is more than ``lag`` versions old start over (their
    tokens are wasted, counted), so no trained sample lags further."""
    for ex in sorted(w.live.values(), key=lambda x: x.seq_no):
        if ex.first_version >= version - lag:
            continue
        if ex.seg is not None:
            w.stop_seq(ex)
        w.wasted_tokens += ex.ctx - ex.spec.prompt_tokens
        ex.gen += 1
        ex.turn, ex.ctx, ex.in_tool, ex.pending, ex.cached = (
            0,
            ex.spec.prompt_tokens,
            False,
            None,
            0,
        )
        ex.first_version = version
        if ex.spec.timeout_s is not None:
            w.arm_timeout(ex)
        w.begin_turn(ex)
