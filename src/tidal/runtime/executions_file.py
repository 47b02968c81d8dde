"""``executions.jsonl``, written as the run goes: a line per execution as soon as its group's
executions have ended and their records are in (``LedgerBridge.lines_after``), so a run killed
midway keeps the lines of what it closed.

In: the lines (``LedgerBridge.line``: an ``ExecutionLine``), the checkpoint's count of lines
(``RunState.execution_lines``) on ``--resume``. Out: the file, one line per execution id, never
two. Invariant kept across a resume: the file holds exactly the lines written up to the
checkpoint the run resumes from (later ones are cut: those executions run again, or come back as
restored records, and are written then), so after a resume it holds every execution closed
before the kill that the summary counts, and each once.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class ExecutionsFile:
    def __init__(self, path: Path, append: bool) -> None:
        """``append``: a resumed run (``restore`` cuts the file); else the file starts empty."""
        self.path = path
        self.written: set[str] = set()
        self.lines = 0
        if not append:
            path.write_text("")

    def restore(self, n_lines: int) -> None:
        """Keep the first ``n_lines`` (the checkpoint's); their executions count as written."""
        try:
            kept = self.path.read_text().splitlines()[:n_lines]
        except FileNotFoundError:
            kept = []
        self.path.write_text("".join(x + "\n" for x in kept))
        self.written = {json.loads(x)["execution"] for x in kept}
        self.lines = len(kept)

    def add(self, lines: list[dict[str, Any]]) -> None:
        """Append the lines of executions not written yet (in their order)."""
        new = [x for x in lines if x["execution"] not in self.written]
        if not new:
            return
        with open(self.path, "a") as fh:
            for line in new:
                fh.write(json.dumps(line) + "\n")
                self.written.add(line["execution"])
        self.lines += len(new)
