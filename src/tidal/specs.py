"""How a user names things in a command line or a config, parsed without the control plane
(``tidal.config`` reads these; it never imports ``tidal.control``).

In: a policy spec ``NAME[:k=v,k=v]`` (``tidal run --policy``, ``tidal simulate -p``, a
scenario's ``policies``), or a module spec (a ``path/to/file.py`` or a dotted module name, as in
``policy.module``). Out: the name and its arguments (values become bool, int, float or str; a
malformed argument is a one-line ``ConfigError`` naming ``policy``), or the module spec with a
path made absolute. Whether the name is a registered policy is the control plane's question
(``tidal.control.factory.check_policy``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tidal.errors import ConfigError


def parse_policy_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``NAME[:k=v,k=v]`` -> (name, args). Values become int, float, bool or str."""
    name, _, rest = spec.strip().partition(":")
    args: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in rest.split(","))):
        key, sep, raw = part.partition("=")
        if not sep or not key:
            raise ConfigError("policy", f"bad argument {part!r} in {spec!r} (want key=value)")
        args[key.strip()] = _parse_value(raw.strip())
    return name, args


def _parse_value(raw: str) -> bool | int | float | str:
    low = raw.lower()
    if low in ("true", "yes", "on"):
        return True
    if low in ("false", "no", "off"):
        return False
    for conv in (int, float):
        try:
            return conv(raw)
        except ValueError:
            pass
    return raw


def resolved(where: str) -> str:
    """A ``.py`` path made absolute (a run directory's config then loads from any directory);
    a dotted module name unchanged."""
    return str(Path(where).resolve()) if where.endswith(".py") else where
