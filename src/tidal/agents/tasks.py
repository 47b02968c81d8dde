"""Task rows from the user's data: a local JSONL or Parquet file, a Hugging Face dataset saved
with ``save_to_disk``, or a procedural generator (reasoning-gym's ``create_dataset``, or small
Python repositories with a failing test, ``tidal.agents.swe_repos``).

In: the run config's ``task.source`` (a field mapping: prompt text or chat messages, reference
answer, metadata columns). Out: a list of ``TaskRow``, and ``row_for(rows, seed, burst, group)``:
the row of one GRPO group, in a seeded order that a resumed run reproduces (every execution of a
group gets the same row). Bad input (a missing file, a mapping naming a column the data lacks)
is a ``ConfigError`` naming the field, raised before anything starts.

Every row is checked when the rows load (``tidal check`` and ``tidal run`` alike; generated
sources too: every row is in memory already), nothing coerced: a prompt is text (a null, a
number or a missing column is a mistake, never the text "None"), chat messages are a list of
``{role, content}``, a ``data_source`` is text, a ``workspace_files`` value is a mapping of
relative paths to text and a ``test_command`` a list of strings. Each mistake is one line
naming the row (and the file's line for JSONL) and the column; up to ``MAX_MISTAKES`` lines in
one ``ConfigError`` on ``task.source``. A file that is not UTF-8, a directory where a file is
wanted and an empty file are each one line on ``task.source.path``.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tidal.config import TaskSourceConfig
from tidal.errors import ConfigError
from tidal.seeding import derive_seed

FIELD = "task.source"
MAX_MISTAKES = 20  # lines of row mistakes shown (then how many more)


@dataclass(frozen=True)
class TaskRow:
    """One task: its prompt (text, or chat ``messages``), reference answer and metadata."""

    index: int
    prompt: str | None = None
    messages: list[dict] | None = None
    answer: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)
    data_source: str = ""

    def chat(self, system_prompt: str | None = None) -> list[dict]:
        """The row as chat messages (a system message first when given)."""
        msgs = (
            list(self.messages)
            if self.messages is not None
            else [{"role": "user", "content": self.prompt or ""}]
        )
        if system_prompt and not any(m.get("role") == "system" for m in msgs):
            msgs.insert(0, {"role": "system", "content": system_prompt})
        return msgs

    def text(self) -> str:
        """The prompt as one text (the last user message of a chat row)."""
        if self.prompt is not None:
            return self.prompt
        users = [m.get("content", "") for m in self.messages or [] if m.get("role") == "user"]
        return str(users[-1]) if users else ""

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "prompt": self.prompt,
            "messages": self.messages,
            "answer": self.answer,
            "metadata": self.metadata,
            "data_source": self.data_source,
        }


def load_rows(src: TaskSourceConfig, seed: int) -> list[TaskRow]:
    """Every row of the source (at most ``limit``), mapped; ``ConfigError`` on bad input."""
    if src.kind in ("reasoning_gym", "swe_repos"):  # generated here: checked all the same
        if src.kind == "reasoning_gym":
            rows = _reasoning_gym(src, seed)
        else:
            from tidal.agents.swe_repos import rows as swe_rows

            rows = swe_rows(src.size, seed)
        rows = rows[: src.limit] if src.limit is not None else rows
        mistakes = [m for row in rows for m in row_mistakes(row)]
    else:
        records, where = _records(src)
        if src.limit is not None:
            records, where = records[: src.limit], where[: src.limit]
        rows, mistakes = _mapped(src, records, where)
    _raise(mistakes)
    if not rows:
        raise ConfigError(f"{FIELD}.path", "the source holds no rows")
    return rows


def _raise(mistakes: list[str]) -> None:
    if mistakes:
        more = len(mistakes) - MAX_MISTAKES
        raise ConfigError(
            FIELD,
            f"{len(mistakes)} mistake(s) in the rows:\n  "
            + "\n  ".join(mistakes[:MAX_MISTAKES])
            + (f"\n  ... and {more} more" if more > 0 else ""),
        )


def row_mistakes(row: TaskRow, at: str | None = None, prompt: str | None = "prompt") -> list[str]:
    """What is wrong with one row, one line per mistake naming the row (``at``) and the column
    (``prompt``: the prompt's column, None for a chat row); empty: nothing."""
    at, out = at or f"row {row.index}", []
    if prompt is not None and not isinstance(row.prompt, str):
        out.append(f"{at}: column {prompt!r} is {_kind(row.prompt)}, not text")
    files = row.metadata.get("workspace_files")
    if files is not None:
        if not isinstance(files, dict):
            out.append(
                f"{at}: column 'workspace_files' is {_kind(files)}, not a mapping of "
                "relative paths to text"
            )
        else:
            out += [
                f"{at}: column 'workspace_files': {name!r} is {_kind(text)}, not text"
                for name, text in files.items()
                if not isinstance(text, str)
            ]
            out += [
                f"{at}: column 'workspace_files': {name!r} is not a relative path inside "
                "the workspace"
                for name in files
                if not isinstance(name, str)
                or not name
                or name.startswith("/")
                or ".." in Path(name).parts
            ]
    cmd = row.metadata.get("test_command")
    if cmd is not None and not (
        isinstance(cmd, list) and cmd and all(isinstance(a, str) for a in cmd)
    ):
        out.append(f"{at}: column 'test_command' is {_kind(cmd)}, not a list of strings")
    return out


def _kind(value: object) -> str:
    return "null" if value is None else type(value).__name__


def row_for(
    rows: list[TaskRow], seed: int, burst: int, group: int, groups_per_burst: int
) -> TaskRow:
    """The row of group ``group`` of ``burst``: rows in a seeded order, one epoch after
    another (each epoch reshuffled), so a resumed run gives each group the same row."""
    k = burst * groups_per_burst + group
    epoch, at = divmod(k, len(rows))
    order = list(range(len(rows)))
    random.Random(derive_seed("task order", seed, epoch)).shuffle(order)
    return rows[order[at]]


def _records(src: TaskSourceConfig) -> tuple[list[dict[str, Any]], list[str]]:
    """The source's records and where each is (``row i``, and the line of a JSONL file)."""
    if src.path is None:
        raise ConfigError(f"{FIELD}.path", f"a '{src.kind}' source needs a path")
    path = Path(src.path)
    if not path.exists():
        raise ConfigError(f"{FIELD}.path", f"{path}: no such file or directory")
    if src.kind == "jsonl":
        return _jsonl(path)
    if src.kind == "parquet":
        import pyarrow.parquet as pq

        try:
            records = pq.read_table(path).to_pylist()
        except Exception as exc:  # pyarrow's errors carry no common base
            raise ConfigError(
                f"{FIELD}.path", f"{path}: not a Parquet file ({str(exc).splitlines()[0][:120]})"
            ) from None
    else:
        records = _disk(path, src.split)
    if not records:
        raise ConfigError(f"{FIELD}.path", f"{path}: holds no rows (an empty table)")
    return records, [f"row {i}" for i in range(len(records))]


def _jsonl(path: Path) -> tuple[list[dict[str, Any]], list[str]]:
    if path.is_dir():
        raise ConfigError(f"{FIELD}.path", f"{path}: a directory, not a JSONL file")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{FIELD}.path", f"{path}: cannot read: {exc.strerror}") from None
    out, where = [], []
    for n, raw in enumerate(data.splitlines(), 1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ConfigError(
                f"{FIELD}.path",
                f"{path}:{n}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at column "
                f"{exc.start + 1})",
            ) from None
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{FIELD}.path", f"{path}:{n}: not JSON ({exc.msg})") from None
        if not isinstance(rec, dict):
            raise ConfigError(f"{FIELD}.path", f"{path}:{n}: a line must be a JSON object")
        where.append(f"row {len(out)} ({path.name}:{n})")
        out.append(rec)
    if not out:
        raise ConfigError(
            f"{FIELD}.path",
            f"{path}: holds no rows (an empty file: one JSON object per line expected)",
        )
    return out, where


def _disk(path: Path, split: str | None) -> list[dict[str, Any]]:
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError) as exc:
        raise ConfigError(
            f"{FIELD}.path", f"{path}: not a saved dataset ({str(exc).splitlines()[0][:120]})"
        ) from None
    if isinstance(ds, datasets.DatasetDict):
        if split is None or split not in ds:
            raise ConfigError(
                f"{FIELD}.split",
                f"{path} holds splits {sorted(ds)}: name one"
                + (f" ({split!r} is not among them)" if split else ""),
            )
        ds = ds[split]
    elif split is not None:
        raise ConfigError(f"{FIELD}.split", f"{path} is one dataset, not a DatasetDict")
    return ds.to_list()


def _mapped(
    src: TaskSourceConfig, records: list[dict[str, Any]], where: list[str]
) -> tuple[list[TaskRow], list[str]]:
    """The rows, and one line per mistake (a row missing the prompt column, a null or
    non-text prompt, messages that are not chat messages, a non-text data source)."""
    if (src.prompt is None) == (src.messages is None):
        raise ConfigError(
            f"{FIELD}.prompt",
            "map exactly one of prompt (a text column) and messages (a chat-messages column)",
        )
    columns = {c: None for rec in records for c in rec}  # every row's, in order
    named = {
        "prompt": src.prompt,
        "messages": src.messages,
        "answer": src.answer,
        "data_source": src.data_source,
    }
    for key, col in [
        *named.items(),
        *((f"metadata.{i}", c) for i, c in enumerate(src.metadata or [])),
    ]:
        if col is not None and col not in columns:
            raise ConfigError(
                f"{FIELD}.{key}",
                f"no column {col!r} in {src.path} (columns: {', '.join(sorted(columns))})",
            )
    ds_col = src.data_source or ("data_source" if "data_source" in columns else None)
    used = {c for c in named.values() if c} | ({ds_col} if ds_col else set())
    meta_cols = src.metadata if src.metadata is not None else sorted(set(columns) - used)
    rows, mistakes = [], []
    for i, rec in enumerate(records):
        at = where[i]
        missing = [c for c in (src.prompt, src.messages) if c is not None and c not in rec]
        mistakes += [f"{at}: no column {c!r}" for c in missing]
        msgs = rec.get(src.messages) if src.messages else None
        if src.messages and not missing and not _is_chat(msgs):
            mistakes.append(
                f"{at}: column {src.messages!r} is not a list of {{role, content}} messages"
            )
        source = rec.get(ds_col) if ds_col else src.kind
        if not isinstance(source, str):
            mistakes.append(f"{at}: column {ds_col!r} is {_kind(source)}, not text")
        row = TaskRow(
            i,
            prompt=None if src.prompt is None else rec.get(src.prompt),
            messages=msgs,
            answer=rec.get(src.answer) if src.answer else None,
            metadata={c: rec.get(c) for c in meta_cols},
            data_source=source if isinstance(source, str) else "",
        )
        mistakes += row_mistakes(row, at, src.prompt) if not missing else []
        rows.append(row)
    return rows, mistakes


def _is_chat(value: object) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(m, dict) and "role" in m and "content" in m for m in value)
    )


def _reasoning_gym(src: TaskSourceConfig, seed: int) -> list[TaskRow]:
    import reasoning_gym

    if not src.name:
        raise ConfigError(
            f"{FIELD}.name", "a 'reasoning_gym' source needs a dataset name, e.g. basic_arithmetic"
        )
    try:
        ds = reasoning_gym.create_dataset(src.name, size=src.size, seed=seed, **src.args)
    except Exception as exc:  # unknown name or config: reasoning-gym raises plain errors
        raise ConfigError(
            f"{FIELD}.name"
            if "not registered" in str(exc) or "not found" in str(exc).lower()
            else f"{FIELD}.args",
            f"reasoning-gym {src.name!r}: {str(exc).splitlines()[0][:160]}",
        ) from None
    return [
        TaskRow(
            i, prompt=e["question"], answer=e["answer"], metadata={"entry": e}, data_source=src.name
        )
        for i, e in enumerate(ds)
    ]
