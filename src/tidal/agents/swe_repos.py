"""Small Python repositories generated here (no download), one bug each: a function to fix so
that the repository's test passes. The workload of the ``mini-swe-agent`` example.

In: a number of rows and a seed. Out: ``TaskRow``s whose ``metadata`` holds ``workspace_files``
(``{path: text}``, written into each execution's workspace before its agent starts) and
``test_command`` (what the ``tests`` reward runs in the workspace after the agent exits: exit 0
scores 1). The prompt states the failing test and the command that checks it. Each bug is
drawn from a few seeded templates (names and constants vary), so a group's executions share a
repository and rows differ.
"""

from __future__ import annotations

import random
import sys

from tidal.agents.tasks import TaskRow

# (function source with the bug, the test's assertions); {f} is the function's name, {k} a
# constant drawn per row
_BUGS = [
    (
        'def {f}(a, b):\n    """Return a + b + {k}."""\n    return a - b + {k}\n',
        ["assert {f}(2, 3) == {k} + 5", "assert {f}(0, 0) == {k}"],
    ),
    (
        'def {f}(xs):\n    """Return the largest item of xs."""\n    return min(xs)\n',
        ["assert {f}([{k}, 1, 2]) == {k}", "assert {f}([-1, -5]) == -1"],
    ),
    (
        'def {f}(n):\n    """Return n! (the product 1 * 2 * ... * n)."""\n'
        "    out = 1\n    for i in range(1, n):\n        out *= i\n    return out\n",
        ["assert {f}(1) == 1", "assert {f}(4) == 24", "assert {f}(5) == 120"],
    ),
    (
        'def {f}(text):\n    """Return text reversed."""\n    return text\n',
        ["assert {f}('ab{k}') == '{k}ba'", "assert {f}('') == ''"],
    ),
    (
        'def {f}(n):\n    """Return True when n is even."""\n    return n % 2 == 1\n',
        ["assert {f}({k} * 2)", "assert not {f}(7)"],
    ),
    (
        'def {f}(text):\n    """Return how many vowels (a, e, i, o, u) text has."""\n'
        "    return sum(ch in 'aeio' for ch in text.lower())\n",
        ["assert {f}('queue') == 4", "assert {f}('xyz') == 0"],
    ),
]
_NAMES = ["compute", "solve", "transform", "calc", "measure", "combine"]
_MODULES = ["core", "mathx", "helpers", "ops", "lib"]


def rows(size: int, seed: int) -> list[TaskRow]:
    rng = random.Random(seed)
    out = []
    for i in range(size):
        src, checks = rng.choice(_BUGS)
        f, mod, k = rng.choice(_NAMES), rng.choice(_MODULES), rng.randrange(2, 9)
        test = f"test_{mod}.py"
        body = "\n".join(f"    {c.format(f=f, k=k)}" for c in checks)
        files = {
            f"{mod}.py": src.format(f=f, k=k),
            test: (
                f"from {mod} import {f}\n\n\ndef test_{f}():\n{body}\n\n\n"
                f'if __name__ == "__main__":\n    test_{f}()\n    print("ok")\n'
            ),
        }
        prompt = (
            f"The test {test} fails: the function {f} in {mod}.py does not do what its "
            f"docstring says. Fix {f} in {mod}.py so that `python {test}` prints ok. "
            f"Do not edit {test}."
        )
        out.append(
            TaskRow(
                i,
                prompt=prompt,
                answer=None,
                data_source="swe_repos",
                metadata={"workspace_files": files, "test_command": [sys.executable, "-B", test]},
            )
        )
    return out
