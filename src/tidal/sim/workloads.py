"""Workloads: GRPO groups of executions, drawn from classes or replayed from a JSONL trace.

Out: ``ExecSpec`` objects (prompt tokens, turns of decode tokens + tool seconds + tool output
tokens, timeout, reward), one list per group. Lengths are capped lognormals; a share of the
log-variance is common to the group (the prompt's difficulty), the rest per execution.
Randomness comes from one seeded numpy ``Generator``: the same seed gives the same workload.

Trace format (one JSON object per line, one line per execution; lines of a group adjacent)::

    {"group": "g1", "prompt_tokens": 400, "reward": 1.0,
     "turns": [{"decode_tokens": 900, "tool_s": 2.5, "tool_output_tokens": 300}, ...]}

Optional per line: ``setup_s`` (harness time before the first call). A last turn's ``tool_s``
is the harness's final step (e.g. scoring) before the execution closes.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from tidal.errors import ConfigError
from tidal.sim.scenario import Dist, ExecutionClass, WorkloadConfig

Turn = tuple[int, float, int]  # decode tokens, tool seconds after the turn, tool output tokens


@dataclass(frozen=True, slots=True)
class ExecSpec:
    prompt_tokens: int
    turns: tuple[Turn, ...]
    timeout_s: float | None
    reward: float
    cls: str = "default"
    setup_s: float = 0.0  # harness time before the first call (workspace, registration)

    @property
    def decode_tokens(self) -> int:
        return sum(t[0] for t in self.turns)

    @property
    def prefill_tokens(self) -> int:
        """Tokens prefilled once if nothing is ever recomputed (prompt + tool outputs)."""
        return self.prompt_tokens + sum(t[2] for t in self.turns[:-1])

    @property
    def train_tokens(self) -> int:
        return self.prefill_tokens + self.decode_tokens

    def min_duration_s(self, seq_cap_tok_s: float) -> float:
        """The fastest this execution can possibly run (decode at the cap, tools as drawn)."""
        return self.decode_tokens / seq_cap_tok_s + self.setup_s + sum(t[1] for t in self.turns)


def draw(d: Dist, z: float) -> float:
    v = d.median * math.exp(d.sigma * z) if d.median > 0 else 0.0
    if d.cap is not None:
        v = min(v, d.cap)
    return max(v, d.lo)


class ClassWorkload:
    """Groups drawn from weighted execution classes (vectorised per group with numpy)."""

    def __init__(self, classes: list[ExecutionClass], seed: int, batch_groups: int = 1) -> None:
        import numpy as np

        self.classes = classes
        self.batch_groups = max(1, batch_groups)
        self.drawn = 0  # groups drawn so far: the clock of length drift
        self.rng = np.random.default_rng(seed)
        total = sum(c.weight for c in classes)
        self._cum = []
        acc = 0.0
        for c in classes:
            acc += c.weight / total
            self._cum.append(acc)

    def _pick(self) -> ExecutionClass:
        u = float(self.rng.random())
        for c, edge in zip(self.classes, self._cum, strict=True):
            if u <= edge:
                return c
        return self.classes[-1]

    def group(self, size: int) -> list[ExecSpec]:
        import numpy as np

        c = _drifted(self._pick(), self.drawn / self.batch_groups)
        self.drawn += 1
        rng = self.rng
        a, b = math.sqrt(c.group_share), math.sqrt(1.0 - c.group_share)
        zg_len, zg_turns, z_ok = rng.standard_normal(3)
        p_ok = min(1.0, max(0.0, c.success_rate + 0.3 * float(z_ok)))
        z_exec = rng.standard_normal((2, size))
        n_turns = np.maximum(1, np.rint(_draw_np(c.turns, a * zg_turns + b * z_exec[0])))
        z_len = a * zg_len + b * z_exec[1]
        counts = n_turns.astype(int)
        total = int(counts.sum())
        z_turn = rng.standard_normal((3, total))
        owner = np.repeat(np.arange(size), counts)
        # Turns of one execution vary around its own length level.
        z_dec = np.where(counts[owner] == 1, z_len[owner], 0.7 * z_len[owner] + 0.71 * z_turn[0])
        dec = np.maximum(1, np.rint(_draw_np(c.decode_tokens, z_dec))).astype(int).tolist()
        tool = _draw_np(c.tool_s, z_turn[1]).tolist()
        tout = np.rint(_draw_np(c.tool_output_tokens, z_turn[2])).astype(int).tolist()
        rewards = (rng.random(size) < p_ok).tolist()
        out, k = [], 0
        for i, n in enumerate(counts.tolist()):
            turns = [(dec[j], tool[j], tout[j]) for j in range(k, k + n - 1)]
            turns.append((dec[k + n - 1], 0.0, 0))  # nothing follows the last turn
            k += n
            out.append(
                ExecSpec(
                    c.prompt_tokens, tuple(turns), c.timeout_s, 1.0 if rewards[i] else 0.0, c.name
                )
            )
        return out


def _drifted(c: ExecutionClass, steps: float) -> ExecutionClass:
    """The class with its medians moved by its drift after ``steps`` steps' worth of groups."""
    d = c.drift
    if d is None or steps <= 0:
        return c
    dec = max(d.floor, 1.0 + d.decode_growth_per_step * steps)
    turns = max(d.floor, 1.0 + d.turns_growth_per_step * steps)
    return c.model_copy(
        update={
            "decode_tokens": c.decode_tokens.model_copy(
                update={"median": c.decode_tokens.median * dec}
            ),
            "turns": c.turns.model_copy(update={"median": c.turns.median * turns}),
        }
    )


def _draw_np(d: Dist, z):
    import numpy as np

    if d.median <= 0:
        return np.full(np.shape(z), d.lo, dtype=float)
    v = d.median * np.exp(d.sigma * z)
    if d.cap is not None:
        v = np.minimum(v, d.cap)
    return np.maximum(v, d.lo)


class TraceWorkload:
    """Replays a JSONL trace group by group, cycling when it runs out."""

    def __init__(self, path: str | Path) -> None:
        self.groups = load_trace(path)
        if not self.groups:
            raise ConfigError("workload.trace", f"{path}: the trace holds no executions")
        self._next = 0

    def group(self, size: int) -> list[ExecSpec]:
        g = self.groups[self._next % len(self.groups)]
        self._next += 1
        return g


def load_trace(path: str | Path) -> list[list[ExecSpec]]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError("workload.trace", f"{p}: no such trace file")
    groups: list[list[ExecSpec]] = []
    last_gid: object = object()
    for n, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            turns = tuple(
                (
                    int(t["decode_tokens"]),
                    float(t.get("tool_s", 0.0)),
                    int(t.get("tool_output_tokens", 0)),
                )
                for t in rec["turns"]
            )
            if not turns or any(t[0] < 1 or t[1] < 0 or t[2] < 0 for t in turns):
                raise ValueError("turns must be non-empty with decode_tokens >= 1")
            spec = ExecSpec(
                int(rec.get("prompt_tokens", 0)),
                turns,
                rec.get("timeout_s"),
                float(rec.get("reward", 0.0)),
                str(rec.get("class", "trace")),
                float(rec.get("setup_s", 0.0)),
            )
            if spec.setup_s < 0:
                raise ValueError("setup_s must be >= 0")
            gid = rec["group"]
        except (ValueError, KeyError, TypeError) as exc:
            raise ConfigError("workload.trace", f"{p}:{n}: bad trace line ({exc})") from None
        if gid != last_gid:
            groups.append([])
            last_gid = gid
        groups[-1].append(spec)
    return groups


def make_workload(
    cfg: WorkloadConfig, seed: int, batch_groups: int = 1
) -> ClassWorkload | TraceWorkload:
    """The scenario's workload; ``batch_groups`` (groups per optimizer step) clocks drift."""
    if cfg.trace:
        return TraceWorkload(cfg.trace)
    return ClassWorkload(cfg.classes, seed, batch_groups)


def write_trace(path: str | Path, groups: list[list[ExecSpec]]) -> None:
    """Writes groups in the trace format (used to export a drawn workload)."""
    with open(path, "w") as fh:
        for gi, group in enumerate(groups):
            for spec in group:
                fh.write(
                    json.dumps(
                        {
                            "group": f"g{gi}",
                            "prompt_tokens": spec.prompt_tokens,
                            **({"setup_s": spec.setup_s} if spec.setup_s else {}),
                            "reward": spec.reward,
                            "class": spec.cls,
                            "turns": [
                                {"decode_tokens": d, "tool_s": t, "tool_output_tokens": o}
                                for d, t, o in spec.turns
                            ],
                        }
                    )
                    + "\n"
                )
