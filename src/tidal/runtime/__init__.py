"""The elastic runtime on Ray: the only package that imports ``ray``.

In: a validated ``RunConfig``. Out: a real run - engine processes owned by Ray actors (cells and
standalone engines), the proxy, the harness pool, the core trainer and the controller on the
wall clock - and its run directory (resolved config, metrics, decisions, summary).
Modules: ``cell`` (the engine-owning actor), ``actuator`` (plan steps against the proxy and the
actors), ``bridge`` (harness ledger events and proxy records into the controller and the
trajectory buffer), ``driver`` (wiring, bursts, trainer loop, outputs), ``cpuquota`` (per-cell
CPU quotas on a CPU host: cgroups, no Ray).
"""
