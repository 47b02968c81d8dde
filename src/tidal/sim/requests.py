"""A turn's model request on its engine: started, stopped, its prefill decided once.

In: an execution (its turn, context, what its engine's cache holds) and the world. Out: the
request on its engine (``Engine.add`` with the decode tokens left and the tokens to prefill),
or taken off it with the decode tokens its turn has left. Keeps: a request's pending work is
never more than its turn's decode tokens; a prefill covers only what the cache lacks, so a
reroute or a weight sync costs one prefill of the context, never a compounding debt;
re-prefilled tokens (what some cache held before) are counted.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tidal.sim.dispatch import ExecRec
    from tidal.sim.world import World


def begin_turn(w: World, ex: ExecRec) -> None:
    """The turn's model request: it decodes the turn's tokens after prefilling whatever
    of its context its engine's cache lacks (``start_seq``)."""
    dec = float(ex.spec.turns[ex.turn][0])
    if ex.engine is None or ex.hold:
        ex.pending = dec
    else:
        start_seq(w, ex, dec)


def start_seq(w: World, ex: ExecRec, decode_tokens: float) -> None:
    """Sends the turn's request with ``decode_tokens`` left to decode: its context is
    the turn's context plus what the turn decoded so far (partial rollout); the engine
    prefills the part its cache lacks, once. Prefilled tokens that some cache held
    before count as re-prefill."""
    full = ex.ctx + max(0.0, ex.spec.turns[ex.turn][0] - decode_tokens)
    pre = max(0.0, full - ex.cached)
    w.reprefill_tokens += int(max(0.0, min(full, ex.hw) - ex.cached))
    ex.base, ex.cached = ex.cached, int(full)
    ex.hw = max(ex.hw, int(full))
    w.seg_no += 1
    ex.seg = w.seg_no
    w.seqs[w.seg_no] = ex
    e = ex.engine
    assert e is not None
    e.add(w.seg_no, decode_tokens, w.now, full, ex.gid, prefill_tokens=pre)
    w.resched(e)


def stop_seq(w: World, ex: ExecRec) -> float:
    """Takes the request off its engine; returns the decode tokens its turn has left. The
    cache keeps what was computed (a prefill not yet done is lost)."""
    e = ex.engine
    assert e is not None and ex.seg is not None
    prefilling = e.in_prefill(ex.seg)
    rem = e.remove(ex.seg, w.now)
    ex.cached = ex.base if prefilling else int(ex.ctx + max(0.0, ex.spec.turns[ex.turn][0] - rem))
    ex.hw = max(ex.hw, ex.cached)
    del w.seqs[ex.seg]
    ex.seg = None
    w.resched(e)
    return rem
