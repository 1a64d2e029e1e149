"""Run and sweep files loaded into pandas (`gatherlab.analysis.results`, whose public names this
module holds): ``load_sweep``, ``load_run``, ``load_runs``, ``load_comparison``,
``newest_sweep``."""

from gatherlab.analysis.results import *  # noqa: F403
from gatherlab.analysis.results import __all__  # noqa: F401
