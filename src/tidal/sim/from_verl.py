"""A simulator scenario fitted on a verl run's logged metrics (``tidal calibrate --verl-log``).

In: a verl metrics log, one row per training step, in any of verl's own logger formats: the
file logger's JSONL (``{"step": N, "data": {key: value}}``), flat JSONL (``{"step": N, key:
value}``), the console logger's lines (``step:N - key:value - ...``) or a CSV export of the same
keys (a header row; one row per step). verl's own metric names are read: ``timing_s/gen``,
``timing_s/update_actor`` (with ``timing_s/old_log_prob`` and ``timing_s/ref`` when logged),
``timing_s/update_weights``, ``response_length/{mean,max,min,clip_ratio}``,
``prompt_length/mean``, ``perf/total_num_tokens``, ``perf/throughput`` and ``perf/time_per_step``
(or ``timing_s/step``). Plus what the metrics do not hold: the GRPO group size (verl's
``actor_rollout_ref.rollout.n``). Out: a ``VerlFit`` (every fitted number, named) and a validated
``Scenario``. Pure: reads one file.

What is fitted, and from what (per step ``k``; ``G`` GPUs; ``n`` samples per step):
- ``n = total_num_tokens / (prompt_length/mean + response_length/mean)`` (median over steps);
  ``G = total_num_tokens / (throughput * time_per_step)`` (median), unless given.
- response lengths: a capped lognormal. ``cap`` = the largest ``response_length/max`` when some
  step clipped (``clip_ratio > 0``), else none. With ``e_n`` the expected largest of ``n``
  standard normals, ``log(mean / min) = sigma**2 / 2 + sigma * e_n`` gives ``sigma`` (the
  mean over steps of the per-step solution), and ``median = mean / exp(sigma**2 / 2)`` from the
  steps that did not clip.
- rollout: a batch's generation time is ``W / (T * G) + M / C`` (the decode work ``W = n *
  response mean`` at the engines' throughput ``T`` per GPU while loaded, then the longest
  response ``M`` alone at the per-sequence cap ``C``), fitted by least squares over steps.
- training: ``R = total_num_tokens / (G * (update_actor + old_log_prob + ref))`` (median) on
  all ``G`` GPUs; one cell of the scenario trains at ``R / e**log2(cells)`` per GPU (``e``:
  scaling efficiency, the scenario's default), so that all cells together train at ``R``.
- weight sync: ``sync_latency_s`` = mean ``timing_s/update_weights`` (``weight_gb`` 0).
The scenario: ``G / cell_gpus`` elastic cells (slots: every sample of a step at once), the
group size and batch of the run, the fitted workload, engine, trainer and sync; one burst per
logged step (one update per version, as verl's trainer). Its policies: ``colocate`` (the
synchronous colocated schedule a verl run of this shape uses), ``waterlevel`` and ``tidal``;
verl's fully-async policies need hybrid cells beside standalone engines, which a colocated run
does not have.
"""

from __future__ import annotations

import csv
import json
import math
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tidal.config import validate_model
from tidal.errors import ConfigError
from tidal.sim.scenario import Scenario

REQUIRED = (
    "timing_s/gen",
    "timing_s/update_actor",
    "response_length/mean",
    "response_length/max",
    "response_length/min",
    "prompt_length/mean",
    "perf/total_num_tokens",
)
FIELD = "verl_log"


@dataclass(frozen=True)
class VerlFit:
    steps: int
    gpus: int
    samples_per_step: int
    prompt_tokens: int
    decode_median: float
    decode_sigma: float
    decode_cap: float | None
    decode_tok_s_per_gpu: float
    seq_cap_tok_s: float
    train_tok_s_per_gpu: float  # on all GPUs together
    sync_s: float
    logged_s: float | None  # the run's own time: sum of its steps' times, when logged

    def notes(self) -> dict[str, Any]:
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in asdict(self).items()}


# ------------------------------------------------------------------------ reading


def read_verl_log(path: str | Path) -> list[dict[str, float]]:
    """One dict of numeric metrics per step, in step order; a ``ConfigError`` naming the file
    and line for anything that is not a verl metrics row."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(FIELD, f"{p}: no such file")
    text = p.read_text()
    rows = _read_csv(p, text) if p.suffix.lower() == ".csv" else _read_lines(p, text)
    if not rows:
        raise ConfigError(FIELD, f"{p}: no metrics rows")
    for i, row in enumerate(rows):
        missing = [k for k in REQUIRED if k not in row]
        if missing:
            raise ConfigError(
                FIELD, f"{p}: step {row.get('step', i)} lacks verl's {', '.join(missing)}"
            )
    return sorted(rows, key=lambda r: r.get("step", 0.0))


def _numeric(d: dict[str, Any]) -> dict[str, float]:
    out = {}
    for k, v in d.items():
        if isinstance(v, bool):
            continue
        if isinstance(v, int | float):
            out[k] = float(v)
        elif isinstance(v, str):
            try:
                out[k] = float(v)
            except ValueError:
                continue
    return out


def _read_lines(p: Path, text: str) -> list[dict[str, float]]:
    rows = []
    for no, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line:
            continue
        if line.startswith("step:"):  # verl's console logger
            row = {}
            for part in line.split(" - "):
                key, sep, val = part.rpartition(":")
                if not sep:
                    raise ConfigError(FIELD, f"{p}:{no}: {part!r} is not key:value")
                row[key] = val
            rows.append(_numeric(row))
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            raise ConfigError(FIELD, f"{p}:{no}: neither JSON nor a verl console line") from None
        if not isinstance(obj, dict):
            raise ConfigError(FIELD, f"{p}:{no}: a row must be a JSON object")
        data = obj["data"] if isinstance(obj.get("data"), dict) else obj  # file logger
        rows.append(_numeric({**data, "step": obj.get("step", data.get("step", len(rows)))}))
    return rows


def _read_csv(p: Path, text: str) -> list[dict[str, float]]:
    reader = csv.DictReader(text.splitlines())
    if reader.fieldnames is None:
        raise ConfigError(FIELD, f"{p}: no CSV header")
    return [_numeric({k: v for k, v in r.items() if k and v not in (None, "")}) for r in reader]


# ------------------------------------------------------------------------ fitting


def expected_max_normal(n: int) -> float:
    """E[max of n independent standard normals] (numerical integration)."""
    if n <= 1:
        return 0.0
    lo, hi, steps = -10.0, 10.0, 8000
    h = (hi - lo) / steps
    total = 0.0
    for i in range(steps + 1):
        x = lo + i * h
        pdf = math.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
        cdf = 0.5 * (1 + math.erf(x / math.sqrt(2)))
        w = 0.5 if i in (0, steps) else 1.0
        total += w * x * n * pdf * cdf ** (n - 1)
    return total * h


def fit_lengths(rows: list[dict[str, float]], n: int) -> tuple[float, float, float | None]:
    """(median, sigma, cap) of the response lengths (see the module docstring)."""
    clipped = [r for r in rows if r.get("response_length/clip_ratio", 0.0) > 0]
    cap = max(r["response_length/max"] for r in clipped) if clipped else None
    e_n = expected_max_normal(n)
    sigmas = []
    for r in rows:
        lo, mean = r["response_length/min"], r["response_length/mean"]
        if lo <= 0 or mean <= lo:
            continue
        ratio = math.log(mean / lo)
        sigmas.append(-e_n + math.sqrt(e_n * e_n + 2 * ratio))
    if not sigmas:
        raise ConfigError(
            FIELD,
            "response_length/min must be > 0 and below the mean on some "
            "step to fit the spread of lengths",
        )
    sigma = statistics.fmean(sigmas)
    free = [r for r in rows if r.get("response_length/clip_ratio", 0.0) == 0] or rows
    median = statistics.median(r["response_length/mean"] for r in free) / math.exp(
        0.5 * sigma * sigma
    )
    return median, sigma, cap


def fit_rollout(rows: list[dict[str, float]], n: int, gpus: int) -> tuple[float, float]:
    """(T tokens/s per GPU, C tokens/s per sequence): least squares of
    ``gen = W / (T * G) * 1 + M / C`` over steps."""
    xs = [(n * r["response_length/mean"] / gpus, r["response_length/max"]) for r in rows]
    ys = [r["timing_s/gen"] for r in rows]
    a11 = sum(x * x for x, _ in xs)
    a12 = sum(x * m for x, m in xs)
    a22 = sum(m * m for _, m in xs)
    b1 = sum(x * y for (x, _), y in zip(xs, ys, strict=True))
    b2 = sum(m * y for (_, m), y in zip(xs, ys, strict=True))
    det = a11 * a22 - a12 * a12
    if det <= 1e-12 * a11 * a22:
        raise ConfigError(
            FIELD,
            "timing_s/gen cannot separate throughput from the "
            "per-sequence cap (the steps' lengths are too alike)",
        )
    inv_t = (b1 * a22 - b2 * a12) / det
    inv_c = (a11 * b2 - a12 * b1) / det
    if inv_t <= 0 or inv_c <= 0:
        raise ConfigError(
            FIELD,
            f"timing_s/gen does not fit W / (T G) + M / C with T, C > 0 "
            f"(got 1/T = {inv_t:.3g}, 1/C = {inv_c:.3g})",
        )
    return 1.0 / inv_t, 1.0 / inv_c


def fit(rows: list[dict[str, float]], group_size: int, gpus: int | None = None) -> VerlFit:
    """Every number of the scenario from the rows (see the module docstring)."""
    tokens = [r["perf/total_num_tokens"] for r in rows]
    per_sample = [r["prompt_length/mean"] + r["response_length/mean"] for r in rows]
    n = round(statistics.median(t / s for t, s in zip(tokens, per_sample, strict=True)))
    if n < group_size or n % group_size:
        raise ConfigError(
            "--group-size",
            f"{n} samples per step (perf/total_num_tokens over "
            f"the mean prompt + response) are not whole groups "
            f"of {group_size}",
        )
    if gpus is None:
        have = [
            r
            for r in rows
            if "perf/throughput" in r and ("perf/time_per_step" in r or "timing_s/step" in r)
        ]
        if not have:
            raise ConfigError(
                "--gpus",
                "the log has no perf/throughput with perf/time_per_step: give the GPU count",
            )
        gpus = round(
            statistics.median(
                r["perf/total_num_tokens"]
                / (r["perf/throughput"] * r.get("perf/time_per_step", r.get("timing_s/step", 0.0)))
                for r in have
            )
        )
    if gpus < 1:
        raise ConfigError("--gpus", f"must be >= 1, got {gpus}")
    median, sigma, cap = fit_lengths(rows, n)
    t, c = fit_rollout(rows, n, gpus)
    train = [
        r["timing_s/update_actor"]
        + r.get("timing_s/old_log_prob", 0.0)
        + r.get("timing_s/ref", 0.0)
        for r in rows
    ]
    rate = statistics.median(tok / (gpus * s) for tok, s in zip(tokens, train, strict=True))
    sync = statistics.fmean(r.get("timing_s/update_weights", 0.0) for r in rows)
    step_s = [r.get("timing_s/step", r.get("perf/time_per_step")) for r in rows]
    logged = sum(step_s) if all(x is not None for x in step_s) else None  # type: ignore[misc]
    return VerlFit(
        len(rows),
        gpus,
        n,
        round(statistics.median(r["prompt_length/mean"] for r in rows)),
        median,
        sigma,
        cap,
        t,
        c,
        rate,
        sync,
        logged,
    )


def scenario_from_verl(
    path: str | Path,
    group_size: int,
    gpus: int | None = None,
    cell_gpus: int = 8,
    staleness: float = 0.5,
    name: str | None = None,
) -> tuple[Scenario, VerlFit]:
    """The fitted scenario and the fit (see the module docstring)."""
    if group_size < 1:
        raise ConfigError("--group-size", f"must be >= 1, got {group_size}")
    f = fit(read_verl_log(path), group_size, gpus)
    if f.gpus % cell_gpus:
        raise ConfigError(
            "--cell-gpus", f"{cell_gpus} GPUs per cell do not divide the run's {f.gpus} GPUs"
        )
    cells = f.gpus // cell_gpus
    eff = 0.9
    decode: dict[str, Any] = {
        "median": round(f.decode_median, 1),
        "sigma": round(f.decode_sigma, 4),
    }
    if f.decode_cap is not None:
        decode["cap"] = f.decode_cap
    data = {
        "name": name or Path(path).stem,
        "description": f"fitted on verl metrics {Path(path).name}: {f.gpus} GPUs, "
        f"{f.samples_per_step} samples per step",
        "seed": 0,
        "cluster": {
            "cell_count": cells,
            "cell_gpus": cell_gpus,
            "cell_slots": -(-f.samples_per_step // cells),
            "cell_kind": "elastic",
        },
        "control": {
            "group_size": group_size,
            "batch_groups": f.samples_per_step // group_size,
            "updates_per_burst": 1,
            "bursts": f.steps,
        },
        "sim": {"staleness_threshold": staleness},
        "workload": {
            "classes": [{"name": "verl", "decode_tokens": decode, "prompt_tokens": f.prompt_tokens}]
        },
        "engine": {
            "decode_tok_s_per_gpu": round(f.decode_tok_s_per_gpu, 3),
            "seq_cap_tok_s": round(f.seq_cap_tok_s, 3),
            "prefill_equiv": 0.0,
        },
        "trainer": {
            "train_tok_s_per_gpu": round(f.train_tok_s_per_gpu / eff ** math.log2(cells), 3)
            if cells > 1
            else round(f.train_tok_s_per_gpu, 3),
            "scaling_efficiency": eff,
            "optimizer_s": 0.0,
            "aggregate_s_per_cell": 0.0,
        },
        "costs": {"weight_gb": 0.0, "sync_latency_s": round(f.sync_s, 4)},
        "policies": ["colocate", "waterlevel", "tidal"],
    }
    return validate_model(Scenario, data, "scenario"), f
