"""Subcommands of the ``tidal`` CLI, one module each, discovered by name.

A module ``foo_bar.py`` here becomes ``tidal foo-bar``; it must define ``command`` (a click
command) and import heavy dependencies (torch, ray, matplotlib) inside the command body only,
so that ``tidal --help`` stays fast and works with the base install.
"""
