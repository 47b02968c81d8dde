"""The type of a JSON value as ``json.loads`` returns it (for annotations only)."""

from __future__ import annotations

from typing import Union

JSONScalar = str | int | float | bool | None
JSON = Union[JSONScalar, list["JSON"], dict[str, "JSON"]]  # noqa: UP007 (recursive alias)
