"""tidal: elastic GPU scheduling between agent rollout and RL training.

Packages, in data-flow order: ``types``/``config``/``clock``/``errors`` (vocabulary), ``control``
(pure decisions), ``serving``, ``agents``, ``training``, ``runtime`` (the only Ray user), ``sim``,
``viz`` and the ``tidal`` CLI. See DESIGN.md in the shared folder and README.md.
"""

__version__ = "0.1.0"
