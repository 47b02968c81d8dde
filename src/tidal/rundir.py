"""The run directory: a ``tidal run`` directory read into plain values (no plots, Ray, torch).

In: a run directory as ``tidal run`` writes it (schema: ``tidal.contracts.run_files``):
``summary.json`` (required), ``config.yaml``, ``metrics.jsonl``, ``state.jsonl``, ``timeline.json``,
``executions.jsonl`` (each optional). Out: ``RunData`` holding them, and the figures derived
from them that the report and the comparison print: reward first/last-quarter means, the mean
reward over GRPO groups with its standard error, and per-burst times and utilization.
Invariant: a missing optional file reads as ``None`` and its figures are skipped; a file that is
present but malformed (bad JSON, a line that is not an object, a missing key) raises
``ConfigError`` naming the file and line, so a bad directory is one readable line, never a
traceback. Unknown keys are ignored, missing summary keys read as absent.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from tidal.contracts import run_files as schema
from tidal.contracts.run_files import M
from tidal.errors import ConfigError

if TYPE_CHECKING:
    from tidal.json_types import JSON

# verl's per-version metrics, on the final step of each burst (``dynamic_resource/*``)
UTIL_KEYS = {
    "train": "dynamic_resource/train_resource_utilization",
    "rollout": "dynamic_resource/rollout_resource_utilization",
    "cluster": "dynamic_resource/resource_utilization",
}
GENERATED_KEY = "fully_async/rollouter/step_generated_samples"

_METRIC_KEYS = ("t", "burst", "step", "mean_reward")
_STATE_KEYS = ("t",)


@dataclass
class RunData:
    path: Path
    summary: dict[str, Any]
    config: dict[str, Any] | None
    metrics: list[dict[str, Any]] | None
    states: list[dict[str, Any]] | None
    timeline: list[list[tuple[float, float, str]]] | None
    group_rewards: dict[str, float] | None = None  # GRPO group -> mean reward of its executions

    @property
    def emulated(self) -> dict[str, Any] | None:
        """An emulated run's ``runtime.emulate`` (scenario, k); None for a real run."""
        emu = ((self.config or {}).get("runtime") or {}).get("emulate")
        if isinstance(emu, dict):
            return emu
        return {"banner": self.summary["emulated"]} if "emulated" in self.summary else None

    @property
    def policy(self) -> str:
        """The policy spec: ``name[:k=v,...]`` from the resolved config, else the summary's;
        an emulated run's says so first (every figure's title starts with it)."""
        emu = self.emulated
        mark = "EMULATED" + (f" k={emu['k']:g}" if "k" in (emu or {}) else "") + " " if emu else ""
        pol = (self.config or {}).get("policy")
        if isinstance(pol, dict) and pol.get("name"):
            args = pol.get("args") or {}
            spec = ",".join(f"{k}={v}" for k, v in sorted(args.items()))
            return mark + (f"{pol['name']}:{spec}" if spec else str(pol["name"]))
        return mark + str(self.summary.get("policy", self.path.name))

    def rewards(self) -> tuple[list[int], list[float]]:
        """Optimizer steps and their mean rewards (metrics.jsonl, else the summary's list)."""
        if self.metrics:
            return (
                [int(m["step"]) for m in self.metrics],
                [float(m["mean_reward"]) for m in self.metrics],
            )
        per_step = self.summary.get("mean_reward_per_step") or []
        return list(range(len(per_step))), [float(r) for r in per_step]

    def reward_quarters(self) -> tuple[float | None, float | None]:
        return quarter_means(self.rewards()[1])

    def reward_noise(self) -> tuple[float | None, float | None, int]:
        """Mean reward over the run's GRPO groups, its standard error (groups are the
        independent units: the executions of one group share a prompt) and the group count;
        (None, None, n) without executions.jsonl or with fewer than two groups."""
        vals = list((self.group_rewards or {}).values())
        mean = statistics.fmean(vals) if vals else None
        se = statistics.stdev(vals) / len(vals) ** 0.5 if len(vals) >= 2 else None
        return mean, se, len(vals)

    def reward_change(self) -> dict[str, Any] | None:
        """The learning figure: mean reward of the GRPO groups trained in the last quarter of
        the optimizer steps minus that of the first quarter's, each with its standard error
        over groups (the independent units), the difference's standard error
        (``sqrt(se_first² + se_last²)``) and the difference in those errors (``z``). None
        without per-step group lists (``metrics.jsonl``), group rewards, or two groups in each
        quarter."""
        steps = [m.get("groups") for m in self.metrics or []]
        if not steps or any(not isinstance(g, list) for g in steps) or not self.group_rewards:
            return None
        q = max(1, len(steps) // 4)
        parts = []
        for chunk in (steps[:q], steps[-q:]):
            vals = [self.group_rewards[g] for gs in chunk for g in gs if g in self.group_rewards]
            if len(vals) < 2:
                return None
            parts.append(
                (statistics.fmean(vals), statistics.stdev(vals) / len(vals) ** 0.5, len(vals))
            )
        (m1, se1, n1), (m2, se2, n2) = parts
        se = (se1**2 + se2**2) ** 0.5
        return {
            "steps_each": q,
            "first": m1,
            "first_se": se1,
            "first_groups": n1,
            "last": m2,
            "last_se": se2,
            "last_groups": n2,
            "change": m2 - m1,
            "change_se": se,
            "z": (m2 - m1) / se if se > 0 else None,
        }

    def n_steps(self) -> int:
        steps = self.summary.get("trainer_steps")
        return int(steps) if isinstance(steps, int) else len(self.rewards()[1])

    def relative_times(self) -> bool:
        """Whether metrics.jsonl's ``t`` counts from the first dispatch (runs written before the
        runtime did so carry the wall clock; no step can come after the whole run's time)."""
        run_s = self.summary.get("run_time_s")
        if not self.metrics or not isinstance(run_s, int | float):
            return True
        return max(float(m["t"]) for m in self.metrics) <= run_s + 1.0

    def cell_names(self) -> list[str]:
        """Names from the summary's ``final_roles`` (``core:R sat1:T``), else ``cell i``."""
        n = len(self.timeline) if self.timeline is not None else self.cell_count()
        names = [part.split(":")[0] for part in str(self.summary.get("final_roles", "")).split()]
        return names if len(names) == n else [f"cell {i}" for i in range(n)]

    def cell_count(self) -> int:
        cluster = (self.config or {}).get("cluster") or {}
        if isinstance(cluster.get("cells"), list):
            return len(cluster["cells"])
        return int(cluster.get("cell_count", 0))

    def config_line(self) -> str:
        """The run in one line: policy, cells, standalone engines, model, task, schedule."""
        cfg = self.config
        if cfg is None:
            return f"policy `{self.policy}` (no config.yaml: cluster, model and task unknown)"
        cl, ctl, rt = (cfg.get(k) or {} for k in ("cluster", "control", "runtime"))
        if isinstance(cl.get("cells"), list):
            gpus = sum(int(c.get("gpus", 0)) for c in cl["cells"])
            cells = f"{len(cl['cells'])} cells ({gpus} GPUs)"
        else:
            cells = (
                f"{cl.get('cell_count', '?')} cells × {cl.get('cell_gpus', '?')} GPU "
                f"({cl.get('cell_slots', '?')} slots)"
            )
        standalone = int(cl.get("standalone_count", 0) or 0)
        if standalone:
            cells += f" + {standalone} standalone engine{'s' if standalone > 1 else ''}"
        task = rt.get("task", "arithmetic")  # an older run kept its built-in task there
        if isinstance(cfg.get("task"), dict):  # the task: section
            src, agent = cfg["task"].get("source") or {}, cfg["task"].get("agent") or {}
            kind, by = src.get("kind", "?"), agent.get("kind", "chat")
            task = (
                kind
                if kind in ("arithmetic", "workspace") and by == "chat"
                else (f"{kind}{':' + src['name'] if src.get('name') else ''}, {by} agent")
            )
        return (
            f"policy `{self.policy}` · {cells} · model `{rt.get('model', '?')}` · "
            f"task `{task}` · {ctl.get('bursts', '?')} bursts × "
            f"{ctl.get('updates_per_burst', '?')} updates × {ctl.get('batch_groups', '?')} "
            f"groups of {ctl.get('group_size', '?')}"
        )

    def config_without_policy(self) -> dict[str, Any]:
        """The resolved config flattened to dotted keys, minus what names the run or policy."""
        flat: dict[str, Any] = {}

        def walk(prefix: str, val: object) -> None:
            if isinstance(val, dict):
                for k, v in val.items():
                    walk(f"{prefix}.{k}" if prefix else str(k), v)
            else:
                flat[prefix] = val

        walk("", {k: v for k, v in (self.config or {}).items() if k not in ("policy", "name")})
        return flat


def quarter_means(values: list[float]) -> tuple[float | None, float | None]:
    """Means of the first and the last quarter (at least one value each); None when empty."""
    if not values:
        return None, None
    q = max(1, len(values) // 4)
    return sum(values[:q]) / q, sum(values[-q:]) / q


def burst_rows(run: RunData) -> list[dict[str, Any]]:
    """Per burst: steps, the time from the previous burst's final optimizer step (or the first
    dispatch) to this burst's final step, and verl's utilization of the burst's last version."""
    rows: list[dict[str, Any]] = []
    prev_end: float | None = 0.0 if run.relative_times() else None
    by_burst: dict[int, list[dict[str, Any]]] = {}
    for m in run.metrics or []:
        by_burst.setdefault(int(m["burst"]), []).append(m)
    for burst in sorted(by_burst):
        lines = by_burst[burst]
        end = max(float(m["t"]) for m in lines)
        final = next((m for m in reversed(lines) if UTIL_KEYS["train"] in m), None)
        row: dict[str, Any] = {
            "burst": burst,
            "steps": len(lines),
            "start_s": prev_end,
            "end_s": end,
            "time_s": None if prev_end is None else end - prev_end,
            "version": final.get("version") if final else None,
        }
        for name, key in UTIL_KEYS.items():
            row[f"{name}_utilization"] = final.get(key) if final else None
        row["generated_samples"] = final.get(GENERATED_KEY) if final else None
        rows.append(row)
        prev_end = end
    return rows


def load_run(path: str | Path) -> RunData:
    """Read a run directory; ``ConfigError`` (one line, naming the path) when it is not one."""
    root = Path(path)
    if not root.exists():
        raise ConfigError(str(root), "no such run directory")
    if not root.is_dir():
        raise ConfigError(str(root), "not a directory (give the run directory of `tidal run`)")
    if not (root / "summary.json").is_file():
        raise ConfigError(
            str(root),
            "not a run directory: no summary.json (written by `tidal run` when the run ends)",
        )
    summary = _read_json(root / "summary.json")
    if not isinstance(summary, dict):
        raise ConfigError(str(root / "summary.json"), "not a JSON object")
    schema.check(schema.Summary, summary, str(root / "summary.json"))
    return RunData(
        path=root,
        summary=summary,
        config=_read_config(root / "config.yaml"),
        metrics=read_jsonl(root / "metrics.jsonl", _METRIC_KEYS, schema.MetricsLine),
        states=read_jsonl(root / "state.jsonl", _STATE_KEYS, schema.StateLine),
        timeline=_read_timeline(root / "timeline.json"),
        group_rewards=_group_rewards(root / "executions.jsonl"),
    )


def _group_rewards(path: Path) -> dict[str, float] | None:
    rows = read_lines(path, schema.ExecutionLine)
    if rows is None:
        return None
    by: dict[str, list[float]] = {}
    for r in rows:
        if r.reward is not None:  # reward_error: no reward
            by.setdefault(r.group, []).append(r.reward)
    return {g: sum(x / len(v) for x in v) for g, v in by.items()}


def _read_json(path: Path) -> JSON:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(str(path), f"cannot read: {exc}") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(str(path), f"not valid JSON: {exc.msg} (line {exc.lineno})") from None


def read_jsonl(
    path: Path, required: tuple[str, ...] = (), model: type[BaseModel] | None = None
) -> list[dict[str, Any]] | None:
    """The objects of a JSONL file of a run directory (None if it is absent); a bad line, a
    missing ``required`` key or a value ``model`` (``tidal.contracts.run_files``) refuses is a
    ``ConfigError`` naming the file and line."""
    objs = _objects(path)
    if objs is None:
        return None
    out = []
    for n, obj in objs:
        missing = [k for k in required if k not in obj]
        if missing:
            raise ConfigError(f"{path}:{n}", f"missing key(s) {', '.join(missing)}")
        bad = [k for k in required if not _is_number(obj[k])]
        if bad:
            raise ConfigError(f"{path}:{n}", f"key(s) {', '.join(bad)} must be numbers")
        out.append(obj if model is None else schema.check(model, obj, f"{path}:{n}"))
    return out


def read_lines(path: Path, model: type[M]) -> list[M] | None:
    """The lines of a run-directory file as ``model`` instances (``tidal.contracts.run_files``;
    None if the file is absent); a bad line is a ``ConfigError`` naming the file, line and
    field."""
    objs = _objects(path)
    if objs is None:
        return None
    return [schema.parse(model, obj, f"{path}:{n}") for n, obj in objs]


def _objects(path: Path) -> list[tuple[int, dict[str, Any]]] | None:
    """(line number, object) of every non-blank line of a JSONL file (None if absent)."""
    if not path.is_file():
        return None
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(str(path), f"cannot read: {exc}") from None
    out = []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}:{n}", f"not valid JSON: {exc.msg}") from None
        if not isinstance(obj, dict):
            raise ConfigError(f"{path}:{n}", "not a JSON object")
        out.append((n, obj))
    return out


def _is_number(val: object) -> bool:
    return isinstance(val, int | float) and not isinstance(val, bool)


def _read_timeline(path: Path) -> list[list[tuple[float, float, str]]] | None:
    if not path.is_file():
        return None
    data = _read_json(path)
    cells = data.get("cells") if isinstance(data, dict) else None
    if not isinstance(cells, list):
        raise ConfigError(str(path), 'expected {"cells": [[[start_s, end_s, role], ...], ...]}')
    out = []
    for i, segs in enumerate(cells):
        try:
            out.append([(float(a), float(b), str(r)) for a, b, r in segs])
        except (TypeError, ValueError):
            raise ConfigError(
                f"{path}: cells.{i}", "segments must be [start_s, end_s, role]"
            ) from None
    return out


def _read_config(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    import yaml

    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(str(path), f"not readable YAML: {str(exc).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ConfigError(str(path), "not a YAML mapping")
    return data
