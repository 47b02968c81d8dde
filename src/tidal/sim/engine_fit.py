"""Engine speed from a real run's model calls (``tidal calibrate``; ``from_run``).

In: per model call its engine (the last segment's), start, duration and output tokens
(``executions.jsonl``). Out: the simulator's processor-sharing engine: per-engine decode
throughput ``T`` (``decode_tok_s_per_gpu``, one "GPU" per engine), per-sequence cap ``C``
(``seq_cap_tok_s``) and, for engines sharing one host's cores (CPU runs), the host's
throughput ``H`` (``host_tok_s``; None when it never binds). Pure.

The fit is on throughput, what burst times depend on: each call's output tokens are spread
evenly over its duration; between consecutive call starts and ends the host's token rate and
the calls in flight per engine ``n_e`` are constant. The model rate there is
``sum_e min(n_e * C, T, n_e * H / n_h)`` (every call at ``min(C, T / n_e, H / n_h)``, ``n_h``
the calls on the host). ``(C, T, H)`` minimise the time-weighted squared error against the
measured rate: a log grid, each also unbounded; of fits within ``PARSIMONY`` of the rate
variance the least binding wins (a limit the run never reached must not bind the simulation).
Calls queued in front of an engine count as in flight: their wait is part of the measured
duration, as it is of the rate.

Prefill is not fitted separately (``prefill_equiv`` 0): the rates are output tokens per second
of calls with their prompts, which holds while the prompt/output mix is the calibration run's.
"""

from __future__ import annotations

import math
from typing import Any

from tidal.contracts.run_files import ExecutionLine
from tidal.errors import ConfigError

GRID = 28
UNBOUNDED = 1e12  # tokens/s: a limit that never binds
PARSIMONY = 0.002  # share of the rate variance a more binding limit must explain to be kept

Call = tuple[str, float, float, int]  # engine, start_s, duration_s, output tokens


def call_rows(execs: list[ExecutionLine]) -> list[Call]:
    """(engine, start_s, call_s, output tokens) of every timed call that produced tokens."""
    rows = []
    for e in execs:
        for c in e.calls:
            if (
                (c.call_s or 0) > 0
                and c.engines
                and c.output_tokens > 0
                and c.start_s is not None
                and c.call_s is not None
            ):
                rows.append((c.engines[-1], c.start_s, c.call_s, c.output_tokens))
    return rows


def intervals(rows: list[Call]) -> tuple[list[float], list[list[int]], list[float], list[str]]:
    """Durations, calls in flight per engine and host token rate of the pieces between
    consecutive call starts and ends; and the engine names."""
    engines = sorted({r[0] for r in rows})
    idx = {e: i for i, e in enumerate(engines)}
    events = []
    for eng, s, d, o in rows:
        events.append((s, idx[eng], 1, o / d))
        events.append((s + d, idx[eng], -1, -o / d))
    events.sort(key=lambda x: (x[0], x[2]))
    counts, rate, last = [0] * len(engines), 0.0, events[0][0]
    durs, ns, rates = [], [], []
    for t, i, step, dr in events:
        if t > last and any(counts):
            durs.append(t - last)
            ns.append(list(counts))
            rates.append(max(0.0, rate))
        counts[i] += step
        rate += dr
        last = t
    return durs, ns, rates, engines


def fit_engine(execs: list[ExecutionLine]) -> tuple[dict[str, Any], dict[str, Any]]:
    import numpy as np

    rows = call_rows(execs)
    if len(rows) < 3:
        raise ConfigError(
            "executions.jsonl",
            f"{len(rows)} timed model calls: too few to fit "
            "the engine (need call_s, start_s and engines per call)",
        )
    durs, ns, rates, _ = intervals(rows)
    dur, n, rate = np.array(durs), np.array(ns, dtype=float), np.array(rates)
    per_call = np.array([o / d for _, _, d, o in rows])
    lo, hi = per_call.min(), 4 * max(rate.max(), per_call.max())
    # unbounded (UNBOUNDED) first, then descending
    grid = np.append(UNBOUNDED, np.geomspace(hi, lo, GRID))
    best = (math.inf, UNBOUNDED, UNBOUNDED, UNBOUNDED)
    total = float((dur * (rate - (dur * rate).sum() / dur.sum()) ** 2).sum())
    nh = np.maximum(n.sum(1, keepdims=True), 1.0)
    slack = PARSIMONY * total  # a more binding limit must explain this much more
    for c in grid:
        for h in grid:
            base = np.minimum(n * c, n * h / nh)  # [I, E]: before the engine's own limit
            pred = np.minimum(base[None, :, :], grid[:, None, None]).sum(-1)  # [T, I]
            err = (dur[None, :] * (rate[None, :] - pred) ** 2).sum(1)
            i = int(np.argmax(err <= err.min() + slack))  # the least binding near-best T
            if err[i] < best[0] - slack:
                best = (float(err[i]), float(c), float(grid[i]), float(h))
    err, c_, t_, h_ = best
    fit = {
        "decode_tok_s_per_gpu": round(min(t_, float(hi)), 3),
        "seq_cap_tok_s": round(min(c_, float(hi)), 3),
        "prefill_equiv": 0.0,
        "host_tok_s": round(h_, 3) if h_ < UNBOUNDED else None,
    }
    busy = dur.sum()
    return fit, {
        "calls": len(rows),
        "r2": round(1 - err / total, 4) if total > 0 else None,
        "mean_host_tok_s": round(float((dur * rate).sum() / busy), 2),
        "mean_calls_in_flight": round(float((dur * n.sum(1)).sum() / busy), 2),
    }
