"""gatherlab's Hydra sweeper (``hydra/sweeper=gatherlab``, the default of conf/config.yaml).

Hydra finds plugins in the ``hydra_plugins`` namespace package and imports each one whenever any
Hydra application starts, so this package imports Hydra and OmegaConf only.
"""
