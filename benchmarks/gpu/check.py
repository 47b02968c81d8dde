"""The GPU check: one command on a lent GPU machine that installs the carried wheels, runs
``tests/gpu``, then measures tidal's GPU paths, and writes ``check.json`` and ``check.md``.

In: ``--out DIR``, ``--device`` (``cuda``; ``cpu`` for the dry run), ``--sizes`` (``full``: the
Qwen2.5-7B shape of the simulator's shipped ``config.json`` in bf16 with random weights made on
the device; ``tiny``: a few-layer model, for the CPU dry run ``make test`` runs), ``--limit-s``
(the whole check, default 450 s: it fits a machine's 8 minutes with its start), ``--wheels``
(default ``gpu-kit/wheels``, made by ``make gpu-kit``). Out: ``DIR/check.json`` (every step:
status ``ok`` / ``failed`` / ``skipped`` / ``timeout``, seconds, reason, figures) and
``DIR/check.md`` (one table), rewritten after every step so a killed run still leaves them.

Each step (``STEPS``) runs in its own forked process group under its own timeout, cut to what
is left of ``--limit-s``: a hang, an out-of-memory or a crash ends that step only, and is
recorded. The wheels are unpacked into a temporary directory put first on the path (no
network, no pip).

Run: ``benchmarks/gpu/check.sh`` (on the device: ``OUT`` is where the files come back).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import zipfile
from datetime import UTC, datetime
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
T0 = time.monotonic()
STATUSES = ("ok", "failed", "skipped", "timeout")
ACTIVE: set[int] = set()  # process groups of the step or the tests running now
COLUMNS = ("step", "status", "s", "figure", "measured", "unit", "tidal.sim.perf", "note")
# name, module, function, timeout (s); in this order: tests first, then by value per second
# (the 7B weight update writes and reads a 30 GB float32 file: last)
STEPS = (
    ("tests_gpu", None, None, 120),
    ("decode", "engine_steps", "decode", 75),
    ("sleep_wake", "engine_steps", "sleep_wake", 120),
    ("trainer_offload", "trainer_steps", "trainer_offload", 100),
    ("trainer_precision", "trainer_steps", "trainer_precision", 60),
    ("engine_vs_cpu", "engine_steps", "engine_vs_cpu", 120),
    ("weight_carriers", "carrier_steps", "weight_carriers", 150),
    ("weight_broadcast", "carrier_steps", "weight_broadcast", 90),
    ("weight_update", "trainer_steps", "weight_update", 150),
    ("fsdp_two_ranks", "trainer_steps", "fsdp_two_ranks", 60),
)


def note(what: str) -> None:
    print(f"[check {time.monotonic() - T0:6.1f} s] {what}", flush=True)


def wheel_fits(name: str) -> bool:
    """Whether a wheel's tags fit this interpreter (pure ones always; cpXY ones on X.Y)."""
    tags = name[:-4].split("-")[-3:]
    here = f"cp{sys.version_info.major}{sys.version_info.minor}"
    return tags[0] in ("py3", here) and (tags[2] == "any" or sys.platform == "linux")


def install_wheels(wheels: Path, site: Path) -> list[str]:
    """Unpack every fitting wheel into ``site`` and put it first on the path of this process
    and its children (the device has no registry; these wheels need no build step)."""
    if not wheels.is_dir():
        return []
    done = []
    for whl in sorted(wheels.glob("*.whl")):
        if wheel_fits(whl.name):
            with zipfile.ZipFile(whl) as z:
                z.extractall(site)
            done.append(whl.name)
    if done:
        sys.path.insert(0, str(site))
    return done


def _child(fn, ctx, result: Path) -> None:
    """One step in its own process group; its outcome goes to ``result`` as JSON (and each
    figure as it comes to ``result.partial``)."""
    os.setpgid(0, 0)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    from kit import Figures, Skip

    figs = Figures(result.with_suffix(".partial"))
    out: dict = {"status": "ok", "reason": ""}
    try:
        fn(ctx, figs)
        if figs.failures:
            out.update(status="failed", reason="; ".join(figs.failures))
    except Skip as exc:
        out.update(status="skipped", reason=str(exc))
    except BaseException as exc:  # recorded, never fatal to the check
        traceback.print_exc()
        out.update(status="failed", reason=f"{type(exc).__name__}: {exc}".splitlines()[0][:300])
    out["figures"] = figs.rows
    result.write_text(json.dumps(out))
    sys.stdout.flush()
    os._exit(0)


def run_step(fn, ctx, timeout_s: float, tmp: Path) -> dict:
    result = tmp / f"{fn.__name__}.json"
    ctx.tmp = Path(tempfile.mkdtemp(prefix=f"{fn.__name__}-", dir=tmp))
    proc = mp.get_context("fork").Process(target=_child, args=(fn, ctx, result))
    proc.start()
    ACTIVE.add(proc.pid)
    proc.join(timeout_s)
    if proc.is_alive():
        _kill_group(proc.pid)
        proc.join(10)
        ACTIVE.discard(proc.pid)
        return _partial(result, "timeout", f"killed after {timeout_s:.0f} s")
    ACTIVE.discard(proc.pid)
    if result.is_file():
        return json.loads(result.read_text())
    return _partial(result, "failed", f"the step's process died (exit {proc.exitcode})")


def _partial(result: Path, status: str, reason: str) -> dict:
    """A step that did not finish: the figures it had written before it ended."""
    partial = result.with_suffix(".partial")
    done = json.loads(partial.read_text()) if partial.is_file() else {"figures": []}
    return {"status": status, "reason": reason, "figures": done["figures"]}


def _on_term(signum, frame) -> None:
    """Killed from outside (``check.sh``'s timeout): end the running step's process group
    too (it has its own, so it would outlive this process and hold the output open)."""
    for pgid in list(ACTIVE):
        _kill_group(pgid)
    sys.exit(128 + signum)


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def run_tests(args, timeout_s: float) -> dict:
    """``pytest tests/gpu`` in a child process group, each test under ``--test-timeout-s``."""
    junit = args.out / "tests_gpu.xml"
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        *args.tests,
        "-q",
        "-rfE",
        f"--timeout={args.test_timeout_s}",
        f"--junitxml={junit}",
    ]
    path = [*args.site_paths, str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p)}
    if args.device == "cpu":
        env["TIDAL_TEST_DEVICE"] = "cpu"
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True)
    ACTIVE.add(proc.pid)
    try:
        rc = proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        _kill_group(proc.pid)
        proc.wait(10)
        return {"status": "timeout", "reason": f"killed after {timeout_s:.0f} s", "figures": []}
    finally:
        ACTIVE.discard(proc.pid)
    counts = _junit_counts(junit)
    rows = [
        {"figure": k, "value": v, "unit": "tests", "sim": None, "note": ""}
        for k, v in counts.items()
        if k != "failing"
    ]
    if counts.get("failing"):
        rows.append(
            {
                "figure": "failing",
                "value": ", ".join(counts["failing"]),
                "unit": "",
                "sim": None,
                "note": "",
            }
        )
    status = "ok" if rc == 0 else "failed"
    return {"status": status, "reason": "" if rc == 0 else f"pytest exit {rc}", "figures": rows}


def _junit_counts(junit: Path) -> dict:
    import xml.etree.ElementTree as ET

    if not junit.is_file():
        return {}
    cases = ET.parse(junit).getroot().iter("testcase")
    counts = {"passed": 0, "failed": 0, "skipped": 0, "failing": []}
    for case in cases:
        kinds = {child.tag for child in case}
        if kinds & {"failure", "error"}:
            counts["failed"] += 1
            counts["failing"].append(case.get("name", "?"))
        elif "skipped" in kinds:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return counts


class Ctx:
    """What a step gets: the device, the sizes, the big shape, a tmp dir of its own, and the
    simulator's GPU (asked in the step: the parent never touches CUDA, so it can fork)."""

    def __init__(self, device, sizes, big: dict) -> None:
        self.device, self.sizes, self.big = device, sizes, big
        self.tmp = Path(tempfile.gettempdir())

    @property
    def gpu(self) -> str:
        from kit import gpu_profile

        return gpu_profile(self.device)


def environment(ctx, figs) -> None:
    """What the check ran on (a step too: CUDA is first touched in a child)."""
    import torch
    import transformers

    from tidal.models.device import describe_devices

    figs.add("device", describe_devices() if ctx.device.type == "cuda" else "cpu (dry run)")
    figs.add("torch / transformers", f"{torch.__version__} / {transformers.__version__}")
    figs.add("python", sys.version.split()[0])
    from kit import free_bytes, params_of

    figs.add(
        "big model",
        f"{ctx.big['model_type']}, {ctx.big['num_hidden_layers']} layers",
        note=f"{params_of(ctx.big) / 1e9:.2f} B params, random weights",
    )
    figs.add("free disk under tmp", free_bytes(ctx.tmp) / 2**30, "GiB")
    if ctx.device.type == "cuda":
        figs.add("simulator GPU profile", ctx.gpu)


def rows_of(name: str, res: dict) -> list[list[str]]:
    """The table rows of one step (one row when it has no figures)."""
    head = [name, res["status"], f"{res.get('seconds', 0):.1f}"]
    if not res["figures"]:
        return [[*head, "", "", "", "", res["reason"]]]
    out = []
    for i, f in enumerate(res["figures"]):
        value = f["value"]
        shown = f"{value:.4g}" if isinstance(value, float) else str(value)
        sim = "" if f["sim"] is None else f"{f['sim']:.4g}"
        note_ = f["note"] if i or not res["reason"] else f"{res['reason']}; {f['note']}"
        out.append(
            [
                *(head if i == 0 else ["", "", ""]),
                f["figure"],
                shown,
                f["unit"],
                sim,
                note_.strip("; "),
            ]
        )
    return out


def markdown(report: dict) -> str:
    lines = [
        f"GPU check, {report['date']}: {report['device']}; sizes {report['sizes']}, "
        f"{report['wall_s']:.0f} s of {report['limit_s']:.0f} s",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    for name, res in report["steps"].items():
        for row in rows_of(name, res):
            cells = [re.sub(r"[|\n]", " ", c) for c in row]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write(report: dict, out: Path) -> None:
    report["wall_s"] = round(time.monotonic() - T0, 1)
    (out / "check.json").write_text(json.dumps(report, indent=2))
    (out / "check.md").write_text(markdown(report))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--sizes", default="full", choices=("full", "tiny"))
    ap.add_argument("--limit-s", type=float, default=450.0, help="the whole check")
    ap.add_argument("--wheels", type=Path, default=ROOT / "gpu-kit" / "wheels")
    ap.add_argument(
        "--tests",
        nargs="*",
        default=["tests/gpu"],
        help="what pytest runs first (none: no tests step)",
    )
    ap.add_argument("--test-timeout-s", type=int, default=90, help="per test")
    ap.add_argument("--steps", default=None, help="comma-separated subset of the steps")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _on_term)
    site = Path(tempfile.mkdtemp(prefix="tidal-gpu-site-"))  # not under --out: not sent back
    installed = install_wheels(args.wheels, site)
    args.site_paths = [str(site)] if installed else []
    sys.path[:0] = [str(HERE), str(ROOT / "src")]
    note(f"wheels unpacked: {', '.join(installed) or 'none'}")
    # imported once here: every forked step starts with torch (CUDA is touched only there)
    import torch
    from kit import SIZES, big_shape

    sizes = SIZES[args.sizes]
    ctx = Ctx(torch.device(args.device), sizes, big_shape(sizes))
    report = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "device": args.device,
        "sizes": args.sizes,
        "limit_s": args.limit_s,
        "wheels": installed,
        "columns": list(COLUMNS),
        "steps": {},
    }
    wanted = set(args.steps.split(",")) if args.steps else None
    with tempfile.TemporaryDirectory(prefix="tidal-gpu-check-") as tmp:
        for name, module, func, timeout_s in (("environment", None, None, 60), *STEPS):
            if (name == "tests_gpu" and not args.tests) or (
                wanted and name not in wanted | {"environment"}
            ):
                continue
            report["steps"][name] = _timed_step(name, module, func, timeout_s, args, ctx, Path(tmp))
            if name == "environment" and report["steps"][name]["figures"]:
                report["device"] = str(report["steps"][name]["figures"][0]["value"])
            write(report, args.out)
    print(markdown(report))
    note(f"wrote {args.out / 'check.json'} and {args.out / 'check.md'}")
    return 0


def _timed_step(name, module, func, timeout_s, args, ctx, tmp: Path) -> dict:
    left = args.limit_s - (time.monotonic() - T0) - 5
    if left < 10:
        return {
            "status": "skipped",
            "reason": f"the check's {args.limit_s:.0f} s are spent",
            "figures": [],
            "seconds": 0.0,
        }
    timeout_s = min(timeout_s, left)
    note(f"{name}: start (timeout {timeout_s:.0f} s)")
    t0 = time.monotonic()
    if name == "tests_gpu":
        res = run_tests(args, timeout_s)
    else:
        fn = environment if module is None else getattr(__import__(module), func)
        res = run_step(fn, ctx, timeout_s, tmp)
    res["seconds"] = round(time.monotonic() - t0, 1)
    note(f"{name}: {res['status']} in {res['seconds']:.1f} s {res['reason']}")
    return res


if __name__ == "__main__":
    sys.exit(main())
