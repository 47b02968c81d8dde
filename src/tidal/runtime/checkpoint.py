"""Run checkpoints: what ``tidal run --resume DIR`` needs to continue with nothing lost or
trained twice.

In: after an optimizer step, the core's state (weights, optimizer, version, step counter), the
published weight version engines serve, the groups trained so far and every closed execution
whose record is still in the trajectory buffer (in-flight training data). Out: ``DIR/checkpoint/``
holding ``trainer.pt`` and ``state.json`` + ``records.jsonl``; ``load`` reads them back.

Consistency: a checkpoint is written between optimizer steps, so "trained" and "held" are a cut:
every closed execution is either in a trained group or in ``records.jsonl``; executions still
running at the cut (and any closed after it) are run again on resume under the same execution
id, so the set of trained executions is the same as an uninterrupted run's. Writing is atomic:
a new checkpoint is built in ``checkpoint.tmp`` and swapped in by rename; a crash in between
leaves the previous one (``checkpoint.old``) readable.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tidal.errors import ConfigError
from tidal.training.records import ExecutionRecord

FORMAT = 1


@dataclass
class RunState:
    """The driver's position: the next optimizer step and what is already done."""

    step: int  # the next step to run (steps 0..step-1 are trained)
    bursts_published: int  # bursts whose final update reached the engines
    published_version: int
    published_path: str | None
    trained_groups: list[str] = field(default_factory=list)
    dispatched_groups: list[str] = field(default_factory=list)
    metrics_lines: int = 0
    elapsed_s: float = 0.0  # run time (first dispatch to this checkpoint) over incarnations
    resumes: int = 0


@dataclass
class Checkpoint:
    state: RunState
    records: list[ExecutionRecord]
    trainer: dict[str, Any]


def save(run_dir: str | Path, state: RunState, records: list[ExecutionRecord],
         trainer: dict[str, Any]) -> Path:
    import torch

    root = Path(run_dir)
    tmp, final, old = root / "checkpoint.tmp", root / "checkpoint", root / "checkpoint.old"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    torch.save(trainer, tmp / "trainer.pt")
    with open(tmp / "records.jsonl", "w") as fh:
        fh.writelines(r.model_dump_json() + "\n" for r in records)
    (tmp / "state.json").write_text(json.dumps({"format": FORMAT, **asdict(state)}, indent=1))
    with open(tmp / "state.json", "rb") as fh:
        os.fsync(fh.fileno())
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)
    return final


def find(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint directory of a run, or None."""
    root = Path(run_dir)
    for name in ("checkpoint", "checkpoint.old"):
        if (root / name / "state.json").is_file() and (root / name / "trainer.pt").is_file():
            return root / name
    return None


def load(run_dir: str | Path) -> Checkpoint:
    import torch

    where = find(run_dir)
    if where is None:
        raise ConfigError("--resume", f"{run_dir}: no checkpoint (checkpoint/state.json); "
                          "was the run started with runtime.checkpoint_every_steps > 0 and "
                          "did it finish a step?")
    try:
        raw = json.loads((where / "state.json").read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError("--resume", f"{where}/state.json is not valid JSON: {exc}") from None
    if raw.pop("format", None) != FORMAT:
        raise ConfigError("--resume", f"{where}: checkpoint format is not {FORMAT}")
    try:
        state = RunState(**raw)
    except TypeError as exc:
        raise ConfigError("--resume", f"{where}/state.json: {exc}") from None
    records = [ExecutionRecord.model_validate_json(line)
               for line in (where / "records.jsonl").read_text().splitlines() if line.strip()]
    # CPU whatever wrote it; the core copies the tensors onto its device
    trainer = torch.load(where / "trainer.pt", weights_only=False, map_location="cpu")
    return Checkpoint(state, records, trainer)


def clear(run_dir: str | Path) -> None:
    """A fresh run into ``run_dir``: drop an earlier run's checkpoint and appended logs."""
    root = Path(run_dir)
    for name in ("checkpoint", "checkpoint.tmp", "checkpoint.old"):
        shutil.rmtree(root / name, ignore_errors=True)
    for name in ("metrics.jsonl", "state.jsonl", "processes.json"):
        (root / name).unlink(missing_ok=True)


def record_processes(run_dir: str | Path) -> None:
    """Note this driver and every process under it (Ray's, engines, proxy, satellites) with
    their start times, so a resume can end what a killed driver left running."""
    import psutil

    me = psutil.Process()
    procs = [me, *me.children(recursive=True)]
    rows = []
    for p in procs:
        try:
            rows.append({"pid": p.pid, "create_time": p.create_time(), "name": p.name()})
        except psutil.Error:
            continue
    tmp = Path(run_dir) / "processes.json.tmp"
    tmp.write_text(json.dumps({"driver": me.pid, "processes": rows}))
    os.replace(tmp, Path(run_dir) / "processes.json")


def end_stale_processes(run_dir: str | Path, timeout_s: float = 10.0) -> int:
    """Before a resume: refuse if the recorded driver still runs; otherwise kill what it left
    (only processes whose pid *and* start time match the record). Returns how many."""
    import psutil

    path = Path(run_dir) / "processes.json"
    if not path.is_file():
        return 0
    data = json.loads(path.read_text())
    alive = []
    for row in data["processes"]:
        try:
            p = psutil.Process(row["pid"])
            if abs(p.create_time() - row["create_time"]) < 1e-3:
                alive.append(p)
        except psutil.Error:
            continue
    if any(p.pid == data["driver"] for p in alive):
        raise ConfigError("--resume", f"{run_dir} is still being run by pid {data['driver']}; "
                          "stop it first")
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(alive, timeout=timeout_s)
    return len(alive)
