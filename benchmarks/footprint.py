"""Memory footprint of a real run: peak RSS per process and the machine's peak over its baseline.

Runs ``tidal run CONFIG`` in a child process, samples that process and everything it starts
(Ray's GCS and raylet, the cell actors, their engines and satellites, the proxy) every
``--interval-s`` with psutil, and prints per process its peak resident memory, the totals by kind
and the machine's used memory before the run (baseline), its peak, and the difference. The run's
own ``summary.json`` carries the same figures (``memory``), named by engine id; its table is
printed too, with the run's switch times (p50 / max per direction) and per plan step p50 / max
from ``steps.jsonl``.

    .venv/bin/python benchmarks/footprint.py                          # configs/quickstart.yaml
    .venv/bin/python benchmarks/footprint.py --config configs/tiny.yaml --set control.bursts=1
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tidal.runtime.footprint import MemorySampler, table

ROOT = Path(__file__).resolve().parents[1]


def step_figures(steps_path: Path) -> list[str]:
    """Per plan step kind: n, p50 and max seconds (from the run's ``steps.jsonl``)."""
    by: dict[str, list[float]] = {}
    for line in steps_path.read_text().splitlines():
        rec = json.loads(line)
        by.setdefault(rec["step"], []).append(rec["duration_s"])
    out = [f"{'plan step':<26} {'n':>3} {'p50 s':>7} {'max s':>7}"]
    for name, ds in sorted(by.items()):
        ds.sort()
        out.append(f"{name:<26} {len(ds):>3} {ds[(len(ds) - 1) // 2]:>7.3f} {ds[-1]:>7.3f}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "quickstart.yaml"))
    ap.add_argument("--out", default=None, help="run directory (default: a temporary one)")
    ap.add_argument("--interval-s", type=float, default=0.5)
    ap.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        help="passed to `tidal run --set` (repeatable)",
    )
    args = ap.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="tidal-footprint-")) / "run"
    cmd = [sys.executable, "-m", "tidal.cli", "run", args.config, "--out", str(out)]
    for s in args.sets:
        cmd += ["--set", s]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd)
    sampler = MemorySampler(proc.pid, args.interval_s).start()
    rc = proc.wait()
    memory = sampler.stop()
    print(
        f"\n== sampled from outside ({memory['samples']} samples every {args.interval_s} s, "
        f"{time.perf_counter() - t0:.0f} s, exit {rc})"
    )
    print(table(memory))
    summary_path = out / "summary.json"
    if summary_path.is_file():
        summary = json.loads(summary_path.read_text())
        if "memory" in summary:
            print("\n== the run's summary.json (memory)")
            print(table(summary["memory"]))
        print(
            "\nswitch_s:",
            json.dumps(summary.get("switch_s")),
            " satellite_starts:",
            summary.get("satellite_starts"),
            " satellite_joins:",
            summary.get("satellite_joins"),
            " plans_aborted:",
            summary.get("plans_aborted"),
            " run_time_s:",
            summary.get("run_time_s"),
            " mean_reward:",
            round(summary.get("mean_reward", 0.0), 4),
        )
    if (out / "steps.jsonl").is_file():
        print("\n" + "\n".join(step_figures(out / "steps.jsonl")))
    return rc


if __name__ == "__main__":
    sys.exit(main())
