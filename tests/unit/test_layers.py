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


CLOCKS = {"time.time", "time.monotonic", "time.perf_counter", "time.time_ns",
          "time.monotonic_ns", "time.sleep", "datetime.datetime.now", "datetime.now"}
IO_MODULES = {"httpx", "socket", "ray", "torch", "io", "subprocess", "requests", "urllib"}
IO_METHODS = {"read_text", "write_text", "read_bytes", "write_bytes", "open", "unlink", "mkdir"}


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def _io_and_clocks(path: Path) -> list[str]:
    """Wall-clock reads and I/O in one module: clock functions imported (``from time import
    monotonic``) or called (``time.time()``), I/O modules imported, ``open(...)`` called, and
    file methods called (``p.read_text()``)."""
    found = [n for n in _imports(path) if n in CLOCKS or n.split(".")[0] in IO_MODULES]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func)
        if name in CLOCKS or name == "open" or name.rsplit(".", 1)[-1] in IO_METHODS:
            found.append(f"{name}() at line {node.lineno}")
    return found


def test_control_reads_no_wall_clock_and_does_no_io():
    bad = {str(p.relative_to(SRC)): f for p in _package("control") if (f := _io_and_clocks(p))}
    assert bad == {}


def test_the_io_and_clock_rule_sees_each_form(tmp_path):
    for code in ("from time import monotonic\n", "import time\nx = time.time()\n",
                 "def f(p):\n    return open(p).read()\n", "def f(p):\n    p.write_text('x')\n",
                 "import socket\n"):
        (tmp_path / "m.py").write_text(code)
        assert _io_and_clocks(tmp_path / "m.py"), code
    (tmp_path / "m.py").write_text("def f(clock):\n    return clock.now()\n")
    assert _io_and_clocks(tmp_path / "m.py") == []


def test_serving_never_imports_agents():
    """The proxy serves harnesses; harnesses (``agents``) build on it, never the reverse."""
    bad = {str(p.relative_to(SRC)): sorted(n for n in _imports(p) if n.startswith("tidal.agents"))
           for p in _package("serving")}
    assert not {k: v for k, v in bad.items() if v}
