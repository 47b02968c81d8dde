"""DESIGN.md's layer rules, read from the source (every import statement, at any depth):
``sim`` never imports ``viz``; ``config`` never builds policies and imports nothing of
``control``; only ``runtime`` imports Ray; ``control`` does no I/O of its own (no ``open``, no
HTTP, no wall clock)."""

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
    bad = {
        str(p.relative_to(SRC)): sorted(n for n in _imports(p) if n.startswith("tidal.viz"))
        for p in _package("sim")
    }
    assert not {k: v for k, v in bad.items() if v}


def test_config_never_builds_policies():
    names = _imports(SRC / "config.py")
    assert not {
        n
        for n in names
        if n.startswith("tidal.control.factory")
        or n.endswith(("make_policy", "build_policy", "build_controller"))
    }, names


def _module_files(name: str, root: Path) -> list[Path]:
    """The files importing ``name`` (``tidal.a.b``) runs under ``root`` (the ``tidal`` package):
    each package's ``__init__.py`` on the way and the module itself; none for a name that is
    no module (``tidal.errors.ConfigError``, a name imported from one)."""
    parts = name.split(".")[1:]
    if not (
        root.joinpath(*parts).with_suffix(".py").is_file()
        or (root.joinpath(*parts) / "__init__.py").is_file()
    ):
        return []
    files = [root.joinpath(*parts[:i]) / "__init__.py" for i in range(len(parts) + 1)]
    files.append(root.joinpath(*parts).with_suffix(".py"))
    return [f for f in files if f.is_file()]


def _reached(path: Path, root: Path = SRC) -> set[str]:
    """Every ``tidal`` name imported by ``path`` and, in turn, by each tidal module it imports:
    at module level or inside a function, at any depth."""
    seen: set[Path] = set()
    todo, names = [path], set()
    while todo:
        f = todo.pop()
        if f in seen:
            continue
        seen.add(f)
        found = {n for n in _imports(f) if n == "tidal" or n.startswith("tidal.")}
        names |= found
        todo += [m for n in found for m in _module_files(n, root)]
    return names


def test_config_imports_nothing_of_the_control_plane():
    """``config`` sits below ``control`` (``control.factory`` reads configs): it imports no
    ``tidal.control`` module, not lazily, and nothing that does (``tidal.plugins`` does)."""
    reached = _reached(SRC / "config.py")
    assert not {n for n in reached if n == "tidal.control" or n.startswith("tidal.control.")}
    assert "tidal.plugins" not in reached


def test_the_reach_rule_sees_each_form(tmp_path):
    pkg = tmp_path / "tidal"
    (pkg / "control").mkdir(parents=True)
    (pkg / "control" / "__init__.py").write_text("")
    (pkg / "control" / "policy.py").write_text("")
    (pkg / "leaf.py").write_text("import os\n")
    (pkg / "mid.py").write_text("def f():\n    from tidal.control.policy import registered\n")
    for code in (
        "import tidal.control.policy\n",
        "from tidal.control import policy\n",
        "def f():\n    from tidal.control.policy import registered\n",
        "from tidal.leaf import x\nfrom tidal.mid import f\n",
    ):
        (pkg / "config.py").write_text(code)
        assert "tidal.control.policy" in _reached(pkg / "config.py", pkg), code
    (pkg / "config.py").write_text("from tidal.leaf import x\nimport tidal.leaf\n")
    assert _reached(pkg / "config.py", pkg) == {"tidal.leaf", "tidal.leaf.x"}


def test_only_runtime_imports_ray():
    # integrations/verl.py runs inside verl's own Ray program and asks verl's rollouter actor
    # for its statistics: the one place outside runtime/ that may talk to Ray (lazily).
    allowed = {"runtime", "integrations"}
    bad = [
        str(p.relative_to(SRC))
        for p in SRC.rglob("*.py")
        if not allowed & set(p.relative_to(SRC).parts)
        and any(n == "ray" or n.startswith("ray.") for n in _imports(p))
    ]
    assert bad == []


CLOCKS = {
    "time.time",
    "time.monotonic",
    "time.perf_counter",
    "time.time_ns",
    "time.monotonic_ns",
    "time.sleep",
    "datetime.datetime.now",
    "datetime.now",
}
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
    for code in (
        "from time import monotonic\n",
        "import time\nx = time.time()\n",
        "def f(p):\n    return open(p).read()\n",
        "def f(p):\n    p.write_text('x')\n",
        "import socket\n",
    ):
        (tmp_path / "m.py").write_text(code)
        assert _io_and_clocks(tmp_path / "m.py"), code
    (tmp_path / "m.py").write_text("def f(clock):\n    return clock.now()\n")
    assert _io_and_clocks(tmp_path / "m.py") == []


def test_serving_never_imports_agents():
    """The proxy serves harnesses; harnesses (``agents``) build on it, never the reverse."""
    bad = {
        str(p.relative_to(SRC)): sorted(n for n in _imports(p) if n.startswith("tidal.agents"))
        for p in _package("serving")
    }
    assert not {k: v for k, v in bad.items() if v}


# ------------------------------------------------------------------------ contracts

# What the contracts may import from tidal: themselves and the error tree (a leaf module).
CONTRACT_DEPS = ("tidal.contracts", "tidal.errors")


def _tidal_and_heavy(names: set[str]) -> set[str]:
    return {
        n
        for n in names
        if n.split(".")[0] in {"torch", "ray"}
        or (n.split(".")[0] == "tidal" and not n.startswith(CONTRACT_DEPS))
    }


def test_contracts_import_neither_torch_nor_ray_nor_another_tidal_package():
    bad = {
        str(p.relative_to(SRC)): sorted(found)
        for p in _package("contracts")
        if (found := _tidal_and_heavy(_imports(p)))
    }
    assert bad == {}
    # the error tree they raise is a leaf: it imports nothing of tidal
    assert not {n for n in _imports(SRC / "errors.py") if n.startswith("tidal")}


def test_the_contracts_rule_sees_each_form(tmp_path):
    for code in (
        "import torch\n",
        "from ray import remote\n",
        "from tidal.types import Role\n",
        "import tidal.serving.records\n",
    ):
        (tmp_path / "m.py").write_text(code)
        assert _tidal_and_heavy(_imports(tmp_path / "m.py")), code
    (tmp_path / "m.py").write_text(
        "from tidal.contracts.close import CloseReason\n"
        "from tidal.errors import RecordError\nimport pydantic\n"
    )
    assert _tidal_and_heavy(_imports(tmp_path / "m.py")) == set()


def test_contracts_load_without_torch_or_ray():
    """Any process reads them (the cell actor, the satellite's command line, a report)."""
    import subprocess
    import sys

    modules = sorted(
        f"tidal.contracts.{p.stem}" for p in _package("contracts") if p.stem != "__init__"
    )
    code = (
        f"import sys, tidal.contracts, {', '.join(modules)}\n"
        "print(sorted(m for m in ('torch', 'ray') if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONPATH": str(SRC.parent)},
    )
    assert out.stdout.strip() == "[]"


# one definition each, in contracts only: classes whose name holds one of these, the close
# reasons' table, the version-span function
SECOND_MODELS = ("ModelCall", "CallRecord", "ExecutionRecord", "CloseReason", "OutputSegment")
SECOND_VALUES = ("CLOSE_REASONS", "version_spans")


def _definitions(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ClassDef) and any(m in node.name for m in SECOND_MODELS):
            found.append(f"class {node.name} at line {node.lineno}")
        names: list[str] = []
        if isinstance(node, ast.FunctionDef):
            names = [node.name]
        elif isinstance(node, ast.Assign):
            names = [t.id for t in node.targets if isinstance(t, ast.Name)]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names = [node.target.id]
        found += [f"{n} at line {node.lineno}" for n in names if n in SECOND_VALUES]
    return found


def test_no_second_model_of_a_call_an_execution_or_a_close_reason():
    bad = {
        str(p.relative_to(SRC)): f
        for p in SRC.rglob("*.py")
        if "contracts" not in p.relative_to(SRC).parts and (f := _definitions(p))
    }
    assert bad == {}


def test_the_second_model_rule_sees_each_form(tmp_path):
    for code in (
        "class ModelCall:\n    pass\n",
        "class TrainCallRecord(BaseModel):\n    x: int\n",
        "CLOSE_REASONS = ('completed',)\n",
        "def version_spans(v):\n    return v\n",
    ):
        (tmp_path / "m.py").write_text(code)
        assert _definitions(tmp_path / "m.py"), code


def _policy_name_keys(path: Path, names: set[str]) -> list[str]:
    """Module-level tables keyed by a policy's name, and comparisons of a value with one
    anywhere. (A scenario's data may name policies, e.g. its per-policy ``policy_args``: that
    is the user's input, not a lookup the simulator makes.)"""
    tree = ast.parse(path.read_text(), str(path))
    in_tables = {
        id(d)
        for n in tree.body
        if isinstance(n, ast.Assign | ast.AnnAssign) and n.value is not None
        for d in ast.walk(n.value)
    }
    found = []
    for node in ast.walk(tree):
        consts: list[ast.expr] = []
        if isinstance(node, ast.Dict) and id(node) in in_tables:
            consts = [k for k in node.keys if k is not None]
        elif isinstance(node, ast.Compare):
            consts = [node.left, *node.comparators]
            consts += [
                e
                for c in node.comparators
                if isinstance(c, ast.Tuple | ast.Set | ast.List)
                for e in c.elts
            ]
        found += [
            f"{c.value!r} at line {node.lineno}"
            for c in consts
            if isinstance(c, ast.Constant) and c.value in names
        ]
    return found


def test_sim_keeps_no_table_keyed_by_policy_name():
    """The simulator gives a policy the mechanics it declares (``policy_mechanics``), never
    ones looked up or guessed by its name."""
    from tidal.control.policy import registered

    names = set(registered())
    bad = {
        str(p.relative_to(SRC)): f for p in _package("sim") if (f := _policy_name_keys(p, names))
    }
    assert bad == {}


def test_the_policy_name_rule_sees_each_form(tmp_path):
    for code in (
        "M = {'waterlevel': 1}\n",
        "M: dict = {'a': {'waterlevel': 1}}\n",
        "def f(n):\n    return n == 'waterlevel'\n",
        "def f(n):\n    return n in ('verl-default', 'x')\n",
    ):
        (tmp_path / "m.py").write_text(code)
        assert _policy_name_keys(tmp_path / "m.py", {"waterlevel", "verl-default"}), code


# what the runtime may import of the workload (DESIGN.md, "One road for an execution"): the
# workload, the pool, and nothing else; how an execution ended comes as contracts' ``Outcome``
RUNTIME_FROM_AGENTS = {
    "tidal.agents.pool": {"HarnessPool", "PoolConfig"},
    "tidal.agents.workload": {"Workload", "check_workload"},
}


def _agents_names(path: Path) -> set[str]:
    """``module:name`` for every import of ``tidal.agents`` in ``path`` (at any depth)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {f"{a.name}:*" for a in node.names if a.name.startswith("tidal.agents")}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tidal.agents"):
            out |= {f"{node.module}:{a.name}" for a in node.names}
    return out


def test_the_runtime_sees_only_the_workload_the_pool_and_outcome():
    seen = {n for p in _package("runtime") for n in _agents_names(p)}
    allowed = {f"{m}:{n}" for m, names in RUNTIME_FROM_AGENTS.items() for n in names}
    assert seen <= allowed, sorted(seen - allowed)
    assert "tidal.agents.pool:HarnessPool" in seen  # the test reads real imports


def _close_reason_literals(path: Path, root: Path = SRC) -> list[str]:
    """String constants spelling a close reason, but for dict keys (a foreign API's field,
    e.g. vLLM's ``"timeout"``) and the values of ``STATUS_*`` names (a foreign API's own status
    vocabulary, e.g. OpenAI Responses' ``"completed"``, named once where it is used)."""
    from tidal.contracts.close import CLOSE_REASONS

    tree = ast.parse(path.read_text(), str(path))
    keys = {id(k) for n in ast.walk(tree) if isinstance(n, ast.Dict) for k in n.keys if k}
    keys |= {
        id(c)
        for n in ast.walk(tree)
        if isinstance(n, ast.Assign)
        and all(isinstance(t, ast.Name | ast.Tuple) for t in n.targets)
        and all(
            name.id.startswith("STATUS_")
            for t in n.targets
            for name in ast.walk(t)
            if isinstance(name, ast.Name)
        )
        for c in ast.walk(n.value)
        if isinstance(c, ast.Constant)
    }
    return [
        f"{path.relative_to(root)}:{n.lineno}: {n.value!r}"
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant)
        and isinstance(n.value, str)
        and n.value in CLOSE_REASONS
        and id(n) not in keys
    ]


def test_no_close_reason_literal_outside_contracts(tmp_path):
    """``CloseReason`` is the one spelling; a literal would drift from it unseen."""
    found = [
        hit
        for p in sorted(SRC.rglob("*.py"))
        if "contracts" not in p.relative_to(SRC).parts
        for hit in _close_reason_literals(p)
    ]
    assert not found, found
    planted = tmp_path / "planted.py"  # the check finds what it looks for, and only that
    planted.write_text('a = {"timeout": 1.0}\nb = "timeout"\nc = f(reason="failed")\n')
    assert _close_reason_literals(planted, tmp_path) == [
        "planted.py:2: 'timeout'",
        "planted.py:3: 'failed'",
    ]
