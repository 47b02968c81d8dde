"""``tidal simulate --costs-from FILE``: a scenario's switch costs replaced by what tidal's own
runtime measured on a GPU (a GPU check's JSON, ``benchmarks/gpu/check.py``), so a saving says
what it rests on.

In: the check's JSON (its ``sleep_wake`` and ``weight_update`` steps: engine sleep and wake at
level 1, trainer -> engine GB/s, the model's bytes per GPU) and a scenario with a cost model.
Out: ``MeasuredCosts`` and the scenario with ``costs.sleep_s``, ``costs.wake_s`` and the weight
sync priced from them. The check ran one model on one GPU; a scenario's engine holds
``weight_gb / engine_tp`` per GPU and each GPU moves its share in parallel, so every measured
time is scaled by the scenario's bytes per GPU over the check's (a rate per GPU carried over).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from tidal.errors import ConfigError

GiB = 2**30
# the steady state first (a second level-1 sleep reuses the first one's pinned buffers)
SLEEP = ("sleep level 1 again (rollout -> training)", "sleep level 1 (rollout -> training)")
WAKE = ("wake level 1 again (training -> rollout)", "wake level 1 (training -> rollout)")
# the runtime's trainer -> engine path, newest name first (the check names its carrier)
SYNC = ("tidal run: trainer -> engine", "tidal: trainer -> engine")


class MeasuredCosts(BaseModel):
    model_config = ConfigDict(extra="forbid")

    source: str
    date: str
    device: str
    weights_gib: float  # the check's model, on its one GPU
    sleep_s: float
    wake_s: float
    sync_gbps: float
    sync_figure: str


def _figures(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {
        f["figure"]: f
        for st in report.get("steps", {}).values()
        for f in st.get("figures", [])
        if isinstance(f, dict) and "figure" in f
    }


def read_check(path: str | Path) -> MeasuredCosts:
    """The switch costs of a GPU check's JSON; ``ConfigError`` naming what is missing."""
    try:
        report = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError("--costs-from", f"{path}: not a GPU check's JSON ({exc})") from None
    figs = _figures(report)
    sync, sleep, wake = (
        next((figs[n] for n in names if n in figs), None) for names in (SYNC, SLEEP, WAKE)
    )
    missing = [names[-1] for names, f in ((SLEEP, sleep), (WAKE, wake), (SYNC, sync)) if f is None]
    if missing:
        raise ConfigError(
            "--costs-from",
            f"{path}: no figure {missing[0]!r} (a GPU check "
            "whose sleep_wake and weight_update steps ran)",
        )
    size = figs.get("weights (one version)")
    if size is not None:
        gib = float(size["value"])
    else:  # checks before 2026-12-06 name the bytes in the sync figure's note
        m = re.search(r"([\d.]+) GiB", str(sync.get("note", "")))
        if m is None:
            raise ConfigError("--costs-from", f"{path}: the model's size is not stated")
        gib = float(m.group(1))
    return MeasuredCosts(
        source=str(path),
        date=str(report.get("date", "?")),
        device=str(report.get("device", "?")),
        weights_gib=gib,
        sleep_s=float(sleep["value"]),
        wake_s=float(wake["value"]),
        sync_gbps=float(sync["value"]),
        sync_figure=str(sync["figure"]),
    )


def apply(sc: Any, m: MeasuredCosts) -> tuple[Any, dict[str, float]]:
    """``sc`` with the measured costs (scaled to its bytes per GPU) and what they are:
    {sleep_s, wake_s, sync_s} as used."""
    from tidal.sim import perf

    if sc.costmodel is None:
        raise ConfigError(
            "--costs-from", f"scenario {sc.name} has no costmodel: its bytes per GPU are unknown"
        )
    resolved = perf.resolve(sc)
    c = resolved.costs
    per_gpu_gb = c.weight_gb / sc.costmodel.engine_tp
    scale = per_gpu_gb / (m.weights_gib * GiB / 1e9)
    sync_s = c.sync_latency_s + per_gpu_gb / m.sync_gbps
    # sync_gb_s is derived again from the cost model at each run: the measured transfer goes
    # into the latency term, so that sync_s comes out as measured
    latency = sync_s - c.weight_gb / c.sync_gb_s
    costs = sc.costs.model_copy(
        update={"sleep_s": m.sleep_s * scale, "wake_s": m.wake_s * scale, "sync_latency_s": latency}
    )
    used = {"sleep_s": m.sleep_s * scale, "wake_s": m.wake_s * scale, "sync_s": sync_s}
    return sc.model_copy(update={"costs": costs}), used


def assumed(sc: Any) -> dict[str, float]:
    from tidal.sim import perf

    c = perf.resolve(sc).costs
    return {"sleep_s": c.sleep_s, "wake_s": c.wake_s, "sync_s": c.sync_s}
