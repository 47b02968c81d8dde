"""Run checkpoints: what ``tidal run --resume DIR`` needs to continue with nothing lost or
trained twice.

In: after an optimizer step, the core's state (weights, optimizer, version, step counter), the
published weight version engines serve, the groups trained so far and every closed execution
whose record is still in the trajectory buffer (in-flight training data). Out: ``DIR/checkpoint/``
holding ``trainer.safetensors`` (every tensor of the core's state) + ``trainer.json`` (the rest of
that state, tensors named by key; a sharded core's ranks write their own shards into
``trainer.dcp/`` instead, see ``tidal.training.dcp_state``), ``state.json`` and
``records.jsonl``: no pickle, so loading a checkpoint runs no code; ``load`` reads them back,
and a damaged checkpoint is one ``ConfigError`` line.

Consistency: a checkpoint is written between optimizer steps, so "trained" and "held" are a cut:
every closed execution is either in a trained group or in ``records.jsonl``; executions still
running at the cut (and any closed after it) are run again on resume under the same execution
id, so the set of trained executions is the same as an uninterrupted run's. Writing is atomic:
a new checkpoint is built in ``checkpoint.tmp`` (every file and the directory fsynced) and swapped
in by rename (the run directory fsynced); a crash in between leaves the previous one
(``checkpoint.old``) readable.

Retention (``runtime.keep_checkpoints``, ``runtime.keep_weights``): while a run lasts the newest
checkpoint is always there (more with ``keep_checkpoints`` > 1, as ``checkpoint-step<k>``);
``retain`` runs after a successful run only and deletes what the user did not ask to keep.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tidal.contracts.calls import ExecutionRecord
from tidal.errors import ConfigError, RecordError, TidalError

if TYPE_CHECKING:
    from tidal.json_types import JSON

# 2: no pickle (trainer.safetensors + trainer.json); 3: records are ``contracts``'
# ExecutionRecords (engine segments with a version per token, the close reason)
FORMAT = 3
TENSORS = "trainer.safetensors"
SHARDED = "trainer.dcp"  # a sharded core's state: one safetensors file per rank (dcp_state)


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
    # close reasons of the executions closed before this cut, over incarnations (a resumed
    # run's summary counts them: a failure before a driver crash is not forgotten)
    close_reasons: dict[str, int] = field(default_factory=dict)
    resumes: int = 0
    # lines of executions.jsonl this cut covers (a resumed run cuts the file back to them)
    execution_lines: int = 0


@dataclass
class Checkpoint:
    state: RunState
    records: list[ExecutionRecord]
    trainer: dict[str, Any]


def _flatten(obj: object, path: str, tensors: dict[str, Any], seen: set[int]) -> JSON:
    """``obj`` as JSON, each tensor replaced by ``{"tensor": key}`` (its bytes go to
    ``tensors``); tuples and dicts with non-string keys keep their type. Only a tensor whose
    memory another one already uses (tied weights) is copied: safetensors stores no aliases,
    and copying the whole state would double the driver's memory at every checkpoint. Disjoint
    views of one storage (the trainer's weights are views of one flat vector) are no aliases."""
    import torch

    if isinstance(obj, torch.Tensor):
        key, t = f"t{len(tensors)}", obj.detach().to("cpu").contiguous()
        ptr = t.data_ptr()
        tensors[key] = t.clone() if ptr in seen and t.numel() else t
        seen.add(ptr)
        return {"tensor": key}
    if isinstance(obj, dict):
        items = [[k, _flatten(v, f"{path}.{k}", tensors, seen)] for k, v in obj.items()]
        if all(isinstance(k, str) for k in obj):
            return {"dict": dict(items)}
        return {"items": items}
    if isinstance(obj, list | tuple):
        vals = [_flatten(v, f"{path}[{i}]", tensors, seen) for i, v in enumerate(obj)]
        return {"tuple": vals} if isinstance(obj, tuple) else vals
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    raise TidalError(f"checkpoint: {path} is a {type(obj).__name__}: not a tensor or JSON value")


def _unflatten(obj: JSON, tensors: dict[str, Any]) -> object:
    if isinstance(obj, list):
        return [_unflatten(v, tensors) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if "tensor" in obj:
        return tensors[obj["tensor"]]
    if "tuple" in obj:
        return tuple(_unflatten(v, tensors) for v in obj["tuple"])
    if "items" in obj:
        return {k: _unflatten(v, tensors) for k, v in obj["items"]}
    return {k: _unflatten(v, tensors) for k, v in obj["dict"].items()}


def _write(path: Path, data: bytes) -> None:
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(
    run_dir: str | Path,
    state: RunState,
    records: list[ExecutionRecord],
    trainer: dict[str, Any],
    keep: int = 1,
) -> Path:
    """Write the checkpoint (no pickle: tensors as safetensors, the rest JSON); every file and
    both directories fsynced, swapped in by rename. ``keep`` > 1: the previous one stays as
    ``checkpoint-step<k>`` (by rename, no copy), the newest ``keep - 1`` of those kept."""
    from safetensors.torch import save_file

    root = Path(run_dir)
    tmp, final, old = root / "checkpoint.tmp", root / "checkpoint", root / "checkpoint.old"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tensors: dict[str, Any] = {}
    if callable(trainer.get("dcp")):  # a sharded core: its ranks write their shards here
        trainer = {**trainer, **trainer["dcp"](tmp / SHARDED), "dcp": SHARDED}
    skeleton = _flatten(trainer, "trainer", tensors, set())
    save_file(tensors, tmp / TENSORS)  # streamed from the tensors' memory, then fsynced
    with open(tmp / TENSORS, "rb") as fh:
        os.fsync(fh.fileno())
    _write(tmp / "trainer.json", json.dumps(skeleton).encode())
    _write(tmp / "records.jsonl", "".join(r.model_dump_json() + "\n" for r in records).encode())
    _write(tmp / "state.json", json.dumps({"format": FORMAT, **asdict(state)}, indent=1).encode())
    _fsync_dir(tmp)
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync_dir(root)
    if keep > 1 and (old / "state.json").is_file():
        step = json.loads((old / "state.json").read_text())["step"]
        shutil.rmtree(root / f"checkpoint-step{step}", ignore_errors=True)
        os.replace(old, root / f"checkpoint-step{step}")
    shutil.rmtree(old, ignore_errors=True)
    for stale in _earlier(root)[max(0, keep - 1) :]:
        shutil.rmtree(stale, ignore_errors=True)
    return final


def _earlier(root: Path) -> list[Path]:
    """The ``checkpoint-step<k>`` directories, newest first."""
    found = [
        (int(p.name.removeprefix("checkpoint-step")), p)
        for p in root.glob("checkpoint-step*")
        if p.name[15:].isdigit()
    ]
    return [p for _, p in sorted(found, reverse=True)]


def retain(run_dir: str | Path, keep_checkpoints: int, keep_weights: int) -> int:
    """After a successful run (nothing left to resume): leave the newest ``keep_checkpoints``
    checkpoints and ``keep_weights`` published weight files (``weights/v<n>.safetensors``),
    delete the rest. Returns the bytes freed. An interrupted run never gets here: its
    checkpoint and the weights it names stay for ``--resume``."""
    root = Path(run_dir)
    doomed = [root / "checkpoint.old", root / "checkpoint.tmp"]
    if keep_checkpoints == 0:
        doomed.append(root / "checkpoint")
    doomed += _earlier(root)[max(0, keep_checkpoints - 1) :]
    weights = [
        (int(p.stem[1:]), p)
        for p in (root / "weights").glob("v*.safetensors")
        if p.stem[1:].isdigit()
    ]
    doomed += [p for _, p in sorted(weights, reverse=True)[keep_weights:]]
    freed = 0
    for path in doomed:
        files = [path] if path.is_file() else [f for f in path.rglob("*") if f.is_file()]
        freed += sum(f.stat().st_size for f in files if f.exists())
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    with contextlib.suppress(OSError):  # empty now: no directory left behind
        (root / "weights").rmdir()
    return freed


def find(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint directory of a run, or None."""
    root = Path(run_dir)
    for name in ("checkpoint", "checkpoint.old"):
        if (root / name / "state.json").is_file():
            return root / name
    return None


def how_to_continue(run_dir: str | Path) -> str:
    """What a stopped run's last line tells the user to do: resume from its checkpoint, or,
    stopped before its first one, start it again (``--resume`` would refuse: no checkpoint)."""
    if find(run_dir) is not None:
        return f"Continue the run with: tidal run --resume {run_dir}"
    return (
        f"It stopped before its first checkpoint, so it cannot be resumed; start it again "
        f"with: tidal run {Path(run_dir) / 'config.yaml'} --out {run_dir}"
    )


def load(run_dir: str | Path) -> Checkpoint:
    """The checkpoint of ``run_dir``; a missing or damaged one is one ``ConfigError`` line."""
    where = find(run_dir)
    if where is None:
        raise ConfigError(
            "--resume",
            f"{run_dir}: no checkpoint (checkpoint/state.json); "
            "was the run started with runtime.checkpoint_every_steps > 0 and "
            "did it finish a step?",
        )
    raw = _read_json(where / "state.json")
    if not isinstance(raw, dict) or raw.pop("format", None) != FORMAT:
        raise ConfigError(
            "--resume",
            f"{where}: checkpoint format is not {FORMAT} (written by another tidal version?)",
        )
    try:
        state = RunState(**raw)
    except TypeError as exc:
        raise ConfigError("--resume", f"{where}/state.json is damaged: {exc}") from None
    try:
        records = [
            ExecutionRecord.model_validate_json(line)
            for line in (where / "records.jsonl").read_text().splitlines()
            if line.strip()
        ]
    except (OSError, ValueError, RecordError) as exc:
        raise ConfigError(
            "--resume", f"{where}/records.jsonl is damaged: {_first_line(exc)}"
        ) from None
    return Checkpoint(state, records, _load_trainer(where))


def _load_trainer(where: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    skeleton = _read_json(where / "trainer.json")
    try:
        tensors = load_file(where / TENSORS, device="cpu")
        trainer = _unflatten(skeleton, tensors)
    except Exception as exc:  # safetensors' own errors, a skeleton naming a missing tensor
        raise ConfigError(
            "--resume", f"{where}/{TENSORS} is damaged: {type(exc).__name__}: {_first_line(exc)}"
        ) from None
    if isinstance(trainer, dict) and trainer.get("dcp") == SHARDED:
        trainer["dcp"] = str(where / SHARDED)  # read by the core's ranks (dcp_state.load)
    return trainer


def _read_json(path: Path) -> JSON:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError("--resume", f"{path} is damaged: {_first_line(exc)}") from None


def _first_line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [type(exc).__name__])[0]


def clear(run_dir: str | Path) -> None:
    """A fresh run into ``run_dir``: drop an earlier run's checkpoint and appended logs."""
    root = Path(run_dir)
    for path in [
        root / "checkpoint",
        root / "checkpoint.tmp",
        root / "checkpoint.old",
        *_earlier(root),
    ]:
        shutil.rmtree(path, ignore_errors=True)
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


def _writing_logs_of(run_dir: Path) -> list[Any]:
    """Processes whose output goes to this run's ``logs/`` (engines, satellites, the proxy):
    one the killed driver started after it last recorded its processes (a replacement
    engine) is found here; its actor's death left it orphaned, not ended."""
    import psutil

    logs, me, out = (run_dir / "logs").resolve(), os.getpid(), []
    for p in psutil.process_iter():
        try:
            target = Path(os.readlink(f"/proc/{p.pid}/fd/1"))
        except OSError:
            continue
        if p.pid != me and target.parent == logs:
            out.append(p)
    return out


def end_log_writers(run_dir: str | Path, timeout_s: float = 10.0) -> int:
    """End every process of this machine still writing to the run's ``logs/`` (what a lost
    actor or driver left); returns how many. Run on each node of a cluster (``nodes.sweep``)."""
    import psutil

    procs = _writing_logs_of(Path(run_dir))
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(procs, timeout=timeout_s)
    return len(procs)


def end_stale_processes(run_dir: str | Path, timeout_s: float = 10.0) -> int:
    """Before a resume: refuse if the recorded driver still runs; otherwise kill what it left
    (processes whose pid *and* start time match the record, and any process still writing
    to this run's ``logs/``). Returns how many."""
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
        raise ConfigError(
            "--resume", f"{run_dir} is still being run by pid {data['driver']}; stop it first"
        )
    known = {p.pid for p in alive}
    alive += [p for p in _writing_logs_of(Path(run_dir)) if p.pid not in known]
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(alive, timeout=timeout_s)
    return len(alive)
