"""Where the engine actors run: one Ray placement-group bundle per standalone engine and per cell.

In: the run config (``cluster``: engines, cells and their GPUs; ``runtime.use_gpus``,
``runtime.cpus_per_engine``, ``runtime.placement_strategy``) and the actor names in order
(``s0..``, ``c0..``). Out: the reserved placement group and, per actor name, the Ray options
that pin it to its bundle.
On a GPU cluster each bundle holds the GPUs of its cell (``cluster.cell_gpus``) or standalone
engine (``standalone_gpus``), so a cell's engine, its satellite trainer and its GPUs stay
together, and a replaced actor lands on the same reserved bundle. On a laptop (``use_gpus``
false) bundles hold a fraction of a CPU each, so the run fits beside the driver. A cluster that
cannot hold the bundles is one clear error, after ``timeout_s``.
"""

from __future__ import annotations

import contextlib
from types import ModuleType
from typing import Any

from tidal.config import RunConfig
from tidal.runtime.cell import RuntimeFailure


def bundles(cfg: RunConfig) -> list[dict[str, float]]:
    """One bundle per engine actor: standalone engines first, then cells in order."""
    cl, rt = cfg.cluster, cfg.runtime
    gpus = [cl.standalone_gpus] * cl.standalone_count + [s.gpus for s in cl.cell_specs()]
    out = []
    for g in gpus:
        b: dict[str, float] = {"CPU": rt.cpus_per_engine}
        if rt.use_gpus:
            b["GPU"] = float(g)
        out.append(b)
    return out


class Placement:
    def __init__(self, ray: ModuleType, cfg: RunConfig, names: list[str], timeout_s: float) -> None:
        from ray.util.placement_group import placement_group

        self.ray = ray
        self.bundles = bundles(cfg)
        if len(names) != len(self.bundles):
            raise ValueError(f"{len(names)} actor names for {len(self.bundles)} bundles")
        self.index = {n: i for i, n in enumerate(names)}
        self.pg = placement_group(
            self.bundles, strategy=cfg.runtime.placement_strategy, name=f"tidal-{cfg.name}"
        )
        try:
            ray.get(self.pg.ready(), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            need = {k: sum(b.get(k, 0.0) for b in self.bundles) for k in ("CPU", "GPU")}
            self.remove()
            raise RuntimeFailure(
                f"the Ray cluster cannot place {len(self.bundles)} engine bundles "
                f"({need['CPU']:g} CPU, {need['GPU']:g} GPU in all, strategy "
                f"{cfg.runtime.placement_strategy}) within {timeout_s:g} s; available: "
                f"{ray.available_resources()}"
            ) from None

    def options(self, name: str) -> dict[str, Any]:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        i = self.index[name]
        b = self.bundles[i]
        return {
            "num_cpus": b["CPU"],
            "num_gpus": b.get("GPU", 0.0),
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=self.pg, placement_group_bundle_index=i
            ),
        }

    def remove(self) -> None:
        from ray.util.placement_group import remove_placement_group

        with contextlib.suppress(Exception):  # the cluster may already be gone at shutdown
            remove_placement_group(self.pg)
