"""Modules stay small (DESIGN.md: 100-400 lines): none passes 500 lines unless its docstring
says why (a sentence starting "Over 500 lines"), so a module that grows past it is a decision
written down, not drift."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "tidal"
LIMIT = 500


def _oversized(root: Path) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        lines = text.count("\n")
        if lines <= LIMIT:
            continue
        doc = ast.get_docstring(ast.parse(text)) or ""
        if "Over 500 lines" not in " ".join(doc.split()):
            found.append(f"{path.relative_to(root)}: {lines} lines, no reason in its docstring")
    return found


def test_no_module_over_500_lines_without_a_reason(tmp_path):
    assert _oversized(SRC) == []
    (tmp_path / "big.py").write_text('"""A module."""\n' + "x = 1\n" * 600)
    reason = '"""A module. Over 500 lines: one state."""\n'
    (tmp_path / "why.py").write_text(reason + "x = 1\n" * 600)
    assert _oversized(tmp_path) == ["big.py: 601 lines, no reason in its docstring"]
