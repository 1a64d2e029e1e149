"""gatherlab's Hydra configs: ``conf/<group>/<option>.yaml``, one config group per folder.

This folder is the single copy of the configs. It is the package ``gatherlab.conf`` (setuptools'
``package-dir`` in ``pyproject.toml``), so that an installed wheel carries it as package data and an
editable install maps it to this folder; Hydra reads it as ``pkg://gatherlab.conf`` either way.
This file holds no code: it only makes the folder a package that Python can locate.
"""
