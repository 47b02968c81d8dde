"""The executions of a real run as simulator workloads (``tidal calibrate``; ``from_run``).

In: ``executions.jsonl`` lines (per execution: group, burst, reason, reward, dispatch time and
per model call its prompt and output tokens, call and tool seconds). Out: a parametric class
(``fit_workload``: capped lognormals, see ``from_run``), the same executions as a replayable
trace (``trace_lines``, the format of ``workloads.load_trace``) and the dispatcher's measured
interval between groups. Pure functions of their inputs, which are the run directory's own
line models (``contracts.run_files.ExecutionLine``), never dicts read by key.
"""

from __future__ import annotations

import itertools
import math
import statistics as st
from typing import Any

from tidal.contracts.run_files import CallLine, ExecutionLine
from tidal.errors import ConfigError


def dist(values: list[float], integer: bool = False) -> dict[str, float]:
    """A capped lognormal describing ``values`` (median, std of the logs, max, min)."""
    xs = [float(v) for v in values if v is not None]
    if not xs:
        return {"median": 0.0, "sigma": 0.0}
    pos = [math.log(x) for x in xs if x > 0]
    sigma = st.pstdev(pos) if len(pos) > 1 else 0.0
    med = st.median(xs)
    return {
        "median": round(med, 4),
        "sigma": round(sigma, 4),
        "cap": round(max(max(xs), 1.0 if integer else 1e-6), 4),
        "lo": round(min(xs), 4),
    }


# ------------------------------------------------------------------------ workload


def prefill_tokens(calls: list[CallLine]) -> list[int]:
    """Per call, the tokens the simulator prefills: the prompt, then each tool output."""
    out = []
    for k, c in enumerate(calls):
        if k == 0:
            out.append(c.prompt_tokens)
        else:
            prev = calls[k - 1]
            out.append(max(0, c.prompt_tokens - prev.prompt_tokens - prev.output_tokens))
    return out


def fit_workload(execs: list[ExecutionLine], timeout_s: float) -> dict[str, Any]:
    # Whatever closed it (completed, failed, timed out), an execution's calls took their time.
    done = [e for e in execs if e.calls]
    if not done:
        raise ConfigError("executions.jsonl", "no execution with model calls")
    decode, tools, touts, logs_by_group = [], [], [], {}
    for e in done:
        calls = e.calls
        decode += [c.output_tokens for c in calls]
        tools += gaps_s(e)[1][:-1]
        touts += prefill_tokens(calls)[1:]
        mean_log = st.fmean(math.log(max(1, c.output_tokens)) for c in calls)
        logs_by_group.setdefault(e.group, []).append(mean_log)
    all_logs = [x for g in logs_by_group.values() for x in g]
    total_var = st.pvariance(all_logs) if len(all_logs) > 1 else 0.0
    grand = st.fmean(all_logs)
    between = sum(len(g) * (st.fmean(g) - grand) ** 2 for g in logs_by_group.values())
    share = between / len(all_logs) / total_var if total_var > 0 else 1.0
    turns = dist([len(e.calls) for e in done], integer=True)
    turns["lo"] = 1.0
    return {
        "name": "run",
        "turns": turns,
        "decode_tokens": dist(decode, integer=True),
        "tool_s": dist(tools),
        "tool_output_tokens": dist(touts, integer=True),
        "prompt_tokens": int(st.median(e.calls[0].prompt_tokens for e in done)),
        "group_share": round(min(1.0, max(0.0, share)), 4),
        "timeout_s": timeout_s,
        "success_rate": round(sum(e.reward > 0 for e in done) / len(done), 4),
    }


def dispatch_interval_s(execs: list[ExecutionLine], configured: float) -> float:
    """Mean gap between the first dispatches of consecutive groups of a burst (the runtime's
    dispatcher sleeps ``runtime.dispatch_interval_s`` on a busy event loop: it runs late)."""
    first: dict[tuple[int | None, str], float] = {}
    for e in execs:
        if e.dispatched_s is not None:
            key = (e.burst, e.group)
            first[key] = min(first.get(key, math.inf), e.dispatched_s)
    gaps = []
    for burst in {b for b, _ in first}:
        ts = sorted(t for (b, _), t in first.items() if b == burst)
        gaps += [b - a for a, b in itertools.pairwise(ts)]
    return round(st.fmean(gaps), 4) if gaps and configured > 0 else configured


def gaps_s(e: ExecutionLine) -> tuple[float, list[float]]:
    """An execution's harness time before its first call (launch to call), and after each
    call (to the next call, or to its close: tool steps, the final step, the harness's own
    work); the tool step alone where the calls carry no start times."""
    calls = e.calls
    timed = [(c.start_s, c.call_s) for c in calls if c.start_s is not None and c.call_s is not None]
    if not calls or len(timed) < len(calls) or e.launched_s is None or e.closed_s is None:
        return 0.0, [c.tool_s or 0.0 for c in calls]
    ends = [s + d for s, d in timed]
    nexts = [s for s, _ in timed[1:]] + [e.closed_s]
    return (
        max(0.0, timed[0][0] - e.launched_s),
        [max(0.0, n - x) for x, n in zip(ends, nexts, strict=True)],
    )


def trace_lines(execs: list[ExecutionLine]) -> list[dict[str, Any]]:
    """The run's executions in the simulator's trace format (``workloads.load_trace``), with
    the harness time around the calls (``gaps_s``) as setup and tool steps."""
    out = []
    for e in sorted(execs, key=lambda e: (e.group, e.execution)):
        calls = e.calls
        if not calls or any(c.output_tokens < 1 for c in calls):
            continue
        pre = prefill_tokens(calls)
        setup, after = gaps_s(e)
        out.append(
            {
                "group": e.group,
                "prompt_tokens": pre[0],
                "setup_s": round(setup, 4),
                "reward": e.reward,
                "turns": [
                    {
                        "decode_tokens": c.output_tokens,
                        "tool_s": round(after[k], 4),
                        "tool_output_tokens": pre[k + 1] if k < len(calls) - 1 else 0,
                    }
                    for k, c in enumerate(calls)
                ],
            }
        )
    return out
