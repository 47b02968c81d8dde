"""DESIGN.md's layer rules, read from the source (every import statement, at any depth):
``sim`` never imports ``viz``; ``config`` never builds policies; only ``runtime`` imports Ray;
``control`` does no I/O of its own (no ``open``, no HTTP, no wall clock)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "tidal"


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return names


def _package(name: str) -> list[Path]:
    return sorted((SRC / name).rglob("*.py"))


def test_sim_never_imports_viz():
    bad = {str(p.relative_to(SRC)): sorted(n for n in _imports(p) if n.startswith("tidal.viz"))
           for p in _package("sim")}
    assert not {k: v for k, v in bad.items() if v}


def test_config_never_builds_policies():
    names = _imports(SRC / "config.py")
    assert not {n for n in names if n.startswith("tidal.control.factory")
                or n.endswith(("make_policy", "build_policy", "build_controller"))}, names


def test_only_runtime_imports_ray():
    # integrations/verl.py runs inside verl's own Ray program and asks verl's rollouter actor
    # for its statistics: the one place outside runtime/ that may talk to Ray (lazily).
    allowed = {"runtime", "integrations"}
    bad = [str(p.relative_to(SRC)) for p in SRC.rglob("*.py")
           if not allowed & set(p.relative_to(SRC).parts)
           and any(n == "ray" or n.startswith("ray.") for n in _imports(p))]
    assert bad == []


def test_control_reads_no_wall_clock_and_does_no_io():
    for p in _package("control"):
        names = _imports(p)
        assert not {n for n in names if n.split(".")[0] in {"httpx", "socket", "ray", "torch"}}, p
        assert "time.time" not in p.read_text() and "time.monotonic" not in p.read_text(), p
