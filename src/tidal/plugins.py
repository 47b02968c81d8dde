"""The user's policies: a module named in a config (``policy.module``: a dotted module, or a
``path/to/file.py`` loaded by path) or installed as an entry point (group ``tidal.policies``);
importing one runs its ``register_policy`` calls. The loading itself is
``tidal.user_modules`` (engine backends load through it too: ``tidal.backends``).

In: module specs and the dotted config field they came from. Out: the policies registered, or
a one-line ``ConfigError`` naming the field (a missing file, a module that does not import, a
policy declaring no mechanics); a module refused part-way registers nothing. An entry point
that fails is named where its policy is asked for (``broken_plugins``).
"""

from __future__ import annotations

from tidal.specs import resolved as resolved  # re-exported: callers import it from here
from tidal.user_modules import broken_plugins as _broken
from tidal.user_modules import load_registering

POLICY_GROUP = "tidal.policies"


def load_policies(modules: list[str] | tuple[str, ...] = (), field: str = "policy.module") -> None:
    """The ``tidal.policies`` entry points (once), then each of ``modules``. A module refused
    part-way leaves none of its policies registered (fixed, it loads again)."""
    from tidal.control.policy import registered, unregister_policy

    load_registering(POLICY_GROUP, modules, field, registered, unregister_policy)


def broken_plugins(group: str = POLICY_GROUP) -> dict[str, str]:
    """Entry point name -> why it did not load, for ``group`` (the policies' by default)."""
    return _broken(group)
