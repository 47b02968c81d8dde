"""The cluster simulator: tidal's real control plane driven in virtual time.

In: a scenario (``scenario``: cluster, control settings, workload, engine / trainer speeds,
costs) and policy specs. Out: makespans, utilizations, switch and reroute counts, decision
logs and time series (``runner``), an oracle lower bound (``oracle``).
Pieces: ``world`` (event loop, dispatcher, executions), ``engines`` (processor sharing),
``trainer``, ``actuator`` (plan steps: cost and effect), ``moves`` (reroutes, aborts, KV
holds), ``sync`` (weight publication), ``costs``, ``workloads`` (classes and trace replay),
``invariants`` (checked after every event in tests), ``profiles`` and ``perf`` (the cost model:
GPU and model profiles, decode roofline, trainer passes, link costs), ``published`` and
``calibration`` (published results as a file; the efficiency fit). No scheduling logic lives
here: every decision is made by the ``tidal.control`` objects the world builds with the
factory.
"""
