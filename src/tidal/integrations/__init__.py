"""Bridges to other systems: tidal's policies inside verl (``verl``), and verl's released code
loaded for conformance checks (``verl_wheel``, ``verl_conformance``)."""
